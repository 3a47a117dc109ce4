"""The asyncio engine loop: an engine failure ends every open stream with an error, never a hang."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.async_engine import AsyncLLMEngine
from swaserve.engine.types import SamplingParams


async def _collect(engine: AsyncLLMEngine, rid: str, n: int = 5) -> list[int]:
    out: list[int] = []
    async for o in engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=n, temperature=0.0), rid):
        out.extend(o.new_token_ids)
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_failing_step_fails_streams_and_engine_keeps_serving(
    tiny_dir: Path, anyio_backend: str
) -> None:
    engine = AsyncLLMEngine.from_model_dir(tiny_dir, EngineConfig(page_size=4, kv_cache_memory=1 << 20))
    await engine.start()
    try:
        real_step = engine.engine.step
        calls = {"n": 0}

        def broken_step():  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected")
            return real_step()

        engine.engine.step = broken_step  # type: ignore[method-assign]
        results = await asyncio.wait_for(
            asyncio.gather(_collect(engine, "a", 20), _collect(engine, "b", 20), return_exceptions=True), 30
        )
        assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results), results
        assert engine.stats().pools["full"].request_pages == 0
        assert len(await asyncio.wait_for(_collect(engine, "c"), 30)) == 5  # still serving
        assert engine.running
    finally:
        await engine.stop()

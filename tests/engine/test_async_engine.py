"""The asyncio engine loop: an engine failure ends every open stream with an error, never a hang;
a step runs off the loop (the loop serves meanwhile) and one that hangs marks the engine dead."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.async_engine import AsyncLLMEngine
from swaserve.engine.client import EngineDead
from swaserve.engine.types import RequestOutput, SamplingParams


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


class HeldStep:
    """Wraps ``engine.engine.step``: the first call waits (on its thread) until ``release``;
    ``entered`` is set when it starts waiting, ``returned`` when that step has returned."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()
        self._real, self._held = engine.engine.step, False
        engine.engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> list[RequestOutput]:
        if self._held:
            return self._real()
        self._held = True
        self.entered.set()
        self.release.wait(60)  # a guard: the test releases it
        try:
            return self._real()
        finally:
            self.returned.set()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_loop_serves_while_a_step_runs(tiny_dir: Path, anyio_backend: str) -> None:
    """A step runs off the event loop: while one is in progress, other coroutines (gRPC GetLoad,
    /health, aborts) run and ``stats`` answers with the load as that step began."""
    engine = AsyncLLMEngine.from_model_dir(tiny_dir, EngineConfig(page_size=4, kv_cache_memory=1 << 20))
    await engine.start()
    try:
        before = engine.stats().steps_total
        held = HeldStep(engine)
        task = asyncio.create_task(_collect(engine, "long", 3))
        assert await asyncio.to_thread(held.entered.wait, 30)
        await asyncio.sleep(0)  # the loop runs other work now
        during = engine.stats()
        in_step = not held.returned.is_set()
        held.release.set()
        assert in_step, "the loop waited for the step"
        assert (during.num_running + during.num_waiting, during.prefill_tokens, during.steps_total) == (
            1,
            4,
            before,
        )
        assert len(await asyncio.wait_for(task, 30)) == 3
        assert engine.stats().steps_total == before + 3
        assert engine.stats().computed_tokens_total >= 4 + 2
    finally:
        await engine.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_hung_step_marks_the_engine_dead(tiny_dir: Path, anyio_backend: str) -> None:
    """A step that runs past ``engine_step_timeout``: its streams end with ``EngineDead``, the
    engine stops accepting requests and ``on_dead`` is called (the worker and ``serve`` exit 1,
    so routers mark the worker down), as for a separate core that hangs."""
    dead: list[str] = []
    cfg = EngineConfig(page_size=4, kv_cache_memory=1 << 20, engine_step_timeout=0.5)
    engine = AsyncLLMEngine.from_model_dir(tiny_dir, cfg, on_dead=dead.append)
    await engine.start()
    held = HeldStep(engine)
    try:
        with pytest.raises(EngineDead, match="hung"):
            await asyncio.wait_for(_collect(engine, "on-a-hung-step", 3), 30)
        assert dead and "hung" in dead[0] and isinstance(engine.unavailable(), EngineDead)
        assert not engine.running and engine.stats().prefill_tokens == 4  # the snapshot: never waits
        with pytest.raises(EngineDead):
            await _collect(engine, "after")
    finally:
        held.release.set()
        await engine.stop()

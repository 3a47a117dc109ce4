"""Expert parallelism on CUDA (NCCL, rank r on GPU r): untested here (no GPU); runs when a
machine with at least two GPUs is lent. Greedy tokens of EP = 2 on the GPUs equal one CPU engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from swaserve.config import EngineConfig
from swaserve.engine.ep_client import EPEngineClient
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL: one rank per GPU)"),
]


def test_ep2_over_nccl_equals_cpu(tiny_dir: Path) -> None:
    prompts = [[5 + i, 9, 13, 200 + i, 7] * (3 + i) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = dict(page_size=4, max_num_batched_tokens=16, kv_cache_memory=16 << 20)
    want = LLMEngine(str(tiny_dir), EngineConfig(**base, device="cpu")).generate(prompts, params)  # type: ignore[arg-type]

    async def run() -> list[list[int]]:
        c = EPEngineClient(tiny_dir, EngineConfig(**base, device="cuda", ep_size=2))  # type: ignore[arg-type]
        await c.start()
        try:

            async def one(i: int, p: list[int]) -> list[int]:
                out: list[int] = []
                async for o in c.generate(p, params, f"r{i}"):
                    out += o.new_token_ids
                return out

            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            ep = c.stats().ep
            assert ep is not None and all(0 < b <= 1 for b in ep.balance())
            return got
        finally:
            await c.stop()

    assert asyncio.run(run()) == want

"""Quantized KV pages through the disaggregated cluster (tiny checkpoint, W = 8): a router, one
prefill and one decode worker with ``--kv-cache-dtype int8 --kv-cache-dtype-swa fp8_e4m3``. The
decode worker continues from the prefill worker's packed pages: greedy outputs equal one engine
with the same formats; ``/workers`` and the workers' ``/metrics`` name the format."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.launcher import Cluster
from tests.helpers.cluster import WORKER_ARGS, scrape, wait_idle, workers
from tests.services.test_cluster import NEW, complete_all, prompts

pytestmark = pytest.mark.cluster  # starts router and workers (``Cluster``) as child processes

QUANT = ["--kv-cache-dtype", "int8", "--kv-cache-dtype-swa", "fp8_e4m3"]
LABEL = "float32 full=int8/g0/scale=f32-after-data swa=fp8_e4m3/g0/scale=f32-after-data"


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(tiny_dir, prefill=1, decode=1, worker_args=[*WORKER_ARGS, *QUANT])
    try:
        c.start(timeout_s=300)
        yield c
    finally:
        c.stop()


def test_quantized_pd_equals_one_engine_and_names_its_format(cluster: Cluster, tiny_dir: Path) -> None:
    ps = prompts(6, seed=3)
    got = asyncio.run(complete_all(cluster.url, ps))
    cfg = EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4,
                       kv_cache_dtype="int8", kv_cache_dtype_swa="fp8_e4m3")  # fmt: skip
    want = LLMEngine(str(tiny_dir), cfg).generate(
        ps, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    )
    for r, w in zip(got, want, strict=True):
        assert r["choices"][0]["token_ids"] == w
    ws = workers(cluster.url)
    assert len(ws) == 2 and {w["kv_format"] for w in ws.values()} == {LABEL}, ws
    wait_idle(cluster)
    m = scrape(cluster.metrics_urls["decode-0"])
    token_bytes = {
        (dict(labels)["pool"], dict(labels)["format"]): v
        for (name, labels), v in m.items()
        if name == "swaserve:kv_cache_token_bytes" and dict(labels)["role"] == "decode"
    }
    full = token_bytes[("full", "int8/g0/scale=f32-after-data")]
    swa = token_bytes[("swa", "fp8_e4m3/g0/scale=f32-after-data")]
    from swaserve.config import ModelConfig

    mc = ModelConfig.from_pretrained(tiny_dir)
    assert full == len(mc.full_layers) * mc.full.num_kv_heads * (
        mc.full.head_dim + 4 + mc.full.v_head_dim + 4
    )
    assert swa == len(mc.swa_layers) * mc.swa.num_kv_heads * (mc.swa.head_dim + 4 + mc.swa.v_head_dim + 4)

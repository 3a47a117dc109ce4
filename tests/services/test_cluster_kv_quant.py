"""Quantized KV pages through the disaggregated cluster (tiny checkpoint, W = 8): a router, one
prefill and one decode worker with ``--kv-cache-dtype int8 --kv-cache-dtype-swa fp8_e4m3``, then
with ``kivi2``. The first also keeps 2 sink tokens in full precision (``--kv-sink-tokens``). The
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

# per case: worker flags, the engine config, each pool's format name, the label /workers shows
CASES = {
    # with sink tokens: the decode worker computes the first 2 tokens' full-precision K/V itself
    "int8-fp8-sink2": (
        ["--kv-cache-dtype", "int8", "--kv-cache-dtype-swa", "fp8_e4m3", "--kv-sink-tokens", "2"],
        {"kv_cache_dtype": "int8", "kv_cache_dtype_swa": "fp8_e4m3", "kv_sink_tokens": 2},
        ("int8/g0/scale=f32-after-data/sink2", "fp8_e4m3/g0/scale=f32-after-data"),
    ),
    "kivi2": (
        ["--kv-cache-dtype", "kivi2"],
        {"kv_cache_dtype": "kivi2"},
        ("kivi2/g0/kg4/r8/scale-zero=f16", "auto"),
    ),
}


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, marks=pytest.mark.slow) if c == "kivi2" else c for c in CASES],
)
def cluster(request, tiny_dir: Path) -> Iterator[tuple[Cluster, str]]:  # type: ignore[no-untyped-def]
    c = Cluster(tiny_dir, prefill=1, decode=1, worker_args=[*WORKER_ARGS, *CASES[request.param][0]])
    try:
        c.start(timeout_s=300)
        yield c, request.param
    finally:
        c.stop()


def test_quantized_pd_equals_one_engine_and_names_its_format(
    cluster: tuple[Cluster, str], tiny_dir: Path
) -> None:
    """KIVI: the residuals travel as SWA layers, so the decode worker reads the last R tokens of
    the prompt in full precision as the one engine does."""
    c, case = cluster
    _, engine_flags, (full_fmt, swa_fmt) = CASES[case]
    ps = prompts(6, seed=3)
    got = asyncio.run(complete_all(c.url, ps))
    cfg = EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4, **engine_flags)  # type: ignore[arg-type]
    want = LLMEngine(str(tiny_dir), cfg).generate(
        ps, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    )
    for r, w in zip(got, want, strict=True):
        assert r["choices"][0]["token_ids"] == w
    ws = workers(c.url)
    assert len(ws) == 2 and {w["kv_format"] for w in ws.values()} == {
        f"float32 full={full_fmt} swa={swa_fmt} page=4"
    }, ws
    wait_idle(c)
    m = scrape(c.metrics_urls["decode-0"])
    token_bytes = {
        (dict(labels)["pool"], dict(labels)["format"]): v
        for (name, labels), v in m.items()
        if name == "swaserve:kv_cache_token_bytes" and dict(labels)["role"] == "decode"
    }
    full, swa = token_bytes[("full", full_fmt)], token_bytes[("swa", swa_fmt)]
    from swaserve.config import ModelConfig

    mc = ModelConfig.from_pretrained(tiny_dir)
    f, s = mc.full, mc.swa
    if case == "kivi2":  # 2-bit codes; a key group's fp16 scale/zero over its 4 rows, one per value row
        assert full == len(mc.full_layers) * f.num_kv_heads * (
            f.head_dim // 4 + 4 * f.head_dim // 4 + f.v_head_dim // 4 + 4
        )
        # the SWA layers and one residual per full layer, float32
        assert (
            swa
            == (len(mc.swa_layers) + len(mc.full_layers)) * s.num_kv_heads * (s.head_dim + s.v_head_dim) * 4
        )
    else:
        assert full == len(mc.full_layers) * f.num_kv_heads * (f.head_dim + 4 + f.v_head_dim + 4)
        assert swa == len(mc.swa_layers) * s.num_kv_heads * (s.head_dim + 4 + s.v_head_dim + 4)

"""MTP speculative decoding through ``swaserve up`` (router + prefill + decode worker processes) on
the tiny target with 3 MTP layers: the prefill worker sends the MTP KV, hidden states and first
drafts with the KV; greedy and seeded outputs equal one engine without MTP; stop strings cut the
same way; the decode worker counts its verify steps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.launcher import Cluster
from swaserve.model.checkpoint import make_checkpoint
from tests.helpers.cluster import MODEL, WORKER_ARGS, scrape
from tests.services.test_cluster import complete_all, prompts

pytestmark = pytest.mark.cluster

NEW = 24


@pytest.fixture(scope="module")
def mtp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    model = make_checkpoint("tiny", tmp_path_factory.mktemp("mtp") / MODEL, mtp_layers=3)
    c = Cluster(
        model,
        prefill=1,
        decode=1,
        worker_args=[*WORKER_ARGS, "--speculative-num-steps", "3"],
        router_args=["--request-timeout", "60"],
        redis=False,
    )
    try:
        c.start(timeout_s=300)
        yield c, model
    finally:
        c.stop()


def test_mtp_through_the_cluster_equals_one_engine_without_it(mtp_cluster: tuple[Cluster, Path], tiny_dir: Path) -> None:  # fmt: skip
    cluster, _ = mtp_cluster
    ps = prompts(6, seed=4)
    got = asyncio.run(complete_all(cluster.url, ps, NEW))
    eng = LLMEngine(
        str(tiny_dir), EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4)
    )
    want = eng.generate(ps, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert [r["choices"][0]["token_ids"] for r in got] == want
    seeded = {"model": MODEL, "prompt": ps[1], "max_tokens": NEW, "temperature": 0.9, "seed": 7,
              "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{cluster.url}/v1/completions", json=seeded, timeout=60)
    assert r.status_code == 200, r.text
    sp = SamplingParams(max_tokens=NEW, temperature=0.9, seed=7, ignore_eos=True)
    assert r.json()["choices"][0]["token_ids"] == eng.generate([ps[1]], sp)[0]
    text = httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": ps[2], "max_tokens": NEW, "temperature": 0},
    ).json()
    stop = text["choices"][0]["text"][5:8]
    cut = httpx.post(
        f"{cluster.url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": ps[2], "max_tokens": NEW, "temperature": 0, "stop": [stop]},
    ).json()
    one = LLMEngine(str(tiny_dir), EngineConfig(page_size=4, kv_cache_memory=16 << 20))
    one.add_request("s", ps[2], SamplingParams(max_tokens=NEW, temperature=0.0, stop=(stop,)))
    ref_text, ref_usage = "", 0
    while one.has_unfinished():
        for o in one.step():
            ref_text += o.new_text
            ref_usage = o.completion_tokens
    assert cut["choices"][0]["text"] == ref_text and cut["usage"]["completion_tokens"] == ref_usage
    assert cut["choices"][0]["finish_reason"] == "stop"
    decode = next(u for name, u in cluster.metrics_urls.items() if name.startswith("decode"))
    samples = scrape(decode.removesuffix("/metrics"))
    drafts = sum(v for (n, _), v in samples.items() if n == "swaserve:spec_decode_num_drafts_total")
    assert drafts > 0

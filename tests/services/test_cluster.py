"""The disaggregated cluster as separate processes (``swaserve up``'s ``Cluster``) on the tiny
checkpoint (W = 8): router + 2 prefill + 2 decode workers on 127.0.0.1.

Tests run in file order on one cluster; the fault tests (killing workers) come last.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.launcher import Cluster
from swaserve.transfer.kv_transfer import KVPayload, to_pages
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc
from tests.helpers.cluster import WORKER_ARGS, scrape, value, wait_idle

pytestmark = pytest.mark.cluster  # starts router and workers (``Cluster``) as child processes

NEW = 10


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir, prefill=2, decode=2, worker_args=WORKER_ARGS, router_args=["--request-timeout", "60"]
    )
    try:
        c.start(timeout_s=300)
        yield c
    finally:
        c.stop()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    stem = [rng.randrange(3, 500) for _ in range(19)]
    return [
        (stem if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 45))]
        for i in range(n)
    ]


async def complete_all(url: str, ps: list[list[int]], max_tokens: int = NEW) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(p: list[int]) -> dict:
            body = {
                "model": "mimo-v2-tiny-v2", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 1,
            }  # fmt: skip
            r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(p) for p in ps))


def test_outputs_equal_single_engine_and_transformers(cluster: Cluster, tiny_dir: Path, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(8)
    got = asyncio.run(complete_all(cluster.url, ps))
    eng = LLMEngine(
        str(tiny_dir), EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4)
    )
    want = eng.generate(ps, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    for r, w in zip(got, want, strict=True):
        assert r["choices"][0]["token_ids"] == w
        assert r["usage"]["completion_tokens"] == NEW
    seeded = {"model": "mimo-v2-tiny-v2", "prompt": ps[1], "max_tokens": NEW, "temperature": 0.9,
              "seed": 2**63 + 11, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{cluster.url}/v1/completions", json=seeded, timeout=60)
    assert r.status_code == 200, r.text
    sp = SamplingParams(max_tokens=NEW, temperature=0.9, seed=2**63 + 11, ignore_eos=True)
    assert r.json()["choices"][0]["token_ids"] == eng.generate([ps[1]], sp)[0]
    import torch

    for p, w in list(zip(ps, want, strict=True))[:2]:
        ids = torch.tensor([p])
        ref = hf_tiny.generate(ids, max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids))
        assert ref[0, len(p) :].tolist() == w
    wait_idle(cluster)


def test_kv_bytes_are_full_prompt_plus_swa_window(cluster: Cluster, tiny_dir: Path) -> None:
    from swaserve.config import ModelConfig

    def sent() -> float:
        total = 0.0
        for name, url in cluster.metrics_urls.items():
            if name.startswith("prefill") and cluster.services[name].alive():
                for line in httpx.get(url).text.splitlines():
                    if line.startswith("swaserve:kv_transfer_sent_bytes_total"):
                        total += float(line.split()[-1])
        return total

    m = ModelConfig.from_pretrained(tiny_dir)
    full_tok = len(m.full_layers) * m.full.num_kv_heads * (m.full.head_dim + m.full.v_head_dim) * 4
    swa_tok = len(m.swa_layers) * m.swa.num_kv_heads * (m.swa.head_dim + m.swa.v_head_dim) * 4
    before = sent()
    ps = prompts(5, seed=1)
    asyncio.run(complete_all(cluster.url, ps))
    assert sent() - before == sum(len(p) * full_tok + min(len(p), m.window) * swa_tok for p in ps)


def test_client_disconnect_frees_pages_on_both_workers(cluster: Cluster) -> None:
    body = {"model": "mimo-v2-tiny-v2", "prompt": prompts(1, 3)[0], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    for leave_after in (5, 1, 1, 1, 1):  # mid-decode, and right after the first token (KV in flight)
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data:")
                if n >= leave_after:
                    break  # leave mid-stream
    wait_idle(cluster)  # no request, no request page and nothing staged on any worker


def test_bad_checksum_is_never_decoded(cluster: Cluster) -> None:
    addr = cluster.worker_addresses["decode"][0]
    import torch

    payload = KVPayload("corrupt-1", 6, 8)
    payload.kv = {
        "full": [(torch.ones(6, 1, 16), torch.ones(6, 1, 16))],
    }
    pages = list(to_pages(payload, 4))
    msgs = [
        kvpb.TransferMessage(header=kvpb.TransferHeader(request_id="corrupt-1", num_tokens=6, num_pages=99))
    ]
    for pg in pages:
        msgs.append(kvpb.TransferMessage(page=kvpb.KVPage(
            request_id=pg.request_id, kind=pg.kind, layer=pg.layer, token_start=pg.token_start, token_end=pg.token_end,
            page_size=pg.page_size, dtype=pg.dtype, k_shape=list(pg.k_shape), v_shape=list(pg.v_shape),
            k=pg.k, v=pg.v, checksum=pg.checksum ^ 1)))  # fmt: skip
    with grpc.insecure_channel(addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            kvgrpc.KVTransferStub(ch).Push(iter(msgs), timeout=10)
        assert e.value.code() in (grpc.StatusCode.DATA_LOSS,)
        req = pb.GenerateRequest(request_id="corrupt-1", prompt_token_ids=[5] * 6, first_token=7,
                                 sampling=pb.SamplingParams(max_tokens=3, top_p=1.0, repetition_penalty=1.0))  # fmt: skip
        with pytest.raises(grpc.RpcError) as e2:
            list(wgrpc.WorkerStub(ch).Generate(req, timeout=10))
        assert e2.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no KV staged" in e2.value.details()
    wait_idle(cluster)


# ---------------------------------------------------------------------------------------------
# SSE chunks: the same shape as `swaserve serve`


def test_openai_client_through_the_cluster(cluster: Cluster, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    """The official (sync) openai client through the router: echo logprobs computed by a prefill
    worker equal transformers', n greedy choices equal one request, batched prompts, logit_bias,
    max_tokens 0, prompt_logprobs over gRPC."""
    import platform

    import openai
    import torch

    from tests.helpers.engine import reference_logits

    platform.processor()  # the client's headers run `uname -p`; once, before it is needed
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = "mimo-v2-tiny-v2"
    ids = [7, 19, 44, 301, 12, 9, 250, 77, 3, 18, 120, 64]
    ref = torch.log_softmax(reference_logits(hf_tiny, ids), dim=-1)
    for max_tokens in (0, 1):
        r = client.completions.create(
            model=model, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
        )
        lp = r.choices[0].logprobs
        assert (
            lp is not None
            and lp.token_logprobs[0] is None
            and len(lp.token_logprobs) == len(ids) + max_tokens
        )
        assert max(abs(lp.token_logprobs[q] - ref[q - 1, ids[q]].item()) for q in range(1, len(ids))) <= 1e-4
    one = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    many = client.completions.create(model=model, prompt=[ids, ids[:5]], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    assert many.choices[2].text == many.choices[3].text
    forced = client.completions.create(
        model=model, prompt=ids, max_tokens=4, temperature=0, logit_bias={"42": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert forced.choices[0].model_extra["token_ids"] == [42] * 4  # type: ignore[index]
    plp = client.completions.create(model=model, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = plp.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert entries[0] is None and abs(entries[1][str(ids[1])]["logprob"] - ref[0, ids[1]].item()) <= 1e-4
    wait_idle(cluster)


def _sse(text: str, drop_cached: bool = False) -> list[Any]:
    """The data payloads of an SSE body without ids and timestamps (and without the prompt-cache
    count where the two servers' cache histories differ)."""
    events: list[Any] = []
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            events.append(data)
            continue
        ev = {k: v for k, v in json.loads(data).items() if k not in ("id", "created")}
        if drop_cached and ev.get("usage"):
            ev["usage"]["prompt_tokens_details"] = None
        events.append(ev)
    return events


def test_sse_chunks_equal_serve(cluster: Cluster, tiny_dir: Path) -> None:
    import random

    from swaserve.api.server import build_app
    from swaserve.engine.async_engine import AsyncLLMEngine

    rng = random.Random(11)
    ps = [[rng.randrange(3, 500) for _ in range(rng.randrange(6, 40))] for _ in range(6)]
    model = "mimo-v2-tiny-v2"
    base = {"model": model, "temperature": 0, "stream": True}
    usage = {"stream_options": {"include_usage": True}}

    def chat(i: int) -> list[dict[str, str]]:
        words = " ".join(rng.choice(["files", "open", "agent", "the", "list", "read"]) for _ in range(6))
        return [{"role": "user", "content": f"case {i}: {words}"}]

    async def run() -> None:
        engine = AsyncLLMEngine.from_model_dir(
            str(tiny_dir), EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4)
        )
        app = build_app(engine)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://serve", timeout=120
            ) as s,
            httpx.AsyncClient(base_url=cluster.url, timeout=120) as c,
        ):
            r = await s.post("/v1/completions", json={**base, "stream": False, "prompt": ps[5], "max_tokens": NEW,
                                                      "ignore_eos": True})  # fmt: skip
            text = r.json()["choices"][0]["text"]
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            assert stop.strip(), text
            cases = [
                ("/v1/completions", {"prompt": ps[0], "max_tokens": 1}),
                ("/v1/completions", {"prompt": ps[1], "max_tokens": 1, **usage}),
                ("/v1/completions", {"prompt": ps[2], "max_tokens": NEW, "ignore_eos": True,
                                     "return_token_ids": True, **usage}),
                ("/v1/completions", {"prompt": ps[3], "max_tokens": NEW}),
                ("/v1/completions", {"prompt": ps[5], "max_tokens": NEW, "ignore_eos": True, "stop": [stop],
                                     **usage}),
                ("/v1/chat/completions", {"messages": chat(0), "max_tokens": 1, **usage}),
                ("/v1/chat/completions", {"messages": chat(1), "max_tokens": 6, "ignore_eos": True}),
            ]  # fmt: skip
            for path, body in cases:
                want, got = (
                    await s.post(path, json={**base, **body}),
                    await c.post(path, json={**base, **body}),
                )
                assert want.status_code == got.status_code == 200, (want.text, got.text)
                is_chat = "messages" in body
                # serve saw ps[5] above (its prompt is cached there since its prefill), the cluster did not
                drop = is_chat or body.get("prompt") is ps[5]
                assert _sse(got.text, drop) == _sse(want.text, drop), body
                chunks = [e for e in _sse(want.text) if e != "[DONE]" and e["choices"]]
                reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
                assert reasons[-1] in ("stop", "length") and not any(reasons[:-1]), reasons
                if body["max_tokens"] == 1 and not is_chat:
                    assert len(chunks) == 1  # the one token and its finish reason together
            plain = {k: v for k, v in cases[4][1].items() if k != "stream_options"}  # 400 without stream
            stopped = await c.post("/v1/completions", json={**base, **plain, "stream": False})
            assert stopped.status_code == 200, stopped.text
            assert stopped.json()["choices"][0]["finish_reason"] == "stop"  # it did stop on the string

    asyncio.run(run())
    wait_idle(cluster)


# ---------------------------------------------------------------------------------------------
# Router /metrics


def test_router_metrics_count_tokens_and_show_worker_loads(cluster: Cluster) -> None:
    wait_idle(cluster)
    before = scrape(cluster.url)
    ps = prompts(4, seed=21)
    got = asyncio.run(complete_all(cluster.url, ps))
    after = scrape(cluster.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("swaserve:prompt_tokens_total") == sum(len(p) for p in ps)
    assert (
        delta("swaserve:generation_tokens_total")
        == sum(r["usage"]["completion_tokens"] for r in got)
        == 4 * NEW
    )
    assert delta("swaserve:prefix_cache_queries_total") == sum(len(p) for p in ps)
    assert delta("swaserve:prefix_cache_hits_total", tier="device") == sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in got
    )
    assert delta("swaserve:router_requests_total", status="ok") == 4
    assert delta("swaserve:request_success_total", finished_reason="length") == 4
    assert value(after, "swaserve:router_retries_total", reason="overloaded") == 0

    # per-worker gauges are the workers' own GetLoad (as of the router's last poll)
    ls = wait_idle(cluster)
    want = {
        (role, a): _expected_view(ls[f"{role}-{i}"])
        for role, addrs in cluster.worker_addresses.items()
        for i, a in enumerate(addrs)
    }
    deadline = time.monotonic() + 30
    while True:
        m = scrape(cluster.url)
        seen = {(role, a): _worker_view(m, role, a) for role, a in want}
        if seen == want:
            break
        assert time.monotonic() < deadline, (seen, want)
        time.sleep(0.5)
    assert any(
        v[("full", "kv_cache_peak_used_pages")] > 0 for (role, _), v in seen.items() if role == "prefill"
    )


_GAUGES = ("kv_cache_total_pages", "kv_cache_used_pages", "kv_cache_peak_used_pages", "kv_cache_usage_perc")


def _worker_view(
    m: dict[tuple[str, frozenset[tuple[str, str]]], float], role: str, addr: str
) -> dict[Any, Any]:
    """What the router's /metrics says about one worker."""
    w = {"role": role, "worker": addr}
    view: dict[Any, Any] = {
        g: value(m, f"swaserve:{g}", **w) if (f"swaserve:{g}", frozenset({"model_name": "mimo-v2-tiny-v2", **w}.items())) in m else None
        for g in ("worker_up", "worker_num_requests_running", "worker_num_requests_waiting",
                  "worker_outstanding_tokens", "worker_kv_staged_bytes")
    }  # fmt: skip
    for pool in ("full", "swa"):
        for g in _GAUGES:
            view[(pool, g)] = value(m, f"swaserve:{g}", pool=pool, **w)
    return view


def _expected_view(load: pb.Load) -> dict[Any, Any]:
    view: dict[Any, Any] = {
        "worker_up": 1, "worker_num_requests_running": load.running, "worker_num_requests_waiting": load.waiting,
        "worker_outstanding_tokens": load.outstanding_tokens, "worker_kv_staged_bytes": load.staged_bytes,
    }  # fmt: skip
    for pool, p in load.pools.items():
        values = (p.total_pages, p.used_pages, p.peak_used_pages, p.used_pages / p.total_pages)
        view.update({(pool, g): v for g, v in zip(_GAUGES, values, strict=True)})
    return view


def test_replay_reports_the_cluster_kv_pools(cluster: Cluster, tiny_dir: Path) -> None:
    from swaserve.replay import format_report, run_replay
    from swaserve.replay_plan import ReplayOptions, token_space_from_model_dir
    from swaserve.traces import read_mooncake

    vocab, reserved = token_space_from_model_dir(tiny_dir)
    opts = ReplayOptions(url=cluster.url, time_scale=1000.0, block_tokens=4, max_output_tokens=4, vocab_size=vocab,
                         reserved_ids=reserved, request_timeout_s=120, progress=False)  # fmt: skip
    rep = run_replay(read_mooncake(limit=2), opts)
    assert rep["failed"] == 0, rep["errors"]
    want = {f"{role}@{a}/{pool}" for role, addrs in cluster.worker_addresses.items() for a in addrs
            for pool in ("full", "swa")}  # fmt: skip
    assert set(rep["kv_pages"]) == want
    for v in rep["kv_pages"].values():
        assert 0 <= v["peak_used_pages"] <= v["total_pages"] and v["total_pages"] > 0
    text = format_report(rep)
    assert (
        "not reported" not in text
        and f"KV pool prefill@{cluster.worker_addresses['prefill'][0]}/full" in text
    )
    wait_idle(cluster)


def test_structured_output_holds_across_pd(cluster: Cluster, tiny_dir: Path) -> None:
    """The prefill worker samples the first token under the grammar's mask, the decode worker's
    matcher takes it and goes on: output validates and equals one engine's (greedy and seeded)."""
    import platform

    import jsonschema
    import openai

    from swaserve.engine.types import StructuredOutput
    from tests.engine.test_structured import NESTED, PERSON

    platform.platform()  # cached before the client asks (its first call runs `uname -p`)
    eng = LLMEngine(
        str(tiny_dir), EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4)
    )
    client = openai.OpenAI(api_key="none", base_url=f"{cluster.url}/v1", max_retries=0, timeout=120)
    ps = prompts(3, seed=4)
    for schema, sampling in ((PERSON, {"temperature": 0.0}), (NESTED, {"temperature": 1.0, "seed": 7})):
        so = StructuredOutput("json_schema", json.dumps(schema))
        for p in ps:
            want = eng.generate([p], SamplingParams(max_tokens=200, structured=so, **sampling))[0]
            r = client.completions.create(
                model="mimo-v2-tiny-v2", prompt=p, max_tokens=200, **sampling,
                extra_body={"guided_json": schema, "return_token_ids": True},
            )  # fmt: skip
            (choice,) = r.choices
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), schema)
            assert choice.model_extra is not None and choice.model_extra["token_ids"] == want
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        stream = client.completions.create(
            model="mimo-v2-tiny-v2", prompt=ps[0], max_tokens=200, stream=True, **sampling,
            extra_body={"response_format": fmt},
        )  # fmt: skip
        text = "".join(c.choices[0].text for c in stream if c.choices)
        jsonschema.validate(json.loads(text), schema)
    for p in ps:  # a choice can end at the prefill worker's first token
        r = client.completions.create(
            model="mimo-v2-tiny-v2", prompt=p, max_tokens=8, temperature=0,
            extra_body={"guided_choice": ["yes", "no", "maybe not"]},
        )  # fmt: skip
        assert r.choices[0].text in ("yes", "no", "maybe not") and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="mimo-v2-tiny-v2", prompt="x", max_tokens=4, extra_body={"guided_regex": "(("}
        )
    assert e.value.param == "guided_regex"
    wait_idle(cluster)


def test_the_router_process_never_loads_torch(cluster: Cluster) -> None:
    """After text, chat, streaming and structured-output requests (the tests above), the router
    still has no libtorch mapped: it tokenizes, renders chats, checks grammars and routes without
    torch (``swaserve.hf_tokenizer``; the media, grammar and message modules it imports are
    torch-free), so a router replica starts in a fraction of a worker's time and memory."""
    maps = Path(f"/proc/{cluster.services['router'].proc.pid}/maps")  # type: ignore[union-attr]
    if not maps.exists():
        pytest.skip("needs /proc")
    libs = {line.split()[-1] for line in maps.read_text().splitlines() if "libtorch" in line}
    assert not libs, f"the router loaded {sorted(libs)}"


def _stream_outcome(url: str, prompt: list[int], max_tokens: int) -> str:
    """'done' (finish_reason seen), 'error' (error event), or raises on a hang (timeout)."""
    body = {"model": "mimo-v2-tiny-v2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                return "error"
            if ev["choices"][0].get("finish_reason"):
                return "done"
    return "ended"


def test_killing_a_decode_worker_mid_stream_never_hangs(cluster: Cluster) -> None:
    import concurrent.futures

    ps = prompts(6, seed=5)
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(_stream_outcome, cluster.url, p, 300) for p in ps]
        time.sleep(3.0)
        cluster.services["decode-0"].kill()
        outcomes = [f.result(timeout=120) for f in futs]
    assert set(outcomes) <= {"done", "error"}, outcomes
    got = asyncio.run(complete_all(cluster.url, prompts(4, seed=6)))  # the survivor serves
    assert all(r["usage"]["completion_tokens"] == NEW for r in got)
    wait_idle(cluster)


def test_killing_a_prefill_worker_sends_new_requests_to_the_other(cluster: Cluster) -> None:
    cluster.services["prefill-0"].kill()
    got = asyncio.run(complete_all(cluster.url, prompts(6, seed=7)))
    bad = [(r["usage"], r["choices"][0]) for r in got if r["usage"]["completion_tokens"] != NEW]
    assert not bad, bad
    ls = wait_idle(cluster)
    assert "prefill-0" not in ls and "prefill-1" in ls

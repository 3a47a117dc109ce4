"""Prefill/decode disaggregation in one process: a prefill engine exports each prompt's KV, the
pages go through the wire format (``to_pages``) into decode-side staging (``KVStaging``), and a
decode engine continues from the first token. Greedy tokens and logprobs must equal one engine
doing both, for concurrent requests with prompts several windows long (tiny checkpoint, W = 8)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from swaserve.config import FULL, SWA, EngineConfig, kv_config
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.kvcache import invariants
from swaserve.kvformat import engine_formats, residual_layers
from swaserve.transfer.kv_transfer import (
    KVPage,
    KVPayload,
    KVStaging,
    LayerShape,
    StagingFull,
    StagingTooSmall,
    TransferError,
    expected_pages,
    to_pages,
)
from tests.model.test_kv_quant_exact import TOL_FLIP

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
CFG = EngineConfig(page_size=4, max_num_batched_tokens=24, kv_cache_memory=8 << 20)


def staging_for(eng: LLMEngine) -> KVStaging:
    cfg = eng.model_config
    formats = engine_formats(eng.config, cfg)
    kcfg = kv_config(cfg, 0, residual_layers(formats, cfg))  # KIVI: the residuals are SWA layers
    return KVStaging(
        {FULL: len(kcfg.full_layers), SWA: len(kcfg.swa_layers)},
        {
            FULL: LayerShape(cfg.full.num_kv_heads, cfg.full.head_dim, cfg.full.v_head_dim),
            SWA: LayerShape(cfg.swa.num_kv_heads, cfg.swa.head_dim, cfg.swa.v_head_dim),
        },
        cfg.window if eng.config.kv_layout == "hybrid" else 1 << 30,
        eng.config.page_size,
        eng.dtype,
        formats=formats,
    )


def prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    stem = [rng.randrange(3, 500) for _ in range(21)]
    return {
        f"r{i}": (stem if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 50))]
        for i in range(6)
    }


def run_single(
    eng: LLMEngine, ps: dict[str, list[int]], params: SamplingParams = PARAMS
) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ps}
    for rid, p in ps.items():
        eng.add_request(rid, p, params)
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs)
    return out


def run_pd(
    pre: LLMEngine,
    dec: LLMEngine,
    ps: dict[str, list[int]],
    params: SamplingParams = PARAMS,
) -> tuple[dict[str, tuple[list[int], list[float]]], dict[str, int]]:
    """Prefill all prompts (max_tokens=1, export KV), move pages, decode the rest."""
    staging = staging_for(dec)
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ps}
    sent: dict[str, int] = {}
    for rid, p in ps.items():
        pre.add_request(rid, p, params, export_kv=True)
    while pre.has_unfinished():
        for o in pre.step():
            assert o.finished and o.kv_payload is not None and o.finish_reason == "handoff"
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs)
            staging.begin(o.request_id, o.prompt_tokens, o.kv_payload.sampler_state)
            pages = list(to_pages(o.kv_payload, pre.config.page_size))
            sent[o.request_id] = sum(pg.nbytes() for pg in pages)
            assert len(pages) == expected_pages(
                o.prompt_tokens, staging.window, staging.page_size, staging.layers
            )
            for pg in reversed(pages):  # any order
                staging.add(pg)
            staging.finish(o.request_id)
    invariants.check(pre.kv)
    for rid, p in ps.items():
        dec.add_prefilled(rid, p, out[rid][0][0], params, staging.claim(rid))
    assert dec.kv.full.pool.num_used == 0, "no device page is taken before admission"
    while dec.has_unfinished():
        for o in dec.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs)
        invariants.check(dec.kv)
    return out, sent


QUANT = {"kv_cache_dtype": "int8", "kv_cache_dtype_swa": "fp8_e4m3", "kv_quant_group": 8}
KIVI = {"kv_cache_dtype": "kivi2", "kv_quant_group": 8}
# the decode side computes the sinks itself; the residuals travel as 8-bit SWA layers
SINKS = {"kv_cache_dtype": "kivi2", "kv_cache_dtype_swa": "fp8_e4m3", "kv_sink_tokens": 3}


@pytest.mark.parametrize("layout, quant", [("hybrid", None), ("full", None), ("hybrid", QUANT), ("hybrid", KIVI), ("hybrid", SINKS)],
                         ids=["hybrid", "full", "hybrid-int8-fp8", "hybrid-kivi2", "hybrid-kivi2-fp8-sink3"])  # fmt: skip
def test_pd_equals_single_engine(tiny_dir: Path, layout: str, quant: dict | None) -> None:  # type: ignore[type-arg]
    """``quant``: quantized pages travel as packed bytes (per-token formats: codes plus fp32
    scales; KIVI: 2-bit codes with fp16 scales and zeros, and the full layers' full-precision
    residuals as more SWA layers)."""
    cfg = dataclasses.replace(CFG, kv_layout=layout, **(quant or {}))  # type: ignore[arg-type]
    single = LLMEngine(str(tiny_dir), cfg)
    pre = LLMEngine(str(tiny_dir), cfg)
    dec = LLMEngine(str(tiny_dir), dataclasses.replace(cfg, enable_prefix_caching=False))
    for seed in range(2):
        ps = prompts(seed)
        want = run_single(single, ps)
        got, sent = run_pd(pre, dec, ps)
        for rid in ps:
            assert got[rid][0] == want[rid][0], rid
            # quantized: the one engine batches decodes with other prompts' chunks, where a value
            # on a rounding boundary may land one code away (tests/model/test_kv_quant_exact.py)
            assert got[rid][1] == pytest.approx(want[rid][1], abs=TOL_FLIP if quant else 1e-4)
        m, elem = single.model_config, pre.dtype.itemsize
        fmts = engine_formats(cfg, m)
        n_swa = len(m.swa_layers) + residual_layers(fmts, m)
        full_tok = len(m.full_layers) * fmts[FULL].token_bytes(
            m.full.num_kv_heads, m.full.head_dim, m.full.v_head_dim, elem
        )
        swa_tok = n_swa * fmts[SWA].token_bytes(m.swa.num_kv_heads, m.swa.head_dim, m.swa.v_head_dim, elem)
        if quant is QUANT:  # per layer: codes + 4 bytes of scale per 8 channels, K and V
            assert (
                full_tok
                == len(m.full_layers) * m.full.num_kv_heads * (m.full.head_dim + m.full.v_head_dim) * 1.5
            )
        for rid, p in ps.items():
            n = len(p)
            swa_n = min(n, m.window) if layout == "hybrid" else n
            assert sent[rid] == n * full_tok + swa_n * swa_tok  # exactly the KV decode needs
    assert dec.kv.full.pool.num_used == dec.kv.swa.pool.num_used == 0


def test_bad_pages_are_refused(tiny_dir: Path) -> None:
    pre = LLMEngine(str(tiny_dir), CFG)
    staging = staging_for(pre)
    pre.add_request("a", list(range(3, 40)), PARAMS, export_kv=True)
    done = []
    while pre.has_unfinished():
        done += [o for o in pre.step() if o.finished]
    (o,) = done
    pages = list(to_pages(o.kv_payload, 4))
    staging.begin("a", 37)
    bad = dataclasses.replace(pages[0], k=bytes([pages[0].k[0] ^ 1]) + pages[0].k[1:])
    with pytest.raises(TransferError, match="checksum"):
        staging.add(bad)
    with pytest.raises(TransferError, match="range"):
        staging.add(dataclasses.replace(pages[1], token_start=pages[1].token_start + 1))
    staging.add(pages[0])
    with pytest.raises(TransferError, match="duplicate"):
        staging.add(pages[0])
    with pytest.raises(TransferError, match="incomplete"):
        staging.finish("a")
    assert staging.open_ids() == [] and staging.staged_bytes == 0
    with pytest.raises(StagingTooSmall, match="larger than this decode worker's whole KV staging"):
        KVStaging(staging.layers, staging.shapes, staging.window, 4, torch.float32, max_bytes=10).begin(
            "b", 37
        )
    small = KVStaging(staging.layers, staging.shapes, staging.window, 4, torch.float32)
    small.begin("c", 37)
    small.max_bytes = small.staged_bytes + 1  # room for one such transfer, not two
    with pytest.raises(StagingFull, match="staging full"):
        small.begin("d", 37)


@pytest.mark.parametrize("window", [4, 1 << 30])  # hybrid, full layout
def test_max_tokens_is_the_longest_transfer_that_begins(window: int) -> None:
    """What a decode worker reports as ``Load.max_transfer_tokens`` (a router refuses longer
    prompts up front): the next token more is ``StagingTooSmall``; the bound caps it."""
    shape = LayerShape(2, 8, 6)
    layers = {FULL: 1, SWA: 3}
    for max_bytes in (0, 100, 4_000, 9_999, 50_000):
        staging = KVStaging(layers, {FULL: shape, SWA: shape}, window, 4, torch.float32, max_bytes)
        n = staging.max_tokens(10_000)
        assert n < 10_000
        if n:
            staging.begin("fits", n)
            staging.discard("fits")
        with pytest.raises(StagingTooSmall):
            staging.begin("too long", n + 1)
        assert staging.max_tokens(n // 2) == n // 2
    per_token = (1 + 3) * 2 * (8 + 6) * 4
    assert KVStaging(layers, {FULL: shape, SWA: shape}, 4, 4, torch.float32, 50_000).max_tokens(10**6) == (
        50_000 - 3 * 4 * 2 * (8 + 6) * 4
    ) // (2 * (8 + 6) * 4)
    assert (
        KVStaging(layers, {FULL: shape, SWA: shape}, 1 << 30, 4, torch.float32, 50_000).max_tokens(10**6)
        == 50_000 // per_token
    )


def test_a_superseded_transfer_never_touches_the_newer_one_of_its_id() -> None:
    """A retry's transfer of the same request id replaces an earlier one still arriving (the
    receiver discards it and begins anew); the earlier one's pages, finish and discard, by its own
    ``begin``, are refused or no-ops and leave the newer one as it is."""
    shape = LayerShape(1, 8, 8)
    staging = KVStaging({FULL: 1, SWA: 1}, {FULL: shape, SWA: shape}, 4, 4, torch.float32)

    def payload(seed: int) -> list[KVPage]:
        g = torch.Generator().manual_seed(seed)
        p = KVPayload("x", 10, 4)
        for kind in (FULL, SWA):
            lo, hi = p.token_range(kind)
            p.kv[kind] = [(torch.randn(hi - lo, 1, 8, generator=g), torch.randn(hi - lo, 1, 8, generator=g))]
        return list(to_pages(p, 4))

    old_pages, new_pages = payload(1), payload(2)
    old = staging.begin("x", 10)
    staging.add(old_pages[0], old)
    assert staging.discard("x")  # the retry's header supersedes it
    new = staging.begin("x", 10)
    for pg in new_pages[:2]:
        staging.add(pg, new)
    with pytest.raises(TransferError, match="superseded"):
        staging.add(old_pages[1], old)
    with pytest.raises(TransferError, match="superseded"):
        staging.finish("x", old)
    assert not staging.discard("x", old) and staging.open_ids() == ["x"]
    for pg in new_pages[2:]:
        staging.add(pg, new)
    staging.finish("x", new)
    assert not staging.discard("x", old)  # the earlier one, cancelled late, leaves it staged
    got = staging.claim("x")
    assert got is new and torch.equal(got.kv[FULL][0][0], payload_kv(new_pages, FULL))


def payload_kv(pages: list[KVPage], kind: str) -> torch.Tensor:
    """The full K rows of one layer, from its pages (float32)."""
    rows = [
        torch.frombuffer(bytearray(pg.k), dtype=torch.float32).view(pg.k_shape)
        for pg in pages
        if pg.kind == kind
    ]
    return torch.cat(rows)


def test_seeded_sampling_continues_the_same_random_stream(tiny_dir: Path) -> None:
    """The prefill worker's RNG state after the first token travels with the KV, so a seeded
    sampled request decodes the same tokens as on one engine."""
    params = dataclasses.replace(PARAMS, temperature=0.9, top_k=50, seed=2**63 + 5)
    single = LLMEngine(str(tiny_dir), CFG)
    pre = LLMEngine(str(tiny_dir), CFG)
    dec = LLMEngine(str(tiny_dir), dataclasses.replace(CFG, enable_prefix_caching=False))
    ps = prompts(3)
    want = run_single(single, ps, params)
    got, _ = run_pd(pre, dec, ps, params)
    assert {r: got[r][0] for r in ps} == {r: want[r][0] for r in ps}

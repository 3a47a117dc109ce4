"""Quantized KV pages (``--kv-cache-dtype``): the engine's logits equal an independent reference of
the same quantization on the same inputs.

The reference is transformers' MiMoV2FlashForCausalLM with a cache that fake-quantizes every K/V
row as it is stored (written here, not ``swaserve.kvformat``): symmetric, absmax / qmax scale per
group of channels, int8 round-to-nearest or an FP8 cast. Transformers applies RoPE and the value
scale before the cache update, as our engine does before it writes a page, and attends over what
the cache returns (the current chunk's rows included), so both quantize the same tensors.

The reference is fed the same chunks as the engine: quantization turns float noise at 1e-7 (a
different reduction order in an earlier layer) into a whole code step when a value sits on a
rounding boundary, so a one-shot reference against a chunked engine would compare two different
(both correct) quantizations. Prefill and chunked prefill match to the bit here; token-by-token
decode attends through a different kernel than transformers' (float noise ~1e-6), so a value on a
rounding boundary can land one code away: decode is held to ``TOL_FLIP`` and equal greedy tokens
(seen: 1e-5 on one machine, 2.7e-3 for int8 g8 on CI's).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import DynamicCache

from swaserve.config import FULL, SWA
from swaserve.kvformat import KVFormat
from tests.helpers.engine import Harness, feed_chunks

TOL_PREFILL = 1e-5
# batched rows differ from lone ones by float noise (~1e-6); once in a while a K/V value on a
# rounding boundary then lands one code away (within the format's bound: an int8 step is 1/127 of
# the row's absmax, an fp8_e4m3 step 1/8 of the value), which shows in logits and logprobs at
# 1e-4..1e-3 (seen: 2.3e-4 once in 24 fp8_e5m2 batches, 2.0e-3 in a PD run); greedy tokens agree
TOL_FLIP = 1e-2
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fake_quant(x: torch.Tensor, name: str, group: int) -> torch.Tensor:
    """Quantize and dequantize ``x [..., dim]`` row by row, ``group`` channels per scale (0: all)."""
    dim = x.shape[-1]
    g = group or dim
    xg = x.float().reshape(*x.shape[:-1], dim // g, g)
    amax = xg.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX[name], torch.ones_like(amax))
    y = (xg / scale).clamp(-QMAX[name], QMAX[name])
    q = torch.round(y) if name == "int8" else y.to(FP8[name]).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


class FakeQuantCache(DynamicCache):
    """A transformers cache storing every layer's new K/V rows fake-quantized."""

    def __init__(self, config, names: dict[str, str], group: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config=config)
        self.names = [names[t] for t in config.layer_types]
        self.group = group

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        name = self.names[layer_idx]
        if name != "auto":
            key_states = fake_quant(key_states, name, self.group)
            value_states = fake_quant(value_states, name, self.group)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def reference(
    hf, tokens: Sequence[int], chunks: Sequence[int], names: dict[str, str], group: int
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    cache = FakeQuantCache(hf.config, names, group)
    return feed_chunks(hf, cache, tokens, chunks)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


CASES = [  # (full pool, SWA pool, group)
    ("int8", "int8", 0),
    ("int8", "int8", 8),
    ("fp8_e4m3", "fp8_e4m3", 0),
    ("fp8_e4m3", "fp8_e4m3", 8),
    ("fp8_e5m2", "fp8_e5m2", 0),
    ("fp8_e5m2", "fp8_e5m2", 8),
    ("int8", "auto", 0),  # --kv-cache-dtype-swa auto: the small SWA pool unquantized
    ("auto", "fp8_e4m3", 0),
]
CHUNKS = {
    "one-shot": ([45], TOL_PREFILL),
    "chunked": ([5, 11, 13, 16], TOL_PREFILL),
    "decode": ([6] + [1] * 39, TOL_FLIP),  # W = 8: crosses the window and pages many times
}


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{s}-g{g}" for f, s, g in CASES])
def case(request, tiny_dir):  # type: ignore[no-untyped-def]
    full, swa, group = request.param
    formats = {FULL: KVFormat(full, group), SWA: KVFormat(swa, group)}
    names = {"full_attention": full, "sliding_attention": swa}
    return Harness(tiny_dir, page_size=4, shared=True, formats=formats), names, group


@pytest.mark.parametrize("schedule", list(CHUNKS))
def test_engine_equals_a_fake_quantized_transformers_cache(case, hf_tiny, schedule: str) -> None:  # type: ignore[no-untyped-def]
    harness, names, group = case
    chunks, tol = CHUNKS[schedule]
    toks = _tokens(45, 0)
    ours = harness.run_alone(schedule, toks, chunks)
    ref = reference(hf_tiny, toks, chunks, names, group)
    assert (ours - ref).abs().max().item() <= tol
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # quantization really happened: an unquantized cache gives logits the test can tell apart
    plain = reference(hf_tiny, toks, chunks, {"full_attention": "auto", "sliding_attention": "auto"}, 0)
    assert (plain - ref).abs().max().item() > 5 * tol


def test_pages_hold_packed_rows(case) -> None:  # type: ignore[no-untyped-def]
    """Quantized pools store uint8 rows [data | fp32 scales]: fewer bytes per token than fp32."""
    harness, _, group = case
    cfg = harness.cfg
    for kind, shape in ((FULL, cfg.full), (SWA, cfg.swa)):
        fmt = harness.storage.formats[kind]
        k0, v0 = harness.storage.kv[kind][0][0], harness.storage.kv[kind][1][0]  # layer 0's pages
        assert k0.dtype == v0.dtype == (torch.uint8 if fmt.quantized else torch.float32)
        # bytes the pages really hold per token of a layer (K and V rows of every head)
        row = (k0.shape[-1] * k0.element_size() + v0.shape[-1] * v0.element_size()) * k0.shape[2]
        assert row == fmt.token_bytes(shape.num_kv_heads, shape.head_dim, shape.v_head_dim, 4)
        if fmt.quantized:
            g = group or shape.head_dim
            assert fmt.row_bytes(shape.head_dim, 4) == shape.head_dim + 4 * (shape.head_dim // g)
            assert row < shape.num_kv_heads * (shape.head_dim + shape.v_head_dim) * 4 / 2


def test_a_batch_of_requests_equals_each_alone(case) -> None:  # type: ignore[no-untyped-def]
    """Rows are quantized on their own: a request batched with others reads what it reads alone
    (up to a code flip, ``TOL_FLIP``), and picks the same greedy tokens."""
    harness, _, _ = case
    seqs = {f"r{i}": _tokens(n, 10 + i) for i, n in enumerate([30, 7, 19])}
    alone = {rid: harness.run_alone(f"alone-{rid}", t, [len(t) - 4, 1, 1, 1, 1]) for rid, t in seqs.items()}
    reqs = {rid: harness.new(rid, t) for rid, t in seqs.items()}
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    plans = [[(rid, len(t) - 4) for rid, t in seqs.items()]] + [[(rid, 1) for rid in seqs]] * 4
    for plan in plans:
        for (rid, _), logits in zip(plan, harness.step([(reqs[rid], n) for rid, n in plan]), strict=True):
            got[rid].append(logits)
    for rid in seqs:
        harness.kv.free(rid)
        ours = torch.cat(got[rid])
        assert torch.equal(ours.argmax(-1), alone[rid].argmax(-1))
        assert (ours - alone[rid]).abs().max().item() <= TOL_FLIP


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "kivi2"])
def test_quantized_pages_on_cuda_equal_cpu(tiny_dir, fmt: str) -> None:  # type: ignore[no-untyped-def]
    """On a GPU: packing, the arena's byte views and dequantize-on-read give the CPU's greedy
    tokens, logprobs within a code flip (untested on this CPU-only machine until a device is lent)."""
    from swaserve.config import EngineConfig
    from swaserve.engine.llm_engine import LLMEngine
    from swaserve.engine.types import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = [_tokens(n, 20 + n) for n in (45, 30, 9)]

    def run(device: str) -> list[tuple[list[int], list[float]]]:
        cfg = EngineConfig(page_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20, kv_cache_dtype=fmt,
                           device=device, dtype="float32")  # fmt: skip
        eng = LLMEngine(tiny_dir, cfg)
        out: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id][0].extend(o.new_token_ids)
                out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs)
        return list(out.values())

    for (tc, lc), (tg, lg) in zip(run("cpu"), run("cuda"), strict=True):
        assert tg == tc
        assert all(abs(a - b) <= TOL_FLIP for a, b in zip(lg, lc, strict=True))

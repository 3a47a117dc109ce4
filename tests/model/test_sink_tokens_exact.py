"""Sink tokens in full precision (``--kv-sink-tokens S``, ``engine.sinks``): the engine's logits
equal an independent reference of the same rule on the same inputs.

The rule: a full layer reads the K/V of a request's first S prompt positions from a forward over
those S tokens alone (full layers unquantized, SWA layers in their pool's format), everything
else as the quantized format says. The references are the ones of tests/model/test_kv_quant_exact.py
(transformers with a fake-quantizing cache) and tests/model/test_kivi_exact.py (a dense KIVI
attention), with the sink positions' K/V replaced by what transformers computes over the first S
tokens alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import transformers.models.mimo_v2_flash.modeling_mimo_v2_flash as hf_mimo
from transformers import DynamicCache, MiMoV2FlashForCausalLM

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.kvformat import FormatError, KVFormat, engine_formats
from tests.helpers.engine import Harness, feed_chunks
from tests.model.test_kivi_exact import kivi_attention
from tests.model.test_kv_quant_exact import TOL_FLIP, TOL_PREFILL, FakeQuantCache

S = 3


class SinkCache(FakeQuantCache):
    """``FakeQuantCache`` whose full layers hold ``sinks[layer]`` (k, v [1, H, S, D]) at positions < S;
    with ``record``, it keeps every full layer's stored K/V instead (the sinks' own forward)."""

    def __init__(self, config, names, group, sinks=None, record=False):  # type: ignore[no-untyped-def]
        super().__init__(config, names, group)
        self.full = {i for i, t in enumerate(config.layer_types) if t == FULL}
        self.sinks, self.record = sinks or {}, record
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        if layer_idx in self.full and self.record:
            self.seen[layer_idx] = (key_states.clone(), value_states.clone())
        if layer_idx in self.full and layer_idx in self.sinks:
            start = self.get_seq_length(layer_idx)
            n = max(0, min(S - start, key_states.shape[2]))
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if n:  # the stored rows at the sink positions: the sinks, not the fake-quantized ones
                sk, sv = self.sinks[layer_idx]
                layer = self.layers[layer_idx]
                layer.keys[:, :, start : start + n] = sk[:, :, start : start + n]
                layer.values[:, :, start : start + n] = sv[:, :, start : start + n]
                return layer.keys, layer.values
            return out
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def sink_kv(hf, tokens: Sequence[int], swa: str, group: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Transformers' full-layer K/V over the first S tokens alone, full layers unquantized."""
    cache = SinkCache(hf.config, {FULL: "auto", SWA: swa}, group, record=True)
    with torch.no_grad():
        hf(torch.tensor([list(tokens[:S])]), past_key_values=cache, use_cache=True)
    return cache.seen


def reference(hf, tokens, chunks, names, group, sinks):  # type: ignore[no-untyped-def]
    cache = SinkCache(hf.config, names, group, sinks)
    return feed_chunks(hf, cache, tokens, chunks)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


CHUNKS = {
    "one-shot": ([45], TOL_PREFILL),
    "chunked": ([2, 11, 13, 19], TOL_PREFILL),  # the first chunk ends inside the sinks
    "decode": ([6] + [1] * 39, TOL_FLIP),  # a code flip from decode's kernel noise: test_kv_quant_exact
}


@pytest.mark.parametrize(
    "fmts", [("int8", "int8", 0), ("fp8_e4m3", "auto", 8)], ids=["int8", "fp8-swa-auto-g8"]
)
@pytest.mark.parametrize("schedule", list(CHUNKS))
def test_sink_tokens_equal_a_fake_quantized_reference(tiny_dir, hf_tiny, fmts, schedule: str) -> None:  # type: ignore[no-untyped-def]
    full, swa, group = fmts
    formats = {FULL: KVFormat(full, group, sinks=S), SWA: KVFormat(swa, group)}
    harness = Harness(tiny_dir, page_size=4, shared=True, formats=formats)
    chunks, tol = CHUNKS[schedule]
    toks = _tokens(45, 0)
    ours = harness.run_alone(schedule, toks, chunks)
    names = {FULL: full, SWA: swa}
    ref = reference(hf_tiny, toks, chunks, names, group, sink_kv(hf_tiny, toks, swa, group))
    assert (ours - ref).abs().max().item() <= tol
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # the sinks are really read: the same format without them gives logits the test can tell apart
    plain = reference(hf_tiny, toks, chunks, names, group, None)
    assert (plain - ref).abs().max().item() > 5 * tol


@pytest.fixture(scope="module")
def hf_eager(tiny_dir):  # type: ignore[no-untyped-def]
    return MiMoV2FlashForCausalLM.from_pretrained(
        str(tiny_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def kivi_reference(hf, monkeypatch, tokens, chunks, fmt: KVFormat, sinks) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """tests/model/test_kivi_exact.py's reference, sink positions read from ``sinks`` on both the
    quantized and the full-precision side."""
    eager = hf_mimo.eager_attention_forward

    def attend(module: Any, query, key, value, attention_mask, scaling, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
        if module.layer_type != FULL:
            return eager(module, query, key, value, attention_mask, scaling, dropout, **kw)
        gv = fmt.group or value.shape[-1]
        sink = None
        if sinks is not None:
            sk, sv = sinks[module.layer_idx]
            n = min(S, key.shape[2])
            sink = (sk[:, :, :n], sv[:, :, :n])
        out = kivi_attention(query, key, value, fmt.bits, fmt.kivi_group, gv, fmt.residual, scaling, sink)
        return out, None

    monkeypatch.setattr(hf_mimo, "eager_attention_forward", attend)
    try:
        return feed_chunks(hf, DynamicCache(config=hf.config), tokens, chunks)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("schedule", list(CHUNKS))
def test_kivi_sink_tokens_equal_a_dense_reference(tiny_dir, hf_eager, schedule, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fmt = KVFormat("kivi2", 0, 4, 4, sinks=S)
    harness = Harness(tiny_dir, page_size=4, shared=True, formats={FULL: fmt, SWA: KVFormat()})
    chunks, tol = CHUNKS[schedule]
    toks = _tokens(45, 1)
    ours = harness.run_alone(schedule, toks, chunks)
    sinks = sink_kv(hf_eager, toks, "auto", 0)
    ref = kivi_reference(hf_eager, monkeypatch, toks, chunks, fmt, sinks)
    assert (ours - ref).abs().max().item() <= tol
    plain = kivi_reference(hf_eager, monkeypatch, toks, chunks, fmt, None)
    assert (plain - ref).abs().max().item() > 10 * tol


def test_a_short_prompt_and_a_media_placeholder_bound_the_sinks(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    """S' = min(S, prompt length, first media placeholder): a 2-token prompt keeps 2 sinks, one
    with a placeholder at position 1 keeps 1; the same tokens share one entry (one forward)."""
    from swaserve.engine.request import Request
    from swaserve.engine.types import SamplingParams

    formats = {FULL: KVFormat("int8", sinks=S), SWA: KVFormat("int8")}
    harness = Harness(tiny_dir, page_size=4, shared=True, formats=formats)
    table = harness.runner.sinks
    assert table is not None
    vocab = harness.cfg.vocab_size

    def req(tokens: list[int]) -> Request:
        return Request("x", tokens, SamplingParams(max_tokens=1), 0.0, len(tokens) + 1)

    assert table.count(req([5, 6])) == 2
    assert table.count(req([5, vocab + 7, 9, 9])) == 1
    assert table.count(req([vocab + 7, 9, 9])) == 0
    assert table.count(req(list(range(10)))) == S
    toks = _tokens(20, 3)
    other = toks[:S] + _tokens(20 - S, 4)
    a = harness.run_alone("a", toks, [20])
    b = harness.run_alone("b", other, [20])
    assert table.computed == 1  # b's first S tokens hit a's entry
    torch.testing.assert_close(a[:S], b[:S], rtol=0, atol=1e-5)  # the same sinks, the same prefix
    assert (a[S:] - b[S:]).abs().max().item() > 1e-2
    k, v = table.entry(toks[:S])
    assert table.computed == 1
    k2, v2 = table.compute(toks[:S])  # an evicted entry is computed again to the same bits
    assert torch.equal(k, k2) and torch.equal(v, v2)
    f = harness.cfg.full
    assert k.shape == (len(harness.cfg.full_layers), S, f.num_kv_heads, f.head_dim)
    assert not torch.equal(k, table.compute(other[1 : S + 1])[0])


def test_sink_tokens_are_refused_where_they_mean_nothing(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    mcfg = ModelConfig.from_pretrained(tiny_dir)
    with pytest.raises(FormatError, match="quantized --kv-cache-dtype"):
        engine_formats(EngineConfig(page_size=4, kv_sink_tokens=2), mcfg)
    with pytest.raises(FormatError, match="ep-size"):
        engine_formats(EngineConfig(page_size=4, kv_cache_dtype="int8", kv_sink_tokens=2, ep_size=2), mcfg)
    with pytest.raises(FormatError, match=r"1\.\.64"):
        engine_formats(EngineConfig(page_size=4, kv_cache_dtype="int8", kv_sink_tokens=65), mcfg)
    f = engine_formats(EngineConfig(page_size=4, kv_cache_dtype="int8", kv_sink_tokens=2), mcfg)
    assert f[FULL].sinks == 2 and f[FULL].describe().endswith("/sink2") and f[SWA].sinks == 0

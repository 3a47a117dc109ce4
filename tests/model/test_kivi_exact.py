"""KIVI pages (``--kv-cache-dtype kivi2|kivi4``): the engine's logits equal a dense reference of the
same scheme on the same inputs.

The reference is transformers' MiMoV2FlashForCausalLM (eager attention) with the full-attention
layers' attention replaced by one written here: it takes the full-precision keys and values
transformers computed (its cache keeps every position of a full layer), quantizes them with the
KIVI arithmetic re-implemented in this file (asymmetric, fp16 scale and zero; keys per channel
over groups of G tokens, values per token over groups of channels), and lets a query at q read
positions <= q - R quantized and the last R in full precision. SWA layers are untouched. It is fed
the same chunks as the engine (tests/model/test_kv_quant_exact.py says why), and lays the keys
out as the engine reads them, so prefill and chunked prefill match to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import transformers.models.mimo_v2_flash.modeling_mimo_v2_flash as hf_mimo
from transformers import DynamicCache, MiMoV2FlashForCausalLM

from swaserve.config import FULL, SWA
from swaserve.kvformat import KVFormat
from tests.helpers.engine import Harness, feed_chunks
from tests.model.test_kv_quant_exact import TOL_FLIP, TOL_PREFILL, FakeQuantCache, fake_quant

W = 8  # the tiny checkpoint's window


def asym(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """KIVI quantize-dequantize of ``x`` with min/max over ``dim``: fp16 scale and zero."""
    levels = 2**bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale, zero = ((hi - lo) / levels).half().float(), lo.half().float()
    code = torch.round((x - zero) / torch.where(scale > 0, scale, 1.0)).clamp(0, levels)
    return code * scale + zero


def kivi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int,
    g: int,
    gv: int,
    r: int,
    scaling: float,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
    resid: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, Hq, Lq, D] at the last Lq of positions [0, L); k, v [B, Hkv, L, D] full precision.
    Keys are laid out as the engine reads them (the quantized positions <= L - 1 - R, then the
    full-precision ones from L - Lq - W), so the sums run in the same order. ``sink``: (k, v)
    [B, Hkv, S, D] read at positions < S on both sides (sink tokens); ``resid``: how the
    residual stores K/V (an 8-bit SWA pool: its fake quantization; keys are grouped from it, values
    quantized from the fresh ones). Returns [B, Lq, Hq, Dv]."""
    b, hkv, n, d = k.shape
    dv, lq = v.shape[-1], q.shape[2]
    whole = n // g * g  # complete key groups
    vq = asym(v.reshape(b, hkv, n, dv // gv, gv), bits, dim=4).reshape(b, hkv, n, dv)
    if resid is not None:
        k, v = resid(k), resid(v)
    kq = asym(k[:, :, :whole].reshape(b, hkv, -1, g, d), bits, dim=3).reshape(b, hkv, whole, d)
    if sink is not None:
        m = sink[0].shape[2]
        kq, vq, k, v = kq.clone(), vq.clone(), k.clone(), v.clone()
        kq[:, :, : min(m, whole)] = sink[0][:, :, : min(m, whole)]
        vq[:, :, :m], k[:, :, :m], v[:, :, :m] = sink[1], sink[0], sink[1]
    c, lo = max(0, n - r), max(0, n - lq - W)
    kk = torch.cat((kq[:, :, :c], k[:, :, lo:]), dim=2)
    vv = torch.cat((vq[:, :, :c], v[:, :, lo:]), dim=2)
    qpos = torch.arange(n - lq, n)[:, None]
    kpos = torch.cat((torch.arange(c), torch.arange(lo, n)))[None, :]
    full = torch.arange(c + n - lo)[None, :] >= c  # the full-precision copies
    mask = torch.where(full, (kpos > qpos - r) & (kpos <= qpos), kpos <= qpos - r)
    rep = q.shape[1] // hkv
    s = q @ kk.repeat_interleave(rep, 1).transpose(2, 3) * scaling
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1)
    return (p @ vv.repeat_interleave(rep, 1)).transpose(1, 2)


@pytest.fixture(scope="module")
def hf_eager(tiny_dir):  # type: ignore[no-untyped-def]
    return MiMoV2FlashForCausalLM.from_pretrained(
        str(tiny_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference(
    hf,
    monkeypatch: pytest.MonkeyPatch,
    tokens: Sequence[int],
    chunks: Sequence[int],
    fmt: KVFormat,
    swa: KVFormat | None = None,
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``swa``: a per-token SWA pool format: SWA layers fake-quantized (``FakeQuantCache``), the
    full layers' residual stored in it."""
    eager = hf_mimo.eager_attention_forward
    q8 = swa is not None and swa.quantized
    resid = (lambda x: fake_quant(x, swa.name, swa.group)) if q8 and swa is not None else None

    def attend(module: Any, query, key, value, attention_mask, scaling, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
        if module.layer_type != FULL:
            return eager(module, query, key, value, attention_mask, scaling, dropout, **kw)
        gv = fmt.group or value.shape[-1]
        out = kivi_attention(
            query, key, value, fmt.bits, fmt.kivi_group, gv, fmt.residual, scaling, resid=resid
        )
        return out, None

    monkeypatch.setattr(hf_mimo, "eager_attention_forward", attend)
    cache = (
        FakeQuantCache(hf.config, {FULL: "auto", SWA: swa.name}, swa.group)
        if q8 and swa is not None
        else DynamicCache(config=hf.config)
    )
    try:
        return feed_chunks(hf, cache, tokens, chunks)
    finally:
        monkeypatch.undo()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


CASES = [  # (name, value channel group, key group G, residual R, SWA pool); tiny: head dims 32 / 16, W = 8
    ("kivi4", 8, 4, 8, "auto"),
    ("kivi2", 0, 4, 4, "auto"),
    ("kivi2", 4, 2, 6, "auto"),
    ("kivi2", 0, 4, 8, "fp8_e4m3"),  # the SWA layers and the residual at 8 bits
]
CHUNKS = {
    "one-shot": ([45], TOL_PREFILL),
    "chunked": ([5, 11, 13, 16], TOL_PREFILL),
    # token by token the SWA layers attend through another kernel than transformers' (1e-5 noise),
    # which a 2-bit code step (a third of a group's range) can turn into ~1e-4 (seen: 1.2e-4)
    "decode": ([6] + [1] * 39, TOL_FLIP),
}


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{n}-g{g}-kg{kg}-r{r}-swa-{s}" for n, g, kg, r, s in CASES]
)
def case(request, tiny_dir) -> Iterator[tuple[Harness, KVFormat, KVFormat]]:  # type: ignore[no-untyped-def]
    name, group, kg, r, swa = request.param
    fmt, swa_fmt = KVFormat(name, group, kg, r), KVFormat(swa)
    yield Harness(tiny_dir, page_size=4, shared=True, formats={FULL: fmt, SWA: swa_fmt}), fmt, swa_fmt


@pytest.mark.parametrize("schedule", list(CHUNKS))
def test_engine_equals_a_dense_kivi_reference(
    case, hf_eager, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    harness, fmt, swa = case
    chunks, tol = CHUNKS[schedule]
    toks = _tokens(45, 0)
    ours = harness.run_alone(schedule, toks, chunks)
    ref = reference(hf_eager, monkeypatch, toks, chunks, fmt, swa)
    assert (ours - ref).abs().max().item() <= tol
    # the quantized part is really read: an unquantized model gives other logits
    with torch.no_grad():
        plain = hf_eager(torch.tensor([toks])).logits[0].float()
    assert (plain - ref).abs().max().item() > 10 * tol

"""KV page formats (``swaserve.kvformat``): round trips within each format's bound on random tensors
with outlier channels, the packed layout against an independent reference, KIVI blocks."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve import kivi
from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.kivi import kivi_dequant, kivi_keys, kivi_values
from swaserve.kvformat import (
    ROW_FORMATS,
    FormatError,
    KVFormat,
    engine_formats,
    parse_format,
    residual_layers,
)


def _tensor(seed: int, n: int, h: int, d: int, outliers: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) * scale
    if outliers:  # a few channels 20-100x larger, as keys have (KIVI fig. 2, KVQuant section 3)
        ch = torch.randperm(d, generator=g)[:outliers]
        x[..., ch] *= 20 + 80 * torch.rand(len(ch), generator=g)
    return x


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(ROW_FORMATS),
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 9),
    d=st.sampled_from([16, 32, 48, 64]),
    group=st.sampled_from([0, 8, 16]),
    outliers=st.integers(0, 4),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
)
def test_row_formats_round_trip_within_their_bound(name, seed, n, d, group, outliers, scale) -> None:  # type: ignore[no-untyped-def]
    fmt = KVFormat(name, group)
    fmt.check((d,))
    x = _tensor(seed, n, 2, d, outliers, scale)
    packed = fmt.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (n, 2, fmt.row_bytes(d, 4))
    back = fmt.unpack(packed, d, torch.float32)
    err = (back - x).abs()
    assert bool((err <= fmt.error_bound(x)).all()), float((err - fmt.error_bound(x)).max())
    # the bound is not vacuous: the error of a row is a small part of its largest value
    rel = (err.amax(-1) / x.abs().amax(-1)).max().item()
    assert rel <= {"int8": 1 / 254, "fp8_e4m3": 1 / 16, "fp8_e5m2": 1 / 8}[name] + 1e-6
    # packing is a function of the row alone: a row packed with others gives the same bytes
    assert torch.equal(fmt.pack(x[:1]), packed[:1])


def _reference_int8(x: np.ndarray, group: int) -> bytes:
    """Independent packing of one row: int8 data, then little-endian fp32 scales."""
    d = x.shape[-1]
    g = group or d
    out = bytearray()
    scales = []
    for lo in range(0, d, g):
        blk = x[lo : lo + g].astype(np.float32)
        amax = np.float32(np.abs(blk).max())
        s = np.float32(amax / np.float32(127.0)) if amax > 0 else np.float32(1.0)
        q = np.clip(np.round(blk / s), -127, 127).astype(np.int8)
        out += q.tobytes()
        scales.append(s)
    return bytes(out) + np.array(scales, dtype="<f4").tobytes()


@pytest.mark.parametrize("group", [0, 8])
def test_int8_packed_bytes_equal_a_numpy_reference(group: int) -> None:
    x = _tensor(3, 5, 2, 32, 2, 1.0)
    packed = KVFormat("int8", group).pack(x)
    for t in range(5):
        for h in range(2):
            assert packed[t, h].numpy().tobytes() == _reference_int8(x[t, h].numpy(), group)


def test_fp8_codes_are_the_cast_of_the_scaled_row() -> None:
    x = _tensor(4, 3, 1, 16, 1, 2.0)
    for name, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        p = KVFormat(name).pack(x)
        qmax = 448.0 if name == "fp8_e4m3" else 57344.0
        s = x.abs().amax(-1, keepdim=True) / qmax
        assert torch.equal(p[..., :16], (x / s).to(dt).view(torch.uint8))
        assert torch.equal(p[..., 16:].contiguous().view(torch.float32), s)


def test_zero_rows_and_auto() -> None:
    z = torch.zeros(2, 1, 16)
    for name in ROW_FORMATS:
        f = KVFormat(name)
        assert torch.equal(f.unpack(f.pack(z), 16, torch.float32), z)
    auto = KVFormat()
    x = torch.randn(2, 1, 16, dtype=torch.bfloat16)
    assert auto.pack(x) is x and auto.row_bytes(16, 2) == 32 and auto.describe() == "auto"
    assert KVFormat("fp8_e4m3").row_bytes(64, 2) == 64 + 4  # half of bf16's 128 B, plus a scale


def test_refusals() -> None:
    with pytest.raises(FormatError, match="unknown KV cache dtype"):
        parse_format("fp4")
    with pytest.raises(FormatError, match="does not divide head dim 48"):
        KVFormat("int8", 32).check((64, 48))
    with pytest.raises(FormatError, match="KIVI key group 3 must be >= 1 and divide 4 x head dim 64"):
        KVFormat("kivi2", 0, 3, 8).check((64, 64))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"kv_kivi_group": 3}, "KIVI key group 3 must divide the page size 4"),
        ({"kv_kivi_group": 4, "kv_kivi_residual": 2}, "key group <= residual <= window: 4 <= 2 <= 8"),
        ({"kv_layout": "full"}, "it would take more memory than auto; use the hybrid layout"),
        ({"kv_cache_dtype": "int8", "kv_kivi_group": 4}, "apply to kivi2 / kivi4 only"),
        (
            {"kv_cache_dtype": "auto", "kv_quant_group": 8},
            "applies to a quantized --kv-cache-dtype(-swa) only",
        ),
        ({"kv_kivi_residual": 9}, "4 <= 9 <= 8"),
        ({"kv_quant_group": 5}, "KV quantization group 5 does not divide head dim 32"),
    ],
)
def test_kivi_refusals(tiny_dir, flags: dict, message: str) -> None:  # type: ignore[no-untyped-def, type-arg]
    mcfg = ModelConfig.from_pretrained(tiny_dir)
    with pytest.raises(FormatError, match=re.escape(message)):
        engine_formats(EngineConfig(**{"page_size": 4, "kv_cache_dtype": "kivi2", **flags}), mcfg)  # type: ignore[arg-type]


def test_kivi_engine_formats(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    """Defaults: key group = page size, residual = min(128, W); the SWA pool stores the model dtype
    (its layers and the residuals), whether its flag says auto or the same KIVI format."""
    mcfg = ModelConfig.from_pretrained(tiny_dir)
    for swa in (None, "auto", "kivi4"):
        f = engine_formats(EngineConfig(page_size=4, kv_cache_dtype="kivi4", kv_cache_dtype_swa=swa), mcfg)
        assert f[FULL] == KVFormat("kivi4", 0, 4, 8) and f[SWA] == KVFormat()
    assert residual_layers(f, mcfg) == len(mcfg.full_layers)
    # a per-token SWA format: the SWA layers and the residuals in it
    f8 = engine_formats(
        EngineConfig(page_size=4, kv_cache_dtype="kivi2", kv_cache_dtype_swa="fp8_e4m3"), mcfg
    )
    assert f8[FULL].kivi and f8[SWA] == KVFormat("fp8_e4m3")
    # page 16 > R = 8: the key group defaults to the page's largest divisor within R
    f16 = engine_formats(EngineConfig(page_size=16, kv_cache_dtype="kivi2"), mcfg)
    assert (f16[FULL].kivi_group, f16[FULL].residual) == (8, 8)
    # a 2-bit key row at head dim 32, group 4: 8 bytes of codes + 32 of the group's fp16 scale/zero
    assert KVFormat("kivi2", 0, 4, 8).row_bytes(32, 4, key=True) == 8 + 32
    assert KVFormat("kivi2", 8, 4, 8).row_bytes(16, 4) == 4 + 4 * 2  # values: 2 groups of 8 channels


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_rows_equal_the_block_quantizers(bits: int) -> None:
    """Paged rows (``kivi.pack_keys`` / ``pack_values``) hold exactly what the block quantizers
    give: each key group's scale and zero spread over its rows, value rows on their own."""
    k, v = _tensor(3, 12, 2, 32, 3, 1.0), _tensor(4, 5, 2, 16, 2, 1.0)
    rows = kivi.pack_keys(k, bits, 4)
    assert rows.shape == (12, 2, 32 * bits // 8 + 32) and rows.dtype == torch.uint8
    want = torch.cat([kivi_dequant(kivi_keys(k[i : i + 4], bits)) for i in range(0, 12, 4)])
    assert torch.equal(kivi.unpack_keys(rows, 32, bits, 4, torch.float32), want)
    # a group's rows are enough: the first group unpacks alone to the same values
    assert torch.equal(kivi.unpack_keys(rows[:4], 32, bits, 4, torch.float32), want[:4])
    vrows = kivi.pack_values(v, bits, 8)
    assert torch.equal(
        kivi.unpack_values(vrows, 16, bits, 8, torch.float32), kivi_dequant(kivi_values(v, bits, 8))
    )
    assert torch.equal(
        kivi.unpack_values(vrows[2:3], 16, bits, 8, torch.float32), kivi_dequant(kivi_values(v[2:3], bits, 8))
    )


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**31 - 1),
    g=st.sampled_from([4, 16, 32]),
    d=st.sampled_from([16, 48]),
    outliers=st.integers(0, 3),
)
def test_kivi_blocks_within_half_a_step(bits, seed, g, d, outliers) -> None:  # type: ignore[no-untyped-def]
    k = _tensor(seed, g, 2, d, outliers, 1.0)
    kb = kivi_keys(k, bits)
    assert kb.codes.shape == (g, 2, d * bits // 8) and kb.scale.shape == (1, 2, d)
    back = kivi_dequant(kb)
    # per channel: half a step, plus the fp16 rounding of scale (times the code) and zero point
    step = (k.amax(0) - k.amin(0)) / ((1 << bits) - 1)
    slack = 2**-10 * (k.abs().amax(0) + step * ((1 << bits) - 1))
    assert bool(((back - k).abs() <= step / 2 + slack + 1e-6).all())
    v = _tensor(seed + 1, g, 2, d, outliers, 1.0)
    vb = kivi_values(v, bits, 16)
    vback = kivi_dequant(vb)
    assert vback.shape == v.shape
    grp = v.reshape(g, 2, d // 16, 16)
    vstep = (grp.amax(-1) - grp.amin(-1)) / ((1 << bits) - 1)
    vslack = 2**-10 * (grp.abs().amax(-1) + vstep * ((1 << bits) - 1))
    assert bool(
        ((vback - v).abs().reshape(g, 2, d // 16, 16) <= (vstep / 2 + vslack)[..., None] + 1e-6).all()
    )


def test_kivi_keys_per_channel_beat_per_token_on_outlier_channels() -> None:
    """KIVI's observation (section 3.2): keys with outlier channels lose less per channel."""
    k = _tensor(7, 32, 2, 64, 4, 1.0)
    per_channel = (kivi_dequant(kivi_keys(k, 2)) - k).pow(2).mean()
    per_token = (kivi_dequant(kivi_values(k, 2, 64)) - k).pow(2).mean()
    assert per_channel < per_token / 2

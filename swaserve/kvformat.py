"""KV page formats: how one pool stores K and V (``--kv-cache-dtype``, ``--kv-cache-dtype-swa``).

``auto`` stores the model dtype. The per-token formats quantize each (token, KV head) row of K or V
on its own, as it is written, symmetric with one fp32 scale per ``group`` channels (absmax / qmax;
the row's scales stored after its data, in the same bytes: a packed row is
``[data: dim B | scales: 4 * dim / group B]``, uint8):

- ``fp8_e4m3`` (qmax 448, 3 mantissa bits), ``fp8_e5m2`` (qmax 57344, 2 bits): x / s cast to FP8
  (round to nearest even), as vLLM's FP8 KV cache but with a per-row scale instead of a static one;
- ``int8``: round(x / s) in [-127, 127] (the near-lossless INT8 KV of QServe / LMDeploy).

A row's bytes depend only on that row, so chunking, prefix hits from any tier, PD transfer and
speculation see the same bytes as a cold one-shot prefill; attention always reads the stored
(dequantized) K/V, its own chunk's too.

KIVI (arXiv:2402.02750, section 3): ``kivi_keys`` / ``kivi_values`` and their inverses quantize
a block asymmetrically to 2 or 4 bits (keys per channel over a group of tokens, values per token
over groups of channels; fp16 scale and zero point, codes packed little end first). The engine's
paged KIVI format (full-precision residual) is not built yet; ``check`` refuses it.

Error bounds (``error_bound``): int8 |x - x'| <= s / 2; FP8 with m mantissa bits and min normal
2^e |x - x'| <= max(|x| 2^-(m+1), s 2^(e-m-1)); KIVI |x - x'| <= s / 2 plus the fp16 rounding of
scale and zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig

AUTO = "auto"
ROW_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")
KIVI_FORMATS = ("kivi2", "kivi4")
FORMATS = (AUTO, *ROW_FORMATS, *KIVI_FORMATS)
SCALE_BYTES = 4  # fp32 scale per group of a per-token format

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
# (mantissa bits, exponent of the smallest normal) of the FP8 formats
_FP8_BITS = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}


class FormatError(ValueError):
    """A KV format that cannot be used (unknown name, a group not dividing a head dim, unbuilt)."""


@dataclass(frozen=True)
class KVFormat:
    """One pool's page format.

    Attributes:
        name: one of ``FORMATS``.
        group: channels per scale of a per-token format (divides every head dim of the pool);
            0 = one scale per (token, head) row.
    """

    name: str = AUTO
    group: int = 0

    @property
    def quantized(self) -> bool:
        return self.name != AUTO

    def _group(self, dim: int) -> int:
        return self.group or dim

    def check(self, dims: tuple[int, ...]) -> None:
        """Refuse a format this engine cannot store for head dims ``dims``.

        Raises:
            FormatError: unknown name, KIVI (not built), a group not dividing a dim.
        """
        if self.name not in FORMATS:
            raise FormatError(f"unknown KV cache dtype {self.name!r}; choose one of {', '.join(FORMATS)}")
        if self.name in KIVI_FORMATS:
            raise FormatError(
                f"--kv-cache-dtype {self.name}: the paged KIVI format (2/4-bit with a full-precision "
                "residual window) is not built yet; use fp8_e4m3, fp8_e5m2, int8 or auto"
            )
        if self.group < 0:
            raise FormatError(f"KV quantization group must be >= 0, got {self.group}")
        if self.quantized:
            for d in dims:
                if d % self._group(d):
                    raise FormatError(f"KV quantization group {self.group} does not divide head dim {d}")

    def row_bytes(self, dim: int, elem: int) -> int:
        """Bytes of one (token, head) row of width ``dim``; ``elem``: bytes of the model dtype."""
        if not self.quantized:
            return dim * elem
        return dim + SCALE_BYTES * (dim // self._group(dim))

    def token_bytes(self, heads: int, head_dim: int, v_head_dim: int, elem: int) -> int:
        """K + V bytes of one token in one layer."""
        return heads * (self.row_bytes(head_dim, elem) + self.row_bytes(v_head_dim, elem))

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the page tensors: the model's for ``auto``, else packed bytes (uint8)."""
        return model_dtype if not self.quantized else torch.uint8

    def describe(self) -> str:
        """The format as a page message and a cache key name it: ``auto`` or e.g.
        ``fp8_e4m3/g0/scale=f32-after-data``."""
        if not self.quantized:
            return AUTO
        return f"{self.name}/g{self.group}/scale=f32-after-data"

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize ``x [..., dim]`` (any float dtype) into packed rows ``[..., row_bytes]`` uint8;
        ``auto``: ``x`` unchanged."""
        if not self.quantized:
            return x
        dim = x.shape[-1]
        g = self._group(dim)
        xf = x.float().reshape(*x.shape[:-1], dim // g, g)
        qmax = _QMAX[self.name]
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        y = (xf / scale).clamp(-qmax, qmax)
        if self.name == "int8":
            data = torch.round(y).to(torch.int8).view(torch.uint8)
        else:
            data = y.to(_FP8[self.name]).view(torch.uint8)
        scales = scale.reshape(*x.shape[:-1], dim // g).contiguous().view(torch.uint8)
        return torch.cat((data.reshape(*x.shape[:-1], dim), scales), dim=-1)

    def unpack(self, b: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """Packed rows ``b [..., row_bytes]`` -> ``[..., dim]`` in ``dtype`` (``auto``: a cast)."""
        if not self.quantized:
            return b.to(dtype)
        g = self._group(dim)
        lead = b.shape[:-1]
        data = b[..., :dim].contiguous()
        q = data.view(torch.int8) if self.name == "int8" else data.view(_FP8[self.name])
        scale = b[..., dim:].contiguous().view(torch.float32)
        x = q.float().reshape(*lead, dim // g, g) * scale.reshape(*lead, dim // g, 1)
        # a written row is always finite; an unwritten slot (padding, a page's tail, bytes of the
        # other pool's layout in a shared arena) may read as NaN/inf, which a zero attention
        # weight would still carry into the output (0 * NaN): read those as 0
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        return x.reshape(*lead, dim).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Largest |x - unpack(pack(x))| the format allows, per element of ``x [..., dim]``."""
        if not self.quantized:
            return torch.zeros_like(x, dtype=torch.float32)
        dim = x.shape[-1]
        g = self._group(dim)
        xf = x.float().reshape(*x.shape[:-1], dim // g, g)
        amax = xf.abs().amax(dim=-1, keepdim=True)
        s = amax / _QMAX[self.name]
        if self.name == "int8":
            bound = (s / 2).expand_as(xf)
        else:
            m, e = _FP8_BITS[self.name]
            bound = torch.maximum(xf.abs() * 2.0 ** -(m + 1), (s * 2.0 ** (e - m - 1)).expand_as(xf))
        # the scale and x / s are rounded too: a few fp32 ulps of |x|
        return (bound + xf.abs() * 2.0**-21).reshape(x.shape)


AUTO_FORMAT = KVFormat()


def parse_format(name: str, group: int = 0) -> KVFormat:
    """``--kv-cache-dtype`` value -> ``KVFormat`` (checked later against the model's head dims).

    Raises:
        FormatError: unknown name.
    """
    if name not in FORMATS:
        raise FormatError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(FORMATS)}")
    return KVFormat(name, group)


def engine_formats(ecfg: EngineConfig, mcfg: ModelConfig) -> dict[str, KVFormat]:
    """Each pool's checked page format for an engine (``EngineConfig.kv_formats``).

    Raises:
        FormatError: a format this model cannot be stored in (``KVFormat.check``).
    """
    out = {}
    for kind, name in ecfg.kv_formats().items():
        fmt = parse_format(name, ecfg.kv_quant_group)
        shape = mcfg.full if kind == FULL else mcfg.swa
        fmt.check((shape.head_dim, shape.v_head_dim))
        out[kind] = fmt
    return out


POOL_NAMES = {FULL: "full", SWA: "swa"}  # the pools' names in stats, metrics and GetLoad


def format_label(dtype: str, formats: Mapping[str, KVFormat]) -> str:
    """One engine's KV identity for people and for comparing workers:
    ``"<dtype> full=<format> swa=<format>"`` (``KVFormat.describe``), e.g.
    ``"bfloat16 full=int8/g0/scale=f32-after-data swa=auto"``."""
    return " ".join(
        [dtype, *(f"{POOL_NAMES[k]}={formats[k].describe()}" for k in (FULL, SWA) if k in formats)]
    )


# --- KIVI (arXiv:2402.02750): asymmetric 2/4-bit blocks --------------------------------------


@dataclass(frozen=True)
class KiviBlock:
    """One quantized block: ``codes`` uint8 (``8 / bits`` codes per byte, along the last axis),
    ``scale`` and ``zero`` fp16, ``x' = code * scale + zero``; ``shape`` of the original."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    shape: tuple[int, ...]


def _pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    q = q.to(torch.uint8)
    n = q.shape[-1]
    pad = (-n) % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.reshape(*q.shape[:-1], -1, per)
    out = torch.zeros(q.shape[:-1], dtype=torch.uint8, device=q.device)
    for i in range(per):
        out |= q[..., i] << (bits * i)
    return out


def _unpack_bits(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(codes >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*codes.shape[:-1], -1)[..., :n]


def _asym(x: torch.Tensor, bits: int, dim: int) -> KiviBlock:
    xf = x.float()
    mn = xf.amin(dim=dim, keepdim=True)
    mx = xf.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((mx - mn) / levels).half()
    zero = mn.half()
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((xf - zero.float()) / s).clamp(0, levels)
    return KiviBlock(_pack_bits(q, bits), scale, zero, bits, tuple(x.shape))


def _deq(b: KiviBlock) -> torch.Tensor:
    q = _unpack_bits(b.codes, b.bits, b.shape[-1]).float()
    return q * b.scale.float() + b.zero.float()


def kivi_keys(k: torch.Tensor, bits: int) -> KiviBlock:
    """Keys ``k [G, H, D]`` (one group of G tokens) per channel: a scale and zero per (head,
    channel) over the G tokens. Raises FormatError for bits other than 2 or 4."""
    if bits not in (2, 4):
        raise FormatError(f"KIVI bits must be 2 or 4, got {bits}")
    return _asym(k, bits, dim=0)


def kivi_values(v: torch.Tensor, bits: int, group: int) -> KiviBlock:
    """Values ``v [T, H, D]`` per token: a scale and zero per (token, head, ``group`` channels).

    Raises:
        FormatError: bits not 2 or 4, or ``group`` not dividing D."""
    if bits not in (2, 4):
        raise FormatError(f"KIVI bits must be 2 or 4, got {bits}")
    t, h, d = v.shape
    if group <= 0 or d % group:
        raise FormatError(f"KIVI value group {group} does not divide head dim {d}")
    blk = _asym(v.reshape(t, h, d // group, group), bits, dim=-1)
    return blk


def kivi_dequant(b: KiviBlock) -> torch.Tensor:
    """The block back in fp32, shaped as it was quantized (``[G, H, D]`` or ``[T, H, D]``)."""
    x = _deq(b)
    return x.reshape(b.shape[0], b.shape[1], -1) if len(b.shape) == 4 else x

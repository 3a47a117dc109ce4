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

``kivi2`` / ``kivi4`` (arXiv:2402.02750, rows in ``swaserve.kivi``), full pool only: values
quantized per token as written, keys per channel when their group of G tokens completes, and a
query at position q reads keys and values at positions <= q - R from the quantized pages and the
most recent R (``residual``) in full precision. The full-precision copy is one more SWA layer
per full layer in the SWA pool (``config.kv_config``): it lives W tokens like SWA KV, is cached,
moved to the host tier and transferred with it, and the SWA pool stays in the model dtype (or,
named, a per-token format, which then holds the residual too: read at 8 bits). The
rule depends only on q, so chunking and hits read what a one-shot prefill reads; G dividing the
page size keeps every cached (whole) page's groups quantized.

Error bounds (``error_bound``): int8 |x - x'| <= s / 2; FP8 with m mantissa bits and min normal
2^e |x - x'| <= max(|x| 2^-(m+1), s 2^(e-m-1)); KIVI |x - x'| <= s / 2 plus the fp16 rounding of
scale and zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

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
        group: channels per scale of a per-token format, or per scale and zero of a KIVI value
            row (divides every head dim of the pool); 0 = one per (token, head) row.
        kivi_group: KIVI: tokens per key group G (divides the page size).
        residual: KIVI: the most recent R tokens a query reads in full precision (G <= R <= W).
        sinks: full pool: the first S prompt tokens' K/V read in full precision (attention
            sinks, ``engine.sinks``), not from the pages; 0 = none.
    """

    name: str = AUTO
    group: int = 0
    kivi_group: int = 0
    residual: int = 0
    sinks: int = 0

    @property
    def quantized(self) -> bool:
        return self.name != AUTO

    @property
    def kivi(self) -> bool:
        """A KIVI format: keys quantized per group of tokens, a full-precision residual."""
        return self.name in KIVI_FORMATS

    @property
    def bits(self) -> int:
        return int(self.name.removeprefix("kivi")) if self.kivi else 8

    def _group(self, dim: int) -> int:
        return self.group or dim

    def check(self, dims: tuple[int, ...]) -> None:
        """Refuse a format this engine cannot store for head dims ``dims``.

        Raises:
            FormatError: unknown name, KIVI (not built), a group not dividing a dim.
        """
        if self.name not in FORMATS:
            raise FormatError(f"unknown KV cache dtype {self.name!r}; choose one of {', '.join(FORMATS)}")
        if self.group < 0:
            raise FormatError(f"KV quantization group must be >= 0, got {self.group}")
        if self.quantized:
            for d in dims:
                if d % self._group(d):
                    raise FormatError(f"KV quantization group {self.group} does not divide head dim {d}")
                if self.kivi and (self._group(d) * self.bits) % 8:
                    raise FormatError(
                        f"KIVI value group {self._group(d)} x {self.bits} bits is not whole bytes"
                    )
        if self.kivi:
            g = self.kivi_group
            dk = dims[0]
            if g < 1 or (4 * dk) % g or (dk * self.bits) % 8:
                raise FormatError(f"KIVI key group {g} must be >= 1 and divide 4 x head dim {dk}")

    def row_bytes(self, dim: int, elem: int, key: bool = False) -> int:
        """Bytes of one (token, head) row of width ``dim``; ``elem``: bytes of the model dtype;
        ``key``: a K row (KIVI's differ from V rows, ``swaserve.kivi``)."""
        if not self.quantized:
            return dim * elem
        if self.kivi:
            meta = 4 * dim // self.kivi_group if key else 4 * (dim // self._group(dim))
            return dim * self.bits // 8 + meta
        return dim + SCALE_BYTES * (dim // self._group(dim))

    def token_bytes(self, heads: int, head_dim: int, v_head_dim: int, elem: int) -> int:
        """K + V bytes of one token in one layer."""
        return heads * (self.row_bytes(head_dim, elem, key=True) + self.row_bytes(v_head_dim, elem))

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the page tensors: the model's for ``auto``, else packed bytes (uint8)."""
        return model_dtype if not self.quantized else torch.uint8

    def describe(self) -> str:
        """The format as a page message and a cache key name it: ``auto`` or e.g.
        ``fp8_e4m3/g0/scale=f32-after-data``."""
        if not self.quantized:
            return AUTO
        sink = f"/sink{self.sinks}" if self.sinks else ""
        if self.kivi:
            return f"{self.name}/g{self.group}/kg{self.kivi_group}/r{self.residual}/scale-zero=f16{sink}"
        return f"{self.name}/g{self.group}/scale=f32-after-data{sink}"

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize ``x [..., dim]`` (any float dtype) into packed rows ``[..., row_bytes]`` uint8;
        ``auto``: ``x`` unchanged."""
        if not self.quantized:
            return x
        if self.kivi:
            raise FormatError("KIVI rows are packed by swaserve.kivi (keys need their whole group)")
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
        if self.kivi:
            raise FormatError("KIVI rows are unpacked by swaserve.kivi")
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

    KIVI on the full pool (``kivi_format``) keeps its residual in the SWA pool, which then stores
    the model dtype by default; KIVI named for the SWA pool means the same (a SWA key never leaves
    a residual of W tokens), and needs R = W. A per-token SWA format (``--kv-cache-dtype-swa
    fp8_e4m3``) stores the residual in that format too: the last R tokens are read at 8 bits, not
    in full precision.

    Raises:
        FormatError: a format this model cannot be stored in (``KVFormat.check``, ``kivi_format``).
    """
    names = ecfg.kv_formats()
    kivi = any(n in KIVI_FORMATS for n in names.values())
    if not kivi and (ecfg.kv_kivi_group or ecfg.kv_kivi_residual):
        raise FormatError("--kv-kivi-group / --kv-kivi-residual apply to kivi2 / kivi4 only")
    if ecfg.kv_quant_group and all(n == AUTO for n in names.values()):
        raise FormatError("--kv-quant-group applies to a quantized --kv-cache-dtype(-swa) only")
    out: dict[str, KVFormat] = {}
    if names[FULL] in KIVI_FORMATS:
        out[FULL] = kivi_format(ecfg, mcfg)
        if ecfg.kv_cache_dtype_swa is None:  # the SWA pool holds the residuals: the model dtype
            out[SWA] = KVFormat()
    if SWA not in out and names[SWA] in KIVI_FORMATS:
        residual = ecfg.kv_kivi_residual or min(DEFAULT_RESIDUAL, mcfg.window)
        if residual != mcfg.window:
            raise FormatError(
                f"--kv-cache-dtype-swa {names[SWA]}: SWA keys never leave the window, so KIVI there "
                f"means storing them unquantized, which needs --kv-kivi-residual = W ({mcfg.window}), "
                f"not {residual}; or name another SWA format"
            )
        out[SWA] = KVFormat()
    for kind, name in names.items():
        if kind in out:
            continue
        fmt = parse_format(name, ecfg.kv_quant_group)
        shape = mcfg.full if kind == FULL else mcfg.swa
        fmt.check((shape.head_dim, shape.v_head_dim))
        out[kind] = fmt
    if ecfg.kv_sink_tokens:
        out[FULL] = replace(out[FULL], sinks=_sink_tokens(ecfg, out[FULL]))
    return out


MAX_SINK_TOKENS = 64


def _sink_tokens(ecfg: EngineConfig, full: KVFormat) -> int:
    """``--kv-sink-tokens``, checked against the full pool's format and the engine.

    Raises:
        FormatError: an unquantized full pool, more than ``MAX_SINK_TOKENS``, or EP (the sinks'
            own forward runs on one rank, outside the ranks' collectives).
    """
    n = ecfg.kv_sink_tokens
    if not full.quantized:
        raise FormatError(
            "--kv-sink-tokens keeps the first tokens of a quantized full pool in full precision: "
            "name a quantized --kv-cache-dtype"
        )
    if not 0 < n <= MAX_SINK_TOKENS:
        raise FormatError(f"--kv-sink-tokens must be 1..{MAX_SINK_TOKENS}, got {n}")
    if ecfg.ep_size > 1:
        raise FormatError("--kv-sink-tokens with --ep-size > 1 is not built (the sinks' forward is per rank)")
    return n


def residual_layers(formats: Mapping[str, KVFormat], mcfg: ModelConfig) -> int:
    """SWA layers the pools hold for KIVI residuals: one per full layer under KIVI, else 0."""
    return len(mcfg.full_layers) if formats[FULL].kivi else 0


DEFAULT_RESIDUAL = 128  # KIVI's residual length (arXiv:2402.02750, section 4)


def kivi_format(ecfg: EngineConfig, mcfg: ModelConfig) -> KVFormat:
    """The full pool's KIVI format: bits from the name, value channel group ``kv_quant_group``,
    key group G = ``kv_kivi_group`` (0: the page size, or its largest divisor <= R), residual
    R = ``kv_kivi_residual`` (0: min(128, W)). The residual of each full layer lives in the SWA pool as one more SWA layer
    (``config.kv_config``), so the full layers' KV rows must fit SWA rows.

    Raises:
        FormatError: no SWA layers; the full layout; full-layer KV wider than SWA rows; G not
            dividing the page size; not G <= R <= W; a group not dividing a head dim.
    """
    name = ecfg.kv_cache_dtype
    f, s, w = mcfg.full, mcfg.swa, mcfg.window
    if not mcfg.swa_layers:
        raise FormatError(
            f"{name} keeps its full-precision residual in the SWA pool: the model has no SWA layers"
        )
    if (f.head_dim, f.v_head_dim) != (s.head_dim, s.v_head_dim) or f.num_kv_heads > s.num_kv_heads:
        raise FormatError(
            f"{name}: the full layers' KV ({f.num_kv_heads} heads x {f.head_dim}/{f.v_head_dim}) must fit "
            f"SWA rows ({s.num_kv_heads} heads x {s.head_dim}/{s.v_head_dim}) to keep their residual there"
        )
    if ecfg.kv_layout == "full":
        raise FormatError(
            f"{name} keeps its residual as SWA layers, which --kv-layout full keeps for every token: "
            "it would take more memory than auto; use the hybrid layout"
        )
    r = ecfg.kv_kivi_residual or min(DEFAULT_RESIDUAL, w)
    # default key group: the page size, or its largest divisor within the residual
    g = ecfg.kv_kivi_group or max(
        d for d in range(1, ecfg.page_size + 1) if ecfg.page_size % d == 0 and d <= r
    )
    if ecfg.page_size % g:
        raise FormatError(f"KIVI key group {g} must divide the page size {ecfg.page_size} (--kv-kivi-group)")
    if not g <= r <= w:
        raise FormatError(
            f"KIVI needs key group <= residual <= window: {g} <= {r} <= {w} does not hold "
            "(--kv-kivi-group, --kv-kivi-residual)"
        )
    fmt = KVFormat(name, ecfg.kv_quant_group, g, r)
    fmt.check((f.head_dim, f.v_head_dim))
    return fmt


POOL_NAMES = {FULL: "full", SWA: "swa"}  # the pools' names in stats, metrics and GetLoad


def format_label(dtype: str, formats: Mapping[str, KVFormat]) -> str:
    """One engine's KV identity for people and for comparing workers:
    ``"<dtype> full=<format> swa=<format>"`` (``KVFormat.describe``), e.g.
    ``"bfloat16 full=int8/g0/scale=f32-after-data swa=auto"``."""
    return " ".join(
        [dtype, *(f"{POOL_NAMES[k]}={formats[k].describe()}" for k in (FULL, SWA) if k in formats)]
    )

"""KIVI (arXiv:2402.02750, section 3): asymmetric 2/4-bit KV quantization, keys per channel over a
group of tokens, values per token over groups of channels, fp16 scale and zero point
(``x' = code * scale + zero``), codes packed little end first (``8 / bits`` per byte).

Block quantizers (``kivi_keys``, ``kivi_values``, ``kivi_dequant``) and the paged rows a KIVI pool
stores (``pack_values`` / ``unpack_values`` per token; ``pack_keys`` / ``unpack_keys`` per group of
G tokens). A page row is one (token, head):

- value row: ``[codes: dv * bits / 8 B | scales: 2 * dv / gv B | zeros: 2 * dv / gv B]``;
- key row of token ``t``: ``[codes: dk * bits / 8 B | slice t % G of the group's (scales | zeros),
  4 * dk / G B]``: a key group's fp16 scale and zero per channel are spread over its G rows, so
  pages, tiers and transfers keep moving whole rows, and a group is whole inside one page when G
  divides the page size.

Error bound: ``|x - x'| <= scale / 2`` plus the fp16 rounding of scale and zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KiviError(ValueError):
    """Bits other than 2 or 4, or a group that does not divide its axis."""


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
    return torch.stack(parts, dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * per)[..., :n]


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
    channel) over the G tokens. Raises KiviError for bits other than 2 or 4."""
    if bits not in (2, 4):
        raise KiviError(f"KIVI bits must be 2 or 4, got {bits}")
    return _asym(k, bits, dim=0)


def kivi_values(v: torch.Tensor, bits: int, group: int) -> KiviBlock:
    """Values ``v [T, H, D]`` per token: a scale and zero per (token, head, ``group`` channels).

    Raises:
        KiviError: bits not 2 or 4, or ``group`` not dividing D."""
    if bits not in (2, 4):
        raise KiviError(f"KIVI bits must be 2 or 4, got {bits}")
    t, h, d = v.shape
    if group <= 0 or d % group:
        raise KiviError(f"KIVI value group {group} does not divide head dim {d}")
    blk = _asym(v.reshape(t, h, d // group, group), bits, dim=-1)
    return blk


def kivi_dequant(b: KiviBlock) -> torch.Tensor:
    """The block back in fp32, shaped as it was quantized (``[G, H, D]`` or ``[T, H, D]``)."""
    x = _deq(b)
    return x.reshape(b.shape[0], b.shape[1], -1) if len(b.shape) == 4 else x


# --- paged rows ------------------------------------------------------------------------------


def _bytes16(x: torch.Tensor) -> torch.Tensor:
    """fp16 ``x [..., n]`` as its bytes ``[..., 2n]`` uint8."""
    return x.contiguous().view(torch.uint8)


def _half(b: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., 2n]`` as fp16 ``[..., n]``."""
    return b.contiguous().view(torch.float16)


def pack_values(v: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Value rows ``v [T, H, dv]`` -> packed rows ``[T, H, dv * bits / 8 + 4 * dv / group]`` uint8
    (module doc). ``group``: channels per scale and zero (divides dv)."""
    t, h, _ = v.shape
    blk = kivi_values(v, bits, group)  # codes [T, H, dv/g, g*bits/8]; scale, zero [T, H, dv/g, 1]
    codes = blk.codes.reshape(t, h, -1)
    return torch.cat((codes, _bytes16(blk.scale[..., 0]), _bytes16(blk.zero[..., 0])), dim=-1)


def unpack_values(rows: torch.Tensor, dv: int, bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed value rows ``[T, H, row]`` -> ``[T, H, dv]`` in ``dtype``."""
    t, h, _ = rows.shape
    n, cb = dv // group, dv * bits // 8
    q = _unpack_bits(rows[..., :cb].reshape(t, h, n, cb // n), bits, group).float()
    scale = _half(rows[..., cb : cb + 2 * n]).float()
    zero = _half(rows[..., cb + 2 * n : cb + 4 * n]).float()
    x = q * scale[..., None] + zero[..., None]
    return x.reshape(t, h, dv).to(dtype)


def pack_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys of whole groups ``k [n * G, H, dk]`` (``group`` = G tokens, in order) -> packed rows
    ``[n * G, H, dk * bits / 8 + 4 * dk / G]`` uint8: per group a scale and zero per (head,
    channel), their bytes spread over the group's rows (module doc).

    Raises:
        KiviError: a token count not a multiple of G, or 4 * dk not a multiple of G.
    """
    t, h, d = k.shape
    if t % group or (4 * d) % group:
        raise KiviError(f"KIVI key group {group} must divide the tokens ({t}) and 4 x head dim ({4 * d})")
    n = t // group
    blk = kivi_keys(k.reshape(n, group, h, d).transpose(0, 1), bits)  # per group, over its G tokens
    codes = blk.codes.transpose(0, 1)  # [n, G, H, d*bits/8]
    meta = torch.cat((_bytes16(blk.scale[0]), _bytes16(blk.zero[0])), dim=-1)  # [n, H, 4d]
    meta = meta.reshape(n, h, group, -1).transpose(1, 2)  # [n, G, H, 4d/G]: slice t of the group
    return torch.cat((codes, meta), dim=-1).reshape(t, h, -1)


def unpack_keys(rows: torch.Tensor, dk: int, bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed key rows of whole groups ``[n * G, H, row]`` -> ``[n * G, H, dk]`` in ``dtype``."""
    t, h, w = rows.shape
    n, cb = t // group, dk * bits // 8
    r = rows.reshape(n, group, h, w)
    q = _unpack_bits(r[..., :cb], bits, dk).float()  # [n, G, H, dk]
    meta = r[..., cb:].transpose(1, 2).reshape(n, h, 4 * dk)  # the group's slices back in order
    scale, zero = _half(meta[..., : 2 * dk]).float(), _half(meta[..., 2 * dk :]).float()
    x = q * scale[:, None] + zero[:, None]
    return x.reshape(t, h, dk).to(dtype)

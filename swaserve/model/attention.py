"""Attention over paged KV, with per-head sinks and sliding windows.

Per attention kind and layer, ``k_cache [rows, page_size, num_kv_heads, head_dim]`` and
``v_cache [..., v_head_dim]`` (``swaserve.paged``: slot = row * page_size + offset, a row being a page
or an arena unit); ``KindMeta`` gives the write slots and each sequence's key slots and mask, in the
rows of the layer's group. Sinks (gpt-oss / MiMo-V2): one learned logit per head in the
softmax denominator, ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``. A quantized pool
(``KindMeta.fmt``, ``swaserve.kvformat``) stores packed rows: new K/V are packed as they are
written, and every read (the step's own rows too) dequantizes, so a key reads the same whether it
was written now, in an earlier chunk or came from a cache.

Design notes: docs/DESIGN.md#modelattentionpy"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from swaserve import kivi
from swaserve.config import FULL, ModelConfig
from swaserve.kvformat import KVFormat
from swaserve.model.layers import PartialRope
from swaserve.paged import at, put


@dataclass
class SeqAttn:
    """One sequence's attention view for one kind.

    Attributes:
        q_start, q_len: rows of this sequence's new tokens in the flat batch.
        kv_slots: [L_kv] int64 pool slots of the keys it reads (positions ``kv_pos``, ascending).
        mask: [q_len, L_kv] bool, True where the query may attend; None = all allowed.
        seq: the sequence's index among the step's spans (``SinkKV``).
    """

    q_start: int
    q_len: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    seq: int = 0


@dataclass
class MultiAttn:
    """Short queries of B sequences, ``Lq`` rows each, attended in one batched call (verify chunks
    of speculative decoding, the draft layers' rows).

    Attributes:
        rows: [B, Lq] int64 rows of the flat batch; kv_slots: [B, L] int64 key slots (padded);
        mask: [B, Lq, L] bool, True where the query may attend (False on padding); seqs: [B]
        int64 the sequences' indices among the step's spans.
    """

    rows: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    seqs: torch.Tensor | None = None


@dataclass
class KiviSpan:
    """One sequence's rows in a KIVI full layer (``swaserve.kvformat``): flat rows ``row ..`` hold
    its new positions ``[start, end)``; ``full_slots`` [end] full-pool slots of ``[0, end)`` (the
    layer's unit group); ``resid_slots``: per SWA unit group, [end - lo] slots of the residual's
    positions ``[lo, end)``, ``lo = max(0, start - W)``; ``mask`` [end - start, c + end - lo] bool
    (``kivi_mask``), the same for every full layer of the step; ``seq``: its index among the
    step's spans."""

    row: int
    start: int
    end: int
    lo: int
    full_slots: torch.Tensor
    resid_slots: dict[int, torch.Tensor]
    mask: torch.Tensor
    seq: int = 0


@dataclass
class SinkKV:
    """One full layer's attention sinks in full precision (``engine.sinks``): ``k [E, S, Hkv, Dk]``,
    ``v [E, S, Hkv, Dv]`` in the model dtype, and per span of the step (``kind_meta`` order)
    ``entry [N]`` int64 and ``count [N]`` int64: the span's keys and values at positions
    ``< count`` are ``k[entry, pos]``, ``v[entry, pos]``, not what the pages hold."""

    k: torch.Tensor
    v: torch.Tensor
    entry: torch.Tensor
    count: torch.Tensor

    def over(
        self, kk: torch.Tensor, vv: torch.Tensor, seqs: torch.Tensor, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``kk, vv [B, L, H, D]`` of spans ``seqs [B]`` at positions ``first ..
        first + L - 1`` with the sink positions taken from the sinks (new tensors)."""
        s = self.k.shape[1]
        m = max(0, min(s, first + kk.shape[1]) - first)  # columns that may hold a sink position
        if m == 0:
            return kk, vv
        seqs = seqs.to(self.entry.device)
        entry, count = self.entry[seqs], self.count[seqs]
        pos = torch.arange(first, first + m, device=kk.device)
        sel = (pos[None, :] < count[:, None].to(kk.device))[..., None, None]  # [B, m, 1, 1]
        sk = self.k[entry][:, first : first + m].to(kk.device, kk.dtype)
        sv = self.v[entry][:, first : first + m].to(vv.device, vv.dtype)
        kk, vv = kk.clone(), vv.clone()
        kk[:, :m] = torch.where(sel, sk, kk[:, :m])
        vv[:, :m] = torch.where(sel, sv, vv[:, :m])
        return kk, vv


@dataclass
class SinkTokens:
    """A step's sink tokens for every full layer: ``k [n_full, E, S, Hkv, Dk]``, ``v [n_full, E,
    S, Hkv, Dv]`` (entries padded to S), ``entry``/``count`` [N] per span (``SinkKV``)."""

    k: torch.Tensor
    v: torch.Tensor
    entry: torch.Tensor
    count: torch.Tensor

    def layer(self, j: int) -> SinkKV:
        """Full layer ``j``'s (index among the full layers)."""
        return SinkKV(self.k[j], self.v[j], self.entry, self.count)


def kivi_mask(start: int, end: int, lo: int, residual: int, device: torch.device) -> torch.Tensor:
    """Which keys a KIVI span's queries ``[start, end)`` read: the packed positions ``[0, c)``,
    ``c = max(0, end - R)``, where ``pos <= q - R``, then the residual's ``[lo, end)`` where
    ``q - R < pos <= q``. Returns [end - start, c + end - lo] bool."""
    c = max(0, end - residual)
    q = torch.arange(start, end, device=device)[:, None]
    rpos = torch.arange(lo, end, device=device)[None, :]
    packed = torch.arange(c, device=device)[None, :] <= q - residual
    return torch.cat((packed, (rpos > q - residual) & (rpos <= q)), dim=1)


@dataclass
class KindMeta:
    """Per-step attention metadata for one attention kind.

    Attributes:
        write_slots: [T] int64 pool slot of each new token's K/V.
        prefills: sequences handled one by one (q_len > 1).
        decode_rows: [B] rows of single-token queries batched together; decode_slots [B, L] their
            key slots (padded), decode_mask [B, L] bool validity, decode_seqs [B] their spans.
        multi: groups of short multi-row queries batched together (``MultiAttn``).
        fmt: the pool's page format (``auto``: the model dtype, nothing packed).
        kivi: a KIVI full pool: the sequences (``KiviSpan``), instead of the fields above;
            resid_fmt: the SWA pool's format its residual is stored in.
    """

    write_slots: torch.Tensor
    prefills: list[SeqAttn] = field(default_factory=list)
    multi: list[MultiAttn] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_seqs: torch.Tensor | None = None
    fmt: KVFormat = field(default_factory=KVFormat)
    kivi: list[KiviSpan] | None = None
    resid_fmt: KVFormat = field(default_factory=KVFormat)


# Queries of at most this many rows (verify chunks, draft-layer rows) of several sequences are
# attended in one batched call per length (``MultiAttn``) instead of one call per sequence.
MULTI_MAX_ROWS = 16


def kind_meta(
    spans: Sequence[tuple[str, int, int]],
    slots_of: Callable[[str, int, int], torch.Tensor],
    window: int | None,
    locate: Callable[[torch.Tensor], torch.Tensor],
    dev: torch.device,
    fmt: KVFormat | None = None,
) -> KindMeta:
    """Attention metadata of one kind (one unit group) for query spans ``(request id, start, end)``
    laid out back to back: each span writes its positions' K/V and reads ``[start - window, end)``
    (``[0, end)`` for full attention) under the causal window mask; a 1-row span takes the batched
    decode path. ``slots_of(rid, lo, end)``: pool slots of positions ``lo .. end-1``; ``locate``:
    pool slots -> row slots of the group; ``fmt``: the pool's page format."""
    writes: list[torch.Tensor] = []
    prefills: list[SeqAttn] = []
    dec_rows: list[int] = []
    dec_slots: list[torch.Tensor] = []
    dec_seqs: list[int] = []
    # q_len -> (row, slots, mask, seq)
    short: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, int]]] = {}
    row = 0
    for seq, (rid, start, end) in enumerate(spans):
        n = end - start
        writes.append(locate(slots_of(rid, start, end)))
        lo = 0 if window is None else max(0, start - window)
        slots = locate(slots_of(rid, lo, end))
        if n == 1:
            dec_rows.append(row)
            dec_slots.append(slots)
            dec_seqs.append(seq)
        else:
            kv_pos = torch.arange(lo, end, dtype=torch.int64)
            q_pos = torch.arange(start, end, dtype=torch.int64)
            mask = kv_pos[None, :] <= q_pos[:, None]
            if window is not None:
                mask &= kv_pos[None, :] >= q_pos[:, None] - window
            if n <= MULTI_MAX_ROWS:
                short.setdefault(n, []).append((row, slots, mask, seq))
            else:
                prefills.append(SeqAttn(row, n, slots.to(dev), mask.to(dev), seq))
        row += n
    meta = KindMeta(write_slots=torch.cat(writes).to(dev), prefills=prefills, fmt=fmt or KVFormat())
    for n, group in short.items():
        if len(group) == 1:  # alone: nothing to batch
            r, slots, mask, seq = group[0]
            prefills.append(SeqAttn(r, n, slots.to(dev), mask.to(dev), seq))
            continue
        width = max(len(sl) for _, sl, _, _ in group)
        masks = torch.zeros(len(group), n, width, dtype=torch.bool)
        for i, (_, sl, mk, _) in enumerate(group):
            masks[i, :, : len(sl)] = mk
        rows = torch.tensor([r for r, _, _, _ in group], dtype=torch.int64)[:, None] + torch.arange(n)
        padded = pad_sequence([sl for _, sl, _, _ in group], batch_first=True)
        seqs = torch.tensor([q for _, _, _, q in group], dtype=torch.int64)
        meta.multi.append(MultiAttn(rows.to(dev), padded.to(dev), masks.to(dev), seqs))
    if dec_rows:
        lengths = torch.tensor([len(s) for s in dec_slots])
        slots_pad = pad_sequence(dec_slots, batch_first=True)
        valid = torch.arange(slots_pad.shape[1])[None, :] < lengths[:, None]
        meta.decode_rows = torch.tensor(dec_rows, dtype=torch.int64, device=dev)
        meta.decode_slots = slots_pad.to(dev)
        meta.decode_mask = valid.to(dev)
        meta.decode_seqs = torch.tensor(dec_seqs, dtype=torch.int64)
    return meta


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends. One implementation per device kind."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: KindMeta,
        sinks: torch.Tensor | None,
        scale: float,
        residual: tuple[torch.Tensor, torch.Tensor, int] | None = None,
        sink_kv: SinkKV | None = None,
    ) -> torch.Tensor:
        """Args: q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv]; caches [rows, P, Hkv, D] as in the module doc;
        sinks [Hq] or None; ``residual``: a KIVI layer's full-precision residual (its SWA-pool K and V
        caches, [rows, P, H_swa >= Hkv, D], and their unit group); ``sink_kv``: a full layer's
        first tokens in full precision (read instead of the pages). Returns [T, Hq, Dv]."""


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Batched grouped-query attention.

    q [B, Lq, Hq, Dk], k [B, Lk, Hkv, Dk], v [B, Lk, Hkv, Dv], mask [B, Lq, Lk] bool or None.
    Returns [B, Lq, Hq, Dv].
    """
    b, lq, hq, dk = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    # fold the query heads of each KV group into the row axis: one matmul per (batch, kv head)
    qg = q.view(b, lq, hkv, g, dk).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, dk)
    kk = k.permute(0, 2, 3, 1)  # [B, Hkv, Dk, Lk]
    vv = v.permute(0, 2, 1, 3)  # [B, Hkv, Lk, Dv]
    scores = torch.matmul(qg, kk).view(b, hkv, g, lq, lk) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, lq, 1)
        scores = torch.cat((scores, sink), dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs.reshape(b, hkv, g * lq, lk).to(vv.dtype), vv)  # [B, Hkv, g*Lq, Dv]
    return out.view(b, hkv, g, lq, -1).permute(0, 3, 1, 2, 4).reshape(b, lq, hq, -1)


class TorchPagedAttention(AttentionBackend):
    """Pure-torch reference backend (CPU or CUDA): gathers each sequence's slots and attends."""

    def forward(self, q, k, v, k_cache, v_cache, meta, sinks, scale, residual=None, sink_kv=None):  # type: ignore[no-untyped-def]
        if meta.kivi is not None:
            assert residual is not None, "a KIVI layer reads its residual"
            return _kivi_attend(q, k, v, k_cache, v_cache, meta, residual, sinks, scale, sink_kv)
        fmt, dk, dv = meta.fmt, k.shape[-1], v.shape[-1]
        put(k_cache, meta.write_slots, fmt.pack(k))
        put(v_cache, meta.write_slots, fmt.pack(v))

        def kv(slots: torch.Tensor, seqs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            """K, V [B, L, H, D] of ``slots [B, L]`` (a full layer's: positions 0 ..)."""
            kk, vv = fmt.unpack(at(k_cache, slots), dk, q.dtype), fmt.unpack(at(v_cache, slots), dv, q.dtype)
            return (kk, vv) if sink_kv is None or seqs is None else sink_kv.over(kk, vv, seqs)

        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for s in meta.prefills:
            qs = q[s.q_start : s.q_start + s.q_len].unsqueeze(0)
            ks, vs = kv(s.kv_slots[None], torch.tensor([s.seq]))
            m = None if s.mask is None else s.mask.unsqueeze(0)
            out[s.q_start : s.q_start + s.q_len] = _attend(qs, ks, vs, m, sinks, scale)[0]
        for m in meta.multi:
            km, vm = kv(m.kv_slots, m.seqs)  # [B, L, Hkv, Dk]
            out[m.rows] = _attend(q[m.rows], km, vm, m.mask, sinks, scale)
        if meta.decode_rows is not None:
            assert meta.decode_slots is not None and meta.decode_mask is not None
            qd = q[meta.decode_rows].unsqueeze(1)  # [B, 1, Hq, Dk]
            kd, vd = kv(meta.decode_slots, meta.decode_seqs)  # [B, L, Hkv, Dk]
            out[meta.decode_rows] = _attend(qd, kd, vd, meta.decode_mask.unsqueeze(1), sinks, scale)[:, 0]
        return out


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [n, h, d]`` widened to ``heads`` heads with zeros (full-layer rows in SWA-pool rows)."""
    return (
        x
        if x.shape[1] == heads
        else torch.cat((x, x.new_zeros(x.shape[0], heads - x.shape[1], x.shape[2])), 1)
    )


def _kivi_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: KindMeta,
    residual: tuple[torch.Tensor, torch.Tensor, int],
    sinks: torch.Tensor | None,
    scale: float,
    sink_kv: SinkKV | None = None,
) -> torch.Tensor:
    """A KIVI full layer, sequence by sequence (``swaserve.kvformat``): new K/V go to the
    full-precision residual, values are packed per token, keys of every group completing in
    ``[start, end)`` are packed from the residual; a query at q reads positions <= q - R from the
    packed pages and ``(q - R, q]`` from the residual, one softmax over both; sink positions
    (``sink_kv``) read the sinks on either side."""
    fmt, rf, (rk, rv, rg) = meta.fmt, meta.resid_fmt, residual
    bits, g, r = fmt.bits, fmt.kivi_group, fmt.residual
    hkv, dk, dv = k.shape[1], k.shape[-1], v.shape[-1]
    gv = fmt.group or dv
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    assert meta.kivi is not None
    for s in meta.kivi:
        rows = slice(s.row, s.row + s.end - s.start)
        res = s.resid_slots[rg]
        put(rk, res[s.start - s.lo :], rf.pack(_pad_heads(k[rows], rk.shape[2])))
        put(rv, res[s.start - s.lo :], rf.pack(_pad_heads(v[rows], rv.shape[2])))
        put(v_cache, s.full_slots[s.start :], kivi.pack_values(v[rows], bits, gv))
        first, last = (s.start + g) // g - 1, s.end // g  # key groups completing in [start, end)
        if last > first:  # packed from the residual as stored (an 8-bit SWA pool: its codes)
            a, b = first * g, last * g
            whole = rf.unpack(at(rk, res[a - s.lo : b - s.lo]), dk, q.dtype)[:, :hkv]
            put(k_cache, s.full_slots[a:b], kivi.pack_keys(whole, bits, g))
        c = max(0, s.end - r)  # positions the last query reads packed (whole groups, R >= G)
        kq = kivi.unpack_keys(at(k_cache, s.full_slots[: -(-c // g) * g]), dk, bits, g, q.dtype)[:c]
        vq = kivi.unpack_values(at(v_cache, s.full_slots[:c]), dv, bits, gv, q.dtype)
        kr, vr = rf.unpack(at(rk, res), dk, q.dtype)[:, :hkv], rf.unpack(at(rv, res), dv, q.dtype)[:, :hkv]
        if sink_kv is not None:
            seq = torch.tensor([s.seq])
            kq, vq = (x[0] for x in sink_kv.over(kq[None], vq[None], seq))
            kr, vr = (x[0] for x in sink_kv.over(kr[None], vr[None], seq, first=s.lo))
        kk, vv = torch.cat((kq, kr)), torch.cat((vq, vr))
        out[rows] = _attend(q[rows][None], kk[None], vv[None], s.mask[None], sinks, scale)[0]
    return out


class Attention(nn.Module):
    """Attention of one layer of ``kind`` (full or sliding-window): its kind's head shapes."""

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        shape = cfg.full if kind == FULL else cfg.swa
        self.kind = kind
        self.nh, self.nkv = shape.num_heads, shape.num_kv_heads
        self.dk, self.dv = shape.head_dim, shape.v_head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.dk, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.dk, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.dv, bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, h, bias=False)
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.nh)) if shape.has_sinks else None
        self.scale = self.dk**-0.5
        self.v_scale = cfg.value_scale

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: KindMeta,
        backend: AttentionBackend,
        residual: tuple[torch.Tensor, torch.Tensor, int] | None = None,
        sink_kv: SinkKV | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.dk)
        k = self.k_proj(x).view(t, self.nkv, self.dk)
        v = self.v_proj(x).view(t, self.nkv, self.dv) * self.v_scale
        cos, sin = cos_sin
        q, k = PartialRope.rotate(q, cos, sin), PartialRope.rotate(k, cos, sin)
        out = backend.forward(
            q, k, v, k_cache, v_cache, meta, self.attention_sink_bias, self.scale, residual, sink_kv
        )
        return self.o_proj(out.reshape(t, self.nh * self.dv))

"""Attention of the MiMo-V2.5 vision tower: bidirectional, restricted to each frame, full or 1-D
windowed, grouped-query, with optional per-head sinks on window blocks.

Tokens of several items (images of different requests, the frame pairs of a video) are fused in one
flat batch ``[N, heads, dim]``; a frame is a contiguous run of ``h * w`` rows (one sequence per
temporal index, as ``cu_seqlens`` in vLLM/SGLang). Frames of equal length are attended together as a
``[B, L]`` batch (``Segments``), so a video's frames or same-size images cost one call.

A window block lets query ``i`` see key ``j`` of its frame when ``|i - j| <= window`` in the current
token order (FA3 ``window_size=(w, w)`` in the SGLang fork's mimo_vit.py; ``sliding_window_q =
sliding_window_k = w`` in vLLM's mimo_v2_omni.py). It runs blockwise: ``Q_BLOCK`` queries against
the ``Q_BLOCK + 2 * window`` keys around them, so memory is O(L * window), not O(L**2).

Sinks (``sinks[h]``, one learned logit per query head), two readings of the public ports:
    key0_bias:   ``sinks[h]`` is added to the logit of the frame's first key (where the window lets
                 the query see it): vLLM PR #49815, vllm/model_executor/models/mimo_v2_omni.py
                 (``context_attention_fwd(..., sinks_bias_key0=True)``).
    denominator: an extra logit in the softmax denominator only, gpt-oss style,
                 ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``: the SGLang fork's
                 mimo_vision_attention.py (FA3 ``s_aux``) and vLLM PR #58235.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swaserve.model.vision_config import SINK_MODES

Q_BLOCK = 64  # queries per block of the windowed path (at least 2 * window)


@dataclass(frozen=True)
class Segments:
    """The frames of a fused batch, grouped by length.

    Attributes:
        groups: one ``[B, L]`` int64 tensor of flat row indices per distinct frame length ``L``.
        total: rows in the batch (the sum of all frame lengths).
    """

    groups: tuple[torch.Tensor, ...]
    total: int

    @staticmethod
    def from_lengths(lengths: Sequence[int], device: torch.device | str) -> Segments:
        """Frames laid back to back with these lengths (each > 0), in order."""
        starts: dict[int, list[int]] = {}
        row = 0
        for n in lengths:
            if n <= 0:
                raise ValueError(f"frame length must be positive, got {n}")
            starts.setdefault(n, []).append(row)
            row += n
        groups = tuple(
            (torch.tensor(s, dtype=torch.int64)[:, None] + torch.arange(n)).to(device)
            for n, s in starts.items()
        )
        return Segments(groups, row)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segs: Segments,
    window: int | None,
    sinks: torch.Tensor | None,
    sink_mode: str,
    scale: float,
) -> torch.Tensor:
    """Attention within each frame.

    Args:
        q: [N, Hq, D]; k: [N, Hkv, D]; v: [N, Hkv, Dv] (Hq a multiple of Hkv; query head h reads
            KV head ``h // (Hq // Hkv)``).
        segs: the frames of the N rows.
        window: None for full attention, else the half width w (|i - j| <= w).
        sinks: [Hq] sink logits or None (window blocks only).
        sink_mode: one of ``SINK_MODES``.
        scale: softmax scale (``D ** -0.5``).

    Returns:
        [N, Hq, Dv] in q's dtype.
    """
    if sinks is not None and window is None:
        raise ValueError("sinks are only defined for window blocks")
    if sink_mode not in SINK_MODES:
        raise ValueError(f"sink_mode must be one of {SINK_MODES}, got {sink_mode!r}")
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for rows in segs.groups:
        b, n = rows.shape
        flat = rows.reshape(-1)
        qs, ks, vs = (t[flat].view(b, n, t.shape[1], t.shape[2]) for t in (q, k, v))
        if window is None:
            o = _full(qs, ks, vs, scale)
        else:
            o = _banded(qs, ks, vs, window, sinks, sink_mode, scale)
        out[flat] = o.reshape(b * n, o.shape[2], o.shape[3])
    return out


def _full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, L, H, D] tensors -> [B, L, Hq, Dv]: unmasked SDPA (flash / memory-efficient kernels)."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


def _banded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    sinks: torch.Tensor | None,
    sink_mode: str,
    scale: float,
) -> torch.Tensor:
    """Windowed attention of B frames of length L, blockwise (softmax in fp32).

    ``nb`` query blocks of ``bq`` rows; block ``n`` reads keys ``n * bq - pad + c`` for
    ``c < width``; keys outside the frame or the window are masked::

        keys   [-w ........ bq + w)     block 0
        keys        [bq - w ........ 2 bq + w)     block 1 ...
    """
    b, n, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    g = hq // hkv
    bq = max(Q_BLOCK, 2 * window)
    if n <= bq:  # one block: the whole frame, no padding
        nb, bq, pad, width = 1, n, 0, n
    else:
        nb, pad = -(-n // bq), window
        width = bq + 2 * window
    dev = q.device
    qp = F.pad(q, (0, 0, 0, 0, 0, nb * bq - n))
    kp = F.pad(k, (0, 0, 0, 0, pad, nb * bq - n + pad))
    vp = F.pad(v, (0, 0, 0, 0, pad, nb * bq - n + pad))
    qb = qp.view(b, nb, bq, hkv, g, d).permute(0, 1, 3, 4, 2, 5).reshape(b, nb, hkv, g * bq, d)
    kb = kp.unfold(1, width, bq)  # [B, nb, Hkv, D, width]
    vb = vp.unfold(1, width, bq).transpose(-1, -2)  # [B, nb, Hkv, width, Dv]
    scores = torch.matmul(qb, kb).float().view(b, nb, hkv, g, bq, width) * scale

    start = torch.arange(nb, device=dev)[:, None, None] * bq
    col = torch.arange(width, device=dev)
    i_abs = start + torch.arange(bq, device=dev)[None, :, None]  # [nb, bq, 1]
    j_abs = start - pad + col  # [nb, 1, width]
    valid = (j_abs >= 0) & (j_abs < n) & ((i_abs - j_abs).abs() <= window)  # [nb, bq, width]
    # padded query rows (cropped below) keep one finite logit so their softmax stays finite
    valid |= (i_abs >= n) & (col == 0)
    if sinks is not None and sink_mode == "key0_bias":
        key0 = (valid & (j_abs == 0)).float()
        scores = scores + sinks.float().view(1, 1, hkv, g, 1, 1) * key0.view(1, nb, 1, 1, bq, width)
    scores = scores.masked_fill(~valid.view(1, nb, 1, 1, bq, width), float("-inf"))
    if sinks is not None and sink_mode == "denominator":
        sink_col = sinks.float().view(1, 1, hkv, g, 1, 1).expand(b, nb, hkv, g, bq, 1)
        probs = torch.softmax(torch.cat((scores, sink_col), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype).reshape(b, nb, hkv, g * bq, width), vb)  # [B, nb, Hkv, g*bq, Dv]
    out = out.view(b, nb, hkv, g, bq, dv).permute(0, 1, 4, 2, 3, 5).reshape(b, nb * bq, hq, dv)
    return out[:, :n]

"""``MediaRows``: the rows of one flat forward batch that take media encoder outputs instead of token
embeddings. Chunked prefill slices each item's embeddings by absolute position, so an item may
straddle chunks (and steps); the pad ids at those rows become 0 for the embedding lookup and are
overwritten by ``MiMoV2ForCausalLM.embed``."""

from __future__ import annotations

import torch

from swaserve.engine.request import Request
from swaserve.media.placeholders import PAD_BASE


class MediaRows:
    """Collects ``(row, embedding row)`` pairs while a batch is built."""

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def add(self, req: Request, start: int, end: int, row: int) -> None:
        """Positions ``[start, end)`` of ``req`` sit at batch rows ``row, row + 1, ...``.

        Raises:
            RuntimeError: a media position in range has no embeddings (the scheduler never
                schedules one: internal error).
        """
        m = req.media
        if m is None or end <= start:
            return
        for i, s in enumerate(m.spans):
            lo, hi = max(start, s.start), min(end, s.end)
            if lo >= hi:
                continue
            e = m.embeds.get(i)
            if e is None:
                raise RuntimeError(f"{req.request_id}: media item {i} scheduled without embeddings")
            self._rows.append(torch.arange(row + lo - start, row + hi - start, dtype=torch.int64))
            self._values.append(e[lo - s.start : hi - s.start])

    def build(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [k], values [k, hidden]) on ``device``, or None when no row is a media row."""
        if not self._rows:
            return None
        values = torch.cat([v.to(device) for v in self._values])
        return torch.cat(self._rows).to(device), values

    @staticmethod
    def clear_pads(ids: list[int], device: torch.device) -> torch.Tensor:
        """``ids`` as an int64 tensor with pad ids replaced by 0 (their rows take embeddings)."""
        t = torch.tensor(ids, dtype=torch.int64, device=device)
        return t.masked_fill(t >= PAD_BASE, 0) if ids and max(ids) >= PAD_BASE else t

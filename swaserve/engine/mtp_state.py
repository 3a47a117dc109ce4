"""A request's MTP bookkeeping (``engine.drafter``): which rows are final, and the target's hidden
states the next rows read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MTPState:
    """A request's MTP bookkeeping.

    Attributes:
        fin: MTP rows (every layer) below this position are final.
        base: the target's hidden states exist from this position on (before it: zeros).
        hidden: [m, hidden] the target's pre-final-norm hidden states of positions
            ``hidden_start ..`` (the last few the next rows read), or None.
    """

    fin: int = 0
    base: int = 0
    hidden: torch.Tensor | None = None
    hidden_start: int = 0

    def hidden_at(self, positions: torch.Tensor, width: int, like: torch.Tensor) -> torch.Tensor:
        """[len(positions), width]: the kept hidden state of each position (int64 [n], CPU),
        zeros before ``base``.

        Raises:
            RuntimeError: a position at or after ``base`` that is not kept (internal error)."""
        out = like.new_zeros(positions.shape[0], width)
        valid = positions >= self.base
        if not bool(valid.any()):
            return out
        rows = positions[valid] - self.hidden_start
        have = self.hidden
        if have is None or int(rows.min()) < 0 or int(rows.max()) >= have.shape[0]:
            raise RuntimeError("MTP needs a hidden state that is not kept (internal error)")
        out[valid.to(out.device)] = have[rows.to(have.device)]
        return out

"""``EPStats``: expert load per MoE layer of an EP instance (no torch: routers and metrics
decode it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EPStats:
    """Expert load per MoE layer over the steps of this rank's instance.

    ``rows[l]``: (token, expert) rows this rank computed in the current step (a step ends with
    ``EPShard.end_step``). ``mean_sum[l]`` / ``max_sum[l]``: sums over steps of the mean and the
    max across ranks of those rows; their ratio is the token-weighted balance (mean / max tokens
    per rank, 1 = perfect). ``last[l]``: the balance of the last step that routed any token."""

    rows: list[int]
    mean_sum: list[float]
    max_sum: list[int]
    last: list[float]

    @classmethod
    def empty(cls, layers: int) -> EPStats:
        return cls([0] * layers, [0.0] * layers, [0] * layers, [1.0] * layers)

    def balance(self) -> list[float]:
        """Per MoE layer, sum of means / sum of maxes since start (1.0 for a layer never used)."""
        return [m / x if x else 1.0 for m, x in zip(self.mean_sum, self.max_sum, strict=True)]

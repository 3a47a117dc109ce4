"""Speculative decoding: what one verify step emits, and the acceptance counters.

A verify step runs the target over ``[bonus, d_1, ..., d_k]`` (the last emitted token and k draft
tokens) and gets k+1 rows of logits; row j predicts the token after ``d_j`` (row 0: after the
bonus). ``verify`` walks the rows in order and samples each row's token exactly as a decode step
without speculation would (``sample_row``: argmax at temperature 0, else the request's sampler
drawing from its own generator), accepting ``d_{j+1}`` while it equals row j's token:

- temperature 0: the drafts accepted while they equal the target's argmax, then the target's token
  at the first mismatch (or the bonus row's), so the output is the non-speculative one;
- temperature > 0 with point-mass (greedy) drafts, as MiMo's MTP drafts are: accepting ``d`` iff
  the token drawn from row j's distribution p equals ``d`` accepts with probability p(d) and, on a
  rejection, emits a draw from p conditioned on "not d", i.e. from normalised ``(p - onehot(d))+``:
  Leviathan et al. 2023 (arXiv:2211.17192) / Chen et al. 2023 (arXiv:2302.01318) rejection sampling
  with q = onehot(d) (vLLM's ``NO_DRAFT_PROBS`` case). Rows are sampled lazily, one draw per
  emitted token, and never for a row that emits nothing, so a seeded request draws the same
  numbers in the same order as without speculation and emits the same tokens.

Penalties and grammars see ``d_1..d_j`` as already generated when row j is sampled (the caller's
``sample_row``); a stop token or the ``max_tokens`` budget ends the run (``stop``, ``budget``).

Design notes: docs/DESIGN.md#enginespecpy"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def verify(
    drafts: Sequence[int],
    sample_row: Callable[[int], int],
    budget: int,
    stop: Callable[[int], bool] = lambda _: False,
) -> list[int]:
    """The tokens one verify step emits (1 to ``len(drafts) + 1`` of them).

    Args:
        drafts: d_1..d_k, the draft tokens fed after the bonus token.
        sample_row: j -> the token row j gives (called for j = 0, 1, ... in order, at most once
            each, and only for rows whose token is emitted).
        budget: tokens the request may still emit (``max_tokens`` left), >= 1.
        stop: whether a token ends the request (a stop id, EOS): nothing follows it.

    Raises:
        ValueError: ``budget`` < 1.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    out: list[int] = []
    for j in range(len(drafts) + 1):
        tok = sample_row(j)
        out.append(tok)
        if len(out) == budget or stop(tok) or j == len(drafts) or tok != drafts[j]:
            break
    return out


@dataclass
class SpecStats:
    """Acceptance counters under vLLM's names (``spec_decode_num_drafts``,
    ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``).
    Mean accept length (tokens per verify, bonus included) = 1 + accepted / drafts.

    Attributes: drafts: verify steps; draft_tokens: drafts proposed; accepted: drafts accepted;
    accepted_per_pos: [k] accepted drafts by position (0 = d_1)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafts: Sequence[int], emitted: Sequence[int]) -> int:
        """Count one verify step (``emitted``: what ``verify`` returned for ``drafts``); returns
        the drafts it accepted: the leading emitted tokens equal to the drafts (the token at a
        mismatch is the target's; a run cut by the budget or a stop may end on a draft)."""
        accepted = 0
        while accepted < min(len(drafts), len(emitted)) and emitted[accepted] == drafts[accepted]:
            accepted += 1
        if len(self.accepted_per_pos) < len(drafts):
            self.accepted_per_pos.extend([0] * (len(drafts) - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        self.drafts += 1
        self.draft_tokens += len(drafts)
        self.accepted += accepted
        return accepted

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verify step, bonus included (0 before the first)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

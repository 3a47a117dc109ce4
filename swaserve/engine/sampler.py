"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, seeds and logprobs.

One ``Sampler.sample`` call turns the last-position logits of a step's requests into one token
each, by the OpenAI / vLLM conventions: repetition (CTRL, Keskar et al. 2019), frequency and
presence penalties, greedy at temperature 0, top-k then top-p then min-p, one inverse-CDF draw per
request (its own generator when seeded). Logprobs: ``log_softmax`` of the raw logits.

Exact semantics: docs/DESIGN.md#enginesamplerpy"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swaserve.engine.penalties import apply_logit_bias, apply_penalties, row_index
from swaserve.engine.sampling_state import SamplingState
from swaserve.engine.types import TokenLogprob

# Candidates examined first by the top-p search before it looks at more of the row.
_TOP_P_CANDIDATES = 1024
# Tokens this far (in logits) below a row's maximum have relative probability < 1.7e-38, which is
# below float32's normal range; treating them as zero keeps exp() off its slow path.
_LOG_TINY = 87.0
# Smaller positive temperatures are raised to this, so that scaled logits stay finite.
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SampledToken:
    """The token chosen for one request in one step.

    Attributes:
        token_id: The sampled (or greedy) token id.
        logprob: Raw-logit logprob of ``token_id`` and its top alternatives, or None when the
            request did not ask for logprobs.
    """

    token_id: int
    logprob: TokenLogprob | None


class Sampler:
    """Stateless batched sampler (exact semantics: docs/DESIGN.md#enginesamplerpy)."""

    def __init__(self, top_p_candidates: int = _TOP_P_CANDIDATES) -> None:
        """Args:
        top_p_candidates: How many of a row's most likely tokens the top-p search looks at
            first; rows whose nucleus is larger retry with 16x more, then with a full sort
            (same result, slower).
        """
        self.top_p_candidates = top_p_candidates

    @torch.no_grad()
    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplingState], masked: torch.Tensor | None = None
    ) -> list[SampledToken]:
        """Pick one token per request.

        Args:
            logits: [B, V] last-position logits, one row per entry of ``states`` (any float dtype,
                any device; not modified).
            states: The B requests, in row order. Seeded generators must live on logits' device.
            masked: [B, V] ``logits`` with the tokens a row may not pick at -inf (structured
                output, ``engine.structured``): tokens are picked from it, logprobs stay those of
                ``logits``. None: pick from ``logits``.

        Returns:
            B sampled tokens, in row order.

        Raises:
            ValueError: If the number of rows and states differ, or a request with a repetition
                penalty has a prompt token id outside the vocabulary.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(states)} states")
        if not states:
            return []
        if logits.dtype != torch.float32:
            logits = logits.float()
        x = apply_logit_bias(logits if masked is None else masked.float(), states)
        if all(s.params.greedy for s in states) and not any(s.needs_penalties for s in states):
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = self._pick(x, states)
        ids = token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(states)
        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if lp_rows:
            fill_logprobs(
                logits, token_ids, lp_rows, [states[i].params.logprobs or 0 for i in lp_rows], logprobs
            )
        return [SampledToken(t, lp) for t, lp in zip(ids, logprobs, strict=True)]

    def _pick(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Penalize, then greedy-pick or sample every row; returns [B] int64 token ids."""
        device = logits.device
        x = logits
        if any(s.needs_penalties for s in states):
            vocab = logits.shape[1]
            for s in states:
                if s.params.repetition_penalty != 1.0 and s.max_prompt_id() >= vocab:
                    raise ValueError(f"prompt token id {s.max_prompt_id()} is outside the vocab ({vocab})")
            x = logits.clone(memory_format=torch.contiguous_format)
            apply_penalties(x, states)

        greedy_rows = [i for i, s in enumerate(states) if s.params.greedy]
        if len(greedy_rows) == len(states):
            return x.argmax(dim=-1)
        sample_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        out = torch.empty(len(states), dtype=torch.long, device=device)
        if greedy_rows:
            g_idx = row_index(greedy_rows, device)
            out.index_copy_(0, g_idx, x.index_select(0, g_idx).argmax(dim=-1))
        s_idx = row_index(sample_rows, device)
        s_states = [states[i] for i in sample_rows]
        temps = _column([max(s.params.temperature, _MIN_TEMPERATURE) for s in s_states], device)
        scaled = (x.index_select(0, s_idx) if greedy_rows else x) / temps
        out.index_copy_(0, s_idx, _draw(scaled, self._thresholds(scaled, s_states), s_states))
        return out

    def _thresholds(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Per-row cut-off value: tokens with ``x < threshold`` get probability zero.

        top-k, top-p and min-p each keep the tokens at or above some value of the row, so their
        intersection keeps the tokens at or above the largest of those values. Tokens more than
        ``_LOG_TINY`` below the row maximum (relative probability < 1e-38, which float32 cannot
        represent anyway) are dropped too, which keeps ``exp`` on its fast path.

        Args:
            x: [S, V] temperature-scaled logits.
            states: The S requests.

        Returns:
            [S, 1] float32 thresholds.
        """
        device, vocab = x.device, x.shape[1]
        row_max = x.amax(dim=-1, keepdim=True)
        thresh = row_max - _LOG_TINY
        ks = [s.params.top_k if s.params.top_k is not None and s.params.top_k < vocab else 0 for s in states]
        top_vals: torch.Tensor | None = None
        if any(ks):
            top_vals = x.topk(max(ks), dim=-1).values  # [S, k_max], descending
            # Columns past a row's own k are outside its top-k: make them -inf.
            k_col = _column([k if k else vocab for k in ks], device)
            top_vals.masked_fill_(torch.arange(top_vals.shape[1], device=device) >= k_col, -math.inf)
            kth = top_vals.gather(1, _column([max(k, 1) - 1 for k in ks], device, torch.long))
            thresh = torch.where(
                _column([bool(k) for k in ks], device, torch.bool), kth.maximum(thresh), thresh
            )
        p_rows = [i for i, s in enumerate(states) if s.params.top_p < 1.0]
        if p_rows:
            thresh = self._top_p_thresholds(x, states, p_rows, ks, top_vals, thresh)
        min_ps = [s.params.min_p for s in states]
        if any(m > 0.0 for m in min_ps):
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf leaves a row alone.
            thresh = thresh.maximum(row_max + _column(min_ps, device).log())
        return thresh

    def _top_p_thresholds(
        self,
        x: torch.Tensor,
        states: Sequence[SamplingState],
        p_rows: list[int],
        ks: list[int],
        top_vals: torch.Tensor | None,
        thresh: torch.Tensor,
    ) -> torch.Tensor:
        """Raise ``thresh`` of the top-p rows to the value of the last token of their nucleus.

        A row with top-k finds its nucleus among its top-k values (renormalized over them).
        Other rows look among their n most likely tokens, growing n (up to a full sort) only for
        rows whose candidates hold less than top_p of the mass; the kept set is the same
        whichever n finds it.
        """
        device, vocab = x.device, x.shape[1]
        cut = torch.full_like(thresh, -math.inf)
        with_k = [i for i in p_rows if ks[i]]
        if with_k:
            assert top_vals is not None
            idx = row_index(with_k, device)
            k_cut, _ = _nucleus_cut(top_vals.index_select(0, idx), None, _top_p(states, with_k, device))
            cut.index_copy_(0, idx, k_cut)
        pending_rows = [i for i in p_rows if not ks[i]]
        if pending_rows:
            pending = row_index(pending_rows, device)
            top_p = _top_p(states, pending_rows, device)
            full = x.index_select(0, pending)
            lse = _logsumexp(full)
            n = min(vocab, self.top_p_candidates)
            while True:
                if n >= vocab:
                    cand = full.sort(dim=-1, descending=True).values
                else:
                    cand = full.topk(n, dim=-1).values
                row_cut, covered = _nucleus_cut(cand, lse, top_p)
                if n >= vocab or bool(covered.all()):
                    cut.index_copy_(0, pending, row_cut)
                    break
                cut.index_copy_(0, pending[covered], row_cut[covered])
                rest = (~covered).nonzero().flatten()
                pending, full, lse, top_p = (t.index_select(0, rest) for t in (pending, full, lse, top_p))
                n = min(vocab, n * 16)
        return thresh.maximum(cut)


def _column(
    values: Sequence[float] | Sequence[int] | Sequence[bool],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[N, 1] tensor of per-row values on ``device``."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).unsqueeze(1)


def _top_p(states: Sequence[SamplingState], rows: list[int], device: torch.device) -> torch.Tensor:
    return _column([states[i].params.top_p for i in rows], device)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[R, 1] log-sum-exp of the rows of ``x`` (clamping tiny terms keeps exp on its fast path)."""
    row_max = x.amax(dim=-1, keepdim=True)
    return row_max + (x - row_max).clamp_(min=-_LOG_TINY).exp_().sum(dim=-1, keepdim=True).log_()


def _nucleus_cut(
    cand: torch.Tensor, lse: torch.Tensor | None, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Value of the last token of each row's nucleus among sorted candidates.

    Args:
        cand: [R, N] descending values (-inf for excluded tokens).
        lse: [R, 1] log-normalizer of the row's whole distribution, or None to normalize over
            ``cand``.
        top_p: [R, 1] nucleus masses.

    Returns:
        ([R, 1] cut values, [R] bool covered): a row keeps the tokens whose preceding mass is
        below top_p (at least one); ``covered`` says whether the candidates hold top_p of the
        mass, i.e. whether the nucleus is complete within them.
    """
    if lse is None:
        lse = _logsumexp(cand)
    probs = (cand - lse).exp_()
    cum = probs.cumsum(dim=-1)
    before = cum - probs  # mass strictly ahead of each token; non-decreasing along a row
    count = (before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    return cand.gather(1, count - 1), cum[:, -1] >= top_p.squeeze(1)


def _draw(x: torch.Tensor, thresh: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Draw one token per row among the tokens with ``x >= thresh``, with probability ∝ exp(x).

    Uses the inverse CDF in vocabulary order with exactly one uniform number per row, taken from
    the row's own generator when seeded, so a seeded request's tokens do not depend on which other
    requests share the batch. Tokens below the threshold are never chosen.

    Args:
        x: [S, V] temperature-scaled logits; overwritten.
        thresh: [S, 1] per-row cut-off values (at most the row maximum).
        states: The S requests.

    Returns:
        [S] int64 token ids.
    """
    keep = x >= thresh
    weights = x.sub_(x.amax(dim=-1, keepdim=True)).clamp_(min=-_LOG_TINY).exp_().mul_(keep)
    cum = weights.cumsum_(dim=-1)
    total = cum[:, -1:]
    u = torch.empty(len(states), 1, dtype=torch.float32, device=x.device)
    if any(s.generator is None for s in states):
        u.uniform_()
    for i, s in enumerate(states):
        if s.generator is not None:
            u[i].uniform_(generator=s.generator)
    # Keep the target strictly below the total so the search lands on a token with weight > 0.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)


def fill_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    rows: list[int],
    top_ns: list[int],
    out: list[TokenLogprob | None],
    with_rank: bool = False,
) -> None:
    """Store raw-logit logprobs (``token_ids``' own and the top-N of the row) of ``rows`` into ``out``.

    Args:
        logits: [B, V] float32 raw logits. token_ids: [B] int64, the token of each row to score.
        rows: which rows to score; top_ns: N per scored row; out: B slots, filled at ``rows``.
        with_rank: also each token's rank over the vocabulary (a [B, V] compare; only prompt
            logprobs show it, so sampled tokens skip it).
    """
    if len(rows) == logits.shape[0]:
        raw, chosen_ids = logits, token_ids
    else:
        idx = row_index(rows, logits.device)
        raw, chosen_ids = logits.index_select(0, idx), token_ids.index_select(0, idx)
    lse = _logsumexp(raw)
    chosen_raw = raw.gather(1, chosen_ids.unsqueeze(1))
    chosen = (chosen_raw - lse).squeeze(1).tolist()
    ranks = ((raw > chosen_raw).sum(dim=1) + 1).tolist() if with_rank else [0] * len(rows)
    n_max = min(max(top_ns), raw.shape[1])
    top_vals: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if n_max > 0:
        vals, ids = raw.topk(n_max, dim=-1)
        top_vals, top_ids = (vals - lse).tolist(), ids.tolist()
    for j, (row, token) in enumerate(zip(rows, chosen_ids.tolist(), strict=True)):
        n = top_ns[j]
        top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        out[row] = TokenLogprob(token, chosen[j], top, int(ranks[j]))

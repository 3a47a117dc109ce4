"""Logits processors of the sampler: OpenAI ``logit_bias``, then repetition (CTRL, Keskar et al.
2019, sec. 4.1), frequency and presence penalties, reading only the entries of seen token ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from swaserve.engine.sampling_state import SamplingState


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as an int64 index tensor on ``device``."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """``logits`` plus each request's ``logit_bias`` (a copy; ``logits`` itself when no request
    has one). Args: logits [B, V] float32; states: the B requests (bias token ids < V)."""
    rows = [(i, t, b) for i, s in enumerate(states) for t, b in s.params.logit_bias]
    if not rows:
        return logits
    vocab = logits.shape[1]
    pos = torch.tensor([i * vocab + t for i, t, _ in rows], dtype=torch.long).to(logits.device)
    bias = torch.tensor([b for _, _, b in rows], dtype=torch.float32).to(logits.device)
    x = logits.clone(memory_format=torch.contiguous_format)
    x.view(-1).index_add_(0, pos, bias)  # a token listed twice gets both biases (a JSON object cannot)
    return x


def apply_penalties(x: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """Apply repetition, then frequency and presence penalties to logits in place.

    Only the entries of seen token ids are read and written (flat gather / scatter), so the cost
    is proportional to the number of prompt + output tokens, not to B * V.

    Args:
        x: [B, V] contiguous float32 logits, one row per state; modified in place.
        states: The B requests; every prompt and output token id must be < V.
    """
    device, vocab = x.device, x.shape[1]
    flat = x.view(-1)
    rep_rows = [
        i
        for i, s in enumerate(states)
        if s.params.repetition_penalty != 1.0 and (s.prompt_token_ids or s.output_token_ids)
    ]
    if rep_rows:
        seen = [
            torch.cat([states[i].prompt_tensor(device), states[i].output_tensor(device)]) for i in rep_rows
        ]
        ids, _ = _padded_ids(seen, vocab)
        pos = row_index(rep_rows, device).unsqueeze(1) * vocab + ids
        r = torch.tensor([states[i].params.repetition_penalty for i in rep_rows], dtype=torch.float32)
        r = r.to(device).unsqueeze(1)
        v = flat[pos]
        # Repeated ids (and the padding, which repeats a row's first id) write identical values.
        flat[pos] = torch.where(v > 0, v / r, v * r)
    freq_rows = [
        i
        for i, s in enumerate(states)
        if (s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0)
        and (s.output_token_ids or s.prior_output_ids)
    ]
    if freq_rows:
        ids, counts = _padded_ids([states[i].penalized_output(device) for i in freq_rows], vocab)
        f = torch.tensor([states[i].params.frequency_penalty for i in freq_rows], dtype=torch.float32)
        p = torch.tensor([states[i].params.presence_penalty for i in freq_rows], dtype=torch.float32)
        penalty = f.to(device).unsqueeze(1) * counts + p.to(device).unsqueeze(1) * (counts > 0).float()
        pos = row_index(freq_rows, device).unsqueeze(1) * vocab + ids
        flat[pos] = flat[pos] - penalty


def _padded_ids(ids: list[torch.Tensor], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad non-empty id rows to one [R, L] tensor and count each id's occurrences in its row.

    Args:
        ids: R non-empty int64 tensors of token ids < vocab.
        vocab: Vocabulary size (used as the sort-last padding value while counting).

    Returns:
        (padded ids, counts): [R, L] ids where padding repeats the row's first id, and [R, L]
        float32 occurrence counts of the id at each position within its row (padding gets the
        first id's count, so scattering per-position values stays consistent).
    """
    padded = pad_sequence(ids, batch_first=True, padding_value=vocab)
    ordered = padded.sort(dim=-1).values
    counts = (
        torch.searchsorted(ordered, padded, right=True) - torch.searchsorted(ordered, padded, right=False)
    ).float()
    is_pad = padded == vocab
    padded = torch.where(is_pad, padded[:, :1], padded)
    counts = torch.where(is_pad, counts[:, :1], counts)
    return padded, counts

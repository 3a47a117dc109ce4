"""A request's life inside the engine core: ``Request`` holds its prompt and output token ids,
``num_computed`` (tokens of both whose KV is in the pools), its status, times and sampling state,
in the PD roles the KV payload it exports or imports, and its structured-output grammar."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from swaserve.engine.types import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from swaserve.engine.grammar import Grammar
    from swaserve.engine.mtp_state import MTPState
    from swaserve.engine.sampling_state import SamplingState
    from swaserve.media.placeholders import MediaInputs
    from swaserve.transfer.kv_transfer import KVPayload


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side request.

    ``num_computed`` tokens of ``prompt + output`` have KV in the pools; the next step computes
    ``[num_computed, num_tokens)`` (a prefill chunk, or the one token sampled last step).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_total_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    sampling: SamplingState | None = None
    cached_tokens: int = 0
    cached_host_tokens: int = 0  # of ``cached_tokens``, loaded from the host tier (L3's included)
    l3_tokens: int = 0  # prompt tokens its L3 fetch put in the host tier (``engine.l3_tier``)
    bypassed: int = 0  # waiting requests admitted ahead of this one while it was at the queue head
    export_kv: bool = False  # prefill role: capture the prompt's KV (``kv_payload``) when it finishes
    kv_payload: KVPayload | None = None  # exported KV (prefill role) or KV to import (decode role)
    prompt_logprobs: list[TokenLogprob] | None = None  # computed so far (``params.prompt_logprobs``)
    grammar: Grammar | None = None  # ``params.structured``'s matcher over the output so far
    # speculative decoding (``engine.drafter``): drafts for the next step, pages held up to
    # ``spec_end`` (exclusive position), and the MTP layers' state
    spec_drafts: list[int] = field(default_factory=list)
    spec_end: int = 0
    mtp: MTPState | None = None
    media: MediaInputs | None = None  # media items' spans and embeddings (``media.placeholders``)
    media_asked: bool = False  # its missing media spans were reported (``CoreOutput.media_wanted``)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = self.num_prompt
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def media_ready_end(self) -> int:
        """The first position the next chunk may not reach: the start (or, inside a span the
        prefix hit cut, ``num_computed``) of the first media span after ``num_computed`` whose
        embeddings are missing; ``num_tokens`` when none is."""
        m = self.media
        if m is None:
            return self.num_tokens
        for i, s in enumerate(m.spans):
            if s.end > self.num_computed and i not in m.embeds:
                return max(s.start, self.num_computed)
        return self.num_tokens

    def media_missing(self) -> list[int]:
        """Indices of the spans past ``num_computed`` (a prefix hit) that still need embeddings."""
        m = self.media
        if m is None:
            return []
        return [i for i, s in enumerate(m.spans) if s.end > self.num_computed and i not in m.embeds]

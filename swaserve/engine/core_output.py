"""``CoreOutput``: what one engine-core step did for one request (``engine.core``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swaserve.engine.types import FinishReason, TokenLogprob
from swaserve.transfer.kv_transfer import KVPayload


@dataclass
class CoreOutput:
    """What one step did for one request: at most one new token (none when aborted).

    ``finish_reason`` is set on the request's last output: STOP (an EOS or stop token id, or
    with ``structured_end`` its structured-output grammar complete: the last token is text),
    LENGTH, HANDOFF (prefill role, ``kv_payload`` set) or ABORT (with ``error`` when the request
    failed: its grammar broke). Counters are cumulative; times are the core's clock (seconds).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # once, when the prompt is done (prompt_logprobs)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0  # of cached_tokens, from the host tier (L3 fetches included)
    cached_l3_tokens: int = 0  # of cached_host_tokens, fetched from L3 for this request
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_payload: KVPayload | None = None
    structured_end: bool = False
    error: str = ""
    media_wanted: list[int] | None = None  # admitted, waiting: these media spans' embeddings

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

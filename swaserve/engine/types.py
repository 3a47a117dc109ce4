"""Plain request/response value types shared by the engine, sampler and API layers: ``SamplingParams``
(with its ``StructuredOutput`` constraint), ``RequestOutput`` (a per-step delta with cumulative usage),
``TokenLogprob``, ``FinishReason``, and ``EngineLimits`` (what a request may ask; checked in the front
and again in the core)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, get_args

from swaserve.media.placeholders import check_spans


class FinishReason(StrEnum):
    """Why a request stopped (OpenAI ``finish_reason`` values, plus ``abort``)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # client went away or the request was cancelled
    HANDOFF = "handoff"  # prefill role: first token sampled, decoding goes on elsewhere (internal)


MAX_LOGPROBS = 20  # most top alternatives per token the engine computes (vLLM's default bound)


StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = get_args(StructuredKind)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text, enforced token by token (``engine.structured``).

    Attributes:
        kind: ``json_object`` (any JSON object; ``spec`` is ignored, "" by convention),
            ``json_schema`` (``spec``: the JSON schema as JSON text), ``regex`` (``spec``: a regular
            expression, Rust ``regex`` syntax, matched against the whole output), ``choice``
            (``spec``: a JSON list of strings; the output is exactly one of them) or ``grammar``
            (``spec``: a Lark grammar, or a GBNF one, llguidance's dialect).
        spec: The kind's text, as above.
    """

    kind: StructuredKind
    spec: str = ""

    def validate(self) -> None:
        """Raise ValueError for an unknown kind (the grammar itself is checked by
        ``engine.grammar.validate``)."""
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured output kind must be one of {list(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise ValueError("structured output spec must be a string")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics).

    Attributes:
        max_tokens: Number of output tokens at most (>= 0; 0: only the prompt is computed, e.g.
            for its ``prompt_logprobs``, and the request ends with reason LENGTH, no token).
        temperature: 0 means greedy (argmax, exact); otherwise logits are divided by it.
        top_p: Nucleus mass in (0, 1]; 1 disables.
        top_k: Keep the k most likely tokens; None disables.
        min_p: Drop tokens whose probability is below ``min_p * p_max``; 0 disables.
        seed: Seeds a per-request generator so sampled outputs are reproducible.
        presence_penalty: Subtracted once from logits of tokens already generated ([-2, 2]).
        frequency_penalty: Subtracted per occurrence in the generated tokens ([-2, 2]).
        repetition_penalty: CTRL-style (Keskar et al. 2019, sec. 4.1) over prompt + output; 1 disables.
        stop: Stop strings; the output is cut before the first match.
        stop_token_ids: Extra token ids that end the request (the token is not shown in text).
        ignore_eos: Keep going past EOS (used by trace replay to force the trace's output length).
        logprobs: Number of top alternatives per output token to return (0 = only the sampled one);
            None = no logprobs.
        skip_special_tokens: Leave special tokens out of the detokenized text.
        logit_bias: (token id, bias) pairs added to the logits before penalties and sampling
            (OpenAI ``logit_bias``, bias in [-100, 100]); logprobs stay those of the raw logits.
        prompt_logprobs: Number of top alternatives per prompt token to return (0 = only the
            prompt token's own); None = none. Such a request skips the prefix cache lookup (every
            prompt position must be computed).
        structured: Constrain the output to a JSON schema, regex, choice or grammar; the request
            ends (``STOP``) when the constraint is complete. None = unconstrained.
        prior_output_tokens: The last this-many prompt tokens are this request's own output so far
            (a router's resume on new workers, ``services.router.attempt.Progress``): presence and
            frequency penalties count them as output, and a seeded generator starts this many
            draws in (one per token sampled: ``engine.sampler``), so the request goes on as an
            uninterrupted one would. Internal: not an API parameter.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    prior_output_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for any out-of-range value."""
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        if self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be at least 0, got {self.prior_output_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or null to disable), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2^63, 2^64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")
        if self.structured is not None:
            self.structured.validate()


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one output token and its top alternatives (natural log); ``rank``: 1 +
    the tokens with a higher logprob (0: not computed)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0


@dataclass
class RequestOutput:
    """One streaming delta for a request; the last one has ``finished=True``.

    Token and text fields are deltas since the previous output of the same request;
    the usage counters are cumulative.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0  # of cached_tokens, loaded from the host tier (L3 fetches included)
    cached_l3_tokens: int = 0  # of cached_host_tokens, fetched from L3 (GCache) for this request
    arrival_time: float = 0.0  # engine clock (time.monotonic), seconds
    first_scheduled_time: float | None = None  # when the request first got a prefill slot
    first_token_time: float | None = None
    kv_payload: Any = None  # prefill role, final output: the prompt's KV (``transfer.kv_transfer.KVPayload``)
    prompt_logprobs: list[TokenLogprob] | None = None  # once, with the output that completed the prompt
    error: str = ""  # set on the last output of a request the engine failed (its grammar broke): why
    # admitted, its prefill waits at these media spans (indices) past its prefix hit: the caller
    # fetches their embeddings and hands them over (``supply_media``); no tokens in this delta
    media_wanted: list[int] | None = None
    # per new token, where its text starts in ``new_text`` (several tokens per delta with MTP;
    # empty: every token at 0); completions' ``text_offset``
    token_text_starts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLimits:
    """What requests an engine can take; the front checks with these before a request reaches
    the core (the core checks again).

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_model_len: longest prompt + ``max_tokens`` (tokens).
        max_fit_tokens: longest prompt + ``max_tokens`` empty KV pools could ever hold.
        page_size: tokens per KV page. kv_pages: pages of the full-attention pool.
    """

    vocab_size: int
    max_model_len: int
    max_fit_tokens: int
    page_size: int
    kv_pages: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams, media: Any = None) -> None:
        """Raise ValueError with a user-facing message if the request cannot be served.
        ``media`` (``MediaInputs``): the prompt's media spans, whose pad ids are allowed."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if media is not None and media.spans:
            check_spans(prompt_token_ids, media.spans, self.vocab_size)
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not supported for prompts with media")
        else:
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} out of range [0, {self.vocab_size})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} out of range [0, {self.vocab_size})")
        prior = params.prior_output_tokens
        if prior and (prior >= len(prompt_token_ids) or (media is not None and any(
            sp.start + sp.length > len(prompt_token_ids) - prior for sp in media.spans
        ))):  # fmt: skip
            raise ValueError(
                f"prior_output_tokens {prior} must leave the original prompt (and its media) in the "
                f"{len(prompt_token_ids)}-token prompt"
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({len(prompt_token_ids)} prompt + {params.max_tokens} max_tokens)"
            )
        if total > self.max_fit_tokens:
            raise ValueError(
                f"request of {total} tokens can never fit in the KV cache "
                f"({self.kv_pages} pages of {self.page_size} tokens)"
            )

    def check_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token: int, payload: Any
    ) -> None:
        """Raise ValueError unless ``payload`` (a ``KVPayload``) covers this prompt and
        ``first_token`` is a token id."""
        if payload.num_tokens != len(prompt_token_ids) or payload.request_id != request_id:
            raise ValueError(
                f"KV payload of {payload.request_id!r} covers {payload.num_tokens} tokens, "
                f"prompt {request_id!r} has {len(prompt_token_ids)}"
            )
        if not 0 <= first_token < self.vocab_size:
            raise ValueError(f"first token id {first_token} out of range")

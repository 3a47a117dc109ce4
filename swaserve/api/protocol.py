"""OpenAI-compatible request and response models, and their translation to engine types.

Strict validation (a string where a number belongs is a 400; unknown fields ignored); what a model
cannot check alone (context length, vocabulary, sampling ranges) raises ``ProtocolError``.
Extensions (vLLM's spelling): ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos``, ``skip_special_tokens``, ``return_token_ids``, ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (structured output with ``response_format``: ``api.structured``).

Design notes: docs/DESIGN.md#apiprotocolpy"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swaserve.engine.types import SamplingParams

MAX_STOP_STRINGS = 4
# JSON has no -inf; vLLM and OpenAI clients accept a large negative number instead.
MIN_LOGPROB = -9999.0


class ProtocolError(Exception):
    """A request the server must refuse, with the fields of an OpenAI error body.

    Args:
        message: Human-readable reason, shown to the client.
        param: The request field at fault, if one is.
        code: Machine-readable code (e.g. ``context_length_exceeded``, ``model_not_found``).
        status: HTTP status to answer with.
        type: OpenAI error type.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type


def _omit_none(value: Any) -> bool:
    return value is None


# --------------------------------------------------------------------------------------------
# Requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def check_text(value: Any, path: tuple[str | int, ...] = ()) -> None:
    """Raise ProtocolError (400, ``param`` = the top-level field) for a string anywhere in ``value``
    that is not valid Unicode text (a lone surrogate such as ``"\\ud800"`` from JSON): no
    tokenizer, template or UTF-8 encoder downstream accepts one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
            raise ProtocolError(
                f"{where or 'body'}: invalid text (unpaired surrogate {value[e.start]!r} at {e.start})",
                param=str(path[0]) if path else None,
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, path)
            check_text(v, (*path, str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, (*path, i))


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``name``, ``description`` and
    ``strict`` are accepted and not used: the schema is always enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": ...}``
    (``api.structured`` checks the type)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class _GenerationRequest(_Strict):
    """Fields common to completions and chat completions."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_text(data)
        return data

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or null disables
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # structured output (at most one; api.structured turns them into a StructuredOutput)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self,
        *,
        max_tokens: int | None,
        max_tokens_param: str,
        prompt_param: str,
        default_max_tokens: int,
        prompt_len: int,
        max_model_len: int,
        logprobs: int | None,
    ) -> SamplingParams:
        """Build and validate SamplingParams; raise ProtocolError for anything out of range."""
        if self.n is not None and self.n != 1:
            raise ProtocolError(f"n must be 1 (one choice per request), got {self.n}", param="n")
        if prompt_len >= max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                f"{prompt_len} tokens, leaving no room for output.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:  # a default never overflows the context (vLLM trims it too)
            max_tokens = min(default_max_tokens, max_model_len - prompt_len)
        elif prompt_len + max_tokens > max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or {max_tokens_param}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        stop = _stop_strings(self.stop)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=None if self.top_k in (None, -1) else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )
        try:
            params.validate()
        except ValueError as e:
            message = str(e)
            field = message.split(" ", 1)[0]
            if field == "max_tokens":
                field = max_tokens_param
            raise ProtocolError(message, param=field if field in type(self).model_fields else None) from e
        for name, value in (
            ("temperature", params.temperature),
            ("top_p", params.top_p),
            ("min_p", params.min_p),
            ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty),
            ("repetition_penalty", params.repetition_penalty),
        ):
            if not math.isfinite(value):
                raise ProtocolError(f"{name} must be a finite number, got {value}", param=name)
        return params


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise ProtocolError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", param="stop")
    if any(s == "" for s in items):
        raise ProtocolError("stop strings must not be empty", param="stop")
    return tuple(items)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raise ProtocolError unless every id is in ``[0, vocab_size)``."""
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ProtocolError(
                f"token id {i} in {param} is out of the vocabulary [0, {vocab_size})", param=param
            )


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions body."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_input(self) -> str | list[int]:
        """The single prompt, as text or token ids.

        Raises:
            ProtocolError: Empty prompt, a batch of several prompts, or unsupported options.
        """
        if self.echo:
            raise ProtocolError("echo is not supported", param="echo")
        if self.suffix:
            raise ProtocolError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != 1:
            raise ProtocolError(f"best_of must be 1, got {self.best_of}", param="best_of")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ProtocolError(
                    f"batched prompts are not supported (got {len(prompt)}); send one prompt per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ProtocolError("prompt must not be empty", param="prompt")
        return prompt

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """SamplingParams for this request (max_tokens defaults to 16, as OpenAI's does)."""
        return self._sampling_params(
            max_tokens=self.max_tokens,
            max_tokens_param="max_tokens",
            prompt_param="prompt",
            default_max_tokens=16,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            logprobs=self.logprobs,
        )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. Extra keys (``tool_calls``, ``tool_call_id``...) go to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined by newlines into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(p.text for p in self.content)
        elif self.content is None:
            out["content"] = ""
        return out


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """SamplingParams for this request; max tokens default to the rest of the context."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ProtocolError(
                f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs"
            )
        explicit = self.max_completion_tokens is not None
        return self._sampling_params(
            max_tokens=self.max_completion_tokens if explicit else self.max_tokens,
            max_tokens_param="max_completion_tokens" if explicit else "max_tokens",
            prompt_param="messages",
            default_max_tokens=max_model_len - prompt_len,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


# --------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    """Non-streaming completion, and (with ``object`` unchanged, as OpenAI does) each stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swaserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}

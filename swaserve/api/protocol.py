"""OpenAI-compatible request models and their translation to engine types (responses:
``api.responses``).

Strict validation: a string where a number belongs, or a field this server does not know, is a
400 (never silently ignored); what a model cannot check alone (context length, vocabulary,
sampling ranges) raises ``ProtocolError``. Extensions (vLLM's spelling): ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``return_token_ids``, ``prompt_logprobs``, ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``. Every field and its behaviour: docs/API.md.
Structured output: ``response_format`` and ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (``api.structured``).

Design notes: docs/DESIGN.md#apiprotocolpy"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from pydantic import Field, model_validator

from swaserve.api.errors import ProtocolError
from swaserve.api.messages import ChatMessage, StrictModel
from swaserve.api.tools import Tool, ToolChoice
from swaserve.engine.types import MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 4
MAX_N = 64  # choices per prompt (n)
MAX_BATCH = 1024  # prompts per completions request, and choices (prompts x n)
MAX_MESSAGES = 4096  # chat messages per request
MAX_TOOLS = 1024  # tools per request (OpenAI allows 128)
MAX_CHOICES = 2000  # guided_choice alternatives (llguidance refuses more, after compiling them)

# the serving engine's context length, set per request by the HTTP front (``api.offloop``): lists
# longer than it are refused before the body is validated element by element
MAX_MODEL_LEN: ContextVar[int | None] = ContextVar("swaserve_max_model_len", default=None)


def check_sizes(data: Any) -> None:
    """Raise ProtocolError (400) for a list in a request body whose length alone makes it fail:
    more messages, tools or guided choices than the limits above, or a token-id prompt (or
    ``tokens`` to detokenize) longer than the context (``MAX_MODEL_LEN``). Runs before the
    per-element validation a multi-MB body would otherwise cost on the event loop."""
    if not isinstance(data, dict):
        return
    for name, limit in (("messages", MAX_MESSAGES), ("tools", MAX_TOOLS), ("guided_choice", MAX_CHOICES)):
        v = data.get(name)
        if isinstance(v, list) and len(v) > limit:
            raise ProtocolError(f"{name}: {len(v)} items, more than the limit of {limit}", param=name)
    max_len = MAX_MODEL_LEN.get()
    if max_len is None:
        return
    for name in ("prompt", "tokens"):
        v = data.get(name)
        if not isinstance(v, list) or not v:
            continue
        ids = [v] if not isinstance(v[0], list) else v[: MAX_BATCH + 1]
        for p in ids:
            if isinstance(p, list) and len(p) > max_len:
                raise ProtocolError(
                    f"This model's maximum context length is {max_len} tokens, and {name} has "
                    f"{len(p)} token ids.",
                    param=name,
                    code="context_length_exceeded",
                )


# --------------------------------------------------------------------------------------------
# Requests


class StreamOptions(StrictModel):
    include_usage: bool = False  # a usage chunk before [DONE]
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far
    include_obfuscation: bool = False  # OpenAI's padding field: not sent here, so only false


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
            if isinstance(v, (str, dict, list)):  # skip numbers fast: token-id prompts are long
                check_text(v, (*path, i))


def check_body(data: Any) -> Any:
    """``check_sizes`` then ``check_text`` on a raw request body (a model's before-validator);
    returns ``data``."""
    check_sizes(data)
    check_text(data)
    return data


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's named schema (``name``, ``description`` and
    ``strict`` are accepted and not used: the schema is always enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": ...}``
    (``api.structured`` checks the type)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class _GenerationRequest(StrictModel):
    """Fields common to completions and chat completions."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return check_body(data)

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
    user: str | None = None  # an end-user id for the caller's own records: accepted, has no effect
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM extension

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    # structured output (at most one; api.structured turns them into a StructuredOutput)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _check_stream_options(self) -> None:
        if self.stream_options is None:
            return
        if not self.stream:
            raise ProtocolError("stream_options is only allowed with stream: true", param="stream_options")
        if self.stream_options.include_obfuscation:
            raise ProtocolError(
                "stream_options.include_obfuscation is not supported (no obfuscation field is sent)",
                param="stream_options",
            )

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
        max_logprobs: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Build and validate SamplingParams; raise ProtocolError for anything out of range."""
        self._check_stream_options()
        if not 1 <= self.num_choices <= MAX_N:
            raise ProtocolError(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= max_logprobs:
                raise ProtocolError(f"{name} must be in [0, {max_logprobs}], got {value}", param=name)
        if prompt_len >= max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                f"{prompt_len} tokens, leaving no room for output.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        prompt_only = prompt_logprobs is not None or bool(getattr(self, "echo", False))
        if max_tokens is not None and max_tokens < (0 if prompt_only else 1):
            floor = "0" if prompt_only else "1 (0, the prompt only, goes with echo or prompt_logprobs)"
            raise ProtocolError(
                f"{max_tokens_param} must be at least {floor}, got {max_tokens}", param=max_tokens_param
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
            logit_bias=_logit_bias(self.logit_bias),
            prompt_logprobs=prompt_logprobs,
        )
        try:
            params.validate()
        except ValueError as e:
            message = str(e)
            field = message.split(" ", 1)[0]
            if field == "max_tokens":  # the name the request used
                field, message = max_tokens_param, max_tokens_param + message[len(field) :]
            raise ProtocolError(message, param=field if field in type(self).model_fields else None) from e
        checked: tuple[tuple[str, float], ...] = (
            ("temperature", params.temperature),
            ("top_p", params.top_p),
            ("min_p", params.min_p),
            ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty),
            ("repetition_penalty", params.repetition_penalty),
        )
        for field_name, number in checked:
            if not math.isfinite(number):
                raise ProtocolError(f"{field_name} must be a finite number, got {number}", param=field_name)
        return params


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` map as sorted pairs (ids checked against the vocabulary later)."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ProtocolError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not -100.0 <= value <= 100.0:
            raise ProtocolError(
                f"logit_bias of token {key} must be in [-100, 100], got {value}", param="logit_bias"
            )
        out.append((token, value))
    return tuple(sorted(out))


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


Prompt = str | list[int]


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions body."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_inputs(self) -> list[Prompt]:
        """The prompts (one, or a batch), each text or token ids.

        Raises:
            ProtocolError: an empty prompt or batch, too many prompts, or unsupported options.
        """
        if self.suffix:
            raise ProtocolError("suffix (insertion) is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise ProtocolError(
                f"best_of must equal n ({self.num_choices}): choosing among extra candidates is not "
                f"supported, got {self.best_of}",
                param="best_of",
            )
        prompt: Any = self.prompt
        is_batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        batch: list[Prompt] = prompt if is_batch else [prompt]
        if not batch:
            raise ProtocolError("prompt must not be empty", param="prompt")
        if len(batch) > MAX_BATCH:
            raise ProtocolError(f"at most {MAX_BATCH} prompts per request, got {len(batch)}", param="prompt")
        if len(batch) * self.num_choices > MAX_BATCH:
            raise ProtocolError(
                f"at most {MAX_BATCH} choices per request (prompts x n), got {len(batch)} x {self.num_choices}",
                param="n",
            )
        if any(len(p) == 0 for p in batch):
            raise ProtocolError("prompt must not be empty", param="prompt")
        return batch

    def sampling_params(
        self, prompt_len: int, max_model_len: int, max_logprobs: int = MAX_LOGPROBS
    ) -> SamplingParams:
        """SamplingParams for one prompt (max_tokens defaults to 16, as OpenAI's does). ``echo``
        with ``logprobs`` asks the engine for the prompt's logprobs too."""
        prompt_lps = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_lps = max(self.logprobs, prompt_lps or 0)
        return self._sampling_params(
            max_tokens=self.max_tokens,
            max_tokens_param="max_tokens",
            prompt_param="prompt",
            default_max_tokens=16,
            prompt_len=prompt_len,
            max_model_len=max_model_len,
            logprobs=self.logprobs,
            max_logprobs=max_logprobs,
            prompt_logprobs=prompt_lps,
        )


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extensions, as transformers' apply_chat_template
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def template_messages(self, markers: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The messages for the chat template (``ChatMessage.template_dict``)."""
        return [m.template_dict(markers) for m in self.messages]

    def media_parts(self) -> list[Any]:
        """Every image/audio/video part of the conversation, in order."""
        return [p for m in self.messages for p in m.media_parts()]

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template`` besides the messages.

        Raises:
            ProtocolError: both ``add_generation_prompt`` and ``continue_final_message``, a final
                message to continue that is not the assistant's, or a kwarg the server sets.
        """
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError(
                "continue_final_message and add_generation_prompt cannot both be true; set "
                "add_generation_prompt to false to continue the final message",
                param="continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ProtocolError(
                "continue_final_message needs the last message to be the assistant's",
                param="continue_final_message",
            )
        extra = dict(self.chat_template_kwargs or {})
        taken = sorted(extra.keys() & _TEMPLATE_RESERVED)
        if taken:
            raise ProtocolError(
                f"chat_template_kwargs may not set {', '.join(taken)} (request fields or the server's)",
                param="chat_template_kwargs",
            )
        return {
            **extra,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def sampling_params(
        self, prompt_len: int, max_model_len: int, max_logprobs: int = MAX_LOGPROBS
    ) -> SamplingParams:
        """SamplingParams for this request; max tokens default to the rest of the context."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= max_logprobs:
            raise ProtocolError(
                f"top_logprobs must be in [0, {max_logprobs}], got {self.top_logprobs}", param="top_logprobs"
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
            max_logprobs=max_logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


# apply_chat_template arguments that chat_template_kwargs must not override
_TEMPLATE_RESERVED = frozenset(
    {"conversation", "messages", "tokenize", "chat_template", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_tensors", "padding", "truncation", "max_length",
     "tools", "documents", "tokenizer_kwargs"}
)  # fmt: skip

"""OpenAI-compatible response models (completions, chat, streaming chunks, models, usage) and the
error envelope."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from swaserve.api.tools import ToolCall, ToolCallDelta

# JSON has no -inf; vLLM and OpenAI clients accept a large negative number instead.
MIN_LOGPROB = -9999.0


def _omit_none(value: Any) -> bool:
    return value is None


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
    """Legacy logprobs; with ``echo`` the prompt's first token has null logprob and top_logprobs."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry; ``rank`` 1-based among the top alternatives (null for the
    prompt token when it is not among them)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# per prompt token: {token id: entry} with the token itself and its top alternatives; null first
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_none)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)


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
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_omit_none)


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
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_omit_none)
    content: str | None = Field(default=None, exclude_if=_omit_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_omit_none)


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
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_omit_none)  # first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swaserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope (every 4xx / 5xx answer)."""

    error: ErrorDetail


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}

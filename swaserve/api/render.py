"""Response rendering for the OpenAI endpoints: one accepted request (``Job``: what it asks and what
it produced so far) and the renderers that turn its engine outputs into completion or chat objects
and SSE stream chunks."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from swaserve.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from swaserve.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from swaserve.engine.types import RequestOutput, SamplingParams, TokenLogprob


def sse_data(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finish_reason else None


@dataclass
class Job:
    """One accepted request: what it asks and what it produced so far (for the JSON answer)."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    return_token_ids: bool
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # per output token, where its text starts
    text_len: int = 0
    last: RequestOutput | None = None

    @property
    def head(self) -> dict[str, Any]:
        """The fields every response object and chunk starts with."""
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def add(self, out: RequestOutput) -> None:
        self.text_offsets.extend([self.text_len] * len(out.new_logprobs))
        self.text_len += len(out.new_text)
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.last = out

    def usage(self, out: RequestOutput) -> Usage:
        return Usage.of(out.prompt_tokens or len(self.prompt_ids), out.completion_tokens, out.cached_tokens)

    def ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.return_token_ids else None


class Renderer(ABC):
    """Turns a job's outputs into one endpoint's response objects.

    Args:
        texts: Token texts for logprobs.
        include_usage: Streams end with a usage chunk, and other chunks carry ``"usage": null``.
    """

    def __init__(self, texts: TokenTexts, include_usage: bool) -> None:
        self.texts = texts
        self.include_usage = include_usage

    def _dump(self, chunk: BaseModel) -> dict[str, Any]:
        return chunk.model_dump(exclude=None if self.include_usage else {"usage"})

    @abstractmethod
    def chunks(self, job: Job, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        """Stream chunks for one output (possibly none)."""

    @abstractmethod
    def usage_chunk(self, job: Job, usage: Usage) -> dict[str, Any]:
        """The final ``stream_options.include_usage`` chunk."""

    @abstractmethod
    def response(self, job: Job) -> dict[str, Any]:
        """The non-streaming answer, after the last output."""


class CompletionRenderer(Renderer):
    def __init__(self, texts: TokenTexts, include_usage: bool) -> None:
        super().__init__(texts, include_usage)
        self.offset = 0  # characters streamed so far: where the next token's text starts

    def _logprobs(self, job: Job, items: list[TokenLogprob], offsets: list[int]) -> CompletionLogprobs | None:
        if job.params.logprobs is None:
            return None
        return completion_logprobs(items, self.texts.text, offsets)

    def chunks(self, job: Job, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        keep_ids = bool(out.new_token_ids) and (job.return_token_ids or job.params.logprobs is not None)
        if not (first or out.finished or out.new_text or keep_ids):
            return []  # a token whose text is held back (incomplete UTF-8, possible stop string)
        offsets = [self.offset] * len(out.new_logprobs)
        self.offset += len(out.new_text)
        choice = CompletionChoice(
            text=out.new_text,
            logprobs=self._logprobs(job, out.new_logprobs, offsets),
            finish_reason=finish_reason(out),
            prompt_token_ids=job.ids(job.prompt_ids) if first else None,
            token_ids=job.ids(out.new_token_ids),
        )
        return [self._dump(CompletionResponse(**job.head, choices=[choice]))]

    def usage_chunk(self, job: Job, usage: Usage) -> dict[str, Any]:
        return CompletionResponse(**job.head, choices=[], usage=usage).model_dump()

    def response(self, job: Job) -> dict[str, Any]:
        assert job.last is not None
        choice = CompletionChoice(
            text="".join(job.text),
            logprobs=self._logprobs(job, job.logprobs, job.text_offsets),
            finish_reason=finish_reason(job.last),
            prompt_token_ids=job.ids(job.prompt_ids),
            token_ids=job.ids(job.token_ids),
        )
        return CompletionResponse(**job.head, choices=[choice], usage=job.usage(job.last)).model_dump()


class ChatRenderer(Renderer):
    def __init__(self, texts: TokenTexts, include_usage: bool, num_top: int) -> None:
        super().__init__(texts, include_usage)
        self.num_top = num_top

    def _logprobs(self, job: Job, items: list[TokenLogprob]) -> ChatLogprobs | None:
        if job.params.logprobs is None:
            return None
        return chat_logprobs(items, self.texts.text, self.texts.raw, self.num_top)

    def chunks(self, job: Job, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        choices = []
        if first:  # OpenAI opens every chat stream with the role
            delta = ChatDelta(role="assistant", content="")
            choices.append(ChatStreamChoice(delta=delta, prompt_token_ids=job.ids(job.prompt_ids)))
        keep_ids = bool(out.new_token_ids) and (job.return_token_ids or job.params.logprobs is not None)
        if out.finished or out.new_text or keep_ids:
            choices.append(
                ChatStreamChoice(
                    delta=ChatDelta(content=out.new_text or None),
                    logprobs=self._logprobs(job, out.new_logprobs),
                    finish_reason=finish_reason(out),
                    token_ids=job.ids(out.new_token_ids),
                )
            )
        return [self._dump(ChatCompletionChunk(**job.head, choices=[c])) for c in choices]

    def usage_chunk(self, job: Job, usage: Usage) -> dict[str, Any]:
        return ChatCompletionChunk(**job.head, choices=[], usage=usage).model_dump()

    def response(self, job: Job) -> dict[str, Any]:
        assert job.last is not None
        choice = ChatChoice(
            message=ChatResponseMessage(content="".join(job.text)),
            logprobs=self._logprobs(job, job.logprobs),
            finish_reason=finish_reason(job.last),
            prompt_token_ids=job.ids(job.prompt_ids),
            token_ids=job.ids(job.token_ids),
        )
        return ChatCompletionResponse(**job.head, choices=[choice], usage=job.usage(job.last)).model_dump()

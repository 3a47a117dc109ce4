"""Response rendering for the OpenAI endpoints: one accepted request (``Job``: its choices, one
engine request each, and what they produced so far) and the renderers that turn engine outputs
into completion or chat objects and SSE stream chunks.

Choices are numbered as OpenAI numbers them: prompt ``i``'s ``j``-th of ``n`` is ``i * n + j``."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from swaserve.api.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs,
)
from swaserve.api.responses import (
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
    PromptLogprobs,
    Usage,
)
from swaserve.api.tools import (
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolPlan,
    calls_from_constrained,
    new_call_id,
)
from swaserve.engine.types import RequestOutput, SamplingParams, TokenLogprob
from swaserve.media.placeholders import MediaInputs


def sse_data(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finish_reason else None


@dataclass
class Choice:
    """One choice: one engine request and what it produced so far.

    Attributes:
        index: The choice's index in the response. prompt_index: which prompt of the batch.
        engine_id: Its engine request id. echo: the prompt's text, sent before the completion
            (completions ``echo``), else None.
    """

    index: int
    prompt_index: int
    engine_id: str
    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # per output token, where its text starts
    text_len: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    last: RequestOutput | None = None
    media: MediaInputs | None = None  # the prompt's media (each choice its own copy)
    streamed: int = 0  # characters streamed so far (echo included)

    def add(self, out: RequestOutput) -> None:
        starts = out.token_text_starts or [0] * len(out.new_logprobs)
        self.text_offsets.extend(self.text_len + s for s in starts[: len(out.new_logprobs)])
        self.text_len += len(out.new_text)
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out


@dataclass
class Job:
    """One accepted request: its choices and the fields every response object starts with."""

    request_id: str
    created: int
    model: str
    return_token_ids: bool
    choices: list[Choice]
    n: int = 1  # choices per prompt

    @property
    def head(self) -> dict[str, Any]:
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def usage(self) -> Usage:
        """Prompt tokens once per prompt (its first choice's count), completion tokens of all."""
        prompt = cached = completion = 0
        for c in self.choices:
            last = c.last
            done = last.completion_tokens if last is not None else 0
            completion += done
            if c.index % self.n == 0:
                prompt += (last.prompt_tokens if last is not None else 0) or len(c.prompt_ids)
                cached += last.cached_tokens if last is not None else 0
        return Usage.of(prompt, completion, cached)

    def ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.return_token_ids else None


class Renderer(ABC):
    """Turns a job's outputs into one endpoint's response objects.

    Args:
        texts: Token texts for logprobs.
        include_usage: Streams end with a usage chunk, and other chunks carry ``"usage": null``.
    """

    def __init__(self, texts: TokenTexts, include_usage: bool, continuous_usage: bool = False) -> None:
        self.texts = texts
        self.include_usage = include_usage or continuous_usage
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: usage in every chunk

    def _dump(self, chunk: CompletionResponse | ChatCompletionChunk, job: Job) -> dict[str, Any]:
        if self.continuous_usage:
            chunk.usage = job.usage()
        return chunk.model_dump(exclude=None if self.include_usage else {"usage"})

    def _prompt_logprobs(self, choice: Choice) -> PromptLogprobs | None:
        if choice.params.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        return prompt_logprobs(choice.prompt_logprobs, self.texts.text)

    @abstractmethod
    def chunks(self, job: Job, choice: Choice, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        """Stream chunks for one output of one choice (possibly none)."""

    @abstractmethod
    def usage_chunk(self, job: Job) -> dict[str, Any]:
        """The final ``stream_options.include_usage`` chunk."""

    @abstractmethod
    def response(self, job: Job) -> dict[str, Any]:
        """The non-streaming answer, after every choice's last output."""


class CompletionRenderer(Renderer):
    def __init__(
        self,
        texts: TokenTexts,
        include_usage: bool,
        show_prompt_logprobs: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(texts, include_usage, continuous_usage)
        # echo + logprobs computes prompt logprobs for the echoed logprobs; vLLM's prompt_logprobs
        # field goes out only when the request asked for it
        self.show_prompt_logprobs = show_prompt_logprobs

    def _prompt_logprobs(self, choice: Choice) -> PromptLogprobs | None:
        return super()._prompt_logprobs(choice) if self.show_prompt_logprobs else None

    def _logprobs(
        self, choice: Choice, items: list[TokenLogprob], offsets: list[int], with_echo: bool
    ) -> CompletionLogprobs | None:
        if choice.params.logprobs is None:
            return None
        lp = completion_logprobs(items, self.texts.text, offsets)
        if with_echo and choice.echo is not None:
            head = echo_logprobs(choice.prompt_ids, choice.prompt_logprobs or [], self.texts.text)
            lp = CompletionLogprobs(
                tokens=head.tokens + lp.tokens,
                token_logprobs=head.token_logprobs + lp.token_logprobs,
                top_logprobs=head.top_logprobs + lp.top_logprobs,
                text_offset=head.text_offset + lp.text_offset,
            )
        return lp

    def chunks(self, job: Job, choice: Choice, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        keep_ids = bool(out.new_token_ids) and (job.return_token_ids or choice.params.logprobs is not None)
        if not (first or out.finished or out.new_text or keep_ids):
            return []  # a token whose text is held back (incomplete UTF-8, possible stop string)
        text = out.new_text
        if first and choice.echo is not None:
            text = choice.echo + text
            choice.streamed += len(choice.echo)
        offsets = [choice.streamed] * len(out.new_logprobs)
        choice.streamed += len(out.new_text)
        c = CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=self._logprobs(choice, out.new_logprobs, offsets, first),
            finish_reason=finish_reason(out),
            prompt_token_ids=job.ids(choice.prompt_ids) if first else None,
            token_ids=job.ids(out.new_token_ids),
            prompt_logprobs=self._prompt_logprobs(choice) if first else None,
        )
        return [self._dump(CompletionResponse(**job.head, choices=[c]), job)]

    def usage_chunk(self, job: Job) -> dict[str, Any]:
        return CompletionResponse(**job.head, choices=[], usage=job.usage()).model_dump()

    def response(self, job: Job) -> dict[str, Any]:
        choices = []
        for ch in job.choices:
            assert ch.last is not None
            echo = ch.echo or ""
            offsets = [len(echo) + o for o in ch.text_offsets]
            choices.append(
                CompletionChoice(
                    index=ch.index,
                    text=echo + "".join(ch.text),
                    logprobs=self._logprobs(ch, ch.logprobs, offsets, True),
                    finish_reason=finish_reason(ch.last),
                    prompt_token_ids=job.ids(ch.prompt_ids),
                    token_ids=job.ids(ch.token_ids),
                    prompt_logprobs=self._prompt_logprobs(ch),
                )
            )
        return CompletionResponse(**job.head, choices=choices, usage=job.usage()).model_dump()


def _tool_deltas(calls: list[ToolCall], first_index: int) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(index=first_index + k, id=c.id, type="function",
                      function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments))
        for k, c in enumerate(calls)
    ]  # fmt: skip


@dataclass
class _ToolStream:
    """One streamed choice's tool-call state (``ChatRenderer``)."""

    parser: ToolCallParser
    count: int = 0  # tool calls streamed so far
    named_id: str | None = None
    buffered: str = ""  # required: the JSON list, parsed at the end


class ChatRenderer(Renderer):
    """Args: num_top: alternatives per token in logprobs; tools: the request's ``ToolPlan``."""

    def __init__(
        self,
        texts: TokenTexts,
        include_usage: bool,
        num_top: int,
        tools: ToolPlan | None = None,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(texts, include_usage, continuous_usage)
        self.num_top = num_top
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._streams: dict[int, _ToolStream] = {}

    def _logprobs(self, choice: Choice, items: list[TokenLogprob]) -> ChatLogprobs | None:
        if choice.params.logprobs is None:
            return None
        return chat_logprobs(items, self.texts.text, self.texts.raw, self.num_top)

    def _reason(self, out: RequestOutput, called: bool) -> str | None:
        reason = finish_reason(out)
        return "tool_calls" if called and reason == "stop" else reason

    def _stream_tools(
        self, choice: Choice, out: RequestOutput
    ) -> tuple[str | None, list[ToolCallDelta], bool]:
        """(content delta, tool-call deltas, whether the choice called a tool so far)."""
        plan = self.tools
        assert plan is not None
        st = self._streams.setdefault(choice.index, _ToolStream(ToolCallParser(plan.parallel)))
        deltas: list[ToolCallDelta] = []
        content = ""
        if plan.mode == "auto":
            content, calls = st.parser.feed(out.new_text)
            deltas, st.count = _tool_deltas(calls, st.count), st.count + len(calls)
            if out.finished:
                content += st.parser.finish()
        elif plan.mode == "named":
            if st.named_id is None and (out.new_text or out.finished):
                st.named_id = new_call_id()
                fn = FunctionCallDelta(name=plan.name, arguments=out.new_text)
                deltas, st.count = [ToolCallDelta(index=0, id=st.named_id, type="function", function=fn)], 1
            elif out.new_text:
                deltas = [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=out.new_text))]
        else:
            st.buffered += out.new_text
            if out.finished:
                parsed = calls_from_constrained(plan, st.buffered)
                if parsed is None:
                    content = st.buffered  # cut short (max_tokens): the raw text
                else:
                    deltas, st.count = _tool_deltas(parsed, 0), len(parsed)
        return content or None, deltas, st.count > 0

    def chunks(self, job: Job, choice: Choice, out: RequestOutput, first: bool) -> list[dict[str, Any]]:
        choices = []
        if first:  # OpenAI opens every chat stream with the role
            delta = ChatDelta(role="assistant", content="")
            choices.append(
                ChatStreamChoice(index=choice.index, delta=delta, prompt_token_ids=job.ids(choice.prompt_ids))
            )
        content, called = out.new_text or None, False
        tool_deltas: list[ToolCallDelta] = []
        if self.tools is not None:
            content, tool_deltas, called = self._stream_tools(choice, out)
        keep_ids = bool(out.new_token_ids) and (job.return_token_ids or choice.params.logprobs is not None)
        if out.finished or content or tool_deltas or keep_ids:
            choices.append(
                ChatStreamChoice(
                    index=choice.index,
                    delta=ChatDelta(content=content, tool_calls=tool_deltas or None),
                    logprobs=self._logprobs(choice, out.new_logprobs),
                    finish_reason=self._reason(out, called),
                    token_ids=job.ids(out.new_token_ids),
                )
            )
        plp = self._prompt_logprobs(choice) if first and choice.index == 0 else None
        return [
            self._dump(
                ChatCompletionChunk(**job.head, choices=[c], prompt_logprobs=plp if k == 0 else None), job
            )
            for k, c in enumerate(choices)
        ]

    def usage_chunk(self, job: Job) -> dict[str, Any]:
        return ChatCompletionChunk(**job.head, choices=[], usage=job.usage()).model_dump()

    def _message(self, choice: Choice) -> ChatResponseMessage:
        text = "".join(choice.text)
        plan = self.tools
        if plan is None:
            return ChatResponseMessage(content=text)
        if plan.mode == "auto":
            parser = ToolCallParser(plan.parallel)
            content, found = parser.feed(text)
            content += parser.finish()
            return ChatResponseMessage(
                content=content.strip() or None if found else content, tool_calls=found or None
            )
        if plan.mode == "named":  # the output is the arguments, as streamed (cut short: partial)
            fn = FunctionCall(name=plan.name or "", arguments=text)
            return ChatResponseMessage(content=None, tool_calls=[ToolCall(id=new_call_id(), function=fn)])
        calls = calls_from_constrained(plan, text)
        if calls is None:
            return ChatResponseMessage(content=text)  # a list of calls cut short: the raw text
        return ChatResponseMessage(content=None, tool_calls=calls)

    def response(self, job: Job) -> dict[str, Any]:
        choices = []
        for ch in job.choices:
            assert ch.last is not None
            message = self._message(ch)
            choices.append(
                ChatChoice(
                    index=ch.index,
                    message=message,
                    logprobs=self._logprobs(ch, ch.logprobs),
                    finish_reason=self._reason(ch.last, bool(message.tool_calls)),
                    prompt_token_ids=job.ids(ch.prompt_ids),
                    token_ids=job.ids(ch.token_ids),
                )
            )
        plp = self._prompt_logprobs(job.choices[0])
        return ChatCompletionResponse(
            **job.head, choices=choices, usage=job.usage(), prompt_logprobs=plp
        ).model_dump()

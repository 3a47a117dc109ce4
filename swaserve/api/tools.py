"""Tool calling for chat completions: the request's ``tools`` / ``tool_choice`` and the model's
tool-call syntax parsed back into OpenAI ``tool_calls``.

The bundled chat templates (and Qwen/Hermes-style ones) tell the model to write a call as
``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``; ``ToolCallParser`` finds such
blocks in the output, also incrementally for streams (text that may open a block is held back
until it does or cannot). ``required`` and a named function are enforced by constrained decoding,
as vLLM does it: the output is constrained to JSON (the named function's arguments, or a list of
``{"name", "parameters"}``) and turned into calls from that JSON.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from swaserve.api.errors import ProtocolError
from swaserve.api.messages import StrictModel
from swaserve.engine.types import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for rendering, decoding and parsing.

    Attributes:
        render: tools passed to the chat template (None: no tools in the prompt).
        mode: ``none`` (plain text), ``auto`` (parse the model's blocks), ``named`` (the output is
            the named function's arguments), ``required`` (the output is a JSON list of calls).
        constraint: the structured output that enforces ``named`` / ``required``.
        name: the named function. parallel: more than one call allowed.
    """

    render: list[dict[str, Any]] | None
    mode: Literal["none", "auto", "named", "required"]
    constraint: StructuredOutput | None = None
    name: str | None = None
    parallel: bool = True


def _schema(fn: FunctionDef) -> dict[str, Any]:
    return fn.parameters or {"type": "object", "properties": {}}


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool) -> ToolPlan:
    """The ``ToolPlan`` of a request.

    Raises:
        ProtocolError: ``tool_choice`` without tools, a named function that is not among them,
            or duplicate tool names.
    """
    if not tools:
        if choice not in (None, "none"):
            raise ProtocolError("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, "none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ProtocolError("tool names must be unique", param="tools")
    render = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(None, "none")
    if choice is None or choice == "auto":
        return ToolPlan(render, "auto", parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        fn = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if fn is None:
            raise ProtocolError(
                f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        return ToolPlan(render, "named", StructuredOutput("json_schema", json.dumps(_schema(fn))), fn.name)
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "parameters": _schema(t.function)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        },
    }
    if not parallel:
        calls["maxItems"] = 1
    return ToolPlan(render, "required", StructuredOutput("json_schema", json.dumps(calls)), parallel=parallel)


def calls_from_constrained(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls of a ``required`` output, a JSON list of calls (None: it is not complete JSON,
    e.g. cut by ``max_tokens``). A ``named`` output is the arguments themselves (``api.render``)."""
    assert plan.mode == "required"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [
        ToolCall(
            id=new_call_id(), function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"]))
        )
        for c in value
    ]


def _call(block: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=value["name"], arguments=arguments))


@dataclass
class ToolCallParser:
    """Incremental parser of ``<tool_call>{...}</tool_call>`` blocks in model output.

    ``feed(text)`` returns the content that is certainly not part of a block and the calls that
    completed; ``finish()`` flushes what is left (an unclosed or unparsable block is content).
    """

    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, new = "", []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                break
            end = self._buf.find(CLOSE, start)
            if end < 0:
                content += self._buf[:start]
                self._buf = self._buf[start:]
                break
            content += self._buf[:start]
            block = self._buf[start + len(OPEN) : end]
            self._buf = self._buf[end + len(CLOSE) :]
            call = _call(block.strip())
            if call is None:
                content += OPEN + block + CLOSE
            elif self.parallel or not self.calls:
                self.calls.append(call)
                new.append(call)
        return content, new

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return rest


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0

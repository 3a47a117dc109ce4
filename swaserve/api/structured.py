"""A request's structured-output fields -> one checked ``StructuredOutput`` (or None).

Fields: OpenAI's ``response_format`` (``{"type": "text"}``: none; ``{"type": "json_object"}``:
any JSON object; ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}``: that schema) and vLLM's ``guided_json`` (a schema, as an object or as JSON
text), ``guided_regex``, ``guided_choice`` (a list of strings) and ``guided_grammar`` (Lark, or
GBNF). At most one constraint per request. The grammar is compiled and checked here, off the event
loop (``asyncio.to_thread``): an invalid one is a 400 with llguidance's message before the request
reaches the engine.

Source: OpenAI API reference (``response_format``); vLLM's OpenAI server (``guided_*``
extensions). Engine side: ``engine.structured``.
"""

from __future__ import annotations

import asyncio
import json

from swaserve.api.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from swaserve.engine.grammar import validate
from swaserve.engine.types import StructuredOutput

_RESPONSE_TYPES = ("text", "json_object", "json_schema")


def requested(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, StructuredOutput] | None:
    """The request's constraint and the field that asked for it (not compiled yet).

    Raises:
        ProtocolError: (400, ``param`` the field) an unknown ``response_format.type``, a
            ``json_schema`` without its schema, a ``guided_json`` string that is not a JSON
            schema, an empty ``guided_choice``, or more than one constraint.
    """
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None:
        if rf.type not in _RESPONSE_TYPES:
            raise ProtocolError(
                f"response_format.type must be one of {list(_RESPONSE_TYPES)}, got {rf.type!r}",
                param="response_format",
            )
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ProtocolError(
                    "response_format of type json_schema needs json_schema.schema", param="response_format"
                )
            found.append(
                ("response_format", StructuredOutput("json_schema", json.dumps(rf.json_schema.schema_)))
            )
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ProtocolError(f"guided_json is not valid JSON: {e}", param="guided_json") from None
            if not isinstance(schema, dict | bool):
                raise ProtocolError("guided_json must be a JSON schema (an object)", param="guided_json")
        found.append(("guided_json", StructuredOutput("json_schema", json.dumps(schema))))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput("regex", req.guided_regex)))
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise ProtocolError("guided_choice must list at least one choice", param="guided_choice")
        found.append(("guided_choice", StructuredOutput("choice", json.dumps(req.guided_choice))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput("grammar", req.guided_grammar)))
    if len(found) > 1:
        raise ProtocolError(
            f"one structured-output constraint per request, got {len(found)}: {', '.join(f for f, _ in found)}",
            param=found[1][0],
        )
    return found[0] if found else None


async def structured_output(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The request's checked constraint, or None when it asks for none.

    Raises:
        ProtocolError: (400, ``param`` the field) what ``requested`` refuses, or a schema, regex
            or grammar llguidance cannot compile (its message).
    """
    got = requested(req)
    if got is None:
        return None
    param, so = got
    return await checked(so, param)  # a large schema compiles for a while


async def checked(so: StructuredOutput, param: str) -> StructuredOutput:
    """``so`` once llguidance compiles it (in a worker thread). Raises ProtocolError (400, ``param``)."""
    try:
        await asyncio.to_thread(validate, so)
    except ValueError as e:
        raise ProtocolError(f"invalid {param}: {e}", param=param) from None
    return so

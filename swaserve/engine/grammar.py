"""Structured-output grammars, torch-free (the front's checks run in the router): ``grammar_of``
compiles a request's ``StructuredOutput`` (JSON schema, any JSON object, regex, choice, Lark/GBNF
grammar) to llguidance's grammar text, ``validate`` checks it (the front's 400, before a request
reaches the engine), and ``Grammar`` is one request's matcher state in the core
(``engine.structured.StructuredDecoder`` builds and masks with them).

JSON is compiled compact (``", "`` and ``": "`` separators, no free whitespace) unless the schema's
``x-guidance`` says otherwise: free whitespace lets a model (and certainly random weights) emit
whitespace forever, and bounded schemas (``maxLength``, ``maxItems``, ``enum``, ``maximum``) then
always end.

Source: llguidance (https://github.com/guidance-ai/llguidance), ``LLMatcher`` API; vLLM's
llguidance backend (vllm/v1/structured_output/backend_guidance.py).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from swaserve.engine.types import StructuredOutput

# JSON layout when the schema does not choose one (its "x-guidance" key overrides these).
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'


def grammar_of(so: StructuredOutput) -> str:
    """llguidance grammar text of a constraint (not checked yet: ``validate``).

    Args:
        so: The constraint (``StructuredOutput`` documents each kind's ``spec``).

    Returns:
        The grammar, as ``LLMatcher`` takes it.

    Raises:
        ValueError: a spec of the wrong shape (a schema that is not a JSON object or boolean, a
            choice that is not a non-empty JSON list of strings) or an unknown kind.
    """
    so.validate()
    if so.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if so.kind == "json_schema":
        try:
            schema = json.loads(so.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"choices are not valid JSON: {e}") from None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise ValueError("choices must be a non-empty list of strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.grammar_from("grammar", so.spec)  # Lark, or GBNF converted to Lark


def validate(so: StructuredOutput) -> None:
    """Raise ValueError with llguidance's message if the constraint cannot be compiled.

    CPU-bound (well under a millisecond for small schemas, up to ~1 s for huge ones): callers on
    an event loop run it in a thread. Grammar warnings are not errors.
    """
    message = llguidance.LLMatcher.validate_grammar(grammar_of(so))
    if message:
        raise ValueError(message)


class Grammar:
    """One request's matcher state (``LLMatcher``) over the tokens generated so far.

    Attributes:
        done: the constraint is complete (the matcher stopped): the request ends with STOP.
        error: why the matcher failed ("" while it has not): the request fails.
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.done = False
        self.error = ""

    def accept(self, token: int) -> None:
        """Feed the token the sampler picked; sets ``done`` or ``error``."""
        if self.error:
            return
        if not self.matcher.consume_token(token):
            self.error = f"structured output failed: {self.matcher.get_error() or f'token {token} rejected'}"
        elif self.matcher.is_stopped():
            self.done = True

    def healthy(self) -> bool:
        """Whether the matcher is healthy (after a mask computation); sets ``error`` if not."""
        if not self.error and self.matcher.is_error():
            self.error = f"structured output failed: {self.matcher.get_error()}"
        return not self.error

"""Reader for the agentic multi-turn request trace, and its ChatML token-id prompts.

``data/agentic/agent_sessions.jsonl.gz``: 841 calls of 49 public agent sessions, each call with the
whole chat history so far. ``tokenize_calls`` tokenizes each distinct message once and concatenates
the segments: exactly ``tokenize(render(messages))``, because every ChatML segment starts with an
added special token, on which Hugging Face tokenizers split before BPE.

Design notes: docs/DESIGN.md#agenticpy"""

from __future__ import annotations

import gzip
import io
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swaserve.traces import TraceError, json_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_AGENT_TRACE = Path(__file__).resolve().parent.parent / "data" / "agentic" / "agent_sessions.jsonl.gz"
"""The agentic trace committed with the repository (gzip of the upstream ``agent_sessions.jsonl``)."""

ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Message roles the trace schema allows."""

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
"""What the chat template appends after the messages when ``add_generation_prompt=True``."""

_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Message:
    """One chat message of a call: ``role`` (system, user, assistant or tool) and text ``content``."""

    role: str
    content: str


@dataclass(frozen=True)
class AgentCall:
    """One LLM call of an agent session.

    Attributes:
        session_id: The session, e.g. ``"mini-swe-agent/django__django-11099"`` or
            ``"tau-bench/gpt-4o-airline/task012/trial3"``.
        turn: 0-based index of the call within its session.
        timestamp_ms: Synthetic send time, milliseconds from the trace start (non-decreasing in the
            file). A closed-loop replayer should rather send call k+1 a think time after call k ends.
        messages: The complete chat history sent on this call. Within a session, calls that share
            messages share the ``Message`` objects too (the reader interns them).
        output_chars: Length, in characters, of the assistant reply this call produced.
    """

    session_id: str
    turn: int
    timestamp_ms: int
    messages: tuple[Message, ...]
    output_chars: int

    @property
    def prompt_chars(self) -> int:
        """Sum of the messages' content lengths, in characters (the trace caps it at 60,000)."""
        return sum(len(m.content) for m in self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as ``[{"role": ..., "content": ...}]``, for ``apply_chat_template`` or an API."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


def read_agent_sessions(
    path: str | Path = DEFAULT_AGENT_TRACE, limit: int | None = None, *, check_invariant: bool = True
) -> list[AgentCall]:
    """Read an agentic trace (JSON lines, plain or gzip-compressed) in file order.

    Gzip input is recognised by its magic bytes, not by the file name.

    Args:
        path: A ``.jsonl`` or ``.jsonl.gz`` file; default: the committed trace.
        limit: Read at most this many calls (None = all).
        check_invariant: Also check, per session, that turns run 0, 1, 2, ... and that call k+1's
            messages start with call k's messages followed by an assistant message of exactly
            ``output_chars`` characters (the trace's call invariant).

    Returns:
        The calls, in file (send-time) order; sessions interleave.

    Raises:
        TraceError: With ``file:line``: a line is not valid UTF-8 or JSON, is not an object with the
            five fields of the right types (``session_id`` a non-empty string; ``turn``,
            ``timestamp_ms`` and ``output_chars`` non-negative integers; ``messages`` a non-empty
            list of ``{"role": one of ROLES, "content": string}``), timestamps decrease, or (with
            ``check_invariant``) the call invariant is broken. Also raised for a truncated gzip file.
        ValueError: ``limit`` is negative.
        OSError: The file cannot be read or is not valid gzip.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative, got {limit}")
    return list(_iter_calls(Path(path), limit, check_invariant))


def _open_lines(path: Path) -> io.BufferedIOBase:
    with path.open("rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == _GZIP_MAGIC else path.open("rb")


def _iter_calls(path: Path, limit: int | None, check_invariant: bool) -> Iterator[AgentCall]:
    if limit == 0:
        return
    count = 0
    prev_ts = 0
    last: dict[str, AgentCall] = {}  # session_id -> its latest call so far
    lineno = 0
    with _open_lines(path) as f:
        try:
            for lineno, raw_line in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TraceError(f"{where}: not valid UTF-8: {e}") from e
                if not line.strip():
                    continue
                call = _parse_line(line, where, last)
                if call.timestamp_ms < prev_ts:
                    raise TraceError(f"{where}: timestamp_ms {call.timestamp_ms} < previous {prev_ts}")
                if check_invariant:
                    _check_invariant(last.get(call.session_id), call, where)
                prev_ts = call.timestamp_ms
                last[call.session_id] = call
                yield call
                count += 1
                if limit is not None and count >= limit:
                    return
        except EOFError as e:  # gzip stream cut short
            raise TraceError(f"{path}:{lineno + 1}: truncated gzip data: {e}") from e


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_line(line: str, where: str, last: dict[str, AgentCall]) -> AgentCall:
    raw = json_object(line, where)
    try:
        sid, turn, ts, msgs, out = (
            raw["session_id"],
            raw["turn"],
            raw["timestamp_ms"],
            raw["messages"],
            raw["output_chars"],
        )
    except KeyError as e:
        raise TraceError(f"{where}: missing field {e.args[0]!r}") from e
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{where}: session_id must be a non-empty string")
    for name, v in (("turn", turn), ("timestamp_ms", ts), ("output_chars", out)):
        if not _is_int(v) or v < 0:
            raise TraceError(f"{where}: {name} must be a non-negative integer, got {v!r}")
    if not isinstance(msgs, list) or not msgs:
        raise TraceError(f"{where}: messages must be a non-empty list")
    prev = last.get(sid)
    prev_msgs: tuple[Message, ...] = prev.messages if prev is not None else ()
    messages: list[Message] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise TraceError(f"{where}: messages[{i}] is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise TraceError(f"{where}: messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise TraceError(f"{where}: messages[{i}].content must be a string")
        # Reuse the previous call's object when equal: saves memory (prompts repeat the whole history)
        # and makes later equality checks and dict lookups identity-fast.
        if i < len(prev_msgs) and prev_msgs[i].role == role and prev_msgs[i].content == content:
            messages.append(prev_msgs[i])
        else:
            messages.append(Message(role=role, content=content))
    return AgentCall(session_id=sid, turn=turn, timestamp_ms=ts, messages=tuple(messages), output_chars=out)


def _check_invariant(prev: AgentCall | None, call: AgentCall, where: str) -> None:
    if prev is None:
        if call.turn != 0:
            raise TraceError(f"{where}: session {call.session_id!r} starts at turn {call.turn}, not 0")
        return
    if call.turn != prev.turn + 1:
        raise TraceError(f"{where}: session {call.session_id!r} turn {call.turn} follows turn {prev.turn}")
    n = len(prev.messages)
    if call.messages[:n] != prev.messages:
        raise TraceError(f"{where}: turn {call.turn} does not start with turn {prev.turn}'s messages")
    if len(call.messages) <= n or call.messages[n].role != "assistant":
        raise TraceError(
            f"{where}: turn {call.turn} does not continue with turn {prev.turn}'s assistant reply"
        )
    if len(call.messages[n].content) != prev.output_chars:
        raise TraceError(
            f"{where}: turn {prev.turn}'s reply has {len(call.messages[n].content)} characters, "
            f"but its output_chars is {prev.output_chars}"
        )


def render_message(message: Message) -> str:
    """One message's ChatML segment: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    return f"{IM_START}{message.role}\n{message.content}{IM_END}\n"


def render_prompt(messages: Iterable[Message], add_generation_prompt: bool = True) -> str:
    """The prompt text ``CHAT_TEMPLATE`` renders for ``messages`` without tools.

    The template renders a system message like any other (it only merges it into the tool block
    when tools are given) and writes any role name verbatim, so ``tool`` messages become
    ``<|im_start|>tool\\n...``.
    """
    text = "".join(render_message(m) for m in messages)
    return text + GENERATION_PROMPT if add_generation_prompt else text


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    ids: Any = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [list(x) for x in ids]


def _check_marker_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """The ids of ``<|im_start|>`` and ``<|im_end|>``, after checking the tokenizer splits on them."""
    got = _encode(tokenizer, [IM_START, IM_END, f"a{IM_START}b{IM_END}c", "a", "b", "c"])
    start, end, mixed, a, b, c = got
    if len(start) != 1 or len(end) != 1 or mixed != a + start + b + end + c:
        raise ValueError(
            f"tokenizer does not treat {IM_START} and {IM_END} as single added tokens that split the "
            "text, so per-message tokenization would not equal whole-prompt tokenization"
        )
    return start[0], end[0]


def tokenize_calls(calls: Sequence[AgentCall], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Prompt token ids of each call, as ``apply_chat_template(messages, add_generation_prompt=True)``.

    Renders with ChatML as ``CHAT_TEMPLATE`` does (see ``render_prompt``) and tokenizes without
    extra special tokens (no BOS), like ``apply_chat_template(..., tokenize=True)``. Each distinct
    (role, content) message is tokenized once, all in one batch; prompts are concatenations of the
    cached segments plus the generation prompt. Within a session, call k's ids minus the trailing
    generation prompt are therefore a prefix of call k+1's ids.

    Args:
        calls: The calls, e.g. from ``read_agent_sessions``.
        tokenizer: A Hugging Face tokenizer whose ``<|im_start|>``/``<|im_end|>`` are added tokens,
            e.g. ``AutoTokenizer.from_pretrained(tokenizer_dir("default"))``. Its own chat template is not
            used: for a checkpoint whose template is not ChatML the ids would differ from its
            ``apply_chat_template``.

    Returns:
        One list of token ids per call, in order (fresh lists; the caller may mutate them).

    Raises:
        ValueError: The tokenizer does not split on the chat markers (per-message tokenization would
            not be exact).
    """
    _check_marker_tokens(tokenizer)
    distinct: dict[Message, int] = {}
    for call in calls:
        for m in call.messages:
            if m not in distinct:
                distinct[m] = len(distinct)
    segments = _encode(tokenizer, [render_message(m) for m in distinct])
    (gen,) = _encode(tokenizer, [GENERATION_PROMPT])
    out: list[list[int]] = []
    for call in calls:
        ids: list[int] = []
        for m in call.messages:
            ids.extend(segments[distinct[m]])
        ids.extend(gen)
        out.append(ids)
    return out


def generation_prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the generation prompt ``<|im_start|>assistant\\n`` (5 with the default checkpoint)."""
    return _encode(tokenizer, [GENERATION_PROMPT])[0]


def estimate_output_tokens(call: AgentCall, chars_per_token: float = 4.0) -> int:
    """Output length of ``call`` in tokens, estimated as ``ceil(output_chars / chars_per_token)``.

    The trace records replies in characters only. 4.0 is the trace README's own proxy; at least 1
    is returned, so a replay always generates something.

    Raises:
        ValueError: ``chars_per_token`` is not positive.
    """
    if not chars_per_token > 0:
        raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
    return max(1, math.ceil(call.output_chars / chars_per_token))

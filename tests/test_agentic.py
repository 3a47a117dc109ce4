"""Agentic trace reader and its ChatML token-id prompts."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from swaserve.agentic import (
    DEFAULT_AGENT_TRACE,
    GENERATION_PROMPT,
    AgentCall,
    Message,
    estimate_output_tokens,
    generation_prompt_ids,
    read_agent_sessions,
    render_prompt,
    tokenize_calls,
)
from swaserve.traces import TraceError

TRACE_SHA256 = "81837c03a0e5621558255eeb9a70d0b83808c2fca93a36f4c7808b51dc5af5e8"  # uncompressed
GZ_SHA256 = "360d5aa9558e081476f647eabb1c8ec8db3071a25e4ca4e1be2e1fc9b420d203"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from swaserve.model.checkpoint import tokenizer_dir

    return AutoTokenizer.from_pretrained(str(tokenizer_dir("default")))


@pytest.fixture(scope="module")
def all_calls() -> list[AgentCall]:
    return read_agent_sessions()


def _raw_lines(n: int) -> list[bytes]:
    with gzip.open(DEFAULT_AGENT_TRACE, "rb") as f:
        return list(itertools.islice(f, n))


def test_committed_trace_is_the_upstream_file() -> None:
    data = DEFAULT_AGENT_TRACE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == GZ_SHA256
    assert hashlib.sha256(gzip.decompress(data)).hexdigest() == TRACE_SHA256


def test_read_first_calls() -> None:
    calls = read_agent_sessions(limit=3)
    assert len(calls) == 3
    first = calls[0]
    assert (first.session_id, first.turn, first.timestamp_ms) == ("mini-swe-agent/django__django-14855", 0, 0)
    assert [m.role for m in first.messages] == ["system", "user"]
    assert first.output_chars > 0
    assert first.prompt_chars == sum(len(m.content) for m in first.messages)
    assert read_agent_sessions(limit=0) == []
    with pytest.raises(ValueError, match="non-negative"):
        read_agent_sessions(limit=-1)


def test_plain_and_gzip_readers_agree(tmp_path: Path) -> None:
    lines = _raw_lines(40)
    plain = tmp_path / "s.jsonl"
    plain.write_bytes(b"".join(lines))
    gz = tmp_path / "s.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(lines)))
    odd = tmp_path / "gzip-without-suffix.jsonl"  # detected by magic bytes, not the name
    odd.write_bytes(gz.read_bytes())
    expected = read_agent_sessions(limit=40)
    assert read_agent_sessions(plain) == expected
    assert read_agent_sessions(gz) == expected
    assert read_agent_sessions(odd) == expected
    assert read_agent_sessions(str(plain), limit=5) == expected[:5]


def test_whole_trace(all_calls: list[AgentCall]) -> None:
    assert len(all_calls) == 841
    sessions = {c.session_id for c in all_calls}
    assert len(sessions) == 49
    assert sum(s.startswith("mini-swe-agent/") for s in sessions) == 13  # the upstream README says 17
    assert sum(s.startswith("tau-bench/") for s in sessions) == 36
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(all_calls))
    assert {m.role for c in all_calls for m in c.messages} == {"system", "user", "assistant", "tool"}
    assert max(c.prompt_chars for c in all_calls) <= 60_000
    # The reader interns repeated messages: call k+1 holds call k's very Message objects.
    last: dict[str, AgentCall] = {}
    for c in all_calls:
        prev = last.get(c.session_id)
        if prev is not None:
            assert all(a is b for a, b in zip(prev.messages, c.messages, strict=False))
        last[c.session_id] = c


def _call(sid: Any = "s", turn: Any = 0, ts: Any = 0, msgs: Any = None, out: Any = 2) -> dict[str, Any]:
    if msgs is None:
        msgs = [{"role": "user", "content": "hi"}]
    return {"session_id": sid, "turn": turn, "timestamp_ms": ts, "messages": msgs, "output_chars": out}


def _write(tmp_path: Path, rows: list[Any]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "ok"}
T = {"role": "tool", "content": "result"}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["{not json"], "not valid JSON"),
        (["[1, 2]"], "expected a JSON object"),
        ([{k: v for k, v in _call().items() if k != "output_chars"}], "missing field 'output_chars'"),
        ([_call(sid="")], "session_id"),
        ([_call(turn=-1)], "turn must be a non-negative integer"),
        ([_call(turn=True)], "turn must be a non-negative integer"),
        ([_call(ts=1.5)], "timestamp_ms must be a non-negative integer"),
        ([_call(out="12")], "output_chars must be a non-negative integer"),
        ([_call(msgs=[])], "messages must be a non-empty list"),
        ([_call(msgs=["hi"])], r"messages\[0\] is not an object"),
        ([_call(msgs=[{"role": "function", "content": "x"}])], r"messages\[0\].role must be one of"),
        ([_call(msgs=[{"role": "user", "content": ["x"]}])], r"messages\[0\].content must be a string"),
        ([_call(ts=5), _call(sid="t", ts=4)], "timestamp_ms 4 < previous 5"),
        ([_call(turn=1)], "starts at turn 1, not 0"),
        ([_call(), _call(turn=2, msgs=[U, A, T])], "turn 2 follows turn 0"),
        ([_call(), _call(turn=1, msgs=[{"role": "user", "content": "hey"}, A, T])], "does not start with"),
        ([_call(), _call(turn=1, msgs=[U, T])], "assistant reply"),
        ([_call(out=3), _call(turn=1, msgs=[U, A, T])], "reply has 2 characters, but its output_chars is 3"),
    ],
)
def test_malformed_lines(tmp_path: Path, rows: list[Any], message: str) -> None:
    p = _write(tmp_path, rows)
    with pytest.raises(TraceError, match=message) as info:
        read_agent_sessions(p)
    assert f"{p}:{len(rows)}:" in str(info.value)


def test_invariant_check_can_be_turned_off(tmp_path: Path) -> None:
    rows = [_call(turn=3), _call(turn=1, msgs=[T])]
    p = _write(tmp_path, rows)
    with pytest.raises(TraceError):
        read_agent_sessions(p)
    assert [c.turn for c in read_agent_sessions(p, check_invariant=False)] == [3, 1]


def test_bad_bytes_and_truncated_gzip(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(json.dumps(_call()).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=rf"{p}:2: not valid UTF-8"):
        read_agent_sessions(p)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(_raw_lines(3)))[:-20])
    with pytest.raises(TraceError, match="truncated gzip"):
        read_agent_sessions(gz)


def _sample_calls(calls: list[AgentCall]) -> list[AgentCall]:
    """A few short real calls: a first call, the first with a tool message, a later turn, tau-bench."""
    first_tool = next(c for c in calls if any(m.role == "tool" for m in c.messages))
    later = next(c for c in calls if c.session_id == first_tool.session_id and c.turn == 3)
    tau_tool = min(
        (
            c
            for c in calls
            if c.session_id.startswith("tau-bench/") and any(m.role == "tool" for m in c.messages)
        ),
        key=lambda c: c.prompt_chars,
    )
    return [calls[0], first_tool, later, tau_tool]


def test_tokenize_equals_chat_template(tokenizer: Any, all_calls: list[AgentCall]) -> None:
    sample = _sample_calls(all_calls)
    got = tokenize_calls(sample, tokenizer)
    for call, ids in zip(sample, got, strict=True):
        text = tokenizer.apply_chat_template(call.chat_messages(), tokenize=False, add_generation_prompt=True)
        assert text == render_prompt(call.messages)
        ref = tokenizer.apply_chat_template(
            call.chat_messages(), tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert ids == list(ref)
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_whole_trace_token_prefixes(tokenizer: Any, all_calls: list[AgentCall]) -> None:
    ids = tokenize_calls(all_calls, tokenizer)
    assert len(ids) == len(all_calls)
    gen = generation_prompt_ids(tokenizer)
    assert gen == tokenizer(GENERATION_PROMPT, add_special_tokens=False)["input_ids"]
    last: dict[str, list[int]] = {}
    pairs = 0
    for call, toks in zip(all_calls, ids, strict=True):
        assert toks[-len(gen) :] == gen
        prev = last.get(call.session_id)
        if prev is not None:
            pairs += 1
            body = prev[: -len(gen)]
            assert toks[: len(body)] == body  # call k's prompt minus the generation prompt
            # Here the whole prompt (generation prompt included) is a prefix too, because no assistant
            # reply in this trace starts with whitespace; see test_generation_prompt_is_not_always_a_prefix.
            assert toks[: len(prev)] == prev
        last[call.session_id] = toks
    assert pairs == len(all_calls) - 49


def test_generation_prompt_is_not_always_a_prefix(tokenizer: Any) -> None:
    """A reply starting with whitespace merges with the ``\\n`` after ``assistant`` into one pre-token."""
    user = Message("user", "hi")
    reply = "\n\nok"
    k, k1 = tokenize_calls(
        [
            AgentCall("s", 0, 0, (user,), len(reply)),
            AgentCall("s", 1, 1, (user, Message("assistant", reply), Message("user", "more")), 2),
        ],
        tokenizer,
    )
    gen = generation_prompt_ids(tokenizer)
    assert k1[: len(k) - len(gen)] == k[: -len(gen)]
    assert k1[: len(k)] != k


def test_tokenizer_must_split_on_chat_markers() -> None:
    def char_tokenizer(texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [[ord(ch) for ch in t] for t in texts]}

    call = AgentCall("s", 0, 0, (Message("user", "hi"),), 2)
    with pytest.raises(ValueError, match="single added tokens"):
        tokenize_calls([call], char_tokenizer)  # type: ignore[arg-type]


def test_estimate_output_tokens() -> None:
    def call(n: int) -> AgentCall:
        return AgentCall("s", 0, 0, (Message("user", "hi"),), n)

    assert estimate_output_tokens(call(10)) == 3
    assert estimate_output_tokens(call(0)) == 1
    assert estimate_output_tokens(call(10), chars_per_token=3.5) == 3
    with pytest.raises(ValueError, match="positive"):
        estimate_output_tokens(call(10), chars_per_token=0)

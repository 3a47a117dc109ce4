"""Tests for incremental detokenization, stop strings and the stop-token check."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from swaserve.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from swaserve.engine.types import SamplingParams

_CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "你好，世界！这是一个测试。我们喜欢中文和英文混合的文本。",
    "emoji 😀🎉👍🏽 mixed with 中文 and ascii text 🦊🐶",
    "naïve café résumé — “quotes” and ‘more’ … ok",
    "The quick brown fox 🦊 jumps over the lazy dog 🐶. 日本語もあります。",
    "def f(x):\n    return x * 2  # code\n",
]
_SPECIALS = ["<|eos|>", "<|im_start|>"]
_ALPHABET = "ab c,.\n你好世界中文😀🎉👍🏽é—“”日本語"


def _byte_to_char() -> dict[int, str]:
    """The byte -> printable-character table used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=_SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|eos|>", clean_up_tokenization_spaces=False
    )


def _byte_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte: splits every multibyte character across tokens."""
    table = _byte_to_char()
    return tokenizer.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])


def _run(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> tuple[list[str], str]:
    pieces, pos, i = [], 0, 0
    while pos < len(ids):
        n = chunks[i % len(chunks)] if chunks else 1
        pieces.append(detok.add(ids[pos : pos + n]))
        pos, i = pos + n, i + 1
    return pieces, detok.flush()


@st.composite
def _token_stream(draw: st.DrawFn, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids mixing random vocabulary ids, byte-split text and normally encoded text."""
    parts: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["random", "bytes", "encoded"]))
        if kind == "random":
            parts += draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=8))
        else:
            text = draw(st.text(alphabet=_ALPHABET, max_size=12))
            parts += _byte_ids(tokenizer, text) if kind == "bytes" else tokenizer.encode(text)
    return parts


def test_byte_split_characters_are_held_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], True, ())
    ids = _byte_ids(tokenizer, "a😀")
    assert len(ids) == 5
    assert [detok.add([i]) for i in ids] == ["a", "", "", "", "😀"]
    assert detok.flush() == ""


def test_incomplete_tail_is_flushed_as_replacement(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], True, ())
    ids = _byte_ids(tokenizer, "x中")[:-1]  # last byte of 中 missing
    assert "".join(detok.add([i]) for i in ids) == "x"
    assert detok.flush() == "\ufffd"
    assert tokenizer.decode(ids) == "x\ufffd"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_concatenation_equals_full_decode(tokenizer: PreTrainedTokenizerFast, data: st.DataObject) -> None:
    ids = data.draw(_token_stream(tokenizer))
    skip = data.draw(st.booleans())
    prompt = data.draw(
        st.sampled_from([[], tokenizer.encode("Hello world, "), [*tokenizer.encode("你好"), 1], [0]])
    )
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=5))
    detok = IncrementalDetokenizer(tokenizer, prompt, skip, ())
    pieces, tail = _run(detok, ids, chunks)
    assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not detok.stopped


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_cut_at_first_completed_match(
    tokenizer: PreTrainedTokenizerFast, data: st.DataObject
) -> None:
    ids = data.draw(_token_stream(tokenizer))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):  # a substring of the output: it will hit
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start : start + data.draw(st.integers(1, 4))])
        else:
            stops.append(data.draw(st.text(alphabet=_ALPHABET, min_size=1, max_size=4)))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=5))
    detok = IncrementalDetokenizer(tokenizer, [], True, stops)
    pieces, tail = _run(detok, ids, chunks)
    # The stop string completed first wins (ties: the one starting first).
    hits = sorted((full.find(s) + len(s), full.find(s), s) for s in stops if s in full)
    assert "".join(pieces) + tail == (full[: hits[0][1]] if hits else full)
    assert detok.stopped == bool(hits)
    if hits:
        assert detok.stop_str is not None
        assert (full.find(detok.stop_str) + len(detok.stop_str), full.find(detok.stop_str)) == hits[0][:2]


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _byte_ids(tokenizer, "Hello world, again")
    detok = IncrementalDetokenizer(tokenizer, [], True, ["o w"])
    out = [detok.add([i]) for i in ids]
    assert "".join(out) == "Hell"
    assert detok.stopped and detok.stop_str == "o w"
    # The stop was seen on the token that completed it; nothing after it is printed.
    assert out.index("") >= 4 and all(o == "" for o in out[7:])
    assert detok.flush() == ""


def test_possible_stop_prefix_is_held_then_released(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], True, ["world peace"])
    outs = [detok.add([i]) for i in _byte_ids(tokenizer, "a world")]
    assert "".join(outs) == "a "  # "world" could still become "world peace"
    assert detok.add(_byte_ids(tokenizer, "!")) == "world!"
    assert not detok.stopped
    assert detok.add(_byte_ids(tokenizer, " world pea")) == " "
    assert detok.flush() == "world pea"  # the request ended before the stop completed
    assert not detok.stopped


def test_stop_string_at_very_start(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), True, ["你好"])
    assert detok.add(tokenizer.encode("你好 there")) == ""
    assert detok.stopped and detok.stop_str == "你好"
    assert detok.add(tokenizer.encode("more")) == ""
    assert detok.flush() == ""


def test_multiple_stop_strings_earliest_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "the quick brown fox jumps"
    # All three occur; "quick b" is first in the text, also when it all arrives in one call.
    detok = IncrementalDetokenizer(tokenizer, [], True, ["fox", "quick b", "jumps", "zzz"])
    assert detok.add(tokenizer.encode(text)) == "the "
    assert detok.stop_str == "quick b"
    # Same result when the tokens arrive one at a time.
    detok = IncrementalDetokenizer(tokenizer, [], True, ["fox", "quick b", "jumps"])
    assert "".join(detok.add([i]) for i in tokenizer.encode(text)) == "the "
    # Overlapping stops: "b" is complete before "abc" is, so it wins even though "abc" starts
    # earlier; with one call the result is the same.
    for chunks in ([["a", "b", "c"]], [["abc"]]):
        detok = IncrementalDetokenizer(tokenizer, [], True, ["abc", "b"])
        out = "".join(detok.add(_byte_ids(tokenizer, c)) for c in chunks[0])
        assert out == "a" and detok.stop_str == "b"


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|eos|>")
    ids = [*tokenizer.encode("hi"), eos, *tokenizer.encode(" there")]
    for skip, expected in ((True, "hi there"), (False, "hi<|eos|> there")):
        detok = IncrementalDetokenizer(tokenizer, [], skip, ())
        assert "".join(detok.add([i]) for i in ids) + detok.flush() == expected


def test_window_stays_bounded_on_long_outputs(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("你好 world 😀 " * 400)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt " * 100), True, ())
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert len(detok._ids) < 300  # consumed tokens are dropped from the buffer


def test_output_continues_the_prompt_for_context_dependent_decoders() -> None:
    # SentencePiece-style "▁" pieces: decoding a piece on its own drops its leading space.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    assert hf.decode([2, 3, 4]) == "world! again"
    detok = IncrementalDetokenizer(hf, [1], True, ())
    assert [detok.add([i]) for i in (2, 3, 4)] == [" world", "!", " again"]
    assert detok.flush() == ""
    assert hf.decode([1, 2, 3, 4]) == "Hello" + " world! again"


def test_check_stop_token() -> None:
    eos = {2, 7}
    assert check_stop_token(2, SamplingParams(), eos)
    assert not check_stop_token(3, SamplingParams(), eos)
    assert not check_stop_token(7, SamplingParams(ignore_eos=True), eos)
    assert check_stop_token(3, SamplingParams(stop_token_ids=(3,)), eos)
    assert check_stop_token(3, SamplingParams(stop_token_ids=(3,), ignore_eos=True), eos)
    assert not check_stop_token(4, SamplingParams(stop_token_ids=(3,)), [])

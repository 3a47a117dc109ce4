"""The front's prompt encoder: its character bound never refuses a prompt that fits, and a text
beyond it is refused before it is tokenized."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from swaserve.api.protocol import ProtocolError
from swaserve.api.tokenize import PromptEncoder, chars_per_token_bound


def _texts(rng: random.Random) -> list[str]:
    alphabet = [
        "a",
        "e",
        " ",
        "\n",
        "hello",
        "é",
        "e\u0301",
        "\u1100\u1161\u11a8",
        "日本",
        "🙂",
        "<|",
        "|>",
        "\t\t",
    ]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(300)]


def test_the_bound_holds_for_every_text(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    bound = chars_per_token_bound(tok)
    assert bound is not None and bound >= 1
    for text in _texts(random.Random(0)):
        n = len(tok.encode(text))
        assert len(text) <= bound * n, (text, n)


def test_encode_refuses_past_the_bound_and_equals_the_tokenizer_below(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    enc = PromptEncoder(tok)
    assert enc.bound is not None
    text = "hello world " * 50
    assert asyncio.run(enc.encode(text, 4096, "prompt")) == tok.encode(text)
    assert asyncio.run(enc.encode(text, 4096, "messages", False)) == tok.encode(
        text, add_special_tokens=False
    )
    with pytest.raises(ProtocolError) as e:
        asyncio.run(enc.encode("x" * (enc.bound * 16 + 1), 16, "prompt"))
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


def test_a_normalizer_that_may_drop_characters_gets_no_bound(tiny_dir: Path) -> None:
    from tokenizers import normalizers

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.backend_tokenizer.normalizer = normalizers.Strip()
    assert chars_per_token_bound(tok) is None

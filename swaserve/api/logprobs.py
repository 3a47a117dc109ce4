"""Logprobs in OpenAI's completion and chat formats (from the engine's ``TokenLogprob`` s), with the
raw text/bytes of single tokens: a token that starts or ends mid-character (byte-level BPE) has no
text of its own and is shown by its bytes (``bytes:...``), as OpenAI does."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from swaserve.api.responses import (
    MIN_LOGPROB,
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from swaserve.engine.types import TokenLogprob


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _byte_level_alphabet() -> dict[str, int]:
    """Char -> byte of byte-level BPE vocabularies (GPT-2 style), which draw each byte as one char.

    Printable Latin-1 bytes stand for themselves; the other 68 byte values are drawn, in increasing
    order, as the code points from 256 upwards.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class TokenTexts:
    """Text and raw bytes of single tokens, for logprobs.

    A token that ends or starts mid-character (byte-level BPE splits multi-byte characters) has no
    text of its own; like OpenAI, its text is then shown as ``bytes:\\xe2\\x80``, which keeps
    different partial tokens apart in ``top_logprobs`` maps.

    Args:
        tokenizer: A transformers tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
        self._added = set(added.values()) | set(getattr(tokenizer, "all_special_ids", ()))
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def raw(self, token_id: int) -> bytes:
        """The bytes the token stands for."""
        if token_id not in self._bytes:
            piece = None
            if self._alphabet is not None and token_id not in self._added:
                token = self._tok.convert_ids_to_tokens(token_id)
                if isinstance(token, str) and all(c in self._alphabet for c in token):
                    piece = bytes(self._alphabet[c] for c in token)
            self._bytes[token_id] = piece if piece is not None else self._tok.decode([token_id]).encode()
        return self._bytes[token_id]

    def text(self, token_id: int) -> str:
        """The token's text, or ``bytes:\\x..`` when its bytes are not valid UTF-8 on their own."""
        if token_id not in self._text:
            text = self._tok.decode([token_id])
            if "\ufffd" in text:
                raw = self.raw(token_id)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._text[token_id] = text
        return self._text[token_id]


def completion_logprobs(
    items: Sequence[TokenLogprob], text: Callable[[int], str], text_offsets: Sequence[int]
) -> CompletionLogprobs:
    """Legacy-completions logprobs for some output tokens.

    Args:
        items: One entry per output token, in order.
        text: Token id -> its text (``TokenTexts.text``).
        text_offsets: Per token, the character offset in the completion text where the text it
            produced starts (text held back for an incomplete UTF-8 character counts for the
            token that completes it).

    Returns:
        The logprobs object; ``top_logprobs`` maps token text to logprob and includes the sampled
        token.
    """
    if len(text_offsets) != len(items):
        raise ValueError(f"{len(items)} logprob items but {len(text_offsets)} offsets")
    lp = CompletionLogprobs()
    for item, offset in zip(items, text_offsets, strict=True):
        tok = text(item.token_id)
        lp.tokens.append(tok)
        lp.token_logprobs.append(_finite(item.logprob))
        top = {text(tid): _finite(v) for tid, v in item.top}
        top.setdefault(tok, _finite(item.logprob))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
    return lp


def chat_logprobs(
    items: Sequence[TokenLogprob], text: Callable[[int], str], raw: Callable[[int], bytes], num_top: int
) -> ChatLogprobs:
    """Chat logprobs (``content`` list) for some output tokens, ``num_top`` alternatives each.

    Args:
        items: One entry per output token, in order.
        text: Token id -> its text (``TokenTexts.text``).
        raw: Token id -> its bytes (``TokenTexts.raw``).
        num_top: Alternatives to list per token (0..20).
    """
    content = []
    for item in items:
        tops = [
            TopLogprob(token=text(tid), logprob=_finite(v), bytes=list(raw(tid)))
            for tid, v in item.top[:num_top]
        ]
        content.append(
            ChatLogprobToken(
                token=text(item.token_id),
                logprob=_finite(item.logprob),
                bytes=list(raw(item.token_id)),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


def echo_logprobs(
    prompt_ids: Sequence[int], items: Sequence[TokenLogprob], text: Callable[[int], str]
) -> CompletionLogprobs:
    """Legacy logprobs of an echoed prompt: its first token has null logprob and top_logprobs,
    the others ``items`` (prompt tokens 1..); text offsets are cumulative token-text lengths
    (as vLLM computes them).

    Raises:
        ValueError: ``items`` does not cover prompt tokens 1.. of ``prompt_ids``.
    """
    if [i.token_id for i in items] != list(prompt_ids[1:]):
        raise ValueError(f"{len(items)} prompt logprobs do not match a prompt of {len(prompt_ids)} tokens")
    lp = CompletionLogprobs()
    offset = 0
    for k, tid in enumerate(prompt_ids):
        tok = text(tid)
        lp.tokens.append(tok)
        lp.text_offset.append(offset)
        offset += len(tok)
        if k == 0:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        item = items[k - 1]
        lp.token_logprobs.append(_finite(item.logprob))
        top = {text(t): _finite(v) for t, v in item.top}
        top.setdefault(tok, _finite(item.logprob))
        lp.top_logprobs.append(top)
    return lp


def prompt_logprobs(items: Sequence[TokenLogprob], text: Callable[[int], str]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a map from
    token id (a string, JSON keys) to logprob, rank (1: the most likely token) and text; the
    prompt token itself is always in the map, with its rank over the whole vocabulary."""
    out: PromptLogprobs = [None]
    for item in items:
        entry = {
            str(t): PromptLogprob(logprob=_finite(v), rank=r, decoded_token=text(t))
            for r, (t, v) in enumerate(item.top, start=1)
        }
        entry.setdefault(
            str(item.token_id),
            PromptLogprob(
                logprob=_finite(item.logprob), rank=item.rank or None, decoded_token=text(item.token_id)
            ),
        )
        out.append(entry)
    return out

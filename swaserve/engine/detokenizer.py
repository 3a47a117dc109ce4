"""Incremental detokenization with stop strings, and the stop-token check.

``IncrementalDetokenizer`` decodes a short window of recent tokens twice (printed prefix, prefix +
new tokens) and prints the difference once it no longer ends in an incomplete UTF-8 character:
O(new tokens) per call. Text that could start a stop string is held back; output is cut before one.

Design notes: docs/DESIGN.md#enginedetokenizerpy"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from swaserve.engine.types import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the first output token, so that context-dependent renderings
# (e.g. a leading space) come out as in a full decode.
_PROMPT_CONTEXT = 6
# Drop consumed tokens from the window buffer once this many have piled up.
_TRIM_AT = 256
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, applying its stop strings.

    Without a stop-string hit, the concatenation of everything :meth:`add` and :meth:`flush`
    return equals ``tokenizer.decode(output_ids, skip_special_tokens=...)`` for byte-level BPE
    tokenizers (given a prompt that ends on a character boundary). For decoders whose rendering
    depends on the preceding token (SentencePiece "▁" pieces), the text continues the prompt:
    it is ``decode(prompt + output)`` minus ``decode(prompt)``, keeping e.g. the leading space
    that decoding the output alone would drop. Stop *tokens* (EOS, ``stop_token_ids``) are the engine's job:
    see :func:`check_stop_token`; the engine should not pass such a token to :meth:`add`.

    Attributes:
        stopped: True once a stop string appeared; later calls return "".
        stop_str: The stop string that matched, or None. When several occur, the one completed
            first in the text wins.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        """Args:
        tokenizer: The model's transformers tokenizer.
        prompt_token_ids: The request's prompt; only its last few tokens are kept, as
            decoding context.
        skip_special_tokens: Leave special tokens out of the text.
        stop: Stop strings (empty strings are ignored).
        """
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # window start: ids[prefix:read] are already printed
        self._read_offset = len(self._ids)  # first id whose text is not printed yet
        self._prefix_len: int | None = None  # len(decode(ids[prefix:read])), computed lazily
        self._pending = ""  # final text held back because it may start a stop string
        self.stopped = False
        self.stop_str: str | None = None

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens and return the text that became printable.

        Args:
            token_ids: New output token ids (usually one).

        Returns:
            The new text: possibly empty (an incomplete UTF-8 character or a possible
            stop-string start is held back), cut just before a stop string when one appears
            (then ``stopped`` is set).
        """
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._pending += self._advance(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Return all held-back text at the end of the request ("" after a stop-string hit).

        An incomplete trailing character comes out as U+FFFD, as in a full decode. The text is
        still checked for stop strings (and ``stopped`` set on a hit). Call once, at the end.
        """
        if self.stopped:
            return ""
        self._pending += self._advance(final=True)
        return self._release(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special)
        assert isinstance(text, str)
        return text

    def _advance(self, final: bool) -> str:
        """Decode the window; return the newly final text and move the window past it."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_len is None:
            self._prefix_len = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= self._prefix_len or (text.endswith(_REPLACEMENT) and not final):
            # Nothing visible yet (e.g. skipped special tokens), or the last character is still
            # incomplete: wait for more tokens, keeping the window where it is.
            return ""
        new_text = text[self._prefix_len :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_len = None
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _release(self, final: bool) -> str:
        """Return the pending text that cannot be part of a stop string; handle stop hits."""
        text = self._pending
        if not self._stops:
            self._pending = ""
            return text
        # The stop string that is complete first in the text wins (as if the text arrived one
        # character at a time), which keeps the result independent of how tokens are grouped;
        # of two ending at the same place, the longer (earlier-starting) one.
        hit_at, hit_end, hit = -1, -1, None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (hit is None or (at + len(stop), at) < (hit_end, hit_at)):
                hit_at, hit_end, hit = at, at + len(stop), stop
        if hit is not None:
            self.stopped, self.stop_str, self._pending = True, hit, ""
            return text[:hit_at]
        hold = 0 if final else _longest_stop_prefix_suffix(text, self._stops)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold]


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def check_stop_token(token_id: int, params: SamplingParams, eos_token_ids: Collection[int]) -> bool:
    """Whether a sampled token ends its request.

    Args:
        token_id: The token just sampled.
        params: The request's sampling settings.
        eos_token_ids: The model's end-of-sequence ids.

    Returns:
        True for an EOS token (unless ``params.ignore_eos``) or one of ``params.stop_token_ids``.
    """
    if token_id in params.stop_token_ids:
        return True
    return not params.ignore_eos and token_id in eos_token_ids

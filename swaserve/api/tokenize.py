"""Prompt tokenization for the HTTP front: off the event loop, and a text that cannot fit the
context refused before it is tokenized (a multi-MB prompt would otherwise hold every stream and
probe of the process for seconds).

The bound: a token decodes to at most ``L`` characters (the longest vocab string; byte-level
strings count bytes, no fewer than the characters they decode to), and a normalizer of the NFC/NFKC
family composes at most 3 characters into 1 (Hangul L+V+T), so ``n`` tokens come from at most
``3 * L * n`` characters. A tokenizer with another normalizer (one that may drop characters) gets
no bound, only the thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field, model_validator

from swaserve.api.messages import ChatMessage, StrictModel
from swaserve.api.protocol import ProtocolError, check_body

_BOUNDED_NORMALIZERS = {"NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 1}


def chars_per_token_bound(tokenizer: Any) -> int | None:
    """Most characters of input text one token can stand for; None when no bound is known."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    normalizer = backend.normalizer
    factor = 1 if normalizer is None else _BOUNDED_NORMALIZERS.get(type(normalizer).__name__)
    if factor is None:
        return None
    return factor * max(map(len, tokenizer.get_vocab()), default=1)


class PromptEncoder:
    """Args: tokenizer (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bound = chars_per_token_bound(tokenizer)

    async def encode(
        self, text: str, max_model_len: int, param: str, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of ``text``, tokenized in a worker thread.

        Raises:
            ProtocolError: 400 ``context_length_exceeded`` when ``text`` has more characters than
                ``max_model_len`` tokens can stand for (the module docstring's bound).
        """
        if self.bound is not None and len(text) > self.bound * max_model_len:
            raise ProtocolError(
                f"This model's maximum context length is {max_model_len} tokens, and the prompt "
                f"has {len(text)} characters: more than {max_model_len} tokens.",
                param=param,
                code="context_length_exceeded",
            )
        ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)


# -- /tokenize, /detokenize (vLLM's shapes); unknown fields are a 400 --------------------------------
class _Exact(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return check_body(data)


class TokenizeCompletionRequest(_Exact):
    """POST /tokenize with a ``prompt``: its ids as ``/v1/completions`` would see them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Exact):
    """POST /tokenize with ``messages``: the rendered chat prompt's ids, as ``/v1/chat/completions``."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Exact):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info (vLLM's endpoint; lm-eval's ``tokenizer_backend=remote`` reads it):
    what a client needs to tokenize and render chats as the server does. ``chat_template``: the
    one the server renders with (``--chat-template`` or the tokenizer's); ``model_max_length``:
    the server's context length (tokens)."""

    tokenizer_class: str
    model_max_length: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None


def tokenizer_info(tokenizer: Any, max_model_len: int, chat_template: str | None) -> TokenizerInfoResponse:
    def token(name: str) -> str | None:
        value = getattr(tokenizer, name, None)
        return value if isinstance(value, str) else None

    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return TokenizerInfoResponse(
        tokenizer_class=type(tokenizer).__name__,
        model_max_length=max_model_len,
        bos_token=token("bos_token"),
        eos_token=token("eos_token"),
        pad_token=token("pad_token"),
        unk_token=token("unk_token"),
        chat_template=template if isinstance(template, str) else None,
    )

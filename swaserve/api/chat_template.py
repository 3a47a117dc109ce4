"""``--chat-template PATH_OR_STRING`` (``serve``, the router, ``up``): a Jinja chat template used
instead of the tokenizer's, for ``/v1/chat/completions`` and ``/tokenize`` with ``messages``.

Read as vLLM reads it: a file that opens is a file; a value that does not open and has none of
``{``, ``}`` or a newline looks like a path, so it is an error (a typo in a path never serves as a
one-line template); anything else is the template itself. ``resolve_chat_template`` also renders a
one-message conversation with the model's tokenizer, so a template that does not compile is a
startup error, not a 400 on every chat request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_JINJA_CHARS = "{}\n"
_TRIAL = [{"role": "user", "content": "hello"}]


def load_chat_template(value: str) -> str:
    """The template text of ``--chat-template``'s value (a file path or the template).

    Raises:
        ValueError: it looks like a path and cannot be read, or the file is empty.
    """
    try:
        text = Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{value}: not UTF-8 text ({e})") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the "path"
        if not any(c in value for c in _JINJA_CHARS):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(
                f"{value!r} looks like a file path, but it cannot be read: {reason} "
                "(an inline template has '{' or '}' in it)"
            ) from None
        text = value
    if not text.strip():
        raise ValueError(f"the chat template {value!r} is empty")
    return text


def check_chat_template(tokenizer: Any, template: str) -> None:
    """Render a one-message conversation through ``template`` with ``tokenizer``.

    Raises:
        ValueError: the template does not compile or fails on that conversation.
    """
    try:
        tokenizer.apply_chat_template(
            _TRIAL, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # jinja2's TemplateSyntaxError, TemplateError, its raise_exception()
        raise ValueError(f"the chat template does not render: {type(e).__name__}: {e}") from None


def resolve_chat_template(value: str | None, model_dir: str | Path) -> str | None:
    """``--chat-template``'s template, read and checked against ``model_dir``'s tokenizer (None
    when not given: the tokenizer's own template is used).

    Raises:
        ValueError: it cannot be read or does not render (``load_chat_template``,
            ``check_chat_template``).
    """
    if value is None:
        return None
    template = load_chat_template(value)
    from swaserve.hf_tokenizer import load_tokenizer

    check_chat_template(load_tokenizer(model_dir), template)
    return template

"""Media inputs of multimodal requests, sans model: decoding and cheap metadata of images, video and
audio, preprocessing into the encoders' inputs, and the token counts the router computes before
any encoding. Errors are ``MediaError`` (the API answers them with a 400)."""

from __future__ import annotations

import json

MODALITIES = ("image", "video", "audio")


class MediaError(ValueError):
    """Media that cannot be used: corrupt or truncated bytes, an unsupported format or codec, or a
    size, length or count over a limit. The message says which, for the client."""


def parse_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: a JSON object of modality -> items per request (vLLM's form).

    Raises:
        ValueError: not such an object, an unknown modality or a negative count."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(d, dict) or any(
        k not in MODALITIES or not isinstance(v, int) or isinstance(v, bool) or v < 0 for k, v in d.items()
    ):
        raise ValueError(f"an object of {'/'.join(MODALITIES)} -> count >= 0, got {text!r}")
    return d

"""Media inputs of multimodal requests, sans model: decoding and cheap metadata of images, video and
audio, preprocessing into the encoders' inputs, and the token counts the router computes before
any encoding. Errors are ``MediaError`` (the API answers them with a 400)."""

from __future__ import annotations


class MediaError(ValueError):
    """Media that cannot be used: corrupt or truncated bytes, an unsupported format or codec, or a
    size, length or count over a limit. The message says which, for the client."""

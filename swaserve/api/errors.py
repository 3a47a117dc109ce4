"""The error a request handler raises to refuse a request with an OpenAI error body."""

from __future__ import annotations


class ProtocolError(Exception):
    """A request the server must refuse, with the fields of an OpenAI error body.

    Args:
        message: Human-readable reason, shown to the client.
        param: The request field at fault, if one is.
        code: Machine-readable code (e.g. ``context_length_exceeded``, ``model_not_found``).
        status: HTTP status to answer with.
        type: OpenAI error type.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type

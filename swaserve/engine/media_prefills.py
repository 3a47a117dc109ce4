"""``MediaPrefills``: the core's bookkeeping of requests whose prompt has media and is not computed
yet — the only ones a step's media checks look at. It asks once, at admission, for the spans past
the prefix hit whose embeddings are missing (``media_wanted``), takes them (``supply``), tells the
core when nothing can run until they come, and drops a prompt's embeddings once its KV holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from swaserve.engine.core_output import CoreOutput
from swaserve.engine.request import Request, RequestStatus


class MediaPrefills:
    """Args: hidden: the model's hidden size (embeddings are [span.length, hidden])."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self.open: dict[str, Request] = {}

    def __bool__(self) -> bool:
        return bool(self.open)

    def add(self, req: Request) -> None:
        """Track ``req`` (a prompt with media spans) until its prompt is computed."""
        self.open[req.request_id] = req

    def supply(self, req: Request, index: int, embeds: torch.Tensor) -> None:
        """Give ``req`` the embeddings of its span ``index``.

        Raises:
            ValueError: no such span, or a shape that does not fit it (nothing is kept).
        """
        if req.media is None or not 0 <= index < len(req.media.spans):
            raise ValueError(f"{req.request_id}: no media item {index}")
        req.media.embeds[index] = embeds
        try:
            req.media.check_embeds(self.hidden)
        except ValueError:
            del req.media.embeds[index]
            raise

    def asks(self, output: Callable[[Request], CoreOutput]) -> list[CoreOutput]:
        """One output (``media_wanted`` set) per request admitted since the last call that misses
        embeddings past its prefix hit; ``output`` makes a request's empty output."""
        out = []
        for req in self.open.values():
            if req.status == RequestStatus.RUNNING and not req.media_asked:
                req.media_asked = True
                missing = req.media_missing()
                if missing:
                    o = output(req)
                    o.media_wanted = missing
                    out.append(o)
        return out

    def waiting(self) -> bool:
        """Whether an admitted prefill stands at a span whose embeddings have not come."""
        return any(
            r.status == RequestStatus.RUNNING and r.media_ready_end() < r.num_tokens
            for r in self.open.values()
        )

    def missing(self) -> dict[str, list[int]]:
        """Admitted requests' spans past their prefix hit still without embeddings, by request id."""
        out: dict[str, list[int]] = {}
        for req in self.open.values():
            if req.status == RequestStatus.RUNNING:
                m = req.media_missing()
                if m:
                    out[req.request_id] = m
        return out

    def done(self, requests: Mapping[str, Request]) -> None:
        """Drop prompts now in the KV (their embeddings with them) and requests that left."""
        for rid, req in list(self.open.items()):
            if req.num_computed >= req.num_prompt or requests.get(rid) is not req:
                if req.media is not None:
                    req.media.embeds.clear()
                del self.open[rid]

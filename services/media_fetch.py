"""A prefill worker's media fetching: the embeddings of the spans its prefix hit does not cover,
from the encoders the router named, into the engine (``supply_media``).

One fetch per item (a video's frame-pair spans share it), items in parallel; each fetch reserves
its bytes in a byte-bounded staging budget until the request's prefill is done (its first token)
or it ends. A full budget, an encoder that is down or does not have the item, a timeout, a CRC
error: ``MediaFetchError`` — the worker fails the request as retryable, and the router sends it
elsewhere (with the items resubmitted). An item the encoder refused (INVALID_ARGUMENT: data whose
header passed the router's checks but does not decode): ``MediaRejected``, a 400, no retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from services.encoder.client import EncoderClients
from services.tls import Dialer
from swaserve.engine.client import LocalEngineClient
from swaserve.media.placeholders import MediaInputs

log = logging.getLogger(__name__)


class MediaFetchError(RuntimeError):
    """The media of a request could not be fetched (retryable elsewhere)."""


class MediaRejected(MediaFetchError):
    """The encoder refused an item as invalid (corrupt or truncated data its header hid): the
    request is a client error, not retried."""


class MediaFetcher:
    """Args: dialer: plaintext or TLS to the encoders. staging_bytes: embeddings held at once
    (bytes). timeout_s: one item's fetch, waiting for its encoding included."""

    def __init__(
        self, dialer: Dialer | None = None, staging_bytes: int = 1 << 30, timeout_s: float = 60.0
    ) -> None:
        self.dialer = dialer or Dialer()
        self.staging_bytes, self.timeout_s = staging_bytes, timeout_s
        self.used = 0
        self._held: dict[str, int] = {}
        self.clients = EncoderClients(self.dialer)
        self.fetched_bytes = 0

    async def supply(
        self,
        engine: LocalEngineClient,
        request_id: str,
        media: MediaInputs,
        wanted: Sequence[int],
        hidden: int,
    ) -> None:
        """Fetch the items of spans ``wanted`` and hand their rows to ``engine``.

        Raises:
            MediaFetchError: no room, or a fetch failed (the message says which and why).
        """
        items: dict[tuple[bytes, str], list[int]] = {}
        for i in wanted:
            src = media.sources.get(i)
            if not src:
                raise MediaFetchError(f"media span {i} has no encoder to fetch from")
            items.setdefault((media.spans[i].key, src), []).append(i)
        need = 0
        for (_, _), idx in items.items():
            need += max(media.spans[j].offset + media.spans[j].length for j in idx) * hidden * 4
        if self.used + need > self.staging_bytes:
            raise MediaFetchError(
                f"media staging full ({self.used} + {need} > {self.staging_bytes} bytes): try another worker"
            )
        self.used += need
        self._held[request_id] = self._held.get(request_id, 0) + need

        async def one(key: bytes, src: str, idx: list[int]) -> None:
            rows = max(media.spans[j].offset + media.spans[j].length for j in idx)
            try:
                emb = await self.clients.get(src).fetch(key, self.timeout_s, rows * hidden * 4 + (1 << 20))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise MediaRejected(f"media item {idx[0]}: {e.details()}") from e
                raise MediaFetchError(
                    f"media fetch from encoder {src} failed: {e.code().name}: {e.details()}"
                ) from e
            except ValueError as e:  # CRC, shape
                raise MediaFetchError(f"media fetch from encoder {src} failed: {e}") from e
            if emb.dim() != 2 or emb.shape[0] < rows or emb.shape[1] != hidden:
                raise MediaFetchError(
                    f"encoder {src} sent embeddings of shape {tuple(emb.shape)} for {rows} rows"
                )
            self.fetched_bytes += emb.numel() * emb.element_size()
            for j in idx:
                s = media.spans[j]
                await engine.supply_media(request_id, j, emb[s.offset : s.offset + s.length])

        await asyncio.gather(*(one(k, src, idx) for (k, src), idx in items.items()))

    def release(self, request_id: str) -> None:
        """The request's prefill is done (or it ended): its staged bytes are free."""
        self.used -= self._held.pop(request_id, 0)

    async def close(self) -> None:
        await self.clients.close()

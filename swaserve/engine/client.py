"""``EngineClient``: what the HTTP server, the worker shell and the router need of an engine.

Implementations: the inline engine (``engine.async_engine.AsyncLLMEngine``: the core steps on the
event loop), the engine core in its own process (``engine.mp_client.MPEngineClient``) and the
router's ``services.router.cluster.ClusterEngine`` (workers instead of a core). Text, stop
strings and streaming always happen in the caller's process.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swaserve.config import EngineConfig, ModelConfig
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import RequestOutput, SamplingParams
from swaserve.media.placeholders import MediaInputs, MediaSpan, split_embeds
from swaserve.model.multimodal import MultimodalConfig

if TYPE_CHECKING:
    import torch

    from swaserve.encoder.items import EncodeItem
    from swaserve.encoder.runner import MediaEncoder
    from swaserve.kvcache.block_events import BlockEvent
    from swaserve.transfer.kv_transfer import KVPayload


class Unavailable(RuntimeError):
    """The engine cannot serve a request now (no capacity, no worker, no engine core); retrying
    later (or elsewhere) may work. Raised from ``generate``: the HTTP client gets a 503 with
    ``code``, or an error event with ``code`` in a stream that had started."""

    code = "service_unavailable"


class EngineDead(Unavailable):
    """The engine core process died (crash, OOM, kill): every open request ends with this."""

    code = "engine_dead"


class EngineClient(ABC):
    """An engine as its callers see it: streams of ``RequestOutput`` deltas per request.

    Attributes:
        model_name: the served model name. tokenizer: the model's (a transformers tokenizer).
        model_config: the model's shape. max_model_len: longest prompt + output (tokens).
        media_config: the checkpoint's towers and media parameters (None: text only).
    """

    model_name: str
    tokenizer: Any
    model_config: ModelConfig
    max_model_len: int
    media_config: MultimodalConfig | None = None

    @property
    @abstractmethod
    def running(self) -> bool:
        """Whether requests are accepted (started, and its core or workers are there)."""

    @abstractmethod
    async def start(self) -> None:
        """Start serving (load or connect); returns once requests are accepted."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop serving; open streams end with an error."""

    @abstractmethod
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        export_kv: bool = False,
        prefilled: tuple[int, KVPayload] | None = None,
        media: MediaInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request; closing the iterator aborts the request.

        Args:
            prompt_token_ids: the prompt [n] (token ids).
            params: sampling settings.
            request_id: unique among open requests.
            export_kv: prefill role: stop after the first token; the last delta carries the
                prompt's KV (``kv_payload``).
            prefilled: decode role: ``(first_token, KVPayload)`` of a prompt prefilled elsewhere.
            media: the prompt's media spans and embeddings (``media_inputs``).

        Raises:
            ValueError: the request is refused (before any output), or failed alone (its
                structured-output grammar broke): a user-facing message.
            Unavailable: no capacity or no engine now (503).
            RuntimeError: the engine failed while the request ran.
        """

    async def media_inputs(
        self, spans: Sequence[MediaSpan], items: Sequence[EncodeItem], item_spans: Sequence[Sequence[int]]
    ) -> MediaInputs:
        """The ``media`` argument of ``generate`` for a prompt's media: ``items`` (in order; item i
        covers ``spans[j]`` for j in ``item_spans[i]``) encoded here, or (a router) sent to
        encoders that the prefill worker fetches from.

        Raises:
            MediaError: an item that does not decode. Unavailable: no encoder now.
            ValueError: this model takes no media.
        """
        raise ValueError("this model takes no images, audio or video")

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a request (no-op if unknown); its stream ends with finish reason ``abort``."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """The latest snapshot (never waits for a step)."""

    def unavailable(self) -> Unavailable | None:
        """Why requests are refused while ``running`` is False (None: not started)."""
        return None


class LocalEngineClient(EngineClient):
    """An engine with its own core (inline or in a child process): what a worker shell needs.

    Attributes:
        engine_config: the core's knobs. kv_dtype: dtype of its KV pages.
    """

    engine_config: EngineConfig
    kv_dtype: torch.dtype
    model_dir: Path

    @abstractmethod
    async def supply_media(self, request_id: str, index: int, embeds: torch.Tensor) -> None:
        """Hand an open request the embeddings [span.length, hidden] of its media span ``index``
        (after a ``RequestOutput.media_wanted``); a bad shape fails the request with its message."""

    _media_encoder: MediaEncoder | None = None
    _media_lock: asyncio.Lock | None = None

    async def media_inputs(
        self, spans: Sequence[MediaSpan], items: Sequence[EncodeItem], item_spans: Sequence[Sequence[int]]
    ) -> MediaInputs:
        """``EngineClient.media_inputs``: the items encoded by this process's ``MediaEncoder`` (built
        on first use, on the engine's device and dtype), off the event loop."""
        if self.media_config is None:
            raise ValueError("this model takes no images, audio or video")
        if self._media_lock is None:
            self._media_lock = asyncio.Lock()
        async with self._media_lock:
            if self._media_encoder is None:
                from swaserve.encoder.runner import MediaEncoder
                from swaserve.engine.core import default_device

                device = self.engine_config.device or default_device()
                self._media_encoder = await asyncio.to_thread(
                    MediaEncoder, self.model_dir, device, self.kv_dtype
                )
        embeds = await asyncio.to_thread(self._media_encoder.encode, list(items))
        return MediaInputs(tuple(spans), split_embeds(spans, item_spans, embeds))

    @abstractmethod
    def has_request(self, request_id: str) -> bool:
        """Whether a request is open (added, not finished)."""

    @abstractmethod
    async def flush_cache(self) -> None:
        """Drop every unlocked page of the prefix cache."""

    @abstractmethod
    async def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        """Prefix-cache block events since the last call (``EngineCore.drain_cache_events``)."""


async def queue_stream(
    queue: asyncio.Queue[RequestOutput | BaseException], on_close: Callable[[bool], None]
) -> AsyncGenerator[RequestOutput, None]:
    """Yield the deltas put on ``queue`` up to the last one; an exception put on it is raised, and
    so is a ValueError for a delta with ``error`` (the engine failed the request alone: its
    structured-output grammar broke). ``on_close(ended)`` runs when the stream closes (``ended`` False: its consumer left early,
    so the request must be aborted). Close it with ``contextlib.aclosing``."""
    ended = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                ended = True
                raise item
            if item.error:
                ended = True
                raise ValueError(item.error)
            ended = item.finished
            yield item
            if ended:
                return
    finally:
        on_close(ended)

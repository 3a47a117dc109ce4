"""Media items and an encoder in this process, for the encoder service tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import torch

from services.encoder.cli import EncoderOptions, EncoderServer
from services.encoder.client import EncoderClient
from services.encoder.servicer import Limits
from services.tls import Dialer
from swaserve.encoder.items import EncodeItem
from swaserve.encoder.runner import MediaEncoder
from swaserve.media.audio import AudioParams, audio_num_tokens, decoded_samples
from swaserve.media.image import image_num_tokens
from swaserve.media.placeholders import item_key
from swaserve.media.video import frame_size, grid_timestamps, probe_video, sample_times
from tests.helpers.media import png, wav
from tests.media.media_samples import make_video

ALL = frozenset({"image", "video", "audio"})


def image(enc: MediaEncoder, seed: int, width: int = 64, height: int = 48) -> EncodeItem:
    """A random PNG as the router lays it out (rows from its header size)."""
    assert enc.config.image is not None
    data = png(width, height, seed)
    return EncodeItem(
        item_key("t", "image", {}, data), "image", data, image_num_tokens(height, width, enc.config.image)
    )


def audio(enc: MediaEncoder, seconds: float = 0.5) -> EncodeItem:
    data = wav(seconds)
    frames = AudioParams.from_hf(enc.config.processor).num_frames(decoded_samples(data, 60))
    return EncodeItem(item_key("t", "audio", {}, data), "audio", data, audio_num_tokens(frames))


def video(enc: MediaEncoder) -> EncodeItem:
    """A 2 s H.264 clip with its sampling plan (times, frame size), as ``api.media`` makes it."""
    p = enc.config.video
    assert p is not None
    data = make_video(frames=16, fps=8)
    meta = probe_video(data)
    times = sample_times(meta, p)
    h, w = frame_size(meta, p, len(times))
    n = (h // p.factor) * (w // p.factor) * len(grid_timestamps(times, p))
    return EncodeItem(item_key("t", "video", {}, data), "video", data, n, tuple(times), (h, w))


class Counting:
    """A ``MediaEncoder`` that records the keys of every forward; ``gate`` (when given) holds
    each forward until it is set."""

    def __init__(self, inner: MediaEncoder, gate: threading.Event | None = None) -> None:
        self.inner, self.gate = inner, gate
        self.calls: list[list[bytes]] = []

    def encode(self, items: Sequence[EncodeItem]) -> list[torch.Tensor]:
        self.calls.append([it.key for it in items])
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.encode(items)


@contextlib.asynccontextmanager
async def serving(
    encoder: Any,
    fingerprint: str,
    modalities: frozenset[str] = ALL,
    shm_cache: str | None = None,
    credentials: grpc.ServerCredentials | None = None,
    dialer: Dialer | None = None,
    **limits: Any,
) -> AsyncIterator[tuple[EncoderServer, EncoderClient]]:
    """An encoder service on a free local port over ``encoder`` (``limits``: ``Limits`` fields;
    ``shm_cache``: a shared tier's name, 16 MiB; ``credentials``: TLS), and a client of it."""
    opts = EncoderOptions(port=0, limits=Limits(**limits), grace_s=5.0, shm_cache=shm_cache)
    opts.shm_cache_bytes, opts.credentials = 16 << 20, credentials
    server = EncoderServer(opts, encoder=encoder, fingerprint=fingerprint, modalities=modalities)
    await server.start()
    client = EncoderClient(f"127.0.0.1:{server.port}", dialer, timeout_s=10.0)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()


def sample(server: EncoderServer, name: str, **labels: str) -> float:
    """A metric sample's value (0 when absent)."""
    return server.metrics.registry.get_sample_value(name, labels) or 0.0

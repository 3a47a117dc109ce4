"""The HTTP front's media handling: content-part URLs to bytes, per-request limits, and the prompt's
placeholder runs computed from cheap metadata before any encoding.

URLs (vLLM's rules, vllm/multimodal/utils.py ``MediaConnector``): ``data:`` URLs with base64 only,
their MIME type of the part's modality; ``http(s)`` only to hosts on ``--allowed-media-domains``
(off by default); ``file://`` only under ``--allowed-local-media-path``. Every failure is a
``ProtocolError`` (400) naming the part.

Expansion: the chat template renders each part as its marker text (``markers``); after
tokenization each marker pad token becomes the item's placeholder run (``media.placeholders``):
- image: ``<|vision_start|>`` + pads (grid from the header size: ``media.image``) + ``<|vision_end|>``;
- video: ``<|video_start|>``, then per frame pair its "MM:SS" text, ``<|vision_start|>``, pads,
  ``<|vision_end|>``, then ``<|video_end|>`` (frame times and sizes from the container headers:
  ``media.video``), as the MiMo processor lays it out (SGLang fork mimo_vl_processor.py);
- audio: ``<|mimo_audio_start|>`` + pads + ``<|mimo_audio_end|>``; the count needs the sample
  count, so the clip is decoded here (compressed formats' headers are not exact enough).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

import httpx

from swaserve.api.errors import ProtocolError
from swaserve.encoder.items import EncodeItem
from swaserve.media import MediaError, parse_limits
from swaserve.media.audio import AudioParams, audio_num_tokens, decoded_samples
from swaserve.media.image import image_num_tokens, image_size, smart_resize
from swaserve.media.placeholders import MediaSpan, item_key, pad_ids
from swaserve.media.video import frame_size, grid_timestamps, probe_video, sample_times
from swaserve.model.multimodal import TOKEN_TEXT, MultimodalConfig

MODALITY_MIME = {"image": "image/", "video": "video/", "audio": "audio/"}
# container formats (probed: the label is not trusted); raw PCM has no header to probe
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm", "mp4")


def _an(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


DEFAULT_LIMITS = {"image": 8, "video": 1, "audio": 4}
LOW_DETAIL_PIXELS = 512 * 512  # image_url.detail "low": the resized image's area at most
OFF_LOOP_BYTES = 256 << 10  # data URLs this long are base64-decoded in a worker thread


@dataclass(frozen=True)
class MediaOptions:
    """Per-request media limits and where media may come from.

    Attributes:
        limit_per_prompt: items per modality in one request (vLLM ``--limit-mm-per-prompt``).
        allowed_domains: hosts http(s) URLs may name (empty: no fetching).
        allowed_local_path: a directory ``file://`` URLs may read under (None: none).
        max_item_bytes: bytes of one item (encoded). max_image_pixels: an image's source area.
        max_video_seconds, max_audio_seconds: longest clip. fetch_timeout_s: per http fetch.
    """

    limit_per_prompt: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_item_bytes: int = 32 << 20
    max_image_pixels: int = 64 << 20
    max_video_seconds: float = 3600.0
    max_audio_seconds: float = 600.0
    fetch_timeout_s: float = 10.0


@dataclass
class MediaPrompt:
    """A prompt with its media expanded: ids (placeholder runs in), spans, and the items to encode
    (``item_spans[i]``: the span indices of item i; a video has one per frame pair)."""

    ids: list[int]
    spans: list[MediaSpan]
    items: list[EncodeItem]
    item_spans: list[list[int]]


class MediaFront:
    """Loads and lays out the media of chat requests for one multimodal checkpoint."""

    def __init__(self, config: MultimodalConfig, tokenizer: Any, options: MediaOptions | None = None) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.options = options or MediaOptions()
        self.digest = config.digest()
        self.audio_params = AudioParams.from_hf(config.processor)
        t = config.tokens
        self.markers = {}
        if config.vision is not None:
            self.markers["image"] = (
                TOKEN_TEXT["vision_start"] + TOKEN_TEXT["image_pad"] + TOKEN_TEXT["vision_end"]
            )
            self.markers["video"] = TOKEN_TEXT["video_pad"]  # start/end and per-pair markers: ``expand``
        if config.audio_config is not None:
            self.markers["audio"] = (
                TOKEN_TEXT["audio_start"] + TOKEN_TEXT["audio_pad"] + TOKEN_TEXT["audio_end"]
            )
        self._pad_modality = {t.image_pad: "image", t.video_pad: "video", t.audio_pad: "audio"}

    # -- loading ---------------------------------------------------------------------------------
    @staticmethod
    def check_part(part: Any) -> None:
        """Refuse what a part asks that is not honored (ProtocolError): an image ``detail`` other
        than auto/low/high, an ``input_audio`` format outside ``AUDIO_FORMATS``."""
        value = getattr(part, "image_url", None)
        detail = getattr(value, "detail", None)
        if detail not in (None, "auto", "low", "high"):
            raise ProtocolError(
                f"image_url.detail {detail!r} is not one of auto, low, high", param="messages"
            )
        audio = getattr(part, "input_audio", None)
        if audio is not None and audio.format.lower() not in AUDIO_FORMATS:
            raise ProtocolError(
                f"input_audio.format {audio.format!r} is not one of {', '.join(AUDIO_FORMATS)}",
                param="messages",
            )

    def check_counts(self, modalities: Sequence[str]) -> None:
        """Raise ProtocolError when a modality is absent from the model or over its limit."""
        for m in ("image", "video", "audio"):
            n = sum(1 for x in modalities if x == m)
            if not n:
                continue
            if m not in self.markers:
                raise ProtocolError(f"this model does not take {m} input", param="messages")
            limit = int(self.options.limit_per_prompt.get(m, 0))
            if n > limit:
                raise ProtocolError(
                    f"At most {limit} {m}(s) may be provided in one prompt. "
                    "Set `--limit-mm-per-prompt` to increase this limit.",
                    param=m,
                )

    async def load(self, url: str, modality: str) -> bytes:
        """The bytes a part's URL names. Raises ProtocolError (400) with the reason."""
        if url.startswith("data:"):  # a big one decodes off the event loop
            if len(url) > OFF_LOOP_BYTES:
                return await asyncio.to_thread(self._data_url, url, modality)
            return self._data_url(url, modality)
        parsed = urlparse(url)
        if parsed.scheme in ("http", "https"):
            return await self._fetch(url, parsed.hostname or "", modality)
        if parsed.scheme == "file":  # off the loop: a slow disk or share must not stall the server
            return await asyncio.to_thread(self._local, unquote(parsed.path), modality)
        raise ProtocolError(
            f"unsupported {modality} URL scheme {parsed.scheme or url[:16]!r}", param="messages"
        )

    def _data_url(self, url: str, modality: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep:
            raise ProtocolError("a data URL needs a comma before its data", param="messages")
        parts = head[5:].split(";")
        mime = parts[0].lower()
        if "base64" not in parts[1:]:
            raise ProtocolError("only base64 data URLs are supported", param="messages")
        if not mime.startswith(MODALITY_MIME[modality]):
            raise ProtocolError(
                f"{_an(modality)} part needs a data URL of type {MODALITY_MIME[modality]}*, got {mime or 'none'!r}",
                param="messages",
            )
        if len(payload) * 3 // 4 > self.options.max_item_bytes:
            raise ProtocolError(
                f"{_an(modality)} item is over {self.options.max_item_bytes} bytes", param="messages"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ProtocolError(f"the {modality} data URL is not valid base64: {e}", param="messages") from e

    async def _fetch(self, url: str, host: str, modality: str) -> bytes:
        allowed = self.options.allowed_domains
        if not allowed:
            raise ProtocolError(
                f"fetching {modality} URLs is off on this server (--allowed-media-domains); send a data: URL",
                param="messages",
            )
        if host not in allowed:
            raise ProtocolError(f"host {host!r} is not in --allowed-media-domains", param="messages")
        limit, timeout_s = self.options.max_item_bytes, self.options.fetch_timeout_s
        try:
            async with (  # the whole fetch, not each read, within timeout_s
                asyncio.timeout(timeout_s),
                httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client,
                client.stream("GET", url) as r,
            ):
                if r.status_code != 200:
                    raise ProtocolError(
                        f"fetching the {modality} URL gave HTTP {r.status_code}", param="messages"
                    )
                buf = bytearray()
                async for chunk in r.aiter_bytes():
                    buf += chunk
                    if len(buf) > limit:
                        raise ProtocolError(f"{_an(modality)} item is over {limit} bytes", param="messages")
                return bytes(buf)
        except (TimeoutError, httpx.TimeoutException) as e:
            raise ProtocolError(
                f"fetching the {modality} URL timed out after {timeout_s:g} s", param="messages"
            ) from e
        except httpx.HTTPError as e:
            why = str(e) or type(e).__name__
            raise ProtocolError(f"fetching the {modality} URL failed: {why}", param="messages") from e

    def _local(self, path: str, modality: str) -> bytes:
        root = self.options.allowed_local_path
        if root is None:
            raise ProtocolError(
                "cannot load local files without --allowed-local-media-path", param="messages"
            )
        real, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            raise ProtocolError(f"{path} is not under --allowed-local-media-path", param="messages")
        try:
            # a FIFO, device or socket could block its reader for good: regular files only,
            # opened without blocking and checked again on the descriptor (no swap in between)
            if not stat.S_ISREG(os.stat(real).st_mode):
                raise ProtocolError(f"{path} is not a regular file", param="messages")
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
            with open(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ProtocolError(f"{path} is not a regular file", param="messages")
                if st.st_size > self.options.max_item_bytes:
                    raise ProtocolError(
                        f"{_an(modality)} item is over {self.options.max_item_bytes} bytes", param="messages"
                    )
                return f.read()
        except OSError as e:
            raise ProtocolError(f"cannot read {path}: {e.strerror}", param="messages") from e

    # -- layout ----------------------------------------------------------------------------------
    def expand(
        self, ids: Sequence[int], media: Sequence[tuple[str, bytes]], details: Sequence[str | None] = ()
    ) -> MediaPrompt:
        """Replace each marker pad token of ``ids`` by its item's run (module docstring); blocking
        (probes headers, decodes audio). Raises ProtocolError: a marker count that differs from
        the items' (a chat template that drops or repeats them), or media that does not load."""
        found = [(i, self._pad_modality[t]) for i, t in enumerate(ids) if t in self._pad_modality]
        if [m for _, m in found] != [m for m, _ in media]:
            pads = {m: TOKEN_TEXT[f"{m}_pad"] for m in ("image", "video", "audio")}
            raise ProtocolError(
                f"the prompt has media markers {[m for _, m in found]} for the media parts "
                f"{[m for m, _ in media]}: message text may not contain the markers "
                f"{', '.join(pads.values())} itself (or a custom chat template dropped or repeated a part)",
                param="messages",
            )
        out = MediaPrompt([], [], [], [])
        last = 0
        for k, ((pos, modality), (_, data)) in enumerate(zip(found, media, strict=True)):
            out.ids.extend(ids[last:pos])
            last = pos + 1
            try:
                self._item(out, modality, data, details[k] if k < len(details) else None)
            except MediaError as e:
                raise ProtocolError(f"{modality} {len(out.items)}: {e}", param="messages") from e
        out.ids.extend(ids[last:])
        return out

    def _params(self, modality: str) -> dict[str, Any]:
        mm = self.config
        if modality == "audio":
            return self.audio_params.to_hf()
        d = dataclasses.asdict(mm.image) if mm.image is not None else {}
        if modality == "video" and mm.video is not None:
            d = {"image": d, "video": dataclasses.asdict(mm.video)}
        return d

    def _item(self, out: MediaPrompt, modality: str, data: bytes, detail: str | None = None) -> None:
        mm, opts, t = self.config, self.options, self.config.tokens
        low = modality == "image" and detail == "low"
        params = self._params(modality) | ({"detail": "low"} if low else {})
        key = item_key(self.digest, modality, params, data)
        spans: list[int] = []

        def run(n: int, offset: int) -> None:
            spans.append(len(out.spans))
            out.spans.append(MediaSpan(len(out.ids), n, key, modality, offset))
            out.ids.extend(pad_ids(key, n, offset))

        if modality == "image":
            assert mm.image is not None
            w, h = image_size(data)
            if w * h > opts.max_image_pixels:
                raise MediaError(f"{w}x{h} is over the {opts.max_image_pixels}-pixel limit")
            size = None
            p = mm.image
            if low:  # OpenAI's low detail: at most a 512x512 image's pixels
                p = dataclasses.replace(p, max_pixels=max(p.min_pixels, min(p.max_pixels, LOW_DETAIL_PIXELS)))
                size = smart_resize(h, w, p.factor, p.min_pixels, p.max_pixels)
            n = image_num_tokens(h, w, p)
            run(n, 0)
            out.items.append(EncodeItem(key, modality, data, n, (), size))
        elif modality == "video":
            assert mm.video is not None
            meta = probe_video(data)
            if meta.duration_s > opts.max_video_seconds:
                raise MediaError(f"{meta.duration_s:.1f} s is over the {opts.max_video_seconds:.0f} s limit")
            times = sample_times(meta, mm.video)
            h, w = frame_size(meta, mm.video, len(times))
            per = (h // mm.video.factor) * (w // mm.video.factor)
            stamps = grid_timestamps(times, mm.video)
            out.ids.append(t.video_start)
            for g, stamp in enumerate(stamps):
                out.ids.extend(self.tokenizer.encode(stamp, add_special_tokens=False))
                out.ids.append(t.vision_start)
                run(per, g * per)
                out.ids.append(t.vision_end)
            out.ids.append(t.video_end)
            out.items.append(EncodeItem(key, modality, data, per * len(stamps), tuple(times), (h, w)))
        else:
            n = audio_num_tokens(self.audio_params.num_frames(decoded_samples(data, opts.max_audio_seconds)))
            run(n, 0)
            out.items.append(EncodeItem(key, modality, data, n))
        out.item_spans.append(spans)


def media_options(limit: str | None, domains: list[str] | None, local: Any) -> MediaOptions:
    """``MediaOptions`` from the front's flags (``options.LimitMMOption`` etc.)."""
    limits = dict(DEFAULT_LIMITS)
    if limit is not None:
        limits.update(parse_limits(limit))
    return MediaOptions(
        limit_per_prompt=limits,
        allowed_domains=tuple(domains or ()),
        allowed_local_path=None if local is None else str(local),
    )

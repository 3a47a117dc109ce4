"""Video inputs: cheap metadata, MiMo frame sampling, token counts, and chunked parallel decoding.

The MiMo processor (Xiaomi-authored, in the SGLang fork Abatom/sglang:
python/sglang/srt/multimodal/processors/mimo_omni_processor/mimo_vl_processor.py, ``process_video``)
turns a video into frame pairs. From the container's frame count N and average rate f it takes
``n`` frame indices (``sample_times``), resizes every frame to one size under a per-video pixel
budget (``frame_size``) and feeds pairs of frames (temporal patch 2) to the ViT. The prompt
carries one "MM:SS" text per pair::

    <|video_start|>
      00:00 <|vision_start|> <|video_pad|> x tokens_per_grid <|vision_end|>     frames 0, 1
      00:01 <|vision_start|> <|video_pad|> x tokens_per_grid <|vision_end|>     frames 2, 3
      ...                                                                       (num_grids rows)
    <|video_end|>

``video_num_tokens`` gives ``(num_grids, tokens_per_grid)`` from the metadata alone, so the router
can count tokens before anything is decoded. ``decode_frames`` decodes the chosen frames with
PyAV: the time range is split into chunks, each decoded by its own thread from its own
container (seek back to a keyframe, decode, keep only the frames the chunk owns), and the result
is pixel-equal to one sequential decode. Errors from untrusted bytes are ``MediaError``.

torch and PyAV are imported by the functions that use them, on first use: the router loads this
module to count tokens and starts without torch, and the engine loads its configs without FFmpeg. The sampling and the timestamps call torch on purpose: the
processor computes them with torch ops (a float32 ``linspace`` whose CPU kernel rounds by its SIMD
width), which a numpy imitation misses in the last bit for many lengths (so it could round to
another frame).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from swaserve.media import MediaError
from swaserve.media.image import smart_resize

if TYPE_CHECKING:
    import torch

# Sanity limits on what a container may claim (the API applies its own, tighter, per-request limits).
MAX_SIDE = 16384  # pixels, either side
MAX_FRAME_PIXELS = 8192 * 8192
MAX_ASPECT = 200  # the processor's smart_resize rejects more
MAX_DURATION_S = 24 * 3600.0
MAX_FPS = 1000.0
MAX_NUM_FRAMES = 10_000_000
MAX_OUTPUT_BYTES = 1 << 33  # decode_frames' uint8 result

# A requested time matches a frame whose pts is at most this much later (float rounding of
# index / fps); frame spacing is always far larger.
_TIME_EPS_S = 1e-6


@dataclass(frozen=True)
class VideoParams:
    """How a video becomes frames and tokens (MiMo processor defaults, SGLang fork
    processors/mimo_v2_omni.py ``MiMoV2OmniProcessor.__init__``).

    Attributes:
        fps: frames sampled per second of video. min_frames / max_frames: bounds on that count.
        num_frames: a fixed frame count instead of ``fps`` (None: use ``fps``).
        min_pixels / max_pixels: bounds on one frame's resized area, in pixels.
        total_max_pixels: the whole video's pixel budget, spread over the frames (per frame pair).
        factor: resized sides are multiples of this (ViT patch 16 x spatial merge 2).
        temporal_patch_size: frames per temporal grid (one "MM:SS" text each).
    """

    fps: float = 2.0
    min_frames: int = 8
    max_frames: int = 256
    num_frames: int | None = None
    min_pixels: int = 4 * 32 * 32
    max_pixels: int = 4096 * 32 * 32
    total_max_pixels: int = 16384 * 32 * 32
    factor: int = 32
    temporal_patch_size: int = 2

    def __post_init__(self) -> None:
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"fps must be positive, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"need 1 <= min_frames <= max_frames, got {self.min_frames}, {self.max_frames}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        if self.total_max_pixels <= 0 or self.factor <= 0 or self.temporal_patch_size <= 0:
            raise ValueError("total_max_pixels, factor and temporal_patch_size must be positive")

    @classmethod
    def from_hf(
        cls,
        processor_config: dict[str, Any],
        *,
        patch_size: int = 16,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
    ) -> VideoParams:
        """Parameters from a checkpoint's ``processor_config`` (keys ``fps``, ``num_frames``,
        ``min_frames``, ``max_frames``, ``video_min_pixels``, ``video_max_pixels``,
        ``video_total_max_pixels``). A missing or falsy key takes the processor's default, scaled
        by ``patch_size * merge_size`` as the SGLang fork's processors/mimo_v2_omni.py does."""
        unit = patch_size * merge_size
        c = processor_config
        return cls(
            fps=float(c.get("fps") or 2.0),
            min_frames=int(c.get("min_frames") or 8),
            max_frames=int(c.get("max_frames") or 256),
            num_frames=int(c["num_frames"]) if c.get("num_frames") else None,
            min_pixels=int(c.get("video_min_pixels") or 4 * unit * unit),
            max_pixels=int(c.get("video_max_pixels") or 4096 * unit * unit),
            total_max_pixels=int(c.get("video_total_max_pixels") or 16384 * unit * unit),
            factor=unit,
            temporal_patch_size=temporal_patch_size,
        )


@dataclass(frozen=True)
class VideoMeta:
    """What the container headers say about the first (non cover-art) video stream.

    Attributes:
        width / height: coded frame size, pixels (display rotation is not applied).
        duration_s: the stream's duration (the container's if the stream has none), seconds.
        fps: average frame rate, frames per second.
        num_frames: the stream's frame count from the header, or ``int(fps * duration_s)`` when
            the container has none (WebM/Matroska), as torchcodec's approximate mode estimates it.
        codec: decoder name (``h264``, ``mpeg4``, ``vp9``...). has_audio: any audio stream.
    """

    width: int
    height: int
    duration_s: float
    fps: float
    num_frames: int
    codec: str
    has_audio: bool


class VideoTokens(NamedTuple):
    """Placeholder counts of one video: ``num_grids`` frame pairs of ``tokens_per_grid`` pads."""

    num_grids: int
    tokens_per_grid: int

    @property
    def pads(self) -> int:
        return self.num_grids * self.tokens_per_grid


# ---------------------------------------------------------------------------------------------
# metadata


def _open(data: bytes) -> Any:
    import av

    if not data:
        raise MediaError("the video is empty (0 bytes)")
    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="replace")
    except av.FFmpegError as e:
        raise MediaError(f"not a readable video container ({e.strerror or e})") from None


def _video_stream(container: Any) -> Any:
    """The first video stream that is not an attached picture (cover art), or MediaError."""
    import av

    fmt = container.format.name
    if fmt.endswith("_pipe") or fmt == "image2":
        raise MediaError(f"this is a still image ({fmt.removesuffix('_pipe')}), not a video")
    for s in container.streams.video:
        if not s.disposition & av.stream.Disposition.attached_pic:
            return s
    kinds = sorted({s.type for s in container.streams}) or ["none"]
    raise MediaError(f"the file has no video stream (streams: {', '.join(kinds)})")


def _codec_name(stream: Any) -> str:
    import av

    try:
        name = stream.codec_context.name
    except (AttributeError, av.FFmpegError):
        name = None
    if not name or name == "none":
        raise MediaError("the video stream's codec is unknown")
    try:
        av.codec.Codec(name, "r")
    except (av.codec.codec.UnknownCodecError, av.FFmpegError, ValueError):
        raise MediaError(f"unsupported video codec {name!r} (no decoder)") from None
    return name


def _meta(container: Any, stream: Any) -> VideoMeta:
    import av

    codec = _codec_name(stream)
    w, h = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE) or w * h > MAX_FRAME_PIXELS:
        raise MediaError(f"video frame size {w}x{h} is out of range (each side 1..{MAX_SIDE})")
    if max(w, h) / min(w, h) > MAX_ASPECT:
        raise MediaError(f"video aspect ratio {w}x{h} is over {MAX_ASPECT}")
    duration = 0.0
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / av.time_base
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    frames = int(stream.frames or 0)
    fps = float(rate) if rate else 0.0
    if fps <= 0 and frames > 0 and duration > 0:
        fps = frames / duration
    if duration <= 0 and frames > 0 and fps > 0:
        duration = frames / fps
    if not (duration > 0 and math.isfinite(duration)):
        raise MediaError("the video's duration is zero or unknown")
    if not (0 < fps <= MAX_FPS):
        raise MediaError(f"the video's frame rate {fps:g} is zero, unknown or over {MAX_FPS:g}")
    if duration > MAX_DURATION_S:
        raise MediaError(f"the video is {duration:.0f} s long, over {MAX_DURATION_S:.0f} s")
    num_frames = frames if frames > 0 else int(fps * duration)
    if not 0 < num_frames <= MAX_NUM_FRAMES:
        raise MediaError(f"the video declares {num_frames} frames (allowed 1..{MAX_NUM_FRAMES})")
    has_audio = any(s.type == "audio" for s in container.streams)
    return VideoMeta(w, h, duration, fps, num_frames, codec, has_audio)


def probe_video(data: bytes) -> VideoMeta:
    """Metadata of a video from its container and stream headers (no frame is decoded).

    Raises:
        MediaError: not a container FFmpeg reads, a still image, no video stream, a codec without
            a decoder, a zero or unknown duration or frame rate, or sizes over the module limits.
    """
    with _open(data) as c:
        return _meta(c, _video_stream(c))


# ---------------------------------------------------------------------------------------------
# sampling, sizes and tokens (the MiMo processor's rules)


def _sample_indices(meta: VideoMeta, p: VideoParams) -> list[int]:
    n_total, f = meta.num_frames, meta.fps
    duration = n_total / f  # the processor's duration: frames / average fps
    if p.num_frames is not None:
        n: float = p.num_frames
    else:
        n = min(math.ceil(n_total / f * p.fps), p.max_frames)
        n = max(n, p.min_frames)
    n = min(n, duration * f)  # never more frames than the video has (a float, as upstream)
    k = p.temporal_patch_size
    count = max(math.ceil(n / k) * k, k)
    end_idx = int(duration * f)
    # count + 1 evenly spaced points over [0, end_idx], the last dropped: float32 linspace and
    # round-half-even, exactly the processor's torch ops (do_include_last_frame=False).
    import torch

    idx = torch.linspace(0, end_idx, count + 1).round().int()[:-1].clamp(max=n_total - 1)
    return idx.tolist()


def sample_times(meta: VideoMeta, p: VideoParams) -> list[float]:
    """The times of the frames to take, seconds from the stream's start, in order.

    As the Xiaomi processor samples (SGLang fork mimo_vl_processor.py ``smart_nframes`` and
    ``process_video``, whole video): ``n = ceil(N / f * fps)`` clamped to
    ``[min_frames, max_frames]`` (or ``num_frames``), capped at N, then rounded *up* to a multiple
    of ``temporal_patch_size``; frame indices ``round(linspace(0, N, n + 1))[:-1]`` (so a short
    video repeats frames where the spacing drops below one), time = index / f. Because the count
    is already even, the processor's later pad-by-repeating-the-last-frame is a no-op here; it is
    kept for safety. vLLM's port (vllm/transformers_utils/processors/mimo_v2_omni.py) gets frames
    already sampled by vLLM's video loader and its model adapter treats them as 1 s apart, so its
    timestamps (and token ids) differ; this follows SGLang.
    """
    times = [i / meta.fps for i in _sample_indices(meta, p)]
    k = p.temporal_patch_size
    while len(times) % k:
        times.append(times[-1])
    return times


def frame_size(meta: VideoMeta, p: VideoParams, num_frames: int) -> tuple[int, int]:
    """The (height, width) every frame is resized to when ``num_frames`` frames are sampled.

    Per-frame cap = ``max(min_pixels, min(total_max_pixels * temporal_patch_size // num_frames,
    max_pixels))`` (mimo_vl_processor.py ``smart_resize_video``), then the images' ``smart_resize``
    (swaserve/media/image.py).

    Raises:
        MediaError: as ``smart_resize`` (a frame too thin to fit the cap in sides of ``factor``).
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    cap = max(p.min_pixels, min(p.total_max_pixels * p.temporal_patch_size // num_frames, p.max_pixels))
    return smart_resize(meta.height, meta.width, p.factor, p.min_pixels, cap)


def video_num_tokens(meta: VideoMeta, p: VideoParams) -> VideoTokens:
    """(num_grids, tokens_per_grid) of a video from its metadata only: one grid per
    ``temporal_patch_size`` sampled frames, ``(h / factor) * (w / factor)`` pads per grid."""
    n = len(sample_times(meta, p))
    h, w = frame_size(meta, p, n)
    return VideoTokens(n // p.temporal_patch_size, (h // p.factor) * (w // p.factor))


def timestamp_text(seconds: float) -> str:
    """The "MM:SS" text of a time in seconds (minutes not wrapped: 3725 s is "62:05"), computed
    in float32 as the processor's timestamp tensor is (SGLang fork mimo_vl_utils.py
    ``format_timestamp``; vLLM's ``_format_timestamp`` has the same formula)."""
    import torch

    t = torch.tensor(seconds, dtype=torch.float32)
    return f"{int(t // 60):02d}:{int(t % 60):02d}"


def grid_timestamps(times: Sequence[float], p: VideoParams) -> list[str]:
    """The "MM:SS" text of each temporal grid: the time of its first frame."""
    return [timestamp_text(t) for t in times[:: p.temporal_patch_size]]


# ---------------------------------------------------------------------------------------------
# decoding


class _Late(Exception):
    """A seek landed on a keyframe after the chunk's first target."""


@dataclass(frozen=True)
class _Stream:
    start: int  # the stream's first pts, time-base ticks
    time_base: Fraction
    width: int
    height: int
    frame_ticks: float  # one frame period at the average rate, ticks
    budget: int  # most frames one chunk may decode


def _rgb(frame: Any, s: _Stream) -> np.ndarray:
    if frame.width != s.width or frame.height != s.height:
        frame = frame.reformat(width=s.width, height=s.height)
    return frame.to_ndarray(format="rgb24")


def _scan(container: Any, stream: Any, targets: list[int], s: _Stream, seeked: bool) -> dict[int, np.ndarray]:
    """Decode forward from where ``container`` stands; map each target tick to the frame shown then.

    After a seek (``seeked``), frames before the first keyframe are dropped (they may lean on
    references the seek skipped) and that keyframe must not be later than the first target.
    """
    import av

    out: dict[int, np.ndarray] = {}
    i, count, started = 0, 0, not seeked
    prev: Any = None
    prev_pts = 0
    prev_rgb: tuple[int, np.ndarray] | None = None

    def take(frame: Any, pts: int) -> np.ndarray:
        nonlocal prev_rgb
        if prev_rgb is None or prev_rgb[0] != pts:
            if frame.is_corrupt:
                raise MediaError(f"the video is corrupt near {float((pts - s.start) * s.time_base):.2f} s")
            prev_rgb = (pts, _rgb(frame, s))
        return prev_rgb[1]

    try:
        for frame in container.decode(stream):
            count += 1
            if count > s.budget:
                raise MediaError("the video holds more frames than its header declares")
            pts = frame.pts
            if pts is None:
                raise MediaError("the video has frames without timestamps")
            if not started:
                if not frame.key_frame:
                    continue
                if pts > targets[0]:
                    raise _Late
                started = True
            if prev is not None and pts <= prev_pts:
                continue  # a pts out of order or repeated: the frame is ignored
            while i < len(targets) and pts > targets[i]:
                # the last frame at or before the target; before the first frame: the first frame
                out[targets[i]] = take(prev, prev_pts) if prev is not None else take(frame, pts)
                i += 1
            if i < len(targets) and pts == targets[i]:
                out[targets[i]] = take(frame, pts)
                i += 1
            if i == len(targets):
                return out
            prev, prev_pts = frame, pts
    except av.FFmpegError as e:
        raise MediaError(f"the video data is corrupt or truncated ({e.strerror or e})") from None
    if prev is None:
        raise MediaError("no frame of the video could be decoded")
    for t in targets[i:]:
        if t - prev_pts > 1.5 * s.frame_ticks:
            end = float((prev_pts - s.start) * s.time_base)
            want = float((t - s.start) * s.time_base)
            raise MediaError(
                f"the video data ends at {end:.2f} s, before the frame at {want:.2f} s (truncated?)"
            )
        out[t] = take(prev, prev_pts)
    return out


def _decode_chunk(data: bytes, targets: list[int], s: _Stream, from_start: bool) -> dict[int, np.ndarray]:
    """One chunk in its own container: seek back to a keyframe at or before ``targets[0]`` (one
    further back each time the seek lands late; from the start as the last resort), decode."""
    import av

    back = int(1 / s.time_base)  # one second, ticks
    seek_to = targets[0]
    while True:
        with _open(data) as c:
            stream = _video_stream(c)
            stream.codec_context.thread_type = "NONE"
            if from_start or seek_to <= s.start:
                return _scan(c, stream, targets, s, seeked=False)
            try:
                c.seek(seek_to, stream=stream, backward=True, any_frame=False)
                return _scan(c, stream, targets, s, seeked=True)
            except _Late:
                seek_to -= back
                back *= 2
            except av.FFmpegError:
                from_start = True  # not seekable: decode from the beginning


def _chunks(ticks: list[int], k: int) -> list[list[int]]:
    """Sorted unique ticks split into up to ``k`` runs covering equal spans of time."""
    lo, span = ticks[0], ticks[-1] - ticks[0] + 1
    runs: list[list[int]] = [[] for _ in range(k)]
    for t in ticks:
        runs[min(k - 1, (t - lo) * k // span)].append(t)
    return [r for r in runs if r]


def decode_frames(data: bytes, times: Sequence[float], threads: int = 1) -> torch.Tensor:
    """The frames shown at ``times`` (seconds from the stream's start), as uint8 RGB ``[n, 3, H, W]``
    at the source size, in the order asked (repeats allowed).

    The frame shown at t is the last frame whose pts <= t (1 us tolerance); before the first frame
    it is the first frame. On constant-rate video the time index / fps gives frame ``index``, which
    is what the processor's torchcodec index lookup returns. The distinct times are split into
    ``threads`` chunks of equal time span; each chunk decodes in its own thread and container
    (seek back to a keyframe, decode with FFmpeg threading off, skip frames before the chunk's
    first time, stop after its last) and only chosen frames are converted to RGB. The result is
    pixel-equal to one sequential decode for any ``threads``.

    Raises:
        MediaError: anything ``probe_video`` rejects; corrupt or truncated data; a time past the
            end of the data; more decoded frames than the header declares (work is bounded by
            ``2 * num_frames + 256`` frames per chunk); a result over ``MAX_OUTPUT_BYTES``.
        ValueError: ``threads < 1``, or a negative or non-finite time.
    """
    import av
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if any(not (math.isfinite(t) and t >= 0) for t in times):
        raise ValueError("times must be finite and >= 0")
    with _open(data) as c:
        v = _video_stream(c)
        meta = _meta(c, v)
        tb = Fraction(v.time_base) if v.time_base else Fraction(1, av.time_base)
        start = int(v.start_time) if v.start_time is not None else 0
    n = len(times)
    if n * 3 * meta.width * meta.height > MAX_OUTPUT_BYTES:
        raise MediaError(f"{n} frames of {meta.width}x{meta.height} exceed {MAX_OUTPUT_BYTES} bytes")
    if n == 0:
        return torch.empty((0, 3, meta.height, meta.width), dtype=torch.uint8)
    s = _Stream(
        start, tb, meta.width, meta.height, float(1 / (tb * Fraction(meta.fps))), 2 * meta.num_frames + 256
    )
    ticks = [start + math.floor((Fraction(t) + Fraction(_TIME_EPS_S)) / tb) for t in times]
    runs = _chunks(sorted(set(ticks)), threads)
    if len(runs) == 1:
        frames = _decode_chunk(data, runs[0], s, from_start=True)
    else:
        frames = {}
        with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="video-decode") as pool:
            jobs = [pool.submit(_decode_chunk, data, r, s, j == 0) for j, r in enumerate(runs)]
            for job in jobs:
                frames.update(job.result())
    out = np.stack([frames[t] for t in ticks])
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()

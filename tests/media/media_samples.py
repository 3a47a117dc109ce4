"""Small media made in memory with PyAV's bundled FFmpeg (and pillow), for the media tests."""

from __future__ import annotations

import io
from typing import Any

import av
import numpy as np
from av.video.frame import PictureType


def frame_image(i: int, width: int, height: int) -> np.ndarray:
    """An RGB frame that differs from every other index: a moving bar over a gradient."""
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = (i * 37) % 256
    img[..., 1] = (np.arange(width)[None, :] * 4 + i) % 256
    img[:, (i * 3) % width : (i * 3) % width + 4, 2] = 255
    return img


def make_video(
    codec: str = "libx264",
    fmt: str = "mp4",
    frames: int = 48,
    fps: int = 8,
    width: int = 64,
    height: int = 48,
    gop: int = 8,
    bframes: int = 2,
    audio: bool = False,
) -> bytes:
    """A video of ``frames`` distinct frames at ``fps``: keyframes every ``gop`` frames, up to
    ``bframes`` B-frames between references, and optionally a mono AAC 24 kHz sine track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s: Any = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.gop_size = gop
        if codec == "libx264":
            s.options = {"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0", "bf": str(bframes)}
        else:
            s.codec_context.max_b_frames = bframes
        a: Any = None
        if audio:
            a = c.add_stream("aac", rate=24000)
            a.layout = "mono"
        for i in range(frames):
            f = av.VideoFrame.from_ndarray(frame_image(i, width, height), format="rgb24")
            f.pts = i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
        if a is not None:
            _write_sine(c, a, frames / fps, 24000)
    return buf.getvalue()


def _write_sine(
    c: av.container.OutputContainer, a: av.audio.stream.AudioStream, seconds: float, sr: int
) -> None:
    t = np.arange(int(seconds * sr)) / sr
    x = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    for k in range(0, len(x), 1024):
        af = av.AudioFrame.from_ndarray(x[None, k : k + 1024], format="flt", layout="mono")
        af.sample_rate, af.pts = sr, k
        for p in a.encode(af):
            c.mux(p)
    for p in a.encode():
        c.mux(p)


def make_audio_only(seconds: float = 1.0) -> bytes:
    """An M4A (MP4 container, AAC) with no video stream."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        a = c.add_stream("aac", rate=24000)
        a.layout = "mono"
        _write_sine(c, a, seconds, 24000)
    return buf.getvalue()


def make_png(width: int = 64, height: int = 48) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame_image(0, width, height)).save(buf, format="PNG")
    return buf.getvalue()


def sequential_decode(data: bytes) -> tuple[list[float], np.ndarray, list[str]]:
    """Every frame of the first video stream, decoded in one pass with FFmpeg's defaults: pts in
    seconds, RGB frames [n, H, W, 3], picture types ("I", "P", "B")."""
    c: Any
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        tb = s.time_base
        pts, rgb, kinds = [], [], []
        for f in c.decode(s):
            pts.append(float(f.pts * tb))
            rgb.append(f.to_ndarray(format="rgb24"))
            kinds.append(PictureType(f.pict_type).name)
    return pts, np.stack(rgb), kinds


def frames_at(pts: list[float], rgb: np.ndarray, times: list[float]) -> np.ndarray:
    """The reference pick: at each time the last frame with pts <= t (1 us slack), else the first."""
    idx = [max([i for i, p in enumerate(pts) if p <= t + 1e-6], default=0) for t in times]
    return rgb[idx]

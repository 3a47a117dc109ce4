"""Video: header metadata, the MiMo processor's sampling, sizes and token counts, and chunked
multi-threaded decoding that equals a sequential decode frame for frame. Videos are made here."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from swaserve.media import MediaError
from swaserve.media import video as V
from swaserve.media.video import (
    VideoMeta,
    VideoParams,
    decode_frames,
    frame_size,
    grid_timestamps,
    probe_video,
    sample_times,
    timestamp_text,
    video_num_tokens,
)
from tests.media import media_samples as ms

CODECS = ["libx264", "mpeg4"]


@pytest.fixture(scope="module")
def videos() -> dict[str, bytes]:
    return {
        "libx264": ms.make_video("libx264", audio=True),
        "mpeg4": ms.make_video("mpeg4"),
        "vp9": ms.make_video("libvpx-vp9", fmt="webm"),
        "mkv": ms.make_video("libx264", fmt="matroska"),
    }


@pytest.fixture(scope="module")
def reference(videos: dict[str, bytes]) -> dict[str, tuple[list[float], np.ndarray, list[str]]]:
    return {k: ms.sequential_decode(videos[k]) for k in CODECS}


def _meta(width: int, height: int, frames: int, fps: float) -> VideoMeta:
    return VideoMeta(width, height, frames / fps, fps, frames, "h264", False)


# --- metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "codec", "audio"), [("libx264", "h264", True), ("mpeg4", "mpeg4", False), ("vp9", "vp9", False)]
)
def test_probe_reads_headers(videos: dict[str, bytes], key: str, codec: str, audio: bool) -> None:
    m = probe_video(videos[key])
    # WebM has no frame count: estimated as int(fps * duration) = 48
    assert m == VideoMeta(64, 48, 6.0, 8.0, 48, codec, audio)


@pytest.mark.parametrize("key", CODECS)
def test_samples_have_b_frames_and_gop_8(reference: dict, key: str) -> None:
    pts, rgb, kinds = reference[key]
    assert len(pts) == 48 and pts == [i / 8 for i in range(48)]
    assert "B" in kinds  # reordered frames: decode order != presentation order
    keys = [i for i, k in enumerate(kinds) if k == "I"]
    assert keys[0] == 0 and max(np.diff(keys)) <= 9  # a keyframe every 8 (mpeg4: 9) frames
    assert len({r.tobytes() for r in rgb}) == 48  # every frame differs: a wrong pick shows


# --- chunked decode == sequential decode ------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("key", CODECS)
def test_chunked_decode_equals_sequential(
    videos: dict[str, bytes], reference: dict, key: str, threads: int
) -> None:
    data, (pts, rgb, _) = videos[key], reference[key]
    sampled = sample_times(probe_video(data), VideoParams())
    assert len(sampled) == 12
    every = list(pts)
    between = [0.3, 0.0, 5.99, 0.3, 2.74, 1.0]  # off-grid, repeated, out of order
    for times in (sampled, every, between):
        got = decode_frames(data, times, threads=threads)
        assert got.dtype == torch.uint8 and got.shape == (len(times), 3, 48, 64)
        want = torch.from_numpy(ms.frames_at(pts, rgb, times)).permute(0, 3, 1, 2)
        assert torch.equal(got, want)
    # the off-grid picks are the frame on screen: 0.3 s shows frame 2 (0.25 s), 2.74 s frame 21
    assert torch.equal(decode_frames(data, [0.3, 2.74]), torch.from_numpy(rgb[[2, 21]]).permute(0, 3, 1, 2))


def test_chunks_seek_mid_gop(videos: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """4 threads over 48 frames: chunk 0 decodes from the start, the others seek into the video."""
    calls: list[tuple[int, bool]] = []
    scan = V._scan

    def spy(c, stream, targets, s, seeked):  # type: ignore[no-untyped-def]
        calls.append((targets[0], seeked))
        return scan(c, stream, targets, s, seeked)

    monkeypatch.setattr(V, "_scan", spy)
    decode_frames(videos["libx264"], [i / 8 for i in range(48)], threads=4)
    assert sorted(seeked for _, seeked in calls) == [False, True, True, True]
    assert sorted(t for t, _ in calls)[1:] == [12 * 2048, 24 * 2048, 36 * 2048]  # time base 1/16384


def test_late_seek_steps_back(
    videos: dict[str, bytes], reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seek that lands on a keyframe after the chunk's first time is retried 1 s further back."""
    seeks: list[int] = []

    class LateFirstSeek:
        def __init__(self, c: object) -> None:
            self.c = c

        def __enter__(self) -> LateFirstSeek:
            return self

        def __exit__(self, *exc: object) -> None:
            self.c.close()  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.c, name)

        def seek(self, ts: int, **kw: object) -> None:
            seeks.append(ts)
            self.c.seek(ts + (16384 if len(seeks) == 1 else 0), **kw)  # type: ignore[attr-defined]

    real_open = V._open
    monkeypatch.setattr(V, "_open", lambda data: LateFirstSeek(real_open(data)))
    pts, rgb, _ = reference["libx264"]
    got = decode_frames(videos["libx264"], pts, threads=2)  # chunk 1 starts at 3 s
    assert seeks == [3 * 16384, 2 * 16384]  # landed at 4 s (late), then from 2 s
    assert torch.equal(got, torch.from_numpy(rgb).permute(0, 3, 1, 2))


def test_decode_edge_times(videos: dict[str, bytes]) -> None:
    data = videos["libx264"]
    assert decode_frames(data, []).shape == (0, 3, 48, 64)
    with pytest.raises(ValueError, match="finite"):
        decode_frames(data, [-1.0])
    with pytest.raises(ValueError, match="threads"):
        decode_frames(data, [0.0], threads=0)
    with pytest.raises(MediaError, match=r"ends at 5\.88 s"):
        decode_frames(data, [0.0, 30.0], threads=2)  # past the end of the data


# --- sampling, sizes, tokens (values worked by hand from the processor's rules) ---------------


def test_sample_times_short_video_padded_to_min_frames() -> None:
    # 3 s at 8 fps: ceil(3 * 2) = 6 -> min_frames 8; indices round(linspace(0, 24, 9))[:-1]
    assert sample_times(_meta(64, 48, 24, 8.0), VideoParams()) == [i * 3 / 8 for i in range(8)]


def test_sample_times_fewer_frames_than_min_repeat_one() -> None:
    # 7 frames: 8 wanted, capped at 7, rounded up to 8 -> linspace(0, 7, 9) repeats index 4
    ts = sample_times(_meta(64, 48, 7, 8.0), VideoParams())
    assert [t * 8 for t in ts] == [0, 1, 2, 3, 4, 4, 5, 6]


def test_sample_times_odd_counts_become_even() -> None:
    # 3.5 s at 2 fps = 7 frames -> 8; 28 source frames, round-half-even: 3.5 -> 4, 10.5 -> 10
    ts = sample_times(_meta(64, 48, 28, 8.0), VideoParams(min_frames=1))
    assert [t * 8 for t in ts] == [0, 4, 7, 10, 14, 18, 21, 24]
    # an odd max_frames (5) -> 6 frames
    ts = sample_times(_meta(64, 48, 80, 8.0), VideoParams(min_frames=1, max_frames=5))
    assert [t * 8 for t in ts] == [0, 13, 27, 40, 53, 67]
    # a fixed num_frames (3) -> 4
    assert sample_times(_meta(64, 48, 80, 8.0), VideoParams(num_frames=3)) == [0.0, 2.5, 5.0, 7.5]


def test_sample_times_long_video_capped_at_max_frames() -> None:
    meta = _meta(1920, 1080, 86400, 24.0)  # one hour at 24 fps: 7200 frames at 2 fps -> 256
    ts = sample_times(meta, VideoParams())
    assert len(ts) == 256
    assert [t * 24 for t in ts[:5]] == [0, 338, 675, 1012, 1350]  # steps of 337.5, half to even
    assert ts[-1] * 24 == 86062
    texts = grid_timestamps(ts, VideoParams())
    assert len(texts) == 128 and texts[:3] == ["00:00", "00:28", "00:56"] and texts[-1] == "59:31"


def test_sample_times_ntsc_rate() -> None:
    meta = VideoMeta(320, 240, 60.06, 30000 / 1001, 1800, "h264", False)
    ts = sample_times(meta, VideoParams())
    assert len(ts) == 122  # ceil(1800 / 29.97 * 2) = 121 -> 122
    assert grid_timestamps(ts, VideoParams())[:5] == ["00:00", "00:01", "00:01", "00:02", "00:03"]


def test_frame_size_and_tokens() -> None:
    p = VideoParams()
    small = _meta(64, 48, 48, 8.0)
    assert frame_size(small, p, 12) == (64, 64)  # 64x48 -> nearest multiples of 32
    assert video_num_tokens(small, p) == (6, 4)
    hd = _meta(1920, 1080, 86400, 24.0)
    # total cap: 16384*1024*2 // 256 = 131072 px per frame -> 256x480 (120 tokens per pair)
    assert frame_size(hd, p, 256) == (256, 480)
    tokens = video_num_tokens(hd, p)
    assert tokens == (128, 120) and tokens.pads == 15360
    # few frames: the per-frame max_pixels (4096*32*32) binds; 1080 rounds to 1088
    assert frame_size(hd, p, 8) == (1088, 1920)
    # very many frames: the cap floors at min_pixels, and the floor rounding lands below it
    assert frame_size(hd, p, 10000) == (32, 64)
    # a side under 32 becomes 32 and the other scales with it (image.py's rule, as vLLM's port;
    # the SGLang fork's code reassigns the short side first and so keeps the long side: (32, 96))
    assert frame_size(_meta(100, 20, 16, 8.0), p, 8) == (32, 160)


def test_timestamp_text() -> None:
    assert timestamp_text(0.5) == "00:00"
    assert timestamp_text(59.99) == "00:59"
    assert timestamp_text(61.0) == "01:01"
    assert timestamp_text(3725.0) == "62:05"  # minutes are not wrapped into hours
    assert timestamp_text(59.999999999) == "01:00"  # float32, as the processor's tensor


def test_params_from_hf() -> None:
    assert VideoParams.from_hf({}) == VideoParams()
    p = VideoParams.from_hf({"fps": 1, "max_frames": 64, "video_max_pixels": 1024 * 1024, "min_frames": None})
    assert (p.fps, p.max_frames, p.min_frames, p.max_pixels) == (1.0, 64, 8, 1024 * 1024)
    assert VideoParams.from_hf({}, patch_size=14).min_pixels == 4 * 28 * 28
    with pytest.raises(ValueError):
        VideoParams(min_frames=9, max_frames=8)


# --- bad input -------------------------------------------------------------------------------


def _decode_all(data: bytes, threads: int = 2) -> torch.Tensor:
    return decode_frames(data, sample_times(probe_video(data), VideoParams()), threads=threads)


def test_bad_videos_raise_media_error(videos: dict[str, bytes]) -> None:
    mp4 = videos["libx264"]
    cases = {
        "garbage": (b"\x00\x01not a video" * 64, "not a readable video container"),
        "empty": (b"", "empty"),
        "half mp4": (mp4[: len(mp4) // 2], "not a readable video container"),  # index (moov) lost
        "audio only": (ms.make_audio_only(), r"no video stream \(streams: audio\)"),
        "png": (ms.make_png(), r"still image \(png\)"),
        "unknown codec": (mp4.replace(b"avc1", b"zzzz"), "codec"),
    }
    for name, (data, message) in cases.items():
        with pytest.raises(MediaError, match=message):
            probe_video(data)
        with pytest.raises(MediaError, match=message):
            _decode_all(data)
        assert name


@pytest.mark.parametrize("threads", [1, 4])
def test_truncated_stream_raises(videos: dict[str, bytes], threads: int) -> None:
    """Matroska keeps its header in front: half the file still probes as 6 s, decoding finds the cut."""
    half = videos["mkv"][: len(videos["mkv"]) // 2]
    assert probe_video(half).duration_s == 6.0
    with pytest.raises(MediaError, match=r"ends at \d+\.\d\d s, before the frame at .* \(truncated\?\)"):
        _decode_all(half, threads)


def test_corrupt_bytes_only_raise_media_error(videos: dict[str, bytes]) -> None:
    """Flipped bits anywhere: either frames of the right shape or a MediaError, nothing else."""
    rng = np.random.default_rng(0)
    for key in ("libx264", "mkv"):
        data = videos[key]
        for _ in range(8):
            bad = bytearray(data)
            for pos in rng.integers(0, len(bad), 10):
                bad[pos] ^= 1 << int(rng.integers(0, 8))
            with contextlib.suppress(MediaError):
                assert _decode_all(bytes(bad), threads=3).shape[1:] == (3, 48, 64)


@pytest.mark.cluster  # a fresh interpreter (subprocess)
def test_the_engine_and_media_configs_load_without_pyav() -> None:
    """PyAV (~0.1 s to import, FFmpeg's libraries) loads on first decode, not with every engine."""
    code = (
        "import sys; import swaserve.engine.client, swaserve.model.multimodal, swaserve.media.audio; "
        "print('av' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

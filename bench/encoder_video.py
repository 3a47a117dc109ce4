"""Part 2 of ``swaserve bench encoder``: chunked video decode (its setup and targets: the docstring
of ``bench.encoder``)."""

from __future__ import annotations

import io
import os
import time
from typing import Any

import numpy as np
import torch

VIDEO_THREADS = (1, 2, 4)
VIDEO_FPS_SAMPLED = 2.0
VIDEO_EFFICIENCY = 0.7  # N threads: speedup >= this x min(N, usable CPUs)


def make_video(seconds: float, width: int, height: int, fps: int, gop_s: float = 10.0) -> bytes:
    """An H.264 MP4 (x264 ``veryfast``, a keyframe every ``gop_s`` s): gradients that drift and a
    moving block, so every frame differs."""
    import av

    buf = io.BytesIO()
    gop = max(1, round(gop_s * fps))
    xs = (np.arange(width) * 255 // width).astype(np.int32)[None, :]
    ys = (np.arange(height) * 2).astype(np.int32)[:, None]
    img = np.zeros((height, width, 3), np.uint8)
    with av.open(buf, "w", format="mp4") as c:
        st: Any = c.add_stream("libx264", rate=fps)
        st.width, st.height, st.pix_fmt = width, height, "yuv420p"
        st.options = {"g": str(gop), "keyint_min": str(gop), "sc_threshold": "0", "preset": "veryfast"}
        bw, bh = max(4, width // 20), max(4, height // 10)
        for i in range(int(seconds * fps)):
            img[..., 0] = (xs + i) % 256
            img[..., 1] = (ys + 3 * i) % 256
            img[..., 2] = 0
            x = (i * 4) % (width - bw)
            img[height // 3 : height // 3 + bh, x : x + bw, 2] = 255
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts = i
            for p in st.encode(f):
                c.mux(p)
        for p in st.encode():
            c.mux(p)
    return buf.getvalue()


def run_video_part(seconds: float, size: tuple[int, int], fps: int, repeats: int) -> dict[str, Any]:
    """Part 2: ``decode_frames`` of one generated video (``seconds`` long, ``size`` pixels, ``fps``)
    at 1, 2, 4 threads, the best of ``repeats`` each."""
    from swaserve.media.video import VideoParams, decode_frames, probe_video, sample_times

    t0 = time.perf_counter()
    w, h = size
    data = make_video(seconds, w, h, fps)
    make_s = time.perf_counter() - t0
    meta = probe_video(data)
    params = VideoParams(fps=VIDEO_FPS_SAMPLED, max_frames=1_000_000)
    times = sample_times(meta, params)
    cpus = len(os.sched_getaffinity(0))
    ref: torch.Tensor | None = None
    rows: list[dict[str, Any]] = []
    for threads in VIDEO_THREADS:
        runs = []
        equal = True
        for _ in range(repeats):
            t = time.perf_counter()
            out = decode_frames(data, times, threads)
            runs.append(time.perf_counter() - t)
            if ref is None:
                ref = out
            equal = equal and torch.equal(out, ref)
            del out
        rows.append({"threads": threads, "best_s": round(min(runs), 4), "runs_s": [round(x, 4) for x in runs],
                     "equal_to_1_thread": equal})  # fmt: skip
    one = rows[0]["best_s"]
    for r in rows:
        r["speedup"] = round(one / r["best_s"], 3) if r["best_s"] > 0 else None
        r["cores_usable"] = min(r["threads"], cpus)
    assert ref is not None
    return {
        "video": {
            "seconds": seconds, "width": w, "height": h, "fps": fps, "codec": meta.codec,
            "frames": meta.num_frames, "bytes": len(data), "keyframe_every_s": 10.0, "make_s": round(make_s, 1),
        },
        "sampled_fps": VIDEO_FPS_SAMPLED, "sampled_frames": len(times),
        "output_shape": list(ref.shape), "cpus": cpus, "repeats": repeats, "rows": rows,
    }  # fmt: skip


def print_video(v: dict[str, Any]) -> None:
    m = v["video"]
    print(f"\nVideo decode: {m['seconds']:g} s {m['width']}x{m['height']} {m['fps']} fps {m['codec']} "
          f"({m['bytes'] / 1e6:.1f} MB), {v['sampled_frames']} frames at {v['sampled_fps']:g} fps, "
          f"best of {v['repeats']}, {v['cpus']} usable CPUs")  # fmt: skip
    print(f"{'threads':>8}{'best s':>9}{'speedup':>9}{'equal':>7}")
    for r in v["rows"]:
        print(
            f"{r['threads']:>8}{r['best_s']:>9.3f}{r['speedup']:>9.2f}{'yes' if r['equal_to_1_thread'] else 'NO':>7}"
        )

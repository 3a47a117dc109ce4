"""The requests of ``swaserve bench encoder``: images made in memory (sizes, JPEG / PNG), drawn
Zipf-like from popular ones or unique, built as the router builds them, with Poisson arrivals for
the open loop."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from swaserve.encoder.items import EncodeItem

SIZES = ((160, 120), (320, 240), (480, 360), (640, 480), (800, 600), (1024, 768), (1280, 960))
POPULAR = 24  # popular images (the repeated ones) per phase
ZIPF_S = 1.0
JPEG_SHARE = 0.75


def make_image(width: int, height: int, seed: int, fmt: str) -> bytes:
    """A photo-like picture (gradients, a few blocks, mild noise) as JPEG or PNG bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        a, b, p = rng.uniform(-1, 1, 3)
        img[..., c] = 128 + 90 * np.sin(a * x / 37 + b * y / 53 + 6 * p)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        img[y0 : y0 + height // 5, x0 : x0 + width // 5] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    buf = io.BytesIO()
    pic = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    pic.save(buf, fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return buf.getvalue()


def random_image(rng: np.random.Generator, seed: int) -> bytes:
    w, h = SIZES[int(rng.integers(len(SIZES)))]
    jitter = float(rng.uniform(0.8, 1.25))
    w, h = max(32, int(w * jitter)), max(32, int(h / jitter))
    return make_image(w, h, seed, "JPEG" if rng.random() < JPEG_SHARE else "PNG")


@dataclass
class Request:
    """One request: its item (the router's key and count) and whether it is one of the popular."""

    item: EncodeItem
    popular: bool
    index: int
    arrival_s: float = 0.0  # open loop: seconds after the phase's start


class Router:
    """Items as the router builds them (``MediaFront.expand`` over one image marker)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from swaserve.api.media import MediaFront
        from swaserve.model.multimodal import MultimodalConfig

        mm = MultimodalConfig.from_pretrained(model_dir)
        if mm is None or mm.vision is None:
            raise ValueError(f"{model_dir}: the checkpoint has no vision tower")
        self.front = MediaFront(mm, AutoTokenizer.from_pretrained(str(model_dir)))
        self.pad = mm.tokens.image_pad

    def item(self, data: bytes) -> EncodeItem:
        prompt = self.front.expand([self.pad], [("image", data)])
        (item,) = prompt.items
        return item


def workload(router: Router, n: int, repeat_share: float, seed: int) -> list[Request]:
    """``n`` requests: ``repeat_share`` of them Zipf-drawn from ``POPULAR`` images, the rest unique."""
    rng = np.random.default_rng(seed)
    popular = [router.item(random_image(rng, seed * 100_003 + i)) for i in range(POPULAR)]
    weights = 1.0 / np.arange(1, POPULAR + 1) ** ZIPF_S
    weights /= weights.sum()
    out: list[Request] = []
    for i in range(n):
        if rng.random() < repeat_share:
            out.append(Request(popular[int(rng.choice(POPULAR, p=weights))], True, i))
        else:
            out.append(Request(router.item(random_image(rng, seed * 100_003 + POPULAR + i)), False, i))
    return out


def unique_key(item: EncodeItem, index: int) -> EncodeItem:
    """``item`` under a key of its own for request ``index`` (the baseline: nothing shared)."""
    key = hashlib.blake2b(item.key + index.to_bytes(8, "little"), digest_size=len(item.key)).digest()
    return replace(item, key=key)


def poisson_arrivals(requests: list[Request], rate: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = 0.0
    for r in requests:
        t += float(rng.exponential(1.0 / rate))
        r.arrival_s = t

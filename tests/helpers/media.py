"""Test helpers for multimodal requests: media made in memory, data URLs, and the transformers
reference over ``inputs_embeds`` with encoder outputs at the placeholder rows."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from swaserve.media.placeholders import PAD_BASE, MediaSpan


def png(width: int, height: int, seed: int) -> bytes:
    """A random RGB PNG (seeded)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def wav(seconds: float, freq: float = 440.0, rate: int = 24000) -> bytes:
    """A mono 16-bit PCM sine WAV."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def reference_greedy(
    hf: Any, ids: Sequence[int], spans: Sequence[MediaSpan], embeds: dict[int, torch.Tensor], new: int
) -> list[int]:
    """Greedy tokens of transformers' MiMo-V2 over ``inputs_embeds``: token embeddings, with each
    span's rows (``embeds[span index]``) written over its placeholder positions."""
    emb = hf.get_input_embeddings()
    x = emb(torch.tensor([[0 if t >= PAD_BASE else t for t in ids]]))[0].detach().clone()
    for i, s in enumerate(spans):
        x[s.start : s.end] = embeds[i].float()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(new):
            tok = int(hf(inputs_embeds=x[None]).logits[0, -1].argmax())
            out.append(tok)
            x = torch.cat([x, emb(torch.tensor([tok]))])
    return out

"""The media encoders on a CUDA device (skipped without one): preprocessing and the towers on the GPU
equal the CPU path (fp32 within 1e-4; bf16 finite and close), fused batches equal items alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swaserve.encoder.items import EncodeItem
from swaserve.encoder.runner import MediaEncoder
from swaserve.media.image import image_num_tokens
from swaserve.media.pixels import decode_image, preprocess_images
from swaserve.media.placeholders import item_key
from swaserve.model.multimodal import MultimodalConfig
from tests.helpers.media import png, wav

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _items(tiny_dir: Path) -> list[EncodeItem]:
    from swaserve.media.audio import AudioParams, audio_num_tokens
    from swaserve.media.audio_features import decode_audio

    mm = MultimodalConfig.from_pretrained(tiny_dir)
    assert mm is not None and mm.image is not None
    out = []
    for i, (w, h) in enumerate(((70, 50), (128, 96), (40, 200))):
        data = png(w, h, i)
        out.append(
            EncodeItem(item_key("gpu", "image", {}, data), "image", data, image_num_tokens(h, w, mm.image))
        )
    data = wav(1.3)
    n = audio_num_tokens(AudioParams.from_hf(mm.processor).num_frames(int(decode_audio(data, 60).shape[0])))
    out.append(EncodeItem(item_key("gpu", "audio", {}, data), "audio", data, n))
    return out


def test_preprocessing_on_cuda_equals_cpu(tiny_dir: Path) -> None:
    mm = MultimodalConfig.from_pretrained(tiny_dir)
    assert mm is not None and mm.image is not None
    imgs = [decode_image(png(w, h, 3), 1 << 26) for w, h in ((70, 50), (300, 200))]
    cpu, gc = preprocess_images(imgs, mm.image, "cpu"), preprocess_images(imgs, mm.image, "cuda")
    assert torch.equal(cpu[1], gc[1].cpu())
    assert (cpu[0] - gc[0].cpu()).abs().max() <= 1e-4


def test_towers_on_cuda_equal_cpu_and_fused_equals_alone(tiny_dir: Path) -> None:
    items = _items(tiny_dir)
    cpu = MediaEncoder(tiny_dir, "cpu").encode(items)
    gpu = MediaEncoder(tiny_dir, "cuda")
    fused = gpu.encode(items)
    for c, g in zip(cpu, fused, strict=True):
        assert (c - g).abs().max() <= 1e-4
    for it, g in zip(items, fused, strict=True):
        assert (gpu.encode([it])[0] - g).abs().max() <= 1e-5
    bf16 = MediaEncoder(tiny_dir, "cuda", torch.bfloat16).encode(items)
    for c, b in zip(cpu, bf16, strict=True):
        assert torch.isfinite(b.float()).all() and (c - b.float()).abs().max() <= 0.1 * c.abs().max() + 0.05

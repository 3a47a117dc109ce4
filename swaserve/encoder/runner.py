"""``MediaEncoder``: a checkpoint's media towers over decoded, preprocessed items.

Items of one call are fused: every image and video grid goes through one ViT forward (attention
stays within each frame), every audio clip through one audio-encoder forward; outputs are split
back per item in order. Preprocessing (resize, normalize, patchify, the mel front end) runs in
torch on the encoder's device. Video frames are decoded in time chunks by ``video_threads``
threads (``media.video.decode_frames``, equal to a sequential decode).

An item's row count was computed before encoding from cheap metadata (``api.media``); the encoder
checks it against what the media really decodes to and refuses a mismatch (``MediaError``), so a
placeholder run and its embeddings always agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swaserve.encoder.items import EncodeItem
from swaserve.media import MediaError
from swaserve.media.audio import AudioParams
from swaserve.media.audio_features import decode_audio, log_mel
from swaserve.media.pixels import decode_image, preprocess_frames, preprocess_images
from swaserve.media.video import decode_frames
from swaserve.model.multimodal import MultimodalConfig


@dataclass(frozen=True)
class MediaLimits:
    """Bounds the encoder enforces while decoding (the front checks them from metadata first)."""

    max_source_pixels: int = 64 << 20  # decoded image area
    max_audio_seconds: float = 600.0


class MediaEncoder:
    """The towers of ``model_dir`` on ``device`` in ``dtype``.

    Raises:
        ValueError: the checkpoint has no media towers.
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        video_threads: int = 1,
        limits: MediaLimits | None = None,
    ) -> None:
        mm = MultimodalConfig.from_pretrained(model_dir)
        if mm is None:
            raise ValueError(f"{model_dir}: the checkpoint has no media towers")
        self.config = mm
        self.device, self.dtype = torch.device(device), dtype
        self.video_threads = video_threads
        self.limits = limits or MediaLimits()
        self.vit: torch.nn.Module | None = None
        if mm.vision is not None:
            self.vit = _load_vision(Path(model_dir), mm, self.device, dtype)
        self.audio: torch.nn.Module | None = None
        self.audio_params = AudioParams.from_hf(mm.processor)
        if mm.audio_config is not None:
            from swaserve.model.audio import load_audio_encoder

            self.audio = load_audio_encoder(model_dir, dtype, self.device)
        self.weights_digest = _digest(m for m in (self.vit, self.audio) if m is not None)

    @property
    def hidden_size(self) -> int:
        vision, audio = self.config.vision, self.config.audio_config
        return vision.out_hidden_size if vision is not None else int((audio or {})["out_hidden_size"])

    @torch.inference_mode()
    def encode(self, items: Sequence[EncodeItem]) -> list[torch.Tensor]:
        """Embeddings [num_tokens, hidden] of each item (on the CPU, in ``dtype``), in order.

        Raises:
            MediaError: an item that does not decode, or decodes to another row count than
                ``num_tokens``; a modality the checkpoint lacks.
        """
        out: list[torch.Tensor | None] = [None] * len(items)
        visual = [i for i, it in enumerate(items) if it.modality in ("image", "video")]
        audio = [i for i, it in enumerate(items) if it.modality == "audio"]
        if len(visual) + len(audio) != len(items):
            bad = next(it.modality for it in items if it.modality not in ("image", "video", "audio"))
            raise MediaError(f"unknown media modality {bad!r}")
        if visual:
            for i, e in zip(visual, self._visual([items[i] for i in visual], visual), strict=True):
                out[i] = e
        if audio:
            for i, e in zip(audio, self._audio([items[i] for i in audio], audio), strict=True):
                out[i] = e
        return [e for e in out if e is not None]

    def _visual(self, items: list[EncodeItem], index: list[int]) -> list[torch.Tensor]:
        mm = self.config
        if self.vit is None or mm.image is None:
            raise MediaError("this model does not take images or video")
        patches: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        for k, it in zip(index, items, strict=True):
            try:
                if it.modality == "image":
                    img = decode_image(it.data, self.limits.max_source_pixels)
                    p, g = preprocess_images([img], mm.image, self.device, [it.size])
                else:
                    if it.size is None or not it.times:
                        raise MediaError("a video item without its sampling plan")
                    frames = decode_frames(it.data, list(it.times), self.video_threads)
                    p, g = preprocess_frames(frames, it.size, mm.image, self.device)
            except MediaError as err:
                raise MediaError(f"{it.modality} {k}: {err}") from None
            rows = int(g.prod(-1).sum()) // mm.image.merge_size**2
            if rows != it.num_tokens:
                raise MediaError(
                    f"the {it.modality} decodes to {rows} tokens but its metadata gave {it.num_tokens}"
                )
            patches.append(p)
            grids.append(g)
        emb = self.vit(torch.cat(patches).to(self.dtype), torch.cat(grids))
        return [e.cpu() for e in emb.split([it.num_tokens for it in items])]

    def _audio(self, items: list[EncodeItem], index: list[int]) -> list[torch.Tensor]:
        if self.audio is None:
            raise MediaError("this model does not take audio")
        mels = []
        for k, it in zip(index, items, strict=True):
            try:
                wave = decode_audio(it.data, self.limits.max_audio_seconds)
            except MediaError as err:
                raise MediaError(f"audio {k}: {err}") from None
            mels.append(log_mel(wave, self.audio_params, self.device).to(self.dtype))
        outs = self.audio(mels)
        for it, e in zip(items, outs, strict=True):
            if e.shape[0] != it.num_tokens:
                raise MediaError(
                    f"the audio decodes to {e.shape[0]} tokens but its metadata gave {it.num_tokens}"
                )
        return [e.cpu() for e in outs]


def _digest(modules: Iterable[torch.nn.Module]) -> str:
    """BLAKE2b-128 (hex) over the towers' loaded tensors (names, dtypes, shapes, bytes): what keys
    a cache shared between encoder processes, so towers of other weights never share entries."""
    h = hashlib.blake2b(digest_size=16)
    for m in modules:
        for name, t in sorted(m.state_dict().items()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _load_vision(
    model_dir: Path, mm: MultimodalConfig, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    from safetensors import safe_open

    from swaserve.model.vision import VisionTransformer, vision_state_dict_from_hub
    from swaserve.model.vision_config import HUB_PREFIXES

    assert mm.vision is not None
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name.startswith(HUB_PREFIXES):
                    tensors[name] = fh.get_tensor(name)
    vit = VisionTransformer(mm.vision)
    vit.load_state_dict(vision_state_dict_from_hub(tensors, mm.vision), strict=True)
    return vit.to(device=device, dtype=dtype).eval().requires_grad_(False)

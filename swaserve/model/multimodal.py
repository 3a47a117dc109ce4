"""A checkpoint's multimodal side: which towers it has, their configs, the preprocessing parameters,
and the special tokens the chat template places around media.

Read from ``config.json`` (``vision_config``, ``audio_config``, the ``*_token_id`` keys) and
``processor_config.json`` when present (hub layout: vLLM
vllm/transformers_utils/configs/mimo_v2_omni.py and processors/mimo_v2_omni.py). A text-only
checkpoint has no ``MultimodalConfig`` (``from_pretrained`` returns None).

``digest``: SHA-256 over the towers' configs, the preprocessing parameters and the token ids: what
the media content keys (``media.placeholders.item_key``) and the model fingerprint include, so
two deployments that would embed the same bytes differently never share a key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swaserve.media.image import ImageParams
from swaserve.media.video import VideoParams
from swaserve.model.vision_config import HUB_PREFIXES as VISION_PREFIXES
from swaserve.model.vision_config import VisionConfig

# Special tokens of the MiMo-V2.5 chat format (processor_config ``*_token`` names).
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD, AUDIO_PAD = "<|image_pad|>", "<|video_pad|>", "<|audio_pad|>"
VIDEO_START, VIDEO_END = "<|video_start|>", "<|video_end|>"
AUDIO_START, AUDIO_END = "<|mimo_audio_start|>", "<|mimo_audio_end|>"
MEDIA_TOKENS = (
    VISION_START,
    VISION_END,
    IMAGE_PAD,
    VIDEO_PAD,
    VIDEO_START,
    VIDEO_END,
    AUDIO_START,
    AUDIO_END,
    AUDIO_PAD,
)
# config.json keys of their ids (hub ``processor_config`` / ``config`` spelling)
TOKEN_KEYS = {
    "vision_start": "vision_start_token_id",
    "vision_end": "vision_end_token_id",
    "image_pad": "image_token_id",
    "video_pad": "video_token_id",
    "video_start": "video_start_token_id",
    "video_end": "video_end_token_id",
    "audio_start": "audio_start_token_id",
    "audio_end": "audio_end_token_id",
    "audio_pad": "audio_token_id",
}
TOKEN_TEXT = dict(zip(TOKEN_KEYS, MEDIA_TOKENS, strict=True))
# weight-name prefixes of the towers (the language model's loader leaves these tensors alone)
TOWER_PREFIXES = (*VISION_PREFIXES, "speech_embeddings.", "model.speech_embeddings.", "audio_encoder.")


@dataclass(frozen=True)
class MediaTokenIds:
    """Token ids of the media markers (``TOKEN_KEYS``)."""

    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    video_start: int
    video_end: int
    audio_start: int
    audio_end: int
    audio_pad: int

    @staticmethod
    def from_config(c: dict[str, Any]) -> MediaTokenIds | None:
        """From config.json keys; None when the image ones are absent. Raises ValueError when
        only some are given."""
        have = {f: c.get(k) for f, k in TOKEN_KEYS.items()}
        if all(v is None for v in have.values()):
            return None
        missing = [TOKEN_KEYS[f] for f, v in have.items() if v is None]
        if missing:
            raise ValueError(f"config.json gives some media token ids but not {missing}")
        return MediaTokenIds(**{f: int(v) for f, v in have.items()})  # type: ignore[arg-type]

    def to_config(self) -> dict[str, int]:
        return {TOKEN_KEYS[f.name]: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class MultimodalConfig:
    """The towers and media parameters of a multimodal checkpoint.

    Attributes:
        tokens: media marker ids. vision: the ViT (None: no image/video input). image, video:
            their preprocessing. processor: the raw ``processor_config``.
    """

    tokens: MediaTokenIds
    vision: VisionConfig | None
    image: ImageParams | None
    video: VideoParams | None
    processor: dict[str, Any]
    audio_config: dict[str, Any] | None = None

    @property
    def modalities(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.vision is not None:
            out += ["image", "video"]
        if self.audio_config is not None:
            out.append("audio")
        return tuple(out)

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> MultimodalConfig | None:
        """None for a text-only checkpoint. Raises ValueError on an inconsistent config."""
        d = Path(model_dir)
        c = json.loads((d / "config.json").read_text())
        text = c.get("text_config", c)
        tokens = MediaTokenIds.from_config(c)
        if tokens is None or (c.get("vision_config") is None and c.get("audio_config") is None):
            return None
        proc_path = d / "processor_config.json"
        processor = (
            json.loads(proc_path.read_text())
            if proc_path.is_file()
            else dict(c.get("processor_config") or {})
        )
        hidden = int(text["hidden_size"])
        vc = c.get("vision_config")
        vision = VisionConfig.from_hf(vc, hidden) if vc is not None else None
        image = ImageParams.from_hf(processor, vc) if vc is not None else None
        video = None
        if vision is not None:
            video = VideoParams.from_hf(
                processor,
                patch_size=vision.patch_size,
                merge_size=vision.spatial_merge_size,
                temporal_patch_size=vision.temporal_patch_size,
            )
        return MultimodalConfig(tokens, vision, image, video, processor, c.get("audio_config"))

    def digest(self) -> str:
        """SHA-256 (hex) of everything here that changes an item's embeddings or its tokens."""
        blob = {
            "tokens": self.tokens.to_config(),
            "vision": None if self.vision is None else self.vision.to_hf(),
            "image": None if self.image is None else dataclasses.asdict(self.image),
            "video": None if self.video is None else dataclasses.asdict(self.video),
            "processor": self.processor,
            "audio": self.audio_config,
        }
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def media_digest(model_dir: str | Path) -> str | None:
    """``MultimodalConfig.digest()`` of a checkpoint, None when it is text only."""
    mm = MultimodalConfig.from_pretrained(model_dir)
    return None if mm is None else mm.digest()

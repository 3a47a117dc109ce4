"""Small random media towers for generated checkpoints: a vision tower and an audio encoder with
the real layouts at widths a CPU runs in milliseconds, written in the hub layout with the media
token ids and a ``processor_config.json`` of small limits (``write_media_towers``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from swaserve.model.multimodal import TOKEN_TEXT


def _tiny_towers(hidden: int) -> tuple[Any, Any]:
    """(VisionConfig, AudioConfig) of the small random towers: the real layouts (GQA, row and
    column windows with sinks, a full block at each end; hybrid-window audio tokenizer with a skip,
    RVQ, bidirectional local transformer) at widths a CPU runs in milliseconds."""
    from swaserve.model.audio import AudioConfig
    from swaserve.model.audio_tokenizer import AudioTokenizerConfig
    from swaserve.model.vision_config import VisionConfig

    vision = VisionConfig(
        depth=4,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        out_hidden_size=hidden,
        window_types=(-1, 0, 1, -1),
        window_size=8,
        use_sink=True,
    )
    tok = AudioTokenizerConfig(
        n_mels=128,
        d_model=32,
        avg_pooler=2,
        encoder_layers=4,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        encoder_skip_layer_id=2,
        encoder_attn_window_size=(8, 8),
        hybrid_attention=True,
        swa_per_block=2,
        num_quantizers=4,
        codebook_size=(16, 16, 8, 8),
    )
    audio = AudioConfig(
        speech_vocab_size=(17, 17, 9, 9),
        speech_zeroemb_idx=(16, 16, 8, 8),
        audio_channels=4,
        input_local_layers=2,
        input_local_dim=32,
        input_local_attn_heads=4,
        input_local_head_dim=8,
        input_local_intermediate_size=64,
        out_hidden_size=hidden,
        partial_rotary_factor=1.0,
        projection_layers=2,
        tokenizer=tok,
    )
    return vision, audio


# Small media limits for CPU checkpoints: <= 64 tokens per image or frame pair, <= 16 frames.
TINY_PROCESSOR = {
    "image_min_pixels": 4 * 32 * 32,
    "image_max_pixels": 64 * 32 * 32,
    "video_min_pixels": 4 * 32 * 32,
    "video_max_pixels": 16 * 32 * 32,
    "video_total_max_pixels": 128 * 32 * 32,
    "fps": 2.0,
    "min_frames": 2,
    "max_frames": 16,
}


def write_media_towers(model_dir: Path, seed: int) -> None:
    """Add random vision (``visual.*`` in ``visual.safetensors``) and audio towers
    (``speech_embeddings.*``/``audio_encoder.*`` in ``audio.safetensors``, the tokenizer in
    ``audio_tokenizer/``) in the hub layout, the media token ids in config.json and a
    ``processor_config.json`` (``TINY_PROCESSOR``)."""
    from tokenizers import Tokenizer

    from swaserve.model.audio import random_audio_weights
    from swaserve.model.multimodal import TOKEN_KEYS
    from swaserve.model.vision import random_vision_weights

    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    vision, audio = _tiny_towers(int(raw["hidden_size"]))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for field_name, key in TOKEN_KEYS.items():
        tid = tok.token_to_id(TOKEN_TEXT[field_name])
        if tid is None:
            raise RuntimeError(f"the tokenizer has no {TOKEN_TEXT[field_name]}")
        raw[key] = tid
    raw["vision_config"] = vision.to_hf()
    audio_cfg, tok_cfg = audio.to_hf()
    raw["audio_config"] = audio_cfg
    visual = {f"visual.{k}": v.contiguous() for k, v in random_vision_weights(vision, seed + 2).items()}
    main, tok_tensors = random_audio_weights(audio, seed + 3)
    save_file(visual, str(model_dir / "visual.safetensors"), metadata={"format": "pt"})
    save_file(main, str(model_dir / "audio.safetensors"), metadata={"format": "pt"})
    (model_dir / "audio_tokenizer").mkdir(exist_ok=True)
    save_file(
        tok_tensors, str(model_dir / "audio_tokenizer" / "model.safetensors"), metadata={"format": "pt"}
    )
    (model_dir / "audio_tokenizer" / "config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx["weight_map"].update({k: "visual.safetensors" for k in visual})
        idx["weight_map"].update({k: "audio.safetensors" for k in main})
        index.write_text(json.dumps(idx, indent=2))
    (model_dir / "processor_config.json").write_text(json.dumps(TINY_PROCESSOR, indent=2) + "\n")
    cfg_path.write_text(json.dumps(raw, indent=2) + "\n")

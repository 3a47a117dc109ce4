"""Random MiMo-V2 checkpoints for tests, demos and benchmarks.

``make_checkpoint`` builds a random ``MiMoV2FlashForCausalLM`` with transformers' own classes
(``save_pretrained``: the hub's key layout) and a byte-level BPE tokenizer trained on ``data/corpus``
with a ChatML template; every detail that changes logits is non-trivial on purpose. ``to_hub_style``
rewrites config.json in the hub's spelling; ``quantize_fp8`` writes the hub's block-wise FP8 format.

Design notes: docs/DESIGN.md#modelcheckpointpy"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swaserve.model.multimodal import MEDIA_TOKENS, TOKEN_TEXT
from swaserve.model.train import DistillConfig, PretrainConfig, corpus_prompts, distill, pretrain

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# trained first, so their ids are 0, 1, 2, then the media markers 3 .. 11
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, *MEDIA_TOKENS)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
CHECKPOINT_VERSION = 2  # bump when the generated weights or tokenizer change
CORPUS_PATH = Path(__file__).resolve().parents[2] / "data" / "corpus" / "agent_messages.jsonl"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# Weights that the hub's FP8 checkpoints store as float8: attention projections, dense MLP, experts.
_FP8_WEIGHT = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")

# ChatML with system/user/assistant/tool roles, OpenAI content parts, tool definitions and tool calls.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- text(messages[0]['content']) + '\\n\\n' -}}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    '{{- \'You can call these tools. To call one, write <tool_call>{"name": NAME, "arguments": ARGS}'
    "</tool_call>.\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.first:] -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) -}}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{- '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + args + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Preset:
    """Shape of one random checkpoint; ``config`` goes straight into ``MiMoV2FlashConfig``."""

    config: dict[str, Any]
    partial_rotary_factor: float = 0.334
    full_rope_theta: float = 5_000_000.0
    swa_rope_theta: float = 10_000.0
    # Init scales: weight std = gain / sqrt(fan_in); embeddings ~ N(0, embed_std).
    gain: float = 1.0
    lm_head_gain: float = 3.0
    embed_std: float = 1.0
    # Short CPU training after the random init (``model.train``; None: the random model as is)
    # and the version of the cached checkpoint's directory name (bump when the weights change).
    train: TrainPlan | None = None
    version: int = CHECKPOINT_VERSION


@dataclass(frozen=True)
class TrainPlan:
    """Target pretraining, then ``mtp_layers`` MTP layers self-distilled (``swaserve.model.train``)."""

    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    mtp_layers: int = 3
    distill: DistillConfig = field(default_factory=DistillConfig)


_COMMON: dict[str, Any] = {
    "num_attention_heads": 4,
    "num_key_value_heads": 1,  # transformers gives SWA layers 2x this
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "attention_value_scale": 0.707,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, Preset] = {
    # 8 layers: transformers' default layer_types makes layers 0 and 5 full attention, the rest SWA.
    "tiny": Preset(
        config=_COMMON
        | {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_hidden_layers": 8,
            "head_dim": 32,
            "v_head_dim": 16,
            "intermediate_size": 128,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "sliding_window": 9,
            "max_position_embeddings": 4096,
        },
    ),
    # 12 layers: layers 0, 5, 11 full attention. head_dim 64 x 0.334 would give an odd rotary dim,
    # so this preset uses 11/32 (22 rotary dims), close to the real model's one third.
    "default": Preset(
        config=_COMMON
        | {
            "vocab_size": 4096,
            "hidden_size": 256,
            "num_hidden_layers": 12,
            "head_dim": 64,
            "v_head_dim": 48,
            "intermediate_size": 512,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 128,
            "sliding_window": 129,
            "max_position_embeddings": 32768,
        },
        partial_rotary_factor=11 / 32,
        # a tiny language model (repetitive, text-like greedy output) with 3 self-distilled MTP
        # layers: what speculative decoding needs to be worth it (docs/BENCHMARKS.md#mtp-speculative-decoding-swaserve-bench-mtp)
        train=TrainPlan(),
        version=3,
    ),
}


def mimo_config(preset: str) -> Any:
    """The ``MiMoV2FlashConfig`` of a preset, with the tokenizer's special token ids.

    Raises:
        KeyError: unknown preset name.
    """
    from transformers import MiMoV2FlashConfig

    p = PRESETS[preset]
    rope = {
        kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": p.partial_rotary_factor}
        for kind, theta in (("full_attention", p.full_rope_theta), ("sliding_attention", p.swa_rope_theta))
    }
    return MiMoV2FlashConfig(
        **p.config,
        rope_parameters=rope,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
    )


def build_model(preset: str, seed: int = 0) -> Any:
    """A randomly initialised ``MiMoV2FlashForCausalLM`` (float32, eval mode), deterministic in seed."""
    from transformers import MiMoV2FlashForCausalLM

    p = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG state alone
        torch.manual_seed(seed)
        model = MiMoV2FlashForCausalLM(mimo_config(preset)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda kv: kv[0]):
            if "rotary_emb" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                t.normal_(0.0, p.embed_std, generator=g)
            elif name.endswith("lm_head.weight"):
                t.normal_(0.0, p.lm_head_gain / math.sqrt(t.shape[-1]), generator=g)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                t.uniform_(0.5, 1.5, generator=g)  # RMSNorm weights that are not all ones
            elif name.endswith("self_attn.sinks"):
                t.normal_(0.0, 1.0, generator=g)
            elif name.endswith("e_score_correction_bias"):
                t.uniform_(-0.1, 0.1, generator=g)
            elif t.dim() >= 2:  # linear weights [out, in] and fused experts [E, out, in]
                t.normal_(0.0, p.gain / math.sqrt(t.shape[-1]), generator=g)
            else:
                raise AssertionError(f"build_model: no init rule for {name} {tuple(t.shape)}")
    return model


def train_tokenizer(vocab_size: int, corpus: Path = CORPUS_PATH) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on the committed corpus (deterministic).

    Raises:
        FileNotFoundError: the corpus file is missing (swaserve must run from a source checkout).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not corpus.is_file():
        raise FileNotFoundError(f"tokenizer corpus {corpus} not found (run from a swaserve source checkout)")
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["content"] for line in f]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens did not get ids 0 .. {len(SPECIAL_TOKENS) - 1}")
    return tok


def write_tokenizer(tok: Any, out_dir: Path, model_max_length: int) -> None:
    """Save ``tokenizer.json`` and a ``tokenizer_config.json`` that ``AutoTokenizer`` loads."""
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END, *MEDIA_TOKENS],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def make_checkpoint(
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    overwrite: bool = False,
    mtp_layers: int = 0,
    train: bool = True,
    media: bool = True,
) -> Path:
    """Write a random MiMo-V2 checkpoint (weights, config, generation config, tokenizer).

    Args:
        preset: "tiny" (tests) or "default" (demo server).
        out_dir: Target directory; built in a temp dir next to it, then renamed into place.
        seed: RNG seed; the same preset and seed give byte-identical weights.
        overwrite: Replace an existing non-empty ``out_dir``.
        mtp_layers: MTP layers to add (hub keys ``model.mtp.layers.N.*`` in
            ``mtp.safetensors``, ``num_nextn_predict_layers`` in config.json): random, the
            target's weights the same as without them; with a trained preset, self-distilled
            (0: the preset's own count).
        train: run the preset's ``TrainPlan`` (``default``: a few CPU minutes); False: the
            random model only.
        media: add small random vision and audio towers (``write_media_towers``): the model
            takes images, video and audio.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: unknown preset.
        FileExistsError: ``out_dir`` is a non-empty directory and ``overwrite`` is False.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    plan = PRESETS[preset].train if train else None
    with _atomic_dir(out, overwrite) as tmp:
        model = build_model(preset, seed)
        model.save_pretrained(tmp)
        write_tokenizer(train_tokenizer(model.config.vocab_size), tmp, model.config.max_position_embeddings)
        if media:
            write_media_towers(tmp, seed)
        if plan is not None:
            train_checkpoint(tmp, preset, plan, seed, mtp_layers or plan.mtp_layers)
        elif mtp_layers:
            write_mtp_layers(tmp, preset, mtp_layers, seed)
    return out


def train_checkpoint(model_dir: Path, preset: str, plan: TrainPlan, seed: int, mtp_layers: int) -> None:
    """Pretrain the target in ``model_dir`` and self-distil ``mtp_layers`` MTP layers for it
    (``swaserve.model.train``), writing the weights back; the losses, held-out accuracies and
    accept length go to ``training.json`` beside them."""
    from tokenizers import Tokenizer

    from swaserve.model.loader import load_model, save_weights

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    report: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_model(model_dir)
        pc = plan.pretrain
        windows = corpus_prompts(tok, CORPUS_PATH, pc.windows, pc.tokens + 1, pc.seed + seed)
        report["pretrain"] = {"config": asdict(pc), "loss_every_10_steps": pretrain(model, windows, pc)}
        save_weights(model, model_dir)
        if mtp_layers:
            write_mtp_layers(model_dir, preset, mtp_layers, seed)
            model = load_model(model_dir)
            dc = plan.distill
            prompts = corpus_prompts(tok, CORPUS_PATH, dc.sequences, dc.prompt_tokens, dc.seed + seed + 1)
            report["distill"] = asdict(distill(model, prompts, dc))
            save_weights(model, model_dir)
    (model_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")


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


def write_mtp_layers(model_dir: Path, preset: str, n: int, seed: int) -> None:
    """Add ``n`` random MTP layers to the checkpoint in ``model_dir`` (hub key layout: separate
    q/k/v projections, ``attention_sink_bias``, ``pre_mlp_layernorm``), initialised as
    ``build_model`` initialises the target, from their own generator (seed + 1)."""
    from safetensors.torch import save_file

    from swaserve.config import ModelConfig
    from swaserve.model.mtp import HUB_RENAMES, MTPLayer

    cfg_path = model_dir / "config.json"
    raw_cfg = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_dict(raw_cfg)
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(seed + 1)
    hub = {v: k for k, v in HUB_RENAMES.items()}
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n):
        layer = MTPLayer(cfg)
        with torch.no_grad():
            for name, t in sorted(layer.named_parameters()):
                if name.endswith("norm.weight"):
                    t.uniform_(0.5, 1.5, generator=g)
                elif name.endswith("attention_sink_bias"):
                    t.normal_(0.0, 1.0, generator=g)
                else:
                    t.normal_(0.0, p.gain / math.sqrt(t.shape[-1]), generator=g)
                tensors[f"model.mtp.layers.{i}.{hub.get(name, name)}"] = t.detach().clone().contiguous()
    save_file(tensors, str(model_dir / "mtp.safetensors"), metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index must name the new file's tensors
        idx = json.loads(index.read_text())
        idx["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(idx, indent=2))
    raw_cfg["num_nextn_predict_layers"] = n
    cfg_path.write_text(json.dumps(raw_cfg, indent=2) + "\n")


def cache_dir() -> Path:
    """``$SWASERVE_CACHE`` if set, else ``~/.cache/swaserve``."""
    env = os.environ.get("SWASERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "swaserve"


def _build_once(target: Path, build: Callable[[], object]) -> Path:
    """``target`` (a directory with a config.json), made by ``build`` unless it exists, once
    across processes (an fcntl lock beside it)."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (target / "config.json").is_file():
                log.warning(
                    "building %s on first use (cached at %s; minutes for a trained preset)",
                    target.name,
                    target,
                )
                build()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def cached_model_dir(preset: str) -> Path:
    """The preset (seed 0) under ``<cache>/models``, created once under an fcntl lock."""
    target = cache_dir() / "models" / f"mimo-v2-{preset}-v{PRESETS[preset].version}"
    return _build_once(target, lambda: make_checkpoint(preset, target, seed=0, overwrite=True))


def tokenizer_dir(preset: str) -> Path:
    """The preset's config.json and tokenizer only, under ``<cache>/models`` (built once, in
    seconds): for readers that need the tokenizer or the shape, not the weights (the agent-trace
    tokenizer, the simulator's model config), so they never wait for a trained preset."""
    target = cache_dir() / "models" / f"mimo-v2-{preset}-tokenizer-v{CHECKPOINT_VERSION}"

    def build() -> None:
        with _atomic_dir(target, True) as tmp:
            config = mimo_config(preset)
            config.save_pretrained(tmp)
            write_tokenizer(train_tokenizer(config.vocab_size), tmp, config.max_position_embeddings)

    return _build_once(target, build)


def default_model_dir() -> Path:
    """The cached ``default`` preset checkpoint (built on first use)."""
    return cached_model_dir("default")


def tiny_model_dir() -> Path:
    """The cached ``tiny`` preset checkpoint (built on first use)."""
    return cached_model_dir("tiny")


def to_hub_style(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Copy a transformers-style checkpoint, rewriting config.json with XiaomiMiMo hub keys.

    Weights and tokenizer files are copied unchanged (the weight key layout is already the hub's).

    Raises:
        ValueError: the source config is not in transformers style.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    c = json.loads((src / "config.json").read_text())
    if "layer_types" not in c or "rope_parameters" not in c:
        raise ValueError(f"{src}/config.json is not a transformers-style MiMo-V2 config")
    full, swa = c["rope_parameters"]["full_attention"], c["rope_parameters"]["sliding_attention"]
    if full.get("partial_rotary_factor") != swa.get("partial_rotary_factor"):
        raise ValueError("hub configs have one partial_rotary_factor for both attention kinds")
    hub = {
        k: v
        for k, v in c.items()
        if k not in ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window", "rms_norm_eps")
    }
    hub.update(
        hybrid_layer_pattern=[0 if t == "full_attention" else 1 for t in c["layer_types"]],
        moe_layer_freq=[1 if t == "sparse" else 0 for t in c["mlp_layer_types"]],
        rope_theta=full["rope_theta"],
        swa_rope_theta=swa["rope_theta"],
        partial_rotary_factor=full["partial_rotary_factor"],
        sliding_window_size=c["sliding_window"] - 1,
        layernorm_epsilon=c["rms_norm_eps"],
        swa_num_attention_heads=c["num_attention_heads"],
        swa_num_key_value_heads=2 * c["num_key_value_heads"],
        swa_head_dim=c["head_dim"],
        swa_v_head_dim=c["v_head_dim"],
        add_full_attention_sink_bias=False,
        add_swa_attention_sink_bias=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    with _atomic_dir(dst, overwrite=False) as tmp:
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(dict(sorted(hub.items())), indent=2) + "\n")
    return dst


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir (``model.safetensors`` or sharded with an index), on CPU."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[k] = f.get_tensor(k)
    return out


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 e4m3 quantization of one 2-D weight.

    Args:
        w: [out, in] float weight.
        block: (bm, bn) block shape; edge blocks may be smaller.

    Returns:
        (q, scale_inv): q is [out, in] torch.float8_e4m3fn; scale_inv is float32
        [ceil(out/bm), ceil(in/bn)] with ``w ~= q.float() * scale_inv`` expanded per block, where
        scale_inv = block absmax / 448.
    """
    bm, bn = block
    rows, cols = w.shape
    nr, nc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(nr * bm, nc * bn, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, bm, nc, bn)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nr * bm, nc * bn)
    return q[:rows, :cols].contiguous().to(torch.float8_e4m3fn), scale_inv.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Inverse of ``quantize_fp8_block``: [out, in] float32 = q.float() * scale_inv per block."""
    bm, bn = block
    rows, cols = q.shape
    scale = scale_inv.float().repeat_interleave(bm, dim=0).repeat_interleave(bn, dim=1)
    return q.float() * scale[:rows, :cols]


def dequantize_fp8_state_dict(sd: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Replace every FP8 weight + ``<name>_scale_inv`` pair by its float32 dequantization."""
    out: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if k.endswith("_scale_inv"):
            continue
        out[k] = dequantize_fp8_block(t, sd[k + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t
    return out


def is_fp8_weight(name: str) -> bool:
    """Whether the hub FP8 format stores this tensor as float8 (with a ``_scale_inv``)."""
    return _FP8_WEIGHT.search(name) is not None


def quantize_fp8(
    src_dir: str | Path, dst_dir: str | Path, block: tuple[int, int] = (128, 128), *, num_shards: int = 2
) -> Path:
    """Convert a checkpoint to hub-style block FP8, written as ``num_shards`` shards with an index.

    Projection weights (see ``is_fp8_weight``) become float8_e4m3fn plus float32 ``<name>_scale_inv``
    [ceil(out/bm), ceil(in/bn)]; everything else keeps its dtype. config.json gains
    ``quantization_config``; tokenizer and generation config are copied.

    Raises:
        ValueError: ``num_shards`` < 1 or the source is already quantized.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    config = json.loads((src / "config.json").read_text())
    if num_shards < 1 or "quantization_config" in config:
        raise ValueError("quantize_fp8 needs num_shards >= 1 and an unquantized source")
    sd = load_state_dict(src)
    tensors: dict[str, torch.Tensor] = {}
    for k in sorted(sd):
        if is_fp8_weight(k):
            tensors[k], tensors[k + "_scale_inv"] = quantize_fp8_block(sd[k], block)
        else:
            tensors[k] = sd[k].contiguous()
    n_layers = int(config.get("num_hidden_layers", 1))
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for k, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.", k)
        i = (
            min(int(m.group(1)) * num_shards // n_layers, num_shards - 1)
            if m
            else (0 if "embed_tokens" in k else num_shards - 1)
        )
        shards[i][k] = t
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    with _atomic_dir(dst, overwrite=False) as tmp:
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
    return dst


@contextmanager
def _atomic_dir(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temp dir next to ``out``; on success rename it to ``out``, else delete it."""

    def occupied() -> bool:
        return out.exists() and (not out.is_dir() or any(out.iterdir()))

    if occupied() and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if occupied():
            if not overwrite:
                raise FileExistsError(f"{out} appeared while it was being built")
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        elif out.exists():
            out.rmdir()
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)

"""Random MiMo-V2 checkpoints for tests, demos and benchmarks.

``make_checkpoint`` builds a random ``MiMoV2FlashForCausalLM`` with transformers' own classes
(``save_pretrained``: the hub's key layout) and a byte-level BPE tokenizer trained on ``data/corpus``
with a ChatML template; every detail that changes logits is non-trivial on purpose. The hub's
config spelling and block-wise FP8 format are ``model.hub_format``'s.

Design notes: docs/DESIGN.md#modelcheckpointpy"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swaserve.model.multimodal import MEDIA_TOKENS
from swaserve.model.tiny_towers import write_media_towers
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

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
        version=4,
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
    with atomic_dir(out, overwrite) as tmp:
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


def write_mtp_layers(model_dir: Path, preset: str, n: int, seed: int) -> None:
    """Add ``n`` random MTP layers to the checkpoint in ``model_dir`` (hub key layout: separate
    q/k/v projections, ``attention_sink_bias``, ``pre_mlp_layernorm``), initialised as
    ``build_model`` initialises the target, from their own generator (seed + 1)."""

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
        with atomic_dir(target, True) as tmp:
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


@contextmanager
def atomic_dir(out: Path, overwrite: bool) -> Iterator[Path]:
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

"""The MiMo-V2.5 audio encoder: log-mel -> RVQ codes -> LLM input embeddings.

Sources: vLLM vllm/model_executor/models/mimo_audio.py (``MimoAudioEncoder``, "ported from
SGLang") and mimo_v2_omni.py (weight names), the Xiaomi-authored SGLang fork Abatom/sglang
python/sglang/srt/models/mimo_audio.py. Per item::

    mel [T, n_mels] -> TokenizerEncoder (audio_tokenizer.py)        codes [n, C]   (25 Hz)
      pre-tokenized codes [n, n_vq >= C] enter here (first C channels)
      -> pad n to a multiple of group_size by repeating the last code -> [G, group_size, C]
      -> sum_c speech_embeddings[c](codes[..., c])                    [G, group_size, dim]
      -> input_local_transformer: Qwen2 layers over each group of group_size codes, bidirectional
         (``is_causal = not input_full_attention``), final RMSNorm only if add_post_norm
      -> reshape [G, group_size * dim] -> projection                  [G, out_hidden_size]

Groups are independent, so items of many requests fuse into one forward by concatenating groups.

Choices where the sources are silent or disagree:

* The local transformer rotates the whole head: both ports build transformers' ``Qwen2Model``
  with ``partial_rotary_factor``, which transformers 5.x ignores (4.x would fail on a factor < 1);
  an sglang-jax MiMo-V2.5 port (python/sgl_jax/srt/multimodal/models/mimo_v2_5/) requires 1.0.
  The factor is recorded, not applied.
* Head dim is ``input_local_dim / input_local_attn_heads`` (what ``Qwen2Model`` derives);
  ``input_local_head_dim`` is recorded, not applied.
* ``speech_zeroemb_idx`` is the embeddings' ``padding_idx`` in the ports, which only matters for
  training; it is recorded, not applied.

Hub layout (vLLM ``hf_to_vllm_mapper``; the sglang-jax port's notes and a third-party Rust loader
list the same 95 names for the released checkpoint): ``speech_embeddings.N.weight``,
``audio_encoder.input_local_transformer.*`` (Qwen2Model names),
``audio_encoder.projection.*`` in the main checkpoint; the tokenizer in ``audio_tokenizer/``
(its own config.json and model.safetensors, ``encoder.*`` keys). ``audio_tokenizer.*`` keys of the
main checkpoint are skipped, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from swaserve.config import ConfigError
from swaserve.model.audio_tokenizer import (
    AudioTokenizerConfig,
    TokenizerEncoder,
    init_tokenizer_weights,
    num_codes,
    parse_int_list,
)
from swaserve.model.layers import DenseMLP, PartialRope, RMSNorm
from swaserve.model.meta import on_meta

RMS_EPS = 1e-6  # Qwen2Config's default rms_norm_eps; the ports do not set it


class AudioWeightsError(ValueError):
    """Audio weights that do not match the config: the message names missing, unexpected and
    mis-shaped tensors."""


@dataclass(frozen=True)
class AudioConfig:
    """The audio encoder's config: the hub ``config.json`` ``audio_config`` keys (defaults from
    vLLM mimo_audio.py ``MimoAudioEncoderConfig``) plus the tokenizer's own config.

    Attributes:
        speech_vocab_size: embedding rows per code channel ("a-b-..." or one value for all).
        speech_zeroemb_idx: per channel padding id (recorded; module docstring).
        group_size: codes per LLM token (``group_size``).
        audio_channels: code channels used, C (``audio_channels``).
        input_local_layers / input_local_dim / input_local_attn_heads /
            input_local_intermediate_size: the local transformer's depth, width, heads, MLP width.
        input_local_head_dim: recorded (module docstring).
        input_full_attention: bidirectional local attention (``input_full_attention``).
        input_local_hidden_dropout: training only (recorded).
        out_hidden_size: output width, the LLM hidden size (``out_hidden_size``).
        rope_theta: local transformer RoPE base (``rope_theta``).
        partial_rotary_factor: recorded (module docstring).
        projection_layers: 1 = Linear(group_size * dim -> out), 2 = Linear -> GELU -> Linear with
            a 4x wider middle, both bias-free (``projection_layers``).
        add_post_norm: final RMSNorm in the local transformer (``add_post_norm``).
        audio_segment_size: mel frames per independently tokenized segment (``audio_segment_size``).
        tokenizer: ``audio_tokenizer/config.json``.
    """

    speech_vocab_size: tuple[int, ...] = (1025, 1025, 129, 129, 129, 129, 129, 129)
    speech_zeroemb_idx: tuple[int, ...] = (1024, 1024, 128, 128, 128, 128, 128, 128)
    group_size: int = 4
    audio_channels: int = 8
    input_local_layers: int = 6
    input_local_dim: int = 1024
    input_full_attention: bool = True
    input_local_attn_heads: int = 64
    input_local_head_dim: int = 16
    input_local_intermediate_size: int = 4096
    input_local_hidden_dropout: float = 0.0
    out_hidden_size: int = 4096
    rope_theta: float = 640000.0
    partial_rotary_factor: float = 0.334
    projection_layers: int = 1
    add_post_norm: bool = False
    audio_segment_size: int = 6000
    tokenizer: AudioTokenizerConfig = dataclasses.field(default_factory=AudioTokenizerConfig)

    def __post_init__(self) -> None:
        c = self.audio_channels
        if len(self.speech_vocab_size) != c or len(self.speech_zeroemb_idx) != c:
            raise ConfigError(f"speech_vocab_size and speech_zeroemb_idx need {c} entries")
        if self.input_local_dim % self.input_local_attn_heads or (self.local_head_dim % 2):
            raise ConfigError("input_local_dim / input_local_attn_heads must be an even integer")
        if self.projection_layers not in (1, 2):
            raise ConfigError(f"projection_layers must be 1 or 2, got {self.projection_layers}")
        if min(self.group_size, self.audio_segment_size, c) < 1:
            raise ConfigError("group_size, audio_segment_size and audio_channels must be >= 1")
        if self.tokenizer.num_quantizers < c:
            raise ConfigError(f"the tokenizer has {self.tokenizer.num_quantizers} RVQ levels < {c} channels")

    @property
    def local_head_dim(self) -> int:
        return self.input_local_dim // self.input_local_attn_heads

    @classmethod
    def from_hf(cls, audio_config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]) -> AudioConfig:
        """From ``config.json["audio_config"]`` and ``audio_tokenizer/config.json``; absent keys
        take the defaults, unknown keys are ignored."""
        kw: dict[str, Any] = {}
        fields = dataclasses.fields(cls)
        for f in fields:
            default = f.default
            if isinstance(default, (bool, int, float)):  # bool first: it is an int too
                cast = bool if isinstance(default, bool) else type(default)
                kw[f.name] = cast(audio_config.get(f.name, default))
        for f in fields:
            if isinstance(f.default, tuple):
                value = audio_config.get(f.name, f.default)
                kw[f.name] = parse_int_list(value, kw["audio_channels"], f.name)
        return cls(**kw, tokenizer=AudioTokenizerConfig.from_hf(tokenizer_config))

    def to_hf(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(audio_config, tokenizer config) with the keys ``from_hf`` reads."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokenizer"}
        for f in ("speech_vocab_size", "speech_zeroemb_idx"):
            out[f] = "-".join(str(v) for v in out[f])
        return out, self.tokenizer.to_hf()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> AudioConfig:
        """From a checkpoint directory (``config.json`` and ``audio_tokenizer/config.json``).

        Raises:
            ConfigError: no ``audio_config`` or no tokenizer config.
        """
        root = Path(model_dir)
        main = json.loads((root / "config.json").read_text())
        tok = root / "audio_tokenizer" / "config.json"
        if not main.get("audio_config") or not tok.is_file():
            raise ConfigError(f"{root}: no audio_config or no audio_tokenizer/config.json")
        return cls.from_hf(main["audio_config"], json.loads(tok.read_text()))

    def num_codes(self, num_mel_frames: int) -> int:
        """Codes the tokenizer makes from ``num_mel_frames`` frames (per segment, summed)."""
        return num_codes(self.tokenizer, num_mel_frames, self.audio_segment_size) if num_mel_frames else 0

    def num_tokens(self, num_mel_frames: int) -> int:
        """Output rows (LLM tokens) for ``num_mel_frames`` mel frames."""
        return -(-self.num_codes(num_mel_frames) // self.group_size)


class _LocalAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=True)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.o_proj = nn.Linear(dim, dim, bias=False)


class _LocalLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        dim = cfg.input_local_dim
        self.causal = not cfg.input_full_attention
        self.input_layernorm = RMSNorm(dim, RMS_EPS)
        self.self_attn = _LocalAttention(dim, cfg.input_local_attn_heads)
        self.post_attention_layernorm = RMSNorm(dim, RMS_EPS)
        self.mlp = DenseMLP(dim, cfg.input_local_intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        g, s, dim = x.shape
        a = self.self_attn
        h = self.input_layernorm(x)
        q = PartialRope.rotate(a.q_proj(h).view(g, s, a.heads, -1), cos, sin)
        k = PartialRope.rotate(a.k_proj(h).view(g, s, a.heads, -1), cos, sin)
        v = a.v_proj(h).view(g, s, a.heads, -1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal
        )
        x = x + a.o_proj(o.transpose(1, 2).reshape(g, s, dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class LocalTransformer(nn.Module):
    """transformers ``Qwen2Model`` semantics on ``inputs_embeds`` (q/k/v biases, full-head NeoX
    RoPE, SwiGLU, fp32 RMSNorm), bidirectional unless ``input_full_attention`` is false.
    Parameter names follow Qwen2Model's; no ``embed_tokens``; ``norm`` only with add_post_norm."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_LocalLayer(cfg) for _ in range(cfg.input_local_layers))
        self.norm = RMSNorm(cfg.input_local_dim, RMS_EPS) if cfg.add_post_norm else None
        self.rope = PartialRope(cfg.local_head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [G, S, dim] (G independent sequences of S codes) -> [G, S, dim]."""
        cos, sin = self.rope.cos_sin(torch.arange(x.shape[1], device=x.device), x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) if self.norm is not None else x


class _MLPProjection(nn.Module):
    def __init__(self, d_in: int, d_mid: int, d_out: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(d_in, d_mid, bias=False), nn.GELU(), nn.Linear(d_mid, d_out, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class AudioEncoder(nn.Module):
    """Log-mels or RVQ codes of many items -> one embedding per LLM audio token, per item.

    Pure torch on any device, fp32 or bf16 (``.to(dtype)``); RVQ distances are always fp32.
    """

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        for i, (book, vocab) in enumerate(
            zip(cfg.tokenizer.codebook_size, cfg.speech_vocab_size, strict=False)
        ):
            if book > vocab:  # the tokenizer's codes would overflow the embedding
                raise ConfigError(f"code channel {i}: codebook size {book} > speech_vocab_size {vocab}")
        self.cfg = cfg
        dim = cfg.input_local_dim
        self.tokenizer = TokenizerEncoder(cfg.tokenizer, cfg.audio_channels)
        self.speech_embeddings = nn.ModuleList(nn.Embedding(v, dim) for v in cfg.speech_vocab_size)
        self.input_local_transformer = LocalTransformer(cfg)
        d_in = dim * cfg.group_size
        self.projection: nn.Module = (
            nn.Linear(d_in, cfg.out_hidden_size, bias=False)
            if cfg.projection_layers == 1
            else _MLPProjection(d_in, 4 * d_in, cfg.out_hidden_size)
        )

    def tokenize(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mels [T_i, n_mels] -> codes int64 [cfg.num_codes(T_i), audio_channels] per item."""
        return self.tokenizer(mels, self.cfg.audio_segment_size)

    def encode_codes(self, codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Codes [T_i >= 1, n_vq >= audio_channels] (integer; the first audio_channels are used)
        -> embeddings [ceil(T_i / group_size), out_hidden_size] per item, in the module's dtype.

        Raises:
            ValueError: wrong shape or dtype, or a code outside its channel's vocabulary.
        """
        if not codes:
            return []
        cfg, c = self.cfg, self.cfg.audio_channels
        emb0 = next(self.speech_embeddings.parameters())
        groups, counts = [], []
        for item in codes:
            if item.dim() != 2 or item.shape[0] < 1 or item.shape[1] < c:
                raise ValueError(f"codes must be [T >= 1, n_vq >= {c}], got {tuple(item.shape)}")
            if item.dtype.is_floating_point or item.dtype.is_complex or item.dtype == torch.bool:
                raise ValueError(f"codes must be integers, got {item.dtype}")
            x = item[:, :c].to(device=emb0.device, dtype=torch.long)
            pad = -x.shape[0] % cfg.group_size
            x = torch.cat([x, x[-1:].expand(pad, c)])
            groups.append(x.view(-1, cfg.group_size, c))
            counts.append(groups[-1].shape[0])
        grouped = torch.cat(groups)  # [G, group_size, C]
        vocab = torch.tensor(cfg.speech_vocab_size, device=grouped.device)
        bad = (grouped < 0) | (grouped >= vocab)
        if bool(bad.any()):
            ch = int(bad.nonzero()[0, 2])
            raise ValueError(f"code channel {ch}: values must be in [0, {cfg.speech_vocab_size[ch]})")
        h = torch.zeros(*grouped.shape[:2], cfg.input_local_dim, dtype=emb0.dtype, device=emb0.device)
        for i, emb in enumerate(self.speech_embeddings):
            h.add_(emb(grouped[..., i]))
        h = self.input_local_transformer(h)
        out = self.projection(h.reshape(h.shape[0], -1))
        return list(out.split(counts))

    def forward(self, mels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mels [T_i, n_mels] -> embeddings [cfg.num_tokens(T_i), out_hidden_size] per item
        (equal to ``swaserve.media.audio.audio_num_tokens(T_i)`` for MiMo's conv stack)."""
        return self.encode_codes(self.tokenize(mels))


_CODEBOOK = re.compile(r"^quantizer\.vq\.layers\.(\d+)\._codebook\.(\w+)$")
_CODEBOOK_STATE = ("inited", "cluster_size", "embed_avg")  # k-means / EMA training state


def _expected_shapes(cfg: AudioConfig) -> dict[str, tuple[int, ...]]:
    with on_meta():
        model = AudioEncoder(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def audio_state_dict_from_hub(
    main: Mapping[str, torch.Tensor], tokenizer: Mapping[str, torch.Tensor], cfg: AudioConfig
) -> dict[str, torch.Tensor]:
    """Hub tensors -> an ``AudioEncoder`` state dict (for ``load_state_dict(strict=True)``).

    Args:
        main: the main checkpoint's tensors (or only its audio ones); tensors outside
            ``speech_embeddings.`` / ``audio_encoder.`` (LLM, ViT, ``audio_tokenizer.*``) are
            ignored, as is an unused ``input_local_transformer.embed_tokens``.
        tokenizer: ``audio_tokenizer/model.safetensors``; only ``encoder.*`` is read, and of the
            quantizer only the first ``audio_channels`` levels' ``_codebook.embed``.

    Raises:
        AudioWeightsError: missing, unexpected (within the prefixes read) or mis-shaped tensors,
            or the same tensor under two names.
    """
    out: dict[str, torch.Tensor] = {}
    dupes: list[str] = []

    def put(key: str, t: torch.Tensor) -> None:
        if key in out:
            dupes.append(key)
        out[key] = t

    for name, t in main.items():
        if name.startswith("speech_embeddings."):
            put(name, t)
        elif name.startswith("audio_encoder.") and not name.endswith(".embed_tokens.weight"):
            put(name[len("audio_encoder.") :], t)
    for name, t in tokenizer.items():
        if not name.startswith("encoder."):
            continue
        key = name[len("encoder.") :]
        m = _CODEBOOK.match(key)
        if m is None:
            put("tokenizer." + key, t)
        elif m[2] == "embed" and int(m[1]) < cfg.audio_channels:
            put(f"tokenizer.codebooks.{m[1]}", t)
        elif m[2] not in ("embed", *_CODEBOOK_STATE):
            put("tokenizer." + key, t)  # reported as unexpected below
    shapes = _expected_shapes(cfg)
    missing = sorted(set(shapes) - set(out))
    unexpected = sorted(set(out) - set(shapes))
    common = sorted(set(out) & set(shapes))
    wrong = [
        f"{k} {tuple(out[k].shape)} (want {shapes[k]})" for k in common if tuple(out[k].shape) != shapes[k]
    ]
    problems = [
        (f"missing {len(missing)}", missing),
        (f"unexpected {len(unexpected)}", unexpected),
        (f"mis-shaped {len(wrong)}", wrong),
        (f"duplicated {len(dupes)}", dupes),
    ]
    text = "; ".join(
        f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
        for what, names in problems
        if names
    )
    if text:
        raise AudioWeightsError(f"audio weights do not match the config ({text})")
    return out


def _to_hub(key: str) -> tuple[str, str]:
    """Internal state-dict key -> ("main" | "tokenizer", hub key)."""
    if key.startswith("tokenizer."):
        key = key[len("tokenizer.") :]
        m = re.match(r"^codebooks\.(\d+)$", key)
        return "tokenizer", f"encoder.quantizer.vq.layers.{m[1]}._codebook.embed" if m else "encoder." + key
    return "main", key if key.startswith("speech_embeddings.") else "audio_encoder." + key


def random_audio_weights(
    cfg: AudioConfig, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Deterministic random weights in the hub layout: (main checkpoint tensors, the
    ``audio_tokenizer/model.safetensors`` tensors, with every RVQ level and its training buffers).

    Tokenizer weights come from ``init_tokenizer_weights`` (codebooks with stable codes); the rest
    are N(0, 0.5 / sqrt(fan_in)) matrices, N(0, 1 / sqrt(C)) embeddings, RMSNorm scales near 1.
    fp32, CPU. Raises ValueError when the codebooks do not fit (``separated_codebooks``).
    """
    gen = torch.Generator().manual_seed(seed)
    model = AudioEncoder(cfg)
    init_tokenizer_weights(model.tokenizer, gen)
    for name, p in model.named_parameters():
        if name.startswith("tokenizer."):
            continue
        if name.startswith("speech_embeddings."):
            p.data = torch.randn(p.shape, generator=gen) / cfg.audio_channels**0.5
        elif name.endswith("norm.weight"):
            p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:
            p.data = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            p.data = torch.randn(p.shape, generator=gen) * (0.5 / p.shape[1] ** 0.5)
    files: dict[str, dict[str, torch.Tensor]] = {"main": {}, "tokenizer": {}}
    for key, t in model.state_dict().items():
        which, hub = _to_hub(key)
        files[which][hub] = t.detach().clone().contiguous()
    tok = files["tokenizer"]
    for level, size in enumerate(cfg.tokenizer.codebook_size):
        prefix = f"encoder.quantizer.vq.layers.{level}._codebook."
        if prefix + "embed" not in tok:
            tok[prefix + "embed"] = torch.randn(size, cfg.tokenizer.d_model, generator=gen)
        tok[prefix + "inited"] = torch.ones(1)
        tok[prefix + "cluster_size"] = torch.ones(size)
        tok[prefix + "embed_avg"] = tok[prefix + "embed"].clone()
    return files["main"], tok


def _read_tensors(files: Sequence[Path], keep: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if keep(name):
                    out[name] = fh.get_tensor(name)
    return out


def load_audio_encoder(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> AudioEncoder:
    """Build the audio encoder of a checkpoint directory (main safetensors, sharded or not, and
    ``audio_tokenizer/model.safetensors``) in ``dtype`` on ``device``.

    Raises:
        ConfigError: no audio config. AudioWeightsError: tensors do not match it.
    """
    root = Path(model_dir)
    cfg = AudioConfig.from_pretrained(root)
    main = _read_tensors(
        sorted(root.glob("*.safetensors")),
        lambda n: n.startswith(("speech_embeddings.", "audio_encoder.")),
    )
    tok = _read_tensors([root / "audio_tokenizer" / "model.safetensors"], lambda n: n.startswith("encoder."))
    with on_meta():
        model = AudioEncoder(cfg)
    model.load_state_dict(audio_state_dict_from_hub(main, tok, cfg), strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

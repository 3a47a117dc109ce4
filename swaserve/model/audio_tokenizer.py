"""The MiMo-Audio-Tokenizer encoder and its residual vector quantizer: log-mel -> discrete codes.

Sources (no library holds a reference; these ports agree with each other): vLLM
vllm/model_executor/models/mimo_audio.py (``AudioEncoder``, ``ResidualVectorQuantizer``, "adapted
from https://github.com/XiaomiMiMo/MiMo-Audio-Tokenizer"), the Xiaomi-authored SGLang fork
Abatom/sglang python/sglang/srt/models/mimo_audio.py (the same code). Per segment of at most
``audio_segment_size`` mel frames::

    mel [L, n_mels] -> conv1 (k 3, pad 1) -> GELU -> conv2 (k 3, stride 2, pad 1) -> GELU  [L2, d]
      -> layers: x += attn(LN(x)) (RoPE, window or full), x += fc2(GELU(fc1(LN(x))))
      -> x += output of layer ``encoder_skip_layer_id`` (if set) -> LN
      -> pooler conv (k = stride = avg_pooler, no bias, zero-padded tail) -> GELU -> LN  [L3, d]
      -> RVQ: code_i = argmin_c |r_i - e_c|^2, r_{i+1} = r_i - e[code_i]  (fp32)     [L3, n_q]

Segments are independent (positions restart at 0). Segments of many items run packed in one
forward: convolutions gather their taps inside each segment (zeros past its ends) and attention
runs per group of equal-length segments, so an item's codes do not depend on what it is batched
with. The ports pad a batch to its longest segment instead, which lets conv2 and the pooler of a
shorter segment read the padding's conv1 outputs / a copy of its last frame; we keep the
single-segment semantics (what the ports compute for one item under one segment).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.config import ConfigError
from swaserve.model.layers import PartialRope


def parse_int_list(value: Any, length: int, what: str) -> tuple[int, ...]:
    """A hub list value as ``length`` ints: "a-b-c" strings and lists give their entries (at least
    ``length``; extra ones are dropped, like the ports' indexing), a scalar repeats."""
    if isinstance(value, str) and "-" in value:
        items = [int(s) for s in value.split("-")]
    elif isinstance(value, (list, tuple)):
        items = [int(v) for v in value]
    else:
        items = [int(value)] * length
    if len(items) < length:
        raise ConfigError(f"{what} has {len(items)} entries, need {length}")
    return tuple(items[:length])


@dataclass(frozen=True)
class AudioTokenizerConfig:
    """The tokenizer encoder's config: ``audio_tokenizer/config.json`` keys, defaults from
    ``MiMoAudioTokenizerConfig`` (vLLM mimo_audio.py); decoder and vocoder keys are not read.

    Attributes:
        n_mels: mel bands of the input (``n_mels``).
        d_model: width of the conv and transformer stack (``d_model``).
        kernel_size / stride_size: conv1/conv2 kernel and conv2 stride; both pad by 1
            (``kernel_size``, ``stride_size``).
        avg_pooler: pooler conv kernel = stride after the transformer; 1 = none (``avg_pooler``).
        encoder_layers / encoder_attention_heads / encoder_ffn_dim: transformer depth, heads, MLP
            width (head dim = d_model / heads).
        encoder_skip_layer_id: the output of layer ``id - 1`` (0-based) is added to the last
            layer's output before the final LN; None = no skip (``encoder_skip_layer_id``).
        encoder_causal: causal attention (``encoder_causal``; MiMo: false).
        encoder_attn_window_size: (left, right) keys a windowed layer sees around each query,
            -1 = unbounded, flash-attn ``window_size`` semantics (``encoder_attn_window_size``).
        hybrid_attention / swa_per_block: when set, layer i is windowed iff
            ``i % swa_per_block < swa_per_block - 1`` and full otherwise; when unset every layer
            uses the window (``hybrid_attention``, ``swa_per_block``).
        rope_theta: RoPE base over the whole head dim, NeoX halves (``rope_theta``).
        num_quantizers / codebook_size: RVQ depth and per-level codebook sizes, a short list
            repeating its last entry (``num_quantizers``, ``codebook_size``).
        sampling_rate / hop_length: the front end the weights were trained on (recorded).
        activation_function / ln_type / position_embedding_type / rope_type: the only supported
            values are "gelu" (exact erf), "LayerNorm" (eps 1e-5), "rope" and "default".
    """

    n_mels: int = 80
    d_model: int = 768
    kernel_size: int = 3
    stride_size: int = 2
    avg_pooler: int = 1
    encoder_layers: int = 8
    encoder_attention_heads: int = 12
    encoder_ffn_dim: int = 3072
    encoder_skip_layer_id: int | None = None
    encoder_causal: bool = False
    encoder_attn_window_size: tuple[int, int] = (-1, -1)
    hybrid_attention: bool = False
    swa_per_block: int = 2
    rope_theta: float = 10000.0
    num_quantizers: int = 12
    codebook_size: tuple[int, ...] = field(default=(1024,) * 12)
    sampling_rate: int = 24000
    hop_length: int = 240
    activation_function: str = "gelu"
    ln_type: str = "LayerNorm"
    position_embedding_type: str = "rope"
    rope_type: str = "default"

    def __post_init__(self) -> None:
        unsupported = {
            "activation_function": (self.activation_function, "gelu"),
            "ln_type": (self.ln_type, "LayerNorm"),
            "position_embedding_type": (self.position_embedding_type, "rope"),
            "rope_type": (self.rope_type, "default"),
        }
        for key, (got, want) in unsupported.items():
            if got != want:
                raise ConfigError(f"audio tokenizer {key}={got!r} is not supported (only {want!r})")
        if self.d_model % self.encoder_attention_heads or (self.d_model // self.encoder_attention_heads) % 2:
            raise ConfigError("audio tokenizer head dim (d_model / heads) must be an even integer")
        if min(self.kernel_size, self.stride_size, self.avg_pooler, self.swa_per_block) < 1:
            raise ConfigError("audio tokenizer kernel, stride, pooler and swa_per_block must be >= 1")
        if len(self.codebook_size) != self.num_quantizers or min(self.codebook_size, default=1) < 1:
            raise ConfigError("codebook_size must hold one positive size per quantizer")
        if len(self.encoder_attn_window_size) != 2:
            raise ConfigError("encoder_attn_window_size must be [left, right]")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> AudioTokenizerConfig:
        """From ``audio_tokenizer/config.json``; absent keys take the defaults above."""
        base = cls()
        kw: dict[str, Any] = {}
        for f in (
            "n_mels",
            "d_model",
            "kernel_size",
            "stride_size",
            "avg_pooler",
            "encoder_layers",
            "encoder_attention_heads",
            "encoder_ffn_dim",
            "swa_per_block",
            "num_quantizers",
            "sampling_rate",
            "hop_length",
        ):
            kw[f] = int(d.get(f, getattr(base, f)))
        for f in ("encoder_causal", "hybrid_attention"):
            kw[f] = bool(d.get(f, getattr(base, f)))
        for f in ("activation_function", "ln_type", "position_embedding_type", "rope_type"):
            kw[f] = str(d.get(f, getattr(base, f)))
        skip = d.get("encoder_skip_layer_id")
        kw["encoder_skip_layer_id"] = None if skip is None else int(skip)
        window = d.get("encoder_attn_window_size") or [-1, -1]
        kw["encoder_attn_window_size"] = tuple(int(w) for w in window)
        kw["rope_theta"] = float(d.get("rope_theta", base.rope_theta))
        sizes = d.get("codebook_size") or [1024]
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        n_q = kw["num_quantizers"]
        kw["codebook_size"] = tuple(int(s) for s in (sizes + sizes[-1:] * n_q)[:n_q])
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The keys ``from_hf`` reads (``from_hf(to_hf(c)) == c``)."""
        out: dict[str, Any] = {
            f: getattr(self, f) for f in self.__dataclass_fields__ if f not in ("codebook_size",)
        }
        out["encoder_attn_window_size"] = list(self.encoder_attn_window_size)
        out["codebook_size"] = list(self.codebook_size)
        return out

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    def window(self, layer: int) -> tuple[int, int]:
        """(left, right) window of a layer; (-1, -1) is full attention."""
        if self.hybrid_attention and layer % self.swa_per_block == self.swa_per_block - 1:
            return (-1, -1)
        w = self.encoder_attn_window_size
        return (w[0], w[1])

    def frames(self, num_mel_frames: int) -> tuple[int, int, int]:
        """Lengths after conv1, conv2 and the pooler for one segment (the ports'
        ``get_output_length`` and the pooler's ceil)."""
        l1 = num_mel_frames + 3 - self.kernel_size
        l2 = (l1 + 2 - self.kernel_size) // self.stride_size + 1
        return l1, l2, -(-l2 // self.avg_pooler)


class _Plan:
    """Index tables of one packed batch of segments (lengths per stage, gathers, attention groups)."""

    def __init__(self, cfg: AudioTokenizerConfig, seg_lens: Sequence[int], device: torch.device) -> None:
        self.lens0 = list(seg_lens)
        stages = [cfg.frames(n) for n in self.lens0]
        self.lens1 = [s[0] for s in stages]
        self.lens2 = [s[1] for s in stages]
        self.lens3 = [s[2] for s in stages]
        if min(self.lens2) < 1:
            raise ValueError(f"a segment of {min(self.lens0)} mel frames is too short for the conv stack")
        k = cfg.kernel_size
        self.conv1 = _taps(self.lens0, self.lens1, k, 1, 1, device)
        self.conv2 = _taps(self.lens1, self.lens2, k, cfg.stride_size, 1, device)
        p = cfg.avg_pooler
        self.pool = _taps(self.lens2, self.lens3, p, p, 0, device) if p != 1 else None
        lens = torch.tensor(self.lens2, device=device)
        starts = torch.cumsum(lens, 0) - lens
        seg = torch.repeat_interleave(torch.arange(len(self.lens2), device=device), lens)
        self.positions = torch.arange(int(lens.sum()), device=device) - starts[seg]
        self.groups: list[tuple[int, torch.Tensor]] = []  # (length, [n, length] rows of x)
        for length in sorted(set(self.lens2)):
            ids = torch.tensor([i for i, n in enumerate(self.lens2) if n == length], device=device)
            self.groups.append((length, starts[ids][:, None] + torch.arange(length, device=device)))


def _taps(
    in_lens: list[int], out_lens: list[int], kernel: int, stride: int, pad: int, device: torch.device
) -> torch.Tensor:
    """[sum(out_lens), kernel] rows of a packed input each output tap reads; taps outside their own
    segment point at row ``sum(in_lens)`` (a zero row appended by ``_conv``)."""
    n_in = sum(in_lens)
    li = torch.tensor(in_lens, device=device)
    lo = torch.tensor(out_lens, device=device)
    in_start = torch.cumsum(li, 0) - li
    seg = torch.repeat_interleave(torch.arange(len(out_lens), device=device), lo)
    j = torch.arange(int(lo.sum()), device=device) - (torch.cumsum(lo, 0) - lo)[seg]
    idx = j[:, None] * stride - pad + torch.arange(kernel, device=device)[None, :]
    inside = (idx >= 0) & (idx < li[seg][:, None])
    return torch.where(inside, in_start[seg][:, None] + idx, torch.full_like(idx, n_in))


def _conv(
    x: torch.Tensor, taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A Conv1d over packed segments: x [N_in, C], taps [N_out, K], weight [O, C, K] -> [N_out, O]."""
    cols = torch.cat([x, x.new_zeros(1, x.shape[1])])[taps]  # [N_out, K, C]
    w = weight.permute(0, 2, 1).reshape(weight.shape[0], -1)
    return F.linear(cols.reshape(cols.shape[0], -1), w, bias)


def window_mask(
    length: int, window: tuple[int, int], causal: bool, device: torch.device
) -> torch.Tensor | None:
    """[length, length] bool, True where query i may read key j: ``i - left <= j <= i + right``
    (-1: unbounded) and ``j <= i`` when causal; None when nothing is masked."""
    left, right = window
    if left < 0 and right < 0 and not causal:
        return None
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    ok = torch.ones(length, length, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if causal:
        ok &= j <= i
    return ok


class _SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=True)
        self.out_proj = nn.Linear(d, d, bias=True)


class _EncoderLayer(nn.Module):
    """Pre-LN transformer layer; parameter names follow the checkpoint (``encoder.layers.N.*``)."""

    def __init__(self, cfg: AudioTokenizerConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = _SelfAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: list[tuple[int, torch.Tensor]],
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:
        a = self.self_attn
        n, d = x.shape
        h = self.self_attn_layer_norm(x)
        q = PartialRope.rotate(a.q_proj(h).view(n, a.heads, -1), cos, sin)
        k = PartialRope.rotate(a.k_proj(h).view(n, a.heads, -1), cos, sin)
        v = a.v_proj(h).view(n, a.heads, -1)
        out = torch.empty_like(q)
        for (_, rows), mask in zip(groups, masks, strict=True):
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [segs, heads, L, hd]
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2)
        x = x + a.out_proj(out.reshape(n, d))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class TokenizerEncoder(nn.Module):
    """The tokenizer's encoder and the first ``n_q`` RVQ levels (module docstring).

    Parameter names follow the checkpoint's ``encoder.*`` keys, except the codebooks:
    ``encoder.quantizer.vq.layers.N._codebook.embed`` is ``codebooks.N`` here.
    """

    def __init__(self, cfg: AudioTokenizerConfig, n_q: int) -> None:
        super().__init__()
        if not 1 <= n_q <= cfg.num_quantizers:
            raise ConfigError(f"need 1 <= n_q <= num_quantizers ({cfg.num_quantizers}), got {n_q}")
        self.cfg = cfg
        d, k = cfg.d_model, cfg.kernel_size
        self.conv1 = nn.Conv1d(cfg.n_mels, d, k, padding=1)
        self.conv2 = nn.Conv1d(d, d, k, stride=cfg.stride_size, padding=1)
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        self.down_sample_layer: nn.Sequential | None = None
        self.down_sample_norm: nn.LayerNorm | None = None
        if cfg.avg_pooler != 1:
            pool = nn.Conv1d(d, d, cfg.avg_pooler, cfg.avg_pooler, bias=False)
            self.down_sample_layer = nn.Sequential(pool, nn.GELU())
            self.down_sample_norm = nn.LayerNorm(d)
        self.codebooks = nn.ParameterList(
            nn.Parameter(torch.empty(cfg.codebook_size[i], d), requires_grad=False) for i in range(n_q)
        )
        self.rope = PartialRope(cfg.head_dim, cfg.rope_theta)

    def features(self, mel: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Packed mel segments [sum(lens0), n_mels] -> pre-quantizer features [sum(lens3), d]."""
        cfg = self.cfg
        x = mel.to(self.conv1.weight.dtype)
        x = F.gelu(_conv(x, plan.conv1, self.conv1.weight, self.conv1.bias))
        x = F.gelu(_conv(x, plan.conv2, self.conv2.weight, self.conv2.bias))
        cos, sin = self.rope.cos_sin(plan.positions, x.dtype)
        masks: dict[tuple[int, tuple[int, int]], torch.Tensor | None] = {}
        skip: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            win = cfg.window(i)
            layer_masks = []
            for length, _ in plan.groups:
                if (length, win) not in masks:
                    masks[(length, win)] = window_mask(length, win, cfg.encoder_causal, x.device)
                layer_masks.append(masks[(length, win)])
            x = layer(x, cos, sin, plan.groups, layer_masks)
            if cfg.encoder_skip_layer_id is not None and i == cfg.encoder_skip_layer_id - 1:
                skip = x
        if skip is not None:
            x = x + skip
        x = self.layer_norm(x)
        if self.down_sample_layer is not None and self.down_sample_norm is not None and plan.pool is not None:
            pool = cast(nn.Conv1d, self.down_sample_layer[0])
            x = F.gelu(_conv(x, plan.pool, pool.weight, None))
            x = self.down_sample_norm(x)
        return x

    def quantize(self, h: torch.Tensor) -> torch.Tensor:
        """RVQ codes [N, n_q] (int64) of features h [N, d], in fp32 as the ports do: level i picks
        ``argmin_c |r - e_c|^2`` (first index on ties) and subtracts ``e_code`` from the residual."""
        r = h.float()
        codes = []
        for book in self.codebooks:
            e = book.float()
            dist = r.pow(2).sum(1, keepdim=True) - 2 * (r @ e.T) + e.pow(2).sum(1)[None, :]
            idx = dist.argmin(dim=1)
            codes.append(idx)
            r = r - e[idx]
        return torch.stack(codes, dim=1)

    def forward(self, mels: Sequence[torch.Tensor], segment_size: int) -> list[torch.Tensor]:
        """Codes of each item.

        Args:
            mels: items' log-mels, each [T_i, n_mels] with T_i >= 1 (any float dtype and device).
            segment_size: mel frames per independently encoded segment (``audio_segment_size``).

        Returns:
            per item, int64 [sum over its segments of ``cfg.frames(len)[2]``, n_q] on the module's
            device.

        Raises:
            ValueError: an item is not [T >= 1, n_mels].
        """
        if not mels:
            return []
        device = self.conv1.weight.device
        seg_lens: list[int] = []
        per_item: list[int] = []
        for m in mels:
            if m.dim() != 2 or m.shape[1] != self.cfg.n_mels or m.shape[0] < 1:
                raise ValueError(f"a mel must be [T >= 1, {self.cfg.n_mels}], got {tuple(m.shape)}")
            t = m.shape[0]
            segs = [segment_size] * (t // segment_size) + ([t % segment_size] if t % segment_size else [])
            seg_lens += segs
            per_item.append(len(segs))
        plan = _Plan(self.cfg, seg_lens, device)
        packed = torch.cat([m.to(device) for m in mels])
        codes = self.quantize(self.features(packed, plan))
        by_seg = codes.split(plan.lens3)
        out, i = [], 0
        for n in per_item:
            out.append(torch.cat(by_seg[i : i + n]))
            i += n
        return out


def num_codes(cfg: AudioTokenizerConfig, num_mel_frames: int, segment_size: int) -> int:
    """Codes ``TokenizerEncoder`` makes from ``num_mel_frames`` frames cut into segments."""
    full, rest = divmod(num_mel_frames, segment_size)
    n = full * cfg.frames(segment_size)[2]
    return n + (cfg.frames(rest)[2] if rest else 0)


def init_tokenizer_weights(model: TokenizerEncoder, gen: torch.Generator) -> None:
    """Deterministic random weights for tests and tiny checkpoints: N(0, 0.5 / sqrt(fan_in))
    matrices, small biases, LayerNorm scales near 1, and ``separated_codebooks``."""
    for name, p in model.named_parameters():
        if name.startswith("codebooks."):
            continue
        if p.dim() == 1:
            scale = name.endswith("norm.weight")
            p.data = (1.0 if scale else 0.0) + (0.1 if scale else 0.02) * torch.randn(p.shape, generator=gen)
        else:
            p.data = torch.randn(p.shape, generator=gen) * (0.5 / math.sqrt(p[0].numel()))
    books = separated_codebooks([b.shape[0] for b in model.codebooks], model.cfg.d_model, gen)
    for book, value in zip(model.codebooks, books, strict=True):
        book.data = value


def separated_codebooks(sizes: Sequence[int], d: int, gen: torch.Generator) -> list[torch.Tensor]:
    """RVQ codebooks [size_l, d] whose codes are stable under float noise.

    Level l owns its own block of ``m_l = ceil(log2(size_l))`` coordinates (zero elsewhere), and its
    entries are distinct +-1 patterns on that block, so a level only sees its block of the features
    (earlier levels subtract nothing there). With ``size_l = 2**m_l`` the level holds every
    pattern: the nearest entry is ``sign(h)`` on the block and any other is farther by
    ``4 * sum |h_i|`` over the coordinates where it differs, at least ``4 * min |h_i|``, far above
    fp32 noise for the O(1) LayerNorm outputs the codes are taken from. Other sizes hold a random
    subset of the patterns and only generic margins.

    Raises:
        ValueError: the blocks do not fit in ``d``.
    """
    widths = [max(1, math.ceil(math.log2(n))) for n in sizes]
    if sum(widths) > d:
        raise ValueError(f"codebooks of sizes {list(sizes)} need {sum(widths)} > d={d} coordinates")
    books, start = [], 0
    for n, m in zip(sizes, widths, strict=True):
        ids = torch.randperm(2**m, generator=gen)[:n]
        bits = (ids[:, None] >> torch.arange(m)[None, :]) & 1
        book = torch.zeros(n, d)
        book[:, start : start + m] = bits.float() * 2 - 1
        books.append(book)
        start += m
    return books

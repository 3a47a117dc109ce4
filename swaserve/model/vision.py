"""The MiMo-V2.5 vision transformer (ViT): patches -> embeddings that replace ``<|image_pad|>`` /
``<|video_pad|>`` tokens one row per token.

Architecture (vLLM vllm/model_executor/models/mimo_v2_omni.py ``MiMoVisionTransformer`` and the SGLang
fork Abatom/sglang python/sglang/srt/models/mimo_vit.py agree; Qwen2.5-VL's vision tower, arXiv
2502.13923, is the parent)::

    patches [N, C*T*P*P] -> patch_embed (Conv3d kernel = stride = (T, P, P), no bias, as a Linear)
    blocks x depth: x += attn(RMSNorm(x)); x += SwiGLU-MLP(RMSNorm(x))   (qkv, proj, MLP biased)
        attn: GQA, head_dim = qk_channels, 2-D RoPE (Qwen2.5-VL: h and w angles over head_dim/2
              each, rotate-half over the whole head), within each frame; per block
              window_types[i]: -1 full, 0 window |i-j| <= w in row order, 1 the same in column
              order (merge units listed column-major per frame; RoPE tables permuted alike,
              undone when a run of type-1 blocks ends); sinks on window blocks only
    merger: RMSNorm -> view [N/m^2, m^2*hidden] -> Linear -> GELU -> Linear(out_hidden), no biases
    -> [N / m^2, out_hidden]

Rows are in merge-unit order (t, h/m, w/m, m, m): ``swaserve.media.image`` patchifies that way.
Parameter names are the hub's after stripping ``model.visual.`` or ``visual.``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.model.layers import PartialRope, RMSNorm
from swaserve.model.meta import on_meta
from swaserve.model.vision_attention import SINK_MODES, Segments, attend

DEFAULT_SINK_MODE = "key0_bias"
HUB_PREFIXES = ("model.visual.", "visual.")
_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionConfig:
    """Shape and attention layout of the MiMo-V2.5 ViT.

    Attributes:
        head_dim: Q/K/V channels per head (hub ``qk_channels`` = ``kv_channels``; 64 on the real
            checkpoint, not hidden/heads).
        window_types: one per block: -1 full attention, 0 row-order window, 1 column-order window
            (hub ``vit_window_attn_types``); None = all full.
        window_size: w of the window blocks, |i - j| <= w (hub ``visual_token_window_size``).
        use_sink: window blocks carry ``attn.sinks`` [num_heads].
        sink_mode: "key0_bias" (vLLM PR #49815: the sink is added to the logit of each frame's
            first key) or "denominator" (an extra softmax logit: the SGLang fork's FA3 ``s_aux``,
            vLLM PR #58235). Not a hub key: ours, and part of the model's identity.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    out_hidden_size: int
    window_types: tuple[int, ...] | None = None
    window_size: int = 64
    use_sink: bool = False
    sink_mode: str = DEFAULT_SINK_MODE
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        types = (-1,) * self.depth if self.window_types is None else tuple(int(t) for t in self.window_types)
        object.__setattr__(self, "window_types", types)
        for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "out_hidden_size", "patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels"):  # fmt: skip
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"vision config: {f} must be positive, got {getattr(self, f)}")
        if len(types) != self.depth:
            raise ValueError(f"vision config: {len(types)} window types for depth {self.depth}")
        if any(t not in (-1, 0, 1) for t in types):
            raise ValueError(f"vision config: window types must be -1, 0 or 1, got {list(types)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"vision config: num_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"vision config: head_dim {self.head_dim} must be a multiple of 4 (2-D RoPE)")
        if self.window_size < 0:
            raise ValueError(f"vision config: window_size must be >= 0, got {self.window_size}")
        if self.sink_mode not in SINK_MODES:
            raise ValueError(f"vision config: sink_mode must be one of {SINK_MODES}, got {self.sink_mode!r}")
        if self.hidden_act not in _ACTS:
            raise ValueError(
                f"vision config: hidden_act must be one of {sorted(_ACTS)}, got {self.hidden_act!r}"
            )

    @property
    def types(self) -> tuple[int, ...]:
        """``window_types`` (never None after construction)."""
        assert self.window_types is not None
        return self.window_types

    @property
    def full_blocks(self) -> tuple[int, ...]:
        """Indexes of the full-attention blocks (hub ``fullatt_block_indexes``)."""
        return tuple(i for i, t in enumerate(self.types) if t == -1)

    def has_sinks(self, block: int) -> bool:
        """Whether block ``block`` carries ``attn.sinks`` (window blocks when ``use_sink``)."""
        return self.use_sink and self.types[block] != -1

    @property
    def patch_dim(self) -> int:
        """Values per patch row: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @staticmethod
    def from_hf(vision_config: Mapping[str, Any], out_hidden_size: int) -> VisionConfig:
        """From the hub's ``vision_config`` (Mimo_VLVisionConfig keys, vLLM
        vllm/transformers_utils/configs/mimo_v2_omni.py) plus our ``sink_mode``.

        ``out_hidden_size`` is the LLM's hidden size. Missing ``num_key_value_heads`` means MHA;
        missing ``qk_channels``/``kv_channels`` mean hidden/heads; missing
        ``vit_window_attn_types`` with ``fullatt_block_indexes`` given means row windows elsewhere
        (vLLM's reading). Raises ValueError on a missing shape key or an inconsistent config.
        """
        vc = dict(vision_config)

        def need(key: str) -> int:
            if vc.get(key) is None:
                raise ValueError(f"vision_config lacks {key!r}")
            return int(vc[key])

        depth, hidden, heads = need("depth"), need("hidden_size"), need("num_heads")
        qk, kvc = vc.get("qk_channels"), vc.get("kv_channels")
        if qk is not None and kvc is not None and int(qk) != int(kvc):
            raise ValueError(f"vision_config: qk_channels {qk} != kv_channels {kvc} is not supported")
        head_dim = int(qk if qk is not None else kvc if kvc is not None else hidden // heads)
        full = vc.get("fullatt_block_indexes")
        types = vc.get("vit_window_attn_types")
        if full is not None and any(not 0 <= int(i) < depth for i in full):
            raise ValueError(f"vision_config: fullatt_block_indexes {list(full)} outside depth {depth}")
        if types is None:
            types = [-1] * depth if full is None else [-1 if i in set(full) else 0 for i in range(depth)]
        if vc.get("out_hidden_size") is not None and int(vc["out_hidden_size"]) != out_hidden_size:
            raise ValueError(
                f"vision_config: out_hidden_size {vc['out_hidden_size']} != the LLM hidden size {out_hidden_size}"
            )
        cfg = VisionConfig(
            depth=depth,
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_heads=heads,
            num_kv_heads=int(vc.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            out_hidden_size=out_hidden_size,
            window_types=tuple(int(t) for t in types),
            window_size=int(vc.get("visual_token_window_size", 64)),
            use_sink=bool(vc.get("use_sink", False)),
            sink_mode=str(vc.get("sink_mode", DEFAULT_SINK_MODE)),
            patch_size=int(vc.get("patch_size", 16)),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            in_channels=int(vc.get("in_channels") or vc.get("in_chans") or 3),
            rms_norm_eps=float(vc.get("rms_norm_eps", 1e-6)),
            rope_theta=float(vc.get("rope_theta", 10000.0)),
            hidden_act=str(vc.get("hidden_act", "silu")),
        )
        if full is not None and sorted({int(i) for i in full}) != list(cfg.full_blocks):
            raise ValueError(
                f"vision_config: fullatt_block_indexes {sorted(full)} disagree with the -1 entries of "
                f"vit_window_attn_types {list(types)}"
            )
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """Hub-style ``vision_config`` dict; ``from_hf(to_hf(), out_hidden_size)`` gives this config back."""
        return {
            "model_type": "mimovl",
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "qk_channels": self.head_dim,
            "kv_channels": self.head_dim,
            "out_hidden_size": self.out_hidden_size,
            "fullatt_block_indexes": list(self.full_blocks),
            "vit_window_attn_types": list(self.types),
            "visual_token_window_size": self.window_size,
            "use_sink": self.use_sink,
            "sink_mode": self.sink_mode,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "in_channels": self.in_channels,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": self.hidden_act,
        }


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P) on pre-cut patches, computed as a Linear."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C*T*P*P] -> [N, hidden]."""
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.view(w.shape[0], -1))


class VisionAttention(nn.Module):
    """Fused-qkv GQA attention of one block (q heads, then k, then v in ``qkv``)."""

    def __init__(self, cfg: VisionConfig, block: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = None if cfg.types[block] == -1 else cfg.window_size
        self.sink_mode = cfg.sink_mode
        self.qkv = nn.Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=True)
        self.proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(self.nh)) if cfg.has_sinks(block) else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segs: Segments) -> torch.Tensor:
        """x [N, hidden]; cos/sin [N, head_dim] fp32 -> [N, hidden]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = _rope(q.reshape(n, self.nh, self.hd), cos, sin)
        k = _rope(k.reshape(n, self.nkv, self.hd), cos, sin)
        v = v.reshape(n, self.nkv, self.hd)
        o = attend(q, k, v, segs, self.window, self.sinks, self.sink_mode, self.hd**-0.5)
        return self.proj(o.reshape(n, self.nh * self.hd))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in fp32 (as transformers' Qwen2.5-VL vision tower)."""
    return PartialRope.rotate(x.float(), cos, sin).to(x.dtype)


class VisionMLP(nn.Module):
    """Biased SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, block: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg, block)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segs: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge unit's m*m rows side by side through a bias-free GELU MLP.

    Bias-free as vLLM builds it (``bias=False``); the SGLang fork zeroes the biases of
    Qwen2.5-VL's merger, and the checkpoint has none."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width, bias=False),
            nn.GELU(),
            nn.Linear(self.width, cfg.out_hidden_size, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] in merge-unit order -> [N / m^2, out_hidden]."""
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class VisionTransformer(nn.Module):
    """The MiMo-V2.5 ViT over a fused batch of images and video frame pairs."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg, i) for i in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        d = cfg.head_dim // 2  # d/2 frequencies per axis: h and w angles fill head_dim/2, then doubled
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode items fused in one batch.

        Args:
            patches: [N, in_channels * T * P * P], each item's rows in merge-unit order
                (``swaserve.media.image.preprocess_images`` / ``preprocess_frames``), items back to back.
            grid_thw: [items, 3] int (t, h, w) in patches; h and w multiples of spatial_merge_size.
                Attention stays within each of an item's t frames.

        Returns:
            [N / merge**2, out_hidden_size] in the weights' dtype; item i owns
            ``t_i * h_i * w_i / merge**2`` consecutive rows.

        Raises:
            ValueError: shapes that disagree with the grid or the config.
        """
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3 or grid_thw.shape[0] == 0:
            raise ValueError(f"grid_thw must be [items, 3], got {tuple(grid_thw.shape)}")
        grid = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        if any(t <= 0 or h <= 0 or w <= 0 or h % m or w % m for t, h, w in grid):
            raise ValueError(f"grid_thw {grid}: sizes must be positive, h and w multiples of {m}")
        n = sum(t * h * w for t, h, w in grid)
        if patches.dim() != 2 or patches.shape != (n, cfg.patch_dim):
            raise ValueError(
                f"patches {tuple(patches.shape)} do not match grid {grid}: want ({n}, {cfg.patch_dim})"
            )
        dev = self.patch_embed.proj.weight.device
        x = self.patch_embed(patches.to(dev))
        cos, sin = self._rope_tables(grid, dev)
        segs = Segments.from_lengths([h * w for t, h, w in grid for _ in range(t)], dev)
        col = inv = col_cos = col_sin = None
        if 1 in cfg.types:
            col = self._column_order(grid).to(dev)
            inv = torch.argsort(col)
            col_cos, col_sin = cos[col], sin[col]
        in_col = False
        for i, blk in enumerate(self.blocks):
            want_col = cfg.types[i] == 1
            if want_col != in_col:
                x = x[col] if want_col else x[inv]
                in_col = want_col
            if in_col:
                assert col_cos is not None and col_sin is not None
                x = blk(x, col_cos, col_sin, segs)
            else:
                x = blk(x, cos, sin, segs)
        if in_col:
            x = x[inv]
        return self.merger(x)

    def _rope_tables(
        self, grid: list[tuple[int, ...]], dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim] fp32: angles (h * f, w * f) of each row's patch, duplicated."""
        m = self.cfg.spatial_merge_size
        pos = []
        for t, h, w in grid:
            hp = torch.arange(h)[:, None].expand(h, w)
            wp = torch.arange(w)[None, :].expand(h, w)
            hw = torch.stack(
                [p.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1) for p in (hp, wp)], -1
            )
            pos.append(hw.repeat(t, 1))
        angles = torch.cat(pos).to(dev).float()[:, :, None] * self.inv_freq.to(dev)  # [N, 2, d/2]
        emb = angles.flatten(1)
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos(), emb.sin()

    def _column_order(self, grid: list[tuple[int, ...]]) -> torch.Tensor:
        """Row permutation to column order: per frame, merge units listed column-major."""
        m2 = self.cfg.spatial_merge_size**2
        units, base = [], 0
        for t, h, w in grid:
            lh, lw = h // self.cfg.spatial_merge_size, w // self.cfg.spatial_merge_size
            units.append(torch.arange(t * lh * lw).view(t, lh, lw).transpose(1, 2).reshape(-1) + base)
            base += t * lh * lw
        u = torch.cat(units)
        return (u[:, None] * m2 + torch.arange(m2)).reshape(-1)


def vision_param_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name (hub layout, no prefix) and its shape."""
    with on_meta():
        model = VisionTransformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def vision_state_dict_from_hub(
    tensors: Mapping[str, torch.Tensor], cfg: VisionConfig | None = None
) -> dict[str, torch.Tensor]:
    """The ViT's tensors of a checkpoint, prefix (``model.visual.`` / ``visual.``) stripped.

    Other tensors (the LLM, the audio tower) are ignored. With ``cfg``, the names and shapes are
    checked against ``VisionTransformer(cfg)``; all-zero merger biases (savers that write
    Qwen2.5-VL's merger) are dropped.

    Raises:
        ValueError: no ViT tensors, a name under both prefixes, or (with ``cfg``) missing,
            unexpected or misshapen tensors, each named.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix = next((p for p in HUB_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        key = name[len(prefix) :]
        if key in out:
            raise ValueError(f"vision weight {key!r} appears under both {HUB_PREFIXES}")
        out[key] = t
    if not out:
        raise ValueError(f"no vision tower weights (names starting with {' or '.join(HUB_PREFIXES)})")
    if cfg is None:
        return out
    for key in ("merger.mlp.0.bias", "merger.mlp.2.bias"):
        if key in out and not out[key].any():
            del out[key]
    want = vision_param_shapes(cfg)
    missing = sorted(set(want) - set(out))
    unexpected = sorted(set(out) - set(want))
    bad = sorted(k for k in set(want) & set(out) if tuple(out[k].shape) != want[k])
    if missing or unexpected or bad:
        parts = [
            f"{label} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", bad))
            if keys
        ]
        raise ValueError("vision weights do not match the config: " + "; ".join(parts))
    return out


def random_vision_weights(cfg: VisionConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 weights for tiny test checkpoints (names without prefix).

    Linear/conv weights ~ N(0, 1/fan_in); norm weights 1 + N(0, 0.2) (not all ones); biases
    N(0, 0.05) (the merger has none); sinks N(0, 1) (nonzero), so every feature shows in outputs.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in vision_param_shapes(cfg).items():
        r = torch.randn(shape, generator=g)
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "merger.ln_q.weight":
            r = 1.0 + 0.2 * r
        elif name.endswith(".sinks"):
            pass
        elif name.endswith(".bias"):
            r = 0.05 * r
        else:
            fan_in = 1
            for s in shape[1:]:
                fan_in *= s
            r = r * fan_in**-0.5
        out[name] = r
    return out

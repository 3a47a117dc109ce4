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

Rows are in merge-unit order (t, h/m, w/m, m, m): ``swaserve.media.pixels`` patchifies that way.
Parameter names are the hub's after stripping ``model.visual.`` or ``visual.``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.model.layers import PartialRope, RMSNorm
from swaserve.model.meta import on_meta
from swaserve.model.vision_attention import Segments, attend
from swaserve.model.vision_config import HUB_PREFIXES, VisionConfig

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
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
                (``swaserve.media.pixels.preprocess_images`` / ``preprocess_frames``), items back to back.
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

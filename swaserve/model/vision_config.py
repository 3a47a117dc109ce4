"""The MiMo-V2.5 vision transformer's configuration (``VisionConfig``), torch-free: read by the
router and the encoders from config.json before any tower is built (``model.vision`` builds it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_SINK_MODE = "key0_bias"
SINK_MODES = ("key0_bias", "denominator")  # see VisionConfig.sink_mode
HUB_PREFIXES = ("model.visual.", "visual.")  # weight-name prefixes of the tower on the hub
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")  # the MLP's hub ``hidden_act`` values


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
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"vision config: hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}"
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

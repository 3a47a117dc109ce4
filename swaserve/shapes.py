"""Public MiMo-V2 shapes (attention layout and KV sizes; weights not needed) as ``ModelConfig``s, for KV
sizing, transfer and simulation without a checkpoint. From the models' hub config.json
(XiaomiMiMo/MiMo-V2-Flash, XiaomiMiMo/MiMo-V2.5-Pro: ``hybrid_layer_pattern``, ``num_key_value_heads``,
``swa_num_key_value_heads``, ``head_dim``, ``v_head_dim``, ``sliding_window_size``):

* MiMo-V2-Flash: 48 layers = 9 full (4 KV heads) + 39 SWA (8 KV heads); q/k head 192, v head 128; W 128;
  256 routed experts, top-8; 309B parameters published (every weight shape public: hidden 4096, dense
  intermediate 16384, moe_intermediate 2048, vocab 152576).
* MiMo-V2.5-Pro: 70 layers = 10 full + 60 SWA, 8 KV heads each; q/k head 192, v head 128; W 128;
  384 routed experts, top-8 (vllm-project/recipes MiMo-V2.5-Pro.yaml); 1.02T parameters published.
  Its hidden_size and moe_intermediate_size are not public: ``weights_public`` is False and the
  ``ModelConfig`` carries Flash's values there (right for KV sizes, not for weight sizes).

Both carry 3 MTP layers (``num_nextn_predict_layers``; docs/DESIGN.md#schedep_planpy)."""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.config import FULL, SWA, AttnShape, ModelConfig


@dataclass(frozen=True)
class Shape:
    name: str
    full_pattern: tuple[int, ...]  # indices of full-attention layers
    num_layers: int
    full_kv_heads: int
    swa_kv_heads: int
    experts: int = 256  # routed experts
    published_params: float = 0.0  # the model card's total (MTP layers not counted)
    weights_public: bool = True  # every weight shape known (hidden, intermediates)
    mtp_layers: int = 3


SHAPES = (
    Shape("MiMo-V2-Flash", (0, 5, 11, 17, 23, 29, 35, 41, 47), 48, 4, 8, 256, 309e9),
    Shape("MiMo-V2.5-Pro", (0, 7, 15, 23, 31, 39, 47, 55, 62, 69), 70, 8, 8, 384, 1.02e12, False),
)


def model_config(s: Shape) -> ModelConfig:
    types = tuple(FULL if i in s.full_pattern else SWA for i in range(s.num_layers))
    return ModelConfig(
        vocab_size=152576,
        hidden_size=4096,
        num_layers=s.num_layers,
        layer_types=types,
        mlp_types=("dense",) + ("sparse",) * (s.num_layers - 1),
        full=AttnShape(64, s.full_kv_heads, 192, 128, 5e6, 64, False),
        swa=AttnShape(64, s.swa_kv_heads, 192, 128, 1e4, 64, True),
        sliding_window=129,
        intermediate_size=16384,
        moe_intermediate_size=2048,
        n_routed_experts=s.experts,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-5,
        value_scale=0.707,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        num_mtp_layers=s.mtp_layers,
    )


def shape(name: str) -> Shape:
    """The shape called ``name`` (``MiMo-V2-Flash``, ``MiMo-V2.5-Pro``; any case). Raises ValueError."""
    for s in SHAPES:
        if s.name.lower() == name.lower():
            return s
    raise ValueError(f"unknown shape {name!r}; known: {', '.join(s.name for s in SHAPES)}")

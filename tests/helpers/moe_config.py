"""A small MiMo-V2 config.json for hand-computed sizing cases (``sched.ep_plan``, ``sched.ep_cost``)."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_config(tmp_path: Path) -> Path:
    """4 layers (full, SWA, SWA, full), layer 0 dense, 8 experts top-2, 1 MTP layer."""
    cfg = {
        "model_type": "mimo_v2_flash",
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "hybrid_layer_pattern": [0, 1, 1, 0],
        "moe_layer_freq": [0, 1, 1, 1],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "swa_num_key_value_heads": 2,
        "head_dim": 16,
        "v_head_dim": 8,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window_size": 8,
        "num_nextn_predict_layers": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path

"""Weight loading: hub-style configs, FP8 block weights, fused expert keys, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swaserve.config import ConfigError, ModelConfig
from swaserve.model.hub_format import dequantize_fp8_state_dict, quantize_fp8, to_hub_style
from swaserve.model.loader import LoadError, load_model
from tests.helpers.engine import Harness, reference_logits

TOKENS = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(7)).tolist()


def _logits(model_dir: Path) -> torch.Tensor:
    return Harness(model_dir, page_size=4).run_alone("x", TOKENS, [11, 1, 18])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_hub_style_config_loads_to_same_logits(tiny_dir: Path, tmp_path: Path, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    hub = to_hub_style(tiny_dir, tmp_path / "hub")
    raw = json.loads((hub / "config.json").read_text())
    assert "hybrid_layer_pattern" in raw and "layer_types" not in raw
    assert ModelConfig.from_pretrained(hub) == ModelConfig.from_pretrained(tiny_dir)
    ref = reference_logits(hf_tiny, TOKENS)
    assert (_logits(hub) - ref).abs().max().item() <= 1e-4


def test_hub_keys_win_over_transformers_keys(tiny_dir: Path) -> None:
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw["swa_num_key_value_heads"] = 4  # transformers would silently assume 2x = 2
    raw["swa_rope_theta"] = 12345.0
    raw["sliding_window_size"] = 16
    cfg = ModelConfig.from_dict(raw)
    assert cfg.swa.num_kv_heads == 4 and cfg.swa.rope_theta == 12345.0 and cfg.sliding_window == 17


def test_fp8_block_weights_match_dequantized_reference(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import MiMoV2FlashForCausalLM

    block = (16, 16)
    q = quantize_fp8(tiny_dir, tmp_path / "fp8", block=block)
    assert (q / "model.safetensors.index.json").is_file()
    # reference: transformers on the dequantized weights (what FP8 block quantization really means)
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(q.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    assert any(t.dtype == torch.float8_e4m3fn for t in sd.values())
    deq = dequantize_fp8_state_dict(sd, block)
    ref_dir = _copy(tiny_dir, tmp_path / "deq")
    for f in ref_dir.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in deq.items()}, str(ref_dir / "model.safetensors"))
    hf = MiMoV2FlashForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    ref = reference_logits(hf, TOKENS)
    ours = _logits(q)
    assert (ours - ref).abs().max().item() <= 1e-4
    # and the quantization really changed the weights (so the check above is not vacuous)
    orig = reference_logits(MiMoV2FlashForCausalLM.from_pretrained(str(tiny_dir)).eval(), TOKENS)
    assert (ours - orig).abs().max().item() > 1e-4


def test_fused_expert_keys_load_to_same_logits(tiny_dir: Path, tmp_path: Path, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    d = _copy(tiny_dir, tmp_path / "fused")
    f = d / "model.safetensors"
    sd = load_file(str(f))
    cfg = ModelConfig.from_pretrained(d)
    for i in range(cfg.num_layers):
        if cfg.mlp_types[i] != "sparse":
            continue
        p = f"model.layers.{i}.mlp.experts."
        e = range(cfg.n_routed_experts)
        gate = [sd.pop(f"{p}{j}.gate_proj.weight") for j in e]
        up = [sd.pop(f"{p}{j}.up_proj.weight") for j in e]
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        sd[p + "down_proj"] = torch.stack([sd.pop(f"{p}{j}.down_proj.weight") for j in e])
    save_file(sd, str(f))
    assert (_logits(d) - reference_logits(hf_tiny, TOKENS)).abs().max().item() <= 1e-4


def _edit_weights(tiny_dir: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    d = _copy(tiny_dir, dst)
    f = d / "model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f))
    return d


def test_missing_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _edit_weights(
        tiny_dir, tmp_path / "m", lambda sd: sd.pop("model.layers.1.self_attn.attention_sink_bias")
    )
    with pytest.raises(LoadError, match=r"missing.*layers\.1\.self_attn\.attention_sink_bias"):
        load_model(d)


def test_unexpected_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _edit_weights(
        tiny_dir, tmp_path / "u", lambda sd: sd.__setitem__("model.layers.0.foo", torch.zeros(1))
    )
    with pytest.raises(LoadError, match=r"unexpected.*model\.layers\.0\.foo"):
        load_model(d)


def test_wrong_shape_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    def edit(sd):  # type: ignore[no-untyped-def]
        sd["model.layers.2.self_attn.k_proj.weight"] = sd["model.layers.2.self_attn.k_proj.weight"][:-1]

    d = _edit_weights(tiny_dir, tmp_path / "s", edit)
    with pytest.raises(LoadError, match="k_proj"):
        load_model(d)


def test_an_incomplete_mtp_layer_names_what_it_lacks(tiny_dir: Path, tmp_path: Path) -> None:
    d = _edit_weights(
        tiny_dir,
        tmp_path / "mtp",
        lambda sd: sd.__setitem__("model.mtp.layers.0.enorm.weight", torch.ones(64)),
    )
    with pytest.raises(LoadError, match=r"model\.mtp\.layers\.0\.hnorm\.weight"):
        load_model(d)


@pytest.mark.parametrize(
    "edit,msg",
    [
        ({"model_type": "llama"}, "unsupported model_type"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"hybrid_layer_pattern": [0, 1]}, "hybrid_layer_pattern"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"n_shared_experts": 1}, "shared experts"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1.0},
                }
            },
            "rope_type",
        ),
    ],
)
def test_unsupported_config_fails_clearly(tiny_dir: Path, edit: dict, msg: str) -> None:
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw.update(edit)
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_dict(raw)


def test_odd_rotary_dim_matches_reference(tiny_dir: Path, tmp_path: Path) -> None:
    """int(32 * 0.3) = 9 rotary dims: the reference rotates 10 with frequencies over 9."""
    from transformers import MiMoV2FlashForCausalLM

    d = _copy(tiny_dir, tmp_path / "odd")
    raw = json.loads((d / "config.json").read_text())
    for kind in raw["rope_parameters"].values():
        kind["partial_rotary_factor"] = 0.3
    (d / "config.json").write_text(json.dumps(raw))
    hf = MiMoV2FlashForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    assert (_logits(d) - reference_logits(hf, TOKENS)).abs().max().item() <= 1e-4

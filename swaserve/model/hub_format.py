"""The hub's checkpoint formats: ``to_hub_style`` rewrites a transformers-style config.json in the
XiaomiMiMo hub's spelling, ``quantize_fp8`` writes the hub's block-wise FP8 weights
(``quantization_config``: e4m3, dynamic activations, ``weight_block_size``) with their
``_scale_inv`` tensors, sharded with an index; ``load_state_dict`` reads either layout back.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swaserve.model.checkpoint import TOKENIZER_FILES, atomic_dir

FP8_MAX = 448.0  # largest finite float8_e4m3fn value

# Weights that the hub's FP8 checkpoints store as float8: attention projections, dense MLP, experts.
_FP8_WEIGHT = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


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
    with atomic_dir(dst, overwrite=False) as tmp:
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
    with atomic_dir(dst, overwrite=False) as tmp:
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

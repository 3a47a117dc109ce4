"""Load a MiMo-V2 Hugging Face checkpoint directory into ``MiMoV2ForCausalLM``.

Safetensors (single, sharded, indexed); per-expert (hub) or fused (transformers v5) expert weights,
stacked into ``w_gate``/``w_up`` [E, I, H] and ``w_down`` [E, H, I]; separate or fused qkv; FP8 block
weights (DeepSeek-V3 format) dequantized at load; MTP layers (``model.mtp.layers.N.*``, their count
from ``num_nextn_predict_layers``, else from the weights) into ``model.mtp``. Anything missing or
left over raises ``LoadError`` naming the tensors.

Key mapping: docs/DESIGN.md#modelloaderpy"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from swaserve.config import ModelConfig
from swaserve.model.meta import on_meta
from swaserve.model.mimo_v2 import MiMoV2ForCausalLM
from swaserve.model.mtp import count_mtp_layers
from swaserve.model.multimodal import TOWER_PREFIXES

if TYPE_CHECKING:
    from swaserve.model.ep import EPShard


class LoadError(RuntimeError):
    """The checkpoint's tensors do not match the model its config describes."""


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{model_dir}: index names missing shard files {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir}: no *.safetensors weights found")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in the checkpoint's safetensors files."""
    for f in _shard_files(Path(model_dir)):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, fh.get_tensor(name)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [out, in] float8_e4m3fn, scale_inv [ceil(out/bm), ceil(in/bn)] -> fp32 [out, in]."""
    bm, bn = block
    out_dim, in_dim = w.shape
    s = scale_inv.float().repeat_interleave(bm, 0)[:out_dim].repeat_interleave(bn, 1)[:, :in_dim]
    return w.float() * s


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    ep: EPShard | None = None,
) -> MiMoV2ForCausalLM:
    """Build the model from ``model_dir`` with weights in ``dtype`` on ``device``.

    With ``ep`` (expert parallelism) every MoE layer holds only that rank's routed experts.

    The router weight and correction bias stay fp32 (as in the checkpoint), like transformers.

    Raises:
        ConfigError: unsupported config. LoadError: missing/unexpected/mis-shaped tensors.
    """
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_pretrained(model_dir)
    raw: dict[str, torch.Tensor] = dict(iter_checkpoint(model_dir))
    if not cfg.num_mtp_layers:  # the config does not say: the weights do
        cfg = dataclasses.replace(cfg, num_mtp_layers=count_mtp_layers(set(raw)))
    with on_meta():
        model = MiMoV2ForCausalLM(cfg)
    experts = list(range(cfg.n_routed_experts))
    if ep is not None:
        model.shard_experts(ep)
        experts = list(ep.experts)
    block = tuple(cfg.quantization["weight_block_size"]) if cfg.quantization else None

    def take(name: str) -> torch.Tensor:
        t = raw.pop(name)
        if t.dtype == torch.float8_e4m3fn:
            sname = (
                name[: -len("weight")] + "weight_scale_inv"
                if name.endswith("weight")
                else name + "_scale_inv"
            )
            if sname not in raw or block is None:
                raise LoadError(f"FP8 tensor {name} has no {sname} (or config has no quantization_config)")
            t = dequantize_fp8(t, raw.pop(sname), (int(block[0]), int(block[1])))
        return t

    params: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def want(ours: str, *theirs: str) -> None:
        for name in theirs:
            if name in raw:
                params[ours] = take(name)
                return
        missing.append(theirs[0])

    want("embed_tokens.weight", "model.embed_tokens.weight")
    want("norm.weight", "model.norm.weight")
    if "lm_head.weight" in raw or not cfg.tie_word_embeddings:
        want("lm_head.weight", "lm_head.weight")
    elif "embed_tokens.weight" in params:
        params["lm_head.weight"] = params["embed_tokens.weight"]
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        want(o + "input_layernorm.weight", p + "input_layernorm.weight")
        want(o + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight")
        _load_attention(cfg.attn(i), p + "self_attn.", o + "self_attn.", raw, take, params, missing, want)
        if cfg.mlp_types[i] == "sparse":
            _load_moe(cfg, experts, p + "mlp.", o + "mlp.", raw, take, params, missing, want)
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                want(o + f"mlp.{n}.weight", p + f"mlp.{n}.weight")
    for j in range(cfg.num_mtp_layers):
        p, o = f"model.mtp.layers.{j}.", f"mtp.{j}."
        for name in ("enorm", "hnorm", "input_layernorm", "final_layernorm"):
            want(o + f"{name}.weight", p + f"{name}.weight")
        want(
            o + "post_attention_layernorm.weight",
            p + "pre_mlp_layernorm.weight",
            p + "post_attention_layernorm.weight",
        )
        want(o + "eh_proj.weight", p + "eh_proj.weight")
        _load_attention(cfg.swa, p + "self_attn.", o + "self_attn.", raw, take, params, missing, want)
        for name in ("gate_proj", "up_proj", "down_proj"):
            want(o + f"mlp.{name}.weight", p + f"mlp.{name}.weight")
    leftovers = sorted(
        k for k in raw if not k.endswith("rotary_emb.inv_freq") and not k.startswith(TOWER_PREFIXES)
    )
    if missing or leftovers:
        raise LoadError(
            f"{model_dir}: checkpoint does not match config: missing {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''} ({len(missing)}); unexpected {leftovers[:10]}"
            f"{' ...' if len(leftovers) > 10 else ''} ({len(leftovers)})"
        )
    fp32 = {"gate_weight", "e_score_correction_bias"}
    state = {}
    expected = dict(model.state_dict())
    for name, t in params.items():
        if name not in expected:
            raise LoadError(f"internal: no parameter {name}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise LoadError(
                f"{name}: checkpoint shape {tuple(t.shape)} != expected {tuple(expected[name].shape)}"
            )
        state[name] = t.to(torch.float32 if name.rsplit(".", 1)[-1] in fp32 else dtype)
    absent = set(expected) - set(state)
    if absent:
        raise LoadError(f"internal: parameters not loaded: {sorted(absent)[:10]}")
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


def _load_attention(shape, p, o, raw, take, params, missing, want):  # type: ignore[no-untyped-def]
    if p + "qkv_proj.weight" in raw:
        qkv = take(p + "qkv_proj.weight")
        nq, nk = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        nv = shape.num_kv_heads * shape.v_head_dim
        if qkv.shape[0] != nq + nk + nv:
            raise LoadError(f"{p}qkv_proj.weight has {qkv.shape[0]} rows, expected {nq + nk + nv}")
        params[o + "q_proj.weight"], params[o + "k_proj.weight"], params[o + "v_proj.weight"] = (
            qkv[:nq],
            qkv[nq : nq + nk],
            qkv[nq + nk :],
        )
    else:
        for n in ("q_proj", "k_proj", "v_proj"):
            want(o + f"{n}.weight", p + f"{n}.weight")
    want(o + "o_proj.weight", p + "o_proj.weight")
    if shape.has_sinks:
        want(o + "attention_sink_bias", p + "attention_sink_bias", p + "sinks")


def _load_moe(cfg, experts, p, o, raw, take, params, missing, want):  # type: ignore[no-untyped-def]
    """``experts``: the routed experts to keep, in local order (all of them without EP); the
    others' tensors are dropped unread by the caller."""
    want(o + "gate_weight", p + "gate.weight")
    want(o + "e_score_correction_bias", p + "gate.e_score_correction_bias")
    if p + "experts.gate_up_proj" in raw:
        gu = take(p + "experts.gate_up_proj")[experts]
        inter = cfg.moe_intermediate_size
        params[o + "w_gate"], params[o + "w_up"] = gu[:, :inter].contiguous(), gu[:, inter:].contiguous()
        if p + "experts.down_proj" in raw:
            params[o + "w_down"] = take(p + "experts.down_proj")[experts].contiguous()
        else:
            missing.append(p + "experts.down_proj")
        return
    keep = set(experts)
    for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        names = [f"{p}experts.{e}.{theirs}.weight" for e in range(cfg.n_routed_experts)]
        absent = [n for n in names if n not in raw]
        if absent:
            missing.extend(absent)
            continue
        for e, name in enumerate(names):  # another rank's expert: dropped (and its FP8 scale)
            if e not in keep:
                raw.pop(name)
                raw.pop(name[: -len("weight")] + "weight_scale_inv", None)
        params[o + ours] = torch.stack([take(names[e]) for e in experts])


def hub_tensor(model: MiMoV2ForCausalLM, name: str, like: torch.Tensor) -> torch.Tensor:
    """The tensor the checkpoint key ``name`` holds for ``model``'s current weights, in ``like``'s
    dtype and shape (the inverse of ``load_model``'s mapping, unquantized layouts).

    Raises:
        LoadError: a key ``load_model`` does not read, or a shape that differs."""
    cfg = model.cfg
    state = model.state_dict()
    ours: torch.Tensor | None = None
    m = re.match(r"^model\.(layers|mtp\.layers)\.(\d+)\.(.+)$", name)
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        ours = state[name.removeprefix("model.")]
    elif name == "lm_head.weight":
        ours = state["lm_head.weight"]
    elif m is not None:
        prefix = ("layers." if m[1] == "layers" else "mtp.") + m[2] + "."
        rest = m[3]
        rest = {"pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                "self_attn.sinks": "self_attn.attention_sink_bias",
                "mlp.gate.weight": "mlp.gate_weight",
                "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias",
                "mlp.experts.down_proj": "mlp.w_down"}.get(rest, rest)  # fmt: skip
        e = re.match(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", rest)
        if e is not None:
            ours = state[prefix + f"mlp.w_{e[2]}"][int(e[1])]
        elif rest == "mlp.experts.gate_up_proj":
            ours = torch.cat((state[prefix + "mlp.w_gate"], state[prefix + "mlp.w_up"]), dim=1)
        elif rest == "self_attn.qkv_proj.weight":
            ours = torch.cat([state[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        else:
            ours = state.get(prefix + rest)
    if ours is None or tuple(ours.shape) != tuple(like.shape):
        raise LoadError(
            f"{name}: no weight of shape {tuple(like.shape)} in the model ({cfg.num_layers} layers)"
        )
    return ours.detach().to(like.dtype).contiguous()


def save_weights(model: MiMoV2ForCausalLM, model_dir: str | Path) -> None:
    """Write ``model``'s weights over the checkpoint in ``model_dir``: every tensor of its
    safetensors files replaced by the model's (``hub_tensor``), same keys, dtypes and files.

    Raises:
        LoadError: as ``hub_tensor``; an FP8 checkpoint."""
    from safetensors.torch import save_file

    for f in _shard_files(Path(model_dir)):
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata()
            old = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118
        if all(n.startswith(TOWER_PREFIXES) for n in old):
            continue  # a media tower's file: not the language model's
        if any(t.dtype == torch.float8_e4m3fn for t in old.values()):
            raise LoadError(f"{f}: FP8 checkpoints are not written back")
        save_file(
            {n: t if n.startswith(TOWER_PREFIXES) else hub_tensor(model, n, t) for n, t in old.items()},
            str(f),
            metadata=meta,
        )

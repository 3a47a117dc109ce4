"""The MiMo-V2.5 ViT (swaserve.model.vision) against transformers' Qwen2.5-VL vision tower where the two
are the same architecture, and against a dense per-frame reference written here for the MiMo parts
(GQA, 1-D row/column windows, both sink readings), plus batching invariance, configs and weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from swaserve.model import vision_attention
from swaserve.model.vision import (
    _ACTS,
    VisionTransformer,
    random_vision_weights,
    vision_param_shapes,
    vision_state_dict_from_hub,
)
from swaserve.model.vision_config import ACTIVATIONS, VisionConfig

TOL = 1e-5
# fp32 ours vs the float64 reference: measured max |diff| ~1e-6 on outputs of magnitude ~2
# (the Qwen2.5-VL comparison: 2.7e-6, from the patch embedding: their Conv3d vs our Linear)

# the hub's vision_config of MiMo-V2.5 (research: epd_multimodal.md 1.1)
HUB = {
    "depth": 28,
    "hidden_size": 1280,
    "intermediate_size": 4608,
    "num_heads": 32,
    "num_key_value_heads": 8,
    "qk_channels": 64,
    "kv_channels": 64,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "hidden_act": "silu",
    "fullatt_block_indexes": [0, 9, 18, 27],
    "vit_window_attn_types": ([-1] + [0] * 4 + [1] * 4) * 3 + [-1],
    "visual_token_window_size": 64,
    "use_sink": True,
    "window_size": 128,  # Qwen's, unused by MiMo
    "tokens_per_second": 2,
}

# (t, h, w): an image 8x6, an image 4x8, a 2-frame video 4x4
GRID = [(1, 8, 6), (1, 4, 8), (2, 4, 4)]


def _cfg(**kw: object) -> VisionConfig:
    base: dict = dict(
        depth=5,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        out_hidden_size=24,
        patch_size=4,
        window_types=(1, 0, -1, 1, 1),  # enter column order at block 0, leave, re-enter, end in it
        window_size=3,
        use_sink=True,
    )
    base.update(kw)
    return VisionConfig(**base)


def _model(cfg: VisionConfig, seed: int = 0) -> VisionTransformer:
    m = VisionTransformer(cfg).eval()
    m.load_state_dict(random_vision_weights(cfg, seed))
    return m


def _patches(cfg: VisionConfig, grid: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grid)
    return torch.randn(n, cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


def _run(model: VisionTransformer, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
    with torch.no_grad():
        return model(x, torch.tensor(grid))


# --- an independent dense reference -------------------------------------------------------------


def _rows(
    cfg: VisionConfig, grid: list[tuple[int, int, int]]
) -> list[list[tuple[int, int, int, tuple, tuple]]]:
    """Per frame: (flat row, h pos, w pos, row-order key, column-order key) of each patch, rows in
    the processor's merge-unit order (t, h/m, w/m, m, m)."""
    m, row, frames = cfg.spatial_merge_size, 0, []
    for t, h, w in grid:
        for _ in range(t):
            frame = []
            for bh in range(h // m):
                for bw in range(w // m):
                    for mh in range(m):
                        for mw in range(m):
                            frame.append((row, bh * m + mh, bw * m + mw, (bh, bw, mh, mw), (bw, bh, mh, mw)))
                            row += 1
            frames.append(frame)
    return frames


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference(
    cfg: VisionConfig,
    sd: dict[str, torch.Tensor],
    x: torch.Tensor,
    grid: list[tuple[int, int, int]],
    kv_of_head=None,  # type: ignore[no-untyped-def]
) -> torch.Tensor:
    """Dense float64 forward: per frame and head an explicit [S, S] logit matrix; windows and the
    sink's key 0 defined by each patch's rank in the block's order (sorted by row- or column-major
    merge-unit keys), with no permutation of the rows at all."""
    sd = {k: v.double() for k, v in sd.items()}
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    kv_of_head = kv_of_head or (lambda h: h // (nh // nkv))
    frames = _rows(cfg, grid)
    hx = x.double() @ sd["patch_embed.proj.weight"].reshape(cfg.hidden_size, -1).T
    pos = torch.zeros(hx.shape[0], 2, dtype=torch.float64)
    for frame in frames:
        for r, hp, wp, _, _ in frame:
            pos[r] = torch.tensor([hp, wp], dtype=torch.float64)
    d = hd // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.cat([pos[:, 0:1] * inv, pos[:, 1:2] * inv], -1)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1)
        return t * cos[:, None] + half * sin[:, None]

    for i, kind in enumerate(cfg.types):
        p = f"blocks.{i}."
        h = _rms(hx, sd[p + "norm1.weight"], eps)
        qkv = h @ sd[p + "attn.qkv.weight"].T + sd[p + "attn.qkv.bias"]
        q = rope(qkv[:, : nh * hd].reshape(-1, nh, hd))
        k = rope(qkv[:, nh * hd : (nh + nkv) * hd].reshape(-1, nkv, hd))
        v = qkv[:, (nh + nkv) * hd :].reshape(-1, nkv, hd)
        att = torch.zeros(hx.shape[0], nh, hd, dtype=torch.float64)
        sinks = sd.get(p + "attn.sinks")
        for frame in frames:
            rows = torch.tensor([f[0] for f in frame])
            keys = [f[4] if kind == 1 else f[3] for f in frame]
            order = sorted(range(len(frame)), key=lambda j: keys[j])
            rank = torch.empty(len(frame), dtype=torch.float64)
            rank[torch.tensor(order)] = torch.arange(len(frame), dtype=torch.float64)
            allowed = torch.ones(len(frame), len(frame), dtype=torch.bool)
            if kind != -1:
                allowed = (rank[:, None] - rank[None, :]).abs() <= cfg.window_size
            for hh in range(nh):
                kh = kv_of_head(hh)
                logits = (q[rows, hh] @ k[rows, kh].T) / math.sqrt(hd)
                if sinks is not None and cfg.sink_mode == "key0_bias":
                    logits[:, order[0]] += sinks[hh]
                logits = logits.masked_fill(~allowed, float("-inf"))
                e = torch.exp(logits - logits.max(-1, keepdim=True).values)
                den = e.sum(-1, keepdim=True)
                if sinks is not None and cfg.sink_mode == "denominator":
                    den = den + torch.exp(sinks[hh] - logits.max(-1, keepdim=True).values)
                att[rows, hh] = (e / den) @ v[rows, kh]
        hx = hx + att.reshape(-1, nh * hd) @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        h = _rms(hx, sd[p + "norm2.weight"], eps)
        gate = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T + sd[p + "mlp.gate_proj.bias"])
        up = h @ sd[p + "mlp.up_proj.weight"].T + sd[p + "mlp.up_proj.bias"]
        hx = hx + (gate * up) @ sd[p + "mlp.down_proj.weight"].T + sd[p + "mlp.down_proj.bias"]
    h = _rms(hx, sd["merger.ln_q.weight"], eps).reshape(-1, cfg.hidden_size * cfg.spatial_merge_size**2)
    return F.gelu(h @ sd["merger.mlp.0.weight"].T) @ sd["merger.mlp.2.weight"].T


# --- (a) Qwen2.5-VL where the architectures coincide ---------------------------------------------


def test_equals_transformers_qwen2_5_vl_tower_on_the_shared_architecture() -> None:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = VisionConfig(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=4, head_dim=8,
                       out_hidden_size=48, patch_size=14)  # fmt: skip
    hcfg = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48, patch_size=14,
        temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[0, 1, 2, 3],
        hidden_act="silu",
    )  # fmt: skip
    hcfg._attn_implementation = "eager"
    ref = Qwen2_5_VisionTransformerPretrainedModel(hcfg).eval()
    sd = random_vision_weights(cfg, 0)
    hsd = dict(sd, **{"merger.mlp.0.bias": torch.zeros(128), "merger.mlp.2.bias": torch.zeros(48)})
    ref.load_state_dict(hsd, strict=True)  # the same names: the hub layout is Qwen2.5-VL's
    grid = [(1, 4, 6), (1, 8, 4)]
    x = _patches(cfg, grid)
    ours = _run(_model(cfg), x, grid)
    with torch.no_grad():
        theirs = ref(x, torch.tensor(grid)).pooler_output
    assert ours.shape == theirs.shape == (14, 48)
    assert (ours - theirs).abs().max().item() <= TOL
    assert theirs.abs().max().item() > 0.5  # not a vacuous comparison


# --- (b) MiMo features against the dense reference -----------------------------------------------


@pytest.mark.parametrize("q_block", [64, 4], ids=["one-block", "blockwise"])
@pytest.mark.parametrize("sink_mode", ["key0_bias", "denominator"])
def test_windows_gqa_sinks_column_order_equal_dense_reference(
    monkeypatch, sink_mode: str, q_block: int
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(vision_attention, "Q_BLOCK", q_block)  # 4: frames of 16-48 rows in 6-row blocks
    cfg = _cfg(sink_mode=sink_mode)
    sd = random_vision_weights(cfg, 0)
    x = _patches(cfg, GRID)
    ours = _run(_model(cfg), x, GRID)
    ref = reference(cfg, sd, x, GRID)
    assert ours.shape == (sum(t * h * w for t, h, w in GRID) // 4, 24)
    assert (ours.double() - ref).abs().max().item() <= TOL


def test_each_feature_changes_the_output() -> None:
    """Ablations: the comparisons above would catch an implementation that dropped any feature."""
    cfg = _cfg()
    sd = random_vision_weights(cfg, 0)
    x = _patches(cfg, GRID)
    base = _run(_model(cfg), x, GRID)

    def differs(other: torch.Tensor) -> float:
        return (other - base).abs().max().item()

    assert differs(_run(_model(_cfg(window_size=1000)), x, GRID)) > 1e-2  # the window binds
    assert differs(_run(_model(_cfg(window_types=(0, 0, -1, 0, 0))), x, GRID)) > 1e-2  # column order
    assert differs(_run(_model(_cfg(window_types=(1, 0, 0, 1, 1))), x, GRID)) > 1e-2  # full block
    assert differs(_run(_model(_cfg(sink_mode="denominator")), x, GRID)) > 1e-2  # the two sink readings
    no_sink = VisionTransformer(_cfg(use_sink=False)).eval()
    no_sink.load_state_dict({k: v for k, v in sd.items() if not k.endswith(".sinks")})
    assert differs(_run(no_sink, x, GRID)) > 1e-2
    wrong_groups = reference(cfg, sd, x, GRID, kv_of_head=lambda h: h % cfg.num_kv_heads)
    assert differs(wrong_groups.float()) > 1e-2  # query head h reads KV head h // 2, not h % 2
    # frames stay apart: the video's two frames attended as one sequence give other outputs
    one_seq = reference(cfg, sd, x, [*GRID[:2], (1, 8, 4)])
    assert (one_seq.float() - base)[-8:].abs().max().item() > 1e-2


def test_window_edge_is_inclusive() -> None:
    """|i - j| <= w: a window of w equals the reference's w and differs from w - 1."""
    cfg = _cfg(window_size=2, window_types=(0, 0, 0, 0, 0))
    sd = random_vision_weights(cfg, 3)
    x = _patches(cfg, GRID)
    ours = _run(_model(cfg, 3), x, GRID)
    assert (ours.double() - reference(cfg, sd, x, GRID)).abs().max().item() <= TOL
    narrower = VisionConfig(**{**cfg.__dict__, "window_size": 1})
    assert (ours.double() - reference(narrower, sd, x, GRID)).abs().max().item() > 1e-2


# --- (c) batching invariance ----------------------------------------------------------------------


@pytest.mark.parametrize("sink_mode", ["key0_bias", "denominator"])
def test_items_fused_equal_each_alone(sink_mode: str) -> None:
    cfg = _cfg(sink_mode=sink_mode)
    model = _model(cfg)
    grid = [*GRID, (1, 8, 6)]  # two same-size images: one [2, L] attention batch
    x = _patches(cfg, grid)
    fused = _run(model, x, grid)
    row = out = 0
    for t, h, w in grid:
        n = t * h * w
        alone = _run(model, x[row : row + n], [(t, h, w)])
        assert (fused[out : out + n // 4] - alone).abs().max().item() <= 1e-6  # measured: 0.0 here
        row, out = row + n, out + n // 4
    assert out == fused.shape[0]


def test_bfloat16_runs_close_to_float32() -> None:
    cfg = _cfg()
    model = _model(cfg)
    x = _patches(cfg, GRID)
    full = _run(model, x, GRID)
    half = _run(model.to(torch.bfloat16), x, GRID)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    assert (half.float() - full).abs().max().item() <= 0.05 * full.abs().max().item()


def test_bad_inputs_raise() -> None:
    cfg = _cfg()
    model = _model(cfg)
    x = _patches(cfg, GRID)
    with pytest.raises(ValueError, match="do not match grid"):
        _run(model, x[:-1], GRID)
    with pytest.raises(ValueError, match="multiples of 2"):
        _run(model, x[: 3 * 4], [(1, 3, 4)])
    with pytest.raises(ValueError, match=r"\[items, 3\]"):
        model(x, torch.tensor([1, 8, 6]))


# --- configs ----------------------------------------------------------------------------------------


def test_hub_config_gives_the_real_shapes() -> None:
    cfg = VisionConfig.from_hf(HUB, out_hidden_size=4096)
    assert cfg.full_blocks == (0, 9, 18, 27) and cfg.head_dim == 64 and cfg.num_kv_heads == 8
    assert cfg.sink_mode == "key0_bias" and cfg.window_size == 64
    shapes = vision_param_shapes(cfg)
    assert shapes["patch_embed.proj.weight"] == (1280, 3, 2, 16, 16)
    assert shapes["blocks.1.attn.qkv.weight"] == (3072, 1280)  # q 2048 + k 512 + v 512
    assert shapes["blocks.1.attn.proj.weight"] == (1280, 2048)
    assert shapes["merger.mlp.0.weight"] == (5120, 5120) and shapes["merger.mlp.2.weight"] == (4096, 5120)
    sinks = sorted(int(k.split(".")[1]) for k in shapes if k.endswith(".sinks"))
    assert sinks == [i for i in range(28) if i not in (0, 9, 18, 27)]  # 24 window blocks
    assert not any(k.startswith("merger") and k.endswith("bias") for k in shapes)
    assert sum(math.prod(s) for s in shapes.values()) > 600e6  # the model card's ~729M incl. merger


def test_config_round_trips_and_reads_defaults() -> None:
    cfg = VisionConfig.from_hf(HUB, out_hidden_size=4096)
    assert VisionConfig.from_hf(cfg.to_hf(), 4096) == cfg
    tiny = _cfg(sink_mode="denominator")
    assert VisionConfig.from_hf(tiny.to_hf(), tiny.out_hidden_size) == tiny
    # no window types: vLLM's reading of fullatt_block_indexes (row windows elsewhere)
    legacy = {k: v for k, v in HUB.items() if k != "vit_window_attn_types"}
    assert VisionConfig.from_hf(legacy, 4096).types == tuple(
        -1 if i in (0, 9, 18, 27) else 0 for i in range(28)
    )
    plain = {"depth": 2, "hidden_size": 32, "intermediate_size": 8, "num_heads": 4}
    mha = VisionConfig.from_hf(plain, 16)
    assert (mha.num_kv_heads, mha.head_dim, mha.types, mha.use_sink) == (4, 8, (-1, -1), False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vit_window_attn_types": [0] * 27}, "27 window types for depth 28"),
        ({"fullatt_block_indexes": [0, 9, 18]}, "disagree"),
        ({"fullatt_block_indexes": [0, 9, 18, 28]}, "outside depth"),
        ({"vit_window_attn_types": [2] * 28}, "must be -1, 0 or 1"),
        ({"num_key_value_heads": 5}, "not a multiple"),
        ({"kv_channels": 32}, "qk_channels 64 != kv_channels 32"),
        ({"sink_mode": "first_key"}, "sink_mode must be one of"),
        ({"out_hidden_size": 2048}, "out_hidden_size 2048 != the LLM hidden size 4096"),
        ({"hidden_act": "relu6"}, "hidden_act"),
        ({"qk_channels": 30, "kv_channels": 30}, "multiple of 4"),
        ({"depth": None}, "lacks 'depth'"),
    ],
)
def test_inconsistent_configs_raise(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf({**HUB, **change}, out_hidden_size=4096)


# --- weights ---------------------------------------------------------------------------------------


def test_random_weights_are_deterministic_and_nontrivial() -> None:
    cfg = _cfg()
    a, b, c = random_vision_weights(cfg, 7), random_vision_weights(cfg, 7), random_vision_weights(cfg, 8)
    assert a.keys() == vision_param_shapes(cfg).keys()
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(
        a["merger.mlp.2.weight"], c["merger.mlp.2.weight"]
    )
    norms = [v for k, v in a.items() if k.endswith(("norm1.weight", "norm2.weight", "ln_q.weight"))]
    assert norms and all((n - 1).abs().max() > 0.05 for n in norms)
    sinks = [v for k, v in a.items() if k.endswith(".sinks")]
    assert len(sinks) == 4 and all(s.abs().min() > 0 for s in sinks)  # window blocks only
    biases = [v for k, v in a.items() if k.endswith(".bias")]
    assert biases and all(v.abs().min() > 0 for v in biases)
    assert not any(k.startswith("merger") and k.endswith(".bias") for k in a)


def test_hub_state_dict_strips_prefixes_and_names_problems() -> None:
    cfg = _cfg()
    sd = random_vision_weights(cfg, 0)
    ckpt = {f"model.visual.{k}": v for k, v in sd.items()}
    ckpt["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(2, 2)  # the LLM's: ignored
    ckpt["model.visual.merger.mlp.0.bias"] = torch.zeros(128)  # an all-zero merger bias: dropped
    got = vision_state_dict_from_hub(ckpt, cfg)
    assert got.keys() == sd.keys()
    VisionTransformer(cfg).load_state_dict(got)
    assert vision_state_dict_from_hub({f"visual.{k}": v for k, v in sd.items()}, cfg).keys() == sd.keys()

    missing = {k: v for k, v in ckpt.items() if k != "model.visual.blocks.1.attn.sinks"}
    with pytest.raises(ValueError, match=r"missing \(1\): blocks\.1\.attn\.sinks"):
        vision_state_dict_from_hub(missing, cfg)
    extra = {
        **ckpt,
        "model.visual.blocks.2.attn.sinks": torch.ones(4),
        "model.visual.merger.mlp.2.bias": torch.ones(24),
    }
    with pytest.raises(ValueError, match=r"unexpected \(2\): blocks\.2\.attn\.sinks, merger\.mlp\.2\.bias"):
        vision_state_dict_from_hub(extra, cfg)
    with pytest.raises(ValueError, match=r"wrong shape \(1\): blocks\.0\.attn\.qkv\.bias"):
        vision_state_dict_from_hub({**ckpt, "model.visual.blocks.0.attn.qkv.bias": torch.zeros(3)}, cfg)
    with pytest.raises(ValueError, match="both"):
        vision_state_dict_from_hub({"visual.a": torch.zeros(1), "model.visual.a": torch.zeros(1)})
    with pytest.raises(ValueError, match="no vision tower weights"):
        vision_state_dict_from_hub({"model.embed_tokens.weight": torch.zeros(1)})


def test_the_config_names_every_activation_the_tower_builds() -> None:
    assert set(_ACTS) == set(ACTIVATIONS)

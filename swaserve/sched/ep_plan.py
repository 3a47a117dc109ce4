"""Expert-parallel (EP) size planner: the smallest EP whose ranks hold their share of the routed
experts, the replicated non-expert weights, the KV of a target load and a reserve::

    U = utilization x gpu_memory                              usable bytes per GPU
    w_ne + W_e / EP + KV(layout) + reserve <= U               per GPU, DP attention
    EP_min = min{ d | d divides E, d >= W_e / (U - w_ne - reserve - KV) }

``w_ne``: non-expert weights (attention, dense MLP, router, embeddings, norms, MTP) replicated on
every rank; ``W_e``: all routed-expert weights; ``E``: routed experts. KV per GPU of ``concurrency``
requests of ``context`` tokens each (``b_f``, ``b_s``: KV bytes per token of all full / all SWA
layers, MTP layers counted as SWA layers; ``W`` the window; ``chunk`` one step's prefill tokens)::

    full layout (SWA-unaware):  concurrency x context x (b_f + b_s)
    hybrid layout:              concurrency x (context x b_f + min(context, W) x b_s) + chunk x b_s

Weights come from the shape (``param_counts``) where every weight shape is public; otherwise
(MiMo-V2.5-Pro) from the published total and an assumed expert fraction. Sans IO; the command is
``swaserve plan-ep`` (``swaserve.plan_cli``). Derivation and checks: docs/DESIGN.md#schedep_planpy"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from swaserve.config import AttnShape, ConfigError, ModelConfig, kv_config
from swaserve.shapes import SHAPES, model_config, shape

LAYOUTS = ("hybrid", "full")
EXPERT_FRACTION = 0.98  # routed experts / total params where the shape is not public (Flash: 98.1%)
SWEEP_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
FORMULA = (
    "per GPU (DP attention): w_ne + W_e / EP + KV(layout) + reserve <= U = utilization x GPU memory",
    "EP_min = min{ d | d divides E, d >= W_e / (U - w_ne - reserve - KV) }",
    "KV full layout:   concurrency x context x (b_f + b_s)",
    "KV hybrid layout: concurrency x (context x b_f + min(context, W) x b_s) + chunk x b_s",
)
ASSUMPTIONS = (
    "non-expert weights (attention, dense MLP, router, embeddings, norms, MTP) replicated on every "
    "rank (DP attention); experts split evenly, no redundant (EPLB) experts",
    "MTP layers keep SWA KV like the decoder's SWA layers (b_s includes them)",
    "KV is theoretical: no paging round-up (at most ~2 pages per request in the engine)",
    "FP8 block scales (4 B per 128x128 block, +0.02% of expert bytes) not counted",
    "reserve covers activations, all-to-all buffers, CUDA graphs and workspace",
)


class Params(NamedTuple):
    """Parameter counts of a checkpoint's shape, by part (``param_counts``)."""

    experts: int  # routed experts, every MoE layer
    router: int  # MoE gates and their score-correction biases
    attention: int  # q, k, v, o projections and sink biases
    dense_mlp: int  # the dense (non-MoE) layers' SwiGLU MLPs
    embeddings: int  # embed_tokens and lm_head (once when tied)
    norms: int
    mtp: int  # the MTP layers (their own attention, dense MLP, eh_proj, norms)

    @property
    def total(self) -> int:
        return sum(self)

    @property
    def non_expert(self) -> int:
        return self.total - self.experts


def attention_params(cfg: ModelConfig, a: AttnShape) -> int:
    """q, k, v, o projection weights (no biases) plus one sink bias per head, if any."""
    h = cfg.hidden_size
    qkv = h * (a.num_heads * a.head_dim + a.num_kv_heads * (a.head_dim + a.v_head_dim))
    return qkv + a.num_heads * a.v_head_dim * h + (a.num_heads if a.has_sinks else 0)


def param_counts(cfg: ModelConfig, mtp_layers: int | None = None) -> Params:
    """Parameters of ``cfg`` computed from its shapes; ``mtp_layers`` (default: the checkpoint's)
    MTP layers, each ``eh_proj [H, 2H]``, one SWA attention, a dense MLP and 5 norms (the layout of
    the hub's ``model.mtp.layers.N.*``). Flash: 308.78B without MTP (309B published) + 3 x 329M."""
    h, moe = cfg.hidden_size, cfg.mlp_types.count("sparse")
    mtp = cfg.num_mtp_layers if mtp_layers is None else mtp_layers
    mlp = 3 * h * cfg.intermediate_size  # gate, up, down
    return Params(
        experts=moe * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size,
        router=moe * cfg.n_routed_experts * (h + 1),
        attention=sum(attention_params(cfg, cfg.attn(i)) for i in range(cfg.num_layers)),
        dense_mlp=cfg.mlp_types.count("dense") * mlp,
        embeddings=cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2),
        norms=(2 * cfg.num_layers + 1) * h,
        mtp=mtp * (2 * h * h + attention_params(cfg, cfg.swa) + mlp + 5 * h),
    )


class Weights(NamedTuple):
    """Parameters the planner sizes: computed (``parts``) or assumed (``source`` says which)."""

    expert_params: float
    non_expert_params: float
    source: str
    parts: Params | None = None


class KVPerToken(NamedTuple):
    """KV bytes per token over all full layers (``full``) and all SWA layers, MTP ones included
    (``swa``); ``window``: previous tokens a SWA layer keeps."""

    full: int
    swa: int
    window: int


def kv_per_token(cfg: ModelConfig, mtp_layers: int, dtype_bytes: int) -> KVPerToken:
    """K+V bytes per token; Flash in bf16 with 3 MTP layers: 9 x 2,560 = 23,040 full and
    (39 + 3) x 5,120 = 215,040 SWA."""
    k = kv_config(cfg, mtp_layers)
    return KVPerToken(
        len(k.full_layers) * k.full.kv_bytes_per_token(dtype_bytes),
        len(k.swa_layers) * k.swa.kv_bytes_per_token(dtype_bytes),
        k.window,
    )


@dataclass(frozen=True)
class Inputs:
    """What a GPU must hold. Bytes are decimal (141 GB = 141e9 B).

    Attributes:
        gpu_bytes: HBM per GPU. utilization: the share of it usable (U = utilization x gpu_bytes).
        reserve_bytes: activations, all-to-all buffers and workspace per GPU.
        context: KV tokens per request. concurrency: requests per GPU (per DP-attention rank).
        chunk: prefill tokens of one step per GPU (their SWA KV is held until the step ends).
        kv_dtype_bytes: bytes per KV element. expert_bytes, non_expert_bytes: bytes per parameter.
    """

    gpu_bytes: int = 141 * 10**9
    utilization: float = 0.9
    reserve_bytes: int = 8 * 10**9
    context: int = 32768
    concurrency: int = 8
    chunk: int = 8192
    kv_dtype_bytes: int = 2
    expert_bytes: float = 1.0
    non_expert_bytes: float = 2.0

    @property
    def tokens(self) -> int:
        """KV tokens per GPU: concurrency x context."""
        return self.concurrency * self.context

    @property
    def usable_bytes(self) -> float:
        return self.utilization * self.gpu_bytes


def kv_bytes(kv: KVPerToken, layout: str, i: Inputs) -> int:
    """KV bytes per GPU of ``layout`` (module formula). Raises ValueError for another layout."""
    if layout == "full":
        return i.tokens * (kv.full + kv.swa)
    if layout == "hybrid":
        per_request = i.context * kv.full + min(i.context, kv.window) * kv.swa
        return i.concurrency * per_request + min(i.chunk, i.tokens) * kv.swa
    raise ValueError(f"kv layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def smallest_ep(experts: int, expert_bytes: float, free_bytes: float) -> int | None:
    """The smallest divisor d of ``experts`` with ``expert_bytes / d <= free_bytes``; None if even
    one expert per rank does not fit."""
    for d in range(1, experts + 1):
        if experts % d == 0 and expert_bytes / d <= free_bytes:
            return d
    return None


class LayoutPlan(NamedTuple):
    """One layout's answer; ``ep_size`` None: no EP fits (every other field then at EP = E)."""

    layout: str
    kv_bytes: int
    free_bytes: float  # U - non-expert - reserve - KV: what the experts may take per GPU
    ep_size: int | None
    expert_bytes_per_gpu: float  # at ep_size (at E experts' worth of ranks when none fits)
    headroom_bytes: float  # U minus everything, at ep_size
    capacity_tokens: int  # KV tokens per GPU this layout holds at ep_size, same concurrency


@dataclass(frozen=True)
class Plan:
    """Both layouts' EP for one model and ``Inputs`` (``plan``)."""

    model: str
    experts: int
    mtp_layers: int
    weights: Weights
    kv: KVPerToken
    inputs: Inputs
    non_expert_bytes: float
    expert_bytes: float
    layouts: dict[str, LayoutPlan]

    def kv_room(self, ep: int) -> float:
        """KV bytes per GPU left at ``ep`` ranks: U - w_ne - reserve - W_e / ep (< 0: no fit)."""
        return (
            self.inputs.usable_bytes
            - self.non_expert_bytes
            - self.inputs.reserve_bytes
            - self.expert_bytes / ep
        )

    def halving(self) -> float | None:
        """EP of the full layout / EP of the hybrid layout (None when either does not fit)."""
        f, h = self.layouts["full"].ep_size, self.layouts["hybrid"].ep_size
        return None if f is None or h is None else f / h

    def to_json(self, layout: str = "hybrid") -> dict[str, Any]:
        """Every input, assumption and intermediate; ``ep_size`` is ``layout``'s (null: no fit)."""
        w = self.weights
        return {
            "ep_size": self.layouts[layout].ep_size,
            "layout": layout,
            "model": self.model,
            "routed_experts": self.experts,
            "mtp_layers": self.mtp_layers,
            "inputs": asdict(self.inputs) | {"tokens_per_gpu": self.inputs.tokens},
            "usable_bytes": self.inputs.usable_bytes,
            "weights": {
                "expert_params": w.expert_params,
                "non_expert_params": w.non_expert_params,
                "source": w.source,
                "parts": w.parts._asdict() if w.parts else None,
                "expert_bytes_total": self.expert_bytes,
                "non_expert_bytes_per_gpu": self.non_expert_bytes,
            },
            "kv_bytes_per_token": self.kv._asdict(),
            "layouts": {k: v._asdict() for k, v in self.layouts.items()},
            "full_over_hybrid_ep": self.halving(),
            "formula": list(FORMULA),
            "assumptions": list(ASSUMPTIONS),
        }


def plan(
    name: str, cfg: ModelConfig, weights: Weights, inputs: Inputs, mtp_layers: int | None = None
) -> Plan:
    """The smallest EP of each layout (module formula) for ``cfg`` with ``weights``.

    Raises:
        ValueError: ``cfg`` has no routed experts, or an input is out of range.
    """
    if cfg.n_routed_experts < 1:
        raise ValueError(f"{name} has no routed experts: expert parallelism does not apply")
    if not 0 < inputs.utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {inputs.utilization}")
    if min(inputs.context, inputs.concurrency, inputs.kv_dtype_bytes) < 1 or inputs.chunk < 0:
        raise ValueError("context, concurrency and KV dtype bytes must be >= 1, chunk >= 0")
    mtp = cfg.num_mtp_layers if mtp_layers is None else mtp_layers
    kv = kv_per_token(cfg, mtp, inputs.kv_dtype_bytes)
    w_e = weights.expert_params * inputs.expert_bytes
    w_ne = weights.non_expert_params * inputs.non_expert_bytes
    out = Plan(name, cfg.n_routed_experts, mtp, weights, kv, inputs, w_ne, w_e, {})
    for layout in LAYOUTS:
        need = kv_bytes(kv, layout, inputs)
        free = out.kv_room(1) + w_e - need  # what the experts may take per GPU
        ep = smallest_ep(cfg.n_routed_experts, w_e, free)
        per_gpu = w_e / (ep or cfg.n_routed_experts)
        room = out.kv_room(ep or cfg.n_routed_experts)  # KV bytes this EP leaves
        if layout == "full":
            cap = room / (kv.full + kv.swa)
        else:  # the windows and the chunk at this concurrency first, then full-layer tokens
            cap = (room - (inputs.concurrency * kv.window + inputs.chunk) * kv.swa) / kv.full
        out.layouts[layout] = LayoutPlan(layout, need, free, ep, per_gpu, free - per_gpu, max(0, int(cap)))
    return out


def computed_weights(cfg: ModelConfig) -> Weights:
    """``Weights`` of every part ``param_counts`` computes from ``cfg`` (its MTP layers included)."""
    parts = param_counts(cfg)
    return Weights(parts.experts, parts.non_expert, "computed from the shape", parts)


def resolve(
    shape_or_dir: str, expert_params: float | None = None, total_params: float | None = None
) -> tuple[str, ModelConfig, Weights]:
    """A public shape's name (any case) or a checkpoint directory -> (name, config, weights).

    Weights: computed from the shape (``param_counts``) when every weight shape is known; else
    ``expert_params`` (default ``EXPERT_FRACTION`` x the published total) and the rest of
    ``total_params`` (default: published). Either flag overrides a computed count.

    Raises:
        ValueError: not a known shape nor a directory with a readable MiMo-V2 config.json, or
            counts that leave no non-expert parameters.
    """
    try:
        s = shape(shape_or_dir)
    except ValueError:
        if not Path(shape_or_dir).is_dir():
            known = ", ".join(x.name.lower() for x in SHAPES)
            raise ValueError(f"{shape_or_dir!r} is neither a known shape ({known}) nor a directory") from None
        try:
            cfg = ModelConfig.from_pretrained(shape_or_dir)
        except ConfigError as e:
            raise ValueError(str(e)) from e
        name, public, published = str(shape_or_dir), True, 0.0
    else:
        cfg, name, public, published = model_config(s), s.name, s.weights_public, s.published_params
    parts = param_counts(cfg) if public else None
    if parts is not None and expert_params is None and total_params is None:
        return name, cfg, computed_weights(cfg)
    total = total_params if total_params is not None else (parts.total if parts else published)
    if expert_params is not None:
        experts, how = expert_params, "--expert-params"
    elif parts is not None:
        experts, how = parts.experts, "computed from the shape"
    else:
        experts, how = EXPERT_FRACTION * total, f"assumed {EXPERT_FRACTION:.0%} of the total"
    if total - experts <= 0:
        raise ValueError(f"total params {total:.4g} leave no non-expert params beside {experts:.4g} experts")
    src = f"experts {how}; non-expert = total ({'--total-params' if total_params else 'published'}) - experts"
    if not public:
        src += f" (hidden/moe_intermediate of {name} are not public; MTP not counted)"
    return name, cfg, Weights(experts, total - experts, src, parts)


def sweep(
    name: str,
    cfg: ModelConfig,
    weights: Weights,
    inputs: Inputs,
    contexts: tuple[int, ...] = SWEEP_CONTEXTS,
    mtp_layers: int | None = None,
) -> list[Plan]:
    """``plan`` at each context per request (the other inputs as given)."""
    return [plan(name, cfg, weights, replace(inputs, context=c), mtp_layers) for c in contexts]

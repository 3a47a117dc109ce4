"""Model and engine configuration: ``ModelConfig`` from a MiMo-V2 ``config.json`` (transformers or hub
key spelling; hub keys win), ``EngineConfig``; a config we cannot run raises ``ConfigError``.

Window convention: ``sliding_window`` counts the query itself (129 = 128 previous tokens + self), as
transformers does; ``window`` (= sliding_window - 1) is what a SWA query sees and the KV pools keep.

Design notes: docs/DESIGN.md#configpy"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

FULL = "full_attention"
SWA = "sliding_attention"
LayerKind = Literal["full_attention", "sliding_attention"]


class ConfigError(ValueError):
    """The checkpoint's config is missing a key, inconsistent, or describes something unsupported."""


@dataclass(frozen=True)
class AttnShape:
    """Head shapes of one attention kind (full or SWA)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim
    v_head_dim: int
    rope_theta: float
    rotary_dim: int  # int(head_dim * partial_rotary_factor); 2 * ceil(rotary_dim / 2) leading dims rotate
    has_sinks: bool

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K+V bytes for one token in one layer of this kind."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * dtype_bytes


@dataclass(frozen=True)
class ModelConfig:
    """Everything about a MiMo-V2 checkpoint that changes logits or KV layout."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: FULL or SWA
    mlp_types: tuple[str, ...]  # per layer: "dense" or "sparse"
    full: AttnShape
    swa: AttnShape
    sliding_window: int  # tokens a SWA query sees, counting itself
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    value_scale: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_mtp_layers: int = 0
    quantization: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def window(self) -> int:
        """Previous tokens a SWA query attends to (sliding_window - 1)."""
        return self.sliding_window - 1

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def swa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SWA]

    def attn(self, layer: int) -> AttnShape:
        return self.full if self.layer_types[layer] == FULL else self.swa

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> ModelConfig:
        model_type = c.get("model_type")
        if model_type not in ("mimo_v2_flash", "mimo_v2"):
            raise ConfigError(f"unsupported model_type {model_type!r}: swaserve runs MiMo-V2 (mimo_v2_flash)")
        text = c.get("text_config", c)

        def req(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json is missing required key {key!r}")
            return text[key]

        n_layers = int(req("num_hidden_layers"))
        layer_types = _layer_types(text, n_layers)
        mlp_types = _mlp_types(text, n_layers)
        heads = int(req("num_attention_heads"))
        kv_heads = int(req("num_key_value_heads"))
        head_dim = int(text.get("head_dim") or int(req("hidden_size")) // heads)
        v_head_dim = int(text.get("v_head_dim") or head_dim)
        rope = text.get("rope_parameters") or {}
        full_rope = rope.get(FULL, rope if "rope_theta" in rope else {})
        swa_rope = rope.get(SWA, full_rope)
        full_theta = float(text.get("rope_theta", full_rope.get("rope_theta", 10000.0)))
        swa_theta = float(text.get("swa_rope_theta", swa_rope.get("rope_theta", full_theta)))
        for r in (full_rope, swa_rope):
            if r.get("rope_type", "default") != "default":
                raise ConfigError(
                    f"unsupported rope_type {r.get('rope_type')!r} (only 'default' is implemented)"
                )
        if text.get("rope_scaling"):
            raise ConfigError("rope_scaling is not supported")
        prf_full = float(text.get("partial_rotary_factor", full_rope.get("partial_rotary_factor", 1.0)))
        prf_swa = float(text.get("partial_rotary_factor", swa_rope.get("partial_rotary_factor", prf_full)))
        swa_heads = int(text.get("swa_num_attention_heads") or heads)
        # transformers hard-codes SWA kv heads = 2x full kv heads; the hub key states it explicitly.
        swa_kv_heads = int(text.get("swa_num_key_value_heads") or kv_heads * 2)
        swa_head_dim = int(text.get("swa_head_dim") or head_dim)
        swa_v_head_dim = int(text.get("swa_v_head_dim") or v_head_dim)
        if swa_heads != heads:
            raise ConfigError("swa_num_attention_heads != num_attention_heads is not supported")
        for nh, nkv, what in ((heads, kv_heads, "full"), (swa_heads, swa_kv_heads, "SWA")):
            if nh % nkv:
                raise ConfigError(f"{what} attention: {nh} heads not divisible by {nkv} kv heads")
        full_sinks = bool(text.get("add_full_attention_sink_bias", False))
        swa_sinks = bool(text.get("add_swa_attention_sink_bias", True))
        if "sliding_window_size" in text:
            sliding_window = int(text["sliding_window_size"]) + 1
        else:
            sliding_window = int(req("sliding_window"))
        if sliding_window < 2:
            raise ConfigError(f"sliding_window must be >= 2 (query + 1 previous token), got {sliding_window}")
        n_experts = int(text.get("n_routed_experts") or text.get("num_local_experts") or 0)
        if "sparse" in mlp_types and n_experts == 0:
            raise ConfigError("MoE layers present but n_routed_experts is 0")
        n_group = int(text.get("n_group") or 1)
        if n_experts and n_experts % n_group:
            raise ConfigError(f"n_routed_experts {n_experts} not divisible by n_group {n_group}")
        scoring = text.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"unsupported scoring_func {scoring!r} (MiMo-V2 routes with sigmoid)")
        if int(text.get("n_shared_experts") or 0):
            raise ConfigError("shared experts are not part of MiMo-V2 and are not supported")
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {text.get('hidden_act')!r}")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported")
        eps = float(text.get("layernorm_epsilon", text.get("rms_norm_eps", 1e-5)))
        vscale = text.get("attention_value_scale")
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        quant = c.get("quantization_config")
        if quant is not None:
            if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
                raise ConfigError(f"unsupported quantization_config {quant!r} (FP8 e4m3 block only)")
            if not quant.get("weight_block_size"):
                raise ConfigError("FP8 quantization_config without weight_block_size is not supported")
        return cls(
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            num_layers=n_layers,
            layer_types=layer_types,
            mlp_types=mlp_types,
            full=AttnShape(
                heads, kv_heads, head_dim, v_head_dim, full_theta, _rotary_dim(head_dim, prf_full), full_sinks
            ),
            swa=AttnShape(
                swa_heads,
                swa_kv_heads,
                swa_head_dim,
                swa_v_head_dim,
                swa_theta,
                _rotary_dim(swa_head_dim, prf_swa),
                swa_sinks,
            ),
            sliding_window=sliding_window,
            intermediate_size=int(text.get("intermediate_size") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            n_routed_experts=n_experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            n_group=n_group,
            topk_group=int(text.get("topk_group") or 1),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            routed_scaling_factor=float(text.get("routed_scaling_factor") or 1.0),
            rms_norm_eps=eps,
            value_scale=float(vscale) if vscale is not None else 1.0,
            max_position_embeddings=int(text.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            hidden_act="silu",
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_mtp_layers=int(text.get("num_nextn_predict_layers") or 0),
            quantization=quant,
        )


def kv_config(cfg: ModelConfig, mtp_layers: int, residual_layers: int = 0) -> ModelConfig:
    """``cfg`` as the KV pools see it with ``mtp_layers`` MTP layers running: each one more SWA
    layer (its KV is SWA KV at the same positions and page tables; ``engine.drafter``), appended
    after the decoder's layers; then ``residual_layers`` more SWA layers, the full-precision
    residual of each full layer under KIVI (``swaserve.kvformat``). Sizing, storage, the host
    tier and PD transfer take this config; the model keeps ``cfg``."""
    extra = mtp_layers + residual_layers
    if extra == 0:
        return cfg
    return replace(
        cfg,
        num_layers=cfg.num_layers + extra,
        layer_types=cfg.layer_types + (SWA,) * extra,
        mlp_types=cfg.mlp_types + ("dense",) * extra,
    )


def _rotary_dim(head_dim: int, factor: float) -> int:
    """``int(head_dim * factor)``, as the reference computes it (an odd value rotates one more dim)."""
    dim = int(head_dim * factor)
    if not 2 <= dim <= head_dim:
        raise ConfigError(
            f"rotary dim {dim} (head_dim {head_dim} x partial_rotary_factor {factor}) out of range"
        )
    return dim


def _layer_types(c: dict[str, Any], n: int) -> tuple[str, ...]:
    pattern = c.get("hybrid_layer_pattern")
    if pattern is not None:
        if len(pattern) != n or any(p not in (0, 1) for p in pattern):
            raise ConfigError(
                f"hybrid_layer_pattern must be {n} entries of 0 (full) / 1 (SWA), got {pattern}"
            )
        return tuple(SWA if p else FULL for p in pattern)
    types = c.get("layer_types")
    if types is None:  # transformers' default: layer 0 and every 6th layer full
        return tuple(FULL if (i == 0 or (i + 1) % 6 == 0) else SWA for i in range(n))
    if len(types) != n or any(t not in (FULL, SWA) for t in types):
        raise ConfigError(f"layer_types must be {n} entries of {FULL!r}/{SWA!r}, got {types}")
    return tuple(types)


def _mlp_types(c: dict[str, Any], n: int) -> tuple[str, ...]:
    freq = c.get("moe_layer_freq")
    if isinstance(freq, list):
        if len(freq) != n:
            raise ConfigError(f"moe_layer_freq must have {n} entries, got {len(freq)}")
        return tuple("sparse" if f else "dense" for f in freq)
    types = c.get("mlp_layer_types")
    if types is None:
        return ("dense",) + ("sparse",) * (n - 1)
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(f"mlp_layer_types must be {n} entries of 'dense'/'sparse', got {types}")
    return tuple(types)


KVLayout = Literal["hybrid", "full"]


@dataclass
class EngineConfig:
    """Engine knobs (CLI flags map 1:1).

    Attributes:
        page_size: Tokens per KV page, both pools.
        kv_cache_memory: Bytes for both KV pools together (split by ``kvcache.sizing``).
        kv_layout: "hybrid" (SWA layers keep only their window) or "full" (SWA-unaware baseline).
        max_num_seqs: Most requests running at once; also the expected concurrency used to size the
            SWA pool.
        max_num_batched_tokens: Token budget per engine step (decode tokens + prefill chunks).
        max_model_len: Longest prompt + output, tokens (default: the model's max positions).
        dtype: "float32" | "bfloat16" | "float16" for activations and KV.
        device: "cpu", "cuda", ... (default: CUDA when present).
        enable_prefix_caching: reuse the KV of cached prefixes (SWA-aware radix tree).
        host_cache_memory: bytes of the host-memory tier behind the device pools (0 = none): one
            host arena both kinds share (as the device's), or with ``swa_full_tokens_ratio`` split
            between full and SWA pages in the device pools' proportion.
        host_write_policy: "on_evict" (copy pages to host when the device evicts them) or
            "second_hit" (copy a node when it is hit the second time).
        swa_full_tokens_ratio: with prefix caching and the hybrid layout, a fixed split: SWA-pool
            pages per full-pool page (at least what running requests need). None = one KV arena
            both kinds draw from, split by the traffic (``kvcache.arena``, ``kvcache.adaptive``).
            The SWA pages also hold cached windows (prompt ends, branch points, chunk checkpoints).
        schedule_policy: admission order of waiting requests: "fcfs" or "compute" (fewest uncached
            tokens first with aging and a bound, ``sched.priority.ComputeAwarePriority``).
        priority_max_wait_s, priority_wait_weight: its starvation bound (s) and aging weight.
        cost_model: the ``sched.cost`` preset whose prefill times the priority compares.
        index_block_tokens: log the prefix cache's stored / removed blocks of this many tokens (a
            multiple of ``page_size``) for the router's precise-mode index; None = no events.
        engine_process: where the engine core steps: "inline" (on the server's event loop),
            "separate" (its own process behind an IPC client) or "auto" (``engine.factory``).
        engine_step_timeout: separate core only: seconds a core holding work may send nothing
            (one step) before it is killed as hung and handled as dead; 0 = never.
        speculative_num_steps: MTP speculative decoding: draft tokens per step, one per MTP layer
            (0 = off; at most the checkpoint's ``num_nextn_predict_layers``). Their KV: extra SWA
            layers (``kv_config``).
        l3_url: the L3 KV cache (GCache) the host tier reads from and writes back to
            (``gcache.l3.connect``: ``gcache://host:port``, ``redis://...`` for the nodes a Redis
            registry lists, ``local://name``); None = no L3. Needs a host tier.
        l3_min_tokens: the least hit extension worth an L3 fetch (at least the window).
        l3_timeout_s, l3_timeout_per_ki_token_s: a fetch's deadline, base + per 1024 tokens.
        weights_id: the weights' identity in L3 keys (None: a digest of the weight files).
        ep_size: expert parallelism: ranks (processes) of one instance, each with 1/ep_size of
            the routed experts and its own requests (data-parallel attention); 1 = off. Needs a
            separate engine process (``engine.ep_client``).
        ep_placement: a JSON file placing the experts on ranks (``model.ep.ExpertPlacement``;
            None: contiguous).
        ep_timeout_s: seconds a rank waits in an EP collective for its peers before it gives up
            (the instance then exits; a dead peer is noticed at once).
        ep_launcher: how the ranks start: "process" (child processes) or "ray" (actors in a
            Ray placement group: ``engine.ray_ranks``).
        ray_address: the Ray cluster ``ep_launcher`` ray joins (None: ``RAY_ADDRESS``, else a
            local Ray on 127.0.0.1).
        kv_cache_dtype: the full pool's page format (``swaserve.kvformat``): "auto" (``dtype``),
            "fp8_e4m3", "fp8_e5m2", "int8". kv_cache_dtype_swa: the SWA pool's (None: the same).
        kv_quant_group: channels per scale of the quantized formats (0: one per token and head).
        kv_kivi_group: KIVI: tokens per key group (0: the page size). kv_kivi_residual: KIVI: recent
            tokens read in full precision (0: min(128, W)).
        kv_sink_tokens: the first N prompt tokens' full-layer K/V read in full precision
            (attention sinks, ``engine.sinks``); needs a quantized full pool; 0 = off.
    """

    page_size: int = 16
    kv_cache_memory: int = 256 * 1024 * 1024
    kv_layout: KVLayout = "hybrid"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    host_cache_memory: int = 0
    host_write_policy: str = "on_evict"
    swa_full_tokens_ratio: float | None = None
    schedule_policy: str = "fcfs"
    priority_max_wait_s: float = 30.0
    priority_wait_weight: float = 0.1
    cost_model: str = "cpu-tiny"
    index_block_tokens: int | None = None
    engine_process: str = "auto"
    engine_step_timeout: float = 120.0
    speculative_num_steps: int = 0
    l3_url: str | None = None
    l3_min_tokens: int = 256
    l3_timeout_s: float = 2.0
    l3_timeout_per_ki_token_s: float = 0.1
    weights_id: str | None = None
    ep_size: int = 1
    ep_placement: str | None = None
    ep_timeout_s: float = 60.0
    ep_launcher: str = "process"
    ray_address: str | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_swa: str | None = None
    kv_quant_group: int = 0
    kv_kivi_group: int = 0
    kv_kivi_residual: int = 0
    kv_sink_tokens: int = 0

    def kv_formats(self) -> dict[str, str]:
        """Each pool's page format name: {"full_attention": ..., "sliding_attention": ...}."""
        return {FULL: self.kv_cache_dtype, SWA: self.kv_cache_dtype_swa or self.kv_cache_dtype}

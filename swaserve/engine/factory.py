"""Builds the engine client ``--engine-process`` asks for: inline or the core in its own process.

``auto`` = separate on every device. Measured (``swaserve bench frontend``, 2-core CPU, make-run
workload, docs/BENCHMARKS.md): saturated output tokens/s separate / inline 0.97; replay TTFT p50
8.6 s vs 10.6 s, ITL p50 199 ms vs 138 ms (the fronts' CPU work competes with the cores on 2
cores); during an 8k-token prefill probes answer in both (p99 <= 40 ms; inline runs each step on
a step thread). On CUDA the front's CPU work overlaps the GPU forward (not measured: no device).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from swaserve.config import EngineConfig
from swaserve.cpus import usable_cpus
from swaserve.engine.client import LocalEngineClient

EngineProcess = Literal["inline", "separate"]


def resolve_engine_process(mode: str, device: str | None = None) -> EngineProcess:
    """``inline`` / ``separate`` for ``mode`` (``auto``: by ``device``, e.g. "cpu", "cuda:0").

    Raises:
        ValueError: an unknown mode.
    """
    if mode in ("inline", "separate"):
        return mode  # type: ignore[return-value]
    if mode != "auto":
        raise ValueError(f"engine_process must be auto, inline or separate, got {mode!r}")
    return "separate"


def check_ep(model_dir: str | Path, config: EngineConfig) -> None:
    """Refuse an expert-parallel setup that cannot start, before any process does.

    Raises:
        ValueError: ep_size > 1 with the inline engine, a model without routed experts, or a
            placement that does not fit (``model.ep.PlacementError``).
    """
    if config.ep_size == 1:
        return
    if resolve_engine_process(config.engine_process, config.device) == "inline":
        raise ValueError(
            "expert parallelism (--ep-size > 1) runs each rank in its own process: "
            "use --engine-process separate or auto"
        )
    from swaserve.config import ModelConfig
    from swaserve.model.ep import ExpertPlacement

    cfg = ModelConfig.from_pretrained(model_dir)
    if not cfg.n_routed_experts or "sparse" not in cfg.mlp_types:
        raise ValueError("expert parallelism needs a model with routed experts")
    if config.ep_placement:
        ExpertPlacement.from_file(config.ep_placement, cfg.n_routed_experts, config.ep_size)
    else:
        ExpertPlacement.contiguous(cfg.n_routed_experts, config.ep_size)


def check_kv_formats(model_dir: str | Path, config: EngineConfig) -> None:
    """Refuse KV page formats this model cannot be stored in, before any process starts.

    Raises:
        ValueError: an unknown or unbuilt format, or a group not dividing a head dim
            (``kvformat.FormatError``).
    """
    from swaserve.config import ModelConfig
    from swaserve.kvformat import engine_formats

    engine_formats(config, ModelConfig.from_pretrained(model_dir))


def build_engine_client(
    model_dir: str | Path,
    config: EngineConfig,
    model_name: str | None = None,
    on_dead: Callable[[str], None] | None = None,
    num_threads: int | None = None,
) -> LocalEngineClient:
    """The engine client for ``config.engine_process`` (not started; ``await client.start()``).

    ``on_dead``: called if the engine dies while serving: the separate core's process exits, or a
    step (either mode) runs past ``engine_step_timeout`` (the shells exit non-zero).
    ``num_threads``: torch threads of the process that runs the model (default: torch's own
    count, capped by ``usable_cpus()`` so a CPU-limited container does not oversubscribe).
    """
    import torch

    if num_threads is None:
        cpus = usable_cpus()
        num_threads = cpus if torch.get_num_threads() > cpus else None
    mode = resolve_engine_process(config.engine_process, config.device)
    if config.ep_size > 1:
        check_ep(model_dir, config)
        from swaserve.engine.ep_client import EPEngineClient

        return EPEngineClient(model_dir, config, model_name, on_dead)
    if mode == "inline":
        from swaserve.engine.async_engine import AsyncLLMEngine

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        return AsyncLLMEngine.from_model_dir(model_dir, config, model_name, on_dead)
    from swaserve.engine.mp_client import MPEngineClient

    return MPEngineClient(model_dir, config, model_name, on_dead=on_dead, num_threads=num_threads)

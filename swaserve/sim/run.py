"""``swaserve sim``: deployments (cost model + KV shape + budgets), one simulation run, a table.

Deployments (``DEPLOYMENTS``): ``mimo-v2-flash-h200`` (MiMo-V2-Flash on 8 x H200 instances: 690 GB of
KV each, page 64, chunk 8192) and ``cpu-tiny`` (the bundled checkpoint with the engine's CPU defaults
and the measured cost model, to compare with the real cluster on this machine).

Where the numbers come from: docs/DESIGN.md#simrunpy"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from swaserve.config import ModelConfig
from swaserve.routing.index import IndexConfig
from swaserve.routing.policy import make_policy
from swaserve.sched.cost import CPU_TINY, MIMO_V2_FLASH_H200, CostModel
from swaserve.sim.cluster import SimConfig, Simulator
from swaserve.sim.workload import Workload, scale_for_load


@dataclass(frozen=True)
class Deployment:
    name: str
    cost: CostModel
    device_bytes: int  # KV budget of a prefill instance
    host_bytes: int
    chunk: int
    decode_batch: int
    decode_kv_tokens: int
    page_size: int = 16
    max_model_len: int | None = None
    prefill_gpus: int = 0  # GPUs of a prefill instance (its EP size; ``sim.ep``); 0: not a GPU deployment

    def model(self) -> ModelConfig:
        if self.name == "cpu-tiny":
            from swaserve.model.checkpoint import tokenizer_dir

            return ModelConfig.from_pretrained(tokenizer_dir("default"))
        from swaserve.shapes import model_config, shape

        return model_config(shape("MiMo-V2-Flash"))


DEPLOYMENTS = {
    "mimo-v2-flash-h200": Deployment(
        "mimo-v2-flash-h200",
        MIMO_V2_FLASH_H200,
        690 * 10**9,
        0,
        8192,
        256,
        690 * 10**9 // 23_040,
        64,
        max_model_len=262_144,
        prefill_gpus=8,
    ),
    "cpu-tiny": Deployment("cpu-tiny", CPU_TINY, 256 * 1024 * 1024, 0, 512, 64, 10**6, max_model_len=32_768),
}


def deployment(name: str) -> Deployment:
    """Raises ValueError naming the known deployments."""
    try:
        return DEPLOYMENTS[name]
    except KeyError:
        raise ValueError(f"unknown deployment {name!r}; known: {', '.join(sorted(DEPLOYMENTS))}") from None


def simulate(
    work: Workload,
    prefill: int,
    decode: int,
    policy: str,
    dep: Deployment,
    priority: str = "fcfs",
    load: float | None = 0.8,
    time_scale: float | None = None,
    host_bytes: int | None = None,
    buckets: tuple[tuple[int, int], ...] | None = None,
    policy_args: dict[str, float | str] | None = None,
    max_wait_s: float | None = None,
    wait_weight: float | None = None,
    index_mode: str = "approximate",
    l3_bytes: int = 0,
) -> dict[str, object]:
    """Simulate ``work`` on one deployment; returns the ``SimResult.summary()`` plus the setup.

    ``time_scale`` wins over ``load`` (``sim.workload.scale_for_load`` over the prefill instances).
    """
    make_policy(policy, **(policy_args or {}))  # bad names fail before the trace is scanned
    if priority not in ("fcfs", "compute"):
        raise ValueError(f"priority must be 'fcfs' or 'compute', got {priority!r}")
    if priority != "compute" and (max_wait_s is not None or wait_weight is not None):
        raise ValueError(
            "max wait and wait weight (--max-wait, --wait-weight) apply to the compute priority only (--priority compute)"
        )
    scale = time_scale if time_scale is not None else scale_for_load(work, dep.cost, prefill, load or 0.8)
    cfg = SimConfig(
        prefill, decode, policy, dep.cost, dep.model(), dep.device_bytes,
        dep.host_bytes if host_bytes is None else host_bytes, priority, dep.decode_batch,
        dep.decode_kv_tokens, scale, dep.page_size, dep.chunk, buckets,
        policy_args=policy_args or {}, index=IndexConfig(), max_model_len=dep.max_model_len,
        index_mode=index_mode, l3_bytes=l3_bytes,
    )  # fmt: skip
    if max_wait_s is not None:
        cfg = replace(cfg, max_wait_s=max_wait_s)
    if wait_weight is not None:
        cfg = replace(cfg, wait_weight=wait_weight)
    out = Simulator(cfg).run(work).summary()
    order = (policy_args or {}).get("queue_order", "auto") if policy == "cache_aware" else "-"
    out.update(
        queue_order=order, index_mode=index_mode, trace=work.name, prefill=prefill, decode=decode, deployment=dep.name, time_scale=round(scale, 6),
        load=load if time_scale is None else None,
    )  # fmt: skip
    return out


COLUMNS = ("policy", "priority", "queue_order", "index_mode", "requests", "too_long", "hit_rate",
           "host_hit_rate", "l3_hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "prefill_utilization",
           "wall_s")  # fmt: skip
# table headers with units: hit rates are cached / prompt tokens; times in seconds (wall_s: real
# time the simulation took, the rest simulated)
HEADERS = {"hit_rate": "hit_rate(tok)", "host_hit_rate": "host_hit(tok)", "l3_hit_rate": "l3_hit(tok)", "ttft_p50": "ttft_p50_s",
           "ttft_p90": "ttft_p90_s", "ttft_p99": "ttft_p99_s", "itl_p50": "itl_p50_s",
           "prefill_utilization": "prefill_util", "too_long": "refused_too_long"}  # fmt: skip


def print_table(rows: list[dict[str, object]], columns: tuple[str, ...] = COLUMNS) -> None:
    """Print ``rows`` (``simulate`` results) as an aligned table of ``columns`` (``HEADERS``: units)."""
    heads = [HEADERS.get(c, c) for c in columns]
    widths = [
        max(len(h), *(len(str(r.get(c, ""))) for r in rows)) for c, h in zip(columns, heads, strict=True)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")

"""Expert parallelism in ``swaserve sim``: a GPU deployment's prefill instances at EP N (``EP N``
GPUs each; prefill seconds per token from ``sched.ep_cost``, KV budget from ``sched.ep_plan``'s
memory formula), and the comparison of EP N with P instances against EP N/2 with 2P instances: the
same GPUs, the same arrivals (the time scale of the EP N run at ``load``).

Per instance at EP N: KV = N x (U - w_ne - reserve - W_e / N), the bytes the planner leaves every
GPU once its expert share, the replicated non-expert weights and the reserve are placed.
Design notes: docs/DESIGN.md#simeppy"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from swaserve.sched.ep_cost import EPHardware, EPPrefill, ep_prefill, with_ep
from swaserve.sched.ep_plan import Inputs, computed_weights, plan
from swaserve.sim.run import Deployment, simulate
from swaserve.sim.workload import Workload, scale_for_load

COLUMNS = ("prefill_ep", "prefill", "prefill_gpus", "prefill_token_us", "device_kv_gb", "requests",
           "hit_rate", "ttft_p50", "ttft_p90", "ttft_p99", "prompt_tok_s", "prefill_utilization")  # fmt: skip


@dataclass(frozen=True)
class EPSetup:
    """How EP deployments are built.

    Attributes:
        hw: GPUs and links (``EPHardware``). balance: a measured or stated expert load balance
            (mean/max tokens per rank) by EP size; other sizes: ``default_balance``.
        memory: GPU memory, utilization, reserve and weight bytes per parameter (``Inputs``; its
            KV target is not used: an instance's KV budget is what the GPUs have left).
    """

    hw: EPHardware = field(default_factory=EPHardware)
    balance: Mapping[int, float] = field(default_factory=dict)
    memory: Inputs = field(default_factory=Inputs)


class EPDeployment:
    """``dep`` with prefill instances of ``ep`` GPUs (``deployment``: the one ``simulate`` takes).

    Raises:
        ValueError: ``dep`` is not a GPU deployment, ``ep`` does not divide the routed experts, or
            ``ep`` GPUs cannot hold the experts and non-expert weights with the reserve.
    """

    def __init__(self, dep: Deployment, ep: int, setup: EPSetup) -> None:
        if not dep.prefill_gpus:
            raise ValueError(f"EP applies to a GPU deployment (mimo-v2-flash-h200), not {dep.name}")
        cfg = dep.model()
        self.prefill: EPPrefill = ep_prefill(cfg, ep, setup.hw, setup.balance.get(ep))
        self.plan = plan(dep.name, cfg, computed_weights(cfg), setup.memory)
        room = self.plan.kv_room(ep)
        if room <= 0:
            raise ValueError(
                f"EP {ep} cannot hold the model: experts {self.plan.expert_bytes / ep / 1e9:.1f} GB + "
                f"non-expert {self.plan.non_expert_bytes / 1e9:.1f} GB + reserve "
                f"{setup.memory.reserve_bytes / 1e9:.1f} GB per GPU > {setup.memory.usable_bytes / 1e9:.1f} GB usable"
            )
        self.ep, self.kv_per_gpu = ep, room
        self.deployment = replace(
            dep,
            name=f"{dep.name}@ep{ep}",
            cost=with_ep(dep.cost, self.prefill, dep.prefill_gpus),
            device_bytes=int(ep * room),
            prefill_gpus=ep,
        )

    def describe(self) -> str:
        """The per-token terms and the KV budget of one instance, one line each."""
        u, m = self.plan.inputs.usable_bytes / 1e9, self.plan.inputs
        return (
            f"{self.prefill.describe()}\n"
            f"EP {self.ep}: KV per instance {self.ep} x ({u:.1f} - {self.plan.non_expert_bytes / 1e9:.2f} - "
            f"{m.reserve_bytes / 1e9:.1f} - {self.plan.expert_bytes / 1e9:.1f} / {self.ep}) GB = "
            f"{self.deployment.device_bytes / 1e9:.1f} GB"
        )

    def run(self, work: Workload, instances: int, decode: int, policy: str, **kw: Any) -> dict[str, Any]:
        """``simulate`` ``instances`` prefill instances of this EP (``kw``: its other options;
        ``device_bytes`` replaces the KV budget), plus this EP's columns."""
        dep = self.deployment
        if kw.get("device_bytes") is not None:
            dep = replace(dep, device_bytes=kw["device_bytes"])
        kw.pop("device_bytes", None)
        return simulate(work, instances, decode, policy, dep, **kw) | {
            "prefill_ep": self.ep,
            "prefill_gpus": self.ep * instances,
            "prefill_token_us": round(dep.cost.prefill_token_s * 1e6, 3),
            "device_kv_gb": round(dep.device_bytes / 1e9, 1),
        }


def hardware_line(setup: EPSetup) -> str:
    """The stated hardware and all-to-all assumptions, one line."""
    hw = setup.hw
    return (
        f"assumed: {hw.gpu_flops / 1e12:.0f} TFLOP/s per GPU at {hw.mfu:.0%} MFU; {hw.gpus_per_node} GPUs per "
        f"node; all-to-all {hw.nvlink_bytes_per_s / 1e9:.0f} GB/s NVLink, {hw.rdma_bytes_per_s / 1e9:.0f} GB/s "
        f"RDMA per rank, {hw.a2a_bytes} B per element, {hw.a2a_overlap:.0%} hidden behind compute; "
        "balance "
        + (", ".join(f"EP {k}: {v}" for k, v in sorted(setup.balance.items())) or "by default_balance")
    )


def compare(
    work: Workload,
    prefill: int,
    decode: int,
    policy: str,
    dep: Deployment,
    ep: int,
    setup: EPSetup,
    load: float = 0.8,
    time_scale: float | None = None,
    **kw: Any,
) -> tuple[list[EPDeployment], list[dict[str, Any]]]:
    """Simulate EP ``ep`` with ``prefill`` instances and EP ``ep // 2`` with ``2 * prefill``, at the
    time scale of the first at ``load`` (or ``time_scale``); ``kw``: ``EPDeployment.run``'s options.

    Raises:
        ValueError: ``ep`` odd or < 2, or either EP size does not fit (``EPDeployment``).
    """
    if ep < 2 or ep % 2:
        raise ValueError(f"the EP comparison halves EP: it needs an even EP >= 2, got {ep}")
    deps = [EPDeployment(dep, e, setup) for e in (ep, ep // 2)]
    scale = (
        time_scale if time_scale is not None else scale_for_load(work, deps[0].deployment.cost, prefill, load)
    )
    rows = [
        d.run(work, n, decode, policy, time_scale=scale, **kw)
        | {"load": load if time_scale is None else None}
        for d, n in ((deps[0], prefill), (deps[1], 2 * prefill))
    ]
    return deps, rows

"""``swaserve sim`` and ``swaserve plan-ep``: the planning commands, which start nothing (typer; the
cores are ``swaserve.sim`` and ``swaserve.sched.ep_plan``). ``swaserve.cli`` mounts them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal

import typer

from swaserve.options import size_option
from swaserve.sched.ep_plan import Inputs, Plan


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def plan_lines(p: Plan) -> list[str]:
    """The plan's formula, every input and assumption, and its layouts, as text lines."""
    from swaserve.sched.ep_plan import ASSUMPTIONS, FORMULA

    i, w, kv = p.inputs, p.weights, p.kv
    out = [
        f"plan-ep: {p.model}: {p.experts} routed experts (EP divides {p.experts}), {p.mtp_layers} MTP layers"
    ]
    out += [f"  {f}" for f in FORMULA]
    out.append("inputs:")
    out.append(
        f"  U = {i.utilization} x {_gb(i.gpu_bytes)} GB = {_gb(i.usable_bytes)} GB per GPU; reserve "
        f"{_gb(i.reserve_bytes)} GB (activations, all-to-all buffers, workspace)"
    )
    out.append(
        f"  KV target per GPU: --concurrency {i.concurrency} requests x --context {i.context:,} tokens = "
        f"{i.tokens:,} tokens; chunk {i.chunk:,} tokens; KV {i.kv_dtype_bytes} B per element"
    )
    out.append(
        f"  b_f = {kv.full:,} B/token (full layers), b_s = {kv.swa:,} B/token (SWA layers incl. "
        f"{p.mtp_layers} MTP), W = {kv.window}"
    )
    out.append(
        f"  W_e = {w.expert_params / 1e9:.2f}B expert params x {i.expert_bytes} B = {_gb(p.expert_bytes)} GB; "
        f"w_ne = {w.non_expert_params / 1e9:.2f}B params x {i.non_expert_bytes} B = {_gb(p.non_expert_bytes)} GB"
    )
    out.append(f"  weights: {w.source}")
    if w.parts is not None:
        out.append("  params: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in w.parts._asdict().items()))
    out.append("assumptions:")
    out += [f"  {a}" for a in ASSUMPTIONS]
    out.append(
        f"{'layout':<8}{'KV GB':>9}{'EP':>6}{'experts GB':>12}{'headroom GB':>13}{'tokens/GPU at EP':>18}"
    )
    for lp in p.layouts.values():
        if lp.ep_size is None:  # what fits at one expert per rank is beside the point
            out.append(f"{lp.layout:<8}{_gb(lp.kv_bytes):>9}{'none':>6}{'-':>12}{'-':>13}{'-':>18}")
            continue
        out.append(
            f"{lp.layout:<8}{_gb(lp.kv_bytes):>9}{lp.ep_size:>6}{_gb(lp.expert_bytes_per_gpu):>12}"
            f"{_gb(lp.headroom_bytes):>13}{lp.capacity_tokens:>18,}"
        )
    return out


def _ratio(p: Plan) -> str:
    full, hyb = p.layouts["full"].ep_size, p.layouts["hybrid"].ep_size
    if hyb is None:
        return "neither fits" if full is None else "hybrid does not fit"
    if full is None:
        return "full does not fit"
    return f"{full / hyb:.3g}x" + (" (hybrid: half the EP or less)" if full >= 2 * hyb else "")


def sweep_lines(plans: list[Plan]) -> list[str]:
    """The EP each layout needs at each context (``ep_plan.sweep``), as text lines."""
    i = plans[0].inputs
    out = [f"sweep: --context per request, {i.concurrency} requests per GPU, other inputs as above"]
    out.append(
        f"{'context':>9}{'tokens/GPU':>12}{'full KV GB':>12}{'full EP':>9}{'hybrid KV GB':>14}"
        f"{'hybrid EP':>11}  full/hybrid EP"
    )
    for p in plans:
        f, h = p.layouts["full"], p.layouts["hybrid"]
        out.append(
            f"{p.inputs.context:>9,}{p.inputs.tokens:>12,}{_gb(f.kv_bytes):>12}{f.ep_size or 'none':>9}"
            f"{_gb(h.kv_bytes):>14}{h.ep_size or 'none':>11}  {_ratio(p)}"
        )
    return out


def plan_ep(
    shape: Annotated[
        str, typer.Option(help="mimo-v2-flash, mimo-v2.5-pro, or a checkpoint DIR with config.json.")
    ] = "mimo-v2-flash",
    gpu_memory: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES", help="HBM per GPU, e.g. 141GB.")
    ] = "141GB",  # type: ignore[assignment]  # parsed by size_option
    gpu_utilization: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Share of the HBM usable (U = this x --gpu-memory).")
    ] = 0.9,
    context: Annotated[int, typer.Option(min=1, help="KV tokens per request.")] = 32768,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Requests per GPU (DP-attention rank): tokens/GPU = this x --context.")
    ] = 8,
    chunk: Annotated[
        int, typer.Option(min=0, help="Prefill tokens of one step per GPU (their SWA KV).")
    ] = 8192,
    kv_layout: Annotated[
        Literal["hybrid", "full"] | None,
        typer.Option(help="The layout whose EP is the answer (default: both shown, the answer hybrid's)."),
    ] = None,
    kv_dtype_bytes: Annotated[int, typer.Option(min=1, help="Bytes per KV element (bf16: 2).")] = 2,
    expert_bytes: Annotated[float, typer.Option(min=0.01, help="Bytes per expert param (FP8: 1).")] = 1.0,
    non_expert_bytes: Annotated[
        float, typer.Option(min=0.01, help="Bytes per non-expert param (bf16: 2; an upper bound).")
    ] = 2.0,
    reserve: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES", help="Activations and workspace per GPU.")
    ] = "8GB",  # type: ignore[assignment]  # parsed by size_option
    mtp_layers: Annotated[
        int | None, typer.Option(min=0, help="MTP layers whose SWA KV is held (default: the model's).")
    ] = None,
    expert_params: Annotated[
        float | None,
        typer.Option(help="Routed-expert params (default: from the shape; not public: 0.98 x total)."),
    ] = None,
    total_params: Annotated[
        float | None,
        typer.Option(help="Total params (default: from the shape; not public: the published total)."),
    ] = None,
    sweep: Annotated[bool, typer.Option(help="Also show both layouts' EP over a range of contexts.")] = True,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the plan here as JSON.")] = None,
) -> None:
    """The smallest expert-parallel size whose GPUs hold the experts, the non-expert weights, the KV
    of the target load and a reserve, for the hybrid (SWA-aware) and full KV layouts. Exit 1 when
    the answer's layout fits at no EP."""
    import json

    from swaserve.sched import ep_plan

    try:
        name, cfg, weights = ep_plan.resolve(shape, expert_params, total_params)
        inputs = Inputs(
            gpu_memory, gpu_utilization, reserve, context, concurrency, chunk, kv_dtype_bytes,
            expert_bytes, non_expert_bytes,
        )  # fmt: skip
        p = ep_plan.plan(name, cfg, weights, inputs, mtp_layers)
        rows = ep_plan.sweep(name, cfg, weights, inputs, mtp_layers=mtp_layers) if sweep else []
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    layout = kv_layout or "hybrid"
    lines = plan_lines(p)
    if kv_layout is None:
        lines.append(f"full/hybrid EP: {_ratio(p)}")
    if rows:
        lines += ["", *sweep_lines(rows)]
    typer.echo("\n".join(lines))
    if json_path is not None:
        doc = p.to_json(layout)
        doc["sweep"] = [
            {
                "context": r.inputs.context,
                "tokens_per_gpu": r.inputs.tokens,
                "full_over_hybrid_ep": r.halving(),
            }
            | {k: {"ep_size": v.ep_size, "kv_bytes": v.kv_bytes} for k, v in r.layouts.items()}
            for r in rows
        ]
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    lp = p.layouts[layout]
    if lp.ep_size is None:
        typer.echo(
            f"error: the {layout} layout does not fit at any EP: non-expert {_gb(p.non_expert_bytes)} + KV "
            f"{_gb(lp.kv_bytes)} + reserve {_gb(inputs.reserve_bytes)} GB leave {_gb(lp.free_bytes)} GB for "
            f"{_gb(p.expert_bytes)} GB of experts over at most {p.experts} ranks",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(f"ep_size = {lp.ep_size} ({layout} layout)")


def _balances(values: list[str] | None) -> dict[int, float]:
    """``--balance EP=B`` entries -> {EP: B}. Raises typer.BadParameter."""
    out: dict[int, float] = {}
    for v in values or []:
        try:
            ep, b = v.split("=")
            out[int(ep)] = float(b)
        except ValueError:
            raise typer.BadParameter(
                f"{v!r} is not EP=BALANCE (e.g. 16=0.85)", param_hint="--balance"
            ) from None
        if not 0 < out[int(ep)] <= 1:
            raise typer.BadParameter(f"balance must be in (0, 1], got {v!r}", param_hint="--balance")
    return out


def sim(
    trace: Annotated[Path, typer.Option(help="Mooncake .jsonl or agent-session trace (.jsonl[.gz]).")],
    prefill: Annotated[
        int, typer.Option(min=1, max=512, help="Prefill instances (each holds a KV cache: ~15 MB of RAM).")
    ] = 8,
    decode: Annotated[int, typer.Option(min=1, max=512, help="Decode instances.")] = 8,
    policy: Annotated[
        str, typer.Option(help="Routing policy: round_robin, least_load, cache_aware.")
    ] = "cache_aware",
    priority: Annotated[str, typer.Option(help="Prefill queue order: fcfs or compute.")] = "fcfs",
    deployment: Annotated[
        str, typer.Option(help="Cost model + KV shape: mimo-v2-flash-h200 or cpu-tiny.")
    ] = "mimo-v2-flash-h200",
    load: Annotated[
        float, typer.Option(min=0.01, max=2.0, help="Offered prefill load (ideal-cache work / capacity).")
    ] = 0.8,
    time_scale: Annotated[
        float | None, typer.Option(min=1e-9, help="Multiply trace inter-arrival times (overrides --load).")
    ] = None,
    host_cache: Annotated[
        int | None,
        typer.Option(
            parser=size_option, metavar="BYTES", help="Host-tier KV per prefill instance, e.g. 1.5TB."
        ),
    ] = None,
    l3_cache: Annotated[
        int | None,
        typer.Option(
            parser=size_option,
            metavar="BYTES",
            help="A GCache (L3) tier shared by the prefill instances, e.g. 20TB (needs --host-cache).",
        ),
    ] = None,
    device_cache: Annotated[
        int | None,
        typer.Option(
            parser=size_option,
            metavar="BYTES",
            help="Device KV per prefill instance (default: the deployment's), e.g. 10GB.",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="First N requests of the trace.")] = None,
    copies: Annotated[
        int, typer.Option(min=1, help="Agent sessions: run this many unrelated copies (closed loop).")
    ] = 1,
    index_mode: Annotated[
        Literal["approximate", "precise"],
        typer.Option(help="Router index: record dispatches, or follow the prefill caches' block events."),
    ] = "approximate",
    max_wait: Annotated[float | None, typer.Option(min=0.0, help="compute priority: max wait (s).")] = None,
    wait_weight: Annotated[
        float | None, typer.Option(min=0.0, help="compute priority: aging weight.")
    ] = None,
    queue_order: Annotated[
        Literal["auto", "fcfs", "compute"],
        typer.Option(
            help="cache_aware: the prefill queue order its wait estimate assumes (auto: the instances')."
        ),
    ] = "auto",
    prefill_ep: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="GPUs (EP size) of a prefill instance: its prefill time from sched.ep_cost and its KV from "
            "the GPUs' memory left (default: the deployment's preset as is).",
        ),
    ] = None,
    ep_compare: Annotated[
        bool,
        typer.Option(
            help="Also run EP --prefill-ep/2 with twice the prefill instances (same GPUs, arrivals)."
        ),
    ] = False,
    gpus_per_node: Annotated[
        int, typer.Option(min=1, help="GPUs on one NVLink node: a larger EP crosses RDMA.")
    ] = 8,
    balance: Annotated[
        list[str] | None,
        typer.Option(help="Expert load balance (mean/max tokens per rank) at an EP, EP=B (repeatable)."),
    ] = None,
    nvlink_bw: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES/S", help="All-to-all per rank on NVLink.")
    ] = "153GB",  # type: ignore[assignment]  # parsed by size_option
    rdma_bw: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES/S", help="All-to-all per rank over RDMA.")
    ] = "43GB",  # type: ignore[assignment]  # parsed by size_option
    a2a_overlap: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of all-to-all time hidden behind compute.")
    ] = 0.0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result here as JSON.")] = None,
) -> None:
    """Simulate the cluster on a trace: the real routing and radix-cache code in simulated time."""
    from swaserve.sched.ep_cost import EPHardware
    from swaserve.sim import workload as wl
    from swaserve.sim.ep import COLUMNS as EP_COLUMNS
    from swaserve.sim.ep import EPDeployment, EPSetup, compare, hardware_line
    from swaserve.sim.run import deployment as get_deployment
    from swaserve.sim.run import print_table, simulate, write_json

    setup = EPSetup(
        EPHardware(nvlink_bytes_per_s=nvlink_bw, rdma_bytes_per_s=rdma_bw, gpus_per_node=gpus_per_node,
                   a2a_overlap=a2a_overlap),
        _balances(balance),
    )  # fmt: skip
    deps: list[EPDeployment] = []
    try:
        if policy != "cache_aware" and queue_order != "auto":
            raise ValueError(f"--queue-order applies to --policy cache_aware only, not {policy}")
        if ep_compare and prefill_ep is None:
            raise ValueError("--ep-compare needs --prefill-ep N (the EP it halves)")
        dep = get_deployment(deployment)
        if prefill_ep is None and device_cache is not None:
            dep = dataclasses.replace(dep, device_bytes=device_cache)
        if prefill_ep is not None and not ep_compare:
            deps = [EPDeployment(dep, prefill_ep, setup)]
        work = wl.load(trace, limit, copies)
        kw = dict(
            priority=priority, host_bytes=host_cache, max_wait_s=max_wait, wait_weight=wait_weight,
            index_mode=index_mode, l3_bytes=l3_cache or 0,
            policy_args={"queue_order": queue_order} if policy == "cache_aware" else None,
        )  # fmt: skip
        if ep_compare:
            assert prefill_ep is not None
            deps, rows = compare(
                work, prefill, decode, policy, dep, prefill_ep, setup, load, time_scale,
                device_bytes=device_cache, **kw,
            )  # fmt: skip
        elif deps:
            rows = [deps[0].run(work, prefill, decode, policy, load=load, time_scale=time_scale,
                                device_bytes=device_cache, **kw)]  # fmt: skip
        else:
            rows = [simulate(work, prefill, decode, policy, dep, load=load, time_scale=time_scale, **kw)]  # type: ignore[arg-type]
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if deps:
        typer.echo(hardware_line(setup))
        typer.echo("\n".join(d.describe() for d in deps))
        print_table(rows, EP_COLUMNS)
    else:
        print_table(rows)
    if ep_compare and rows[0]["prompt_tok_s"]:
        n, half = rows
        typer.echo(
            f"EP {half['prefill_ep']} x {half['prefill']} vs EP {n['prefill_ep']} x {n['prefill']}: prompt "
            f"tok/s x{half['prompt_tok_s'] / n['prompt_tok_s']:.3f}, TTFT p50 "
            f"x{half['ttft_p50'] / max(n['ttft_p50'], 1e-9):.3f}, p90 x{half['ttft_p90'] / max(n['ttft_p90'], 1e-9):.3f}"
        )
    if json_path is not None:
        write_json(json_path, rows if ep_compare else rows[0])

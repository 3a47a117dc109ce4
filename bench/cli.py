"""``swaserve bench ...``: the benchmark commands as a typer app, mounted by ``swaserve.cli``
through the ``swaserve.cli`` entry point group (``bench = "bench.cli:app"`` in pyproject.toml),
so the core CLI never imports ``bench``. Each command imports its bench module when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from swaserve.options import size_option

app = typer.Typer(help="Benchmarks (results as JSON).", no_args_is_help=True)


@app.command("kv-capacity")
def bench_kv_capacity(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
) -> None:
    """KV capacity of the hybrid vs full layout for a memory budget."""
    from bench.kv_capacity import main

    main(str(json_path) if json_path is not None else None)


@app.command("prefix-cache")
def bench_prefix_cache(
    trace: Annotated[
        list[Path] | None,
        typer.Option(help="Mooncake .jsonl or agent-session trace; repeatable (default: both bundled ones)."),
    ] = None,
    budget: Annotated[
        int | None,
        typer.Option(
            parser=size_option,
            metavar="BYTES",
            help="Device KV bytes (default: 25% of the trace's footprint).",
        ),
    ] = None,
    host_budget: Annotated[
        int | None,
        typer.Option(
            parser=size_option,
            metavar="BYTES",
            help="Host-tier bytes (default: none for Mooncake, the whole footprint for agent sessions).",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Replay the first N requests only.")] = None,
    chunk: Annotated[int, typer.Option(min=1, help="Prefill chunk, tokens.")] = 512,
    cache_partial: Annotated[
        bool,
        typer.Option(
            help="Insert each non-final prefill chunk into the cache, as the engine does (off: only "
            "prompt ends and divergence points)."
        ),
    ] = True,
    budget_share: Annotated[
        float | None,
        typer.Option(
            min=1e-6,
            help="Device KV budget as a share of the trace's footprint (default 0.25; --budget wins).",
        ),
    ] = None,
    swa_ratio: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Fixed SWA pages per full page for the hybrid layout, as --swa-full-tokens-ratio "
            "(default: one shared budget, split by the traffic).",
        ),
    ] = None,
    curve: Annotated[bool, typer.Option(help="Also replay the hit-rate curve over budgets.")] = True,
    sweep: Annotated[
        bool, typer.Option(help="On the curve, also replay each fixed ratio (best fixed ratio in hindsight).")
    ] = True,
    jobs: Annotated[
        int | None, typer.Option(min=1, help="Replays run in parallel (default: the usable CPUs).")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    curve_share: Annotated[
        list[float] | None,
        typer.Option(help="Replay only the curve's points at this device share; repeatable (default: all)."),
    ] = None,
    reuse: Annotated[
        Path | None,
        typer.Option(
            help="An earlier --json of the same traces: take its full-layout and fixed-ratio replays "
            "(they do not depend on the adaptive split) instead of rerunning them."
        ),
    ] = None,
) -> None:
    """Prefix-cache token hit rates of a trace at a memory budget (real cache, no model)."""
    from bench.prefix_cache import main
    from bench.prefix_workload import BenchInputError
    from swaserve.traces import TraceError

    try:
        main(
            str(json_path) if json_path is not None else None,
            [str(t) for t in trace] if trace else None,
            limit,
            budget,
            host_budget,
            curve,
            chunk,
            cache_partial,
            swa_ratio=swa_ratio,
            budget_share=budget_share,
            sweep=sweep,
            jobs=jobs,
            reuse=str(reuse) if reuse is not None else None,
            curve_shares=curve_share or None,
        )
    except (
        OSError,
        TraceError,
        BenchInputError,
        ValueError,
        KeyError,
    ) as e:  # unreadable or malformed trace, tiny budget
        raise typer.BadParameter(str(e)) from e


@app.command("engine")
def bench_engine(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
) -> None:
    """Engine throughput and latency on the default model."""
    from bench.engine_bench import main

    main(str(json_path) if json_path is not None else None)


@app.command("mtp")
def bench_mtp(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    batch: Annotated[
        list[int] | None, typer.Option(min=1, help="Batch sizes; repeatable (default: 1, 8, 32).")
    ] = None,
    k: Annotated[int, typer.Option(min=1, help="Draft tokens per step (MTP layers).")] = 3,
    prompt_tokens: Annotated[
        int, typer.Option(min=1, help="Prompt length (the trace prompt's last N tokens).")
    ] = 512,
    output_tokens: Annotated[int, typer.Option(min=2, help="Greedy tokens per request (EOS ignored).")] = 256,
    cluster: Annotated[bool, typer.Option(help="Also through `swaserve up` (batch 1 and 8).")] = False,
    solo_prompts: Annotated[
        int, typer.Option(min=1, help="Batch 1: this many prompts, one after another.")
    ] = 8,
) -> None:
    """MTP speculative decoding off vs on, default model: tok/s and ITL by output position, accept length."""
    from bench.mtp import main

    main(
        str(json_path) if json_path else None,
        tuple(batch or (1, 8, 32)),
        k,
        prompt_tokens,
        output_tokens,
        cluster,
        solo_prompts,
    )


@app.command("pd-transfer")
def bench_pd_transfer(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Loopback pushes per length (best is reported).")] = 3,
) -> None:
    """Prefill->decode KV bytes per request vs full KV (per length), and loopback throughput."""
    from bench.pd_transfer import main

    main(json_path, repeats=repeats)


@app.command("cluster-replay")
def bench_cluster_replay(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Trace requests to replay per mode.")] = 250,
    max_output_tokens: Annotated[int, typer.Option(min=1, help="Cap on each output.")] = 64,
    time_scale: Annotated[float, typer.Option(min=0.001, help="Divide arrival times by this.")] = 1.0,
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(min=1, help="Decode workers.")] = 1,
) -> None:
    """The make-run replay through `swaserve serve`, then `swaserve up`: TTFT and ITL p50/p90."""
    from bench.cluster_replay import main

    main(
        json_path, limit, max_output=max_output_tokens, time_scale=time_scale, prefill=prefill, decode=decode
    )


@app.command("prefix-replay")
def bench_prefix_replay(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Trace requests to replay per mode.")] = 250,
    max_output_tokens: Annotated[int, typer.Option(min=1, help="Cap on each output.")] = 64,
    time_scale: Annotated[float, typer.Option(min=0.001, help="Divide arrival times by this.")] = 1.0,
    workload: Annotated[
        Literal["conversation", "agent"],
        typer.Option(help="conversation: the make-run trace slice; agent: agent sessions, closed loop."),
    ] = "conversation",
    sessions: Annotated[int, typer.Option(min=1, help="agent: sessions run concurrently.")] = 4,
    calls: Annotated[int, typer.Option(min=1, help="agent: first calls of each session.")] = 8,
) -> None:
    """A trace replay through `swaserve serve`, prefix cache off then on: TTFT ratio."""
    from bench.prefix_replay import main

    main(
        json_path,
        limit,
        max_output=max_output_tokens,
        time_scale=time_scale,
        workload=workload,
        sessions=sessions,
        calls=calls,
    )


@app.command("routing-sim")
def bench_routing_sim(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="First N requests of each trace.")] = None,
    load: Annotated[float, typer.Option(min=0.01, max=2.0, help="Offered prefill load.")] = 0.8,
) -> None:
    """Routing policies in the simulator: hit rate and TTFT, 8 and 16 prefill instances."""
    from bench.routing_sim import main

    main(load=load, limit=limit, json_path=json_path)


@app.command("routing-cluster")
def bench_routing_cluster(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Trace requests to replay per row.")] = 200,
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers.")] = 2,
    time_scale: Annotated[float, typer.Option(min=0.001, help="Divide arrival times by this.")] = 1.0,
    max_output_tokens: Annotated[int, typer.Option(min=1, help="Cap on each output.")] = 32,
    workload: Annotated[
        Literal["agent", "conversation"],
        typer.Option(help="agent: sessions closed loop (reuse); conversation: the make-run trace slice."),
    ] = "agent",
    sessions: Annotated[int, typer.Option(min=1, help="agent: sessions run concurrently.")] = 6,
    calls: Annotated[int, typer.Option(min=1, help="agent: first calls of each session.")] = 6,
) -> None:
    """Routing policies on the real cluster (CPU) next to the simulator on the same requests."""
    from bench.routing_cluster import main

    main(
        json_path, limit, max_output=max_output_tokens, time_scale=time_scale, prefill=prefill,
        workload=workload, sessions=sessions, calls=calls,
    )  # fmt: skip


@app.command("frontend")
def bench_frontend(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[
        int, typer.Option(min=0, help="Trace requests of the make-run replay (0: probes only).")
    ] = 250,
    saturated: Annotated[int, typer.Option(min=1, help="Requests sent at once (throughput).")] = 100,
    probe_tokens: Annotated[int, typer.Option(min=16, help="Prompt tokens of the long prefill.")] = 32000,
    probe_interval: Annotated[float, typer.Option(min=0.001, help="Seconds between probes.")] = 0.02,
) -> None:
    """Inline engine vs separate engine-core process: TTFT/ITL, tokens/s, probe latency."""
    from bench.frontend import main

    main(json_path, limit, saturated, probe_tokens, probe_interval)


@app.command("guided")
def bench_guided(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    requests: Annotated[int, typer.Option(min=1, help="Chat requests, sent at once.")] = 16,
    max_tokens: Annotated[int, typer.Option(min=8, help="Output tokens of each request.")] = 64,
    rounds: Annotated[int, typer.Option(min=1, help="Timed runs of each, alternating (best is kept).")] = 3,
    threads: Annotated[int, typer.Option(min=1, help="torch threads.")] = 1,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: the default model).")
    ] = None,
) -> None:
    """Structured output: tokens/s of the same requests unconstrained vs with a json_schema."""
    from bench.guided import main

    path = str(json_path) if json_path is not None else None
    main(path, str(model) if model else None, requests, max_tokens, rounds, threads)


@app.command("drain")
def bench_drain(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint dir (default: the bundled default model).")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Closed-loop streaming clients.")] = 4,
    steady_s: Annotated[float, typer.Option(min=1.0, help="Seconds of load before the scale-down.")] = 30.0,
    after_s: Annotated[float, typer.Option(min=0.0, help="Seconds of load after both pods are gone.")] = 10.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens per request.")] = 48,
) -> None:
    """Scale a decode and a prefill worker down under load (the Helm chart's pods, run by the
    kubelet emulator): requests lost, retried and resumed; TTFT p90 during the change vs steady."""
    from bench.drain import main

    main(str(json_path) if json_path else None, model, concurrency, steady_s, after_s, max_tokens)


@app.command("gcache")
def bench_gcache(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    sizes: Annotated[
        str, typer.Option(help="Object sizes (header + payload), comma-separated, e.g. 64KiB,1MiB,4MiB.")
    ] = "64KiB,1MiB,4MiB",
    iters: Annotated[int, typer.Option(min=1, help="Objects put and got per cell, at most.")] = 200,
    cell_bytes: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES", help="Object bytes per cell, at most.")
    ] = "256MiB",  # type: ignore[assignment]
    batch: Annotated[int, typer.Option(min=1, help="Objects per call of the batched get, at most.")] = 8,
    tier: Annotated[
        list[str] | None, typer.Option(help="Node tier: dram or nvme; repeatable (default: both).")
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(min=1, help="Simulator: each workload's first N requests (default 1000 / all calls)."),
    ] = None,
    copies: Annotated[
        int | None, typer.Option(min=1, help="Simulator: agent session copies (default 2).")
    ] = None,
    sim: Annotated[bool, typer.Option(help="Run the returning-sessions simulation (part 2).")] = True,
    perftest_bytes: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES", help="ucx_perftest bytes per size.")
    ] = "256MiB",  # type: ignore[assignment]
) -> None:
    """GCache: put/get MiB/s and latency (DRAM, NVMe; UCX, gRPC) next to ucx_perftest, and the
    returning-sessions hit rate and TTFT without L3, with L3 and ideal (simulator); the targets."""
    from bench.gcache import MAX_OBJECT_BYTES, PAGE, TIERS, main
    from swaserve.gcache.codec import header_size
    from swaserve.options import parse_size

    try:
        size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sizes") from e
    least = header_size(PAGE) + 1
    if not size_list or not all(least <= s <= MAX_OBJECT_BYTES for s in size_list):
        raise typer.BadParameter(
            f"a comma-separated list of object sizes from {least} B (a header and a byte) to "
            f"{MAX_OBJECT_BYTES >> 20} MiB (a node's largest object)",
            param_hint="--sizes",
        )
    tiers = tier or list(TIERS)
    if bad := [t for t in tiers if t not in TIERS]:
        raise typer.BadParameter(f"{', '.join(bad)}: tiers are {', '.join(TIERS)}", param_hint="--tier")
    main(json_path, size_list, iters, cell_bytes, batch, tiers, limit, copies, perftest_bytes, sim)


@app.command("encoder")
def bench_encoder(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint with media towers (default: the default model).")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="Closed-loop image requests per encoder.")] = 600,
    open_requests: Annotated[
        int, typer.Option(min=1, help="Open-loop (Poisson) requests per encoder.")
    ] = 400,
    concurrency: Annotated[int, typer.Option(min=1, help="Closed-loop clients.")] = 16,
    repeat_share: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of requests drawn from the popular images.")
    ] = 0.5,
    open_load: Annotated[
        float, typer.Option(min=0.01, max=2.0, help="Open-loop rate as a share of the baseline's items/s.")
    ] = 0.6,
    baseline_keys: Annotated[
        Literal["unique", "content"],
        typer.Option(
            help="unique: a key per baseline request (nothing shared); content: the router's keys "
            "(the baseline then joins identical items in flight)."
        ),
    ] = "unique",
    video_seconds: Annotated[float, typer.Option(min=1.0, help="Length of the generated video.")] = 180.0,
    video_repeats: Annotated[int, typer.Option(min=1, help="Decodes per thread count (best kept).")] = 3,
    quick: Annotated[bool, typer.Option(help="A tiny run (tests): overrides the sizes above.")] = False,
) -> None:
    """Encoder service: items/s and p50/p90 latency with batching + cache vs one item at a time
    without cache (same image requests); chunked video decode time at 1, 2, 4 threads."""
    from bench.encoder import Settings, main

    settings = Settings.quick() if quick else Settings(
        requests=requests, open_requests=open_requests, concurrency=concurrency, repeat_share=repeat_share,
        open_load=open_load, baseline_keys=baseline_keys, video_seconds=video_seconds,
        video_repeats=video_repeats,
    )  # fmt: skip
    main(json_path, model, settings)


@app.command("ep")
def bench_ep(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint with routed experts (default: the default model).")
    ] = None,
    ep: Annotated[
        list[int] | None, typer.Option(min=1, help="EP sizes; repeatable (default: 1, 2, 4; 1 always runs).")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="Prompts per round, submitted at once.")] = 48,
    prompt_tokens: Annotated[
        int, typer.Option(min=1, help="Prompt length (each trace prompt's last N tokens).")
    ] = 512,
    rounds: Annotated[int, typer.Option(min=1, help="Timed rounds per EP size, interleaved.")] = 3,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Torch threads in all, split between ranks (default: the CPUs).")
    ] = None,
    sim_limit: Annotated[int, typer.Option(min=1, help="Simulator: the trace's first N requests.")] = 2000,
    quick: Annotated[bool, typer.Option(help="A tiny run (tests): overrides the sizes above.")] = False,
) -> None:
    """Expert parallelism: prefill tok/s at EP 1/2/4 (CPU ranks: overhead, not speedup), expert load
    balance per layer, plan-ep for Flash and Pro (hybrid vs full KV), simulated EP N vs N/2."""
    from bench.ep import BenchInputError, Settings, main

    base = Settings()
    settings = Settings.quick() if quick else Settings(
        ep_sizes=tuple(ep) if ep else base.ep_sizes, requests=requests, prompt_tokens=prompt_tokens,
        rounds=rounds, threads=threads or base.threads, sim_limit=sim_limit,
    )  # fmt: skip
    try:
        main(json_path, model, settings)
    except BenchInputError as e:
        raise typer.BadParameter(str(e)) from e


@app.command("kv-quant")
def bench_kv_quant(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    model: Annotated[
        Path | None,
        typer.Option(help="Checkpoint for quality and decode speed (default: the default model)."),
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="Trace replays run in parallel.")] = 2,
    quick: Annotated[
        bool, typer.Option(help="A tiny run (tests): tiny model, 32K context only, 200 requests.")
    ] = False,
) -> None:
    """KV page formats (auto, fp8_e4m3, fp8_e5m2, int8): capacity in 80 GB (real allocator), KL and
    greedy agreement vs auto, decode tok/s at batch 1 and 8, prefix-cache hit rate at 5% budget."""
    from bench.kv_quant import main

    main(str(json_path) if json_path is not None else None, quick, str(model) if model else None, jobs=jobs)

"""The ``swaserve`` command line: serve, make-checkpoint, replay, bench.

Heavy modules (torch, the engine, the HTTP server) are imported inside the commands, so
``swaserve --help`` stays fast.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import typer

from swaserve.config import EngineConfig  # light: no torch

app = typer.Typer(
    name="swaserve",
    help="Serving stack for MiMo-V2 hybrid sliding-window-attention + MoE models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks (results as JSON).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Parse a byte size: ``1073741824``, ``256MiB``, ``1.5GiB``, ``1GB``, ``512M``.

    ``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` (also ``Ki/Mi/...``) are powers of 1024;
    ``KB/MB/GB/TB`` are powers of 1000. Case-insensitive.

    Raises:
        ValueError: Not a size, or not positive.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r} (examples: 268435456, 256MiB, 1GiB, 1GB)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def _size_option(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


# ---------------------------------------------------------------------------------------------
# Engine options: one definition for `swaserve serve` and the workers (services/worker_cli.py)


@dataclass(frozen=True)
class EngineOption:
    """One engine flag: parameter name (``page_size`` -> ``--page-size``), typer annotation, default."""

    name: str
    annotation: Any
    default: Any


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("page_size", Annotated[int, typer.Option(min=1, help="Tokens per KV page.")], 16),
    EngineOption(
        "kv_cache_memory",
        Annotated[
            int, typer.Option(parser=_size_option, metavar="BYTES", help="KV cache bytes, e.g. 256MiB, 1GB.")
        ],
        "256MiB",
    ),
    EngineOption(
        "kv_layout",
        Annotated[
            Literal["hybrid", "full"],
            typer.Option(help="hybrid: SWA layers keep only their window; full: baseline."),
        ],
        "hybrid",
    ),
    EngineOption(
        "max_num_seqs", Annotated[int, typer.Option(min=1, help="Most requests running at once.")], 64
    ),
    EngineOption(
        "max_num_batched_tokens",
        Annotated[int, typer.Option(min=1, help="Token budget per engine step.")],
        512,
    ),
    EngineOption(
        "max_model_len",
        Annotated[int | None, typer.Option(min=1, help="Longest prompt+output (default: model's).")],
        None,
    ),
    EngineOption(
        "dtype",
        Annotated[Literal["float32", "bfloat16", "float16"], typer.Option(help="Activation and KV dtype.")],
        "float32",
    ),
    EngineOption(
        "device",
        Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1... (default: CUDA if present).")],
        None,
    ),
    EngineOption("seed", Annotated[int, typer.Option(help="Engine sampling seed.")], 0),
    EngineOption(
        "enable_prefix_caching",
        Annotated[bool, typer.Option(help="Reuse cached prefixes' KV (SWA-aware radix tree).")],
        True,
    ),
    EngineOption(
        "host_cache_memory",
        Annotated[
            int | None,
            typer.Option(
                parser=_size_option,
                metavar="BYTES",
                help="Host-memory KV tier behind the device pools (default: none).",
            ),
        ],
        None,
    ),
    EngineOption(
        "host_write_policy",
        Annotated[
            Literal["on_evict", "second_hit"],
            typer.Option(
                help="When pages get a host copy: when evicted from device, or on their second hit."
            ),
        ],
        "on_evict",
    ),
    EngineOption(
        "swa_full_tokens_ratio",
        Annotated[
            float | None,
            typer.Option(
                min=0.0,
                help="With prefix caching: SWA-pool pages per full-pool page (default 1/9; see kvcache.sizing).",
            ),
        ],
        None,
    ),
    EngineOption(
        "schedule_policy",
        Annotated[
            Literal["fcfs", "compute"],
            typer.Option(
                help="Admission order: fcfs, or compute (fewest uncached tokens first, aged, bounded)."
            ),
        ],
        "fcfs",
    ),
    EngineOption(
        "priority_max_wait_s",
        Annotated[
            float, typer.Option(min=0.0, help="compute: no request waits past this (s) for a shorter one.")
        ],
        30.0,
    ),
    EngineOption(
        "priority_wait_weight",
        Annotated[
            float, typer.Option(min=0.0, help="compute: seconds of work one second of waiting is worth.")
        ],
        0.1,
    ),
    EngineOption(
        "cost_model",
        Annotated[
            Literal["cpu-tiny", "mimo-v2-flash-h200"],
            typer.Option(help="compute: cost-model preset for prefill times (swaserve.routing.cost)."),
        ],
        "cpu-tiny",
    ),
    EngineOption(
        "engine_process",
        Annotated[
            Literal["auto", "inline", "separate"],
            typer.Option(
                help="Where the engine core steps: inline (on the server's event loop), separate "
                "(its own process; probes and streams never wait for a step), auto (by device)."
            ),
        ],
        "auto",
    ),
)
"""The engine flags of ``swaserve serve`` and of every worker (``engine_options``): a flag added
here exists for both, with the same name, default and help."""

F = TypeVar("F", bound=Callable[..., Any])


def engine_options(**overrides: tuple[Any, str]) -> Callable[[F], F]:
    """Decorator for a typer command: its ``engine_config: EngineConfig`` parameter becomes the
    ``ENGINE_OPTIONS`` flags (in its place), and the command receives their values as one
    ``EngineConfig``.

    Args:
        overrides: ``name=(default, help)`` for a flag whose default differs in this command.
    """
    unknown = set(overrides) - {o.name for o in ENGINE_OPTIONS}
    if unknown:
        raise ValueError(f"no engine option {sorted(unknown)}")

    def wrap(func: F) -> F:
        options = []
        for o in ENGINE_OPTIONS:
            annotation, default = o.annotation, o.default
            if o.name in overrides:
                default, help_text = overrides[o.name]
                base, info = get_args(annotation)
                info = copy.copy(info)
                info.help = help_text
                annotation = Annotated[base, info]
            options.append(
                inspect.Parameter(
                    o.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
                )
            )
        sig = inspect.signature(func, eval_str=True)
        if "engine_config" not in sig.parameters:
            raise TypeError(f"{func.__name__} has no engine_config parameter")
        params: list[inspect.Parameter] = []
        for p in sig.parameters.values():  # keyword-only: typer passes everything by name
            params += (
                options if p.name == "engine_config" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]
            )

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            values = {o.name: kwargs.pop(o.name) for o in ENGINE_OPTIONS}
            return func(**kwargs, engine_config=build_engine_config(**values))

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command  # type: ignore[return-value]

    return wrap


def build_engine_config(**values: Any) -> EngineConfig:
    """An ``EngineConfig`` from the values of the ``ENGINE_OPTIONS`` flags."""
    return EngineConfig(**{**values, "host_cache_memory": values.get("host_cache_memory") or 0})


def _model_dir(model: Path | None) -> Path:
    if model is not None:
        return model
    from swaserve.model.checkpoint import default_model_dir

    return Path(default_model_dir())


@app.command()
@engine_options()
def serve(
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: the bundled default model).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name in the API (default: dir name).")
    ] = None,
    engine_config: EngineConfig = None,  # type: ignore[assignment]  # the ENGINE_OPTIONS flags
) -> None:
    """Serve a checkpoint over the OpenAI-compatible HTTP API."""
    from swaserve.api.server import serve as run_server

    code = run_server(str(_model_dir(model)), host, port, engine_config, served_model_name)
    if code:
        raise typer.Exit(code)


@app.command()
def up(
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(min=1, help="Decode workers.")] = 1,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: the bundled default model).")
    ] = None,
    port: Annotated[int, typer.Option(min=0, help="Router HTTP port (0 = a free one).")] = 8000,
    worker_arg: Annotated[
        list[str] | None,
        typer.Option(help="Extra worker argument (repeatable), e.g. --worker-arg=--max-num-seqs=16."),
    ] = None,
    router_arg: Annotated[list[str] | None, typer.Option(help="Extra router argument (repeatable).")] = None,
    prefill_arg: Annotated[
        list[str] | None,
        typer.Option(
            help="Extra prefill-worker argument (repeatable), e.g. --prefill-arg=--schedule-policy=compute."
        ),
    ] = None,
    decode_arg: Annotated[
        list[str] | None, typer.Option(help="Extra decode-worker argument (repeatable).")
    ] = None,
    prefill_len_range: Annotated[
        list[str] | None,
        typer.Option(
            help="Prompt-length bucket of prefill worker i, in order (repeatable, e.g. 0-2k then 2k-): "
            "--prompt-len-range of each."
        ),
    ] = None,
    routers: Annotated[int, typer.Option(min=1, help="Router replicas (stateless; state in Redis).")] = 1,
    redis: Annotated[
        bool,
        typer.Option(help="Share routing state in Redis: REDIS_URL, or a local redis-server started here."),
    ] = True,
    index_mode: Annotated[
        Literal["approximate", "precise"],
        typer.Option(help="Prefix index: record dispatches, or follow the prefill workers' cache events."),
    ] = "approximate",
    startup_timeout: Annotated[float, typer.Option(min=1.0, help="Seconds to wait for readiness.")] = 600.0,
) -> None:
    """Start the disaggregated cluster (router + prefill + decode workers) on 127.0.0.1 until Ctrl-C."""
    import signal

    from swaserve.launcher import Cluster, ClusterError

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    cluster = Cluster(
        _model_dir(model),
        prefill,
        decode,
        port,
        worker_args=list(worker_arg or []),
        router_args=list(router_arg or []),
        prefill_args=list(prefill_arg or []),
        decode_args=list(decode_arg or []),
        prefill_ranges=list(prefill_len_range or []),
        routers=routers,
        redis=redis,
        index_mode=index_mode,
    )
    try:
        url = cluster.start(startup_timeout)
        others = f"; other routers: {' '.join(cluster.urls[1:])}" if routers > 1 else ""
        shared = f"; routing state in {cluster.redis_url}" if cluster.redis_url else ""
        print(
            f"\ncluster ready: {url}  ({prefill} prefill, {decode} decode{others}{shared}; "
            f"try: curl {url}/v1/models)",
            flush=True,
        )
        code = cluster.watch()
        print(f"every router exited (last status {code}); stopping the cluster", flush=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        print("\nstopping the cluster...", flush=True)
    except ClusterError as e:
        print(f"error: {e}", flush=True)
        raise typer.Exit(1) from e
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()


@app.command("make-checkpoint")
def make_checkpoint(
    out: Annotated[Path, typer.Option(help="Directory to write the checkpoint to.")],
    preset: Annotated[Literal["tiny", "default"], typer.Option(help="Model size preset.")] = "default",
    seed: Annotated[int, typer.Option(help="Weight initialization seed.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty --out directory.")] = False,
) -> None:
    """Write a randomly initialized MiMo-V2 checkpoint (config, tokenizer, safetensors)."""
    from swaserve.model.checkpoint import make_checkpoint as write_checkpoint

    try:
        write_checkpoint(preset, out, seed, overwrite=overwrite)
    except FileExistsError as e:
        raise typer.BadParameter(f"{e} (pass --overwrite to replace it)", param_hint="--out") from e
    typer.echo(f"wrote {preset} checkpoint to {out}")


@app.command()
def replay(
    url: Annotated[str, typer.Option(help="Server base URL.")] = "http://127.0.0.1:8000",
    trace: Annotated[
        Path | None, typer.Option(help="Mooncake .jsonl trace (default: the bundled one).")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Replay the first N requests only.")] = None,
    time_scale: Annotated[float, typer.Option(help="Divide arrival times by S (> 0).")] = 1.0,
    block_tokens: Annotated[int, typer.Option(min=1, help="Tokens per 512-token trace block.")] = 16,
    max_output_tokens: Annotated[
        int | None, typer.Option(min=1, help="Cap on each request's max_tokens.")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here as JSON.")] = None,
    model: Annotated[
        str | None, typer.Option(help="Model name to request (default: first of /v1/models).")
    ] = None,
    model_dir: Annotated[Path | None, typer.Option(help="Read vocab size and special ids from here.")] = None,
    vocab_size: Annotated[
        int | None, typer.Option(min=1, help="Prompt ids < this (default: --model-dir's, else 4096).")
    ] = None,
    reserved_ids: Annotated[
        str | None, typer.Option(help="Ids never used in prompts, e.g. '0-2,100' (default: 0-2).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the prompt token blocks.")] = 0,
    request_timeout: Annotated[float, typer.Option(help="Seconds per request (> 0).")] = 600.0,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a Mooncake trace against a server and report latency, throughput and KV usage."""
    from swaserve.replay import (
        DEFAULT_RESERVED_IDS,
        DEFAULT_VOCAB_SIZE,
        ReplayError,
        ReplayOptions,
        format_report,
        parse_id_ranges,
        run_replay,
        token_space_from_model_dir,
    )
    from swaserve.traces import DEFAULT_MOONCAKE_TRACE, read_mooncake

    vocab, reserved = DEFAULT_VOCAB_SIZE, None
    if model_dir is not None:
        try:
            vocab, found = token_space_from_model_dir(model_dir)
        except ValueError as e:  # ConfigError
            raise typer.BadParameter(str(e), param_hint="--model-dir") from e
        reserved = found
    if vocab_size is not None:
        vocab = vocab_size
    if reserved_ids is not None:
        try:
            reserved = parse_id_ranges(reserved_ids)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--reserved-ids") from e
    if reserved is None:
        reserved = DEFAULT_RESERVED_IDS
    trace_path = trace or DEFAULT_MOONCAKE_TRACE
    try:
        requests = read_mooncake(trace_path, limit)
    except (OSError, ValueError) as e:  # unreadable file, TraceError
        raise typer.BadParameter(str(e), param_hint="--trace") from e
    try:
        opts = ReplayOptions(
            url=url,
            model=model,
            time_scale=time_scale,
            block_tokens=block_tokens,
            max_output_tokens=max_output_tokens,
            vocab_size=vocab,
            reserved_ids=reserved,
            seed=seed,
            request_timeout_s=request_timeout,
            progress=progress,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    try:
        report = run_replay(requests, opts, json_path, trace_name=str(trace_path))
    except ReplayError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(format_report(report))
    if report["failed"]:
        raise typer.Exit(1)


@bench_app.command("kv-capacity")
def bench_kv_capacity(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
) -> None:
    """KV capacity of the hybrid vs full layout for a memory budget."""
    from bench.kv_capacity import main

    main(str(json_path) if json_path is not None else None)


@bench_app.command("prefix-cache")
def bench_prefix_cache(
    trace: Annotated[
        list[Path] | None,
        typer.Option(help="Mooncake .jsonl or agent-session trace; repeatable (default: both bundled ones)."),
    ] = None,
    budget: Annotated[
        int | None,
        typer.Option(
            parser=_size_option,
            metavar="BYTES",
            help="Device KV bytes (default: 25% of the trace's footprint).",
        ),
    ] = None,
    host_budget: Annotated[
        int | None,
        typer.Option(
            parser=_size_option,
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
    swa_ratio: Annotated[
        float | None,
        typer.Option(min=0.0, help="Hybrid SWA-pool pages per full page (default: the engine's, 1/9)."),
    ] = None,
    curve: Annotated[bool, typer.Option(help="Also replay the hit-rate curve over budgets.")] = True,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
) -> None:
    """Prefix-cache token hit rates of a trace at a memory budget (real cache, no model)."""
    from bench.prefix_cache import BenchInputError, main
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
        )
    except (OSError, TraceError, BenchInputError) as e:  # unreadable or malformed trace, tiny budget
        raise typer.BadParameter(str(e)) from e


@bench_app.command("engine")
def bench_engine(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
) -> None:
    """Engine throughput and latency on the default model."""
    from bench.engine_bench import main

    main(str(json_path) if json_path is not None else None)


@bench_app.command("pd-transfer")
def bench_pd_transfer(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Loopback pushes per length (best is reported).")] = 3,
) -> None:
    """Prefill->decode KV bytes per request vs full KV (per length), and loopback throughput."""
    from bench.pd_transfer import main

    main(json_path, repeats=repeats)


@bench_app.command("cluster-replay")
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


@bench_app.command("prefix-replay")
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


@app.command()
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
            parser=_size_option, metavar="BYTES", help="Host-tier KV per prefill instance, e.g. 1.5TB."
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
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result here as JSON.")] = None,
) -> None:
    """Simulate the cluster on a trace: the real routing and radix-cache code in simulated time."""
    from swaserve.sim import workload as wl
    from swaserve.sim.run import deployment as get_deployment
    from swaserve.sim.run import print_table, simulate, write_json

    try:
        if policy != "cache_aware" and queue_order != "auto":
            raise ValueError(f"--queue-order applies to --policy cache_aware only, not {policy}")
        dep = get_deployment(deployment)
        work = wl.load(trace, limit, copies)
        row = simulate(
            work, prefill, decode, policy, dep, priority, load=load, time_scale=time_scale,
            host_bytes=host_cache, max_wait_s=max_wait, wait_weight=wait_weight, index_mode=index_mode,
            policy_args={"queue_order": queue_order} if policy == "cache_aware" else None,
        )  # fmt: skip

    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    print_table([row])
    if json_path is not None:
        write_json(json_path, row)


@bench_app.command("routing-sim")
def bench_routing_sim(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="First N requests of each trace.")] = None,
    load: Annotated[float, typer.Option(min=0.01, max=2.0, help="Offered prefill load.")] = 0.8,
) -> None:
    """Routing policies in the simulator: hit rate and TTFT, 8 and 16 prefill instances."""
    from bench.routing_sim import main

    main(load=load, limit=limit, json_path=json_path)


@bench_app.command("routing-cluster")
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


@bench_app.command("frontend")
def bench_frontend(
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here as JSON.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Trace requests of the make-run replay.")] = 250,
    saturated: Annotated[int, typer.Option(min=1, help="Requests sent at once (throughput).")] = 100,
    probe_tokens: Annotated[int, typer.Option(min=16, help="Prompt tokens of the long prefill.")] = 8192,
    probe_interval: Annotated[float, typer.Option(min=0.001, help="Seconds between probes.")] = 0.02,
) -> None:
    """Inline engine vs separate engine-core process: TTFT/ITL, tokens/s, probe latency."""
    from bench.frontend import main

    main(json_path, limit, saturated, probe_tokens, probe_interval)


if __name__ == "__main__":
    app()

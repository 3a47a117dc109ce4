"""The ``swaserve`` command line: serve, up, make-checkpoint, replay, sim and plan-ep
(``swaserve.plan_cli``), and the command groups of the ``swaserve.cli`` entry points (``bench``:
``bench/cli.py``). Engine flags: ``swaserve.options``.

Heavy modules (torch, the engine, the HTTP server) are imported inside the commands, so
``swaserve --help`` stays fast.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Literal

import typer

from swaserve.config import EngineConfig  # light: no torch
from swaserve.engine.types import MAX_LOGPROBS  # light: no torch
from swaserve.front_options import (
    API_KEY_ENV,
    AdminTokenOption,
    AllowedLocalMediaPathOption,
    AllowedMediaDomainsOption,
    ApiKeyOption,
    ChatTemplateOption,
    LimitMMOption,
    MaxLogprobsOption,
    ServedModelNameOption,
    SslCertfileOption,
    SslKeyfileOption,
    check_ssl_files,
    media_args,
)
from swaserve.options import engine_options, size_option
from swaserve.plan_cli import plan_ep, sim

app = typer.Typer(
    name="swaserve",
    help="Serving stack for MiMo-V2 hybrid sliding-window-attention + MoE models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _ep in entry_points(group="swaserve.cli"):  # e.g. ``bench`` (bench/cli.py): typer apps mounted here
    app.add_typer(_ep.load(), name=_ep.name)


def _model_dir(model: Path | None) -> Path:
    if model is not None:
        return model
    from swaserve.model.checkpoint import default_model_dir

    return Path(default_model_dir())


def _chat_template(value: str | None, model_dir: Path) -> str | None:
    """``--chat-template``'s template, read and checked now: a bad one is a usage error (exit 2)."""
    if value is None:
        return None
    from swaserve.api.chat_template import resolve_chat_template

    try:
        return resolve_chat_template(value, model_dir)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--chat-template") from e


def _check_engine(model_dir: Path, engine_config: EngineConfig) -> None:
    from swaserve.engine.factory import check_ep, check_kv_formats

    try:
        check_ep(model_dir, engine_config)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--ep-size") from e
    try:
        check_kv_formats(model_dir, engine_config)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-cache-dtype") from e


@app.command()
@engine_options()
def serve(
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: the bundled default model).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: ServedModelNameOption = None,
    max_request_bytes: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES", help="Larger request bodies get a 413.")
    ] = "32MiB",  # type: ignore[assignment]  # parsed by size_option
    api_key: ApiKeyOption = None,
    chat_template: ChatTemplateOption = None,
    max_logprobs: MaxLogprobsOption = MAX_LOGPROBS,
    ssl_certfile: SslCertfileOption = None,
    ssl_keyfile: SslKeyfileOption = None,
    limit_mm_per_prompt: LimitMMOption = None,
    allowed_media_domains: AllowedMediaDomainsOption = None,
    allowed_local_media_path: AllowedLocalMediaPathOption = None,
    num_threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="CPU threads for torch in the engine (default: torch's choice, at most the usable CPUs).",
        ),
    ] = None,
    engine_config: EngineConfig = None,  # type: ignore[assignment]  # the ENGINE_OPTIONS flags
) -> None:
    """Serve a checkpoint over the OpenAI-compatible HTTP API."""
    check_ssl_files(ssl_certfile, ssl_keyfile)
    model_dir = _model_dir(model)
    template = _chat_template(chat_template, model_dir)
    _check_engine(model_dir, engine_config)
    from swaserve.api.media import media_options
    from swaserve.api.server import serve as run_server

    code = run_server(
        str(model_dir), host, port, engine_config, served_model_name, max_request_bytes,
        api_key=api_key, chat_template=template, max_logprobs=max_logprobs, num_threads=num_threads,
        ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
        ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
        media_options=media_options(limit_mm_per_prompt, allowed_media_domains, allowed_local_media_path),
    )  # fmt: skip
    if code:
        raise typer.Exit(code)


@app.command()
def up(
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(min=1, help="Decode workers.")] = 1,
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: the bundled default model).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address the router's HTTP port binds (0.0.0.0: every one).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(min=0, help="Router HTTP port (0 = a free one).")] = 8000,
    served_model_name: ServedModelNameOption = None,
    api_key: ApiKeyOption = None,
    admin_token: AdminTokenOption = None,
    chat_template: ChatTemplateOption = None,
    max_logprobs: MaxLogprobsOption = MAX_LOGPROBS,
    limit_mm_per_prompt: LimitMMOption = None,
    allowed_media_domains: AllowedMediaDomainsOption = None,
    allowed_local_media_path: AllowedLocalMediaPathOption = None,
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
    gcache: Annotated[
        int,
        typer.Option(
            min=0,
            help="GCache (L3 KV cache) nodes to start (0: none). Needs Redis; prefill workers get "
            "--l3-url (the nodes registered in this Redis and namespace), --weights-id and, unless "
            "given, --host-cache-memory=256MiB. Routers credit L3 hits with --index-mode precise.",
        ),
    ] = 0,
    gcache_dram: Annotated[
        int | None,
        typer.Option(
            parser=size_option, metavar="BYTES", help="DRAM tier of each GCache node (default 1GiB)."
        ),
    ] = None,
    gcache_nvme: Annotated[
        int | None,
        typer.Option(
            parser=size_option, metavar="BYTES", help="NVMe tier of each GCache node (default 8GiB)."
        ),
    ] = None,
    gcache_nvme_dir: Annotated[
        Path | None,
        typer.Option(
            help="GCache node i's NVMe tier in DIR/gcache-i, kept across runs (default: this run's "
            "temporary directory, removed at exit)."
        ),
    ] = None,
    gcache_arg: Annotated[
        list[str] | None,
        typer.Option(help="Extra GCache node argument (repeatable), e.g. --gcache-arg=--ucx-port=-1."),
    ] = None,
    encoder: Annotated[
        int,
        typer.Option(
            min=0,
            help="Media encoder workers to start (0: none; images, audio and video then get a 400). "
            "The routers get --encoder for each.",
        ),
    ] = 0,
    encoder_arg: Annotated[
        list[str] | None,
        typer.Option(help="Extra encoder argument (repeatable), e.g. --encoder-arg=--max-batch-items=8."),
    ] = None,
    prefill_ep: Annotated[
        int,
        typer.Option(
            min=1, help="Expert parallelism of each prefill worker: ranks per instance (--ep-size)."
        ),
    ] = 1,
    launcher: Annotated[
        Literal["process", "ray"],
        typer.Option(
            help="How EP instances start their ranks: child processes, or Ray actors in a placement "
            "group (--ep-launcher; each worker starts a local Ray on 127.0.0.1 unless RAY_ADDRESS is set)."
        ),
    ] = "process",
) -> None:
    """Start the disaggregated cluster (router + prefill + decode workers, optional GCache nodes and
    media encoders) on
    127.0.0.1 until Ctrl-C; the routers' HTTP port on --host."""
    import signal

    from swaserve.launcher import Cluster
    from swaserve.procs import ClusterError

    model_dir = _model_dir(model)
    _chat_template(chat_template, model_dir)  # a bad one stops here, before any process starts
    front = ["--max-logprobs", str(max_logprobs)]
    front += media_args(limit_mm_per_prompt, allowed_media_domains, allowed_local_media_path)
    if served_model_name is not None:
        front += ["--served-model-name", served_model_name]
    if chat_template is not None:
        front += ["--chat-template", chat_template]

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    cluster = Cluster(
        model_dir,
        prefill,
        decode,
        port,
        worker_args=[*(["--ep-launcher", launcher] if launcher != "process" else []), *(worker_arg or [])],
        router_args=[*front, *(router_arg or [])],
        prefill_args=[*(["--ep-size", str(prefill_ep)] if prefill_ep > 1 else []), *(prefill_arg or [])],
        decode_args=list(decode_arg or []),
        prefill_ranges=list(prefill_len_range or []),
        routers=routers,
        redis=redis,
        index_mode=index_mode,
        host=host,
        api_key=api_key,
        admin_token=admin_token,
        gcache=gcache,
        gcache_dram=gcache_dram,
        gcache_nvme=gcache_nvme,
        gcache_nvme_dir=gcache_nvme_dir,
        gcache_args=list(gcache_arg or []),
        encoders=encoder,
        encoder_args=list(encoder_arg or []),
    )
    try:
        url = cluster.start(startup_timeout)
        others = f"; other routers: {' '.join(cluster.urls[1:])}" if routers > 1 else ""
        shared = f"; routing state in {cluster.redis_url}" if cluster.redis_url else ""
        shared += f"; GCache: {' '.join(cluster.gcache_addresses)}" if gcache else ""
        shared += f"; encoders: {' '.join(cluster.encoder_addresses)}" if encoder else ""
        auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if api_key else ""  # never the key itself
        print(
            f"\ncluster ready: {url}  ({prefill} prefill, {decode} decode{others}{shared}; "
            f"try: curl{auth} {url}/v1/models)",
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
    mtp_layers: Annotated[
        int,
        typer.Option(
            min=0,
            max=8,
            help="MTP (multi-token prediction) layers to add, hub key layout: random, or self-distilled "
            "when the preset trains (default: 0 = random none / the trained preset's 3).",
        ),
    ] = 0,
    train: Annotated[
        bool,
        typer.Option(help="Run the preset's short CPU training (default preset: target + MTP layers)."),
    ] = True,
) -> None:
    """Write a MiMo-V2 checkpoint (config, tokenizer, safetensors): random weights; the default
    preset then trains a few CPU minutes (swaserve.model.train; losses in training.json)."""
    from swaserve.model.checkpoint import make_checkpoint as write_checkpoint

    try:
        write_checkpoint(preset, out, seed, overwrite=overwrite, mtp_layers=mtp_layers, train=train)
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
    from swaserve.replay import format_report, run_replay
    from swaserve.replay_plan import (
        DEFAULT_RESERVED_IDS,
        DEFAULT_VOCAB_SIZE,
        ReplayError,
        ReplayOptions,
        parse_id_ranges,
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


app.command()(sim)
app.command("plan-ep")(plan_ep)


if __name__ == "__main__":
    app()

"""``python -m services.router --help``: the OpenAI HTTP API over prefill and decode workers, plus
``GET/POST/DELETE /workers`` (``swaserve.api.workers``) to list, add and remove workers at runtime.
Flags: workers and polling, routing (``--policy``, ``--redis-url``, ``--index-mode``, ...), the HTTP
front's (``--api-key``; ``--admin-token`` for ``/workers``, else the API key guards it too;
``--chat-template``, ``--max-logprobs``; HTTPS: ``--ssl-certfile``/``--ssl-keyfile``), gRPC TLS to
the workers (``--grpc-tls-ca``, ``--grpc-tls-server-name``): docs/OPERATIONS.md."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.lifecycle import run_app
from swaserve.engine.types import MAX_LOGPROBS
from swaserve.front_options import (
    AdminTokenOption,
    AllowedLocalMediaPathOption,
    AllowedMediaDomainsOption,
    ApiKeyOption,
    ChatTemplateOption,
    GrpcTlsCaOption,
    GrpcTlsServerNameOption,
    LimitMMOption,
    MaxLogprobsOption,
    ServedModelNameOption,
    SslCertfileOption,
    SslKeyfileOption,
    check_ssl_files,
)
from swaserve.options import size_option
from swaserve.routing.discovery import DEFAULT_PORT, DEFAULT_SELECTOR

if TYPE_CHECKING:
    from services.router.discovery import DiscoveryOptions

app = typer.Typer(add_completion=False, help="swaserve router: OpenAI API, dispatch to gRPC workers.")


@app.command()
def main(
    prefill: Annotated[
        list[str] | None,
        typer.Option(help="Prefill worker host:port (repeatable; required without --discovery kubernetes)."),
    ] = None,
    decode: Annotated[
        list[str] | None,
        typer.Option(help="Decode worker host:port (repeatable; required without --discovery kubernetes)."),
    ] = None,
    encoder: Annotated[
        list[str] | None,
        typer.Option(help="Media encoder host:port (repeatable; none: images, audio and video get a 400)."),
    ] = None,
    limit_mm_per_prompt: LimitMMOption = None,
    allowed_media_domains: AllowedMediaDomainsOption = None,
    allowed_local_media_path: AllowedLocalMediaPathOption = None,
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir (tokenizer, config).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, help="HTTP port.")] = 8000,
    served_model_name: ServedModelNameOption = None,
    api_key: ApiKeyOption = None,
    chat_template: ChatTemplateOption = None,
    max_logprobs: MaxLogprobsOption = MAX_LOGPROBS,
    admin_token: AdminTokenOption = None,
    ssl_certfile: SslCertfileOption = None,
    ssl_keyfile: SslKeyfileOption = None,
    grpc_tls_ca: GrpcTlsCaOption = None,
    grpc_tls_server_name: GrpcTlsServerNameOption = None,
    request_timeout: Annotated[float, typer.Option(min=1.0, help="Per-request deadline, seconds.")] = 600.0,
    max_request_bytes: Annotated[
        int, typer.Option(parser=size_option, metavar="BYTES", help="Larger request bodies get a 413.")
    ] = "32MiB",  # type: ignore[assignment]  # parsed by size_option
    max_retries: Annotated[
        int,
        typer.Option(
            min=0,
            help="Re-dispatches of a request whose worker failed: retries before its first decode token "
            "and resumes after it (prompt + tokens sent, on other workers) count alike.",
        ),
    ] = 2,
    poll_interval: Annotated[
        float,
        typer.Option(
            min=0.05, help="Seconds between GetLoad polls (worker health, load, /metrics) and registry syncs."
        ),
    ] = 1.0,
    poll_timeout: Annotated[
        float,
        typer.Option(
            min=0.05,
            help="GetLoad deadline, seconds: a worker answers between engine steps, so keep it above the "
            "longest step.",
        ),
    ] = 10.0,
    hung_polls: Annotated[
        int,
        typer.Option(
            min=1,
            help="Poll deadlines missed in a row that mark a worker down (its requests in flight are "
            "cancelled and retried elsewhere when no decode output was sent yet).",
        ),
    ] = 3,
    policy: Annotated[
        str,
        typer.Option(help="Prefill choice: cache_aware, least_load, round_robin (swaserve.routing.policy)."),
    ] = "cache_aware",
    cost_model: Annotated[
        str, typer.Option(help="Cost-model preset for TTFT estimates: cpu-tiny, mimo-v2-flash-h200.")
    ] = "cpu-tiny",
    block_tokens: Annotated[int, typer.Option(min=1, help="Tokens per prefix-index block.")] = 64,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="REDIS_URL", help="Shared routing state for router replicas (default: in process)."
        ),
    ] = None,
    namespace: Annotated[str, typer.Option(help="Redis key namespace of this cluster.")] = "swaserve",
    index_mode: Annotated[
        str, typer.Option(help="approximate: record dispatches; precise: follow workers' cache events.")
    ] = "approximate",
    index_max_entries: Annotated[int, typer.Option(min=1, help="Global cap on index entries.")] = 4_000_000,
    index_ttl: Annotated[float, typer.Option(min=1.0, help="Seconds an index entry lives unused.")] = 3600.0,
    balance_abs: Annotated[
        float | None, typer.Option(min=0.0, help="cache_aware guard: queue seconds over the shortest.")
    ] = None,
    balance_rel: Annotated[
        float | None, typer.Option(min=1.0, help="cache_aware guard: queue ratio over the shortest.")
    ] = None,
    queue_order: Annotated[
        str,
        typer.Option(
            help="cache_aware: the prefill queue order its wait estimate assumes: auto (each worker's "
            "reported --schedule-policy), fcfs, compute (swaserve.routing.policy.wait_s)."
        ),
    ] = "auto",
    discovery: Annotated[
        str,
        typer.Option(
            help="Where workers come from: static (--prefill/--decode, POST /workers) or kubernetes "
            "(also the Ready pods with label swaserve.io/role=prefill|decode matching --selector)."
        ),
    ] = "static",
    selector: Annotated[
        str, typer.Option(help="kubernetes: label selector of the pods to watch (labelSelector).")
    ] = DEFAULT_SELECTOR,
    discovery_namespace: Annotated[
        str | None,
        typer.Option(help="kubernetes: namespace of the pods (default: the router pod's own, else default)."),
    ] = None,
    worker_port: Annotated[
        int,
        typer.Option(
            min=1,
            max=65535,
            help="kubernetes: gRPC port of a pod without the swaserve.io/grpc-port annotation.",
        ),
    ] = DEFAULT_PORT,
    resync_interval: Annotated[
        float, typer.Option(min=1.0, help="kubernetes: seconds between full pod LISTs (besides the watch).")
    ] = 30.0,
    shutdown_timeout: Annotated[
        int,
        typer.Option(
            min=0,
            help="On SIGTERM: stop accepting connections and let the responses in flight (streams "
            "included) finish for at most this many seconds, then close them.",
        ),
    ] = 5,
) -> None:
    import uvicorn

    from services.router.cluster import ClusterEngine
    from services.router.routing import RoutingOptions
    from swaserve.api.chat_template import resolve_chat_template
    from swaserve.api.media import media_options
    from swaserve.api.server import build_app
    from swaserve.api.workers import install_worker_routes

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    found_by = _discovery(
        discovery, prefill, decode, selector, discovery_namespace, worker_port, resync_interval
    )
    check_ssl_files(ssl_certfile, ssl_keyfile)
    from services.tls import Dialer

    try:
        dialer = Dialer.from_flags(grpc_tls_ca, grpc_tls_server_name)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if admin_token is None and api_key is not None:
        logging.getLogger("swaserve.router").warning(
            "no --admin-token: /workers (add, remove workers) is guarded by the API key only, so "
            "every API client can change the workers; set --admin-token (env SWASERVE_ADMIN_TOKEN)"
        )
    try:
        routing = RoutingOptions(
            policy, cost_model, block_tokens, redis_url, namespace, index_mode, index_max_entries, index_ttl,
            balance_abs, balance_rel, queue_order=queue_order,
        )  # fmt: skip
        from swaserve.routing.policy import make_policy
        from swaserve.sched.cost import preset

        preset(cost_model)
        make_policy(policy, **({"queue_order": queue_order} if policy == "cache_aware" else {}))
        if redis_url:
            import redis

            redis.Redis.from_url(redis_url)  # a malformed URL raises ValueError here
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if model is None:  # builds the default checkpoint on first use (imports torch: a model is built)
        from swaserve.model.checkpoint import default_model_dir

        model = default_model_dir()
    model_dir = model
    try:  # the template the router renders chats with: read and checked now
        template = resolve_chat_template(chat_template, model_dir)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--chat-template") from e
    engine = ClusterEngine(
        model_dir,
        prefill or [],
        decode or [],
        served_model_name,
        request_timeout,
        max_retries,
        poll_interval,
        routing,
        poll_timeout,
        hung_polls,
        dialer=dialer,
        discovery=found_by,
        encoders=encoder or [],
    )
    fastapi_app = build_app(
        engine,  # type: ignore[arg-type]
        max_request_bytes=max_request_bytes,
        api_key=api_key,
        chat_template=template,
        max_logprobs=max_logprobs,
        admin_token=admin_token,
        media_options=media_options(limit_mm_per_prompt, allowed_media_domains, allowed_local_media_path),
    )
    install_worker_routes(fastapi_app, engine.admin)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(
            fastapi_app, host=host, port=port, log_level="info", timeout_graceful_shutdown=shutdown_timeout,
            ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
            ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
        )  # fmt: skip


def _discovery(
    mode: str,
    prefill: list[str] | None,
    decode: list[str] | None,
    selector: str,
    namespace: str | None,
    worker_port: int,
    resync_s: float,
) -> DiscoveryOptions | None:
    """The discovery flags checked: None in static mode (which needs --prefill and --decode).

    Raises:
        typer.BadParameter: a bad mode, a missing worker flag (static),
            no Kubernetes client configuration (kubernetes).
    """
    import asyncio

    from services.router.discovery import DiscoveryError, DiscoveryOptions, client_config

    if mode == "static":
        for name, given in (("--prefill", prefill), ("--decode", decode)):
            if not given:  # exit status 2, as when the options were required
                raise typer.BadParameter(
                    "missing: at least one worker of each role, unless --discovery kubernetes",
                    param_hint=f"'{name}'",
                )
        return None
    if mode != "kubernetes":
        raise typer.BadParameter(f"must be 'static' or 'kubernetes', got {mode!r}", param_hint="--discovery")
    try:  # fail now, not at the first LIST: in a pod, or a kubeconfig file
        asyncio.run(client_config())
    except DiscoveryError as e:
        raise typer.BadParameter(str(e), param_hint="--discovery") from e
    return DiscoveryOptions(namespace, selector, worker_port, resync_s)


if __name__ == "__main__":
    run_app(app)

"""The HTTP front's flags shared by ``serve``, ``up`` and the router (``--api-key``,
``--served-model-name``, ``--chat-template``, ``--max-logprobs``, the media limits,
``--ssl-certfile``/``--ssl-keyfile``; the router's ``--admin-token``) and the gRPC TLS flags of the
router, the workers and the encoders (``--grpc-tls-*``), as typer annotations.
Light to import: typer, ``swaserve.engine.types`` and ``swaserve.media`` (numpy) only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from swaserve.engine.types import MAX_LOGPROBS
from swaserve.media import parse_limits

# -- the HTTP front's flags (serve, the router, up) ---------------------------------------------------
API_KEY_ENV = "SWASERVE_API_KEY"
"""The environment variable ``--api-key`` is read from when the flag is absent (vLLM: VLLM_API_KEY);
``swaserve up`` hands the key to its routers through it, never on their command lines."""


def _api_key(value: str | None) -> str | None:
    if value is not None and (not value or value != value.strip()):
        raise typer.BadParameter("the API key must not be empty or start or end with whitespace")
    return value


ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        envvar=API_KEY_ENV,
        show_envvar=True,
        metavar="KEY",
        callback=_api_key,
        help="Clients must send 'Authorization: Bearer KEY' (401 otherwise; /health and /metrics stay "
        "open). Prefer the environment variable: a command line shows in ps.",
    ),
]
ServedModelNameOption = Annotated[
    str | None,
    typer.Option(
        help="Model name clients send as `model` and see in /v1/models (default: the checkpoint dir's name)."
    ),
]
ChatTemplateOption = Annotated[
    str | None,
    typer.Option(
        metavar="PATH_OR_STRING",
        help="Jinja chat template (a file, or the template itself) used instead of the tokenizer's.",
    ),
]
MaxLogprobsOption = Annotated[
    int,
    typer.Option(
        min=0,
        max=MAX_LOGPROBS,
        help="Most alternatives per token a request may ask for (logprobs, top_logprobs, "
        "prompt_logprobs); more is a 400. At most the engine's bound.",
    ),
]


def _mm_limits(value: str | None) -> str | None:
    if value is not None:
        try:
            parse_limits(value)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--limit-mm-per-prompt") from e
    return value


LimitMMOption = Annotated[
    str | None,
    typer.Option(
        metavar="JSON",
        callback=_mm_limits,
        help='Most media items per request, e.g. \'{"image": 4, "video": 1, "audio": 2}\' (more is a 400; '
        "default image 8, video 1, audio 4).",
    ),
]
AllowedMediaDomainsOption = Annotated[
    list[str] | None,
    typer.Option(help="A host http(s) media URLs may name (repeatable); none: media only as data: URLs."),
]
AllowedLocalMediaPathOption = Annotated[
    Path | None,
    typer.Option(help="A directory file:// media URLs may read under; none: no local files."),
]


def media_args(limit: str | None, domains: list[str] | None, local: Path | None) -> list[str]:
    """The media flags as a command line (``up`` passes them to its routers)."""
    out: list[str] = []
    if limit is not None:
        out += ["--limit-mm-per-prompt", limit]
    for d in domains or []:
        out += ["--allowed-media-domains", d]
    if local is not None:
        out += ["--allowed-local-media-path", str(local)]
    return out


ADMIN_TOKEN_ENV = "SWASERVE_ADMIN_TOKEN"
"""The environment variable ``--admin-token`` is read from when the flag is absent."""


def _admin_token(value: str | None) -> str | None:
    if value is not None and (not value or value != value.strip()):
        raise typer.BadParameter("the admin token must not be empty or start or end with whitespace")
    return value


AdminTokenOption = Annotated[
    str | None,
    typer.Option(
        envvar=ADMIN_TOKEN_ENV,
        show_envvar=True,
        metavar="TOKEN",
        callback=_admin_token,
        help="/workers (list, add, remove workers) needs 'Authorization: Bearer TOKEN': 401 without a "
        "token, 403 with another (the API key too); /v1 still needs the API key. Prefer the "
        "environment variable: a command line shows in ps.",
    ),
]
SslCertfileOption = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="Serve HTTPS with this certificate chain (PEM; needs --ssl-keyfile).",
    ),
]
SslKeyfileOption = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, help="Private key (PEM) of --ssl-certfile."),
]
GrpcTlsCertOption = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="Serve gRPC with TLS: this certificate chain (PEM; with --grpc-tls-key).",
    ),
]
GrpcTlsKeyOption = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, help="Private key (PEM) of --grpc-tls-cert."),
]
GrpcTlsCaOption = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="Dial workers with TLS, trusting this CA (PEM) for their certificates (default: plaintext).",
    ),
]
GrpcTlsServerNameOption = Annotated[
    str | None,
    typer.Option(
        help="With --grpc-tls-ca: the name checked in worker certificates instead of the address dialed "
        "(pod IPs change; e.g. the one DNS name the certificate was issued for)."
    ),
]


def check_ssl_files(certfile: Path | None, keyfile: Path | None) -> None:
    """``--ssl-certfile`` and ``--ssl-keyfile`` come together.

    Raises:
        typer.BadParameter: one without the other.
    """
    if (certfile is None) != (keyfile is None):
        raise typer.BadParameter("give both or neither", param_hint="--ssl-certfile/--ssl-keyfile")

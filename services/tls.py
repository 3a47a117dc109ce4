"""gRPC TLS between the services: a worker's server credentials (``--grpc-tls-cert``,
``--grpc-tls-key``) and how a process dials workers (``Dialer``: plaintext, or TLS that trusts the
CA of ``--grpc-tls-ca`` and checks the worker certificate for ``--grpc-tls-server-name``, else for
the host dialed). The router dials workers with it, a prefill worker its decode workers (KV push).

Files are read once, at start: a renewed certificate takes a restart (a rolling one in Kubernetes).
Kubelet gRPC probes cannot speak TLS: a TLS worker serves ``grpc.health.v1`` in plaintext on its
``--health-port`` as well (``services.worker``). Operations: docs/OPERATIONS.md#tls-and-tokens"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


def read_pem(path: Path, what: str) -> bytes:
    """The PEM file at ``path`` (``what`` names it in the error).

    Raises:
        ValueError: unreadable, or no PEM block in it.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path}: not a PEM file")
    return data


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """TLS credentials of a worker's gRPC port: its certificate chain and private key (PEM).

    Raises:
        ValueError: a file unreadable or not PEM.
    """
    return grpc.ssl_server_credentials([(read_pem(key, "--grpc-tls-key"), read_pem(cert, "--grpc-tls-cert"))])


@dataclass(frozen=True)
class Dialer:
    """How this process opens channels to workers.

    Attributes:
        ca: PEM of the CA(s) trusted for worker certificates; None: plaintext.
        server_name: the name checked in a worker's certificate instead of the host dialed
            (``grpc.ssl_target_name_override``; pods change IPs, a certificate names one DNS name).
    """

    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_flags(cls, ca: Path | None, server_name: str | None) -> Dialer:
        """From ``--grpc-tls-ca`` and ``--grpc-tls-server-name``.

        Raises:
            ValueError: the CA file unreadable or not PEM; a server name without a CA.
        """
        if ca is None:
            if server_name:
                raise ValueError("--grpc-tls-server-name needs --grpc-tls-ca (it applies to TLS only)")
            return cls()
        return cls(read_pem(ca, "--grpc-tls-ca"), server_name or None)

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def _args(self, options: Sequence[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], Any]:
        opts = list(options)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca) if self.ca is not None else None
        return opts, creds

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` (``host:port``)."""
        opts, creds = self._args(options)
        if creds is None:
            return grpc.aio.insecure_channel(target, options=opts)
        return grpc.aio.secure_channel(target, creds, options=opts)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to ``target`` (probes, tests)."""
        opts, creds = self._args(options)
        if creds is None:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, creds, options=opts)

"""Helpers for tests that run a whole cluster (``swaserve.launcher.Cluster``)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

from swaserve.launcher import Cluster


@contextlib.contextmanager
def running(cluster: Cluster, timeout_s: float = 300) -> Iterator[Cluster]:
    """Start ``cluster`` and stop it afterwards, resuming stopped (SIGSTOP) processes first: a
    stopped process does not act on SIGTERM."""
    try:
        cluster.start(timeout_s=timeout_s)
        yield cluster
    finally:
        for name, svc in cluster.services.items():
            if name != "redis":
                svc.kill(signal.SIGCONT)
        cluster.stop()

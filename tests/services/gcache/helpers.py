"""Page objects and a node in this process, for the GCache service tests."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

from services.gcache.cli import NodeOptions, NodeServer
from swaserve.gcache import codec
from swaserve.gcache.keys import Salt, page_keys
from swaserve.gcache.l3 import PutPage

T = TypeVar("T")
PAGE = 4
SALT = Salt("fp", "w", "float32", PAGE).seed()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def chain(
    tokens: list[int], payload: int = 1000, kind: int = codec.FULL_KIND, seed: int = 0
) -> list[PutPage]:
    """One page object per whole page of ``tokens`` (random payloads of ``payload`` bytes)."""
    rng = np.random.default_rng(seed)
    out, parent = [], SALT
    for i, k in enumerate(page_keys(tokens, PAGE, SALT)):
        body = rng.integers(0, 256, payload, dtype=np.uint8).tobytes()
        obj = codec.encode(kind, i, SALT, k, parent, tokens[i * PAGE : (i + 1) * PAGE], body)
        out.append(PutPage((k, kind), parent, i, obj))
        parent = k
    return out


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 50_000, n)]


def ucx_or_skip() -> None:
    """Skip the test when the UCX data plane cannot run here."""
    try:
        from services.gcache import ucx
    except ImportError as e:
        pytest.skip(f"services/gcache/ucx.py does not import: {e}")
    if not ucx.available():
        pytest.skip("ucxx does not import here (the Makefile installs it: pip install -e .[gcache])")


@contextlib.asynccontextmanager
async def node(ucx: bool = False, **kw: Any) -> AsyncIterator[NodeServer]:
    """A node on 127.0.0.1 in this process (``ucx``: with its UCX data plane)."""
    opts = NodeOptions(ucx_port=0 if ucx else -1, dram=kw.pop("dram", 16 << 20), **kw)
    server = NodeServer(opts)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def run_script(code: str, timeout_s: float = 60.0) -> None:
    """Run ``code`` in a new Python process: it must exit 0 having printed ``done``."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]

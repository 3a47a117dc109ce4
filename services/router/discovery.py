"""Kubernetes discovery of workers for the router (``--discovery kubernetes``): ``KubeDiscovery``
lists and watches the pods of one namespace and label selector with ``kubernetes_asyncio`` and
hands the workers in use (``swaserve.routing.discovery``) to a callback after every change.

The loop: LIST (its resourceVersion) -> reconcile the whole set -> WATCH from that version,
bookmarks on, until the resync deadline (``resync_s``) -> LIST again. A 410 Gone, an ERROR event,
a dropped stream or any error: LIST again after an exponential backoff (0.5 s .. 30 s, reset by
a stream that stayed up ``healthy_s`` or to its deadline). One task: never two LISTs at once.

Design notes: docs/DESIGN.md#servicesrouterdiscoverypy"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swaserve.routing.discovery import (
    DEFAULT_PORT,
    DEFAULT_SELECTOR,
    EVENT_TYPES,
    DiscoveredWorker,
    PodSet,
    count_roles,
)

if TYPE_CHECKING:  # the client is imported when discovery starts (about 1 s), not with the router
    from kubernetes_asyncio import client

log = logging.getLogger("swaserve.router.discovery")
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
OnChange = Callable[[dict[str, DiscoveredWorker]], Awaitable[None]]


class DiscoveryError(RuntimeError):
    """No Kubernetes client configuration could be loaded."""


def default_namespace(path: Path = SA_NAMESPACE) -> str:
    """The pod's own namespace (its service account's file), else ``default``."""
    try:
        return path.read_text().strip() or "default"
    except OSError:
        return "default"


async def client_config(kubeconfig: str | None = None) -> client.Configuration:
    """The API server and credentials: in a pod (``KUBERNETES_SERVICE_HOST`` set and no
    ``kubeconfig``) its service account, else the kubeconfig file (``kubeconfig``, else
    ``$KUBECONFIG``, else ``~/.kube/config``).

    Raises:
        DiscoveryError: neither could be loaded (the reason in the message).
    """
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)
        else:
            path = kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
            if not any(Path(f).expanduser().is_file() for f in path.split(os.pathsep) if f):
                raise DiscoveryError(
                    f"no Kubernetes client configuration: not in a pod (KUBERNETES_SERVICE_HOST unset) "
                    f"and no kubeconfig file at {path}"
                )
            await config.load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
    except (config.ConfigException, OSError, ValueError) as e:
        raise DiscoveryError(f"no Kubernetes client configuration: {e}") from e
    return cfg


@dataclass(frozen=True)
class DiscoveryOptions:
    """``namespace`` (None: ``default_namespace()``), ``selector`` (a label selector),
    ``worker_port`` (a pod's gRPC port without the annotation), ``resync_s`` (seconds between full
    LISTs), ``kubeconfig`` (None: ``client_config``'s rule); backoff bounds, ``healthy_s`` (a
    stream up this long resets the backoff) and ``list_timeout_s`` (a LIST's deadline), seconds."""

    namespace: str | None = None
    selector: str = DEFAULT_SELECTOR
    worker_port: int = DEFAULT_PORT
    resync_s: float = 30.0
    kubeconfig: str | None = None
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    healthy_s: float = 10.0
    list_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.resync_s <= 0 or not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ValueError("resync_s must be > 0 and 0 < backoff_min_s <= backoff_max_s")
        if not 0 < self.worker_port < 65536:
            raise ValueError(f"worker port must be in 1..65535, got {self.worker_port}")


class KubeDiscovery:
    """Args:
    opts: what to watch and how often (``DiscoveryOptions``).
    on_change: awaited with address -> worker after each LIST and each change of that set;
        an error in it counts as a failed LIST (LIST again after the backoff).
    clock: monotonic seconds (stream health). sleep: awaited with each backoff delay (seconds).

    Counters for ``/metrics``: ``events`` (watch events by type), ``relists`` (LISTs by reason:
    start, resync, gone, error), ``workers`` (pods in use by role).
    """

    def __init__(
        self,
        opts: DiscoveryOptions,
        on_change: OnChange,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.opts, self.on_change, self.clock, self.sleep = opts, on_change, clock, sleep
        self.namespace = opts.namespace or default_namespace()
        self.pods = PodSet(opts.worker_port)
        self.events: collections.Counter[str] = collections.Counter()
        self.relists: collections.Counter[str] = collections.Counter()
        self.workers: dict[str, int] = count_roles(())
        self.synced = asyncio.Event()  # a LIST has been reconciled
        self._published: dict[str, DiscoveredWorker] | None = None
        self._ignored: dict[str, str] = {}
        self._api: client.ApiClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the client configuration and start the loop (in the background).

        Raises:
            DiscoveryError: no configuration (``client_config``).
        """
        from kubernetes_asyncio import client

        self._api = client.ApiClient(await client_config(self.opts.kubeconfig))
        self._task = asyncio.create_task(self.run(), name="kube-discovery")
        log.info(
            "discovering workers: pods in namespace %s with labels %s (resync every %.0f s)",
            self.namespace, self.opts.selector, self.opts.resync_s,
        )  # fmt: skip

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def run(self) -> None:
        """LIST, WATCH, LIST again (module docstring), until cancelled."""
        reason, delay = "start", self.opts.backoff_min_s
        while True:
            self.relists[reason] += 1
            try:
                await self._list()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("pod LIST failed (%s); again in %.1f s", _describe(e), delay)
                await self.sleep(delay)
                reason, delay = "error", min(2 * delay, self.opts.backoff_max_s)
                continue
            reason, healthy = await self._watch()
            if healthy:
                delay = self.opts.backoff_min_s
            if reason != "resync":
                await self.sleep(delay)
                delay = min(2 * delay, self.opts.backoff_max_s)

    @property
    def core(self) -> client.CoreV1Api:
        from kubernetes_asyncio import client

        if self._api is None:
            raise RuntimeError("KubeDiscovery.start() was not called")
        return client.CoreV1Api(self._api)

    async def _list(self) -> None:
        resp: Any = await self.core.list_namespaced_pod(  # the aiohttp response: JSON, no models
            self.namespace,
            label_selector=self.opts.selector,
            _preload_content=False,
            _request_timeout=self.opts.list_timeout_s,
        )
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            if resp.status != 200:
                raise ApiException(status=resp.status, reason=(await resp.text())[:300])
            body = await resp.json(content_type=None)
        finally:
            resp.release()
        self.pods.reset(body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion"))
        await self._publish(force=True)
        self.synced.set()

    async def _watch(self) -> tuple[str, bool]:
        """One WATCH from the last resourceVersion until the resync deadline (which bounds each
        read, never the handling of an event); returns the reason of the next LIST and whether
        the stream was healthy."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        resync = self.opts.resync_s
        began = self.clock()
        end_at = asyncio.get_running_loop().time() + resync
        w = watch.Watch(return_type="object")  # events as the API's JSON, no model classes

        def healthy() -> bool:
            return self.clock() - began >= min(self.opts.healthy_s, resync)

        try:
            stream = w.stream(
                self.core.list_namespaced_pod,
                self.namespace,
                label_selector=self.opts.selector,
                resource_version=self.pods.rv,
                allow_watch_bookmarks=True,
                timeout_seconds=int(resync) + 5,  # the server's end comes after ours
            )
            async with stream:
                while True:
                    deadline = asyncio.timeout_at(end_at)
                    try:
                        async with deadline:
                            event = await anext(stream)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        if deadline.expired():
                            return "resync", True
                        raise
                    await self._event(event)
            log.warning("pod watch stream ended after %.1f s; listing again", self.clock() - began)
            return "error", healthy()
        except asyncio.CancelledError:
            raise
        except ApiException as e:
            log.warning("pod watch: %s; listing again", _describe(e))
            return ("gone" if e.status == 410 else "error"), healthy()
        except Exception as e:
            log.warning("pod watch failed (%s); listing again", _describe(e))
            return "error", healthy()
        finally:
            await w.close()

    async def _event(self, event: Any) -> None:
        if not isinstance(event, Mapping) or not isinstance(event.get("raw_object"), Mapping):
            raise ValueError(f"malformed watch event: {str(event)[:200]}")
        kind = str(event.get("type"))
        if kind not in EVENT_TYPES:
            return
        self.events[kind] += 1
        self.pods.apply(kind, event["raw_object"])
        if kind != "BOOKMARK":
            await self._publish()

    async def _publish(self, force: bool = False) -> None:
        """Hand the workers in use to ``on_change`` (after a LIST always; else when they changed)."""
        desired = self.pods.desired()
        ignored = self.pods.ignored()
        for name, why in sorted(ignored.items()):
            if self._ignored.get(name) != why:
                (log.debug if why.startswith("label") else log.info)("pod %s not used: %s", name, why)
        self._ignored = ignored
        if not force and desired == self._published:
            return
        old = self._published or {}
        for addr, wk in sorted(desired.items()):
            if old.get(addr) != wk:
                log.info("%s worker %s (pod %s) discovered", wk.role, addr, wk.pod)
        for addr, wk in sorted(old.items()):
            if addr not in desired:
                log.info("%s worker %s (pod %s) no longer in use", wk.role, addr, wk.pod)
        self.workers = count_roles(desired.values())
        await self.on_change(desired)
        self._published = desired


def _describe(e: BaseException) -> str:
    from kubernetes_asyncio.client.exceptions import ApiException

    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason or ''}".strip()
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

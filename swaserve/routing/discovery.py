"""Kubernetes discovery of workers, pure half: pod objects (the API's JSON as dicts) -> the workers
to route to (``address -> role``), over a LIST (``PodSet.reset``) and the watch events after it
(``PodSet.apply``). No client, no I/O: ``services.router.discovery`` feeds it.

A pod is a worker of role R when its label ``swaserve.io/role`` is R (``prefill`` or ``decode``);
it is in use when it is Running, Ready, has a pod IP and no deletion timestamp. Its address is
``podIP:port``, the port from the annotation ``swaserve.io/grpc-port`` or the default.

Design notes: docs/DESIGN.md#routingdiscoverypy"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, NamedTuple

from swaserve.routing.registry import ROLES

ROLE_LABEL = "swaserve.io/role"
PORT_ANNOTATION = "swaserve.io/grpc-port"
DEFAULT_SELECTOR = "app.kubernetes.io/name=swaserve"
DEFAULT_PORT = 50051
EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")

Pod = Mapping[str, Any]  # a pod as the API's JSON has it (camelCase keys)


class DiscoveredWorker(NamedTuple):
    """A pod in use as a worker: ``address`` ``podIP:port``; ``role`` ``prefill``/``decode``;
    ``since`` its creation time (Unix seconds, 0.0 if unknown); ``pod`` its name."""

    address: str
    role: str
    since: float
    pod: str


def _timestamp(text: Any) -> float:
    """RFC 3339 (``2024-05-01T10:00:00Z``) -> Unix seconds; 0.0 when absent or malformed."""
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def check_pod(pod: Pod, default_port: int = DEFAULT_PORT) -> DiscoveredWorker | str:
    """The worker ``pod`` is, or why it is not in use (a reason for logs)."""
    meta: Mapping[str, Any] = pod.get("metadata") or {}
    status: Mapping[str, Any] = pod.get("status") or {}
    role = (meta.get("labels") or {}).get(ROLE_LABEL)
    if role not in ROLES:
        return f"label {ROLE_LABEL}={role!r} is not a worker role"
    if meta.get("deletionTimestamp"):
        return "terminating"
    if status.get("phase") != "Running":
        return f"phase {status.get('phase')}"
    if not _ready(status):
        return "not Ready"
    ip = status.get("podIP")
    if not ip:
        return "no pod IP"
    port_text = (meta.get("annotations") or {}).get(PORT_ANNOTATION)
    port = default_port
    if port_text is not None:
        if not str(port_text).isdigit() or not 0 < int(port_text) < 65536:
            return f"annotation {PORT_ANNOTATION}={port_text!r} is not a port"
        port = int(port_text)
    host = f"[{ip}]" if ":" in ip else ip
    return DiscoveredWorker(
        f"{host}:{port}", role, _timestamp(meta.get("creationTimestamp")), meta.get("name", "")
    )


def _name(pod: Pod) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("name", ""))


def _rv(pod: Pod) -> str | None:
    rv = (pod.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


class PodSet:
    """The pods of one namespace and selector as last listed and watched.

    Args:
        default_port: the gRPC port of a pod without the ``swaserve.io/grpc-port`` annotation.
    """

    def __init__(self, default_port: int = DEFAULT_PORT) -> None:
        self.default_port = default_port
        self.pods: dict[str, Pod] = {}  # name -> the latest object
        self.rv: str | None = None  # resourceVersion to watch from

    def reset(self, pods: Iterable[Pod], rv: str | None) -> None:
        """Replace everything with a LIST's items and its ``metadata.resourceVersion``: pods not
        in it are gone (the repair of missed events)."""
        self.pods = {_name(p): p for p in pods}
        self.rv = rv

    def apply(self, event_type: str, pod: Pod) -> None:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``, ``BOOKMARK``; others are
        ignored). Every event moves ``rv`` to the object's resourceVersion."""
        rv = _rv(pod)
        if rv is not None:
            self.rv = rv
        if event_type in ("ADDED", "MODIFIED"):
            self.pods[_name(pod)] = pod
        elif event_type == "DELETED":
            self.pods.pop(_name(pod), None)

    def desired(self) -> dict[str, DiscoveredWorker]:
        """address -> the worker to route to there. Two pods in use on one address (an IP
        reused before the old pod's deletion was seen): the newest one (then the greatest name)."""
        out: dict[str, DiscoveredWorker] = {}
        for pod in self.pods.values():
            w = check_pod(pod, self.default_port)
            if isinstance(w, DiscoveredWorker):
                old = out.get(w.address)
                if old is None or (w.since, w.pod) > (old.since, old.pod):
                    out[w.address] = w
        return out

    def ignored(self) -> dict[str, str]:
        """pod name -> why it is not in use (for logs)."""
        out = {}
        for name, pod in self.pods.items():
            w = check_pod(pod, self.default_port)
            if isinstance(w, str):
                out[name] = w
        return out


def count_roles(workers: Iterable[DiscoveredWorker]) -> dict[str, int]:
    """role -> workers of that role (every role present, 0 included)."""
    out = dict.fromkeys(ROLES, 0)
    for w in workers:
        out[w.role] += 1
    return out

"""A small fake Kubernetes API server (aiohttp, 127.0.0.1) for tests: the pods of one namespace,
read by the real client (``kubernetes_asyncio``/``kubernetes``) on the wire.

It serves ``GET /api/v1/namespaces/{ns}/pods``: a LIST (``labelSelector``: ``k=v``, ``k==v``,
``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``; the list's ``resourceVersion``) and a
WATCH (``watch=1``, ``resourceVersion``, ``allowWatchBookmarks``, ``timeoutSeconds``): JSON lines
from that version on, an object that starts or stops matching the selector as ADDED / DELETED (as
the API server does), BOOKMARKs every ``bookmark_s`` when asked, an ERROR 410 when the version is
older than the history kept (``compact``). No RBAC, paging or other kinds.

Use it in the test's event loop (``url = await fake.start()`` ... ``await fake.stop()``) or from
synchronous code (``url = fake.start_in_thread()`` ... ``fake.stop_thread()``); point a client at it
with ``fake.write_kubeconfig(path)``. Every hook (``add_pod``, ``set_ready``, ``set_labels``,
``terminate``, ``delete_pod``; faults: ``drop_watches``, ``compact``, ``expire_next_watches``,
``fail_next``) is a plain method, safe from any thread; ``notify=False`` changes a pod without
telling open watches (a missed event: only a LIST shows it)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from aiohttp import web

Selector = Callable[[Mapping[str, str]], bool]
_Event = tuple[int, str, dict[str, Any] | None, dict[str, Any]]  # version, type, object before, after


def parse_selector(text: str) -> Selector:
    """A label selector (the syntax in the module docstring). Raises ValueError if malformed."""
    reqs: list[Selector] = []
    for term in (t.strip() for t in re.split(r",(?![^()]*\))", text)):
        if not term:
            continue
        m = re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            key, inside, vals = m[1], m[2] == "in", {v.strip() for v in m[3].split(",")}
            reqs.append(lambda lb, k=key, i=inside, v=vals: (lb.get(k) in v) == i)  # type: ignore[misc]
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", term):
            key, eq, val = m[1], m[2] != "!=", m[3]
            reqs.append(lambda lb, k=key, e=eq, v=val: (lb.get(k) == v) == e)  # type: ignore[misc]
        elif m := re.fullmatch(r"(!?)([\w./-]+)", term):
            key, absent = m[2], m[1] == "!"
            reqs.append(lambda lb, k=key, a=absent: (k in lb) != a)  # type: ignore[misc]
        else:
            raise ValueError(f"unable to parse requirement: {term!r}")
    return lambda labels: all(r(labels) for r in reqs)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


def _line(kind: str, obj: Mapping[str, Any]) -> bytes:
    return (json.dumps({"type": kind, "object": obj}) + "\n").encode()


class ApiRequest(NamedTuple):
    """One pods request: ``verb`` ``list`` or ``watch``, its ``query``, when (``at``, monotonic s)."""

    verb: str
    query: dict[str, str]
    at: float


@dataclass(eq=False)
class _Watch:
    selector: Selector
    rv: int  # events after this one are still to send
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    end: str | None = None  # "close", "abort" (the connection cut), "gone" (an ERROR 410 first)


class FakeKube:
    """Args: namespace: the one namespace with pods (others list empty); bookmark_s: seconds
    between BOOKMARKs on watches that allow them.

    Attributes: url (``http://127.0.0.1:PORT`` once started); requests: every pods request
    (``ApiRequest``); pods: name -> the current object (read under ``lock``)."""

    def __init__(self, namespace: str = "default", bookmark_s: float = 1.0) -> None:
        self.namespace, self.bookmark_s = namespace, bookmark_s
        self.url = ""
        self.lock = threading.Lock()
        self.pods: dict[str, dict[str, Any]] = {}
        self.requests: list[ApiRequest] = []
        self._rv = 1
        self._oldest = 1  # a watch from an older version gets 410
        self._history: list[_Event] = []
        self._watches: set[_Watch] = set()
        self._fail: list[int] = []  # statuses of the next requests
        self._expire = 0  # watch requests still to answer 410
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in the running loop; returns the base URL."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods_handler)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self._loop = asyncio.get_running_loop()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve from a daemon thread with its own loop; returns the base URL."""
        loop = asyncio.new_event_loop()
        started: concurrent.futures.Future[str] = concurrent.futures.Future()

        def main() -> None:
            asyncio.set_event_loop(loop)
            try:
                started.set_result(loop.run_until_complete(self.start(host, port)))
            except Exception as e:
                started.set_exception(e)
                return
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=main, name="fake-kube", daemon=True)
        self._thread.start()
        return started.result(timeout=10)

    def stop_thread(self) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = None

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig (JSON, which is YAML) whose current context is this server and namespace."""
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": self.namespace}}],
        }  # fmt: skip
        path.write_text(json.dumps(cfg, indent=1))
        return path

    # -- pods -----------------------------------------------------------------------------------
    def add_pod(
        self, name: str, role: str | None = None, ip: str | None = "127.0.0.1", port: int | None = None,
        ready: bool = True, phase: str = "Running", labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None, notify: bool = True,
    ) -> dict[str, Any]:  # fmt: skip
        """Create a pod (``app.kubernetes.io/name=swaserve``; ``role`` -> ``swaserve.io/role``,
        ``port`` -> annotation ``swaserve.io/grpc-port``); returns it."""
        lbl = {
            "app.kubernetes.io/name": "swaserve",
            **({"swaserve.io/role": role} if role else {}),
            **(labels or {}),
        }
        ann = {**({"swaserve.io/grpc-port": str(port)} if port else {}), **(annotations or {})}
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "uid": str(uuid.uuid4()),
                         "creationTimestamp": _now(), "labels": lbl, "annotations": ann},
            "spec": {"containers": [{"name": "main", "image": "swaserve"}]},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": _now()}],
                       **({"podIP": ip, "podIPs": [{"ip": ip}]} if ip else {})},
        }  # fmt: skip
        return self._change(name, "ADDED", lambda _: pod, notify)

    def set_ready(self, name: str, ready: bool = True, notify: bool = True) -> dict[str, Any]:
        def edit(pod: dict[str, Any]) -> dict[str, Any]:
            pod["status"]["conditions"] = [
                {"type": "Ready", "status": str(ready), "lastTransitionTime": _now()}
            ]
            return pod

        return self._change(name, "MODIFIED", edit, notify)

    def set_labels(self, name: str, labels: Mapping[str, str | None], notify: bool = True) -> dict[str, Any]:
        """Set labels (a None value removes the label)."""

        def edit(pod: dict[str, Any]) -> dict[str, Any]:
            lbl = pod["metadata"]["labels"]
            for k, v in labels.items():
                lbl.pop(k, None) if v is None else lbl.__setitem__(k, v)
            return pod

        return self._change(name, "MODIFIED", edit, notify)

    def terminate(self, name: str, notify: bool = True) -> dict[str, Any]:
        """Set ``metadata.deletionTimestamp`` (graceful deletion started: the pod still exists)."""

        def edit(pod: dict[str, Any]) -> dict[str, Any]:
            pod["metadata"]["deletionTimestamp"] = _now()
            return pod

        return self._change(name, "MODIFIED", edit, notify)

    def delete_pod(self, name: str, notify: bool = True) -> dict[str, Any]:
        return self._change(name, "DELETED", lambda pod: pod, notify)

    def _change(
        self, name: str, kind: str, edit: Callable[[Any], dict[str, Any]], notify: bool
    ) -> dict[str, Any]:
        with self.lock:
            before = self.pods.get(name)
            if (before is None) != (kind == "ADDED"):
                raise KeyError(f"pod {name} {'exists' if before is not None else 'does not exist'}")
            after = edit(copy.deepcopy(before))
            self._rv += 1
            after["metadata"]["resourceVersion"] = str(self._rv)
            if kind == "DELETED":
                del self.pods[name]
            else:
                self.pods[name] = after
            if notify:
                self._history.append((self._rv, kind, before, after))
        self._wake()
        return copy.deepcopy(after)

    # -- faults ---------------------------------------------------------------------------------
    def drop_watches(self, how: str = "close") -> None:
        """End every open watch: ``close`` (the stream ends), ``abort`` (the connection is cut),
        ``gone`` (an ERROR 410 event, then the end)."""

        def end() -> None:
            for w in self._watches:
                w.end = how
                w.wake.set()

        self._on_loop(end)

    def compact(self) -> None:
        """Forget the history: a watch from a version before now gets an ERROR 410."""
        with self.lock:
            self._oldest, self._history = self._rv, []

    def expire_next_watches(self, n: int = 1) -> None:
        """The next ``n`` watch requests get an ERROR 410 whatever their version."""
        with self.lock:
            self._expire += n

    def fail_next(self, n: int = 1, status: int = 500) -> None:
        """The next ``n`` pod requests (list or watch) answer ``status`` with a Status body (0:
        none; replaces what was left of an earlier call)."""
        with self.lock:
            self._fail = [status] * n

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def _wake(self) -> None:
        def wake() -> None:
            for w in self._watches:
                w.wake.set()

        self._on_loop(wake)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the server's loop: now if called there, else soon (open watches live
        there)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn()
        else:
            loop.call_soon_threadsafe(fn)

    # -- the API --------------------------------------------------------------------------------
    async def _pods_handler(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        watching = q.get("watch", "").lower() in ("1", "true")
        self.requests.append(ApiRequest("watch" if watching else "list", dict(q), time.monotonic()))
        with self.lock:
            fail = self._fail.pop(0) if self._fail else None
        if fail is not None:
            return web.json_response(_status(fail, "InternalError", "injected failure"), status=fail)
        try:
            selector = parse_selector(q.get("labelSelector", ""))
        except ValueError as e:
            return web.json_response(_status(400, "BadRequest", str(e)), status=400)
        ours = request.match_info["ns"] == self.namespace
        if not watching:
            with self.lock:
                items = [p for p in self.pods.values() if ours and selector(p["metadata"]["labels"])]
                body = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)}}
            return web.json_response({**body, "items": items})
        return await self._watch(request, selector if ours else (lambda _: False))

    async def _watch(self, request: web.Request, selector: Selector) -> web.StreamResponse:
        q = request.query
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks", "").lower() in ("1", "true")
        since = q.get("resourceVersion") or "0"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        with self.lock:
            gone = self._expire > 0 or (since != "0" and int(since) < self._oldest)
            self._expire = max(0, self._expire - 1)
            first = (
                [] if since != "0" else [p for p in self.pods.values() if selector(p["metadata"]["labels"])]
            )
            w = _Watch(selector, int(since) if since != "0" else self._rv)
        if gone:
            await resp.write(_line("ERROR", _status(410, "Expired", f"too old resource version: {since}")))
            await resp.write_eof()
            return resp
        self._watches.add(w)
        try:
            for pod in first:  # no version asked: the current pods first, as ADDED
                await resp.write(_line("ADDED", pod))
            next_bookmark = loop.time() + self.bookmark_s
            while w.end is None and loop.time() < deadline:
                w.wake.clear()
                with self.lock:
                    todo = [h for h in self._history if h[0] > w.rv]
                    now_rv = self._rv
                for rv, kind, before, after in todo:
                    line = self._render(w.selector, kind, before, after)
                    if line:
                        await resp.write(line)
                    w.rv = rv
                if bookmarks and loop.time() >= next_bookmark:
                    meta = {"resourceVersion": str(max(now_rv, w.rv))}
                    await resp.write(_line("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": meta}))
                    next_bookmark = loop.time() + self.bookmark_s
                wait = min(deadline, next_bookmark if bookmarks else deadline) - loop.time()
                if w.end is None and wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(w.wake.wait(), wait)
            if w.end == "abort":
                if request.transport is not None:
                    request.transport.close()
                return resp
            if w.end == "gone":
                await resp.write(_line("ERROR", _status(410, "Expired", "too old resource version")))
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.discard(w)
        return resp

    @staticmethod
    def _render(
        sel: Selector, kind: str, before: dict[str, Any] | None, after: dict[str, Any]
    ) -> bytes | None:
        """One history event as a watcher with selector ``sel`` sees it (None: not at all)."""
        was = before is not None and sel(before["metadata"]["labels"])
        now = kind != "DELETED" and sel(after["metadata"]["labels"])
        if now:
            return _line("MODIFIED" if was else "ADDED", after)
        return _line("DELETED", after) if was else None

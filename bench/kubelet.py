"""A kubelet emulator: runs the Helm chart's rendered workloads as local processes on 127.0.0.1.

It stands in for the parts of Kubernetes a swaserve release depends on, so the chart's real
commands, args, env, probes, preStop hooks and grace periods are exercised without a cluster:

- each pod gets its own loopback address (``127.0.1.N``, its "pod IP"); the container runs its
  rendered ``command``/``args`` (``python`` -> this interpreter, ``redis-server`` -> the bundled
  binary), ``$(VAR)`` expanded from its env (``fieldRef status.podIP``, ``secretKeyRef`` from the
  rendered Secrets or ``secrets``, values with Service names resolved to a pod of the Service), a
  bind address ``0.0.0.0`` narrowed to the pod's address, volume paths mapped (``hostPath`` to that
  path, ``emptyDir``, ``secret`` and ``configMap`` volumes to a per-pod directory holding the
  rendered Secret's or ConfigMap's keys as files, a StatefulSet's
  ``volumeClaimTemplates`` to a directory per claim that outlives the pod, as a PVC does);
- StatefulSet pods are named by ordinal (``NAME-0``, ``NAME-1``; a replacement takes the lowest
  free one, so it finds its predecessor's claims); workloads start in dependency order: StatefulSets
  first, each Ready before the next, one whose env or args name another's Service after it;
- pods are published to a Kubernetes API (``bench.fake_kube.FakeKube``) with the template's labels
  and annotations; the rendered probes run (gRPC health, HTTP GET, TCP) and set the pod's Ready
  condition; a failing liveness probe or a crash restarts the container;
- scale-down follows the kubelet: ``deletionTimestamp`` (MODIFIED), the preStop hook, SIGTERM, then
  SIGKILL at ``terminationGracePeriodSeconds``, then DELETED.

Not emulated: scheduling, resources, NetworkPolicies, Service load balancing (a Service name
resolves to one ready pod, fixed when the dependent container starts), Deployment rollouts and
network namespaces: pods share this machine's ports on ``0.0.0.0`` (a listener that ignores its
bind address, such as ucxx's, can run in one pod only).
Probe periods can be capped (``period_cap_s``) to compress time in tests."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("swaserve.kubelet")
WORKLOADS = ("Deployment", "StatefulSet")


class KubeApi(Protocol):
    """The pod writes the emulator makes (``bench.fake_kube.FakeKube``)."""

    def add_pod(
        self, name: str, role: str | None = None, ip: str | None = ..., port: int | None = None,
        ready: bool = True, phase: str = "Running", labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None, notify: bool = True,
    ) -> dict[str, Any]: ...  # fmt: skip

    def set_ready(self, name: str, ready: bool = True, notify: bool = True) -> dict[str, Any]: ...

    def terminate(self, name: str, notify: bool = True) -> dict[str, Any]: ...

    def delete_pod(self, name: str, notify: bool = True) -> dict[str, Any]: ...


class KubeletError(RuntimeError):
    """A pod did not start, become ready or stop as asked."""


@dataclasses.dataclass(eq=False)
class Pod:
    """One emulated pod (one container: swaserve's pods have one)."""

    name: str
    ip: str
    workload: str
    template: dict[str, Any]
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    started: bool = False  # the startup probe passed
    ready: bool = False
    ready_at: float | None = None  # time.monotonic() of the last not-Ready -> Ready change
    terminating: bool = False
    gone: threading.Event = dataclasses.field(default_factory=threading.Event)
    exit_code: int | None = None  # of the container's last process
    killed: bool = False  # SIGKILLed at the end of the grace period
    restarts: int = 0
    terminated_in_s: float | None = None  # deletionTimestamp -> process gone

    @property
    def container(self) -> dict[str, Any]:
        containers: list[dict[str, Any]] = self.template["spec"]["containers"]
        return containers[0]

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.template["metadata"].get("labels", {})
        return labels

    def log_text(self) -> str:
        path = self.dir / "container.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _redis_binary() -> str:
    from swaserve.redis_server import redis_binary

    return redis_binary()


class Kubelet:
    """Args:
    docs: the rendered objects (``tests.helpers.chart.render``).
    kube: the API the pods are published to. kubeconfig: given to pods that mount an API token
    (the discovering router) as ``KUBECONFIG``. workdir: per-pod directories and logs.
    secrets: ``{secret: {key: value}}`` for Secrets the chart references but does not create.
    env: extra environment of every container (e.g. ``SWASERVE_CACHE``).
    period_cap_s: probe periods longer than this are shortened to it (time compression).
    """

    def __init__(
        self,
        docs: list[dict[str, Any]],
        kube: KubeApi,
        kubeconfig: Path,
        workdir: Path,
        secrets: Mapping[str, Mapping[str, str]] | None = None,
        env: Mapping[str, str] | None = None,
        period_cap_s: float = 0.5,
    ) -> None:
        self.kube, self.kubeconfig, self.workdir = kube, kubeconfig, workdir
        self.period_cap_s = period_cap_s
        self.workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        self.secrets: dict[str, dict[str, str]] = {k: dict(v) for k, v in (secrets or {}).items()}
        for d in docs:
            if d["kind"] == "Secret":
                data = {k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()}
                self.secrets[d["metadata"]["name"]] = {**data, **(d.get("stringData") or {})}
        self.config_maps = {
            d["metadata"]["name"]: dict(d.get("data") or {}) for d in docs if d["kind"] == "ConfigMap"
        }
        self.env = dict(env or {})
        self.pods: dict[str, Pod] = {}
        self._lock = threading.Lock()
        self._next_ip = 2
        self._counter: dict[str, int] = {}
        self._closing = False

    # -- the controllers' half ----------------------------------------------------------------
    def replicas(self, workload: str) -> list[Pod]:
        """The workload's pods not terminating, oldest first."""
        return [p for p in self.pods.values() if p.workload == workload and not p.terminating]

    def scale(self, workload: str, replicas: int, victims: list[str] | None = None) -> list[Pod]:
        """Create or terminate pods until ``workload`` has ``replicas`` (``victims``: which to
        terminate, else the newest). Returns the pods created. Termination runs in the background
        (``wait_gone``)."""
        if workload not in self.workloads:
            raise KubeletError(f"no workload {workload!r}: {sorted(self.workloads)}")
        live = self.replicas(workload)
        created = [self._create(workload) for _ in range(max(0, replicas - len(live)))]
        excess = len(live) - replicas
        if excess > 0:
            chosen = [self.pods[v] for v in victims or []] or list(reversed(live))
            for p in chosen[:excess]:
                self.terminate(p.name)
        return created

    def _depends(self, workload: str) -> bool:
        """Whether the workload's containers name (in env values or args) another workload's
        Service: it starts after the StatefulSets (Redis before the GCache nodes that register in it)."""
        spec = self.workloads[workload]["spec"]["template"]["spec"]
        text = " ".join(
            [str(e.get("value", "")) for c in spec["containers"] for e in c.get("env", [])]
            + [str(a) for c in spec["containers"] for a in c.get("args", [])]
        )
        mine = self.workloads[workload]["spec"]["template"]["metadata"].get("labels", {})
        for svc, obj in self.services.items():
            sel = obj["spec"].get("selector") or {}
            if all(mine.get(k) == v for k, v in sel.items()):
                continue  # its own Service
            if re.search(rf"(?<=[/@]){re.escape(svc)}(?=[.:/]|$)", text):
                return True
        return False

    def start_all(self) -> None:
        """Every workload at its rendered replica count: StatefulSets first, each ready before the
        next (those naming no other Service first: Redis, then the GCache nodes), then the workers,
        then the router, as their dependencies need."""
        order = sorted(
            self.workloads,
            key=lambda n: (self.workloads[n]["kind"] != "StatefulSet", self._depends(n), "router" in n),
        )
        for name in order:
            spec = self.workloads[name]["spec"]
            pods = self.scale(name, int(spec.get("replicas", 1)))
            if self.workloads[name]["kind"] == "StatefulSet":
                self.wait_ready([p.name for p in pods])

    # -- pods -----------------------------------------------------------------------------------
    def _create(self, workload: str) -> Pod:
        w = self.workloads[workload]
        with self._lock:
            ip = f"127.0.1.{self._next_ip}"
            self._next_ip += 1
            if w["kind"] == "StatefulSet":  # the lowest ordinal no pod holds (a gone pod's is free)
                held = {p.name for p in self.pods.values() if p.workload == workload and not p.gone.is_set()}
                name = next(f"{workload}-{i}" for i in range(len(held) + 1) if f"{workload}-{i}" not in held)
            else:
                n = self._counter.get(workload, 0)
                self._counter[workload] = n + 1
                name = f"{workload}-{n:05d}"
        pod = Pod(name, ip, workload, w["spec"]["template"], self.workdir / name)
        pod.dir.mkdir(parents=True, exist_ok=True)
        self.pods[name] = pod
        meta = pod.template["metadata"]
        self.kube.add_pod(
            name, ip=ip, ready=False, labels=meta.get("labels", {}), annotations=meta.get("annotations", {})
        )
        self._run(pod)
        threading.Thread(target=self._probe_loop, args=(pod,), name=f"probe-{name}", daemon=True).start()
        return pod

    def _env(self, pod: Pod) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "SWASERVE_CACHE", "TMPDIR")
        }
        env["PATH"] = f"{self._image_bin()}{os.pathsep}{env.get('PATH', os.defpath)}"
        env.update(self.env)
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        if pod.template["spec"].get("automountServiceAccountToken"):
            env["KUBECONFIG"] = str(self.kubeconfig)
        for e in pod.container.get("env", []):
            if "value" in e:
                env[e["name"]] = self._resolve(self._expand(str(e["value"]), env))
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                env[e["name"]] = {"status.podIP": pod.ip, "metadata.name": pod.name}[path]
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                env[e["name"]] = self._resolve(self.secrets[ref["name"]][ref["key"]])
        return env

    def _image_bin(self) -> Path:
        """A directory on the containers' PATH whose ``redis-server`` is this machine's, for
        containers that start it from a shell script (``python`` is mapped in ``_argv``)."""
        path = self.workdir / "image-bin"
        path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            (path / "redis-server").symlink_to(_redis_binary())
        return path

    @staticmethod
    def _expand(text: str, env: Mapping[str, str]) -> str:
        """Kubernetes' ``$(VAR)`` expansion (an unknown variable stays as written)."""
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)

    def _resolve(self, text: str) -> str:
        """Service names (``name``, ``name.ns.svc...``) in a host position -> a ready pod's IP."""
        for svc, obj in self.services.items():
            if svc not in text:
                continue
            sel = obj["spec"]["selector"]
            ips = [
                p.ip
                for p in self.pods.values()
                if p.ready and all(p.labels.get(k) == v for k, v in sel.items())
            ]
            if ips:
                text = re.sub(rf"(?<=[/@]){re.escape(svc)}(\.[a-z0-9.-]+)?(?=[:/]|$)", ips[0], text)
        return text

    def _paths(self, pod: Pod) -> dict[str, str]:
        """A container's mount path -> the directory standing in for it here."""
        volumes = {v["name"]: v for v in pod.template["spec"].get("volumes", [])}
        templates = self.workloads[pod.workload]["spec"].get("volumeClaimTemplates", [])
        claims = {c["metadata"]["name"] for c in templates}
        out: dict[str, str] = {}
        for m in pod.container.get("volumeMounts", []):
            if m["name"] not in volumes and m["name"] in claims:  # PVC <claim>-<pod>: kept after the pod
                d = self.workdir / "claims" / f"{m['name']}-{pod.name}"
                d.mkdir(parents=True, exist_ok=True)
                out[m["mountPath"]] = str(d)
                continue
            v = volumes[m["name"]]
            if "hostPath" in v:
                out[m["mountPath"]] = v["hostPath"]["path"]
            elif "secret" in v or "configMap" in v:
                d = pod.dir / "volumes" / m["name"]
                d.mkdir(parents=True, exist_ok=True)
                if "secret" in v:
                    data = self.secrets.get(v["secret"]["secretName"], {})
                else:
                    data = self.config_maps[v["configMap"]["name"]]
                for k, val in data.items():
                    (d / k).write_text(val)
                out[m["mountPath"]] = str(d)
            elif "emptyDir" in v and m["mountPath"] != "/dev/shm":
                d = pod.dir / "volumes" / m["name"]
                d.mkdir(parents=True, exist_ok=True)
                out[m["mountPath"]] = str(d)
        return out

    def _argv(self, pod: Pod, env: Mapping[str, str]) -> list[str]:
        c = pod.container
        argv = [self._expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
        paths = sorted(self._paths(pod).items(), key=lambda kv: -len(kv[0]))
        out = []
        for a in argv:  # the container's paths -> the directories standing in for its volumes
            a = pod.ip if a == "0.0.0.0" else self._resolve(a)
            for mount, local in paths:
                if a == mount or a.startswith(mount + "/"):
                    a = local + a[len(mount) :]
                    break
            out.append(a)
        exe = {"python": sys.executable, "redis-server": _redis_binary()}  # then this machine's binaries
        out[0] = exe.get(argv[0], out[0])
        return out

    def _run(self, pod: Pod) -> None:
        env = self._env(pod)
        argv = self._argv(pod, env)
        (pod.dir / "argv").write_text("\n".join(argv))
        (pod.dir / "env.json").write_text(json.dumps(env, indent=1, sort_keys=True))  # as expanded
        with open(pod.dir / "container.log", "ab") as out:
            pod.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=pod.dir, start_new_session=True
            )
        pod.started = False
        log.info("pod %s (%s) started: %s", pod.name, pod.ip, " ".join(argv[:3]))

    # -- probes ---------------------------------------------------------------------------------
    def _port(self, pod: Pod, port: int | str) -> int:
        if isinstance(port, int):
            return port
        return int(next(p["containerPort"] for p in pod.container["ports"] if p.get("name") == port))

    def probe(self, pod: Pod, probe: Mapping[str, Any]) -> bool:
        """Run one probe (gRPC health, HTTP GET, TCP connect) against the pod; True = success."""
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "grpc" in probe:
                import grpc
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                addr = f"{pod.ip}:{self._port(pod, probe['grpc']['port'])}"
                with grpc.insecure_channel(addr) as ch:
                    req = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
                    status = health_pb2_grpc.HealthStub(ch).Check(req, timeout=timeout).status
                    return bool(status == health_pb2.HealthCheckResponse.SERVING)
            if "httpGet" in probe:
                import httpx

                h = probe["httpGet"]
                url = f"{h.get('scheme', 'HTTP').lower()}://{pod.ip}:{self._port(pod, h['port'])}{h.get('path', '/')}"
                return 200 <= httpx.get(url, timeout=timeout, verify=False).status_code < 400
            if "tcpSocket" in probe:
                with socket.create_connection((pod.ip, self._port(pod, probe["tcpSocket"]["port"])), timeout):
                    return True
        except Exception:
            return False
        raise KubeletError(f"probe kind not emulated: {sorted(probe)}")

    def _period(self, probe: Mapping[str, Any]) -> float:
        return min(float(probe.get("periodSeconds", 10)), self.period_cap_s)

    def _set_ready(self, pod: Pod, ready: bool) -> None:
        if ready != pod.ready and not pod.gone.is_set():
            pod.ready = ready
            if ready:
                pod.ready_at = time.monotonic()
            with contextlib.suppress(KeyError):
                self.kube.set_ready(pod.name, ready)
            log.info("pod %s %s", pod.name, "ready" if ready else "not ready")

    def _probe_loop(self, pod: Pod) -> None:
        c = pod.container
        startup, readiness, liveness = (c.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe"))
        fails = 0
        while not pod.gone.is_set() and not self._closing:
            proc = pod.proc
            if proc is not None and proc.poll() is not None:  # the container exited
                pod.exit_code = proc.returncode
                self._set_ready(pod, False)
                if pod.terminating:
                    return
                log.warning("pod %s container exited %s: restarting", pod.name, proc.returncode)
                pod.restarts += 1
                time.sleep(1.0)
                self._run(pod)
                continue
            if not pod.started:
                probe = startup or readiness
                if probe is None or self.probe(pod, probe):
                    pod.started = True
                    continue
                time.sleep(self._period(probe))
                continue
            if readiness is not None:
                self._set_ready(pod, self.probe(pod, readiness))
            elif not pod.terminating:
                self._set_ready(pod, True)
            if liveness is not None and not pod.terminating:
                fails = 0 if self.probe(pod, liveness) else fails + 1
                if fails >= int(liveness.get("failureThreshold", 3)):
                    log.warning("pod %s failed its liveness probe: restarting", pod.name)
                    self._kill(pod, signal.SIGKILL)
                    fails = 0
            time.sleep(self._period(readiness or liveness or {"periodSeconds": 1}))

    def wait_ready(self, names: list[str], timeout_s: float = 300.0) -> None:
        """Wait until every named pod is Ready.

        Raises:
            KubeletError: one is not ready in time (its log tail in the message)."""
        deadline = time.monotonic() + timeout_s
        for n in names:
            pod = self.pods[n]
            while not pod.ready:
                if time.monotonic() > deadline:
                    raise KubeletError(
                        f"pod {n} not ready after {timeout_s:.0f} s:\n{pod.log_text()[-3000:]}"
                    )
                time.sleep(0.1)

    # -- termination ----------------------------------------------------------------------------
    def _kill(self, pod: Pod, sig: int) -> None:
        if pod.proc is not None and pod.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, sig)

    def terminate(self, name: str) -> threading.Thread:
        """Delete a pod as the kubelet does (module docstring), in a thread; ``wait_gone`` joins."""
        pod = self.pods[name]
        pod.terminating = True
        thread = threading.Thread(target=self._terminate, args=(pod,), name=f"terminate-{name}", daemon=True)
        thread.start()
        return thread

    def _terminate(self, pod: Pod) -> None:
        t0 = time.monotonic()
        self.kube.terminate(pod.name)
        grace = float(pod.template["spec"].get("terminationGracePeriodSeconds", 30))
        hook = pod.container.get("lifecycle", {}).get("preStop", {})
        if "exec" in hook:
            cmd = hook["exec"]["command"]
            if cmd[0] == "sleep":
                time.sleep(min(float(cmd[1]), grace))
            else:
                subprocess.run(cmd, timeout=grace, check=False, env=self._env(pod))
        elif "sleep" in hook:
            time.sleep(min(float(hook["sleep"]["seconds"]), grace))
        self._kill(pod, signal.SIGTERM)
        proc = pod.proc
        if proc is not None:
            try:
                proc.wait(timeout=max(0.0, grace - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pod.killed = True
                self._kill(pod, signal.SIGKILL)
                proc.wait()
            pod.exit_code = proc.returncode
        pod.terminated_in_s = time.monotonic() - t0
        pod.gone.set()
        pod.ready = False
        with contextlib.suppress(KeyError):
            self.kube.delete_pod(pod.name)
        log.info("pod %s gone after %.1f s (exit %s%s)", pod.name, pod.terminated_in_s, pod.exit_code,
                 ", killed" if pod.killed else "")  # fmt: skip

    def wait_gone(self, name: str, timeout_s: float = 300.0) -> Pod:
        pod = self.pods[name]
        if not pod.gone.wait(timeout_s):
            raise KubeletError(f"pod {name} still terminating after {timeout_s:.0f} s")
        return pod

    def close(self) -> None:
        """Kill every container (no grace), keep the logs."""
        self._closing = True
        for pod in self.pods.values():
            pod.terminating = True
            self._kill(pod, signal.SIGKILL)
        for pod in self.pods.values():
            if pod.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pod.proc.wait(timeout=10)
            pod.gone.set()

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

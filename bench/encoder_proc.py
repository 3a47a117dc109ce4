"""The encoder child of ``swaserve bench encoder`` (pinned to a CPU, its per-item warnings
counted) and what the bench reads of it: its /metrics counters, its and this process's CPU seconds."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOT_CACHED_LOG = "is larger than the whole cache: not cached"  # the baseline's per-item warning


def _process_class() -> Any:
    from swaserve.procs import ServiceProcess

    class EncoderProcess(ServiceProcess):
        """The encoder child; its per-item "not cached" warnings (the baseline's 1-byte cache) are
        counted, not printed."""

        dropped = 0

        def _pump(self) -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                if NOT_CACHED_LOG in line:
                    self.dropped += 1
                    continue
                self.tail.append(line)
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    return EncoderProcess


def cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used (None: 0), from /proc; None where
    there is no /proc."""
    try:
        path = f"/proc/{pid}/stat" if pid is not None else "/proc/self/stat"
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def encoder_process(
    name: str, model_dir: Path, flags: Sequence[str], cpu: int | None
) -> Iterator[tuple[str, str, int]]:
    """An encoder child (on CPU ``cpu`` when given) with ``flags``; yields (gRPC address, metrics
    URL, pid: ``setpriv`` and ``taskset`` exec it, so it is the encoder's own)."""
    from bench.ucx_perftest import pinned
    from swaserve.procs import free_port, grpc_ready

    port, mport = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    cmd = [*pinned(cpu), sys.executable, "-m", "services.encoder", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(mport)]
    cmd += ["--num-threads", "1", "--grace-s", "2", *flags]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = _process_class()(f"encoder-{name}", cmd, grpc_ready(addr), env={"PYTHONPATH": path})
    proc.start()
    try:
        proc.wait_ready(120)
        assert proc.proc is not None
        yield addr, f"http://127.0.0.1:{mport}/metrics", proc.proc.pid
    finally:
        proc.stop(grace_s=5.0)


def scrape(url: str) -> dict[str, float]:
    """The encoder's counters this bench reads, from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            lab = s.labels
            if s.name == "swaserve:encoder_items_total" and lab.get("modality") == "image":
                out[f"items_{lab['outcome']}"] = s.value
            elif s.name == "swaserve:encoder_fetches_total":
                out[f"fetches_{lab['outcome']}"] = s.value
            elif s.name in ("swaserve:encoder_batch_items_count", "swaserve:encoder_batch_items_sum"):
                out["forwards" if s.name.endswith("count") else "forward_items"] = s.value
            elif s.name == "swaserve:encoder_cache_hits_total" and lab.get("tier") == "memory":
                out["cache_hits"] = s.value
    return out


def counter_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, Any]:
    d: dict[str, Any] = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    d["mean_batch_items"] = round(d["forward_items"] / d["forwards"], 3) if d.get("forwards") else None
    return d


class CpuClock:
    """CPU seconds of the encoder process and of this one (the client) between ``lap`` calls."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last = (cpu_seconds(pid), time.process_time())

    def lap(self, wall_s: float) -> dict[str, float | None]:
        now = (cpu_seconds(self.pid), time.process_time())
        enc = None if now[0] is None or self.last[0] is None else round(now[0] - self.last[0], 2)
        client = round(now[1] - self.last[1], 2)
        self.last = now
        return {
            "encoder_cpu_s": enc, "client_cpu_s": client,
            "encoder_cpu_share": round(enc / wall_s, 3) if enc is not None and wall_s > 0 else None,
            "client_cpu_share": round(client / wall_s, 3) if wall_s > 0 else None,
        }  # fmt: skip

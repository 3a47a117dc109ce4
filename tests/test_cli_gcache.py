"""``swaserve up --gcache N``: the flags, what prefill workers are given, Redis required, and the
whole command as a process (a node started, registered and serving the cluster's prefill workers;
its temporary NVMe directory gone at exit)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from swaserve.cli import app
from swaserve.launcher import L3_HOST_CACHE, Cluster, l3_url
from swaserve.model.identity import weights_digest
from swaserve.procs import ClusterError

ROOT = Path(__file__).resolve().parents[1]


def test_up_help_documents_gcache() -> None:
    res = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0
    for flag in ("--gcache ", "--gcache-dram", "--gcache-nvme ", "--gcache-nvme-dir", "--gcache-arg"):
        assert flag in res.output, flag


def test_prefill_workers_get_the_l3_url_weights_id_and_a_host_tier(tiny_dir: Path) -> None:
    assert l3_url("redis://h:1/0", "ns") == "redis://h:1/0?namespace=ns"
    assert l3_url("redis://h:1/0?x=1", "ns") == "redis://h:1/0?x=1&namespace=ns"
    c = Cluster(tiny_dir, gcache=1, redis_url="redis://127.0.0.1:9/0")
    c.namespace = "ns"
    args = c._l3_args()
    assert args == ["--l3-url", "redis://127.0.0.1:9/0?namespace=ns", "--weights-id", weights_digest(tiny_dir),
                    "--host-cache-memory", L3_HOST_CACHE]  # fmt: skip
    # what the operator gave stays theirs
    c = Cluster(tiny_dir, gcache=1, redis_url="redis://127.0.0.1:9/0", worker_args=["--host-cache-memory=1MiB"],
                prefill_args=["--weights-id", "rev-7", "--l3-url", "gcache://127.0.0.1:5"])  # fmt: skip
    c.namespace = "ns"
    assert c._l3_args() == []


def test_gcache_needs_redis_and_starts_nothing_without_it(tiny_dir: Path) -> None:
    c = Cluster(tiny_dir, gcache=1, redis=False)
    with pytest.raises(ClusterError, match="need Redis"):
        c.start(timeout_s=5)
    assert c.services == {}
    c.stop()


@pytest.mark.slow
@pytest.mark.cluster  # swaserve up as a subprocess
def test_up_with_a_gcache_node(tiny_dir: Path) -> None:
    cmd = [sys.executable, "-m", "swaserve.cli", "up", "--model", str(tiny_dir), "--port", "0",
           "--gcache", "1", "--gcache-dram", "16MiB", "--gcache-nvme", "16MiB", "--index-mode", "precise",
           "--worker-arg=--page-size=4", "--worker-arg=--kv-cache-memory=16MiB",
           "--prefill-arg=--host-cache-memory=4MiB", "--prefill-arg=--l3-min-tokens=8"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if "cluster ready:" in line or time.monotonic() > deadline:
                break
        out = "".join(lines)
        ready = re.search(r"cluster ready: (\S+) .*GCache: 127\.0\.0\.1:\d+", out)
        assert ready, out
        nvme = re.search(r"\[gcache-0\] gcache node gcache-0 listening .* at (\S+), O_DIRECT", out)
        assert nvme and Path(nvme.group(1)).is_dir(), out
        body = {"model": "mimo-v2-tiny-v2", "prompt": list(range(3, 40)), "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{ready.group(1)}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + rest
    assert not Path(nvme.group(1)).exists()  # the run's temporary directory is removed

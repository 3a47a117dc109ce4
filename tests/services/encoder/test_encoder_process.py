"""``python -m services.encoder`` as a process: health SERVING, an image submitted and fetched
equal to a direct encode, its metrics on ``--metrics-port``, SIGTERM exits 0 (bad flags: test_encoder_cli.py)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from services.encoder.cli import model_fingerprint, shm_lock_dir
from services.encoder.client import EncoderClient
from swaserve.encoder.runner import MediaEncoder
from swaserve.encoder.shm_cache import ShmEmbeddingCache
from swaserve.procs import ServiceProcess, free_port, grpc_ready
from tests.services.encoder.helpers import image

pytestmark = pytest.mark.cluster  # starts the encoder as a child process


def test_encoder_process_serves_scrapes_and_drains(tiny_dir: Path) -> None:
    port, mport = free_port(), free_port()
    name = f"swaserve-test-encp-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "services.encoder", "--model", str(tiny_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--metrics-port", str(mport), "--num-threads", "1", "--max-wait-ms", "2"]
    cmd += ["--shm-cache", name, "--shm-cache-bytes", "8MiB", "--cache-bytes", "64MiB", "--grace-s", "5"]
    proc = ServiceProcess("encoder", cmd, grpc_ready(f"127.0.0.1:{port}"))
    enc = MediaEncoder(tiny_dir)
    it = image(enc, 70)
    segment = f"{name}-{enc.weights_digest[:12]}"  # the tier is keyed by the towers' weights too
    proc.start()
    try:
        proc.wait_ready(60)
        ready = f"encoder ready on 127.0.0.1:{port}"
        deadline = time.monotonic() + 10  # the output reader thread may lag the health check
        while not any(line.startswith(ready) for line in proc.tail) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(line.startswith(ready) for line in proc.tail)

        async def go() -> torch.Tensor:
            client = EncoderClient(f"127.0.0.1:{port}")
            try:
                assert await client.submit([it], model_fingerprint(tiny_dir)) == [True]
                return await client.fetch(it.key, timeout_s=30)
            finally:
                await client.close()

        assert torch.equal(asyncio.run(go()), enc.encode([it])[0])
        with ShmEmbeddingCache.attach(segment, shm_lock_dir()) as shm_view:
            deadline = time.monotonic() + 10  # the shared put follows the answer
            while it.key not in shm_view and time.monotonic() < deadline:
                time.sleep(0.01)
            assert it.key in shm_view  # the encoder shared what it encoded
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
        assert 'swaserve:encoder_items_total{modality="image",outcome="encoded"} 1.0' in text
        assert "swaserve:encoder_batch_items_count 1.0" in text
        assert "swaserve:encoder_queue_items 0.0" in text
        proc.kill(signal.SIGTERM)
        assert proc.proc is not None and proc.proc.wait(timeout=20) == 0
    finally:
        proc.stop(grace_s=5)
        shm: ShmEmbeddingCache | None = None
        with contextlib.suppress(FileNotFoundError):
            shm = ShmEmbeddingCache.attach(segment, shm_lock_dir())
        if shm is not None:
            shm.unlink()
            shm.close()

"""A prefill worker process with ``--redis-url`` publishes its prefix cache's block events to the
cluster's stream (the warm-up's do not leak out); the pump drops events, never requests, when
Redis fails."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from services.index_events import EventPump
from swaserve.launcher import ServiceProcess, free_port, grpc_ready
from swaserve.routing.events import BlockEvent, IndexFollower, stream_key
from swaserve.routing.hashing import block_hashes
from swaserve.routing.index import InMemoryPrefixIndex
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

B = 4


@pytest.fixture(scope="module")
def worker(tiny_dir: Path, redis_url: str) -> Iterator[tuple[str, str]]:
    ns, port = f"w-{uuid.uuid4().hex}", free_port()
    cmd = [sys.executable, "-m", "services.prefill", "--model", str(tiny_dir), "--port", str(port),
           "--page-size", "4", "--max-num-batched-tokens", "32", "--kv-cache-memory", "16MiB",
           "--redis-url", redis_url, "--index-namespace", ns, "--index-block-tokens", str(B)]  # fmt: skip
    proc = ServiceProcess("prefill-events", cmd, grpc_ready(f"127.0.0.1:{port}"))
    proc.start()
    try:
        proc.wait_ready(300)
        yield f"127.0.0.1:{port}", ns
    finally:
        proc.stop()


def test_worker_publishes_the_blocks_it_caches(worker: tuple[str, str], redis_url: str) -> None:
    addr, ns = worker
    rc = redis.Redis.from_url(redis_url, decode_responses=True)
    assert rc.xlen(stream_key(ns)) == 0  # the warm-up's blocks came and went unpublished
    prompt = [(7 * i) % 300 + 3 for i in range(37)]  # two prefill chunks: 32 + 5 tokens
    req = pb.GenerateRequest(request_id="ev-1", prompt_token_ids=prompt,
                             sampling=pb.SamplingParams(max_tokens=1, top_p=1.0, repetition_penalty=1.0))  # fmt: skip
    with grpc.insecure_channel(addr) as ch:
        out = list(wgrpc.WorkerStub(ch).Generate(req, timeout=60))
    assert out[-1].WhichOneof("kind") == "complete"
    want = block_hashes(prompt, B)  # 9 whole blocks: every whole page of the prompt is cached
    deadline = time.monotonic() + 10
    while True:
        entries = rc.xrange(stream_key(ns))
        chains = [[int(h) for h in f["hashes"].split(",")] for _, f in entries]
        if (chains and chains[-1] == want) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert chains and chains[-1] == want
    assert all(f["instance"] == addr and f["op"] == "stored" for _, f in entries)
    assert all(c == want[: len(c)] for c in chains)  # chunk by chunk, each a chain from the root
    follower = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=time.monotonic)
    assert follower.poll() == len(entries)
    assert follower.index.match(want, time.monotonic()) == {addr: len(want)}


class FlakyPublisher:
    def __init__(self) -> None:
        self.fail = True
        self.got: list[BlockEvent] = []
        self.gate = threading.Event()

    def publish(self, events: list[BlockEvent]) -> int:
        self.gate.wait(5)
        if self.fail:
            raise redis.exceptions.ConnectionError("down")
        self.got.extend(events)
        return len(events)


def test_pump_drops_events_when_redis_fails_or_lags() -> None:
    pending: list[BlockEvent] = []

    def drain() -> list[BlockEvent]:
        out = list(pending)
        pending.clear()
        return out

    pub = FlakyPublisher()
    counts: dict[str, int] = {}
    pump = EventPump(
        drain, pub, max_batches=1, on_count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n)
    )
    assert pump.pump() == 0  # nothing pending
    pending.append(BlockEvent("stored", (1,)))
    assert pump.pump() == 1  # taken by the thread, which waits at the gate
    time.sleep(0.1)
    pending.append(BlockEvent("stored", (2,)))
    assert pump.pump() == 1  # queued (one slot)
    pending.append(BlockEvent("stored", (3,)))
    assert pump.pump() == 0  # queue full: dropped
    pub.gate.set()
    deadline = time.monotonic() + 5
    while pump.dropped < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pump.dropped == 3 and counts == {"dropped": 3}  # 1 full + 2 failed publishes
    pub.fail = False
    pending.append(BlockEvent("removed", (4,)))
    pump.close()
    assert pub.got == [BlockEvent("removed", (4,))] and pump.published == 1 and counts["published"] == 1

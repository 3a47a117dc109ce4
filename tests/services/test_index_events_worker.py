"""A prefill worker process with ``--redis-url`` publishes its prefix cache's block events to the
cluster's stream (a ``cleared`` first; the warm-up's do not leak out; each block once, chunk by
chunk) and re-publishes its whole cache after Redis restarted empty; the pump drops events, never
requests, when Redis fails, and re-sends the cache once it works again."""

from __future__ import annotations

import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis

from services.index_events import EventPump
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.hashing import block_hashes
from swaserve.procs import ServiceProcess, free_port, grpc_ready
from swaserve.redis_server import RedisServer
from swaserve.routing.index import InMemoryPrefixIndex
from swaserve.routing.redis.events import IndexFollower, stream_key
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

pytestmark = pytest.mark.cluster  # starts a prefill worker and a redis-server as child processes

B = 4


def worker_cmd(tiny_dir: Path, port: int, redis_url: str, ns: str) -> list[str]:
    return [sys.executable, "-m", "services.prefill", "--model", str(tiny_dir), "--port", str(port),
            "--page-size", "4", "--max-num-batched-tokens", "32", "--kv-cache-memory", "16MiB",
            "--redis-url", redis_url, "--index-namespace", ns, "--index-block-tokens", str(B)]  # fmt: skip


@pytest.fixture(scope="module")
def worker(tiny_dir: Path, redis_url: str) -> Iterator[tuple[str, str]]:
    ns, port = f"w-{uuid.uuid4().hex}", free_port()
    proc = ServiceProcess(
        "prefill-events", worker_cmd(tiny_dir, port, redis_url, ns), grpc_ready(f"127.0.0.1:{port}")
    )
    proc.start()
    try:
        proc.wait_ready(300)
        yield f"127.0.0.1:{port}", ns
    finally:
        proc.stop()


def wait_for(what: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def generate(addr: str, rid: str, prompt: list[int]) -> None:
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling=pb.SamplingParams(max_tokens=1, top_p=1.0, repetition_penalty=1.0))  # fmt: skip
    with grpc.insecure_channel(addr) as ch:
        out = list(wgrpc.WorkerStub(ch).Generate(req, timeout=60))
    assert out[-1].WhichOneof("kind") == "complete"


def test_worker_publishes_the_blocks_it_caches(worker: tuple[str, str], redis_url: str) -> None:
    addr, ns = worker
    rc = redis.Redis.from_url(redis_url, decode_responses=True)
    wait_for(lambda: rc.xlen(stream_key(ns)) > 0)
    # its first entry clears what a previous process under its name left; the warm-up's blocks
    # came and went unpublished
    ((_, first),) = rc.xrange(stream_key(ns))
    assert first == {"instance": addr, "op": "cleared", "hashes": "", "seq": "0"}
    prompt = [(7 * i) % 300 + 3 for i in range(37)]  # two prefill chunks: 32 + 5 tokens
    generate(addr, "ev-1", prompt)
    want = block_hashes(prompt, B)  # 9 whole blocks: every whole page of the prompt is cached
    sent: list[int] = []

    def all_sent() -> bool:
        sent[:] = [int(h) for _, f in rc.xrange(stream_key(ns))[1:] for h in f["hashes"].split(",")]
        return sent == want

    wait_for(all_sent, 10)
    entries = rc.xrange(stream_key(ns))[1:]
    assert all(f["instance"] == addr and f["op"] == "stored" for _, f in entries)
    # chunk by chunk, each block once: the first from the root, the next ones linked to it
    assert "parent" not in entries[0][1]
    for (_, prev), (_, f) in itertools.pairwise(entries):
        assert int(f["parent"]) == int(prev["hashes"].split(",")[-1])
    follower = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=time.monotonic)
    assert follower.poll() == len(entries) + 1 and follower.gaps == 0
    assert follower.index.match(want, time.monotonic()) == {addr: len(want)}


@pytest.mark.slow  # its own cluster and a Redis restart, ~25 s (make test-slow, CI)
def test_worker_resends_its_cache_after_a_redis_restart(tiny_dir: Path) -> None:
    """Redis restarted empty while the worker cached a prompt: the worker notices (its marker is
    gone, its publishes failed) and re-publishes its whole cache; a router's index built from the
    new stream holds both prompts."""
    server = RedisServer().start()
    ns, port = f"w-{uuid.uuid4().hex}", free_port()
    proc = ServiceProcess(
        "prefill-resend", worker_cmd(tiny_dir, port, server.url, ns), grpc_ready(f"127.0.0.1:{port}")
    )
    proc.start()
    again: RedisServer | None = None
    try:
        proc.wait_ready(300)
        addr = f"127.0.0.1:{port}"
        rc = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=1.0)
        a, b = [[(5 * i + k) % 290 + 3 for i in range(24)] for k in (1, 2)]
        generate(addr, "a", a)
        wait_for(lambda: rc.xlen(stream_key(ns)) > 1)
        server.stop()
        generate(addr, "b", b)  # cached while Redis is gone: its events are lost
        again = RedisServer(port=server.port).start()
        follower = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=time.monotonic)

        def both_indexed() -> bool:
            follower.poll()
            now = time.monotonic()
            return [follower.index.match(block_hashes(p, B), now) for p in (a, b)] == [{addr: 6}] * 2

        wait_for(both_indexed)
        assert rc.xrange(stream_key(ns))[0][1]["op"] == "cleared" and follower.gaps == 0
    finally:
        proc.stop()
        if again is not None:
            again.stop()
        server.stop()


class FlakyPublisher:
    """Fails while ``fail``; the first publish waits at ``gate`` (so the queue fills)."""

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

    def check(self) -> bool:
        if self.fail:
            raise redis.exceptions.ConnectionError("down")
        return False


def test_pump_drops_events_when_redis_fails_or_lags_then_resends_the_cache() -> None:
    """Drops (queue full, failed publish) never block the caller; once publishing works again the
    pump sends a snapshot of the cache (here a set of single-block chains), then later events."""
    cache: set[int] = set()
    pending: list[BlockEvent] = []

    def store(h: int) -> None:
        cache.add(h)
        pending.append(BlockEvent("stored", (h,)))

    def drain(resync: bool = False) -> list[BlockEvent]:
        out = list(pending)
        pending.clear()
        if resync:
            return [BlockEvent("cleared", ()), *(BlockEvent("stored", (h,)) for h in sorted(cache))]
        return out

    pub = FlakyPublisher()
    counts: dict[str, int] = {}
    pump = EventPump(
        drain, pub, max_batches=1, check_s=0.05,
        on_count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n),
    )  # fmt: skip
    assert pump.pump() == 1 and pump.snapshots == 1  # the first pump sends a snapshot: [cleared]
    time.sleep(0.1)  # taken by the thread, which waits at the gate
    store(1)
    assert pump.pump() == 1  # queued (one slot)
    store(2)
    assert pump.pump() == 0  # queue full: dropped
    store(3)
    assert pump.pump() == 0  # lost: nothing is queued until the cache is re-sent
    pub.gate.set()
    wait_for(lambda: pump.dropped == 4, 5)
    assert counts == {"dropped": 4} and pub.got == []  # failed snapshot, skipped 1, dropped 2 and 3
    pub.fail = False
    wait_for(lambda: pump.pump() > 0, 5)  # Redis answers: the next pump takes a snapshot
    assert pump.snapshots == 2
    wait_for(lambda: pump.published == 4, 5)  # (a batch dropped before it is out would void it)
    store(4)
    pump.close()
    assert pub.got == [BlockEvent("cleared", ()), *(BlockEvent("stored", (h,)) for h in (1, 2, 3, 4))]
    assert pump.published == 5 and counts["published"] == 5

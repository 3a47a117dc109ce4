"""Where a request's next attempt may go (``WorkerPool.candidates``): never to a worker that failed
it, even the only one of its role (then nowhere: the router answers 503 at once); reachable
workers before ones that look unreachable; draining and refused workers never."""

from __future__ import annotations

from services.router.routing import RouterRouting, RoutingOptions
from services.router.worker_handle import Refusal, WorkerHandle
from services.router.workers import WorkerPool


def pool_of(*names: str) -> tuple[WorkerPool, list[WorkerHandle]]:
    pool = WorkerPool(RouterRouting(RoutingOptions()))
    handles = [WorkerHandle(n, "prefill", None, None) for n in names]  # type: ignore[arg-type]
    pool.handles = {w.address: w for w in handles}
    return pool, handles


def test_a_worker_that_failed_a_request_is_never_tried_again_for_it() -> None:
    pool, (a, b) = pool_of("10.0.0.1:1", "10.0.0.2:1")
    assert set(pool.candidates("prefill", set())) == {a.address, b.address}
    assert set(pool.candidates("prefill", {a})) == {b.address}
    b.healthy = False  # its last poll failed: tried only when no reachable one is left
    assert set(pool.candidates("prefill", set())) == {a.address}
    assert set(pool.candidates("prefill", {a})) == {b.address}
    assert pool.candidates("prefill", {a, b}) == {}
    assert pool.candidates("decode", set()) == {}


def test_the_only_worker_of_a_role_that_failed_a_request_is_not_a_candidate() -> None:
    pool, (only,) = pool_of("10.0.0.1:1")
    assert set(pool.candidates("prefill", set())) == {only.address}
    only.healthy = False  # looks down, but it did not fail this request: still a last resort
    assert set(pool.candidates("prefill", set())) == {only.address}
    assert pool.candidates("prefill", {only}) == {}  # up or down: not again for this request
    only.healthy = True
    assert pool.candidates("prefill", {only}) == {}


def test_draining_and_refused_workers_are_never_candidates() -> None:
    pool, (a, b, c) = pool_of("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
    b.draining = True
    c.refusal, c.healthy = Refusal("duplicate", "the same process as 10.0.0.1:1"), False
    assert set(pool.candidates("prefill", set())) == {a.address}
    assert pool.candidates("prefill", {a}) == {}


def test_a_worker_that_says_it_drains_gets_nothing_new_and_keeps_its_attempts() -> None:
    """``GetLoad.draining`` (SIGTERM on the worker): not a candidate, not up, listed as draining
    with a reason; its attempts are not cancelled; a new process there (new boot id) is used again."""
    import asyncio

    from swaserve.v1 import worker_pb2 as pb

    async def run() -> None:
        pool, (a, b) = pool_of("10.0.0.1:1", "10.0.0.2:1")
        att = pool.begin("r#1", a)
        await pool.record(a, pb.Load(role="prefill", boot_id="one", draining=True))
        assert set(pool.candidates("prefill", set())) == {b.address}
        assert a.state == "draining" and a.reason is not None and "shutting down" in a.reason
        assert a.healthy and att.lost is None and att in a.attempts  # in flight: left to finish
        assert a.stats().draining and not b.stats().draining
        b.healthy = False  # the other looks down: a draining worker is still no candidate
        assert set(pool.candidates("prefill", set())) == {b.address}
        assert not pool.up("prefill") and "shutting down" in (pool.missing("prefill") or "")
        await pool.record(a, pb.Load(role="prefill", boot_id="two"))  # restarted
        assert a.state == "up" and a.reason is None and a.address in pool.candidates("prefill", set())
        pool.end(att)
        pool.routing.executor.shutdown()

    asyncio.run(run())


class _Stub:
    """The gRPC stub of a worker that is hung (every call times out) until ``back``."""

    def __init__(self) -> None:
        self.back = False
        self.aborted: list[str] = []

    async def Abort(self, req: object, timeout: float) -> object:
        import grpc

        from swaserve.v1 import worker_pb2 as pb

        if not self.back:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "stalled"
            )
        assert isinstance(req, pb.AbortRequest)
        self.aborted.append(req.request_id)
        return pb.AbortResponse()

    async def GetLoad(self, req: object, timeout: float) -> object:
        from swaserve.v1 import worker_pb2 as pb

        return pb.Load(role="decode", boot_id="one")


def test_an_abort_a_hung_worker_missed_is_sent_again_once_it_answers_a_poll() -> None:
    """Else a decode worker back from a stall keeps the request's staged KV until its TTL."""
    import asyncio

    async def run() -> None:
        pool, (w,) = pool_of("10.0.0.1:1")
        stub = _Stub()
        w.stub = stub  # type: ignore[assignment]
        await pool.abort(w, "r#1")
        await pool.abort(w, "r#2")
        assert w.pending_aborts == {"r#1", "r#2"} and stub.aborted == []
        await pool.poll_one(w)  # GetLoad answers, its Aborts still time out: kept for the next poll
        assert w.pending_aborts == {"r#1", "r#2"}
        stub.back = True
        await pool.poll_one(w)
        assert stub.aborted == ["r#1", "r#2"] and not w.pending_aborts
        del pool.handles[w.address]  # removed: a missed abort is not kept
        stub.back = False
        await pool.abort(w, "r#3")
        assert not w.pending_aborts

    asyncio.run(run())


def test_a_decode_worker_whose_staging_cannot_hold_the_prompt_is_never_a_candidate() -> None:
    """``Load.max_transfer_tokens``: a prompt goes only to decode workers whose whole staging holds
    its KV (one that has not reported a limit may be tried); the largest limit, of all and of the
    reachable ones, is what the router refuses prompts against before any attempt."""
    from swaserve.v1 import worker_pb2 as pb

    pool = WorkerPool(RouterRouting(RoutingOptions()))
    small, big, unknown = (WorkerHandle(f"10.0.0.{i}:1", "decode", None, None) for i in (1, 2, 3))  # type: ignore[arg-type]
    pool.handles = {w.address: w for w in (small, big, unknown)}
    assert pool.max_transfer_tokens() is None  # nothing reported yet: no limit known
    small.load, big.load = (
        pb.Load(role="decode", max_transfer_tokens=5),
        pb.Load(role="decode", max_transfer_tokens=792),
    )
    assert set(pool.candidates("decode", set(), 5)) == {small.address, big.address, unknown.address}
    assert set(pool.candidates("decode", set(), 6)) == {big.address, unknown.address}
    assert set(pool.candidates("decode", set(), 793)) == {unknown.address}
    assert set(pool.candidates("decode", set(), 0)) == {small.address, big.address, unknown.address}
    assert pool.max_transfer_tokens() == pool.max_transfer_tokens(reachable=True) == 792
    big.healthy = False  # down: still the deployment's limit, not a reachable one
    assert pool.max_transfer_tokens() == 792 and pool.max_transfer_tokens(reachable=True) == 5
    assert set(pool.candidates("decode", set(), 300)) == {unknown.address}
    unknown.draining = True  # removed: only the down one is left for the prompt, as a last resort
    assert set(pool.candidates("decode", set(), 300)) == {big.address}
    big.shutting_down = True
    assert pool.max_transfer_tokens() == 5 and pool.candidates("decode", set(), 300) == {}

"""Two names of one worker process (``127.0.0.1:P`` and ``localhost:P``, e.g. added on two
routers at once, before their registries synced): whatever order a router polls them in, it uses
the same name as every other router, the smallest address."""

from __future__ import annotations

import asyncio

from services.router.routing import RouterRouting, RoutingOptions
from services.router.worker_handle import WorkerHandle
from services.router.workers import WorkerPool
from swaserve.v1 import worker_pb2 as pb


def used_names(poll_order: list[str], rounds: int = 3) -> set[str]:
    async def go() -> set[str]:
        pool = WorkerPool(RouterRouting(RoutingOptions()))
        for name in poll_order:
            pool.handles[name] = WorkerHandle(name, "prefill", None, None)  # type: ignore[arg-type]
        load = pb.Load(role="prefill", boot_id="b00700", queue_order="fcfs")
        for _ in range(rounds):
            for name in poll_order:
                await pool.record(pool.handles[name], load)
        refused = {n: h.refusal for n, h in pool.handles.items() if not h.healthy}
        assert all(r is not None and r.code == "duplicate" for r in refused.values()), refused
        return {n for n, h in pool.handles.items() if h.healthy}

    return asyncio.run(go())


def test_every_router_uses_the_same_name_of_a_process() -> None:
    """From the first round of polls on (a name up until a smaller one answers is refused at
    once), in every poll order."""
    names = ["localhost:50051", "127.0.0.1:50051", "[::1]:50051"]
    orders = (names, names[::-1], names[1:] + names[:1])
    seen = {frozenset(used_names(order, rounds)) for order in orders for rounds in (1, 3)}
    assert seen == {frozenset({"127.0.0.1:50051"})}

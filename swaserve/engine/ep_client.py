"""``EPEngineClient``: one expert-parallel instance, ``ep_size`` engine-core processes as one engine.

Each rank is an engine core in its own process (``engine.mp_client``) holding 1/N of the routed
experts and its own requests, pools and prefix cache (data-parallel attention); the cores meet
in ``torch.distributed`` collectives (``engine.core_proc``: gloo on CPU, NCCL on CUDA; rendezvous
on a loopback TCP port). The front places each request on a rank (``engine.dp_ranks.RankBalancer``)
and wakes the others, so every rank steps while any has work; cache events are merged into the
instance's (``EventMerger``). A rank that dies (or is killed as hung) ends the instance: the
others are killed, open requests fail with ``EngineDead`` and ``on_dead`` runs once, so the
worker goes NOT_SERVING and exits as it does for a single core. With ``ep_launcher`` ray the
ranks are Ray actors in one placement group instead of child processes (``engine.ray_ranks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from swaserve.config import EngineConfig
from swaserve.cpus import usable_cpus
from swaserve.engine.client import EngineDead, LocalEngineClient
from swaserve.engine.dp_ranks import EventMerger, RankBalancer
from swaserve.engine.mp_client import MPEngineClient
from swaserve.engine.stats import EngineStats, merge_stats
from swaserve.engine.types import RequestOutput, SamplingParams
from swaserve.procs import free_port

if TYPE_CHECKING:
    import torch

    from swaserve.engine.core_proc import CoreSpec
    from swaserve.engine.ray_ranks import LocalRayHead, RankGroup, RayCore
    from swaserve.kvcache.block_events import BlockEvent
    from swaserve.media.placeholders import MediaInputs
    from swaserve.transfer.kv_transfer import KVPayload

log = logging.getLogger(__name__)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class EPEngineClient(LocalEngineClient):
    """Args:
    model_dir: checkpoint directory. engine_config: the cores' knobs (``ep_size`` ranks).
    model_name: served model name. on_dead: called once when the instance dies.
    num_threads: torch threads per rank (default: the usable CPUs split between the ranks).
    """

    def __init__(
        self,
        model_dir: str | Path,
        engine_config: EngineConfig,
        model_name: str | None = None,
        on_dead: Callable[[str], None] | None = None,
        num_threads: int | None = None,
    ) -> None:
        size = engine_config.ep_size
        if size < 2:
            raise ValueError(f"an EP client needs ep_size >= 2, got {size}")
        threads = num_threads or max(1, usable_cpus() // size)
        self.ranks = [
            MPEngineClient(
                model_dir,
                engine_config,
                model_name,
                on_dead=functools.partial(self._rank_dead, r),
                num_threads=threads,
                ep_rank=r,
            )
            for r in range(size)
        ]
        first = self.ranks[0]
        self.model_dir, self.model_name, self.engine_config = first.model_dir, first.model_name, engine_config
        self.tokenizer, self.model_config, self.media_config = (
            first.tokenizer,
            first.model_config,
            first.media_config,
        )
        self.max_model_len, self.kv_dtype = first.max_model_len, first.kv_dtype
        self.on_dead = on_dead
        self.balancer = RankBalancer(size, engine_config.page_size, time.monotonic)
        self.merger = EventMerger()
        self._owner: dict[str, int] = {}
        self._dead: EngineDead | None = None
        self._group: RankGroup | None = None  # --ep-launcher ray: the ranks' placement group
        self._ray_head: LocalRayHead | None = None  # a local Ray this client started

    @property
    def running(self) -> bool:
        return self._dead is None and all(c.running for c in self.ranks)

    def unavailable(self) -> EngineDead | None:
        return self._dead

    async def start(self) -> None:
        """Start every rank's core; returns when all have loaded their experts.

        Raises:
            RuntimeError: a rank failed to start (the others are stopped).
        """
        if self.running:
            return
        self._dead = None
        init = f"tcp://127.0.0.1:{free_port()}"
        for c in self.ranks:
            c.ep_init = init
        if self.engine_config.ep_launcher == "ray":
            await self._ray_group()
        tasks = [asyncio.create_task(c.start()) for c in self.ranks]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [(r, t.exception()) for r, t in enumerate(tasks) if t.done() and t.exception()]
        if failed:
            for c in self.ranks:
                c.kill()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(c.stop() for c in self.ranks), return_exceptions=True)
            await self._release_ray()
            r, e = failed[0]
            raise RuntimeError(f"expert-parallel rank {r} of {len(self.ranks)}: {e}")
        self.max_model_len = min(c.max_model_len for c in self.ranks)
        self.kv_dtype = self.ranks[0].kv_dtype
        log.info("expert-parallel instance of %d ranks ready (%s)", len(self.ranks), init)

    async def stop(self) -> None:
        try:
            await asyncio.gather(*(c.stop() for c in self.ranks))
        finally:
            await self._release_ray()

    async def _ray_group(self) -> None:
        """Ranks as Ray actors: Ray up (joined or local), one bundle per rank placed together."""
        from swaserve.engine.ray_ranks import RankGroup, init_ray

        cfg = self.engine_config
        cuda = (cfg.device or "").startswith("cuda") or (cfg.device is None and _cuda())
        self._ray_head = await asyncio.to_thread(
            init_ray, cfg.ray_address, max(len(self.ranks), usable_cpus())
        )
        group = RankGroup(len(self.ranks), gpus=1 if cuda else 0)
        try:
            await asyncio.to_thread(group.create)
        except BaseException:
            await self._release_ray()
            raise
        self._group = group

        async def launch(rank: int, spec: CoreSpec) -> RayCore:
            return await asyncio.to_thread(group.launch, rank, msgspec.json.encode(spec).decode())

        for r, c in enumerate(self.ranks):
            c.launch = functools.partial(launch, r)

    async def _release_ray(self) -> None:
        head_gone = self._ray_head is not None and self._ray_head.proc.poll() is not None
        if self._group is not None:
            if not head_gone:  # a local Ray that ended took the actors and the group with it,
                # and Ray's calls would wait 60 s for its GCS
                await asyncio.to_thread(self._group.remove)
            self._group = None
        if self._ray_head is not None:
            import ray

            head, self._ray_head = self._ray_head, None
            await asyncio.to_thread(ray.shutdown)
            await asyncio.to_thread(head.stop)

    def _rank_dead(self, rank: int, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDead(f"expert-parallel rank {rank} of {len(self.ranks)}: {message}")
        log.error("%s: stopping the instance", self._dead)
        for c in self.ranks:
            c.kill()
        if self.on_dead is not None:
            self.on_dead(str(self._dead))

    # -- requests -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return merge_stats([c.stats() for c in self.ranks])

    def has_request(self, request_id: str) -> bool:
        r = self._owner.get(request_id)
        return r is not None and self.ranks[r].has_request(request_id)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        export_kv: bool = False,
        prefilled: tuple[int, KVPayload] | None = None,
        media: MediaInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``EngineClient.generate`` on the rank the balancer picks."""
        if not self.running:
            raise self._dead or RuntimeError("engine is not running (call start())")
        if request_id in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        rank, cost = self.balancer.choose(prompt_token_ids, params.max_tokens)
        self._owner[request_id] = rank
        try:
            for r, c in enumerate(self.ranks):
                if r != rank:
                    c.wake()  # they step with it: its MoE layers need their experts
            stream = self.ranks[rank].generate(
                prompt_token_ids, params, request_id, export_kv, prefilled, media
            )
            async with contextlib.aclosing(stream) as s:  # type: ignore[type-var]
                async for out in s:
                    yield out
        finally:
            self._owner.pop(request_id, None)
            self.balancer.done(rank, cost)

    async def supply_media(self, request_id: str, index: int, embeds: torch.Tensor) -> None:
        r = self._owner.get(request_id)
        if r is not None:
            await self.ranks[r].supply_media(request_id, index, embeds)

    async def abort(self, request_id: str) -> None:
        r = self._owner.get(request_id)
        if r is not None:
            await self.ranks[r].abort(request_id)

    async def flush_cache(self) -> None:
        await asyncio.gather(*(c.flush_cache() for c in self.ranks))

    async def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        per_rank = await asyncio.gather(*(c.drain_cache_events(resync) for c in self.ranks))
        if resync:
            return self.merger.snapshot(per_rank)
        return [e for r, events in enumerate(per_rank) for e in self.merger.merge(r, events)]

"""A GCache node process (``python -m services.gcache``): ``NodeServer`` puts the parts together
(the store on its thread, gRPC with health and reflection, the UCX data plane, the Redis
registration and index events, ``--metrics-port``), ``app`` is its command line.

SIGTERM (or SIGINT) drains: health NOT_SERVING, puts refused, reads go on until no request is in
flight and no put reservation open (at most ``--shutdown-timeout-s``), then it stops and exits 0;
a second signal stops it at once."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from services.gcache.metrics import GCacheMetrics
from services.gcache.node import GCacheNode, Limits
from services.gcache.registry import Registration, index_instance
from services.gcache.servicer import GrpcServer, start_grpc
from services.lifecycle import serve_until_signalled
from swaserve.gcache.store import PageStore
from swaserve.gcache.tiers import DirectoryInUse, DramTier, NvmeTier
from swaserve.options import size_option

log = logging.getLogger("swaserve.gcache")


@dataclass
class NodeOptions:
    """A node's settings (the command line's flags; sizes in bytes, times in seconds)."""

    host: str = "127.0.0.1"
    port: int = 0
    ucx_port: int = 0  # 0: a free port; -1: no UCX data plane
    dram: int = 1 << 30
    nvme_dir: Path | None = None
    nvme: int = 8 << 30
    direct_io: bool = True
    node_id: str | None = None  # default: the advertised address
    advertise: str | None = None  # the gRPC address clients dial (default host:port)
    redis_url: str | None = None
    namespace: str = "swaserve"
    registry_ttl_s: float = 5.0
    publish_events: bool = True  # with redis_url: block events for the routers' index
    metrics_port: int | None = None
    lease_s: float = 5.0
    put_timeout_s: float = 30.0
    half_life_s: float = 600.0
    max_object_bytes: int = 64 << 20
    max_batch: int = 16384
    maintain_s: float = 1.0
    shutdown_timeout_s: float = 10.0


def direct_io_works(directory: Path) -> bool:
    """Whether ``directory``'s filesystem takes ``O_DIRECT`` (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-io-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


class NodeServer:
    """One node, in this process (tests) or as the process (``app``). ``start`` then ``stop``;
    ``port``, ``address`` and ``node`` once started. ``freeze_gc``: once started, move every
    object so far out of the garbage collector (``gc.freeze``), for the node's own process."""

    def __init__(self, opts: NodeOptions, freeze_gc: bool = False) -> None:
        self.opts, self.freeze_gc = opts, freeze_gc
        self.metrics = GCacheMetrics()
        self.node: GCacheNode | None = None
        self.grpc: GrpcServer | None = None
        self.port = 0
        self.address = ""
        self._ucx: Any = None
        self._registration: Registration | None = None
        self._pump: Any = None
        self._pump_task: asyncio.Task[None] | None = None
        self._httpd: Any = None
        self._direct = False

    def _make_store(self) -> PageStore:
        o = self.opts
        nvme = None
        if o.nvme_dir is not None:
            nvme = NvmeTier(o.nvme_dir, o.nvme, direct=o.direct_io)
            self._direct = o.direct_io and (nvme.direct or direct_io_works(Path(o.nvme_dir)))
            free = shutil.disk_usage(o.nvme_dir).free
            if nvme.given + free < o.nvme:
                log.warning(
                    "--nvme %d bytes but %s has %d free (%d already in its slot files): writes past "
                    "that fail and are dropped (gcache_io_errors_total); lower --nvme",
                    o.nvme, o.nvme_dir, free, nvme.given,
                )  # fmt: skip
        return PageStore(
            DramTier(o.dram),
            nvme,
            half_life_s=o.half_life_s,
            lease_s=o.lease_s,
            put_timeout_s=o.put_timeout_s,
        )

    async def start(self) -> None:
        """Open the store (NVMe recovery included), bind the ports, register, go SERVING. Raises
        what opening the store or binding a port raises."""
        o = self.opts
        limits = Limits(max_object_bytes=o.max_object_bytes, max_batch=o.max_batch)
        self.node = node = GCacheNode(self._make_store, "pending", limits, o.maintain_s, self.metrics.observe)
        await node.start()
        node.direct_io = self._direct
        self.grpc = await start_grpc(node, o.host, o.port)
        self.port = self.grpc.port
        self.address = o.advertise or f"{o.host}:{self.port}"
        node.node_id = o.node_id or self.address
        node.on_drain.append(self._not_serving)
        await self._start_ucx()
        self.metrics.attach(node.snapshot, lambda: node.draining)
        if o.metrics_port is not None:
            from services.worker_metrics import serve_metrics  # imports torch: only when asked

            self._httpd = serve_metrics(o.metrics_port, o.host, self.metrics.registry)
        if o.redis_url:
            self._registration = Registration(
                o.redis_url, o.namespace, node.node_id, self.address, o.registry_ttl_s
            )
            await self._registration.start()
            if o.publish_events:
                self._start_events()
        if self.freeze_gc:  # what startup made (imports, gRPC, ucxx) stays: gen-2 GC scans the rest
            gc.freeze()
        await self.grpc.set_serving(True)
        usage = await node.usage()
        tiers = ", ".join(f"{t} {u['capacity']} B ({u['pages']} pages)" for t, u in usage.items())
        nvme = ""
        if o.nvme_dir is not None:
            rec = await node.run(lambda st: dict(st.recovered))
            nvme = f" at {o.nvme_dir}, O_DIRECT {'on' if self._direct else 'off'}, recovered {rec['pages']} pages"
            nvme += f" ({rec['dropped']} bad slots dropped)"
        metrics = f", metrics {self._httpd.server_port}" if self._httpd is not None else ""
        print(
            f"gcache node {node.node_id} listening on {o.host}:{self.port} (gRPC), UCX "
            f"{node.ucx_port or 'off'}{metrics}; tiers: {tiers}{nvme}",
            flush=True,
        )

    async def _not_serving(self) -> None:
        if self.grpc is not None:
            await self.grpc.set_serving(False)

    async def _start_ucx(self) -> None:
        assert self.node is not None
        if self.opts.ucx_port < 0:
            return
        try:
            from services.gcache import ucx
        except ImportError as e:
            log.warning("no UCX data plane (services.gcache.ucx: %s): gRPC data only", e)
            return
        if not ucx.available():
            log.warning("no UCX data plane (ucxx does not import): gRPC data only")
            return
        self._ucx = ucx.UcxServer(  # no buffer larger than an object: refused before any is received
            self.node.handle_ucx,
            host=self.opts.host,
            port=self.opts.ucx_port,
            max_buffer_bytes=self.opts.max_object_bytes,
        )
        await self._ucx.start()
        self.node.ucx_port = int(self._ucx.port)

    def _start_events(self) -> None:
        import redis

        from services.index_events import EventPump
        from swaserve.routing.redis.events import RedisEventPublisher

        assert self.node is not None and self.opts.redis_url
        client = redis.Redis.from_url(
            self.opts.redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        publisher = RedisEventPublisher(client, self.opts.namespace, index_instance(self.node.node_id))
        self.node.publish_events = True
        self._pump = EventPump(self.node.drain_events, publisher, interval_s=0.2)
        self._pump_task = asyncio.create_task(self._pump.run())

    async def drain(self) -> bool:
        """Refuse puts (health NOT_SERVING), wait for requests in flight and open reservations
        (at most ``shutdown_timeout_s``); returns whether they all finished."""
        assert self.node is not None
        await self.node.drain()
        return await self.node.wait_idle(self.opts.shutdown_timeout_s)

    async def stop(self) -> None:
        """Deregister, close the ports and the store; idempotent."""
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
            with contextlib.suppress(Exception):
                await self._pump.pump_async()
            await asyncio.to_thread(self._pump.close, 2.0, False)
            self._pump_task = None
        if self._ucx is not None:
            with contextlib.suppress(Exception):
                await self._ucx.stop()
            self._ucx = None
        if self.grpc is not None:
            await self.grpc.set_serving(False)
            await self.grpc.server.stop(grace=1.0)
            self.grpc = None
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd = None
        if self.node is not None:
            await self.node.close()
            self.node = None


app = typer.Typer(add_completion=False, help="A GCache node: the L3 KV page cache (DRAM + NVMe), gRPC + UCX.")


@app.command()
def main(
    host: Annotated[str, typer.Option(help="Address to bind (gRPC, metrics; ucxx listens for UCX on every interface: keep the UCX port firewalled).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, help="gRPC port (0 = a free one, printed).")] = 0,
    ucx_port: Annotated[int, typer.Option(min=-1, help="UCX data port (0 = a free one, -1 = no UCX).")] = 0,
    dram: Annotated[int, typer.Option(parser=size_option, metavar="BYTES", help="DRAM tier capacity.")] = "1GiB",  # type: ignore[assignment]
    nvme_dir: Annotated[Path | None, typer.Option(help="NVMe tier directory (slot files; default: no NVMe tier).")] = None,
    nvme: Annotated[int, typer.Option(parser=size_option, metavar="BYTES", help="NVMe tier capacity.")] = "8GiB",  # type: ignore[assignment]
    direct_io: Annotated[bool, typer.Option(help="O_DIRECT for the NVMe tier where the filesystem takes it.")] = True,
    node_id: Annotated[str | None, typer.Option(help="This node's id in the registry (default: the advertised address).")] = None,
    advertise: Annotated[str | None, typer.Option(help="The gRPC address clients dial (default HOST:PORT).")] = None,
    redis_url: Annotated[str | None, typer.Option(envvar="SWASERVE_GCACHE_REDIS_URL", help="Register in this Redis (and publish index events).")] = None,
    namespace: Annotated[str, typer.Option(help="The cluster's Redis namespace.")] = "swaserve",
    registry_ttl_s: Annotated[float, typer.Option(min=0.5, help="Seconds the registry entry outlives the node.")] = 5.0,
    publish_events: Annotated[bool, typer.Option(help="With --redis-url: stored/removed block events for the routers.")] = True,
    metrics_port: Annotated[int | None, typer.Option(min=0, help="Prometheus /metrics port (default: none).")] = None,
    lease_s: Annotated[float, typer.Option(min=0.1, help="Default read lease of a lookup (seconds).")] = 5.0,
    put_timeout_s: Annotated[float, typer.Option(min=0.1, help="Seconds before an uncommitted put is reclaimed.")] = 30.0,
    half_life_s: Annotated[float, typer.Option(min=1.0, help="Half-life of a page's heat (seconds).")] = 600.0,
    max_object_bytes: Annotated[int, typer.Option(parser=size_option, metavar="BYTES", help="Largest page object taken.")] = "64MiB",  # type: ignore[assignment]
    shutdown_timeout_s: Annotated[float, typer.Option(min=0.0, help="On SIGTERM: seconds requests in flight may take.")] = 10.0,
) -> None:  # fmt: skip
    """Run a node until SIGTERM (drain, exit 0)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gcache %(levelname)s %(message)s")
    opts = NodeOptions(
        host=host, port=port, ucx_port=ucx_port, dram=dram, nvme_dir=nvme_dir, nvme=nvme, direct_io=direct_io,
        node_id=node_id, advertise=advertise, redis_url=redis_url, namespace=namespace,
        registry_ttl_s=registry_ttl_s, publish_events=publish_events, metrics_port=metrics_port,
        lease_s=lease_s, put_timeout_s=put_timeout_s, half_life_s=half_life_s,
        max_object_bytes=max_object_bytes, shutdown_timeout_s=shutdown_timeout_s,
    )  # fmt: skip
    try:
        asyncio.run(_serve(opts))
    except DirectoryInUse as e:  # a second node on one NVMe directory would destroy its pages
        print(f"error: {e.strerror}", file=sys.stderr)
        raise typer.Exit(2) from None


async def _serve(opts: NodeOptions) -> None:
    await serve_until_signalled(NodeServer(opts, freeze_gc=True), log, opts.shutdown_timeout_s)

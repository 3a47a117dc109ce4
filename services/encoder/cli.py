"""An encoder process (``python -m services.encoder``): ``EncoderServer`` puts the parts together
(the checkpoint's media towers, the memory and optional shared-memory embedding caches, the
scheduling loop, gRPC with health and reflection, ``--metrics-port``), ``app`` is its command line.

Ready: health SERVING and one printed line (``encoder ready on HOST:PORT ...``). SIGTERM (or
SIGINT) drains: health NOT_SERVING, submits refused (UNAVAILABLE), the queue encoded and open
fetches finished within ``--grace-s``, then it stops and exits 0; a second signal stops it at once.
Bad flags, an unreadable checkpoint or one without media towers: exit 2 with a message.

``--shm-cache NAME``: the per-machine tier, created by the first encoder of the host and attached
by the others (``ShmEmbeddingCache``; lock file in ``shm_lock_dir()``). It is never unlinked here:
entries are keyed by content and CRC-checked, so a restarted encoder finds them again."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import grpc
import torch
import typer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.encoder.limits import MAX_SUBMIT_BYTES
from services.encoder.metrics import EncoderMetrics
from services.encoder.servicer import SERVICE, Encoder, EncoderServicer, EncodeScheduler, Limits
from services.encoder.wire import DTYPES
from services.lifecycle import serve_until_signalled
from swaserve.encoder.cache import EmbeddingCache
from swaserve.encoder.runner import MediaEncoder
from swaserve.encoder.shm_cache import ShmEmbeddingCache
from swaserve.front_options import GrpcTlsCertOption, GrpcTlsKeyOption
from swaserve.options import size_option
from swaserve.v1 import encoder_pb2_grpc as egrpc

log = logging.getLogger("swaserve.encoder")
CaOption = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="The services' TLS CA (PEM): checked and accepted so every service takes one flag set; "
        "the encoder dials nothing.",
    ),
]


@dataclass
class EncoderOptions:
    """An encoder's settings (the command line's flags; sizes in bytes, times in seconds)."""

    model: Path | None = None  # default: the bundled model
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    health_port: int | None = None  # plaintext grpc.health.v1 only (kubelet probes of a TLS encoder)
    device: str = "cpu"
    dtype: str = "float32"
    limits: Limits = field(default_factory=Limits)
    cache_bytes: int = 1 << 30
    shm_cache: str | None = None
    shm_cache_bytes: int = 1 << 30
    video_threads: int = 2
    grace_s: float = 10.0
    credentials: grpc.ServerCredentials | None = None  # TLS on the gRPC port; None: plaintext


def shm_lock_dir() -> Path:
    """Where the shared tier's lock file lives: ``/dev/shm`` (beside the segments), else the
    temporary directory."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def modalities_of(encoder: MediaEncoder) -> frozenset[str]:
    """The modalities ``encoder``'s checkpoint has towers and parameters for."""
    mm, out = encoder.config, set[str]()
    if encoder.vit is not None and mm.image is not None:
        out.update(("image", "video") if mm.video is not None else ("image",))
    if encoder.audio is not None:
        out.add("audio")
    return frozenset(out)


def model_fingerprint(model_dir: Path) -> str:
    """The fingerprint routers and workers compare (``model.identity``, media digest included)."""
    from swaserve.config import ModelConfig
    from swaserve.hf_tokenizer import load_tokenizer
    from swaserve.model.identity import model_identity
    from swaserve.model.multimodal import media_digest

    config, tok = ModelConfig.from_pretrained(model_dir), load_tokenizer(model_dir)
    return model_identity(config, tok, model_dir.name, media_digest(model_dir)).fingerprint


def open_shm(name: str, capacity: int) -> ShmEmbeddingCache:
    """Create the shared tier ``name``, or attach it when another process made it first."""
    try:
        return ShmEmbeddingCache.create(name, capacity, shm_lock_dir())
    except FileExistsError:
        shm = ShmEmbeddingCache.attach(name, shm_lock_dir())
        if shm.capacity != capacity:
            log.info("shared cache %s: attached, %d bytes (its creator's size)", name, shm.capacity)
        return shm


class EncoderServer:
    """One encoder, in this process (tests pass ``encoder``, ``fingerprint``, ``modalities``) or as
    the process (``app``). ``start`` then ``drain``/``stop``; ``port`` once started."""

    def __init__(
        self,
        opts: EncoderOptions,
        encoder: Encoder | None = None,
        fingerprint: str | None = None,
        modalities: frozenset[str] | None = None,
    ) -> None:
        self.opts = opts
        if encoder is None:
            from swaserve.model.checkpoint import default_model_dir

            model_dir = opts.model or Path(default_model_dir())
            media = MediaEncoder(model_dir, opts.device, DTYPES[opts.dtype], opts.video_threads)
            encoder, modalities = media, modalities_of(media)
            fingerprint = fingerprint or model_fingerprint(model_dir)
        if fingerprint is None or modalities is None:
            raise ValueError("an encoder given without its fingerprint and modalities")
        self.encoder, self.fingerprint, self.modalities = encoder, fingerprint, modalities
        self.metrics = EncoderMetrics()
        self.scheduler: EncodeScheduler | None = None
        self.servicer: EncoderServicer | None = None
        self.shm: ShmEmbeddingCache | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._probes: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._httpd: Any = None

    def shm_segment(self) -> str:
        """The shared tier's segment name: ``--shm-cache`` and the towers' weights digest, so
        encoders of other weights on the machine never read each other's embeddings."""
        digest = getattr(self.encoder, "weights_digest", "")
        return f"{self.opts.shm_cache}-{digest[:12]}" if digest else str(self.opts.shm_cache)

    async def start(self) -> None:
        """Open the caches, bind the ports, start the loop, go SERVING. Raises what opening the
        shared tier (ValueError, OSError) or binding a port (RuntimeError) raises."""
        o = self.opts
        if o.shm_cache and self.shm is None:
            self.shm = open_shm(self.shm_segment(), o.shm_cache_bytes)
        self.scheduler = EncodeScheduler(
            self.encoder,
            self.fingerprint,
            self.modalities,
            EmbeddingCache(o.cache_bytes),
            self.shm,
            o.limits,
            self.metrics,
        )
        self.servicer = EncoderServicer(self.scheduler)
        limit = [("grpc.max_receive_message_length", MAX_SUBMIT_BYTES)]
        self._server = server = grpc.aio.server(options=limit)
        egrpc.add_EncoderServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        await self.set_serving(False)
        bind = f"{o.host}:{o.port}"
        self.port = (
            server.add_secure_port(bind, o.credentials) if o.credentials else server.add_insecure_port(bind)
        )
        if o.health_port is not None:
            self._probes = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._probes)
            self._probes.add_insecure_port(f"{o.host}:{o.health_port}")
            await self._probes.start()
        if o.metrics_port is not None:
            from services.worker_metrics import serve_metrics

            self._httpd = serve_metrics(o.metrics_port, o.host, self.metrics.registry)
        await server.start()
        self.scheduler.start()
        await self.set_serving(True)
        tls = " (TLS)" if o.credentials else ""
        metrics = f", metrics {self._httpd.server_port}" if self._httpd is not None else ""
        shm = f", shared cache {o.shm_cache} ({self.shm.capacity} B)" if self.shm is not None else ""
        print(
            f"encoder ready on {o.host}:{self.port}{tls}{metrics}; model fingerprint {self.fingerprint}, "
            f"{'/'.join(sorted(self.modalities))} on {o.device} {o.dtype}; cache {o.cache_bytes} B{shm}",
            flush=True,
        )

    async def set_serving(self, serving: bool) -> None:
        s = health_pb2.HealthCheckResponse
        for name in ("", SERVICE):
            await self._health.set(name, s.SERVING if serving else s.NOT_SERVING)

    async def drain(self) -> bool:
        """Health NOT_SERVING, submits refused, the queue encoded and open fetches done (within
        ``grace_s`` together). Returns whether all finished."""
        assert self.scheduler is not None and self.servicer is not None
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.opts.grace_s
        done = await self.scheduler.drain(self.opts.grace_s)
        while self.servicer.open_fetches and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return done and not self.servicer.open_fetches

    async def stop(self) -> None:
        """Close the ports, the loop and the caches; idempotent."""
        if self._server is not None:
            await self.set_serving(False)
            await self._server.stop(grace=0.5)
            self._server = None
        if self._probes is not None:
            await self._probes.stop(grace=None)
            self._probes = None
        if self.scheduler is not None:
            await self.scheduler.close()
            self.scheduler = None
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None


app = typer.Typer(
    add_completion=False, help="A media encoder (images, video, audio) over gRPC: batching, caches."
)


@app.command()
def main(
    model: Annotated[Path | None, typer.Option(help="Checkpoint directory with media towers (default: bundled model).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (gRPC, metrics).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, help="gRPC port (0 = a free one, printed).")] = 0,
    metrics_port: Annotated[int | None, typer.Option(min=0, help="Prometheus /metrics port (default: none).")] = None,
    device: Annotated[str, typer.Option(help="Torch device of the towers and preprocessing: cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Tower dtype: float32, bfloat16 or float16 (also on the wire).")] = "float32",
    max_batch_items: Annotated[int, typer.Option(min=1, help="Most items fused in one forward.")] = 16,
    max_batch_tokens: Annotated[int, typer.Option(min=1, help="Most output rows (summed) in one forward.")] = 16384,
    max_wait_ms: Annotated[float, typer.Option(min=0.0, help="How long a partial batch waits for more items (ms).")] = 5.0,
    cache_bytes: Annotated[int, typer.Option(parser=size_option, metavar="BYTES", help="Embedding cache of this process (LRU).")] = "1GiB",  # type: ignore[assignment]
    shm_cache: Annotated[str | None, typer.Option(help="Name of the per-machine shared-memory tier (created or attached; default: none).")] = None,
    shm_cache_bytes: Annotated[int, typer.Option(parser=size_option, metavar="BYTES", help="Size of the shared tier when this process creates it.")] = "1GiB",  # type: ignore[assignment]
    video_threads: Annotated[int, typer.Option(min=1, help="Threads decoding one video's time chunks.")] = 2,
    num_threads: Annotated[int | None, typer.Option(min=1, help="CPU threads for torch (default: torch's choice, at most the usable CPUs).")] = None,
    fetch_timeout_s: Annotated[float, typer.Option(min=0.0, help="How long a Fetch waits for an item still encoding, unless it says (s).")] = 60.0,
    max_queued_items: Annotated[int, typer.Option(min=1, help="Items waiting at most; a Submit over it is RESOURCE_EXHAUSTED.")] = 1024,
    grace_s: Annotated[float, typer.Option(min=0.0, help="On SIGTERM: seconds to encode what is queued and finish open fetches.")] = 10.0,
    health_port: Annotated[int | None, typer.Option(min=0, help="Also serve grpc.health.v1, in plaintext, on this port (kubelet probes of a TLS encoder).")] = None,
    grpc_tls_cert: GrpcTlsCertOption = None,
    grpc_tls_key: GrpcTlsKeyOption = None,
    grpc_tls_ca: CaOption = None,
) -> None:  # fmt: skip
    """Run an encoder until SIGTERM (drain, exit 0)."""
    from services.tls import Dialer, server_credentials
    from swaserve.cpus import usable_cpus

    if dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r}: one of {', '.join(DTYPES)}", param_hint="--dtype")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise typer.BadParameter(str(e), param_hint="--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA device here", param_hint="--device")
    if (grpc_tls_cert is None) != (grpc_tls_key is None):
        raise typer.BadParameter("give both or neither", param_hint="--grpc-tls-cert/--grpc-tls-key")
    try:  # the CA is read to check it (the encoder dials nothing): one flag set for every service
        Dialer.from_flags(grpc_tls_ca, None)
        creds = server_credentials(grpc_tls_cert, grpc_tls_key) if grpc_tls_cert and grpc_tls_key else None
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    threads = num_threads or (usable_cpus() if torch.get_num_threads() > usable_cpus() else None)
    if threads:
        torch.set_num_threads(threads)
    limits = Limits(
        max_batch_items=max_batch_items, max_batch_tokens=max_batch_tokens, max_wait_s=max_wait_ms / 1000,
        max_queued_items=max_queued_items, fetch_timeout_s=fetch_timeout_s,
    )  # fmt: skip
    opts = EncoderOptions(
        model=model, host=host, port=port, metrics_port=metrics_port, health_port=health_port, device=device,
        dtype=dtype, limits=limits, cache_bytes=cache_bytes, shm_cache=shm_cache, shm_cache_bytes=shm_cache_bytes,
        video_threads=video_threads, grace_s=grace_s, credentials=creds,
    )  # fmt: skip
    try:
        server = EncoderServer(opts)
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # no checkpoint, no towers, a bad config
        typer.echo(f"error: cannot load the encoder from {model or 'the bundled model'}: {e}", err=True)
        raise typer.Exit(2) from None
    if shm_cache:
        try:
            server.shm = open_shm(server.shm_segment(), shm_cache_bytes)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="--shm-cache") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s encoder %(levelname)s %(message)s")
    asyncio.run(_serve(server))


async def _serve(server: EncoderServer) -> None:
    await serve_until_signalled(server, log, server.opts.grace_s)

"""The engine-core process: ``EngineCore`` stepping in a busy loop behind two ZMQ sockets.

``python -m swaserve.engine.core_proc SPEC`` (SPEC: a ``CoreSpec`` as JSON; started by
``engine.mp_client.MPEngineClient``). Loop: take every queued message (adds, aborts, calls), step
while there is work, send one ``Outputs`` per step (outputs, refusals, cache events, stats), and
one before a step when messages changed something (so the front's load is never a step old). A
malformed or oversized message is logged and refused; a failed step ends the requests in flight
and the loop goes on. The process dies with its parent and ignores SIGINT and SIGTERM (the front stops it).

With expert parallelism (``ep_size`` > 1) the core is one rank of a ``torch.distributed`` group
(gloo on CPU, NCCL on CUDA; ``engine.ep_client`` starts the ranks): every loop iteration all ranks
agree with one all-reduce whether any has work and then step together (a rank without work runs
an idle forward). A failed step or collective ends the process (exit 1): its peers' collectives
then fail too, and the front fails the instance. The group's store and sockets listen on
loopback only (the ranks are processes of one machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
import urllib.parse
from typing import Any

import msgspec
import zmq

from swaserve.config import EngineConfig
from swaserve.engine.core import EngineCore
from swaserve.engine.core_output import CoreOutput
from swaserve.engine.ipc import (
    MAX_MESSAGE_BYTES,
    Abort,
    AddRequest,
    Call,
    Decoder,
    MessageError,
    Outputs,
    Ready,
    Refused,
    Reply,
    StartupFailed,
    SupplyMedia,
    ToCore,
    encode,
)
from swaserve.kvcache.block_events import BlockEvent
from swaserve.media.placeholders import MediaInputs

log = logging.getLogger("swaserve.engine.core_proc")
_IDLE_POLL_MS = 500  # while idle, how often the parent's liveness is checked
_WAKE_GRACE_S = 0.05  # EP: after a message, ranks keep meeting (no idle poll) this long, so a
# rank whose request is still on its way is met without waiting out another rank's idle poll


class CoreSpec(msgspec.Struct):
    """How to start a core: checkpoint, knobs, EOS ids, the front's sockets, its pid."""

    model_dir: str
    config: EngineConfig
    eos_token_ids: list[int]
    input_addr: str
    output_addr: str
    parent_pid: int
    max_message_bytes: int = MAX_MESSAGE_BYTES
    num_threads: int | None = None
    ep_rank: int = 0
    ep_init: str = ""  # the EP group's rendezvous (torch.distributed init_method), ep_size > 1


class CoreLoop:
    """The loop's state between sends, over an ``EngineCore`` (no sockets: ``send`` is given).

    Args:
        core: the engine core. send: sends one message to the front.
        max_message_bytes: inbound messages above this are refused.
        fatal: a failed step raises (an EP rank: its group cannot go on) instead of failing the
            requests in flight and going on.
    """

    def __init__(
        self, core: EngineCore, send: Any, max_message_bytes: int = MAX_MESSAGE_BYTES, fatal: bool = False
    ) -> None:
        self.core, self.send, self.fatal = core, send, fatal
        self.decoder = Decoder(ToCore, max_message_bytes)
        self.events_on = core.config.index_block_tokens is not None
        self.shutdown = False
        self._outputs: list[CoreOutput] = []
        self._refused: list[Refused] = []
        self._failed: list[str] = []
        self._failure = ""
        self._events: list[BlockEvent] = []
        self._dirty = False

    def handle(self, frames: list[Any]) -> None:
        """Apply one inbound message; never raises for a bad one."""
        self._dirty = True
        try:
            msg = self.decoder.decode(frames)
        except MessageError as e:
            rid = _request_id(frames)
            log.error("refused a message from the front%s: %s", f" (request {rid!r})" if rid else "", e)
            if rid:
                self._refused.append(Refused(rid, f"engine core refused the request: {e}"))
            return
        core = self.core
        if isinstance(msg, AddRequest):
            try:
                if msg.first_token is not None:
                    if msg.payload is None:
                        raise ValueError("a prefilled request needs its KV payload")
                    spans = tuple(msg.media_spans or ())
                    core.add_prefilled(
                        msg.request_id, msg.prompt_token_ids, msg.first_token, msg.params, msg.payload,
                        msg.arrival_time, MediaInputs(spans, {}) if spans else None,
                    )  # fmt: skip
                else:
                    media = None
                    if msg.media_spans:
                        media = MediaInputs(tuple(msg.media_spans), dict(msg.media_embeds or {}))
                    core.add_request(
                        msg.request_id,
                        msg.prompt_token_ids,
                        msg.params,
                        msg.arrival_time,
                        msg.export_kv,
                        media,
                    )
            except ValueError as e:
                self._refused.append(Refused(msg.request_id, str(e)))
        elif isinstance(msg, SupplyMedia):
            try:
                core.supply_media(msg.request_id, msg.index, msg.embeds.clone())
            except ValueError as e:  # the request fails alone
                core.abort_request(msg.request_id)
                self._refused.append(Refused(msg.request_id, str(e)))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                out = core.abort_request(rid)
                if out is not None:
                    self._outputs.append(out)
        elif isinstance(msg, Call):
            self._call(msg)

    def _call(self, msg: Call) -> None:
        reply = Reply(msg.call_id)
        try:
            if msg.method == "flush_cache":
                self.core.flush_cache()
            elif msg.method == "snapshot_events":
                self.flush()  # events drained before the snapshot reach the front first
                reply.events = self.core.drain_cache_events(resync=True)
            elif msg.method == "shutdown":
                self.shutdown = True
            # "ping": the reply alone says both sockets are connected
        except Exception as e:  # a failed call is the caller's error, not the loop's
            log.exception("call %s failed", msg.method)
            reply.error = f"{msg.method} failed: {e}"
        self.send(reply)

    def step(self) -> None:
        """One engine step; a failure ends every request in flight (the front fails them)."""
        self._dirty = True
        try:
            self._outputs.extend(self.core.step())
        except Exception as e:  # an engine bug: fail the requests in flight, keep serving
            if self.fatal:
                raise
            log.exception("engine step failed")
            self._failure = f"engine failed: {e}"
            self._failed.extend(self.core.abort_all())

    def flush(self) -> None:
        """Send what happened since the last flush (nothing if nothing did)."""
        if not self._dirty:
            return
        if self.events_on:
            self._events.extend(self.core.drain_cache_events())
        msg = Outputs(
            stats=self.core.stats(),
            outputs=self._outputs,
            refused=self._refused,
            failed=self._failed,
            failure=self._failure,
            events=self._events,
        )
        self._outputs, self._refused, self._failed, self._failure, self._events = [], [], [], "", []
        self._dirty = False
        self.send(msg)


def _request_id(frames: list[Any]) -> str:
    """The ``request_id`` of an undecodable message, if its header is a map that has one."""
    try:
        head = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
        obj = msgspec.msgpack.decode(head)
    except Exception:
        return ""
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else ""


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent dies (Linux prctl); exit now if it already has."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux: the idle poll checks the parent
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        sys.exit(1)


def run(spec: CoreSpec) -> int:
    """Serve the front until it asks to shut down; returns the exit status. ``parent_pid`` 0: a
    Ray actor (``engine.ray_ranks``), whose lifetime Ray ties to the front's: no parent checks."""
    if spec.parent_pid:
        _die_with_parent(spec.parent_pid)
        # Ctrl-C (and a SIGTERM sent to the process group) reach us too: the front stops us, after a
        # worker's drain (--shutdown-timeout); its death kills us (_die_with_parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spec.num_threads is not None:
        import torch

        torch.set_num_threads(spec.num_threads)
    ctx = zmq.Context()
    try:
        return _serve(spec, ctx)
    finally:
        ctx.destroy(linger=2000)  # what is still queued for the front is sent (2 s at most)


def _serve(spec: CoreSpec, ctx: zmq.Context[Any]) -> int:
    inp = ctx.socket(zmq.PULL)
    inp.connect(spec.input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(spec.output_addr)

    def send(msg: Any) -> None:
        out.send_multipart(encode(msg), copy=False)

    try:
        ep = _join_ep_group(spec)
        core = EngineCore(spec.model_dir, spec.config, spec.eos_token_ids, ep_comm=ep)
    except Exception as e:
        log.exception("engine core failed to start")
        send(StartupFailed(f"{type(e).__name__}: {e}"))
        out.close(linger=2000)
        return 1
    send(Ready(core.limits, str(core.dtype).removeprefix("torch."), os.getpid()))
    loop = CoreLoop(core, send, spec.max_message_bytes, fatal=ep is not None)
    if ep is not None:
        try:
            code = _serve_ep(loop, inp, spec)
        except Exception:  # a failed step or collective: a peer died or hung, or an engine bug
            log.exception("expert-parallel rank %d failed: the instance stops", spec.ep_rank)
            code = 1
        out.close(linger=2000 if code == 0 else 0)
        inp.close(linger=0)
        return code
    while not loop.shutdown:
        busy = core.has_unfinished()
        if inp.poll(0 if busy else _IDLE_POLL_MS):
            while not loop.shutdown:
                try:
                    frames = inp.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                loop.handle(frames)
        elif not busy and spec.parent_pid and os.getppid() != spec.parent_pid:
            log.error("the front process is gone: exiting")
            return 1
        if not loop.shutdown and core.has_unfinished():
            loop.flush()  # what the messages changed (adds, aborts) reaches the front before the step
            loop.step()
        loop.flush()
    out.close(linger=2000)
    inp.close(linger=0)
    return 0


def _join_ep_group(spec: CoreSpec) -> Any:
    """This rank's ``TorchComm`` (None without EP). On CUDA rank r takes GPU r mod the count."""
    cfg = spec.config
    if cfg.ep_size == 1:
        return None
    import datetime

    import torch
    import torch.distributed as dist

    from swaserve.model.ep import TorchComm

    cuda = torch.cuda.is_available() and (cfg.device is None or cfg.device.startswith("cuda"))
    if cuda:
        spec.config = dataclasses.replace(cfg, device=f"cuda:{spec.ep_rank % torch.cuda.device_count()}")
    timeout = datetime.timedelta(seconds=cfg.ep_timeout_s)
    host, port = _loopback_rendezvous(spec.ep_init)
    if spec.ep_rank == 0:  # torch's own TCPStore server would listen on every interface
        listener = socket.create_server((host, port), backlog=max(128, cfg.ep_size))
        store = dist.TCPStore(host, port, cfg.ep_size, True, timeout, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, cfg.ep_size, False, timeout)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=spec.ep_rank, world_size=cfg.ep_size, timeout=timeout
    )
    log.info("expert-parallel rank %d of %d joined", spec.ep_rank, cfg.ep_size)
    return TorchComm()


def _loopback_rendezvous(init: str) -> tuple[str, int]:
    """(host, port) of an EP group's ``tcp://127.0.0.1:PORT`` rendezvous; the ranks are processes
    of one machine, so gloo's pairs and NCCL's bootstrap listen on the loopback interface too
    (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless set).

    Raises:
        ValueError: ``init`` is not a TCP address on a loopback host.
    """
    url = urllib.parse.urlsplit(init)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"EP rendezvous {init!r}: expected tcp://HOST:PORT")
    if not ipaddress.ip_address(url.hostname).is_loopback:
        raise ValueError(f"EP rendezvous {init!r}: the ranks of an instance meet on a loopback address")
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return url.hostname, url.port


def _serve_ep(loop: CoreLoop, inp: Any, spec: CoreSpec) -> int:
    """The lockstep loop of an EP rank; returns the exit status (raises when a step or a
    collective fails)."""
    import torch
    import torch.distributed as dist

    core = loop.core
    flags = torch.zeros(2, dtype=torch.int64, device=core.device)
    group_busy = False
    eager_until = 0.0
    while True:
        busy = core.has_unfinished()
        eager = busy or group_busy or time.monotonic() < eager_until
        if inp.poll(0 if eager else _IDLE_POLL_MS):
            while True:
                try:
                    frames = inp.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                loop.handle(frames)
            eager_until = time.monotonic() + _WAKE_GRACE_S
        elif not eager and spec.parent_pid and os.getppid() != spec.parent_pid:
            log.error("the front process is gone: exiting")
            return 1
        flags[0], flags[1] = int(core.has_unfinished()), int(loop.shutdown)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank, once per iteration
        if int(flags[1]):
            break
        group_busy = bool(int(flags[0]))
        if group_busy:
            loop.flush()
            loop.step()  # a forward on every rank, idle ones without tokens
        loop.flush()
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    usage = "usage: python -m swaserve.engine.core_proc SPEC_JSON (started by its front, not by hand)"
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        spec = msgspec.json.decode(argv[0], type=CoreSpec)
    except msgspec.DecodeError as e:  # ValidationError is one
        print(f"{usage}\nbad SPEC_JSON: {e}", file=sys.stderr)
        return 2
    return run(spec)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # the sockets are closed and flushed: skip the interpreter's teardown, about 1 s of CPU with
    # torch loaded (a worker's stop waits for it)
    os._exit(code)

"""Messages between the front process and the engine-core process (``engine.core_proc``).

A message is a ZMQ multipart: frame 0 the msgpack of one tagged ``msgspec`` struct (typed
decode: a field of the wrong type is an error, nothing is unpickled), then one raw frame per
tensor (KV pages of a payload: dtype and shape in the header, checked against the frame's length).
``decode`` raises ``MessageError`` for anything malformed or over the size limits.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import torch

from swaserve.engine.core_output import CoreOutput
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import EngineLimits, SamplingParams
from swaserve.kvcache.block_events import BlockEvent
from swaserve.media.placeholders import MediaSpan
from swaserve.transfer.kv_transfer import KVPayload

MAX_HEADER_BYTES = 64 << 20  # frame 0: token ids, outputs, stats
MAX_MESSAGE_BYTES = 1 << 36  # all frames: KV payloads of long prompts
_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
}


class MessageError(ValueError):
    """A message that is malformed, of an unknown kind, or too big."""


# -- front -> core ------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    """Queue a request (``EngineCore.add_request``, or ``add_prefilled`` with ``first_token``
    and ``payload``, whose tensors travel as frames)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    export_kv: bool = False
    first_token: int | None = None
    payload: KVPayload | None = None
    media_spans: list[MediaSpan] | None = None
    media_embeds: dict[int, torch.Tensor] | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class SupplyMedia(msgspec.Struct, tag="media"):
    """Embeddings of an open request's media span (``EngineCore.supply_media``)."""

    request_id: str
    index: int
    embeds: torch.Tensor


class Call(msgspec.Struct, tag="call"):
    """A utility call answered by a ``Reply`` with the same ``call_id``, between steps."""

    call_id: int
    method: Literal["flush_cache", "snapshot_events", "shutdown", "ping"]


class Wake(msgspec.Struct, tag="wake"):
    """Expert parallelism: another rank of the instance got work; step with it (no reply)."""


# -- core -> front ------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    """The core loaded the model and takes requests."""

    limits: EngineLimits
    kv_dtype: str
    pid: int


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class Refused(msgspec.Struct):
    """An add the core refused (``ValueError``: the client's 400), or a malformed message."""

    request_id: str
    message: str


class Outputs(msgspec.Struct, tag="outputs"):
    """What the core did since its last message: step outputs, refusals, requests a failed step
    ended (``failed``: message), cache events, and the stats after it."""

    stats: EngineStats
    outputs: list[CoreOutput] = []
    refused: list[Refused] = []
    failed: list[str] = []
    failure: str = ""
    events: list[BlockEvent] = []


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    error: str = ""
    events: list[BlockEvent] = []


ToCore = AddRequest | Abort | SupplyMedia | Call | Wake
FromCore = Ready | StartupFailed | Outputs | Reply


# -- codec --------------------------------------------------------------------------------------
def encode(msg: ToCore | FromCore) -> list[Any]:
    """Frames of ``msg``: the msgpack header, then each tensor's bytes (zero-copy views)."""
    frames: list[Any] = [b""]

    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            name = str(t.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise TypeError(f"tensor dtype {t.dtype} cannot be sent")
            frames.append(t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b"")
            return [len(frames) - 1, name, list(t.shape)]
        raise TypeError(f"cannot encode {type(obj).__name__}")

    frames[0] = msgspec.msgpack.encode(msg, enc_hook=enc_hook)
    return frames


class Decoder:
    """Decodes one direction's messages (``ToCore`` or ``FromCore``) with the size limits."""

    def __init__(self, kind: Any, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._frames: Sequence[Any] = ()
        self._dec = msgspec.msgpack.Decoder(kind, dec_hook=self._dec_hook)

    def decode(self, frames: Sequence[Any]) -> Any:
        """The message in ``frames`` (bytes-like, or ``zmq.Frame``). Raises MessageError."""
        bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        if not bufs:
            raise MessageError("empty message")
        total = sum(b.nbytes for b in bufs)
        if bufs[0].nbytes > MAX_HEADER_BYTES or total > self.max_message_bytes:
            raise MessageError(
                f"message of {total} bytes (header {bufs[0].nbytes}) is over the limit "
                f"({self.max_message_bytes} bytes, header {MAX_HEADER_BYTES})"
            )
        self._frames = bufs
        try:
            return self._dec.decode(bufs[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MessageError(f"malformed message: {e}") from e
        finally:
            self._frames = ()

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        if typ is not torch.Tensor:
            raise TypeError(f"unsupported type {typ}")
        if not (
            isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], int) and isinstance(obj[2], list)
        ):
            raise ValueError("a tensor is [frame, dtype, shape]")
        index, name, shape = obj
        if not 0 < index < len(self._frames) or name not in _DTYPES:
            raise ValueError(f"tensor frame {index} / dtype {name!r} not in this message")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad tensor shape {shape}")
        dtype = _DTYPES[name]
        buf = self._frames[index]
        n = 1
        for d in shape:
            n *= d
        if n * dtype.itemsize != buf.nbytes:
            raise ValueError(
                f"tensor of shape {shape} {name} needs {n * dtype.itemsize} bytes, frame has {buf.nbytes}"
            )
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # a read-only view of the frame (kept alive by the
            warnings.simplefilter("ignore", UserWarning)  # tensor): pages are only read
            return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)

"""Conversions between KV transfer payloads and the swaserve.v1 ``KVTransfer`` messages: pages,
the MTP hidden states a header carries, and the transfer stream (a header, then messages of up to
``PAGES_PER_MESSAGE`` pages each)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from swaserve.transfer.kv_transfer import (
    DTYPES,
    KVPage,
    KVPayload,
    TransferError,
    expected_pages,
    to_pages,
)
from swaserve.v1 import kv_transfer_pb2 as kvpb


def page_to_proto(pg: KVPage) -> kvpb.KVPage:
    return kvpb.KVPage(
        request_id=pg.request_id, kind=pg.kind, layer=pg.layer, token_start=pg.token_start,
        token_end=pg.token_end, page_size=pg.page_size, dtype=pg.dtype, k_shape=list(pg.k_shape),
        v_shape=list(pg.v_shape), k=pg.k, v=pg.v, checksum=pg.checksum,
    )  # fmt: skip


def page_from_proto(m: kvpb.KVPage) -> KVPage:
    return KVPage(
        m.request_id, m.kind, m.layer, m.token_start, m.token_end, m.page_size, m.dtype,
        tuple(m.k_shape), tuple(m.v_shape), m.k, m.v, m.checksum,
    )  # fmt: skip


PAGES_PER_MESSAGE = 16  # ~1.3 MB messages for MiMo-V2.5-Pro pages: per-message cost amortized


def hidden_fields(h: torch.Tensor | None) -> dict[str, Any]:
    """``TransferHeader``'s MTP hidden-state fields of ``h`` [m, hidden] (none for None)."""
    if h is None:
        return {}
    h = h.detach().contiguous().cpu()
    return {
        "mtp_hidden": h.view(torch.uint8).numpy().tobytes(),
        "mtp_hidden_shape": list(h.shape),
        "mtp_hidden_dtype": str(h.dtype).removeprefix("torch."),
    }


def hidden_from_header(header: kvpb.TransferHeader) -> torch.Tensor | None:
    """The MTP hidden states a header carries (None: none).

    Raises:
        TransferError: a dtype or size that does not match its shape."""
    if not header.mtp_hidden:
        return None
    dtype = DTYPES.get(header.mtp_hidden_dtype)
    shape = tuple(header.mtp_hidden_shape)
    if dtype is None or len(shape) != 2:
        raise TransferError(f"bad MTP hidden states: dtype {header.mtp_hidden_dtype!r}, shape {shape}")
    if len(header.mtp_hidden) != shape[0] * shape[1] * dtype.itemsize:
        raise TransferError(f"MTP hidden states of {len(header.mtp_hidden)} bytes for shape {shape}")
    return torch.frombuffer(bytearray(header.mtp_hidden), dtype=dtype).view(shape)


def transfer_messages(
    payload: KVPayload, page_size: int, layers: dict[str, int], pages_per_message: int = PAGES_PER_MESSAGE
) -> Iterator[kvpb.TransferMessage]:
    """The KVTransfer.Push stream of one payload: header (with the message count), then its pages."""
    num_pages = expected_pages(payload.num_tokens, payload.window, page_size, layers, pages_per_message)
    yield kvpb.TransferMessage(
        header=kvpb.TransferHeader(
            request_id=payload.request_id,
            num_tokens=payload.num_tokens,
            num_pages=num_pages,
            sampler_state=payload.sampler_state,
            spec_drafts=payload.spec_drafts,
            **hidden_fields(payload.mtp_hidden),
        )
    )
    for pg in to_pages(payload, page_size, pages_per_message):
        yield kvpb.TransferMessage(page=page_to_proto(pg))

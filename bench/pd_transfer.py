"""Prefill -> decode KV transfer: bytes per request vs a full-KV transfer, and loopback throughput.

Bytes (no model): full layers' K/V of all ``n`` prompt tokens + SWA layers' of the last ``min(n, W)``
in page messages with real protobuf headers, vs every layer for every token (MiMo-V2-Flash and
V2.5-Pro, bf16, page 16). Throughput: a real KVTransfer gRPC server into ``KVStaging`` on 127.0.0.1.

Design notes: docs/DESIGN.md#benchpd_transferpy"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.kv_capacity import SHAPES, model_config
from swaserve.config import FULL, SWA, ModelConfig
from swaserve.traces import DEFAULT_MOONCAKE_TRACE, read_mooncake

PAGE = 16
DTYPE_BYTES = 2
FIXED_LENGTHS = (1024, 4096, 16384, 65536, 131072)


def _header_bytes() -> tuple[int, int]:
    """(bytes of one page message without K/V, bytes of the transfer header message)."""
    from swaserve.v1 import kv_transfer_pb2 as kvpb

    page = kvpb.TransferMessage(
        page=kvpb.KVPage(
            request_id="cmpl-" + "0" * 32, kind="full", layer=59, token_start=131056, token_end=131072,
            page_size=PAGE, dtype="bfloat16", k_shape=[16, 8, 192], v_shape=[16, 8, 128],
            k=b"", v=b"", checksum=0xFFFFFFFF,
        )
    )  # fmt: skip
    head = kvpb.TransferMessage(
        header=kvpb.TransferHeader(request_id="cmpl-" + "0" * 32, num_tokens=131072, num_pages=99999)
    )
    # + the K/V fields' tag and length varints (2 x (1 + up to 4 bytes))
    return page.ByteSize() + 10, head.ByteSize()


def transfer_bytes(cfg: ModelConfig, n: int) -> dict[str, int]:
    """Bytes on the wire for one ``n``-token prompt: hybrid (full layers all tokens + SWA layers the
    last W) and the SWA-unaware baseline (every layer all tokens), headers included."""
    page_hdr, head = _header_bytes()
    per_tok = {
        FULL: cfg.full.num_kv_heads * (cfg.full.head_dim + cfg.full.v_head_dim) * DTYPE_BYTES,
        SWA: cfg.swa.num_kv_heads * (cfg.swa.head_dim + cfg.swa.v_head_dim) * DTYPE_BYTES,
    }
    layers = {FULL: len(cfg.full_layers), SWA: len(cfg.swa_layers)}

    def pages(lo: int, hi: int) -> int:
        return 0 if hi <= lo else (hi - 1) // PAGE - lo // PAGE + 1

    swa_n = min(n, cfg.window)
    hybrid = head + layers[FULL] * (n * per_tok[FULL] + pages(0, n) * page_hdr)
    hybrid += layers[SWA] * (swa_n * per_tok[SWA] + pages(n - swa_n, n) * page_hdr)
    full = head + sum(layers[k] * (n * per_tok[k] + pages(0, n) * page_hdr) for k in (FULL, SWA))
    return {"hybrid_bytes": hybrid, "full_bytes": full}


def trace_lengths() -> dict[str, int]:
    lens = sorted(r.input_length for r in read_mooncake(DEFAULT_MOONCAKE_TRACE, None))
    q = statistics.quantiles(lens, n=100)
    return {"trace_p10": int(q[9]), "trace_p50": int(q[49]), "trace_p90": int(q[89]), "trace_p99": int(q[98])}


def bytes_table() -> list[dict[str, Any]]:
    rows = []
    lengths = {**trace_lengths(), **{str(n): n for n in FIXED_LENGTHS}}
    for shape in SHAPES:
        cfg = model_config(shape)
        for label, n in lengths.items():
            b = transfer_bytes(cfg, n)
            rows.append(
                {
                    "shape": shape.name, "length": label, "tokens": n, **b,
                    "transfer_ratio": round(b["hybrid_bytes"] / b["full_bytes"], 4),
                }
            )  # fmt: skip
    return rows


async def _loopback(lengths: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    import grpc

    from services.kv_convert import PAGES_PER_MESSAGE
    from services.kv_receiver import KVTransferService
    from services.transport import GrpcKVSender
    from services.worker_metrics import WorkerMetrics
    from swaserve.model.checkpoint import tokenizer_dir
    from swaserve.transfer.kv_transfer import KVPayload, KVStaging, LayerShape, expected_pages
    from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc

    cfg = ModelConfig.from_pretrained(tokenizer_dir("default"))
    layers = {FULL: len(cfg.full_layers), SWA: len(cfg.swa_layers)}
    shapes = {
        FULL: LayerShape(cfg.full.num_kv_heads, cfg.full.head_dim, cfg.full.v_head_dim),
        SWA: LayerShape(cfg.swa.num_kv_heads, cfg.swa.head_dim, cfg.swa.v_head_dim),
    }
    staging = KVStaging(layers, shapes, cfg.window, PAGE, torch.float32, 1 << 34)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    kvgrpc.add_KVTransferServicer_to_server(KVTransferService(staging, WorkerMetrics(), {}), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rows = []
    try:
        sender = GrpcKVSender(PAGE, layers)  # as a prefill worker sends
        try:
            for n in lengths:
                payload = KVPayload("bench", n, cfg.window)
                for kind, s in shapes.items():
                    lo, hi = payload.token_range(kind)
                    payload.kv[kind] = [
                        (
                            torch.randn(hi - lo, s.kv_heads, s.head_dim),
                            torch.randn(hi - lo, s.kv_heads, s.v_head_dim),
                        )
                        for _ in range(layers[kind])
                    ]
                n_msgs = expected_pages(n, cfg.window, PAGE, layers, PAGES_PER_MESSAGE)
                times = []
                for i in range(repeats):
                    payload.request_id = f"bench-{n}-{i}"
                    t0 = time.perf_counter()
                    sent = await sender.send(f"127.0.0.1:{port}", payload)
                    times.append(time.perf_counter() - t0)
                    assert sent == payload.nbytes()
                    staging.claim(payload.request_id)
                best = min(times)
                rows.append(
                    {
                        "tokens": n, "payload_bytes": payload.nbytes(), "messages": n_msgs,
                        "seconds_best": round(best, 4), "seconds_median": round(statistics.median(times), 4),
                        "mb_per_s": round(payload.nbytes() / best / 1e6, 1),
                    }
                )  # fmt: skip
        finally:
            await sender.close()
    finally:
        await server.stop(None)
    return rows


def main(
    json_path: Path | None = None, lengths: tuple[int, ...] = (512, 2048, 8192), repeats: int = 3
) -> dict:
    table = bytes_table()
    print("KV bytes per request, hybrid (full layers all tokens + SWA last W) vs full KV (bf16, page 16)")
    print(f"{'shape':<16}{'length':>10}{'tokens':>9}{'hybrid MB':>11}{'full MB':>10}{'ratio':>8}")
    for r in table:
        print(
            f"{r['shape']:<16}{r['length']:>10}{r['tokens']:>9}{r['hybrid_bytes'] / 1e6:>11.1f}"
            f"{r['full_bytes'] / 1e6:>10.1f}{r['transfer_ratio']:>8.3f}"
        )
    loop = asyncio.run(_loopback(lengths, repeats))
    print("\nLoopback KVTransfer (gRPC, default model shape, fp32, checksums verified)")
    print(f"{'tokens':>8}{'payload MB':>12}{'messages':>10}{'best s':>9}{'MB/s':>9}")
    for r in loop:
        print(
            f"{r['tokens']:>8}{r['payload_bytes'] / 1e6:>12.2f}{r['messages']:>10}{r['seconds_best']:>9.3f}{r['mb_per_s']:>9.1f}"
        )
    out = {
        "bytes": table,
        "loopback": loop,
        "transfer_ratio": {f"{r['shape']}:{r['length']}": r["transfer_ratio"] for r in table},
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2) + "\n")
    return out

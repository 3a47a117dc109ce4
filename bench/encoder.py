"""``swaserve bench encoder``: the multimodal encoder service (services/encoder) in one run (issue 18).

Part 1, throughput and latency. The real encoder (``python -m services.encoder`` on 127.0.0.1,
``--num-threads 1``) twice, one after the other:
- baseline: ``--max-batch-items 1 --cache-bytes 1`` (0 is refused; 1 byte holds no embedding, so
  nothing is ever cached), one item per forward. Its items carry a key of their own per request
  (the content key hashed with the request's index), so the service cannot join a request to an
  identical one in flight either: every request is encoded (``--baseline-keys content`` keeps the
  router's keys, and with them the in-flight dedupe, which no flag turns off);
- optimized: the service's defaults (batches of up to 16 items / 16384 rows, 5 ms wait window,
  1 GiB embedding cache, in-flight dedupe), the router's content keys.
Each gets the same requests, built the way the router builds them (``MediaFront.expand``: the
content key, the token count from the header size): one image per request, ``--repeat-share``
(half) of the requests drawn Zipf-like (s = 1) from ``POPULAR`` popular images, the others unique
images; sizes from 160x120 to 1280x960 with some aspect jitter, 3/4 JPEG (quality 85) and 1/4 PNG
(smooth pictures with mild noise). A request is Submit then Fetch through one ``EncoderClient``
(as the router, then a prefill worker, do); its latency runs from the Submit to the embeddings
fetched. Without a cache the encoder keeps no result past the Fetches already waiting for it, so
a Fetch that arrives after its item finished gets NOT_FOUND; the bench then submits again, as the
router does (``resubmits``; the request's latency includes both encodes).
- closed loop: ``--concurrency`` clients, each sending its next request when its last one is
  back, over ``--requests`` requests: items/s (requests done / wall time) and p50/p90 latency at
  saturation;
- open loop: ``--open-requests`` other requests (fresh unique and popular images) arriving as a
  Poisson process at ``--open-load`` x the baseline's closed-loop items/s (measured first, in the
  same run), the same arrival times for both: p50/p90 latency at equal offered load;
- optimized only, ``hits``: the closed loop's requests again, every item cached: the cost of a hit.
Every embedding fetched from the optimized encoder is compared with the baseline's for the same
content key (max abs difference, tolerance ``TOLERANCE``: a fused batch may differ from an item
encoded alone by float rounding), and the baseline's repeats with its first output. The encoder's
metrics (scraped from ``--metrics-port`` after each phase) give the items encoded and those served
without a forward, the forwards and their mean size; /proc gives the encoder's and this process's
CPU seconds per phase. The encoder and the client (this process) run on two different CPUs
(``taskset``) where there are two. Then, in this process on one torch thread and without gRPC,
where an encoded item's time goes: decode + preprocessing, ``MediaEncoder.encode`` one item per
call, and in calls of 16 (``profile``).

Part 2, chunked video decode. A video made in memory with PyAV (default 180 s, 320x240, 24 fps,
H.264 ``veryfast``, a keyframe every 10 s, moving content), sampled at 2 fps as the MiMo
processor samples (``media.video.sample_times``, frame cap lifted: 360 frames), decoded by
``media.video.decode_frames`` with 1, 2 and 4 threads (best of ``--video-repeats``); each output
compared with the 1-thread one (exactly equal). Speedup = 1-thread time / N-thread time, next to
the usable CPUs (``os.sched_getaffinity``).

Targets (issue 18): optimized / baseline closed-loop items/s >= 2; p50 latency not worse at equal
offered load (open loop, optimized / baseline <= 1); video decode scales with threads up to the
cores: N threads at least 0.7 x min(N, CPUs) as fast as 1. The bench reports PASS / MISS; it does
not fail on a miss.

    swaserve bench encoder [--json PATH] [--model DIR] [--requests 600] [--concurrency 16] [--quick]"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.encoder_proc import CpuClock, counter_delta, encoder_process, scrape
from bench.encoder_video import VIDEO_EFFICIENCY, print_video, run_video_part
from bench.encoder_workload import (
    JPEG_SHARE,
    POPULAR,
    SIZES,
    ZIPF_S,
    Request,
    Router,
    poisson_arrivals,
    random_image,
    unique_key,
    workload,
)
from bench.targets import target
from swaserve.encoder.items import EncodeItem

TOLERANCE = 1e-5  # max abs difference allowed between an optimized and a baseline embedding
BASELINE_FLAGS = ("--max-batch-items", "1", "--cache-bytes", "1")
WARMUP_ITEMS = 4
PROFILE_BATCH = 16  # the in-process breakdown: 2 batches of this many distinct items
ATTEMPTS = 10  # Submit + Fetch tries of one request (a Fetch may find the item done and gone)


@dataclass(frozen=True)
class Settings:
    """One run's sizes (``quick``: the test's tiny run)."""

    requests: int = 600
    open_requests: int = 400
    concurrency: int = 16
    repeat_share: float = 0.5
    open_load: float = 0.6
    baseline_keys: str = "unique"
    video_seconds: float = 180.0
    video_size: tuple[int, int] = (320, 240)
    video_fps: int = 24
    video_repeats: int = 3
    seed: int = 0

    @staticmethod
    def quick() -> Settings:
        return Settings(
            requests=24, open_requests=12, concurrency=4, video_seconds=8.0, video_size=(160, 120),
            video_fps=12, video_repeats=1,
        )  # fmt: skip


# -- driving it ----------------------------------------------------------------------------------
@dataclass
class Check:
    """Embeddings fetched, compared with a reference per content key."""

    reference: dict[bytes, torch.Tensor]
    record: bool  # the baseline: a key's first output becomes its reference
    compared: int = 0
    exact: int = 0
    over_tolerance: int = 0
    max_abs_diff: float = 0.0
    recorded: int = 0
    bad_shape: int = 0

    def add(self, key: bytes, out: torch.Tensor, num_tokens: int) -> None:
        if out.dim() != 2 or out.shape[0] != num_tokens:
            self.bad_shape += 1
            return
        ref = self.reference.get(key)
        if ref is None:
            if self.record:
                self.reference[key] = out
                self.recorded += 1
            else:
                self.bad_shape += 1  # nothing to compare with: counted as a failure
            return
        self.compared += 1
        if ref.shape != out.shape or ref.dtype != out.dtype:
            self.bad_shape += 1
            return
        diff = float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0
        self.max_abs_diff = max(self.max_abs_diff, diff)
        self.exact += int(diff == 0.0)
        self.over_tolerance += int(diff > TOLERANCE)

    def summary(self) -> dict[str, Any]:
        return {
            "recorded": self.recorded, "compared": self.compared, "exact": self.exact,
            "over_tolerance": self.over_tolerance, "bad": self.bad_shape,
            "max_abs_diff": self.max_abs_diff, "tolerance": TOLERANCE,
        }  # fmt: skip


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    resubmits: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


async def _one(client: Any, fp: str, req: Request, item: EncodeItem, check: Check, phase: Phase) -> None:
    import grpc

    t0 = time.perf_counter()
    try:
        for attempt in range(ATTEMPTS):
            await client.submit([item], fp)
            try:
                out = await client.fetch(item.key, timeout_s=120)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND or attempt == ATTEMPTS - 1:
                    raise
                phase.resubmits += 1  # done and gone between the Submit and the Fetch: again
        phase.latencies.append(time.perf_counter() - t0)
        check.add(req.item.key, out, item.num_tokens)
    except Exception as e:  # counted and reported, the run goes on
        phase.errors.append(f"request {req.index}: {type(e).__name__}: {e}"[:300])


async def closed_loop(
    client: Any, fp: str, reqs: list[Request], items: list[EncodeItem], concurrency: int, check: Check
) -> Phase:
    phase = Phase()
    todo = iter(range(len(reqs)))

    async def worker() -> None:
        for i in todo:
            await _one(client, fp, reqs[i], items[i], check, phase)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.wall_s = time.perf_counter() - t0
    return phase


async def open_loop(
    client: Any, fp: str, reqs: list[Request], items: list[EncodeItem], check: Check
) -> Phase:
    phase = Phase()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks = []
    for r, it in zip(reqs, items, strict=True):
        delay = t0 + r.arrival_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(client, fp, r, it, check, phase)))
    await asyncio.gather(*tasks)
    phase.wall_s = loop.time() - t0
    return phase


def _lat(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50_ms": None, "p90_ms": None, "mean_ms": None}
    a = np.asarray(xs) * 1e3
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 2),
        "p90_ms": round(float(np.percentile(a, 90)), 2),
        "mean_ms": round(float(a.mean()), 2),
    }


def _phase_row(phase: Phase, n: int, metrics: dict[str, Any], cpu: dict[str, float | None]) -> dict[str, Any]:
    done = len(phase.latencies)
    return {
        "requests": n, "done": done, "errors": len(phase.errors), "error_samples": phase.errors[:5],
        "resubmits": phase.resubmits, "wall_s": round(phase.wall_s, 3),
        "items_per_s": round(done / phase.wall_s, 2) if phase.wall_s > 0 else 0.0,
        **_lat(phase.latencies), "encoder": metrics, **cpu,
    }  # fmt: skip


async def run_config(
    name: str,
    addr: str,
    metrics_url: str,
    pid: int,
    fp: str,
    closed: list[Request],
    open_reqs: list[Request],
    warm: list[Request],
    s: Settings,
    check: Check,
    rate: float | None = None,
) -> dict[str, Any]:
    """Warm-up, the closed loop, then the open loop, against the encoder at ``addr``. ``rate``:
    the open loop's arrivals per second (None: ``open_load`` x this closed loop's items/s, and
    ``open_reqs``' arrival times are drawn here; else they are kept)."""
    from services.encoder.client import EncoderClient

    unique = name == "baseline" and s.baseline_keys == "unique"

    def items(reqs: list[Request]) -> list[EncodeItem]:
        return [unique_key(r.item, r.index) if unique else r.item for r in reqs]

    client = EncoderClient(addr, timeout_s=60.0)
    try:
        await closed_loop(client, fp, warm, [r.item for r in warm], 2, Check({}, record=False))
        m0 = await asyncio.to_thread(scrape, metrics_url)
        clock = CpuClock(pid)
        ph = await closed_loop(client, fp, closed, items(closed), s.concurrency, check)
        cpu = clock.lap(ph.wall_s)
        m1 = await asyncio.to_thread(scrape, metrics_url)
        out: dict[str, Any] = {"closed": _phase_row(ph, len(closed), counter_delta(m1, m0), cpu)}
        if rate is None:
            rate = max(0.1, round(s.open_load * out["closed"]["items_per_s"], 2))
            poisson_arrivals(open_reqs, rate, s.seed + 7)
        clock = CpuClock(pid)
        ph = await open_loop(client, fp, open_reqs, items(open_reqs), check)
        cpu = clock.lap(ph.wall_s)
        m2 = await asyncio.to_thread(scrape, metrics_url)
        out["open"] = {
            **_phase_row(ph, len(open_reqs), counter_delta(m2, m1), cpu),
            "offered_items_per_s": rate,
        }
        if name == "optimized":  # the closed loop's requests again: every item cached now
            clock = CpuClock(pid)
            ph = await closed_loop(client, fp, closed, items(closed), s.concurrency, check)
            cpu = clock.lap(ph.wall_s)
            m3 = await asyncio.to_thread(scrape, metrics_url)
            out["hits"] = _phase_row(ph, len(closed), counter_delta(m3, m2), cpu)
        return out
    finally:
        await client.close()


def run_service_part(model_dir: Path, s: Settings, cpus: tuple[int, int] | None) -> dict[str, Any]:
    """Part 1: the baseline encoder, then the optimized one, on the same requests."""
    from services.encoder.cli import model_fingerprint

    t0 = time.perf_counter()
    router = Router(model_dir)
    fp = model_fingerprint(model_dir)
    closed = workload(router, s.requests, s.repeat_share, s.seed * 10 + 1)
    open_reqs = workload(router, s.open_requests, s.repeat_share, s.seed * 10 + 2)
    warm = [Request(router.item(random_image(np.random.default_rng(9), 9_999_000 + i)), False, -1 - i)
            for i in range(WARMUP_ITEMS)]  # fmt: skip
    prep_s = time.perf_counter() - t0
    reference: dict[bytes, torch.Tensor] = {}
    base_check, opt_check = Check(reference, record=True), Check(reference, record=False)
    mine = os.sched_getaffinity(0) if cpus else None
    res: dict[str, Any] = {}
    try:
        if cpus:
            os.sched_setaffinity(0, {cpus[1]})
        with encoder_process("baseline", model_dir, BASELINE_FLAGS, cpus[0] if cpus else None) as (
            addr,
            mu,
            pid,
        ):
            base = asyncio.run(
                run_config("baseline", addr, mu, pid, fp, closed, open_reqs, warm, s, base_check)
            )
        res["baseline"] = base
        rate = base["open"]["offered_items_per_s"]
        with encoder_process("optimized", model_dir, (), cpus[0] if cpus else None) as (addr, mu, pid):
            res["optimized"] = asyncio.run(
                run_config("optimized", addr, mu, pid, fp, closed, open_reqs, warm, s, opt_check, rate)
            )
    finally:
        if mine:
            os.sched_setaffinity(0, mine)
    by_kind = sorted(closed, key=lambda r: r.popular)  # unique images first, popular ones if too few
    sample = list({r.item.key: r.item for r in by_kind}.values())[: 2 * PROFILE_BATCH]
    res["profile"] = profile_items(model_dir, sample, PROFILE_BATCH)
    res["baseline_self_check"] = base_check.summary()
    res["outputs_check"] = opt_check.summary()
    res["workload"] = {
        "closed_requests": len(closed), "open_requests": len(open_reqs),
        "closed_popular_requests": sum(r.popular for r in closed),
        "open_popular_requests": sum(r.popular for r in open_reqs),
        "closed_distinct_items": len({r.item.key for r in closed}),
        "open_distinct_items": len({r.item.key for r in open_reqs}),
        "tokens_per_item_mean": round(float(np.mean([r.item.num_tokens for r in closed + open_reqs])), 1),
        "bytes_per_item_mean": round(float(np.mean([len(r.item.data) for r in closed + open_reqs]))),
        "prep_s": round(prep_s, 1),
    }  # fmt: skip
    return res


def profile_items(model_dir: Path, items: Sequence[EncodeItem], batch: int = 16) -> dict[str, Any]:
    """Where an encoded item's time goes, in this process on one torch thread (no gRPC): decode
    and preprocessing alone (``preprocess_images``: per item even in a fused batch), the whole
    ``MediaEncoder.encode`` one item per call, and in calls of ``batch`` items; ms per item."""
    from swaserve.encoder.runner import MediaEncoder
    from swaserve.media.pixels import decode_image, preprocess_images

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        enc = MediaEncoder(model_dir)
        assert enc.config.image is not None
        enc.encode(list(items[:2]))  # warm-up
        n = len(items)
        t = time.perf_counter()
        for it in items:
            img = decode_image(it.data, enc.limits.max_source_pixels)
            preprocess_images([img], enc.config.image, enc.device)
        prep = time.perf_counter() - t
        t = time.perf_counter()
        for it in items:
            enc.encode([it])
        alone = time.perf_counter() - t
        t = time.perf_counter()
        for k in range(0, n, batch):
            enc.encode(list(items[k : k + batch]))
        fused = time.perf_counter() - t
    finally:
        torch.set_num_threads(threads)
    return {
        "items": n, "batch": batch, "torch_threads": 1,
        "decode_preprocess_ms": round(prep / n * 1e3, 3), "encode_alone_ms": round(alone / n * 1e3, 3),
        "encode_batched_ms": round(fused / n * 1e3, 3),
        "batched_over_alone": round(fused / alone, 4) if alone > 0 else None,
    }  # fmt: skip


# -- report --------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def ratios(svc: dict[str, Any]) -> dict[str, float | None]:
    b, o = svc["baseline"], svc["optimized"]
    return {
        "closed_items_per_s": _ratio(o["closed"]["items_per_s"], b["closed"]["items_per_s"]),
        "closed_p50": _ratio(o["closed"]["p50_ms"], b["closed"]["p50_ms"]),
        "closed_p90": _ratio(o["closed"]["p90_ms"], b["closed"]["p90_ms"]),
        "open_p50": _ratio(o["open"]["p50_ms"], b["open"]["p50_ms"]),
        "open_p90": _ratio(o["open"]["p90_ms"], b["open"]["p90_ms"]),
    }


def targets(svc: dict[str, Any], video: dict[str, Any]) -> list[dict[str, Any]]:
    r = ratios(svc)
    out = [
        target("throughput_optimized_over_baseline", r["closed_items_per_s"], ">=", 2.0,
                "closed loop, items/s"),
        target("p50_optimized_over_baseline", r["open_p50"], "<=", 1.0,
                "open loop at equal offered load"),
    ]  # fmt: skip
    for row in video["rows"][1:]:
        k = row["cores_usable"]
        out.append(target(f"video_decode_speedup_{row['threads']}_threads", row["speedup"], ">=",
                           round(VIDEO_EFFICIENCY * k, 3), f"{k} of {video['cpus']} CPUs usable"))  # fmt: skip
    return out


def print_service(svc: dict[str, Any], s: Settings) -> None:
    w = svc["workload"]
    print(f"Encoder service, {w['closed_requests']} + {w['open_requests']} image requests "
          f"({w['closed_popular_requests']} + {w['open_popular_requests']} from {POPULAR} popular images per "
          f"phase, Zipf s={ZIPF_S:g}; the rest unique), {w['tokens_per_item_mean']} tokens and "
          f"{w['bytes_per_item_mean'] / 1024:.0f} KiB per item on average")  # fmt: skip
    print(
        f"closed loop: {s.concurrency} clients; open loop: Poisson at "
        f"{svc['optimized']['open']['offered_items_per_s']} items/s ({s.open_load:g} x baseline items/s)"
    )
    print(f"{'encoder':<10}{'phase':<8}{'items/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'encoded':>9}{'no fwd':>8}"
          f"{'forwards':>9}{'mean batch':>11}{'enc CPU':>8}{'resub':>6}{'err':>5}")  # fmt: skip
    for name, ph in (("baseline", "closed"), ("baseline", "open"), ("optimized", "closed"),
                     ("optimized", "open"), ("optimized", "hits")):  # fmt: skip
        if ph in svc[name]:
            r = svc[name][ph]
            e = r["encoder"]
            mb = "-" if e["mean_batch_items"] is None else f"{e['mean_batch_items']:.2f}"
            share = "-" if r["encoder_cpu_share"] is None else f"{r['encoder_cpu_share']:.0%}"
            print(f"{name:<10}{ph:<8}{r['items_per_s']:>9.1f}{r['p50_ms']:>9.1f}{r['p90_ms']:>9.1f}"
                  f"{e.get('items_encoded', 0):>9}{e.get('items_cached', 0):>8}{e.get('forwards', 0):>9}"
                  f"{mb:>11}{share:>8}{r['resubmits']:>6}{r['errors']:>5}")  # fmt: skip
    r = ratios(svc)
    print(
        f"optimized / baseline: items/s {r['closed_items_per_s']}, closed p50 {r['closed_p50']} "
        f"p90 {r['closed_p90']}, open p50 {r['open_p50']} p90 {r['open_p90']}"
    )
    c, b = svc["outputs_check"], svc["baseline_self_check"]
    print(f"outputs: {c['compared']} optimized embeddings compared with the baseline's, {c['exact']} exact, "
          f"max abs diff {c['max_abs_diff']:.3g} (tolerance {TOLERANCE:g}), {c['over_tolerance']} over, "
          f"{c['bad']} bad; baseline repeats: {b['compared']}, max abs diff {b['max_abs_diff']:.3g}")  # fmt: skip
    p = svc["profile"]
    print(f"in process, 1 torch thread, {p['items']} distinct items: decode + preprocess {p['decode_preprocess_ms']:.2f} "
          f"ms/item, encode alone {p['encode_alone_ms']:.2f} ms/item, in calls of {p['batch']} "
          f"{p['encode_batched_ms']:.2f} ms/item ({p['batched_over_alone']:.3f}x)")  # fmt: skip
    for name, ph in (("baseline", "closed"), ("optimized", "hits")):
        r = svc[name].get(ph)
        if r is not None and r["encoder_cpu_s"] is not None and r["done"]:
            print(f"encoder CPU per request, {name} {ph}: {r['encoder_cpu_s'] / r['done'] * 1e3:.2f} ms")


def print_targets(ts: list[dict[str, Any]]) -> None:
    print("\nTargets (issue 18)")
    for t in ts:
        v = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        note = f"  ({t['note']})" if t["note"] else ""
        print(f"  {t['name']:<38}{v:>10} {t['op']} {t['threshold']:<6}{t['status']:>6}{note}")


def main(
    json_path: Path | None = None, model: Path | None = None, s: Settings | None = None
) -> dict[str, Any]:
    """Run both parts, print the tables and targets, write ``json_path``; returns the result."""
    from bench.ucx_perftest import pin_cpus
    from swaserve.model.checkpoint import default_model_dir

    s = s or Settings()
    t0 = time.perf_counter()
    model_dir = Path(model) if model is not None else Path(default_model_dir())
    cpus = pin_cpus()
    svc = run_service_part(model_dir, s, cpus)
    print_service(svc, s)
    video = run_video_part(s.video_seconds, s.video_size, s.video_fps, s.video_repeats)
    print_video(video)
    ts = targets(svc, video)
    print_targets(ts)
    wall = time.perf_counter() - t0
    print(f"\nwall: {wall:.1f} s")
    result = {
        "config": {
            "model": str(model_dir), "requests": s.requests, "open_requests": s.open_requests,
            "concurrency": s.concurrency, "repeat_share": s.repeat_share, "popular_images": POPULAR,
            "zipf_s": ZIPF_S, "open_load": s.open_load, "baseline_keys": s.baseline_keys,
            "baseline_flags": list(BASELINE_FLAGS), "optimized_flags": "defaults",
            "image_sizes": [list(x) for x in SIZES], "jpeg_share": JPEG_SHARE, "seed": s.seed,
            "cpus": {"encoder": cpus[0], "client": cpus[1]} if cpus else None, "encoder_torch_threads": 1,
            "units": {"latency": "ms, Submit to embeddings fetched", "items_per_s": "requests done / wall s"},
        },
        "service": svc, "ratios": ratios(svc), "video_decode": video, "targets": ts, "wall_s": round(wall, 1),
    }  # fmt: skip
    if json_path is not None:
        from swaserve.sim.run import write_json

        write_json(Path(json_path), result)
    return result

"""``swaserve bench gcache``: GCache, the distributed L3 KV page cache (services/gcache), in one run
(issue 17).

Part 1, transports. A GCache node as a separate process (``python -m services.gcache`` on
127.0.0.1, its UCX data plane on), twice: the DRAM tier (``--dram 2GiB``) and the NVMe tier
(``--dram 32KiB``: no object's size class fits in DRAM, so every page goes to the slot files under
``--nvme-dir``, a temporary directory, with O_DIRECT where the filesystem takes it; the node's
Info after the puts and after the gets says which tier held the pages). A client in this process
(``GCacheClient``) per transport, UCX and gRPC, and per object size (header + payload exactly that
many bytes): puts N objects of one chain one per call, gets them back one per call, then in
batches of B per call, then N lookups of one page. Calls go back to back, one in flight. Every
object read back is compared with the one written (``mismatches``, and digests of all the bytes
put and all the bytes got), outside the timed call, then dropped, as the engine drops a page
object once verified and copied into host pages (its receive buffer goes back to the client's
pool, services/gcache/recv_pool.py). N per size: ``--iters`` at most, ``--cell-bytes`` of
objects at most, at least 4. Baseline: ``ucx_perftest`` (the libucx wheel's, ``tag_bw`` over
``tcp,self``, bench/ucx_perftest.py) between two processes on the same machine, same sizes, with
UCX's own defaults and with the node's UCX settings (``baseline_settings``), each before and
after the cells (it busy-polls both sides: on a shared 2-core machine it varies), the best run per size
kept. Server and client run on two different CPUs (``taskset``; the node and the perftest server
on one, this process and the perftest client on the other), as on two machines.

Part 2, returning sessions: bench/gcache_sessions.py (the simulator, without L3, with L3, ideal).

Units: MiB/s = 2^20 bytes per second (ucx_perftest's MB/s are the same unit): puts over the
loop's wall time, gets over the calls' summed time; latencies in milliseconds per call
(``time.perf_counter``), p50 / p99 over the calls; hit rates are cached / prompt tokens; TTFT in
simulated seconds. The bench reports the issue's targets (PASS / MISS); it does not fail on a
miss.

    swaserve bench gcache [--json PATH] [--sizes 64KiB,1MiB,4MiB] [--iters 200] [--limit N]"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import gcache_sessions as sessions
from bench.targets import target
from swaserve.gcache import codec
from swaserve.gcache.keys import Salt, page_keys
from swaserve.gcache.l3 import Found, PutPage

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = (64 << 10, 1 << 20, 4 << 20)
TIERS = ("dram", "nvme")
TRANSPORTS = ("ucx", "grpc")
PAGE = 16  # tokens per page object (its header carries them)
SALT = Salt("bench-gcache", "random", "uint8", PAGE).seed()
DRAM_BYTES = 2 << 30
TINY_DRAM = 32 << 10  # below every size class here: the NVMe node's pages all go to NVMe
NVME_BYTES = 2 << 30
MIN_OBJECTS = 4
MAX_OBJECT_BYTES = 64 << 20  # the node's default --max-object-bytes
BATCH_CALLS = 4  # a batched get takes at most N / this objects per call, so it makes several calls


def make_pages(size: int, n: int, seed: int) -> list[PutPage]:
    """``n`` page objects of one chain, each exactly ``size`` bytes (header + random payload).
    Raises ValueError when ``size`` does not exceed the header."""
    hs = codec.header_size(PAGE)
    if size <= hs:
        raise ValueError(f"an object of {size} B does not exceed its {hs} B header")
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(3, 50_000, n * PAGE)]
    out, parent = [], SALT
    for i, key in enumerate(page_keys(toks, PAGE, SALT)):
        obj = codec.encode(
            codec.FULL_KIND, i, SALT, key, parent, toks[i * PAGE : (i + 1) * PAGE], rng.bytes(size - hs)
        )
        out.append(PutPage((key, codec.FULL_KIND), parent, i, obj))
        parent = key
    return out


def objects_for(size: int, iters: int, cell_bytes: int) -> int:
    """Objects (and single gets) of one cell: ``iters`` at most, ``cell_bytes`` at most, 4 at least."""
    return max(MIN_OBJECTS, min(iters, cell_bytes // size))


def _ms(xs: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of ``xs`` seconds, in milliseconds."""
    a = np.asarray(xs) * 1e3
    return round(float(np.percentile(a, 50)), 4), round(float(np.percentile(a, 99)), 4)


def _mib_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / (1 << 20) / seconds, 1) if seconds > 0 else 0.0


@contextlib.contextmanager
def node_process(tier: str, workdir: Path, ucx: bool = True, cpu: int | None = None) -> Iterator[str]:
    """A node with the ``tier`` layout as a child process (on CPU ``cpu`` when given); yields its
    gRPC address."""
    from bench.ucx_perftest import pinned
    from swaserve.procs import ServiceProcess, free_port, grpc_ready

    port = free_port()
    addr = f"127.0.0.1:{port}"
    cmd = [*pinned(cpu), sys.executable, "-m", "services.gcache", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--ucx-port", "0" if ucx else "-1"]
    if tier == "dram":
        cmd += ["--dram", str(DRAM_BYTES)]
    else:
        cmd += ["--dram", str(TINY_DRAM), "--nvme-dir", str(workdir / "nvme"), "--nvme", str(NVME_BYTES)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = ServiceProcess(f"gcache-{tier}", cmd, grpc_ready(addr), env={"PYTHONPATH": path})
    proc.start()
    try:
        proc.wait_ready(60)
        yield addr
    finally:
        proc.stop(grace_s=5.0)


async def _held(client: Any) -> tuple[dict[str, int], bool]:
    info = await client.info()
    return {t.tier: int(t.pages) for t in info.tiers}, bool(info.direct_io)


async def run_cell(
    client: Any, tier: str, transport: str, size: int, n: int, batch: int, seed: int
) -> dict[str, Any]:
    """One (tier, transport, size) cell on a fresh chain of ``n`` objects; removed at the end."""
    pages = make_pages(size, n, seed)
    pids = [p.pid for p in pages]
    put_lat: list[float] = []
    stored = 0
    t0 = time.perf_counter()
    for p in pages:
        t = time.perf_counter()
        ok = await client.put([p])
        put_lat.append(time.perf_counter() - t)
        stored += int(ok[0])
    put_wall = time.perf_counter() - t0
    held, direct = await _held(client)

    # each object is compared and dropped as it arrives, as the engine verifies a page object,
    # copies it into host pages and drops it: its receive buffer goes back to the client's pool
    # (services/gcache/recv_pool.py) for the next get; the comparison is outside the timed call
    mismatches, got_bytes, bget_bytes = 0, 0, 0
    h_got = hashlib.blake2b(digest_size=16)
    get_lat: list[float] = []
    for p, pid in zip(pages, pids, strict=True):  # no lookup first (lease 0): the data call alone
        t = time.perf_counter()
        objs = await client.get(Found([True], None), [pid])
        get_lat.append(time.perf_counter() - t)
        got_bytes += len(objs[0] or b"")
        h_got.update(objs[0] or b"")
        mismatches += objs[0] != p.obj
        del objs

    b = max(1, min(batch, n // BATCH_CALLS))
    bget_lat: list[float] = []
    for j in range(0, n - n % b, b):
        t = time.perf_counter()
        objs = await client.get(Found([True] * b, None), pids[j : j + b])
        bget_lat.append(time.perf_counter() - t)
        bget_bytes += sum(len(g or b"") for g in objs)
        mismatches += sum(g != p.obj for g, p in zip(objs, pages[j : j + b], strict=True))
        del objs

    look_lat: list[float] = []
    for pid in pids:
        t = time.perf_counter()
        found = await client.lookup([pid])
        look_lat.append(time.perf_counter() - t)
        if found.lease:
            await client.release(found.lease)
    held_after, _ = await _held(client)
    await client.remove(pids[:1])  # the chain's first page: with all its descendants

    put_bytes = sum(len(p.obj) for p in pages)
    (put50, put99), (get50, get99), (b50, b99), (l50, l99) = map(_ms, (put_lat, get_lat, bget_lat, look_lat))
    return {
        "tier": tier, "transport": transport, "size_bytes": size, "objects": n, "stored": stored,
        "held_after_put": held, "held_after_get": held_after, "pages_in_tier": held.get(tier, 0),
        "direct_io": direct if tier == "nvme" else None,
        "put_mib_s": _mib_s(put_bytes, put_wall), "put_p50_ms": put50, "put_p99_ms": put99,
        "get_mib_s": _mib_s(got_bytes, sum(get_lat)), "get_p50_ms": get50, "get_p99_ms": get99,
        "batch": b, "batch_calls": len(bget_lat), "batch_get_mib_s": _mib_s(bget_bytes, sum(bget_lat)),
        "batch_get_p50_ms": b50, "batch_get_p99_ms": b99, "lookup_p50_ms": l50, "lookup_p99_ms": l99,
        "bytes_put": put_bytes, "bytes_got": got_bytes, "bytes_batch_got": bget_bytes,
        "digest_put": _digest(p.obj for p in pages), "digest_got": h_got.hexdigest(),
        "mismatches": mismatches,
    }  # fmt: skip


def _digest(objs: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for o in objs:
        h.update(o)
    return h.hexdigest()


async def warm_up(client: Any) -> None:
    """Connect the client's channels (gRPC, UCX) with one small put, get and remove, untimed."""
    pages = make_pages(4096, 2, seed=0)
    await client.put(pages)
    await client.get(await client.lookup([p.pid for p in pages]), [p.pid for p in pages])
    await client.remove([pages[0].pid])


async def run_transports(
    sizes: Sequence[int],
    iters: int,
    cell_bytes: int,
    batch: int,
    tiers: Sequence[str] = TIERS,
    cpus: tuple[int, int] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (tier, transport, size) cell, one node process per tier; ``cpus``: (the node's CPU,
    this process's: set here for the cells' duration), else unpinned. Returns (rows, notes)."""
    from services.gcache import ucx

    notes: list[str] = []
    transports = [t for t in TRANSPORTS if t != "ucx" or ucx.available()]
    if "ucx" not in transports:
        notes.append("UCX unavailable here (ucxx does not import): gRPC only")
    rows: list[dict[str, Any]] = []
    mine = os.sched_getaffinity(0) if cpus else None
    if cpus:
        os.sched_setaffinity(0, {cpus[1]})  # threads started from here on (ucxx's) inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gcache-") as tmp:
            for tier in tiers:
                await _tier_cells(tier, Path(tmp), transports, sizes, iters, cell_bytes, batch, rows, cpus)
    finally:
        if mine:
            os.sched_setaffinity(0, mine)
    return rows, notes


async def _tier_cells(
    tier: str,
    tmp: Path,
    transports: Sequence[str],
    sizes: Sequence[int],
    iters: int,
    cell_bytes: int,
    batch: int,
    rows: list[dict[str, Any]],
    cpus: tuple[int, int] | None,
) -> None:
    """One node of ``tier``'s layout and its cells, appended to ``rows``."""
    from services.gcache.client import GCacheClient

    with node_process(tier, tmp, cpu=cpus[0] if cpus else None) as addr:
        for transport in transports:
            client = GCacheClient(addr, transport, timeout_s=60.0)
            try:
                await warm_up(client)
                for size in sizes:
                    n = objects_for(size, iters, cell_bytes)
                    rows.append(await run_cell(client, tier, transport, size, n, batch, len(rows) + 1))
            finally:
                await client.close()


def baseline_settings() -> dict[str, dict[str, str]]:
    """The UCX settings ucx_perftest runs with, by label: UCX's own defaults, and the node's: its
    process's ``UCX_*`` once ucxx is imported (``services.gcache.ucx.ENV_DEFAULTS``, ucxx's own
    additions such as ``UCX_RNDV_THRESH``, and this environment's settings, which the node
    inherits), but ``UCX_TLS``, which the baseline sets itself."""
    from services.gcache import ucx

    ucx.available()  # imports ucxx as the node does, where it can
    node = {**ucx.ENV_DEFAULTS, **{k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    node.pop("UCX_TLS", None)
    return {"ucx defaults": {}, "node settings": node}


def run_baseline(
    sizes: Sequence[int],
    budget_bytes: int,
    cpus: tuple[int, int] | None = None,
    label: str = "ucx defaults",
    ucx_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """ucx_perftest at ``sizes`` with ``ucx_env`` (server and client on ``cpus`` as the node and
    the client): ``{"label", "rows": [...]}``, or with ``missing`` / ``error`` (why) and no rows."""
    from bench.ucx_perftest import PerftestMissing, run_perftest

    try:
        rows = run_perftest(tuple(sizes), budget_bytes=budget_bytes, cpus=cpus, ucx_env=ucx_env)
        return {"label": label, "rows": rows}
    except PerftestMissing as e:
        return {"label": label, "missing": str(e), "rows": []}
    except RuntimeError as e:
        return {"label": label, "error": str(e), "rows": []}


def merge_baselines(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One baseline from several runs (UCX's defaults and the node's settings, before and after
    the cells: ucx_perftest busy-polls both sides, so on a shared 2-core machine it varies a
    lot): per size the run with the most MB/s; ``runs``: each run's label and MB/s per size."""
    ok = [r for r in runs if r["rows"]]
    if not ok:
        return runs[0] if runs else {"error": "not run", "rows": []}
    best: dict[int, dict[str, Any]] = {}
    for run in ok:
        for row in run["rows"]:
            size = row["size_bytes"]
            if size not in best or row["mb_per_s"] > best[size]["mb_per_s"]:
                best[size] = row
    labelled = [
        {"label": r.get("label"), "mb_per_s": {_size(x["size_bytes"]): x["mb_per_s"] for x in r["rows"]}}
        for r in ok
    ]
    out: dict[str, Any] = {"rows": list(best.values()), "runs": labelled}
    out.update({k: r[k] for r in runs for k in ("missing", "error") if k in r})
    return out


def _row(rows: list[dict[str, Any]], tier: str, transport: str, size: int) -> dict[str, Any] | None:
    return next(
        (r for r in rows if (r["tier"], r["transport"], r["size_bytes"]) == (tier, transport, size)), None
    )


def vs_perftest(rows: list[dict[str, Any]], baseline: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per size: DRAM UCX get MiB/s over ucx_perftest's, one object per get and batched."""
    out = {}
    for b in baseline.get("rows", []):
        r = _row(rows, "dram", "ucx", b["size_bytes"])
        if r is not None and b["mb_per_s"] > 0:
            out[_size(b["size_bytes"])] = {
                "get": round(r["get_mib_s"] / b["mb_per_s"], 4),
                "batch_get": round(r["batch_get_mib_s"] / b["mb_per_s"], 4),
            }
    return out


def targets(
    rows: list[dict[str, Any]], baseline: dict[str, Any], sims: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The issue's targets, measured (DRAM tier for the transport ones)."""
    out = []
    ratio = vs_perftest(rows, baseline).get(_size(4 << 20), {}).get("get")
    missing = baseline.get("missing") or baseline.get("error")
    why = f"no baseline: {missing}" if missing else "no 4 MiB UCX cell or baseline" if ratio is None else ""
    out.append(target("ucx_get_vs_perftest_4MiB", ratio, ">=", 0.7, why or "DRAM, one object per get"))
    small = _row(rows, "dram", "ucx", 64 << 10)
    out.append(target("ucx_get_p50_ms_64KiB", small["get_p50_ms"] if small else None, "<", 1.0, "DRAM"))
    for s in sims:
        w = s["workload"]
        out.append(target(f"{w}_hit_with_l3_over_ideal", s["hit_with_l3_over_ideal"], ">=", 0.97))
        out.append(
            target(f"{w}_ttft_p50_with_l3_over_without", s["ttft_p50_with_l3_over_without"], "<=", 0.5)
        )
    return out


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_transports(rows: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    print("GCache node process on 127.0.0.1, client here, one call in flight, server and client on two CPUs "
          "where there are two (MiB/s = 2^20 B/s, latency ms)")  # fmt: skip
    print(f"{'tier':<5}{'xport':<6}{'size':>8}{'n':>5}{'put MiB/s':>10}{'p50':>8}{'p99':>8}{'get MiB/s':>10}"
          f"{'p50':>8}{'p99':>8}{'batch':>6}{'bget MiB/s':>11}{'p50':>8}{'lookup p50':>11}{'held':>14}{'bad':>4}")  # fmt: skip
    for r in rows:
        held = f"{r['tier']} {r['pages_in_tier']}/{r['objects']}"
        print(
            f"{r['tier']:<5}{r['transport']:<6}{_size(r['size_bytes']):>8}{r['objects']:>5}{r['put_mib_s']:>10.1f}"
            f"{r['put_p50_ms']:>8.3f}{r['put_p99_ms']:>8.3f}{r['get_mib_s']:>10.1f}{r['get_p50_ms']:>8.3f}"
            f"{r['get_p99_ms']:>8.3f}{r['batch']:>6}{r['batch_get_mib_s']:>11.1f}{r['batch_get_p50_ms']:>8.3f}"
            f"{r['lookup_p50_ms']:>11.3f}{held:>14}{r['mismatches']:>4}"
        )
    print()
    if baseline.get("rows"):
        from bench.ucx_perftest import print_table

        print_table(baseline["rows"])
        print(f"(best of {len(baseline['runs'])} runs per size, before and after the cells; MB/s:")
        for run in baseline["runs"]:
            print(f"  {run['label']:<14} " + ", ".join(f"{k} {v:.0f}" for k, v in run["mb_per_s"].items()))
        print(")")
        ratios = vs_perftest(rows, baseline)
        if ratios:
            each = ", ".join(f"{k} {v['get']:.3f} (batched {v['batch_get']:.3f})" for k, v in ratios.items())
            print(f"GCache DRAM UCX get / ucx_perftest: {each}")
    else:
        print(f"ucx_perftest baseline: {baseline.get('missing') or baseline.get('error')}")


def print_targets(ts: list[dict[str, Any]]) -> None:
    print("\nTargets (issue 17)")
    for t in ts:
        v = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        note = f"  ({t['note']})" if t["note"] else ""
        print(f"  {t['name']:<42}{v:>10} {t['op']} {t['threshold']:<6}{t['status']:>6}{note}")


def main(
    json_path: Path | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 200,
    cell_bytes: int = 64 << 20,
    batch: int = 8,
    tiers: Sequence[str] = TIERS,
    limit: int | None = None,
    copies: int | None = None,
    perftest_bytes: int = 256 << 20,
    sim: bool = True,
) -> dict[str, Any]:
    """Run both parts, print the tables and the targets, write ``json_path``; returns the result."""
    from bench.ucx_perftest import pin_cpus

    t0 = time.perf_counter()
    cpus = pin_cpus()
    settings = baseline_settings()
    before = [run_baseline(sizes, perftest_bytes, cpus, k, v) for k, v in settings.items()]
    rows, notes = asyncio.run(run_transports(sizes, iters, cell_bytes, batch, tiers, cpus))
    ok = any(r["rows"] for r in before)
    after = [run_baseline(sizes, perftest_bytes, cpus, k, v) for k, v in settings.items()] if ok else []
    baseline = merge_baselines([*before, *after])
    part1_s = time.perf_counter() - t0
    print_transports(rows, baseline)
    chosen = sessions.setups(limit, copies)
    sims = sessions.run_sessions(chosen) if sim else []
    if sims:
        sessions.print_sessions(sims)
    ts = targets(rows, baseline, sims)
    print_targets(ts)
    for n in notes:
        print(f"note: {n}")
    wall = time.perf_counter() - t0
    print(f"\nwall: {wall:.1f} s (transports and baseline {part1_s:.1f} s)")
    result = {
        "config": {
            "sizes": list(sizes), "iters": iters, "cell_bytes": cell_bytes, "batch": batch, "tiers": list(tiers),
            "page_tokens": PAGE, "dram_bytes": DRAM_BYTES, "nvme_node_dram_bytes": TINY_DRAM,
            "nvme_bytes": NVME_BYTES, "perftest_bytes": perftest_bytes,
            "cpus": {"server": cpus[0], "client": cpus[1]} if cpus else None,
            "sessions": [
                {"workload": s.name, "trace": s.trace.name, "limit": s.limit, "copies": s.copies,
                 "device_bytes": s.device_bytes, "host_bytes": s.host_bytes} for s in chosen
            ] if sim else [],
            "deployment": sessions.DEPLOYMENT, "prefill": sessions.PREFILL, "decode": sessions.DECODE,
            "policy": sessions.POLICY, "load": sessions.LOAD, "l3_bytes": sessions.L3_BYTES,
            "units": {"mib_per_s": "2^20 bytes/s", "latency": "ms", "ttft": "simulated s"},
        },
        "rows": rows, "baseline": baseline, "ucx_get_vs_perftest": vs_perftest(rows, baseline),
        "sessions": sims, "targets": ts, "notes": notes,
        "wall_s": round(wall, 1), "transports_wall_s": round(part1_s, 1),
    }  # fmt: skip
    if json_path is not None:
        from swaserve.sim.run import write_json

        write_json(Path(json_path), result)
    return result

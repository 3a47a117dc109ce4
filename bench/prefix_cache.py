"""Prefix-cache hit rates of a trace, replayed through the real cache at a memory budget, no model.

Each request runs alone through ``KVCacheManager`` (page accounting only): ``admit``, chunked prefill
(``cache_partial`` after each chunk, as ``LLMEngine.step``), ``free``. Hit rates per tier vs the
infinite-cache ideal, hybrid vs full layout at equal bytes; budgets are shares of the trace's
footprint. Mooncake traces or agent sessions; shape MiMo-V2.5-Pro, bf16 KV, page 16.

Method: docs/DESIGN.md#benchprefix_cachepy"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.kv_capacity import SHAPES, model_config
from bench.prefix_reuse import load_records, reused_replays
from bench.prefix_workload import (
    AGENT_TRACE,
    CHUNK,
    CONVERSATION_TRACE,
    PAGE,
    BenchInputError,
    Workload,
    footprint_bytes,
    full_plan,
    hybrid_plan,
    load_workload,
)
from swaserve.config import ModelConfig
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.plan import PoolPlan
from swaserve.kvcache.sizing import host_plan

SHAPE = SHAPES[1]  # MiMo-V2.5-Pro
DEVICE_FRACTION = 0.25  # default device budget, share of the footprint
# the cache's eviction order as replayed here; bump when it changes, so --reuse refuses the
# full-layout and fixed-ratio rows of older runs (they depend on it, not on the adaptive split).
# 2: a finished prompt's chunk-end windows above its last chunk end are demoted
EVICTION_REV = 2
CURVE = (  # (device share, host share) of the footprint
    (0.02, 0.0),
    (0.05, 0.0),
    (0.1, 0.0),
    (0.25, 0.0),
    (0.5, 0.0),
    (1.0, 0.0),
    (0.05, 1.0),
    (0.1, 1.0),
    (0.25, 1.0),
)


# fixed SWA pages per full page swept for "best fixed ratio in hindsight" on the device-only curve
# budgets (0: only what the running request needs; 1/9: the former default); MiMo-V2.5-Pro SWA
# byte shares 0, 0.40, 0.55, 0.64, 0.75
FIXED_RATIOS = (0.0, 1 / 9, 0.2, 0.3, 0.5)


# -- replay ------------------------------------------------------------------------------------------
@dataclass
class Replay:
    """Token counts of one replay (one layout, one device and host budget)."""

    layout: str
    swa_ratio: float | None  # fixed SWA pages per full page; None = shared budget, adaptive split
    device_bytes: int  # of the plan (<= the budget: whole pages)
    host_bytes: int
    full_pages: int
    swa_pages: int
    host_full_pages: int
    host_swa_pages: int
    prompt_tokens: int = 0
    hits_device: int = 0
    hits_host: int = 0
    rejected: int = 0  # requests that never fit the pools (admission failed): 0 hits, tokens counted
    stalled: int = 0  # admitted requests whose prefill could not go on (not expected alone)
    seconds: float = 0.0
    swa_byte_share: float = 0.0  # adaptive: the SWA target at the end, share of the device budget

    @property
    def hits(self) -> int:
        return self.hits_device + self.hits_host

    def rates(self) -> dict[str, float]:
        t = max(1, self.prompt_tokens)
        return {
            "hit_rate": self.hits / t,
            "device_hit_rate": self.hits_device / t,
            "host_hit_rate": self.hits_host / t,
        }


def replay(
    cfg: ModelConfig,
    work: Workload,
    layout: str,
    plan: PoolPlan,
    host_bytes: int = 0,
    chunk: int = CHUNK,
    cache_partial: bool = True,
    write_policy: str = "on_evict",
    swa_ratio: float | None = None,
) -> Replay:
    """Run every prompt of ``work`` through a ``KVCacheManager`` with ``plan`` (module doc)."""
    try:
        host = host_plan(plan, host_bytes) if host_bytes > 0 else None
    except ValueError as e:
        raise BenchInputError(str(e)) from e
    shared = plan.shared_bytes is not None
    kv = KVCacheManager(
        plan,
        PAGE,
        cfg.window,
        layout,
        len(cfg.full_layers),
        len(cfg.swa_layers),
        prefix_caching=True,
        host_pages=host,
        write_policy=write_policy,  # type: ignore[arg-type]
        host_bytes=host_bytes if shared and host_bytes > 0 else None,
    )
    dev_bytes = (
        plan.shared_bytes
        if shared
        else plan.full_pages * plan.full_page_bytes + plan.swa_pages * plan.swa_page_bytes
    )
    out = Replay(
        layout, swa_ratio if layout == "hybrid" else None, dev_bytes or 0, host_bytes,
        plan.full_pages, plan.swa_pages, host[0] if host else 0, host[1] if host else 0,
    )  # fmt: skip
    if not shared and layout == "hybrid":
        out.swa_byte_share = plan.swa_pages * plan.swa_page_bytes / max(1, out.device_bytes)
    t0 = time.perf_counter()
    for i, prompt in enumerate(work.prompts()):
        rid, n = str(i), len(prompt)
        out.prompt_tokens += n
        adm = kv.admit(rid, n + 1, prompt)
        if adm is None:
            out.rejected += 1
            continue
        hit, from_host = adm.hit_tokens, adm.host_tokens
        out.hits_device += hit - from_host
        out.hits_host += from_host
        start = hit
        while start < n:
            step = kv.max_chunk(rid, start, min(n, start + chunk))
            if step == 0 or not kv.allocate(rid, start, start + step):
                out.stalled += 1
                break
            start += step
            if start < n and (cache_partial or start == adm.diverge):
                kv.cache_partial(rid, prompt[:start])
        kv.free(rid, prompt[:start])
    out.seconds = time.perf_counter() - t0
    assert kv.cache is not None
    if kv.cache.split is not None:
        out.swa_byte_share = kv.cache.split.target / kv.cache.split.total
    s = kv.cache.stats
    if (s.hits_device, s.hits_host) != (out.hits_device, out.hits_host):
        raise RuntimeError(f"cache stats {s} disagree with the per-request hits {out}")
    return out


def _r(x: float) -> float:
    return round(x, 4)


def _replay_record(r: Replay) -> dict[str, object]:
    d = asdict(r)
    d.update({k: _r(v) for k, v in r.rates().items()})
    d["seconds"] = round(r.seconds, 2)
    d["swa_byte_share"] = _r(r.swa_byte_share)
    return d


# one replay: (layout, fixed SWA ratio or None, device bytes, host bytes)
Task = tuple[str, float | None, int, int]
_JOB: dict[str, object] = {}  # the workload and settings, inherited by forked workers


def _run_task(task: Task) -> Replay:
    layout, ratio, d, h = task
    cfg, work, chunk, partial, policy = (_JOB[k] for k in ("cfg", "work", "chunk", "partial", "policy"))
    plan = hybrid_plan(cfg, d, chunk, ratio) if layout == "hybrid" else full_plan(cfg, d)  # type: ignore[arg-type]
    return replay(cfg, work, layout, plan, h, chunk, partial, policy, ratio)  # type: ignore[arg-type]


def _run_all(tasks: list[Task], jobs: int) -> dict[Task, Replay | BenchInputError]:
    """Every task's replay (or the budget error), ``jobs`` processes (fork) at a time."""
    out: dict[Task, Replay | BenchInputError] = {}
    if jobs <= 1 or len(tasks) <= 1:
        for t in tasks:
            try:
                out[t] = _run_task(t)
            except BenchInputError as e:
                out[t] = e
        return out
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
        futs = {t: ex.submit(_run_task, t) for t in tasks}
        for t, f in futs.items():
            try:
                out[t] = f.result()
            except BenchInputError as e:
                out[t] = e
    return out


def bench_trace(
    path: Path,
    limit: int | None = None,
    budget: int | None = None,
    host_budget: int | None = None,
    curve: bool = True,
    chunk: int = CHUNK,
    cache_partial: bool = True,
    write_policy: str = "on_evict",
    swa_ratio: float | None = None,
    budget_share: float | None = None,
    sweep: bool = True,
    jobs: int = 1,
    reuse: list[dict[str, Any]] | None = None,
    curve_shares: list[float] | None = None,
) -> dict[str, object]:
    """Replay one trace: hybrid (adaptive, or ``swa_ratio`` fixed) and full layout at the budget, and
    along the curve adaptive, full layout and the sweep of fixed ratios; returns its JSON record.
    ``reuse``: earlier records whose full-layout and fixed-ratio replays are taken, not rerun
    (``bench.prefix_reuse``). ``curve_shares``: replay only the curve's points at these device
    shares (None: all)."""
    t0 = time.perf_counter()
    cfg = model_config(SHAPE)
    work = load_workload(path, limit)
    foot = footprint_bytes(cfg, work.unique_pages)
    if budget is None:
        budget = int(foot * (budget_share if budget_share is not None else DEVICE_FRACTION))
    host_b = host_budget if host_budget is not None else (0 if work.kind == "mooncake" else foot)
    _JOB.update(cfg=cfg, work=work, chunk=chunk, partial=cache_partial, policy=write_policy)
    main_tasks: list[Task] = [("hybrid", swa_ratio, budget, host_b), ("full", None, budget, host_b)]
    tasks = list(main_tasks)
    on_curve = [(d, h) for d, h in CURVE if curve_shares is None or d in curve_shares]
    points = [(d, h, int(foot * d), int(foot * h)) for d, h in on_curve] if curve else []
    for _, _, d, h in points:
        tasks += [("hybrid", None, d, h), ("full", None, d, h)]
        tasks += [("hybrid", r, d, h) for r in (FIXED_RATIOS if sweep and h == 0 else ())]
    tasks = list(dict.fromkeys(tasks))
    kept: dict[Task, Replay | BenchInputError] = {}
    if reuse:
        want = {"trace": str(path), "requests": work.requests, "footprint_bytes": foot, "chunk_tokens": chunk,
                "cache_partial": cache_partial, "write_policy": write_policy, "prompt_tokens": work.prompt_tokens,
                "eviction_rev": EVICTION_REV}  # fmt: skip
        found = reused_replays(reuse, want, tasks, foot, set(Replay.__dataclass_fields__))
        kept = {t: Replay(**f) for t, f in found.items()}
    done = {**kept, **_run_all([t for t in tasks if t not in kept], jobs)}
    hyb, full = done[main_tasks[0]], done[main_tasks[1]]
    if isinstance(hyb, BenchInputError) or isinstance(full, BenchInputError):
        raise hyb if isinstance(hyb, BenchInputError) else full  # type: ignore[misc]
    ideal = work.ideal_hit_rate
    hr, fr = hyb.rates(), full.rates()
    rec: dict[str, object] = {
        "trace": str(path),
        "kind": work.kind,
        "shape": SHAPE.name,
        "page_size": PAGE,
        "chunk_tokens": chunk,
        "cache_partial": cache_partial,
        "swa_full_tokens_ratio": swa_ratio,  # None: one shared budget, adaptive split
        "write_policy": write_policy,
        "eviction_rev": EVICTION_REV,
        "requests": work.requests,
        "prompt_tokens": work.prompt_tokens,
        "unique_pages": work.unique_pages,
        "ideal_hit_tokens": work.ideal_hits,
        "footprint_bytes": foot,
        "device_budget_bytes": budget,
        "device_budget_share": _r(budget / foot) if foot else None,
        "host_budget_bytes": host_b,
        "host_budget_share": _r(host_b / foot) if foot else None,
        "hit_rate": _r(hr["hit_rate"]),
        "device_hit_rate": _r(hr["device_hit_rate"]),
        "host_hit_rate": _r(hr["host_hit_rate"]),
        "ideal_hit_rate": _r(ideal),
        "full_layout_hit_rate": _r(fr["hit_rate"]),
        "hit_vs_ideal": _r(hr["hit_rate"] / ideal) if ideal else None,
        "full_layout_vs_ideal": _r(fr["hit_rate"] / ideal) if ideal else None,
        "hybrid_swa_byte_share": _r(hyb.swa_byte_share),
        "hybrid": _replay_record(hyb),
        "full": _replay_record(full),
        "fixed_ratios": list(FIXED_RATIOS) if sweep else [],
    }
    if curve:
        rows: list[dict[str, object]] = []
        for dfrac, hfrac, d, h in points:
            a, f = done["hybrid", None, d, h], done["full", None, d, h]
            if isinstance(a, BenchInputError) or isinstance(f, BenchInputError):  # tiny trace (--limit)
                rows.append(
                    {
                        "device_share": dfrac,
                        "host_share": hfrac,
                        "error": str(a if isinstance(a, Exception) else f),
                    }
                )
                continue
            row: dict[str, object] = {
                "device_share": dfrac,
                "host_share": hfrac,
                "adaptive": {**{k: _r(v) for k, v in a.rates().items()}, "swa_byte_share": _r(a.swa_byte_share),
                             "rejected": a.rejected, "seconds": round(a.seconds, 1)},
                "full": {**{k: _r(v) for k, v in f.rates().items()}, "rejected": f.rejected,
                         "seconds": round(f.seconds, 1)},
            }  # fmt: skip
            fixed = {r: done["hybrid", r, d, h] for r in (FIXED_RATIOS if sweep and h == 0 else ())}
            fixed_ok = {r: x.rates()["hit_rate"] for r, x in fixed.items() if isinstance(x, Replay)}
            row["fixed"] = {str(_r(r)): _r(v) for r, v in fixed_ok.items()}
            ah = a.rates()["hit_rate"]
            if fixed_ok:
                best = max(fixed_ok, key=lambda r: fixed_ok[r])
                row["best_fixed_ratio"], row["best_fixed_hit_rate"] = _r(best), _r(fixed_ok[best])
                row["adaptive_vs_best_fixed"] = _r(ah / fixed_ok[best]) if fixed_ok[best] else None
            row["adaptive_vs_full"] = _r(ah / f.rates()["hit_rate"]) if f.rates()["hit_rate"] else None
            row["adaptive_vs_ideal"] = _r(ah / ideal) if ideal else None
            rows.append(row)
        rec["curve"] = rows
    rec["reused"] = [list(t) for t in kept]  # taken from --reuse, not replayed in this run
    rec["targets"] = targets(rec, limit is None)
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    rec["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return rec


def targets(rec: dict[str, object], whole_trace: bool = True) -> dict[str, bool]:
    """The targets of issue 14 over the curve (device-only budgets), plus the agent trace's own."""
    out: dict[str, bool] = {}
    hit, ideal = float(rec["hit_rate"]), float(rec["ideal_hit_rate"])  # type: ignore[arg-type]
    if rec["kind"] == "agent":
        out["hybrid >= 0.93 (host tier)"] = hit >= 0.93
        out["hybrid >= 0.98 x ideal (host tier)"] = hit >= 0.98 * ideal
    curve = rec.get("curve", [])
    assert isinstance(curve, list)
    rows: list[dict] = [c for c in curve if isinstance(c, dict) and "error" not in c]
    for c in rows:
        a, f = c["adaptive"]["hit_rate"], c["full"]["hit_rate"]
        d, h = c["device_share"], c["host_share"]
        where = f"device {d}" + (f" + host {h}" if h else "")
        if h == 0 and d >= 0.25:
            out[f"{where}: adaptive >= 0.97 x ideal"] = a >= 0.97 * ideal
        if h == 0 and d == 0.05:
            out[f"{where}: adaptive >= min(2 x full layout, 0.9 x ideal)"] = a >= min(2 * f, 0.9 * ideal)
        if "best_fixed_hit_rate" in c:
            out[f"{where}: adaptive >= 0.98 x best fixed ratio"] = a >= 0.98 * c["best_fixed_hit_rate"]
    if whole_trace and rec["kind"] == "mooncake":
        hyb = rec["hybrid"]
        assert isinstance(hyb, dict)
        out["whole trace replay < 120 s per layout"] = float(hyb["seconds"]) < 120
    return out


# -- output ------------------------------------------------------------------------------------------
def _gb(b: object) -> str:
    return f"{float(b) / 1e9:.1f}"  # type: ignore[arg-type]


def print_record(rec: dict[str, object]) -> None:
    hyb, full = rec["hybrid"], rec["full"]
    assert isinstance(hyb, dict) and isinstance(full, dict)
    ideal = float(rec["ideal_hit_rate"])  # type: ignore[arg-type]
    ratio = rec["swa_full_tokens_ratio"]
    print(
        f"Prefix cache: {rec['trace']} ({rec['kind']}: {rec['requests']} requests, "
        f"{rec['prompt_tokens']} prompt tokens, {rec['unique_pages']} distinct pages)"
    )
    print(
        f"{SHAPE.name}, bf16 KV, page {PAGE}, prefill chunk {rec['chunk_tokens']}"
        f"{', cache_partial' if rec['cache_partial'] else ''}; footprint {_gb(rec['footprint_bytes'])} GB; "
        f"device {_gb(rec['device_budget_bytes'])} GB ({rec['device_budget_share']}), "
        f"host {_gb(rec['host_budget_bytes'])} GB ({rec['host_budget_share']}); hybrid split: "
        + ("one shared budget, adaptive" if ratio is None else f"fixed, {ratio} SWA pages per full page")
    )
    print(
        f"{'layout':<8}{'swa bytes':>10}{'host full':>11}{'host swa':>10}"
        f"{'device':>8}{'host':>8}{'total':>8}{'ideal':>8}{'/ideal':>8}{'reject':>8}{'s':>7}"
    )
    for r in (hyb, full):
        share = f"{r['swa_byte_share']:.3f}" if r["layout"] == "hybrid" else "0.500"
        print(
            f"{r['layout']:<8}{share:>10}{r['host_full_pages']:>11}"
            f"{r['host_swa_pages']:>10}{r['device_hit_rate']:>8.4f}{r['host_hit_rate']:>8.4f}"
            f"{r['hit_rate']:>8.4f}{ideal:>8.4f}{r['hit_rate'] / max(ideal, 1e-12):>8.3f}"
            f"{r['rejected'] + r['stalled']:>8}{r['seconds']:>7.1f}"
        )
    curve = rec.get("curve")
    if isinstance(curve, list):
        print("Hit-rate curve (budgets as shares of the footprint; hit rates device + host)")
        print(
            f"{'device':>7}{'host':>6}{'adaptive':>10}{'swa share':>10}{'best fixed':>11}{'(ratio)':>9}"
            f"{'full':>8}{'/best':>7}{'/full':>7}{'/ideal':>8}{'s':>6}"
        )
        for c in curve:
            if "error" in c:
                print(f"{c['device_share']:>7}{c['host_share']:>6}  {c['error']}")
                continue
            a, f = c["adaptive"], c["full"]
            bf = c.get("best_fixed_hit_rate")
            print(
                f"{c['device_share']:>7}{c['host_share']:>6}{a['hit_rate']:>10.4f}{a['swa_byte_share']:>10.3f}"
                + (f"{bf:>11.4f}{c['best_fixed_ratio']:>9.3f}" if bf is not None else f"{'-':>11}{'-':>9}")
                + f"{f['hit_rate']:>8.4f}"
                + (f"{c['adaptive_vs_best_fixed']:>7.3f}" if bf else f"{'-':>7}")
                + f"{c['adaptive_vs_full'] or 0:>7.2f}{c['adaptive_vs_ideal'] or 0:>8.3f}{a['seconds']:>6.0f}"
                + (
                    f"  (rejected {a['rejected']} / {f['rejected']})"
                    if a["rejected"] or f["rejected"]
                    else ""
                )
            )
        sweep = [c for c in curve if c.get("fixed")]
        if sweep:
            ratios = list(sweep[0]["fixed"])
            print("Fixed ratios (SWA pages per full page), hit rate")
            print(f"{'device':>7}{'host':>6}" + "".join(f"{r:>9}" for r in ratios))
            for c in sweep:
                print(
                    f"{c['device_share']:>7}{c['host_share']:>6}"
                    + "".join(f"{c['fixed'].get(r, 0):>9.4f}" for r in ratios)
                )
    tg = rec.get("targets")
    if isinstance(tg, dict):
        print("targets: " + "; ".join(f"{k}: {'met' if ok else 'NOT met'}" for k, ok in tg.items()))
    reused = rec.get("reused")
    if isinstance(reused, list) and reused:
        print(f"{len(reused)} full-layout / fixed-ratio replays taken from --reuse (not rerun)")
    print(f"wall {rec['wall_s']} s, peak RSS {rec['peak_rss_mb']} MB")


def main(
    json_path: str | None = None,
    traces: list[str] | None = None,
    limit: int | None = None,
    budget: int | None = None,
    host_budget: int | None = None,
    curve: bool = True,
    chunk: int = CHUNK,
    cache_partial: bool = True,
    write_policy: str = "on_evict",
    swa_ratio: float | None = None,
    budget_share: float | None = None,
    sweep: bool = True,
    jobs: int | None = None,
    reuse: str | None = None,
    curve_shares: list[float] | None = None,
) -> dict[str, object]:
    """Bench each trace (default: both bundled ones), print its tables, write JSON.

    JSON: one trace -> its record; several -> ``{"traces": [record, ...]}``. A record has
    ``hit_rate`` (hybrid, device + host), ``device_hit_rate``, ``host_hit_rate``, ``ideal_hit_rate``,
    ``full_layout_hit_rate``, the ratios to the ideal, budgets, ``hybrid``/``full`` details (pages,
    per-tier rates, rejected requests), ``curve`` (per budget: adaptive, full layout, each fixed
    ratio, the best fixed ratio in hindsight) and ``targets``.
    """
    paths = [Path(t) for t in traces] if traces else [CONVERSATION_TRACE, AGENT_TRACE]
    earlier = load_records(Path(reuse)) if reuse else None
    jobs = jobs if jobs is not None else max(1, len(os.sched_getaffinity(0)))
    recs = []
    for p in paths:
        rec = bench_trace(
            p, limit, budget, host_budget, curve, chunk, cache_partial, write_policy, swa_ratio,
            budget_share, sweep, jobs, earlier, curve_shares,
        )  # fmt: skip
        print_record(rec)
        print()
        recs.append(rec)
    out: dict[str, object] = recs[0] if len(recs) == 1 else {"traces": recs}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()

"""``swaserve bench prefix-cache --reuse PATH``: take the replays that do not depend on the adaptive
split (full layout, fixed SWA ratios) from an earlier run's JSON instead of replaying them, so that a
change to the split's policy reruns only its own rows (a whole-trace sweep is ~50 replays).

A replay is reused only from a record of the same trace, request count, footprint, chunk,
``cache_partial``, write policy and eviction order (``EVICTION_REV``), at the same device and host bytes; its hit rates come back at
the JSON's 4 decimals. The record lists what it reused (``reused``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# one replay: (layout, fixed SWA ratio or None, device bytes, host bytes), as bench.prefix_cache
Task = tuple[str, float | None, int, int]


def load_records(path: Path) -> list[dict[str, Any]]:
    """The trace records of an earlier ``--json`` file (one record, or ``{"traces": [...]}``)."""
    data = json.loads(path.read_text())
    return list(data["traces"]) if "traces" in data else [data]


def _same_run(rec: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    keys = (
        "trace",
        "requests",
        "footprint_bytes",
        "chunk_tokens",
        "cache_partial",
        "write_policy",
        "eviction_rev",
    )
    return all(rec.get(k) == want[k] for k in keys)


def _from_rates(
    layout: str, ratio: float | None, d: int, h: int, rates: Mapping[str, Any], tokens: int
) -> dict[str, Any]:
    return {
        "layout": layout, "swa_ratio": ratio, "device_bytes": d, "host_bytes": h, "full_pages": 0,
        "swa_pages": 0, "host_full_pages": 0, "host_swa_pages": 0, "prompt_tokens": tokens,
        "hits_device": round(float(rates.get("device_hit_rate", rates.get("hit_rate", 0.0))) * tokens),
        "hits_host": round(float(rates.get("host_hit_rate", 0.0)) * tokens),
        "rejected": int(rates.get("rejected", 0)), "seconds": float(rates.get("seconds", 0.0)),
    }  # fmt: skip


def reused_replays(
    records: list[dict[str, Any]], want: Mapping[str, Any], tasks: list[Task], foot: int, fields: set[str]
) -> dict[Task, dict[str, Any]]:
    """The ``Replay`` fields of ``tasks`` found in ``records`` (policy-independent ones only, module
    doc); ``fields``: the names ``Replay`` takes.

    Args:
        records: earlier trace records (``load_records``).
        want: this run's settings under the record's keys (``trace``, ``requests``, ...).
        tasks: this run's replays, (layout, fixed ratio or None, device bytes, host bytes).
        foot: the trace's footprint, bytes (curve budgets are its shares).
    """
    out: dict[Task, dict[str, Any]] = {}
    tokens = int(want["prompt_tokens"])
    for rec in records:
        if not _same_run(rec, want):
            continue
        for row in rec.get("curve", []):
            if "error" in row:
                continue
            d, h = int(foot * row["device_share"]), int(foot * row["host_share"])
            out["full", None, d, h] = _from_rates("full", None, d, h, row["full"], tokens)
            for ratio, rate in row.get("fixed", {}).items():
                r = float(ratio)
                match = [x for x in rec.get("fixed_ratios", []) if round(x, 4) == r]
                key = float(match[0]) if match else r
                out["hybrid", key, d, h] = _from_rates("hybrid", key, d, h, {"hit_rate": rate}, tokens)
        full = rec.get("full")  # after the curve: its details win over a curve point's rates
        if isinstance(full, dict):
            t: Task = ("full", None, int(rec["device_budget_bytes"]), int(rec["host_budget_bytes"]))
            out[t] = {k: full[k] for k in fields if k in full}
    return {t: out[t] for t in tasks if t in out and (t[0] == "full" or t[1] is not None)}

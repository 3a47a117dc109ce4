"""CPUs a process may use (``usable_cpus``): what sizes torch's thread pools in workers and serve."""

from __future__ import annotations

import contextlib
import math
import os


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on: its affinity set, capped by a cgroup CPU quota (a container's
    ``--cpus`` / a Kubernetes CPU limit), rounded up, at least 1. ``os.cpu_count()`` reports the
    host's CPUs in a container: more torch threads than usable CPUs make OpenMP threads spin
    against each other (10-20x slower prefill measured on 2 cores)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def _cgroup_cpu_quota(root: str) -> float | None:
    """CPUs allowed by cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``;
    None where there is no limit or no cgroup file."""
    v2 = _read(os.path.join(root, "cpu.max")).split()
    v1 = [_read(os.path.join(root, "cpu", f"cpu.cfs_{k}_us")).strip() for k in ("quota", "period")]
    for quota, period in (v2[:2] if len(v2) >= 2 else ["max", "1"], v1):
        with contextlib.suppress(ValueError):
            if int(quota) > 0 and int(period) > 0:
                return int(quota) / int(period)
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""

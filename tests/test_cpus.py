"""``swaserve.cpus.usable_cpus``: the affinity set capped by a cgroup CPU quota (v2 and v1 files)."""

from __future__ import annotations

import os
from pathlib import Path

from swaserve.cpus import usable_cpus


def test_usable_cpus_reads_the_cgroup_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(str(tmp_path)) == affinity  # no cgroup files: the affinity set
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == affinity  # v2, no limit
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(str(tmp_path)) == 1  # half a CPU rounds up to one
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path)) == affinity  # v1, no limit
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path)) == 1  # v1, one CPU
    assert usable_cpus() >= 1

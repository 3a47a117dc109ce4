"""scripts/gpu_check.sh runs on a lent GPU machine only: here, check that what it names exists,
so a renamed test file or bench command cannot silently drop out of the GPU checks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_gpu_check_names_every_test_file_with_a_cuda_case() -> None:
    named = set(re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text()))
    for path in named:
        assert (ROOT / path).is_file(), f"{path} (named in gpu_check.sh) does not exist"
    with_cuda = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"cuda\.(is_available|device_count)\(\)", p.read_text())
    }
    assert with_cuda <= named, (
        f"test files with CUDA cases missing from gpu_check.sh: {sorted(with_cuda - named)}"
    )


@pytest.mark.cluster  # bash -n: a subprocess
def test_the_gpu_scripts_parse_and_the_bench_command_exists() -> None:
    for name in ("gpu_check.sh", "gpu_prepare.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], check=True)
    from bench.cli import app

    commands = {c.name for c in app.registered_commands}
    assert "mtp" in commands

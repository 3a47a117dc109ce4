"""The conftest's hang backstop: a test that blocks SIGALRM (so pytest-timeout cannot interrupt
it) is ended by faulthandler, which prints the stacks and exits the run non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # runs pytest in a child process

ROOT = Path(__file__).resolve().parents[1]


def test_a_hang_pytest_timeout_cannot_break_ends_the_run_with_stacks(tmp_path: Path) -> None:
    case = ROOT / "tests" / f"_hang_case_{os.getpid()}.py"
    case.write_text(
        textwrap.dedent(
            """
            import signal, time
            import pytest

            @pytest.mark.timeout(1)
            def test_blocks_the_alarm():
                signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
                time.sleep(60)
            """
        )
    )
    try:
        env = {**os.environ, "SWASERVE_TEST_HANG_GRACE_S": "2"}
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(case)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=50,
        )  # fmt: skip
    finally:
        case.unlink()
    assert r.returncode != 0
    assert "Timeout (0:00:03)!" in r.stderr, r.stderr[-2000:]
    assert "test_blocks_the_alarm" in r.stderr

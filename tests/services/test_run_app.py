"""``services.lifecycle.run_app``: a service's exit status and its last output survive the exit
that skips the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cluster  # starts child processes

APP = """
import logging, sys, typer
from services.lifecycle import run_app

app = typer.Typer(add_completion=False)

@app.command()
def main(how: str) -> None:
    logging.basicConfig(stream=sys.stderr, format="%(message)s")
    print("buffered out")  # no flush: stdout is a pipe, so Python buffers it
    logging.getLogger("t").warning("logged")
    if how == "code":
        raise typer.Exit(3)
    if how == "message":
        sys.exit("bad flag")
    if how == "raise":
        raise RuntimeError("boom")

if __name__ == "__main__":
    run_app(app)
"""


@pytest.mark.parametrize(
    "how, code, err",
    [("ok", 0, ""), ("code", 3, ""), ("message", 1, "bad flag"), ("raise", 1, "RuntimeError: boom")],
)
def test_status_and_output_survive_the_fast_exit(how: str, code: int, err: str) -> None:
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(APP), how], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == code, p.stderr
    assert p.stdout == "buffered out\n"
    assert "logged" in p.stderr
    assert err in p.stderr

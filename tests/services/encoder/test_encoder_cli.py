"""The encoder's command line in this process: bad flags and a checkpoint it cannot load exit 2
with a message, before any port is bound."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.encoder.cli import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "float64"], "'float64': one of float32, bfloat16, float16"),
        (["--device", "nonsense"], "--device"),
        (["--cache-bytes", "lots"], "bad size 'lots'"),
        (["--max-batch-items", "0"], "--max-batch-items"),
        (["--grpc-tls-cert", __file__], "give both or neither"),
        (["--grpc-tls-ca", __file__], "not a PEM file"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, ["--num-threads", "1", *args])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split()), r.output


def test_a_checkpoint_without_media_towers_exits_2(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["--num-threads", "1", "--model", str(tmp_path)])
    assert r.exit_code == 2 and "cannot load the encoder from" in r.output, r.output

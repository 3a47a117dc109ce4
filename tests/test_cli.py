"""The ``swaserve`` CLI wiring and the ``make run`` driver (swaserve.run_demo)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from swaserve.cli import app
from swaserve.options import parse_size

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        ([], ["serve", "make-checkpoint", "replay", "bench"]),
        (
            ["serve"],
            [
                "--kv-cache-memory",
                "--kv-layout",
                "--max-num-seqs",
                "--max-num-batched-tokens",
                "--max-model-len",
                "--served-model-name",
                "--page-size",
                "--dtype",
                "--device",
                "--api-key",
                "--chat-template",
                "--max-logprobs",
            ],
        ),
        (
            ["up"],
            ["--host", "--port", "--api-key", "--served-model-name", "--chat-template", "--max-logprobs"],
        ),
        (["make-checkpoint"], ["--preset", "--out", "--seed"]),
        (
            ["replay"],
            [
                "--trace",
                "--url",
                "--limit",
                "--time-scale",
                "--block-tokens",
                "--max-output-tokens",
                "--json",
                "--model",
                "--vocab-size",
                "--reserved-ids",
            ],
        ),
        (["bench"], ["kv-capacity", "engine"]),
        (["bench", "kv-capacity"], ["--json"]),
        (["bench", "engine"], ["--json"]),
    ],
)
def test_help(args: list[str], expect: list[str]) -> None:
    res = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    for word in expect:
        assert word in res.output, word


@pytest.mark.cluster  # a fresh interpreter (subprocess)
def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = (
        "import sys; from swaserve.cli import app; print(sorted(m for m in ('torch', 'httpx', "
        "'swaserve.api.server', 'swaserve.engine.async_engine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_parse_size() -> None:
    assert parse_size("1073741824") == 1 << 30
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("256mib") == 256 << 20
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("1GB") == 10**9
    assert parse_size("64 KB") == 64_000
    for bad in ("", "abc", "12XB", "0", "-5MiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_serve_kv_cache_memory_option_parses_sizes() -> None:
    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    param = next(p for p in serve.params if p.name == "kv_cache_memory")
    ctx = serve.make_context("serve", ["--kv-cache-memory", "1GB"])
    assert ctx.params["kv_cache_memory"] == 10**9
    assert serve.make_context("serve", []).params["kv_cache_memory"] == 256 << 20
    assert param.metavar == "BYTES"
    res = runner.invoke(app, ["serve", "--kv-cache-memory", "lots"])
    assert res.exit_code == 2 and "bad size" in res.output


@pytest.mark.cluster  # runs services.prefill --help (subprocess)
def test_workers_take_every_engine_flag_of_serve() -> None:
    from services.worker_cli import worker_app

    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    serve_flags = {p.name: (p.opts, p.secondary_opts) for p in serve.params}
    serve_values = serve.make_context("serve", []).params
    http = (
        "model",
        "host",
        "port",
        "served_model_name",
        "max_request_bytes",
        "api_key",
        "chat_template",
        "max_logprobs",
        "ssl_certfile",
        "ssl_keyfile",
        "limit_mm_per_prompt",
        "allowed_media_domains",
        "allowed_local_media_path",
    )  # the HTTP front's, not the engine's
    engine = [n for n in serve_flags if n not in http]
    assert {"page_size", "kv_cache_memory", "max_model_len", "seed", "host_cache_memory"} <= set(engine)
    for role in ("prefill", "decode"):
        worker = get_command(worker_app(role))
        flags = {p.name: (p.opts, p.secondary_opts) for p in worker.params}
        values = worker.make_context(role, []).params
        for name in engine:
            assert flags.get(name) == serve_flags[name], (role, name)
            want = (role == "prefill") if name == "enable_prefix_caching" else serve_values[name]
            assert values[name] == want, (role, name)
        ctx = worker.make_context(role, ["--kv-cache-memory", "1GB", "--max-model-len", "64", "--seed", "3"])
        assert (ctx.params["kv_cache_memory"], ctx.params["max_model_len"], ctx.params["seed"]) == (
            10**9,
            64,
            3,
        )
    out = subprocess.run(
        [sys.executable, "-m", "services.prefill", "--help"], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )  # fmt: skip
    assert out.returncode == 0 and "--staging-memory" in out.stdout and "--host-cache-memory" in out.stdout


def _front_commands() -> dict[str, Any]:
    from services.router.__main__ import app as router_app

    commands = get_command(app).commands  # type: ignore[attr-defined]
    return {"serve": commands["serve"], "up": commands["up"], "router": get_command(router_app)}


def test_front_flags_of_serve_up_and_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same flags on the three: --api-key (else SWASERVE_API_KEY), --max-logprobs (20, at most the
    engine's bound, also 20), --served-model-name, --chat-template; the key's value is never in --help."""
    base = {"router": ["--prefill", "a:1", "--decode", "b:2"]}
    monkeypatch.delenv("SWASERVE_API_KEY", raising=False)
    for name, cmd in _front_commands().items():
        args = base.get(name, [])
        values = cmd.make_context(name, list(args)).params
        assert (values["api_key"], values["max_logprobs"], values["chat_template"]) == (None, 20, None), name
        assert values["served_model_name"] is None, name
        values = cmd.make_context(name, [*args, "--api-key", "k1", "--max-logprobs", "7"]).params
        assert (values["api_key"], values["max_logprobs"]) == ("k1", 7), name
        for bad in (
            ["--api-key", ""],
            ["--api-key", " k1"],
            ["--max-logprobs", "21"],
            ["--max-logprobs", "-1"],
        ):
            with pytest.raises(typer.BadParameter):
                cmd.make_context(name, [*args, *bad])
    monkeypatch.setenv("SWASERVE_API_KEY", "from-the-env-3f9a")
    for name, cmd in _front_commands().items():
        args = base.get(name, [])
        assert cmd.make_context(name, list(args)).params["api_key"] == "from-the-env-3f9a", name
        assert cmd.make_context(name, [*args, "--api-key", "flag"]).params["api_key"] == "flag", name
        assert "from-the-env-3f9a" not in cmd.get_help(cmd.make_context(name, list(args))), name
    res = runner.invoke(app, ["up", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert "SWASERVE_API_KEY" in res.output and "from-the-env-3f9a" not in res.output


def test_a_bad_chat_template_stops_serve_up_and_the_router_before_anything_starts(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Exit 2 naming the flag, before a model loads or a process starts (this test may start none)."""
    from services.router.__main__ import app as router_app

    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    for value, why in (
        (str(tmp_path / "chat.jinja"), "looks like a file path"),
        ("{% for %}", "does not render"),
    ):
        for cli, args in (
            (app, ["serve", "--model", str(tiny_dir)]),
            (app, ["up", "--model", str(tiny_dir), "--port", "0"]),
            (router_app, ["--model", str(tiny_dir), "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"]),
        ):
            res = runner.invoke(cli, [*args, "--chat-template", value], env=env)
            assert res.exit_code == 2, (args, res.output)
            assert "--chat-template" in res.output and why in res.output, res.output


def test_make_checkpoint_refuses_non_empty_out(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("keep me")
    res = runner.invoke(
        app,
        ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path)],
        env={"COLUMNS": "200", "NO_COLOR": "1"},
    )
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert (tmp_path / "x").read_text() == "keep me"


def test_make_checkpoint_tiny(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    res = runner.invoke(app, ["make-checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    from swaserve.config import ModelConfig

    assert ModelConfig.from_pretrained(out).vocab_size == 512


def test_replay_unreachable_server_exits_2() -> None:
    res = runner.invoke(app, ["replay", "--url", "http://127.0.0.1:9", "--limit", "1", "--no-progress"])
    assert res.exit_code == 2
    assert "cannot list models" in res.output


def test_replay_rejects_bad_options(tmp_path: Path) -> None:
    for args in (
        ["--reserved-ids", "5-1"],
        ["--time-scale", "0"],
        ["--trace", str(tmp_path / "none.jsonl")],
        ["--model-dir", str(tmp_path)],
    ):
        res = runner.invoke(app, ["replay", *args], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert res.exit_code == 2, args
        assert "Invalid value" in res.output, res.output


# ---------------------------------------------------------------------------------------------
# run_demo end to end on the tiny model


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from swaserve.model.checkpoint import tiny_model_dir

    return Path(tiny_model_dir())


def _demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "swaserve.run_demo", "--no-progress", *args]


@pytest.mark.cluster  # swaserve up as a subprocess
def test_up_refuses_a_busy_port_before_starting_workers(tiny_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "swaserve.cli", "up", "--model", str(tiny_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"router port 127.0.0.1:{port} is not available: Address already in use" in out, out
    assert "[prefill-0]" not in out and "[decode-0]" not in out, out  # no worker was started


@pytest.mark.slow
@pytest.mark.cluster  # make run's driver as a subprocess
def test_run_demo_once(tiny_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    proc = subprocess.run(
        _demo(
            "--once",
            "--model",
            str(tiny_dir),
            "--limit",
            "3",
            "--block-tokens",
            "4",
            "--max-output-tokens",
            "4",
            "--time-scale",
            "100",
            "--media",
            "4",
            "--json",
            str(report),
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 ok, 0 failed" in proc.stdout
    assert "media requests: 4/4 ok (1 audio, 2 image, 1 video)" in proc.stdout, proc.stdout
    assert re.search(r"server ready at http://127\.0\.0\.1:\d+", proc.stdout)
    assert report.is_file()


@pytest.mark.slow
@pytest.mark.cluster  # make run's driver as a subprocess
def test_run_demo_reports_a_server_that_dies(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "not_mimo"}')
    proc = subprocess.run(
        _demo("--once", "--model", str(tmp_path), "--limit", "1"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "exited with status" in proc.stderr and "not_mimo" in proc.stderr
    serve = subprocess.run(
        _demo("--once", "--mode", "serve", "--model", str(tmp_path), "--limit", "1"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert serve.returncode == 1
    assert "server exited with status" in serve.stderr and "not_mimo" in serve.stderr


@pytest.mark.slow
@pytest.mark.cluster  # make run's driver and pgrep as subprocesses
def test_run_demo_sigterm_stops_server(tiny_dir: Path) -> None:
    proc = subprocess.Popen(
        _demo("--model", str(tiny_dir), "--limit", "1", "--block-tokens", "4", "--max-output-tokens", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    url = None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            m = re.search(r"server ready at (http://\S+)", line)
            url = m.group(1) if m else url
            if "still serving" in line:
                break
            assert time.monotonic() < deadline
        assert url is not None
        assert httpx.get(f"{url}/health").status_code == 200
        children = subprocess.run(  # this demo's own children: other clusters may run on the machine
            ["pgrep", "-P", str(proc.pid), "-f", f"services\\.(router|prefill|decode) --model {tiny_dir}"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        assert len(children) == 3, "router + 1 prefill + 1 decode worker"
        cores = subprocess.run(
            ["pgrep", "-P", ",".join(children), "-f", "swaserve.engine.core_proc"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(cores) == 2, "each worker's engine core (--engine-process auto = separate)"
        children += cores
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
        for pid in children:  # no orphans
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep-size", "3"], "EP size 3 must divide the 8 routed experts"),
        (["--ep-size", "2", "--engine-process", "inline"], "runs each rank in its own process"),
        (["--ep-size", "2", "--ep-placement", "/nonexistent.json"], "expert placement /nonexistent.json"),
        (["--kv-cache-dtype", "int8", "--kv-quant-group", "5"], "group 5 does not divide head dim 32"),
        (
            ["--kv-cache-dtype", "kivi2", "--kv-kivi-residual", "9"],
            "key group <= residual <= window: 8 <= 9 <= 8",
        ),
        (["--kv-cache-dtype-swa", "kivi2", "--kv-kivi-residual", "4"], "SWA keys never leave the window"),
    ],
)
def test_serve_refuses_an_ep_or_kv_setup_that_cannot_start(
    tiny_dir: Path, args: list[str], message: str
) -> None:
    r = runner.invoke(app, ["serve", "--model", str(tiny_dir), *args])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.replace("│", " ").split())  # the rich error box's lines joined

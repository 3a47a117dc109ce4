"""The HTTP front's flags end to end: ``swaserve serve`` and ``swaserve up`` as a user starts them
(subprocesses on 127.0.0.1, the tiny model), checked with the official ``openai`` client:
``--api-key`` / ``SWASERVE_API_KEY``, ``--served-model-name``, ``--chat-template``,
``--max-logprobs`` and ``up --host``; the key never in any output line or child command line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from swaserve.procs import free_port
from tests.helpers.cluster import WORKER_ARGS

pytestmark = pytest.mark.cluster  # serve / up as subprocesses

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-e2e-9c41d07b3a2f"
NAME = "alias-7"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
MSGS: list[dict[str, str]] = [{"role": "user", "content": "hello there"}]


@dataclass
class Proc:
    """A child whose output lines are collected by a thread."""

    cmd: list[str]
    env: dict[str, str]
    lines: list[str] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, cwd=ROOT, env={**os.environ, **self.env},
        )  # fmt: skip
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float = 300) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if m := re.search(pattern, line):
                    return m
            seen = len(self.lines)
            assert self.proc is not None and self.proc.poll() is None, "\n".join(self.lines[-40:])
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in time:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.5)  # the pump's last lines
        return self.proc.returncode


@pytest.fixture
def running() -> Iterator[list[Proc]]:
    """Started ``Proc``s, stopped at the end whatever happens."""
    procs: list[Proc] = []
    yield procs
    for p in procs:
        if p.proc is not None:
            p.stop()


def children(pid: int) -> dict[int, tuple[list[str], str]]:
    """Child pid -> (command line, environment block) of ``pid``'s children."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    found = {}
    for c in map(int, out):
        try:
            cmdline = Path(f"/proc/{c}/cmdline").read_bytes().decode().split("\0")
            environ = Path(f"/proc/{c}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        found[c] = (cmdline, environ)
    return found


def check_the_front(url: str, max_logprobs: int) -> None:
    """What every flag does, seen from a client of ``url``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [NAME]
    out = client.completions.create(
        model=NAME, prompt="hello", max_tokens=2, temperature=0, logprobs=max_logprobs
    )
    assert out.model == NAME and out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.top_logprobs is not None
    assert len(out.choices[0].logprobs.top_logprobs[0]) == max_logprobs
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=NAME, prompt="hello", max_tokens=1, logprobs=max_logprobs + 1)
    assert bad.value.param == "logprobs"
    chat = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        r = h.post("/tokenize", json={"messages": MSGS})
        assert r.status_code == 200, r.text
        assert h.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == (
            "[user]hello there[bot]"
        )  # the template, not the tokenizer's
    assert chat.usage is not None and chat.usage.prompt_tokens == r.json()["count"]
    for key in ("wrong", KEY[:-1]):
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model=NAME, prompt="hello", max_tokens=1)
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=NAME, messages=MSGS)  # type: ignore[arg-type]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200


def test_serve_takes_the_key_from_the_environment(tiny_dir: Path, running: list[Proc]) -> None:
    port = free_port()
    serve = Proc(
        [sys.executable, "-m", "swaserve.cli", "serve", "--model", str(tiny_dir), "--port", str(port),
         "--served-model-name", NAME, "--chat-template", TEMPLATE, "--max-logprobs", "2",
         "--engine-process", "inline", "--kv-cache-memory", "8MiB", "--max-model-len", "256"],
        {"SWASERVE_API_KEY": KEY},
    )  # fmt: skip
    running.append(serve)
    serve.start()
    serve.wait_for(r"Uvicorn running on")
    check_the_front(f"http://127.0.0.1:{port}", 2)
    assert serve.stop() == 0
    out = "\n".join(serve.lines)
    assert "POST /v1/completions" in out or "Application startup complete" in out, out
    assert KEY not in out


@pytest.mark.slow
def test_up_hands_the_front_flags_to_its_router(tiny_dir: Path, tmp_path: Path, running: list[Proc]) -> None:
    """``up --host --api-key --served-model-name --chat-template FILE --max-logprobs``: the router
    binds --host and gets the others; the key through its environment, not its command line."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    worker_args = [f"--worker-arg={a}" for a in WORKER_ARGS]
    up = Proc(
        [sys.executable, "-m", "swaserve.cli", "up", "--model", str(tiny_dir), "--port", "0", "--no-redis",
         "--host", "localhost", "--api-key", KEY, "--served-model-name", NAME,
         "--chat-template", str(template), "--max-logprobs", "3", *worker_args],
        {},
    )  # fmt: skip
    running.append(up)
    up.start()
    url = up.wait_for(r"cluster ready: (http://localhost:\d+)").group(1)
    routers = {pid: c for pid, c in children(up.proc.pid).items() if "services.router" in c[0]}  # type: ignore[union-attr]
    assert len(routers) == 1, children(up.proc.pid)  # type: ignore[union-attr]
    (cmdline, environ), *_ = routers.values()
    assert cmdline[cmdline.index("--host") + 1] == "localhost"
    assert cmdline[cmdline.index("--served-model-name") + 1] == NAME
    assert cmdline[cmdline.index("--chat-template") + 1] == str(template)
    assert cmdline[cmdline.index("--max-logprobs") + 1] == "3"
    assert KEY not in " ".join(cmdline) and f"SWASERVE_API_KEY={KEY}" in environ.split("\0")
    for cmd, _ in children(up.proc.pid).values():  # type: ignore[union-attr]
        assert KEY not in " ".join(cmd)
    check_the_front(url, 3)
    r = httpx.get(f"{url}/workers", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{url}/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    assert up.stop() == 0
    out = "\n".join(up.lines)
    assert "[router]" in out and "[prefill-0]" in out, out
    assert KEY not in out

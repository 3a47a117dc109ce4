"""The admin token of the router's ``/workers`` (``--admin-token``; ``api.auth.AdminTokenAuth``), in
process: the router's app (``ClusterEngine`` over worker addresses nothing listens on) with the
API key, the admin token, both or neither. ``/workers`` and below: 401 without a token, 403 with
another one (the API key included), served with the admin token; ``/v1`` keeps needing the API key
(the admin token does not open it); ``/health`` and ``/metrics`` stay open; no response body and
no log line carries either secret. The router's warning when only ``--api-key`` is set."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

KEY = "sk-api-6c1f0e3b9a2d4e57"
ADMIN = "adm-7d2e9b41c5f08a63"
OPEN = {"/health", "/metrics"}


def statuses(tiny_dir: Path, api_key: str | None, admin_token: str | None) -> dict[tuple[str, str, str], int]:
    """(method, path, credential) -> status, for every credential: none, the API key, the admin
    token, a wrong one. Asserts that no body shows a secret."""
    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app
    from swaserve.api.workers import install_worker_routes

    calls = [
        ("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/workers"), ("GET", "/workers/x"),
        ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics"),
    ]  # fmt: skip
    creds = {"none": None, "api": KEY, "admin": ADMIN, "wrong": "nope"}
    out: dict[tuple[str, str, str], int] = {}

    async def run() -> None:
        engine = ClusterEngine(tiny_dir, ["127.0.0.1:1"], ["127.0.0.1:2"], poll_s=0.05)
        app = build_app(engine, api_key=api_key, admin_token=admin_token)  # type: ignore[arg-type]
        install_worker_routes(app, engine.admin)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c,
        ):
            for method, path in calls:
                for name, secret in creds.items():
                    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
                    body: dict[str, Any] = {"url": "nowhere"} if path == "/workers" else {}
                    r = await c.request(method, path, headers=headers, json=body)
                    assert KEY not in r.text and ADMIN not in r.text, (method, path, name, r.text)
                    if r.status_code == 401:
                        assert r.headers["www-authenticate"] == "Bearer"
                    out[(method, path, name)] = r.status_code

    asyncio.run(run())
    return out


def _auth(codes: dict[tuple[str, str, str], int], path_prefix: str) -> dict[str, set[int]]:
    """credential -> the auth outcomes (401, 403, else 0: let through) over the paths under ``path_prefix``."""
    got: dict[str, set[int]] = {}
    for (_, path, name), code in codes.items():
        if path.startswith(path_prefix):
            got.setdefault(name, set()).add(code if code in (401, 403) else 0)
    return got


def test_admin_token_and_api_key(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    codes = statuses(tiny_dir, KEY, ADMIN)
    assert _auth(codes, "/workers") == {"none": {401}, "api": {403}, "admin": {0}, "wrong": {403}}
    assert _auth(codes, "/v1") == {"none": {401}, "api": {0}, "admin": {401}, "wrong": {401}}
    assert codes[("GET", "/workers", "admin")] == 200 and codes[("GET", "/v1/models", "api")] == 200
    for path in OPEN:
        assert _auth(codes, path) == {n: {0} for n in ("none", "api", "admin", "wrong")}
    assert KEY not in caplog.text and ADMIN not in caplog.text


def test_admin_token_alone_guards_only_the_workers(tiny_dir: Path) -> None:
    codes = statuses(tiny_dir, None, ADMIN)
    assert _auth(codes, "/workers") == {"none": {401}, "api": {403}, "admin": {0}, "wrong": {403}}
    assert _auth(codes, "/v1") == {n: {0} for n in ("none", "api", "admin", "wrong")}


def test_without_an_admin_token_the_api_key_guards_the_workers_as_before(tiny_dir: Path) -> None:
    codes = statuses(tiny_dir, KEY, None)
    for prefix in ("/workers", "/v1"):
        assert _auth(codes, prefix) == {"none": {401}, "api": {0}, "admin": {401}, "wrong": {401}}
    codes = statuses(tiny_dir, None, None)
    assert _auth(codes, "/workers") == {n: {0} for n in ("none", "api", "admin", "wrong")}


def test_a_padded_admin_token_is_refused(tiny_dir: Path) -> None:
    from services.router.__main__ import app
    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app

    engine = ClusterEngine(tiny_dir, ["127.0.0.1:1"], ["127.0.0.1:2"])
    for bad in ("", " x", "x\n"):
        with pytest.raises(ValueError, match="admin token"):
            build_app(engine, admin_token=bad)  # type: ignore[arg-type]
    r = CliRunner().invoke(app, ["--prefill", "a:1", "--decode", "b:1"], env={"SWASERVE_ADMIN_TOKEN": " x"})
    assert r.exit_code == 2 and "admin token" in r.output


def test_the_router_warns_when_only_the_api_key_guards_the_workers(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Logged at start, before anything else is checked (here a bad --policy stops it next)."""
    from services.router.__main__ import app

    args = ["--prefill", "a:1", "--decode", "b:1", "--model", str(tiny_dir), "--policy", "nope"]
    caplog.set_level(logging.WARNING)
    r = CliRunner().invoke(app, args, env={"SWASERVE_API_KEY": KEY, "SWASERVE_ADMIN_TOKEN": None})
    assert r.exit_code == 2, r.output
    assert "no --admin-token" in caplog.text and KEY not in caplog.text + r.output
    caplog.clear()
    env = {"SWASERVE_API_KEY": KEY, "SWASERVE_ADMIN_TOKEN": ADMIN}
    assert CliRunner().invoke(app, args, env=env).exit_code == 2
    assert "no --admin-token" not in caplog.text


def test_up_and_the_router_take_the_admin_token_from_the_environment() -> None:
    """``--admin-token`` on ``swaserve up`` and the router, read from SWASERVE_ADMIN_TOKEN; its value
    is never shown in --help."""
    from typer.main import get_command

    from services.router.__main__ import app as router_app
    from swaserve.cli import app

    commands = {"up": get_command(app).commands["up"], "router": get_command(router_app)}  # type: ignore[attr-defined]
    base = {"router": ["--prefill", "a:1", "--decode", "b:2"]}
    for name, cmd in commands.items():
        args = base.get(name, [])
        assert cmd.make_context(name, [*args, "--admin-token", "t1"]).params["admin_token"] == "t1"
        r = CliRunner().invoke(router_app if name == "router" else app, [*([] if name == "router" else ["up"]), "--help"],
                               env={"SWASERVE_ADMIN_TOKEN": ADMIN, "COLUMNS": "200"})  # fmt: skip
        assert r.exit_code == 0 and "SWASERVE_ADMIN_TOKEN" in r.output and ADMIN not in r.output, r.output

"""UCX's own loopback throughput: the ``ucx_perftest`` binary of the libucx wheel, server and client
on 127.0.0.1, ``tag_bw`` over ``tcp,self`` per message size. It is the physical-limit anchor for
GCache's UCX data plane (services/gcache/ucx.py): ``swaserve bench gcache`` reports its MB/s as a
share of these. ``-e`` (endpoint error handling) is on by default, as GCache's endpoints have it.

MB/s here are as ucx_perftest prints them: 2^20 bytes per MB (``bytes_per_s`` has plain bytes).
Latencies are microseconds per message. ucx_perftest busy-polls both sides, so runs are kept short
(``budget_bytes`` per size, a few seconds in all on 2 cores).

    python -m bench.ucx_perftest [--json PATH] [--sizes 65536,1048576,4194304]

Research notes: ../shared/research/gcache_ucx.md section 3.4."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from swaserve.procs import free_port

DEFAULT_SIZES = (64 << 10, 1 << 20, 4 << 20)
CSV_HEADER = "iterations,"  # the first field of ``-f -v`` output's header line


class PerftestMissing(FileNotFoundError):
    """No ``ucx_perftest`` binary: the libucx wheel is not installed."""


def find_perftest() -> tuple[Path, Path]:
    """(the ``ucx_perftest`` binary, the directory of its UCX libraries). Raises ``PerftestMissing``."""
    try:
        import libucx
    except ImportError as e:
        raise PerftestMissing(
            "ucx_perftest ships in the libucx-cu12 wheel, which is not installed: "
            "pip install -e '.[gcache]' (or make .venv)"
        ) from e
    root = Path(libucx.__file__).resolve().parent
    binary = root / "bin" / "ucx_perftest"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise PerftestMissing(
            f"no executable ucx_perftest at {binary} (libucx {getattr(libucx, '__version__', '?')})"
        )
    return binary, root / "lib"


def _env(libdir: Path, tls: str, ucx_env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its ``UCX_*`` settings (UCX's defaults), then
    ``ucx_env``, the library path and ``UCX_TLS``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(ucx_env or {})
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libdir), env.get("LD_LIBRARY_PATH", "")) if p)
    env["UCX_TLS"] = tls
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return env


def parse_csv(out: str) -> dict[str, float]:
    """The final row of ``ucx_perftest -f -v`` output, by column name. Raises ValueError."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.startswith(CSV_HEADER) and i + 1 < len(lines):
            names, values = ln.split(","), lines[i + 1].split(",")
            if len(names) == len(values):
                return {n: float(v) for n, v in zip(names, values, strict=True)}
    raise ValueError(f"no ucx_perftest result in its output: {out[-500:]!r}")


def pinned(cpu: int | None) -> list[str]:
    """A command prefix running it on CPU ``cpu`` (``taskset``), or none."""
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


def pin_cpus() -> tuple[int, int] | None:
    """(server CPU, client CPU): two CPUs this process may use, so a server and its client run
    apart as on two machines (on a 2-core machine sharing one core halves and destabilises
    loopback throughput); None with fewer than two or without ``taskset``."""
    import shutil

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (cpus[0], cpus[1]) if len(cpus) >= 2 and shutil.which("taskset") else None


def _one(
    binary: Path,
    env: dict[str, str],
    size: int,
    test: str,
    iters: int,
    error_handling: bool,
    timeout_s: float,
    cpus: tuple[int, int] | None = None,
) -> dict[str, float]:
    """One server + client run of ``test`` at ``size`` bytes (on ``cpus``: server, client).
    Raises RuntimeError."""
    port = free_port()
    server_cpu, client_cpu = cpus or (None, None)
    server = subprocess.Popen(
        [*pinned(server_cpu), str(binary), "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    cmd = [*pinned(client_cpu), str(binary), "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size)]
    cmd += ["-n", str(iters), "-w", str(max(2, iters // 10)), "-f", "-v"] + (["-e"] if error_handling else [])
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # the server may not listen yet: the client then fails at once
            left = deadline - time.monotonic()
            if left <= 0 or server.poll() is not None:
                err = server.stderr.read() if server.poll() is not None and server.stderr else ""
                raise RuntimeError(f"ucx_perftest {test} {size} B: no result in {timeout_s} s {err[-300:]}")
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
            if run.returncode == 0:
                return parse_csv(run.stdout)
            if "connect() failed" not in run.stdout + run.stderr:
                raise RuntimeError(
                    f"ucx_perftest {test} {size} B failed ({run.returncode}): {(run.stdout + run.stderr)[-500:]}"
                )
            time.sleep(0.05)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"ucx_perftest {test} {size} B: no result in {timeout_s} s") from e
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        if server.stderr:
            server.stderr.close()


def run_perftest(
    sizes: tuple[int, ...] | list[int] = DEFAULT_SIZES,
    *,
    test: str = "tag_bw",
    tls: str = "tcp,self",
    error_handling: bool = True,
    budget_bytes: int = 256 << 20,
    max_iters: int = 2000,
    timeout_s: float = 30.0,
    cpus: tuple[int, int] | None = None,
    ucx_env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """ucx_perftest ``test`` on 127.0.0.1 for each message size (bytes): per size a dict with
    size_bytes, iterations, mb_per_s (2^20 B/s, overall), bytes_per_s, lat_typical_us (the
    median), lat_avg_us, msg_per_s, plus test, tls, error_handling. Iterations per size:
    ``budget_bytes / size`` within [20, max_iters]. ``cpus``: (server CPU, client CPU), else
    unpinned. ``ucx_env``: UCX settings for both sides (else UCX's defaults: inherited ``UCX_*``
    variables are dropped), recorded in each row. Raises ``PerftestMissing`` (no binary) or
    RuntimeError (a run failed or took over ``timeout_s`` seconds)."""
    binary, libdir = find_perftest()
    env = _env(libdir, tls, ucx_env)
    rows = []
    for size in sizes:
        iters = max(20, min(max_iters, budget_bytes // max(1, size)))
        r = _one(binary, env, int(size), test, iters, error_handling, timeout_s, cpus)
        rows.append(
            {
                "test": test, "tls": tls, "error_handling": error_handling, "size_bytes": int(size),
                "iterations": int(r["iterations"]), "mb_per_s": r["overall_bw"],
                "bytes_per_s": r["overall_bw"] * (1 << 20), "lat_typical_us": r.get("50.0_percentile_lat", 0.0),
                "lat_avg_us": r["avg_lat"], "msg_per_s": r["overall_mr"], "ucx_env": dict(ucx_env or {}),
            }
        )  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(
        f"ucx_perftest {r0['test']} on 127.0.0.1, UCX_TLS={r0['tls']}, error handling {'on' if r0['error_handling'] else 'off'}"
    )
    print(f"{'size':>10}{'iters':>8}{'MB/s':>10}{'lat typ us':>12}{'lat avg us':>12}{'msg/s':>10}")
    for r in rows:
        print(
            f"{_size(r['size_bytes']):>10}{r['iterations']:>8}{r['mb_per_s']:>10.1f}"
            f"{r['lat_typical_us']:>12.2f}{r['lat_avg_us']:>12.2f}{r['msg_per_s']:>10.0f}"
        )


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--json", type=Path, help="Write the rows here as JSON.")
    ap.add_argument(
        "--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="Message sizes in bytes, comma-separated."
    )
    ap.add_argument("--tls", default="tcp,self", help="UCX_TLS for both sides.")
    ap.add_argument(
        "--no-error-handling", action="store_true", help="Run without -e (faster, not GCache's mode)."
    )
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    try:
        rows = run_perftest(sizes, tls=args.tls, error_handling=not args.no_error_handling)
    except PerftestMissing as e:
        raise SystemExit(f"ucx_perftest: {e}") from e
    print_table(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ucx_perftest": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()

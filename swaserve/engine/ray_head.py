"""A local Ray head in a process of its own: ``python -m swaserve.engine.ray_head --num-cpus N``.

``init_ray`` starts one here rather than calling ``ray.init()`` in the front: Ray spawns its
servers with a ``preexec_fn`` (Python code between fork and exec), which can deadlock in a process
with many threads (gRPC, torch, the event loop) and then holds every inherited descriptor open.
This process has none of those threads when Ray forks.

Protocol: the head prints ``ADDRESS <gcs host:port>`` on its stdout and closes it, or exits non-zero
with the reason on stderr; it then serves until its stdin reaches EOF (the parent closed it or
died) or SIGTERM, and shuts Ray down. Ray's own output and its children's go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator

OBJECT_STORE_BYTES = 96 << 20  # the ranks pass no objects through it
LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """Keep a Ray node on 127.0.0.1: Ray turns a loopback node address into the machine's
    routable one (``ray._private.services.resolve_ip_for_localhost``); replacing that one function
    for the call is the only way to keep a local Ray off the network."""
    import ray._private.services as services

    keep = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host  # type: ignore[assignment]
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = keep  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swaserve.engine.ray_head", description=__doc__)
    ap.add_argument("--num-cpus", type=int, required=True, help="CPUs the local Ray offers")
    args = ap.parse_args(argv)
    # the pipes to the parent get private descriptors; Ray and its children see stderr and /dev/null
    report = os.fdopen(os.dup(1), "w")
    control = os.dup(0)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # to the finally: Ray shut down
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    try:
        with loopback_node():
            ray.init(
                num_cpus=args.num_cpus,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                object_store_memory=OBJECT_STORE_BYTES,
                configure_logging=False,
                log_to_driver=False,
            )
        node_ip = ray.util.get_node_ip_address()
        if node_ip != LOOPBACK:
            print(
                f"a local Ray came up on {node_ip}, not {LOOPBACK}: refusing to serve off loopback",
                file=sys.stderr,
            )
            return 1
        report.write(f"ADDRESS {ray.get_runtime_context().gcs_address}\n")
        report.close()
        while os.read(control, 4096):  # until EOF: the parent is done or gone
            pass
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

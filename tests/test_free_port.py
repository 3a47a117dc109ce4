"""``free_port``: ports for children to bind later, away from where outgoing connections get theirs."""

from __future__ import annotations

import socket

from swaserve.procs import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    low = _ephemeral_low()
    assert all(p < low for p in ports), (low, ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))

"""``free_port``: ports for children to bind later, away from where outgoing connections get theirs."""

from __future__ import annotations

import socket

import pytest

from swaserve.procs import PORT_RANGE_ENV, _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    low = _ephemeral_low()
    assert all(p < low for p in ports), (low, ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_range_variable_confines_ports_and_a_bad_one_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-22000")
    ports = [free_port() for _ in range(50)]
    assert all(21000 <= p < 22000 for p in ports), ports
    assert len(set(ports)) == len(ports)
    for bad in ("21000", "22000-21000", "a-b", "0-100", "1000-70000"):
        monkeypatch.setenv(PORT_RANGE_ENV, bad)
        with pytest.raises(ValueError, match=PORT_RANGE_ENV):
            free_port()

"""Kubernetes discovery, pure half (``swaserve.routing.discovery``): which pods are workers in use,
``PodSet`` over a LIST and watch events, and discovered workers in the ``RegistryReplica`` (they
count as command-line workers; a registry change older than the pod does not apply to it)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.routing.discovery import DiscoveredWorker, PodSet, check_pod, count_roles
from swaserve.routing.registry import ACTIVE, REMOVED, RegistryReplica, WorkerEntry


def pod(
    name: str = "p0", role: str | None = "prefill", ip: str | None = "10.0.0.1", port: str | None = None,
    ready: bool = True, phase: str = "Running", deleting: bool = False, created: str = "2024-05-01T10:00:00Z",
    rv: int = 1,
) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {
        "name": name, "resourceVersion": str(rv), "creationTimestamp": created,
        "labels": {"app.kubernetes.io/name": "swaserve", **({"swaserve.io/role": role} if role else {})},
        "annotations": {"swaserve.io/grpc-port": port} if port is not None else {},
    }  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = "2024-05-01T11:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_a_running_ready_pod_with_a_role_is_a_worker_at_its_ip_and_port() -> None:
    w = check_pod(pod(port="7000"))
    assert w == DiscoveredWorker("10.0.0.1:7000", "prefill", 1714557600.0, "p0")
    assert check_pod(pod(role="decode"), default_port=50051).address == "10.0.0.1:50051"  # type: ignore[union-attr]
    assert check_pod(pod(ip="fd00::5")).address == "[fd00::5]:50051"  # type: ignore[union-attr]
    assert check_pod(pod(created="nonsense")).since == 0.0  # type: ignore[union-attr]


def test_pods_not_in_use_say_why() -> None:
    cases = {
        "not a worker role": pod(role=None),
        "'encoder' is not": pod(role="encoder"),
        "terminating": pod(deleting=True),
        "phase Pending": pod(phase="Pending"),
        "not Ready": pod(ready=False),
        "no pod IP": pod(ip=None),
        "not a port": pod(port="http"),
    }
    for why, p in cases.items():
        got = check_pod(p)
        assert isinstance(got, str) and why in got, (why, got)
    assert check_pod(pod(port="70000")) == "annotation swaserve.io/grpc-port='70000' is not a port"
    no_conditions = pod()
    del no_conditions["status"]["conditions"]
    assert check_pod(no_conditions) == "not Ready"


def test_pod_set_follows_events_and_a_list_repairs_missed_ones() -> None:
    s = PodSet()
    s.reset([pod("p0", rv=3), pod("d0", role="decode", ip="10.0.0.2", rv=4)], "5")
    assert s.rv == "5" and sorted(s.desired()) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    s.apply("MODIFIED", pod("p0", ready=False, rv=6))  # not Ready: out
    assert sorted(s.desired()) == ["10.0.0.2:50051"] and s.rv == "6"
    assert s.ignored() == {"p0": "not Ready"}
    s.apply("MODIFIED", pod("p0", rv=7))
    s.apply("MODIFIED", pod("d0", role="decode", ip="10.0.0.2", deleting=True, rv=8))  # terminating: out
    assert sorted(s.desired()) == ["10.0.0.1:50051"]
    s.apply("DELETED", pod("d0", role="decode", ip="10.0.0.2", deleting=True, rv=9))
    assert "d0" not in s.pods
    s.apply("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "12"}})
    assert s.rv == "12" and sorted(s.pods) == ["p0"]
    s.apply("ERROR", {"metadata": {}})  # not a pod event: ignored
    s.apply("ADDED", pod("p1", ip="10.0.0.3", rv=13))
    assert count_roles(s.desired().values()) == {"prefill": 2, "decode": 0}
    # p0's DELETED was missed; the next LIST has no p0: it goes
    s.reset([pod("p1", ip="10.0.0.3", rv=13)], "15")
    assert list(s.desired()) == ["10.0.0.3:50051"] and s.rv == "15"


def test_two_pods_on_one_address_the_newest_wins() -> None:
    s = PodSet()
    s.reset(
        [
            pod("old", role="decode", created="2024-05-01T10:00:00Z"),
            pod("new", created="2024-05-02T10:00:00Z"),
        ],
        "1",
    )
    assert s.desired()["10.0.0.1:50051"].pod == "new"


_NAMES = ("a", "b", "c")
_OPS = st.lists(
    st.tuples(
        st.sampled_from(("add", "ready", "unready", "terminate", "delete", "unlabel")),
        st.sampled_from(_NAMES),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_events_give_the_same_workers_as_a_list_of_the_result(ops: list[tuple[str, str]]) -> None:
    """Any sequence of pod changes, fed as watch events, leaves the same workers as a LIST of the
    pods they leave."""
    truth: dict[str, dict[str, Any]] = {}
    s = PodSet()
    s.reset([], "1")
    for rv, (op, name) in enumerate(ops, start=2):
        p = truth.get(name)
        if op == "add" and p is None:
            truth[name] = pod(name, ip=f"10.0.0.{_NAMES.index(name) + 1}", ready=False, rv=rv)
            s.apply("ADDED", copy.deepcopy(truth[name]))
        elif op == "delete" and p is not None:
            s.apply("DELETED", truth.pop(name))
        elif p is not None:
            if op in ("ready", "unready"):
                p["status"]["conditions"] = [{"type": "Ready", "status": str(op == "ready")}]
            elif op == "terminate":
                p["metadata"]["deletionTimestamp"] = "2024-05-01T11:00:00Z"
            else:
                p["metadata"]["labels"].pop("swaserve.io/role", None)
            p["metadata"]["resourceVersion"] = str(rv)
            s.apply("MODIFIED", copy.deepcopy(p))
    listed = PodSet()
    listed.reset(list(truth.values()), "x")
    assert s.desired() == listed.desired()


def test_discovered_workers_count_as_command_line_workers() -> None:
    r = RegistryReplica({"10.0.0.9:1": "decode"})
    r.discover({"10.0.0.1:50051": ("prefill", 100.0)})
    assert r.effective() == {"10.0.0.9:1": "decode", "10.0.0.1:50051": "prefill"}
    assert r.source("10.0.0.1:50051") == "kubernetes" and r.source("10.0.0.9:1") == "flag"
    r.discover({})  # the pod went: so does its worker
    assert r.effective() == {"10.0.0.9:1": "decode"}


def test_a_removal_applies_to_the_pod_it_was_made_for_not_to_a_later_pod_on_its_ip() -> None:
    r = RegistryReplica({})
    r.discover({"10.0.0.1:50051": ("prefill", 100.0)})
    r.set(WorkerEntry("10.0.0.1:50051", "prefill", REMOVED, 150.0))  # an operator took the pod out
    assert r.effective() == {} and r.source("10.0.0.1:50051") == "registry"
    r.discover({"10.0.0.1:50051": ("decode", 200.0)})  # a new pod got the IP later
    assert r.effective() == {"10.0.0.1:50051": "decode"} and r.source("10.0.0.1:50051") == "kubernetes"
    r.set(WorkerEntry("10.0.0.1:50051", "decode", ACTIVE, 250.0))  # and it is added by hand too
    r.discover({})
    assert r.effective() == {"10.0.0.1:50051": "decode"}  # the registry entry keeps it

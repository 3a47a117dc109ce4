"""Import structure of ``swaserve``, ``services`` and ``bench``: the layer contracts of
pyproject.toml (``[tool.importlinter]``, run through import-linter), no import cycles between
modules (``TYPE_CHECKING`` and function-level imports count), and a sans-IO core. The layer order
is written in docs/ARCHITECTURE.md ("Layers").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swaserve", "services", "bench")

# the sans-IO core: these packages reach none of BLOCKING_IO, directly or through other modules
SANS_IO = (
    "swaserve.kvcache",
    "swaserve.gcache",
    "swaserve.sched",
    "swaserve.transfer",
    "swaserve.routing",
    "swaserve.engine",
    "swaserve.encoder",
    "swaserve.sim",
)
# ... except these I/O shells (and what only they import); names not in the tree are skipped
IO_SHELLS = (
    "swaserve.routing.redis",
    "swaserve.engine.async_engine",
    "swaserve.engine.mp_client",
    "swaserve.engine.ep_client",
    "swaserve.engine.ray_ranks",
    "swaserve.engine.core_proc",
    "swaserve.engine.ipc",
)
BLOCKING_IO = (
    "redis",
    "grpc",
    "socket",
    "httpx",
    "zmq",
    "uvicorn",
    "fastapi",
    "aiohttp",
    "kubernetes_asyncio",
)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _in(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph (iterative: no recursion limit).

    Args:
        edges: node -> the nodes it points to (every node a key).

    Returns:
        The components, each a list of nodes; a node alone (without a self-edge) is one too.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    out.append(comp)
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(edges[w])))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return out


def test_strongly_connected_finds_cycles() -> None:
    comps = strongly_connected({"a": ["b"], "b": ["c", "d"], "c": ["a"], "d": ["d"], "e": []})
    assert sorted(sorted(c) for c in comps) == [["a", "b", "c"], ["d"], ["e"]]


def test_layer_contracts(capsys: pytest.CaptureFixture[str]) -> None:
    from importlinter.cli import EXIT_STATUS_SUCCESS, lint_imports

    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == EXIT_STATUS_SUCCESS, capsys.readouterr().out


def _path(edges: Mapping[str, Iterable[str]], start: str, goal: str, within: set[str]) -> list[str]:
    """A shortest path ``start .. goal`` over ``edges`` inside ``within`` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier and goal not in parent:
        nxt = []
        for m in frontier:
            for x in edges[m]:
                if x in within and x not in parent:
                    parent[x] = m
                    nxt.append(x)
        frontier = nxt
    path = [goal]
    while path[-1] != start or len(path) == 1:
        path.append(parent[path[-1]])
    return path[::-1]


def _line(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    d = graph.get_import_details(importer=importer, imported=imported)
    return f"{importer} -> {imported}" + (f" (l.{d[0]['line_number']})" if d else "")


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    mods = sorted(m for m in graph.modules if _ours(m))
    edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if _ours(x)) for m in mods}
    cycles = [sorted(c) for c in strongly_connected(edges) if len(c) > 1 or c[0] in edges[c[0]]]
    lines = []
    for comp in cycles:  # each: its modules, then one cycle through the first of them
        one = _path(edges, comp[0], comp[0], set(comp))
        lines.append(f"{len(comp)} modules import each other: {', '.join(comp)}; e.g.")
        lines += [f"  {_line(graph, a, b)}" for a, b in itertools.pairwise(one)]
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_core_does_no_io(graph: grimp.ImportGraph) -> None:
    core = sorted(m for m in graph.modules if _in(m, SANS_IO) and not _in(m, IO_SHELLS))
    assert "swaserve.kvcache.manager" in core and "swaserve.engine.scheduler" in core
    parent = dict.fromkeys(core, "")
    frontier, bad = core, []
    while frontier:  # breadth first from the whole core over our modules, never into an I/O shell
        nxt = []
        for m in frontier:
            for x in sorted(graph.find_modules_directly_imported_by(m)):
                if x in parent or (_ours(x) and _in(x, IO_SHELLS)):
                    continue
                parent[x] = m
                if _ours(x):
                    nxt.append(x)
                elif x in BLOCKING_IO:
                    chain = [x]
                    while parent[chain[-1]]:
                        chain.append(parent[chain[-1]])
                    bad.append(" -> ".join(chain[:1:-1]) + f" -> {_line(graph, m, x)}")
        frontier = nxt
    assert not bad, "the sans-IO core reaches blocking I/O:\n" + "\n".join(bad)

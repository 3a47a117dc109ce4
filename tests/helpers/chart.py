"""The chart's example values and golden files (``deploy/helm/examples``); rendering is
``bench.chart``'s.

``python -m tests.helpers.chart --update`` (``make chart-golden``) rewrites
``deploy/helm/examples/output-*.yaml`` after an intended chart change: review the diff."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from bench.chart import CHART, CRD_APIS, NAMESPACE, RELEASE, ROOT, notes, render, render_manifests

__all__ = ["CHART", "CRD_APIS", "NAMESPACE", "RELEASE", "notes", "render", "render_manifests"]
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
REDACTED = "<random: generated at install>"


def example_values() -> dict[str, dict[str, Any]]:
    """Example name (``default`` + each ``values-NAME.yaml``) -> values."""
    out: dict[str, dict[str, Any]] = {"default": {}}
    for p in sorted(EXAMPLES.glob("values-*.yaml")):
        out[p.stem.removeprefix("values-")] = yaml.safe_load(p.read_text()) or {}
    return out


def golden_text(values: dict[str, Any]) -> str:
    """The objects as one YAML stream, Secrets' random data redacted (deterministic)."""
    docs = render(values)
    for d in docs:
        if d["kind"] == "Secret" and d.get("data"):
            d["data"] = {k: REDACTED for k in d["data"]}
    return yaml.safe_dump_all(docs, sort_keys=False, width=120)


def golden_path(name: str) -> Path:
    return EXAMPLES / f"output-{name}.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--update", action="store_true", help="rewrite the golden files")
    args = ap.parse_args()
    stale = 0
    for name, values in example_values().items():
        text, path = golden_text(values), golden_path(name)
        if args.update:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
        elif not path.exists() or path.read_text() != text:
            stale += 1
            print(f"{path.relative_to(ROOT)} differs")
    raise SystemExit(1 if stale else 0)


if __name__ == "__main__":
    main()

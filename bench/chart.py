"""Render the Helm chart (``deploy/helm/swaserve``) with Helm's own engine (``helm-python-sdk``,
which embeds Helm 4), offline: what ``helm template`` prints, as text or as objects. Used by the
chart tests, the kubelet emulator's tests and ``swaserve bench drain``."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "swaserve"
RELEASE, NAMESPACE = "rel", "swaserve"
KUBE_VERSION = "v1.30.0"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: about 13x faster on a render
# CRDs a cluster with the Prometheus Operator and KEDA has: the optional objects render with them
CRD_APIS = (
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
    "keda.sh/v1alpha1/ScaledObject",
)


@functools.cache
def _chart() -> Any:
    """The chart, loaded once per process (a loaded ``helm_python.Chart`` is immutable and
    thread-safe)."""
    import helm_python

    return helm_python.Chart.load(CHART)


def render_manifests(
    values: dict[str, Any],
    api_versions: tuple[str, ...] = CRD_APIS,
    kube_version: str = KUBE_VERSION,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """Template path -> rendered text (``NOTES.txt`` included), as ``helm template --api-versions
    ... --kube-version ...`` renders it.

    Raises:
        helm_python.HelmValuesError: values the schema refuses.
        helm_python.HelmRenderError: a template fails (e.g. a ``fail`` guard).
    """
    from helm_python import _native  # render options (api_versions, kube_version) are not public yet

    chart = _chart()
    chart.validate_schema(values)
    opts = {
        "name": name,
        "namespace": namespace,
        "api_versions": list(api_versions),
        "kube_version": kube_version,
    }
    raw = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
    rendered: dict[str, str] = json.loads(raw)
    return rendered


def render(values: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """The rendered Kubernetes objects, in template order (empty documents dropped)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render_manifests(values, **kw).items()):
        if not path.endswith("NOTES.txt"):
            docs.extend(d for d in yaml.load_all(text, Loader=_LOADER) if d)
    return docs


def notes(values: dict[str, Any], **kw: Any) -> str:
    """The rendered NOTES.txt."""
    return next(t for p, t in render_manifests(values, **kw).items() if p.endswith("NOTES.txt"))

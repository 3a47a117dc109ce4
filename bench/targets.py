"""A bench target as the JSON holds it: the figure measured in the run beside its bound."""

from __future__ import annotations

import math
import operator
from typing import Any

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def target(name: str, value: float | None, op: str, threshold: float, note: str = "") -> dict[str, Any]:
    """``{"name", "value", "op", "threshold", "status", "note"}``; status PASS or MISS, N/A when
    ``value`` is missing or not finite. ``op``: one of >=, >, <=, <. Raises KeyError for another."""
    compare = _OPS[op]
    if value is None or not math.isfinite(value):
        status = "N/A"
    else:
        status = "PASS" if compare(value, threshold) else "MISS"
    return {"name": name, "value": value, "op": op, "threshold": threshold, "status": status, "note": note}

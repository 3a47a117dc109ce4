"""``on_meta``: build modules on the meta device without running their random init.

A checkpoint replaces every weight, so the init is wasted; on the meta device it is worse than
wasted: ``torch.nn.init`` goes through ``torch._refs``, whose first call imports ``torch._dynamo``
(about 2 s of CPU, a third of an engine process's start)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import init

_INITS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
_lock = threading.Lock()


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside get meta tensors and no init (``torch.nn.init``'s in-place functions
    return their tensor unchanged while inside: the patch is process-wide, so another thread
    initializing a real module at the same moment would skip its init too)."""
    with _lock:
        saved = {name: getattr(init, name) for name in _INITS}
        try:
            for name in _INITS:
                setattr(init, name, _keep)
            with torch.device("meta"):
                yield
        finally:
            for name, fn in saved.items():
                setattr(init, name, fn)

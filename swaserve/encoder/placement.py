"""Which encoder gets a media item: rendezvous (highest random weight) hashing on the item's key
over the live encoders, with a bounded-load fallback.

Each encoder's weight for a key is ``BLAKE2b(encoder id, 0, key)`` (8 bytes, big-endian order),
the same score as ``swaserve.gcache.l3.owner`` uses for L3 pages, so the first choice of an
unloaded fleet is ``l3.owner(key, encoders)`` (a test pins it; ``owner`` keeps its scoring inside,
so the one-line weight is restated here). Stable across processes and machines; no ring state;
when an encoder joins, only the keys it now wins move (about 1/(N+1) of them), so an item keeps
hitting the embedding cache of the encoder that computed it. An encoder whose load is over
``bound`` times the mean (+ one item's load, so an idle fleet always takes an item) goes behind
the others, keeping their order: the next-best candidate takes its items while it is busy, as in
consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018). SGLang and vLLM
spread items by count or at random instead; content placement is the cache's reason to exist."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def weight(key: bytes, encoder: str) -> bytes:
    """``encoder``'s rendezvous weight for ``key`` (compare as bytes: higher wins)."""
    return hashlib.blake2b(encoder.encode() + b"\0" + key, digest_size=8).digest()


def rank(key: bytes, encoders: Sequence[str]) -> list[str]:
    """``encoders`` (duplicates dropped) in rendezvous order for ``key``, best first."""
    return sorted(dict.fromkeys(encoders), key=lambda e: (weight(key, e), e), reverse=True)


def choose(
    key: bytes, encoders: Sequence[str], load: Mapping[str, float], bound: float = 1.25, slack: float = 1.0
) -> list[str]:
    """Encoders to try for the item ``key``, in preference order.

    Args:
        key: the item's content key.
        encoders: the live encoders' ids (e.g. addresses); empty gives an empty list.
        load: each encoder's load (queued items or tokens; absent = 0).
        bound: an encoder with load over ``bound * mean + slack`` is overloaded (mean over
            ``encoders``), >= 1.
        slack: one item's load in ``load``'s units (1 for queued items), so an idle fleet
            always takes an item on its first choice.

    Returns:
        The rendezvous order, with the overloaded encoders moved after the others (each group
        keeping that order): the first is where to send the item, the rest are retry candidates.

    Raises:
        ValueError: ``bound < 1``, a negative ``slack`` or a negative load.
    """
    if bound < 1 or slack < 0:
        raise ValueError(f"need bound >= 1 and slack >= 0, got {bound}, {slack}")
    order = rank(key, encoders)
    if not order:
        return []
    loads = [load.get(e, 0.0) for e in order]
    if min(loads) < 0:
        raise ValueError(f"loads must be >= 0, got {dict(zip(order, loads, strict=True))}")
    limit = bound * sum(loads) / len(order) + slack
    fine = [e for e, x in zip(order, loads, strict=True) if x <= limit]
    return fine + [e for e, x in zip(order, loads, strict=True) if x > limit]

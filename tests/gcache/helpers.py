"""Page objects for store tests: a chain of pages over random tokens."""

from __future__ import annotations

import random

from swaserve.gcache import codec
from swaserve.gcache.keys import Salt, page_keys

SALT = Salt("fp", "w", "float32", 4).seed()
PAGE = 4


def chain(tokens: list[int], kind: int = codec.FULL_KIND, payload: int = 100, seed: int = 0) -> list[dict]:
    """One page object per whole page of ``tokens``: dicts with pid, parent, index, obj."""
    keys = page_keys(tokens, PAGE, SALT)
    rng = random.Random(seed)
    out, parent = [], SALT
    for i, k in enumerate(keys):
        body = bytes(rng.randrange(256) for _ in range(payload))
        obj = codec.encode(kind, i, SALT, k, parent, tokens[i * PAGE : (i + 1) * PAGE], body)
        out.append({"pid": (k, kind), "parent": parent, "index": i, "obj": obj, "body": body})
        parent = k
    return out


def put(store, page: dict) -> str | int:
    r = store.reserve(page["pid"], page["parent"], page["index"], len(page["obj"]))
    if isinstance(r, int):
        store.commit(r, page["obj"])
    return r

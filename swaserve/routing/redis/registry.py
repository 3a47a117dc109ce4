"""The worker registry (``routing.registry``) in Redis: one Lua script per sync, which stores each
entry unless a newer one is stored and returns them all. Layout (``{ns}`` a hash tag, as in
``routing.redis.store``)::

    {ns}:workers    HASH address -> "<at> <state> <role>"
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from swaserve.routing.registry import WorkerEntry, WorkerRegistry

_SYNC = """
local key = ARGV[1] .. ':workers'
for k = 2, #ARGV, 2 do
  local addr, val = ARGV[k], ARGV[k + 1]
  local cur = redis.call('HGET', key, addr)
  local write = not cur
  if cur then
    local na, ca = tonumber(string.match(val, '^(%S+)')), tonumber(string.match(cur, '^(%S+)'))
    write = (ca == nil) or na > ca or (na == ca and val > cur)
  end
  if write then redis.call('HSET', key, addr, val) end
end
return redis.call('HGETALL', key)
"""


class RedisWorkerRegistry(WorkerRegistry):
    """The registry in Redis (module docstring), one Lua script per sync. Args: client: a
    ``redis.Redis`` with ``decode_responses=True``; namespace: the cluster's key prefix. Redis
    errors propagate (``routing.resilient.SharedState`` falls back on them); a malformed stored
    value is skipped."""

    def __init__(self, client: Any, namespace: str = "swaserve") -> None:
        self.ns = "{" + namespace + "}"
        self._sync = client.register_script(_SYNC)

    def sync(self, entries: Iterable[WorkerEntry]) -> dict[str, WorkerEntry]:
        args = [self.ns, *(x for e in entries for x in (e.address, e.encode()))]
        flat = self._sync(args=args)
        out = {}
        for addr, value in zip(flat[::2], flat[1::2], strict=True):
            try:
                out[addr] = WorkerEntry.decode(addr, value)
            except ValueError:
                continue  # not written by us: ignore it rather than stop every router
        return out

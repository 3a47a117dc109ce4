"""Redis backends of the prefix index and the load book: state shared by stateless router replicas.
Every multi-key operation is one Lua script (atomic on the server, one round trip); keys live under
the hash tag ``{ns}`` (one Redis Cluster slot); 64-bit hashes, times and seconds of work travel as
strings (Lua numbers are doubles, and are truncated to integers on return).

Key layout and eviction order: docs/DESIGN.md#routingredisstorepy"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from swaserve.routing.index import IndexConfig, PrefixIndex, check_chain
from swaserve.routing.load import DEFAULT_HEARTBEAT_TTL_S, InstanceLoad, Lease, LoadBook, WorkerReport

_DROP = """
local function drop(ns, member)
  local inst, h = string.match(member, '^%d+|(.*)|(%d+)$')
  redis.call('HDEL', ns .. ':b:' .. h, inst)
  redis.call('HDEL', ns .. ':i:' .. inst, h)
  redis.call('ZREM', ns .. ':lru', member)
end
"""

_RECORD = (
    _DROP
    + """
local ns, inst, now, cap, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local depth, t = tonumber(ARGV[6]), ARGV[3]
if ARGV[7] ~= '' then
  local pt = redis.call('HGET', ns .. ':b:' .. ARGV[7], inst)
  if pt and tonumber(pt) >= now - ttl then t = pt end
end
for k = 8, #ARGV do
  local h = ARGV[k]
  local member = string.format('%09d', 999999999 - depth - (k - 8)) .. '|' .. inst .. '|' .. h
  local prev = redis.call('HGET', ns .. ':i:' .. inst, h)
  if prev and prev ~= member then redis.call('ZREM', ns .. ':lru', prev) end
  redis.call('HSET', ns .. ':b:' .. h, inst, t)
  redis.call('ZADD', ns .. ':lru', t, member)
  redis.call('HSET', ns .. ':i:' .. inst, h, member)
end
local old = redis.call('ZRANGEBYSCORE', ns .. ':lru', '-inf', '(' .. tostring(now - ttl), 'LIMIT', 0, 100000)
for _, m in ipairs(old) do drop(ns, m) end
local n = redis.call('ZCARD', ns .. ':lru')
if n > cap then
  local pops = redis.call('ZRANGE', ns .. ':lru', 0, n - cap - 1)
  for _, m in ipairs(pops) do drop(ns, m) end
end
return n
"""
)

_MATCH = """
local ns, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local alive, out = nil, {}
for k = 4, #ARGV do
  local f = redis.call('HGETALL', ns .. ':b:' .. ARGV[k])
  local holders = {}
  for j = 1, #f, 2 do
    if tonumber(f[j + 1]) >= now - ttl then holders[f[j]] = true end
  end
  if alive == nil then
    alive = holders
  else
    for inst, _ in pairs(alive) do
      if not holders[inst] then
        out[#out + 1] = inst; out[#out + 1] = k - 4; alive[inst] = nil
      end
    end
  end
  if next(alive) == nil then return out end
end
if alive ~= nil then
  for inst, _ in pairs(alive) do out[#out + 1] = inst; out[#out + 1] = #ARGV - 3 end
end
return out
"""

_EVICT = (
    _DROP
    + """
local ns, inst = ARGV[1], ARGV[2]
for k = 3, #ARGV do
  local member = redis.call('HGET', ns .. ':i:' .. inst, ARGV[k])
  if member then drop(ns, member) end
end
return 0
"""
)

_REMOVE = """
local ns, inst = ARGV[1], ARGV[2]
local f = redis.call('HGETALL', ns .. ':i:' .. inst)
for j = 1, #f, 2 do
  redis.call('HDEL', ns .. ':b:' .. f[j], inst)
  redis.call('ZREM', ns .. ':lru', f[j + 1])
end
redis.call('DEL', ns .. ':i:' .. inst)
return #f / 2
"""

_LOADS = """
local ns, now = ARGV[1], tonumber(ARGV[2])
local out = {}
for k = 3, #ARGV do
  local inst = ARGV[k]
  local key = ns .. ':lease:' .. inst
  local f = redis.call('HGETALL', key)
  local n, work, tokens, each = 0, 0, 0, {}
  for j = 1, #f, 2 do
    local w, t, exp = string.match(f[j + 1], '^(%S+) (%S+) (%S+)$')
    if tonumber(exp) <= now then
      redis.call('HDEL', key, f[j])
    else
      n = n + 1; work = work + tonumber(w); tokens = tokens + tonumber(t); each[#each + 1] = w
    end
  end
  local ver = redis.call('GET', ns .. ':ver:' .. inst) or '0'
  local until_ = redis.call('ZSCORE', ns .. ':live', inst)
  local hb = {}
  if until_ and tonumber(until_) > now then hb = redis.call('HGETALL', ns .. ':hb:' .. inst) end
  out[#out + 1] = {inst, n, tostring(work), tokens, ver, hb, each}
end
return out
"""

_RESERVE = """
local ns, id, inst = ARGV[1], ARGV[2], ARGV[3]
for k = 5, #ARGV, 2 do
  local ver = redis.call('GET', ns .. ':ver:' .. ARGV[k]) or '0'
  if ver ~= ARGV[k + 1] then return 0 end
end
redis.call('HSET', ns .. ':lease:' .. inst, id, ARGV[4])
redis.call('INCR', ns .. ':ver:' .. inst)
return 1
"""

_RENEW = """
local key = ARGV[1] .. ':lease:' .. ARGV[2]
local v = redis.call('HGET', key, ARGV[3])
if not v then return 0 end
local w, t = string.match(v, '^(%S+) (%S+) ')
redis.call('HSET', key, ARGV[3], w .. ' ' .. t .. ' ' .. ARGV[4])
return 1
"""

_RELEASE = """
local ns, inst, id = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HDEL', ns .. ':lease:' .. inst, id) == 1 then redis.call('INCR', ns .. ':ver:' .. inst) end
return 0
"""


def _ns(namespace: str) -> str:
    return "{" + namespace + "}"


class RedisPrefixIndex(PrefixIndex):
    """``PrefixIndex`` in Redis. Args: client: a ``redis.Redis`` (``decode_responses=True``);
    namespace: key prefix shared by the routers of one cluster. Redis errors propagate
    (``redis.exceptions.ConnectionError``...); ``routing.resilient`` falls back on them."""

    def __init__(self, client: Any, config: IndexConfig | None = None, namespace: str = "swaserve") -> None:
        self.r, self.config, self.ns = client, config or IndexConfig(), _ns(namespace)
        self._record = client.register_script(_RECORD)
        self._match = client.register_script(_MATCH)
        self._evict = client.register_script(_EVICT)
        self._remove = client.register_script(_REMOVE)

    def match(
        self, hashes: Sequence[int], now: float, instances: Collection[str] | None = None
    ) -> dict[str, int]:
        if not hashes:
            return {}
        flat = self._match(args=[self.ns, repr(now), repr(self.config.ttl_s), *map(str, hashes)])
        got = {flat[j]: int(flat[j + 1]) for j in range(0, len(flat), 2)}
        keep = set(instances) if instances is not None else None
        return {i: n for i, n in got.items() if n > 0 and (keep is None or i in keep)}

    def record(
        self, instance: str, hashes: Sequence[int], now: float, depth: int = 0, parent: int | None = None
    ) -> None:
        check_chain(hashes, depth, parent)
        args = [self.ns, instance, repr(now), str(self.config.max_entries), repr(self.config.ttl_s)]
        link = [str(depth), "" if parent is None else str(parent)]
        self._record(args=[*args, *link, *map(str, hashes)])

    def evict(self, instance: str, hashes: Sequence[int]) -> None:
        if hashes:
            self._evict(args=[self.ns, instance, *map(str, hashes)])

    def remove_instance(self, instance: str) -> int:
        return int(self._remove(args=[self.ns, instance]))

    def size(self) -> int:
        return int(self.r.zcard(f"{self.ns}:lru"))

    def entries(self, instance: str) -> list[tuple[int, float]]:
        hs = list(self.r.hkeys(f"{self.ns}:i:{instance}"))
        if not hs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for h in hs:
            pipe.hget(f"{self.ns}:b:{h}", instance)
        return [(int(h), float(t)) for h, t in zip(hs, pipe.execute(), strict=True) if t is not None]


_REPORT_FIELDS = ("queued_tokens", "running_tokens", "running_requests", "waiting_requests")


def _report(fields: Sequence[str] | Mapping[str, str]) -> WorkerReport | None:
    d = dict(fields) if isinstance(fields, Mapping) else dict(zip(fields[::2], fields[1::2], strict=True))
    if not d:
        return None
    ints = {k: int(d.get(k, 0)) for k in _REPORT_FIELDS}
    return WorkerReport(
        **ints, kv_usage=float(d.get("kv_usage", 0.0)), at=float(d.get("at", 0.0)),
        queue_order=str(d.get("queue_order", "fcfs")),
    )  # fmt: skip


class RedisLoadBook(LoadBook):
    """``LoadBook`` in Redis (keys: docs/DESIGN.md#routingredisstorepy)."""

    def __init__(self, client: Any, namespace: str = "swaserve") -> None:
        self.r, self.ns = client, _ns(namespace)
        self._loads = client.register_script(_LOADS)
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)

    def loads(self, instances: Collection[str], now: float) -> dict[str, InstanceLoad]:
        if not instances:
            return {}
        rows = self._loads(args=[self.ns, repr(now), *instances])
        return {
            inst: InstanceLoad(
                int(n), float(work), int(tokens), _report(hb), int(ver), tuple(sorted(float(w) for w in each))
            )
            for inst, n, work, tokens, ver, hb, each in rows
        }

    def reserve(self, lease: Lease, now: float, expect: Mapping[str, int] | None = None) -> bool:
        value = f"{lease.work_s!r} {lease.tokens} {lease.expires_at!r}"
        pairs = [x for i, v in (expect or {}).items() for x in (i, str(v))]
        return bool(self._reserve(args=[self.ns, lease.lease_id, lease.instance, value, *pairs]))

    def release(self, instance: str, lease_id: str) -> None:
        self._release(args=[self.ns, instance, lease_id])

    def renew(self, instance: str, lease_id: str, expires_at: float) -> bool:
        return bool(self._renew(args=[self.ns, instance, lease_id, repr(expires_at)]))

    def heartbeat(self, instance: str, report: WorkerReport, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S) -> None:
        fields = {k: str(getattr(report, k)) for k in _REPORT_FIELDS}
        fields |= {
            "kv_usage": repr(report.kv_usage),
            "at": repr(report.at),
            "queue_order": report.queue_order,
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(f"{self.ns}:hb:{instance}", mapping=fields)
        pipe.zadd(f"{self.ns}:live", {instance: report.at + ttl_s})
        pipe.execute()

    def live(self, now: float) -> dict[str, WorkerReport]:
        names = self.r.zrangebyscore(f"{self.ns}:live", f"({now!r}", "+inf")
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(f"{self.ns}:hb:{n}")
        out = {}
        for n, f in zip(names, pipe.execute(), strict=True):
            rep = _report(f)
            if rep is not None:
                out[n] = rep
        return out

    def forget(self, instance: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(f"{self.ns}:lease:{instance}", f"{self.ns}:hb:{instance}")
        pipe.zrem(f"{self.ns}:live", instance)
        pipe.execute()

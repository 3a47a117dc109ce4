"""Cluster routing core, sans IO: prefix index (in-memory / Redis), load leases, cost model,
worker selection, compute-aware priority, length buckets. Used by the router service and by the
simulator (``swaserve.sim``) alike."""

"""Cluster routing core, sans IO: prefix index and load book (in-memory; Redis adapters in
``routing.redis``), worker selection, length buckets, dispatch, worker registry. Used by the router
service and by the simulator (``swaserve.sim``) alike."""

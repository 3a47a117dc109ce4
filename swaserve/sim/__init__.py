"""Trace-driven discrete-event simulation of the cluster: the routing core (``swaserve.routing``)
and the radix cache (``swaserve.kvcache``) run unchanged in simulated time, with a cost model in
place of the model."""

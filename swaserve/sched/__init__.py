"""Scheduling inputs shared by the engine scheduler, the router's policies and the simulator:
the cost model (seconds per prefill, decode step, KV transfer) and the compute-aware priority."""

"""Prefill -> decode KV transfer, sans IO: payloads gathered from and scattered into the pools,
wire pages with checksums, decode-side staging. Transports live in ``services``."""

"""Cost model: seconds of prefill and decode work, for routing estimates and the simulator::

    prefill_s(u, c) = base + token * u + attn * u * (c + (u + 1) / 2)   u tokens after c cached
    decode_step_s(batch, kv_tokens) = step_base + seq * batch + kv * kv_tokens   (full-layer KV)

plus KV transfer seconds (``transfer_bytes(n) / link_bytes_per_s``). Presets (``PRESETS``):
``cpu-tiny`` (measured on the 2-core CPU), ``mimo-v2-flash-h200`` (derived from FLOPs and HBM
bandwidth). Terms and the derivation: docs/DESIGN.md#schedcostpy"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Coefficients in seconds (see the module docstring for the formulas and units)."""

    name: str
    prefill_base_s: float
    prefill_token_s: float
    prefill_attn_s: float
    decode_base_s: float
    decode_seq_s: float
    decode_kv_token_s: float
    kv_full_bytes_per_token: int = 0
    kv_swa_bytes_per_token: int = 0
    window: int = 128
    link_bytes_per_s: float = 0.0  # 0: transfers are free (same host, not modelled)
    source: str = ""
    l3_bytes_per_s: float = 0.0  # L3 (GCache) fetch bandwidth; 0: as ``link_bytes_per_s``
    l3_latency_s: float = 0.0  # per fetch (lookup + get round trips)

    def prefill_s(self, uncached: int, cached: int = 0) -> float:
        """Seconds to prefill ``uncached`` tokens after ``cached`` ones (>= 0 each)."""
        if uncached <= 0:
            return 0.0
        return (
            self.prefill_base_s
            + self.prefill_token_s * uncached
            + self.prefill_attn_s * uncached * (cached + (uncached + 1) / 2)
        )

    def prefill_tokens_s(self, tokens: int) -> float:
        """Seconds of queued prefill work known only as a token count (heartbeats): linear part
        only, no per-request base."""
        return self.prefill_token_s * max(tokens, 0)

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """Seconds of one decode step over ``batch`` sequences holding ``kv_tokens`` in all."""
        if batch <= 0:
            return 0.0
        return self.decode_base_s + self.decode_seq_s * batch + self.decode_kv_token_s * kv_tokens

    def transfer_bytes(self, tokens: int) -> int:
        """Prefill -> decode KV bytes of a ``tokens``-token prompt (full layers: all; SWA: last W)."""
        return self.kv_full_bytes_per_token * tokens + self.kv_swa_bytes_per_token * min(tokens, self.window)

    def transfer_s(self, tokens: int) -> float:
        return 0.0 if self.link_bytes_per_s <= 0 else self.transfer_bytes(tokens) / self.link_bytes_per_s

    def l3_fetch_s(self, tokens: int) -> float:
        """Seconds to fetch ``tokens`` tokens' KV from L3 into a prefill worker: their full KV and
        one SWA window, at ``l3_bytes_per_s``, plus ``l3_latency_s``; 0 for none."""
        if tokens <= 0:
            return 0.0
        bw = self.l3_bytes_per_s or self.link_bytes_per_s
        return self.l3_latency_s + (self.transfer_bytes(tokens) / bw if bw > 0 else 0.0)

    def prefill_with_l3_s(self, prompt: int, cached: int, l3: int) -> float:
        """Prefill seconds of a ``prompt``-token request with ``cached`` tokens on the worker and
        ``l3`` tokens fetchable from L3: the cheaper of computing past ``cached`` and fetching up
        to ``l3`` then computing the rest (the engine fetches when L3 holds more)."""
        own = self.prefill_s(prompt - cached, cached)
        if l3 <= cached:
            return own
        return min(own, self.l3_fetch_s(l3 - cached) + self.prefill_s(prompt - l3, l3))


MIMO_V2_FLASH_H200 = CostModel(
    name="mimo-v2-flash-h200",
    prefill_base_s=0.010,
    prefill_token_s=7.6e-6,
    prefill_attn_s=1.16e-10,
    decode_base_s=0.005,
    decode_seq_s=5e-5,
    decode_kv_token_s=8.6e-10,
    kv_full_bytes_per_token=23_040,
    kv_swa_bytes_per_token=199_680,
    window=128,
    link_bytes_per_s=50e9,
    source="derived from FLOPs and HBM bandwidth (module docstring)",
    l3_bytes_per_s=20e9,  # GCache over RDMA, well below the production system's 170 GB/s reads
    l3_latency_s=300e-6,  # its reported 280 us
)

# Fitted by `python -m bench.cost_calibrate` on the 2-core CPU machine, 2026-11-30, float32, 2 torch
# threads, idle machine (bench/results/cost_calibrate.json: measured vs fitted within ~20%). KV
# bytes: the default checkpoint (3 full + 9 SWA layers, float32); link: loopback gRPC KV transfer
# measured by `swaserve bench pd-transfer` (~140 MB/s).
CPU_TINY = CostModel(
    name="cpu-tiny",
    prefill_base_s=0.0262,
    prefill_token_s=5.44e-4,
    prefill_attn_s=5.7e-8,
    decode_base_s=0.0198,
    decode_seq_s=1.91e-3,
    decode_kv_token_s=6.6e-7,
    kv_full_bytes_per_token=1344,
    kv_swa_bytes_per_token=8064,
    window=128,
    link_bytes_per_s=140e6,
    source="measured: bench/cost_calibrate.py, 2-core CPU, 2026-11-30",
    l3_bytes_per_s=140e6,  # GCache over loopback: TCP-class, as the KV push (bench gcache)
    l3_latency_s=5e-3,
)

PRESETS: dict[str, CostModel] = {m.name: m for m in (CPU_TINY, MIMO_V2_FLASH_H200)}


def preset(name: str) -> CostModel:
    """The preset called ``name``. Raises ValueError naming the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r}; known: {', '.join(sorted(PRESETS))}") from None

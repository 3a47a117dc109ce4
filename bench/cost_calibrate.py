"""Fit the ``CostModel`` of this machine's engine (the ``cpu-tiny`` preset) by measuring it.

Prefill: requests alone with ``max_tokens=1``: ``u`` new tokens after ``c`` cached ones (a first
request of ``c`` tokens puts them in the prefix cache); seconds from ``add_request`` to the first
token, best of ``--repeats``. Decode: ``b`` requests of ``ctx`` prompt tokens decoding together;
the mean seconds of the steps where all of them decode. Least squares on the ``CostModel``
formulas (``swaserve.sched.cost``) gives the coefficients; the table shows measured vs fitted.
Run on an idle machine: concurrent load inflates every number.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams

PREFILL_POINTS = ((32, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (256, 1024), (512, 2048), (64, 2048))
FIT_KEYS = (
    "prefill_base_s",
    "prefill_token_s",
    "prefill_attn_s",
    "decode_base_s",
    "decode_seq_s",
    "decode_kv_token_s",
)
DECODE_POINTS = ((1, 128), (4, 128), (16, 128), (32, 128), (8, 1024), (16, 512))


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run_alone(eng: LLMEngine, rid: str, ids: list[int], n_out: int) -> float:
    t0 = time.perf_counter()
    eng.add_request(rid, ids, _params(n_out))
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and n_out == 1:
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def measure_prefill(eng: LLMEngine, repeats: int, vocab: int) -> list[dict[str, float]]:
    rng = np.random.default_rng(0)
    out = []
    for k, (u, c) in enumerate(PREFILL_POINTS):
        best = float("inf")
        for r in range(repeats):
            eng.kv.flush_cache()
            base = rng.integers(10, vocab, size=c + u).tolist()
            if c:
                _run_alone(eng, f"warm{k}-{r}", [*base[:c], 5], 1)  # caches the first c tokens
            best = min(best, _run_alone(eng, f"p{k}-{r}", base, 1))
        out.append({"uncached": u, "cached": c, "seconds": best})
    return out


def measure_decode(eng: LLMEngine, vocab: int, steps: int = 12) -> list[dict[str, float]]:
    rng = np.random.default_rng(1)
    out = []
    for k, (b, ctx) in enumerate(DECODE_POINTS):
        eng.kv.flush_cache()
        for i in range(b):
            # long enough that all b decode together after the last prefill chunk
            n_out = steps + 2 + b * ctx // 512 + 2
            eng.add_request(f"d{k}-{i}", rng.integers(10, vocab, size=ctx).tolist(), _params(n_out))
        times = []
        while eng.has_unfinished():
            decoding = all(r.num_tokens - r.num_computed == 1 for r in eng.scheduler.running)
            full = len(eng.scheduler.running) == b and not eng.scheduler.waiting
            t0 = time.perf_counter()
            eng.step()
            if decoding and full:
                times.append(time.perf_counter() - t0)
        out.append({"batch": b, "kv_tokens": b * (ctx + steps), "seconds": float(np.median(times))})
    return out


def fit(prefill: list[dict[str, float]], decode: list[dict[str, float]]) -> dict[str, float]:
    a = np.array(
        [[1.0, p["uncached"], p["uncached"] * (p["cached"] + (p["uncached"] + 1) / 2)] for p in prefill]
    )
    y = np.array([p["seconds"] for p in prefill])
    pc = np.linalg.lstsq(a, y, rcond=None)[0]
    d = np.array([[1.0, x["batch"], x["kv_tokens"]] for x in decode])
    dc = np.linalg.lstsq(d, np.array([x["seconds"] for x in decode]), rcond=None)[0]
    return {k: float(max(v, 0.0)) for k, v in zip(FIT_KEYS, [*pc, *dc], strict=True)}


def main(model_dir: Path, repeats: int = 2, json_path: Path | None = None) -> dict[str, object]:
    eng = LLMEngine(model_dir, EngineConfig(max_num_seqs=64, kv_cache_memory=512 << 20))
    vocab = eng.model_config.vocab_size
    _run_alone(eng, "warmup", list(range(10, 300)), 2)
    prefill = measure_prefill(eng, repeats, vocab)
    decode = measure_decode(eng, vocab)
    coef = fit(prefill, decode)
    from swaserve.sched.cost import CostModel

    m = CostModel(
        "fitted", prefill_base_s=coef["prefill_base_s"], prefill_token_s=coef["prefill_token_s"],
        prefill_attn_s=coef["prefill_attn_s"], decode_base_s=coef["decode_base_s"],
        decode_seq_s=coef["decode_seq_s"], decode_kv_token_s=coef["decode_kv_token_s"],
    )  # fmt: skip
    print(f"{'uncached':>8} {'cached':>6} {'measured s':>10} {'fitted s':>9}")
    for p in prefill:
        print(
            f"{p['uncached']:>8} {p['cached']:>6} {p['seconds']:>10.4f} {m.prefill_s(int(p['uncached']), int(p['cached'])):>9.4f}"
        )
    print(f"{'batch':>8} {'kv tok':>6} {'measured s':>10} {'fitted s':>9}")
    for x in decode:
        print(
            f"{x['batch']:>8} {x['kv_tokens']:>6} {x['seconds']:>10.4f} {m.decode_step_s(int(x['batch']), int(x['kv_tokens'])):>9.4f}"
        )
    print("coefficients:", json.dumps(coef))
    rec: dict[str, object] = {"model_dir": str(model_dir), "prefill": prefill, "decode": decode, "fit": coef}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rec, indent=2) + "\n")
    return rec


if __name__ == "__main__":
    import sys

    from swaserve.model.checkpoint import default_model_dir

    main(default_model_dir(), json_path=Path(sys.argv[1]) if len(sys.argv) > 1 else None)

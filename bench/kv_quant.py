"""KV cache quantization (``swaserve.kvformat``): capacity, quality, decode speed and prefix-cache hit
rate of each page format in one run (``swaserve bench kv-quant``).

1. Capacity: MiMo-V2.5-Pro and MiMo-V2-Flash shapes at 32K and 128K context; requests admitted into
   80 GB through the real allocator (``plan_pools(formats=)`` sizes the pages, ``KVCacheManager``
   holds them, no tensors) as ``bench.kv_capacity`` does (pools planned without and with the prefix
   cache's SWA reserve), for each format in the hybrid and full layouts; every row's bytes per
   request as a ratio vs the bf16 full layout, with the token-exact theory (W SWA tokens, no
   paging) and the fp32 scale overhead per group.
2. Quality on real text, default model: corpus prompts several windows long; per format the mean
   KL(auto || format) of the next-token distribution over every prompt position (every row's
   logits from the engine's own runner and pools), the share of it at rows where some MoE layer
   routed to other experts than auto, and the greedy agreement length (leading equal tokens of N
   greedy tokens vs auto); ablations: group 16, one pool quantized, 4 sink tokens in full precision;
   reference rows (an fp32 model only): auto pages rounded through bf16 / fp16, the KL that a
   16-bit KV cache of the same model costs.
3. Decode tokens/s at batch 1 and 8 per format, rounds interleaved over the formats, ratio vs auto.
4. Prefix-cache hit rate on the conversation trace at 5% of its bf16 full-layout footprint per
   format (``bench.prefix_cache.replay``): smaller pages, more of them in the same bytes.
KIVI (``kivi2``, ``kivi4``: 2/4-bit full pool, key group = page size, residual min(128, W) kept
in full precision as one more SWA layer per full layer, the SWA pool in the model dtype) is
measured in the hybrid layout only: in the full layout its residual would keep every token in
full precision. ``kivi2+fp8_e4m3``: the same over an FP8 SWA pool (``--kv-cache-dtype-swa
fp8_e4m3``), SWA layers and the residual at 8 bits (capacity, hit rate, a quality ablation).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from bench.kv_quant_capacity import (
    BF16,
    FORMATS,
    POOL_FORMATS,
    by_name,
    capacity,
    formats_of,
    is_kivi,
    layouts,
    pool_config,
    r4,
)
from bench.prefix_cache import SHAPE, replay
from bench.prefix_workload import CHUNK, CONVERSATION_TRACE, PAGE, footprint_bytes, load_workload
from bench.targets import target
from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.request import Request
from swaserve.engine.scheduler import ScheduledChunk
from swaserve.engine.types import SamplingParams
from swaserve.kvcache.sizing import page_bytes, plan_pools
from swaserve.kvformat import AUTO, KIVI_FORMATS, ROW_FORMATS, KVFormat
from swaserve.shapes import model_config

HIT_BUDGET_SHARE = 0.05
TARGET_KL = 1e-3


@dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...] = (32768, 131072)
    shapes: tuple[str, ...] = ("MiMo-V2.5-Pro", "MiMo-V2-Flash")
    prompts: int = 8
    windows: int = 6  # prompt length in windows of the model
    new_tokens: int = 64  # greedy tokens (agreement and decode timing)
    batches: tuple[int, ...] = (1, 8)
    rounds: int = 3
    trace_limit: int | None = None
    seed: int = 1234
    ablations: tuple[str, ...] | None = None  # labels of ABLATIONS to run (None: all)


QUICK = Settings(
    contexts=(32768,), prompts=2, windows=3, new_tokens=8, batches=(1, 2), rounds=1, trace_limit=200,
    # one ablation of each kind (group, one pool only, sink tokens, KIVI over an 8-bit SWA pool)
    ablations=("int8 group 16", "fp8_e4m3 full pool only", "int8 swa pool only", "kivi2 sink 4",
               "kivi2+fp8_e4m3"),
)  # fmt: skip


# -- 2, 3. quality and decode speed on the model --------------------------------------------------
def engine(
    model_dir: Path, fmt: str, seqs: int, group: int = 0, swa: str | None = None, sinks: int = 0
) -> LLMEngine:
    """An engine storing ``fmt`` pages (page 16; KIVI: key group 16, or the largest divisor of the
    page within a smaller window, residual min(128, W)); ``sinks``: ``--kv-sink-tokens``."""
    window = ModelConfig.from_pretrained(model_dir).window
    kivi_group = max(g for g in (1, 2, 4, 8, 16) if g <= min(128, window))
    ecfg = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=2048, kv_cache_memory=256 << 20,
                        enable_prefix_caching=False, kv_cache_dtype=fmt, kv_cache_dtype_swa=swa,
                        kv_quant_group=group, kv_kivi_group=kivi_group if fmt in KIVI_FORMATS else 0,
                        kv_sink_tokens=sinks, seed=0)  # fmt: skip
    return LLMEngine(model_dir, ecfg)


# quality ablations: (label, full pool's format, SWA pool's, group, sink tokens)
SINKS = 4  # the sink-token ablations' --kv-sink-tokens
ABLATIONS = tuple(
    (f"{f} {label}", full, swa, g, 0)
    for f in ("fp8_e4m3", "int8")
    for label, full, swa, g in (
        ("group 16", f, f, 16),
        ("full pool only", f, AUTO, 0),
        ("swa pool only", AUTO, f, 0),
    )
) + tuple((f"{f} sink {SINKS}", f, None, 0, SINKS) for f in ("int8", "fp8_e4m3", "kivi4", "kivi2"))
ABLATIONS += tuple((f"{f}+fp8_e4m3", f, "fp8_e4m3", 0, 0) for f in ("kivi4", "kivi2"))


# reference rows: auto pages rounded through a 16-bit dtype (what a bf16 / fp16 KV cache of this
# fp32 model would store): how much KL a perturbation far below 8 bits already costs this model
ROUNDINGS = ("bfloat16", "float16")


@contextmanager
def kv_rounded_through(dtype: torch.dtype) -> Iterator[None]:
    """For the duration, unquantized (``auto``) K/V rows are written rounded through ``dtype``
    (``KVFormat.pack`` wrapped; quantized formats unchanged). Attention reads the stored rows, its
    own chunk's too, so every read sees the rounded values."""
    pack = KVFormat.pack

    def rounded(self: KVFormat, x: torch.Tensor) -> torch.Tensor:
        return pack(self, x) if self.quantized else x.to(dtype).to(x.dtype)

    KVFormat.pack = rounded  # type: ignore[method-assign]
    try:
        yield
    finally:
        KVFormat.pack = pack  # type: ignore[method-assign]


def corpus(eng: LLMEngine, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` token windows of ``length`` cut from the bundled corpus (as the checkpoint's training)."""
    from swaserve.model.checkpoint import CORPUS_PATH
    from swaserve.model.train import corpus_prompts

    return [list(map(int, row)) for row in corpus_prompts(eng.tokenizer, CORPUS_PATH, n, length, seed)]


@contextmanager
def expert_choices() -> Iterator[list[torch.Tensor]]:
    """Each MoE layer's chosen experts (sorted ids [T, top_k]) of the forwards run inside, in call
    order: ``swaserve.model.layers.route_sigmoid_topk`` wrapped for the duration."""
    import swaserve.model.layers as layers

    seen: list[torch.Tensor] = []
    route = layers.route_sigmoid_topk

    def recorded(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(*args, **kwargs)
        seen.append(ids.sort(-1).values)
        return weights, ids

    layers.route_sigmoid_topk = recorded  # type: ignore[assignment]
    try:
        yield seen
    finally:
        layers.route_sigmoid_topk = route


@torch.no_grad()
def prompt_logits(eng: LLMEngine, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp32 logits [len(tokens), vocab] of every prompt row, one prefill chunk through the engine's
    runner, pools and page formats (attention reads the stored K/V, this chunk's too); and each
    MoE layer's expert choices per row."""
    core, rid = eng.core, "kl"
    req = Request(rid, list(tokens), SamplingParams(max_tokens=1), 0.0, len(tokens) + 1)
    assert core.kv.admit(rid, len(tokens) + 1) is not None and core.kv.allocate(rid, 0, len(tokens))
    try:
        batch, _ = core.runner.build([ScheduledChunk(req, 0, len(tokens))])
        with expert_choices() as experts:
            logits = core.model.logits(core.model.norm(core.model.forward_hidden(batch))).float()
        return logits, experts
    finally:
        core.kv.free(rid)


def kl_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) of each row's next-token distribution, nats (float64)."""
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def kl_summary(
    ref: list[tuple[torch.Tensor, list[torch.Tensor]]], got: list[tuple[torch.Tensor, list[torch.Tensor]]]
) -> dict[str, Any]:
    """Mean and max KL over every prompt row, and how much of it sits at rows where some MoE layer
    chose other experts than auto's (a routing flip: top-k is discontinuous in its input)."""
    kls, flips = [], []
    for (a, ea), (b, eb) in zip(ref, got, strict=True):
        kls.append(kl_rows(a, b))
        flip = torch.zeros(a.shape[0], dtype=torch.bool)
        for x, y in zip(ea, eb, strict=True):
            flip |= (x != y).any(-1)
        flips.append(flip)
    k, f = torch.cat(kls), torch.cat(flips)
    return {"mean_kl": float(k.mean()), "max_kl": float(k.max()), "median_kl": float(k.median()),
            "rows_with_expert_flip": r4(float(f.double().mean())),
            "kl_share_at_expert_flips": r4(float(k[f].sum() / k.sum())) if k.sum() > 0 else 0.0,
            "mean_kl_without_flips": float(k[~f].mean()) if (~f).any() else 0.0}  # fmt: skip


def agreement(ref: list[int], got: list[int]) -> int:
    n = 0
    while n < min(len(ref), len(got)) and ref[n] == got[n]:
        n += 1
    return n


def timed_decode(eng: LLMEngine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of the prompts added at once: tokens after the last first token, over the
    time from it to the end; and the greedy outputs."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"t{i}", p, params)
    events: list[tuple[float, str, int]] = []
    outs: dict[str, list[int]] = {f"t{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            events.append((time.perf_counter(), o.request_id, len(o.new_token_ids)))
            outs[o.request_id] += o.new_token_ids
    start = max(next(t for t, r, k in events if r == rid and k) for rid in outs)
    tokens = sum(k for t, _, k in events if t > start)
    return tokens / (events[-1][0] - start), [outs[f"t{i}"] for i in range(len(prompts))]


def model_part(model_dir: Path, s: Settings) -> dict[str, Any]:
    cfg = ModelConfig.from_pretrained(model_dir)
    engines = {f: engine(model_dir, f, max(s.batches)) for f in FORMATS}
    ref_eng = engine(model_dir, AUTO, max(s.batches))  # a second auto engine: auto vs auto
    length = s.windows * cfg.window
    prompts = corpus(ref_eng, s.prompts, length, s.seed)
    greedy = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    ref_logits = [prompt_logits(ref_eng, p) for p in prompts]
    ref_out = ref_eng.generate(prompts, greedy)
    greedy_out: dict[str, list[list[int]]] = {}

    def judge(eng: LLMEngine, name: str) -> dict[str, Any]:
        kl = kl_summary(ref_logits, [prompt_logits(eng, p) for p in prompts])
        greedy_out[name] = eng.generate(prompts, greedy)
        agree = [agreement(a, b) for a, b in zip(ref_out, greedy_out[name], strict=True)]
        plan = eng.kv.plan  # the engine's own pools hold tensors of exactly the planned bytes
        held = plan.full_pages * plan.full_page_bytes + plan.swa_pages * plan.swa_page_bytes
        fmts = {pool: eng.core.kv_formats[kind].describe() for pool, kind in (("full", FULL), ("swa", SWA))}
        return {"format": name, **kl, "agreement": agree, "formats": fmts,
                "mean_agreement": statistics.mean(agree), "kl_target_met": kl["mean_kl"] < TARGET_KL,
                "page_bytes": [plan.full_page_bytes, plan.swa_page_bytes],
                "storage_bytes_match_plan": eng.storage.nbytes() == held}  # fmt: skip

    quality = [judge(eng, f) for f, eng in engines.items()]
    ablations = []
    for label, full, swa, g, sinks in ABLATIONS:
        if s.ablations is not None and label not in s.ablations:
            continue
        row = judge(engine(model_dir, full, 1, g, swa, sinks), label)
        ablations.append({**row, "full_pool": full, "swa_pool": swa, "group": g, "sink_tokens": sinks})
    reference = []  # only where the model's KV is wider than the 16-bit dtype
    for name in ROUNDINGS:
        dtype = getattr(torch, name)
        if dtype.itemsize < engines[AUTO].storage.model_dtype.itemsize:
            with kv_rounded_through(dtype):
                row = judge(engines[AUTO], f"auto rounded via {name}")
            reference.append({**row, "rounded_through": name})
    del ref_eng
    tok_s: dict[int, dict[str, list[float]]] = {b: {f: [] for f in FORMATS} for b in s.batches}
    same = True  # every timed run's outputs equal its format's greedy outputs above
    for r in range(s.rounds):
        for b in s.batches:
            work = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
            order = FORMATS if r % 2 == 0 else FORMATS[::-1]
            for f in order:
                rate, outs = timed_decode(engines[f], work, s.new_tokens)
                tok_s[b][f].append(rate)
                same &= outs == [greedy_out[f][(r * b + i) % len(prompts)] for i in range(b)]
    speed = []
    for b in s.batches:
        auto = statistics.median(tok_s[b][AUTO])
        for f in FORMATS:
            med = statistics.median(tok_s[b][f])
            speed.append({"batch": b, "format": f, "tok_s": [round(x, 1) for x in tok_s[b][f]],
                          "median_tok_s": round(med, 1), "vs_auto": r4(med / auto)})  # fmt: skip
    return {"model_dir": str(model_dir), "kv_dtype": engines[AUTO].config.dtype, "window": cfg.window,
            "prompts": len(prompts), "prompt_tokens": length, "new_tokens": s.new_tokens, "rounds": s.rounds,
            "quality": quality, "ablations": ablations, "reference": reference, "decode": speed, "timed_outputs_equal_greedy": same}  # fmt: skip


# -- 4. prefix-cache hit rate at a fixed byte budget ------------------------------------------------
_WORK: dict[str, Any] = {}


def _replay(job: tuple[str, str, int]) -> dict[str, Any]:
    layout, fmt, budget = job
    cfg, work = _WORK["cfg"], _WORK["work"]
    fmts = formats_of(fmt, cfg)
    cfg = pool_config(cfg, fmts)
    ecfg = EngineConfig(page_size=PAGE, kv_cache_memory=budget, kv_layout=layout, max_num_seqs=1,  # type: ignore[arg-type]
                        max_num_batched_tokens=CHUNK, enable_prefix_caching=layout == "hybrid")  # fmt: skip
    plan = plan_pools(cfg, ecfg, BF16, shared=layout == "hybrid", formats=fmts)
    r = replay(cfg, work, layout, plan)
    return {"full_pages": r.full_pages, "swa_pages": r.swa_pages, "hit_rate": r4(r.rates()["hit_rate"]),
            "rejected": r.rejected + r.stalled, "seconds": round(r.seconds, 1)}  # fmt: skip


def hit_rates(s: Settings, jobs: int) -> dict[str, Any]:
    cfg = model_config(SHAPE)
    work = load_workload(CONVERSATION_TRACE, s.trace_limit)
    budget = int(footprint_bytes(cfg, work.unique_pages) * HIT_BUDGET_SHARE)
    _WORK.update(cfg=cfg, work=work)
    # formats of equal page bytes replay the same: one replay per (layout, page bytes)
    fmts = {f: formats_of(f, cfg) for f in POOL_FORMATS}
    key = {f: (page_bytes(pool_config(cfg, fmts[f]), PAGE, BF16, fmts[f]), is_kivi(f)) for f in POOL_FORMATS}
    first = {k: f for f, k in reversed(key.items())}
    tasks = [
        (layout, first[key[f]], budget)
        for layout in ("hybrid", "full")
        for f in POOL_FORMATS
        if first[key[f]] == f and layout in layouts(f)
    ]
    if jobs <= 1:  # in this process
        done = {t: _replay(t) for t in tasks}
    else:
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=get_context("fork")) as ex:
            done = dict(zip(tasks, ex.map(_replay, tasks), strict=True))
    rows: list[dict[str, Any]] = []
    for layout in ("hybrid", "full"):
        for f in (f for f in POOL_FORMATS if layout in layouts(f)):
            rec = done[layout, first[key[f]], budget]
            rows.append({"layout": layout, "format": f, **rec, "same_replay_as": first[key[f]]})
    hyb = {r["format"]: r["hit_rate"] for r in rows if r["layout"] == "hybrid"}
    return {"trace": CONVERSATION_TRACE.name, "requests": work.requests, "shape": SHAPE.name,
            "budget_share_of_bf16_full_footprint": HIT_BUDGET_SHARE, "budget_bytes": budget,
            "ideal_hit_rate": r4(work.ideal_hit_rate), "rows": rows,
            "targets": by_name([target(f"{k} hit rate at 5% budget above fp8_e4m3's (hybrid)", hyb[k], ">",
                                        hyb["fp8_e4m3"]) for k in ("kivi2", "kivi2+fp8_e4m3")])}  # fmt: skip


def print_report(res: dict[str, Any]) -> None:
    cap = res["capacity"]
    print("1. KV capacity in 80 GB (bf16 model, page 16, real allocator); ratio = bf16 full bytes / row's;")
    print(
        "   reqs: pools planned without the prefix cache, (cache): with its SWA reserve (1/9 of full pages)"
    )
    print(f"{'shape':<15}{'ctx':>7}{'layout':>8}{'format':>15}{'MB/req':>10}{'reqs':>7}{'(cache)':>8}{'ratio':>8}"
          f"{'theory':>8}{'/theory':>9}")  # fmt: skip
    for r in cap["rows"]:
        print(f"{r['shape']:<15}{r['context_tokens']:>7}{r['layout']:>8}{r['format']:>15}"
              f"{r['bytes_per_request'] / 1e6:>10.1f}{r['requests_in_80GB']:>7}"
              f"{r['requests_in_80GB_cache_plan']:>8}{r['ratio_vs_bf16_full']:>8}"
              f"{r['theoretical_ratio']:>8}{r['achieved_vs_theory']:>9}")  # fmt: skip
    for name, rows in cap["scale_overhead"].items():
        print(f"fp32 scale overhead of a 1-byte format, {name}: "
              + ", ".join(f"group {o['group'] or 'row'} +{o['overhead']:.1%}" for o in rows))  # fmt: skip
    _targets(cap["targets"])
    m = res["model"]
    if m is not None:
        print(f"2. Quality vs auto ({m['kv_dtype']} KV): {m['prompts']} corpus prompts of {m['prompt_tokens']} "
              f"tokens (window {m['window']}), {m['new_tokens']} greedy tokens")  # fmt: skip
        print(
            "   flip rows: some MoE layer chose other experts than auto's; KL there: its share of the KL sum"
        )
        print(
            "   'auto rounded via' rows (reference): auto pages rounded through a 16-bit dtype, what a bf16 /"
        )
        print("   fp16 KV cache of this model would store; KL vs auto of a perturbation far below 8 bits")
        print(f"{'format':<24}{'mean KL':>10}{'median':>10}{'max':>9}{'flip rows':>10}{'KL there':>9}"
              f"{'KL other':>10}{'agree':>7}  agreement per prompt")  # fmt: skip
        for q in m["quality"] + m["ablations"] + m["reference"]:
            print(f"{q['format']:<24}{q['mean_kl']:>10.2e}{q['median_kl']:>10.2e}{q['max_kl']:>9.3f}"
                  f"{q['rows_with_expert_flip']:>10.3f}{q['kl_share_at_expert_flips']:>9.2f}"
                  f"{q['mean_kl_without_flips']:>10.2e}{q['mean_agreement']:>7.1f}  {q['agreement']}")  # fmt: skip
        print(
            f"3. Decode tokens/s (median of {m['rounds']} interleaved rounds; pure-torch CPU dequantize-on-read)"
        )
        print(f"{'batch':>6}{'format':>10}{'tok/s':>9}{'vs auto':>9}  rounds")
        for d in m["decode"]:
            print(f"{d['batch']:>6}{d['format']:>10}{d['median_tok_s']:>9}{d['vs_auto']:>9}  {d['tok_s']}")
        _targets(m["targets"])
    h = res["hit_rate"]
    print(f"4. Prefix-cache hit rate, {h['trace']} ({h['requests']} requests, {h['shape']}), device budget "
          f"{h['budget_bytes'] / 1e9:.2f} GB = {h['budget_share_of_bf16_full_footprint']} of the bf16 full "
          f"footprint; ideal {h['ideal_hit_rate']}")  # fmt: skip
    for r in h["rows"]:
        if "status" in r:
            print(f"{r['layout']:<8}{r['format']:>15}  {r['status']}")
        else:
            print(f"{r['layout']:<8}{r['format']:>15}{r['hit_rate']:>8}  pages {r['full_pages']} full / "
                  f"{r['swa_pages']} swa")  # fmt: skip
    _targets(h["targets"])


def _targets(t: dict[str, Any]) -> None:
    for k, g in t.items():
        note = f" ({g['note']})" if g["note"] else ""
        print(f"target {k}: {g['value']:.4g} {g['op']} {g['threshold']:.4g}, {g['status']}{note}")


def main(json_path: str | None = None, quick: bool = False, model_dir: str | None = None,
         model: bool = True, jobs: int = 2) -> dict[str, Any]:  # fmt: skip
    """Run the four parts (``model=False``: skip 2 and 3), print them, write JSON."""
    from swaserve.model.checkpoint import default_model_dir, tiny_model_dir

    s = QUICK if quick else Settings()
    t0 = time.perf_counter()
    mdir = Path(model_dir) if model_dir else tiny_model_dir() if quick else default_model_dir()
    res: dict[str, Any] = {"quick": quick, "settings": s.__dict__, "part_wall_s": {}}
    for part, run in (("capacity", lambda: capacity(s.shapes, s.contexts)), ("model", lambda: model_part(mdir, s) if model else None),
                      ("hit_rate", lambda: hit_rates(s, jobs))):  # fmt: skip
        t = time.perf_counter()
        res[part] = run()
        res["part_wall_s"][part] = round(time.perf_counter() - t, 1)
    if res["model"] is not None:
        ref = ", ".join(f"{r['format']}: {r['mean_kl']:.3g}" for r in res["model"]["reference"])
        res["model"]["targets"] = by_name([target(f"{q['format']}: mean KL < {TARGET_KL}", q["mean_kl"], "<", TARGET_KL, ref)
                                            for q in res["model"]["quality"] if q["format"] in ROW_FORMATS])  # fmt: skip
    # every part's targets, also in one place
    res["targets"] = {
        k: v
        for part in ("capacity", "model", "hit_rate")
        for k, v in ((res[part] or {}).get("targets") or {}).items()
    }
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print_report(res)
    print(f"wall {res['wall_s']} s (" + ", ".join(f"{k} {v} s" for k, v in res["part_wall_s"].items()) + ")")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2, default=list) + "\n")
    return res


if __name__ == "__main__":
    main()

"""Structured output's cost: the same chat requests unconstrained vs under a ``json_schema``.

Workload: ``requests`` chat prompts (the default model's chat template over varied user
messages), all sent at once to one inline engine (``LLMEngine``), greedy, ``max_tokens`` each.
The schema (a list of ``items`` objects, exactly ``ITEMS`` of them) needs more tokens than
``max_tokens`` allows, and the unconstrained run ignores EOS, so both runs generate exactly
``requests * max_tokens`` tokens in the same batches: the difference is the mask work (llguidance
bitmask fill, mask applied before sampling, matcher advance). A warm-up round of each comes first
(the ``LLTokenizer`` is built on the first constrained request). Then ``rounds`` timed runs of
each, alternating (unconstrained, constrained, unconstrained, ...), on ``threads`` torch threads
(default 1). Each run reports tokens / wall second and tokens / CPU second of this process
(``time.process_time``: what the engine itself spent, which other load on a shared machine does
not inflate as it does wall time); the best round of each is compared, and ``ratio`` is the CPU
one (``wall_ratio`` beside it). Target: ratio >= 0.8.

Design notes: docs/DESIGN.md#benchguidedpy"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from swaserve.config import EngineConfig
from swaserve.engine.grammar import validate
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams, StructuredOutput

ITEMS = 12
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "items": {
            "type": "array",
            "minItems": ITEMS,
            "maxItems": ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "kind": {"enum": ["fruit", "tool", "book", "other"]},
                },
                "required": ["name", "qty", "kind"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
TOPICS = ["groceries", "a toolbox", "a library shelf", "a picnic", "camping gear", "a bakery", "an office",
          "a garden"]  # fmt: skip


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    """``n`` chat prompts through the model's chat template."""
    tok = engine.tokenizer
    out = []
    for i in range(n):
        msgs = [
            {"role": "user", "content": f"List the contents of {TOPICS[i % len(TOPICS)]} as JSON (#{i})."}
        ]
        out.append(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False))  # fmt: skip
    return out


def timed(engine: LLMEngine, ps: list[list[int]], params: SamplingParams, tag: str) -> dict[str, Any]:
    """Run the prompts together to completion: tokens, wall and CPU seconds, tokens/s, finish reasons."""
    tokens, reasons, steps = 0, {}, 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(ps):  # timed: a constrained request compiles its grammar here
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            tokens += len(o.new_token_ids)
            if o.finished:
                reasons[str(o.finish_reason)] = reasons.get(str(o.finish_reason), 0) + 1
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "tokens": tokens,
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
        "steps": steps,
        "finish": reasons,
    }


def main(
    json_path: str | None = None,
    model_dir: str | None = None,
    requests: int = 16,
    max_tokens: int = 64,
    rounds: int = 3,
    threads: int = 1,
) -> dict[str, Any]:
    """Run the bench; prints a table, writes ``json_path`` if given, returns the results."""
    from swaserve.model.checkpoint import default_model_dir

    torch.set_num_threads(threads)
    mdir = Path(model_dir) if model_dir else default_model_dir()
    engine = LLMEngine(
        mdir, EngineConfig(max_num_seqs=requests, max_num_batched_tokens=2048, kv_cache_memory=256 << 20)
    )
    so = StructuredOutput("json_schema", json.dumps(SCHEMA))
    validate(so)
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=so)
    ps = prompts(engine, requests)
    warm = ps[: min(4, requests)]
    timed(engine, warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "warm-plain")
    timed(engine, warm, SamplingParams(max_tokens=8, temperature=0.0, structured=so), "warm-guided")
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json_schema": []}
    for r in range(rounds):
        for name, params in (("unconstrained", plain), ("json_schema", guided)):
            engine.kv.flush_cache()  # each run prefills its prompts
            runs[name].append(timed(engine, ps, params, f"{name}-{r}"))
    base, constrained = (max(runs[k], key=lambda x: x["tokens_per_cpu_s"]) for k in runs)
    ratio = constrained["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    wall_ratio = max(x["tokens_per_s"] for x in runs["json_schema"]) / max(
        x["tokens_per_s"] for x in runs["unconstrained"]
    )
    result: dict[str, Any] = {
        "model_dir": str(mdir),
        "requests": requests,
        "max_tokens": max_tokens,
        "torch_threads": threads,
        "schema": SCHEMA,
        "rounds": rounds,
        "unconstrained": base,
        "json_schema": constrained,
        "all_rounds": runs,
        "ratio": ratio,
        "wall_ratio": wall_ratio,
        "target": 0.8,
    }
    print(f"{requests} chat requests x {max_tokens} tokens, greedy, inline engine ({mdir.name}), "
          f"{threads} torch thread(s), best of {rounds}")  # fmt: skip
    print(f"{'':<15}{'tokens':>8}{'wall s':>9}{'cpu s':>9}{'tok/s':>9}{'tok/cpu-s':>11}{'steps':>7}  finish")
    for name, x in (("unconstrained", base), ("json_schema", constrained)):
        print(
            f"{name:<15}{x['tokens']:>8}{x['seconds']:>9.2f}{x['cpu_seconds']:>9.2f}{x['tokens_per_s']:>9.1f}"
            f"{x['tokens_per_cpu_s']:>11.1f}{x['steps']:>7}  {x['finish']}"
        )
    print(f"ratio json_schema / unconstrained: {ratio:.3f} per CPU second, {wall_ratio:.3f} per wall second "
          "(target >= 0.8)")  # fmt: skip
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result

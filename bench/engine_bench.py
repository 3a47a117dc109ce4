"""Our engine vs transformers ``generate()`` in static batches, same checkpoint, same run.

Workload: the first ``--requests`` Mooncake requests as an offline burst, prompts scaled to
``block_tokens``-token blocks, outputs the trace's divided by ``output_divisor``; greedy, EOS
ignored. transformers runs static batches of ``hf_batch`` (left padding).

Workload and measurement: docs/DESIGN.md#benchengine_benchpy"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.traces import read_mooncake, to_token_ids

TRACE = Path(__file__).resolve().parent.parent / "data" / "traces" / "conversation_trace.jsonl"


def workload(n: int, block_tokens: int, output_divisor: int, vocab: int) -> list[tuple[list[int], int]]:
    reqs = read_mooncake(TRACE, limit=n)
    out = []
    for r in reqs:
        ids = to_token_ids(r, block_tokens=block_tokens, vocab_size=vocab)
        out.append((ids, max(1, r.output_length // output_divisor)))
    return out


def run_ours(model_dir: Path, work: list[tuple[list[int], int]], ecfg: EngineConfig) -> dict[str, float]:
    eng = LLMEngine(model_dir, ecfg)
    t0 = time.monotonic()
    for i, (ids, n_out) in enumerate(work):
        eng.add_request(
            f"b{i}", ids, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True), arrival_time=t0
        )
    ttft: dict[str, float] = {}
    tokens = 0
    while eng.has_unfinished():
        for o in eng.step():
            tokens += len(o.new_token_ids)
            if o.request_id not in ttft and o.new_token_ids:
                ttft[o.request_id] = time.monotonic() - t0
    wall = time.monotonic() - t0
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50": float(np.percentile(list(ttft.values()), 50)),
        "ttft_p90": float(np.percentile(list(ttft.values()), 90)),
    }


def run_transformers(model_dir: Path, work: list[tuple[list[int], int]], batch: int) -> dict[str, float]:
    from transformers import LogitsProcessor, LogitsProcessorList, MiMoV2FlashForCausalLM

    model = MiMoV2FlashForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = 0

    class FirstStep(LogitsProcessor):
        def __init__(self) -> None:
            self.t: float | None = None

        def __call__(self, input_ids, scores):  # type: ignore[no-untyped-def]
            if self.t is None:
                self.t = time.monotonic()
            return scores

    t0 = time.monotonic()
    ttfts: list[float] = []
    tokens = 0
    for b in range(0, len(work), batch):
        group = work[b : b + batch]
        width = max(len(ids) for ids, _ in group)
        input_ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, (ids, _) in enumerate(group):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        n_new = max(n for _, n in group)
        first = FirstStep()
        with torch.no_grad():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([first]),
            )
        assert first.t is not None
        ttfts.extend([first.t - t0] * len(group))
        tokens += sum(n for _, n in group)
    wall = time.monotonic() - t0
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50": float(np.percentile(ttfts, 50)),
        "ttft_p90": float(np.percentile(ttfts, 90)),
    }


def main(
    json_path: str | None = None,
    model_dir: str | None = None,
    requests: int = 64,
    block_tokens: int = 16,
    output_divisor: int = 8,
    hf_batch: int = 8,
) -> dict[str, object]:
    from swaserve.config import ModelConfig
    from swaserve.model.checkpoint import default_model_dir

    torch.set_num_threads(max(1, torch.get_num_threads()))
    mdir = Path(model_dir) if model_dir else default_model_dir()
    vocab = ModelConfig.from_pretrained(mdir).vocab_size
    work = workload(requests, block_tokens, output_divisor, vocab)
    ecfg = EngineConfig(max_num_seqs=requests, max_num_batched_tokens=1024, kv_cache_memory=512 << 20)
    ours = run_ours(mdir, work, ecfg)
    theirs = run_transformers(mdir, work, hf_batch)
    result: dict[str, object] = {
        "model_dir": str(mdir),
        "requests": requests,
        "block_tokens": block_tokens,
        "output_divisor": output_divisor,
        "hf_batch": hf_batch,
        "prompt_tokens_mean": float(np.mean([len(w[0]) for w in work])),
        "output_tokens_mean": float(np.mean([w[1] for w in work])),
        "ours": ours,
        "transformers": theirs,
        "throughput_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "ttft_p90_ratio": ours["ttft_p90"] / theirs["ttft_p90"],
    }
    print(
        f"engine bench: {requests} trace requests, prompt mean {result['prompt_tokens_mean']:.0f} tok "
        f"(blocks of {block_tokens}), output mean {result['output_tokens_mean']:.0f} tok"
    )
    print(f"{'':<14}{'wall s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p90':>10}")
    for name, r in (("swaserve", ours), ("transformers", theirs)):
        print(
            f"{name:<14}{r['wall_s']:>9.1f}{r['tokens_per_s']:>11.1f}{r['ttft_p50']:>10.2f}{r['ttft_p90']:>10.2f}"
        )
    print(
        f"throughput_ratio {result['throughput_ratio']:.2f} (target >= 2); "
        f"ttft_p90_ratio {result['ttft_p90_ratio']:.2f} (target < 1)"
    )
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""Test helpers: drive the model runner on hand-made chunk schedules, and transformers references."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig, kv_config
from swaserve.engine.model_runner import ModelRunner
from swaserve.engine.request import Request
from swaserve.engine.scheduler import ScheduledChunk
from swaserve.engine.types import SamplingParams
from swaserve.kvcache.arena import arena_layout
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.sizing import plan_pools
from swaserve.kvcache.storage import KVStorage
from swaserve.kvformat import KVFormat, residual_layers
from swaserve.model.loader import load_model


class Harness:
    """The real model, pools and runner, with every row's logits exposed."""

    def __init__(
        self,
        model_dir: str | Path,
        page_size: int,
        layout: str = "hybrid",
        budget: int = 8 << 20,
        shared: bool = False,
        formats: dict[str, KVFormat] | None = None,
    ) -> None:
        """``shared``: both pools on one arena (``kvcache.arena``), as the engine with prefix caching;
        ``formats``: each pool's page format (``swaserve.kvformat``)."""
        self.model_dir = Path(model_dir)
        self.cfg = ModelConfig.from_pretrained(model_dir)
        self.model = load_model(model_dir, self.cfg)
        ecfg = EngineConfig(page_size=page_size, kv_cache_memory=budget, kv_layout=layout)  # type: ignore[arg-type]
        # KIVI: the full layers' residuals are more SWA layers
        kcfg = kv_config(self.cfg, 0, residual_layers(formats, self.cfg)) if formats else self.cfg
        arena = arena_layout(kcfg, page_size, 4, formats) if shared else None
        plan = plan_pools(kcfg, ecfg, 4, shared=shared, arena=arena, formats=formats)
        assert (plan.unit_bytes is not None) == shared
        self.kv = KVCacheManager(
            plan, page_size, self.cfg.window, layout, len(kcfg.full_layers), len(kcfg.swa_layers)
        )
        self.storage = KVStorage(kcfg, plan, page_size, torch.float32, "cpu", formats)
        self.storage.bind(FULL, self.kv.full.pool)
        self.storage.bind(SWA, self.kv.swa.pool)
        self.runner = ModelRunner(self.model, self.cfg, self.kv, self.storage, torch.device("cpu"))

    def new(self, rid: str, tokens: Sequence[int]) -> Request:
        req = Request(rid, list(tokens), SamplingParams(max_tokens=1), 0.0, len(tokens) + 1)
        assert self.kv.admit(rid, len(tokens) + 1) is not None
        return req

    def step(self, plan: Sequence[tuple[Request, int]]) -> list[torch.Tensor]:
        """Run one step with chunk (req, n) for each entry; returns each chunk's logits [n, vocab]."""
        chunks = []
        for req, n in plan:
            start = req.num_computed
            assert self.kv.allocate(req.request_id, start, start + n)
            chunks.append(ScheduledChunk(req, start, n))
        batch, _ = self.runner.build(chunks)
        logits = self.model.logits(self.model(batch))
        out, row = [], 0
        for c in chunks:
            out.append(logits[row : row + c.n])
            row += c.n
            c.req.num_computed += c.n
        return out

    def run_alone(self, rid: str, tokens: Sequence[int], chunk_sizes: Sequence[int]) -> torch.Tensor:
        req = self.new(rid, tokens)
        outs = [self.step([(req, n)])[0] for n in chunk_sizes]
        self.kv.free(rid)
        return torch.cat(outs)


def reference_logits(hf_model, tokens: Sequence[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf_model(torch.tensor([list(tokens)])).logits[0].float()


def feed_chunks(hf, cache, tokens: Sequence[int], chunks: Sequence[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Transformers ``hf`` fed ``tokens`` in ``chunks`` through ``cache``: fp32 logits [sum, vocab]."""
    out, start = [], 0
    with torch.no_grad():
        for n in chunks:
            ids = torch.tensor([list(tokens[start : start + n])])
            out.append(hf(ids, past_key_values=cache, use_cache=True).logits[0].float())
            start += n
    return torch.cat(out)

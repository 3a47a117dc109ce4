"""The synchronous engine in one process: ``EngineCore`` + ``OutputProcessor`` (text, stop strings).

``step()`` = core step (schedule, forward, sample, stop tokens, length) -> detokenize and match
stop strings -> a request a stop string ended is aborted in the core before the next step, so
the core computes nothing past it. Used offline, in tests, and by the inline engine client
(``engine.async_engine``); no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swaserve.config import EngineConfig, ModelConfig
from swaserve.engine.core import EngineCore
from swaserve.engine.output import OutputProcessor
from swaserve.engine.request import Request
from swaserve.engine.scheduler import Scheduler
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import EngineLimits, RequestOutput, SamplingParams
from swaserve.hf_tokenizer import load_tokenizer
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.storage import KVStorage
from swaserve.media.placeholders import MediaInputs
from swaserve.model.multimodal import MultimodalConfig
from swaserve.transfer.kv_transfer import KVPayload


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's EOS id, if it has one (the core adds the model config's)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(eos)} if eos is not None else set()


class LLMEngine:
    """Args:
    model_dir: Hugging Face checkpoint directory (weights, config, tokenizer).
    config: engine knobs.
    clock: seconds, monotonic (injected for tests and simulation).

    ``core`` is the ``EngineCore``; its most used parts are properties here.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.model_dir = Path(model_dir)
        self.media_config = MultimodalConfig.from_pretrained(model_dir)
        self.core = EngineCore(model_dir, config, eos_token_ids(self.tokenizer), clock)
        self.processor = OutputProcessor(self.tokenizer)

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def limits(self) -> EngineLimits:
        return self.core.limits

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def requests(self) -> dict[str, Request]:
        return self.core.requests

    @property
    def storage(self) -> KVStorage:
        return self.core.storage

    @property
    def dtype(self) -> torch.dtype:
        return self.core.dtype

    @property
    def clock(self) -> Callable[[], float]:
        return self.core.clock

    # -- requests -------------------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, media: MediaInputs | None = None
    ) -> None:
        """Raise ValueError with a user-facing message if the request cannot be served."""
        self.core.limits.check(prompt_token_ids, params, media)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        export_kv: bool = False,
        media: MediaInputs | None = None,
    ) -> None:
        """Queue a request (``EngineCore.add_request``). Raises ValueError on invalid input."""
        self.core.add_request(request_id, prompt_token_ids, params, arrival_time, export_kv, media)
        self.processor.add(request_id, prompt_token_ids, params)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        payload: KVPayload,
        arrival_time: float | None = None,
        media: MediaInputs | None = None,
    ) -> None:
        """Queue a prefilled request (``EngineCore.add_prefilled``). Raises ValueError."""
        self.core.add_prefilled(
            request_id, prompt_token_ids, first_token, params, payload, arrival_time, media
        )
        self.processor.add(request_id, prompt_token_ids, params, first_token)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its final output (None if unknown)."""
        out = self.core.abort_request(request_id)
        if out is None:
            self.processor.remove(request_id)
            return None
        deltas, _ = self.processor.process([out])
        return deltas[0] if deltas else None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns one delta per request that produced a token or finished."""
        deltas, stopped = self.processor.process(self.core.step())
        for rid in stopped:  # a stop string ended it: free it before the next step
            self.core.abort_request(rid)
        return deltas

    def stats(self) -> EngineStats:
        return self.processor.with_counters(self.core.stats())

    def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        """``EngineCore.drain_cache_events``."""
        return self.core.drain_cache_events(resync)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline helper: run prompts to completion, return output token ids in order."""
        ids = [f"offline-{i}-{id(p)}" for i, p in enumerate(prompts)]
        for rid, p in zip(ids, prompts, strict=True):
            self.add_request(rid, p, params)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]

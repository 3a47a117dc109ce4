"""The synchronous engine core: add requests, step, read outputs.

``step()`` = schedule (continuous batching, chunked prefill) -> one forward over all scheduled
tokens -> sample the requests whose chunk reached their last token -> detokenize, check stop
conditions -> free finished requests' pages. It does no I/O; ``AsyncLLMEngine`` drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from swaserve.engine.model_runner import ModelRunner
from swaserve.engine.request import Request, RequestStatus
from swaserve.engine.sampler import Sampler, SamplingState
from swaserve.engine.scheduler import Scheduler
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.host import HostKVStorage
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.sizing import host_plan, plan_pools
from swaserve.kvcache.storage import KVStorage
from swaserve.model.loader import load_model
from swaserve.sched.cost import preset
from swaserve.sched.priority import ComputeAwarePriority
from swaserve.transfer.kv_transfer import KVPayload, gather, scatter

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def schedule_priority(config: EngineConfig) -> ComputeAwarePriority | None:
    """The scheduler's admission priority for ``config.schedule_policy`` (None: FCFS).

    Raises:
        ValueError: unknown policy or cost model, or a negative bound or weight.
    """
    if config.schedule_policy == "fcfs":
        return None
    if config.schedule_policy != "compute":
        raise ValueError(f"schedule_policy must be 'fcfs' or 'compute', got {config.schedule_policy!r}")
    return ComputeAwarePriority(
        preset(config.cost_model), config.priority_max_wait_s, config.priority_wait_weight
    )


class LLMEngine:
    """Args:
    model_dir: Hugging Face checkpoint directory.
    config: engine knobs.
    clock: seconds, monotonic (injected for tests and simulation).
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.clock = clock
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        self.dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device) if config.device else default_device()
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        torch.manual_seed(config.seed)
        self.model = load_model(model_dir, self.model_config, self.dtype, self.device)
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        plan = plan_pools(cfg, config, elem)
        self.storage = KVStorage(cfg, plan, config.page_size, self.dtype, self.device)
        self.host: HostKVStorage | None = None
        host_pages = None
        if config.enable_prefix_caching and config.host_cache_memory > 0:
            host_pages = host_plan(plan, config.host_cache_memory)
            self.host = HostKVStorage(
                self.storage, {FULL: host_pages[0], SWA: host_pages[1]}, config.page_size
            )
        if config.host_write_policy not in ("on_evict", "second_hit"):
            raise ValueError(
                f"host write policy must be on_evict or second_hit, got {config.host_write_policy!r}"
            )
        self.kv = KVCacheManager(
            plan,
            config.page_size,
            cfg.window,
            config.kv_layout,
            len(cfg.full_layers),
            len(cfg.swa_layers),
            prefix_caching=config.enable_prefix_caching,
            host_pages=host_pages,
            mover=self.host,
            write_policy=config.host_write_policy,  # type: ignore[arg-type]
        )
        if config.index_block_tokens is not None:
            self.kv.enable_cache_events(config.index_block_tokens)
        if not self.kv.fits_ever(min(self.max_model_len, config.max_num_batched_tokens)):
            raise ValueError("kv cache budget too small for even one request; raise --kv-cache-memory")
        kv_tokens = self.kv.full.pool.num_pages * config.page_size
        if kv_tokens < self.max_model_len:  # as vLLM: one request must always be able to fit
            log.warning(
                "max_model_len lowered from %d to %d tokens, what the KV cache holds",
                self.max_model_len,
                kv_tokens,
            )
            self.max_model_len = kv_tokens
        self.runner = ModelRunner(self.model, cfg, self.kv, self.storage, self.device, self.host)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, on_import=self._import_kv,
            priority=schedule_priority(config),
        )  # fmt: skip
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message if the request cannot be served."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} out of range [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({len(prompt_token_ids)} prompt + {params.max_tokens} max_tokens)"
            )
        if not self.kv.fits_ever(total):
            raise ValueError(
                f"request of {total} tokens can never fit in the KV cache "
                f"({self.kv.full.pool.num_pages} pages of {self.config.page_size} tokens)"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        export_kv: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError on invalid input or a duplicate id.

        ``export_kv`` (prefill role): the request stops after its first token (finish reason
        ``HANDOFF`` unless it really ended there), and its prompt's KV is copied to host memory
        first and returned in the final ``RequestOutput.kv_payload`` (``transfer.kv_transfer``).
        """
        req = self._new_request(request_id, prompt_token_ids, params, arrival_time)
        if export_kv:  # stops after its first token: pages for the prompt and that token only
            req.export_kv = True
            req.max_total_tokens = len(prompt_token_ids) + 1
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.prompt_tokens_total += len(prompt_token_ids)

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams,
        payload: KVPayload,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request whose prompt another worker prefilled (decode role): ``first_token`` was
        sampled there (and already streamed to the client), ``payload`` holds the prompt's KV in host
        memory. No pool page is taken until the scheduler admits the request; then the KV is copied
        in and decoding goes on from ``first_token``.

        Raises:
            ValueError: invalid input, a duplicate id, or a payload that does not cover the prompt.
        """
        if payload.num_tokens != len(prompt_token_ids) or payload.request_id != request_id:
            raise ValueError(
                f"KV payload of {payload.request_id!r} covers {payload.num_tokens} tokens, "
                f"prompt {request_id!r} has {len(prompt_token_ids)}"
            )
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token id {first_token} out of range")
        req = self._new_request(request_id, prompt_token_ids, params, arrival_time)
        req.kv_payload = payload
        gen = req.sampling.generator if req.sampling is not None else None
        if gen is not None and payload.sampler_state:
            try:
                gen.set_state(torch.frombuffer(bytearray(payload.sampler_state), dtype=torch.uint8))
            except RuntimeError as e:
                raise ValueError(f"sampler state from the prefill worker does not fit: {e}") from e
        req.output_token_ids.append(first_token)
        assert req.detok is not None
        req.detok.add([first_token])  # its text went out with the prefill worker's first chunk
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.clock() if arrival_time is None else arrival_time,
            max_total_tokens=len(prompt_token_ids) + params.max_tokens,
        )
        req.sampling = SamplingState.create(params, req.prompt_token_ids, self.device)
        req.sampling.output_token_ids = req.output_token_ids
        req.detok = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, params.skip_special_tokens, params.stop
        )
        return req

    def _import_kv(self, req: Request) -> None:
        """Scheduler hook at admission of a prefilled request: pages for its prompt, KV copied in."""
        payload = req.kv_payload
        assert payload is not None
        n = payload.num_tokens
        if not self.kv.allocate(req.request_id, n, n):
            raise RuntimeError("pages for imported KV not available after admission (internal error)")
        scatter(self.kv, self.storage, payload)
        req.num_computed = n
        req.kv_payload = None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req)
        req.finish_reason = FinishReason.ABORT
        return self._output(req, [], "", [], finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns one delta per request that produced a token or finished."""
        now = self.clock()
        chunks = self.scheduler.schedule(now)
        if not chunks:
            return []
        logits = self.runner.run(chunks)
        sampling = [c for c in chunks if c.samples]
        states = [c.req.sampling for c in sampling]
        sampled = self.sampler.sample(logits, states) if sampling else []  # type: ignore[arg-type]
        for c in chunks:
            c.req.num_computed = c.start + c.n
            if not c.samples and self.kv.cache is not None:  # chunked prefill: share what is done
                self.kv.cache_partial(c.req.request_id, c.req.token_slice(0, c.req.num_computed))
        outputs: list[RequestOutput] = []
        now = self.clock()
        for c, s in zip(sampling, sampled, strict=True):
            outputs.append(self._append(c.req, s.token_id, s.logprob, now))
        return outputs

    def _append(self, req: Request, token: int, logprob: object, now: float) -> RequestOutput:
        assert req.detok is not None
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_token_ids.append(token)
        self.generation_tokens_total += 1
        text = ""
        reason: FinishReason | None = None
        if check_stop_token(token, req.params, self.eos_token_ids):
            reason = FinishReason.STOP
        else:
            text = req.detok.add([token])
            if req.detok.stopped:
                reason = FinishReason.STOP
        if reason is None and (
            len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is None and req.export_kv:
            reason = FinishReason.HANDOFF  # text held back for a later token stays with the decoder
        elif reason is not None and not req.detok.stopped:
            text += req.detok.flush()
        lps = [logprob] if logprob is not None else []
        if reason is not None:
            if req.export_kv:
                req.kv_payload = gather(self.kv, self.storage, req.request_id, req.num_prompt)
                gen = req.sampling.generator if req.sampling is not None else None
                if gen is not None:  # the decoder continues this random stream
                    req.kv_payload.sampler_state = gen.get_state().numpy().tobytes()
            req.finish_reason = reason
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
        return self._output(req, [token], text, lps, finished=reason is not None)  # type: ignore[arg-type]

    def _output(self, req: Request, tokens: list[int], text: str, lps: list, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_text=text,
            new_logprobs=lps,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            prompt_tokens=req.num_prompt,
            completion_tokens=len(req.output_token_ids),
            cached_tokens=req.cached_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            kv_payload=req.kv_payload if finished and req.export_kv else None,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            pools=self.kv.stats(),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache=self.kv.cache.stats if self.kv.cache is not None else None,
            cache_pages=self.kv.cached_pages() if self.kv.cache is not None else {},
        )

    def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        """Prefix-cache block events since the last call, oldest first (``config.index_block_tokens``;
        empty when off). The caller publishes them (``routing.redis.events``). With ``resync``: a snapshot
        of the whole cache instead (``cleared`` + stored chains of every cached block), for a
        publisher that lost events; later calls return what happens after it."""
        return self.kv.drain_cache_events(self.clock(), resync)

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

    def is_running(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and req.status == RequestStatus.RUNNING

"""The engine core: schedule -> one forward over every scheduled token -> sample -> finish.

``EngineCore.step()`` runs continuous batching with chunked prefill and returns one
``CoreOutput`` (token ids, logprobs, why it ended) per request that sampled or finished. It ends
requests on stop *tokens*, length, a complete structured-output grammar (``engine.structured``:
its mask applied before sampling) and the prefill role's handoff; text, stop strings and usage
counters belong to the front (``engine.output.OutputProcessor``), so the same core runs inline
(``LLMEngine``) or in its own process (``engine.core_proc``). No I/O here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from swaserve.config import EngineConfig, ModelConfig
from swaserve.engine.core_output import CoreOutput
from swaserve.engine.detokenizer import check_stop_token
from swaserve.engine.drafter import Drafter
from swaserve.engine.kv_setup import build_kv_stack
from swaserve.engine.l3_tier import build_l3
from swaserve.engine.media_prefills import MediaPrefills
from swaserve.engine.model_runner import ModelRunner
from swaserve.engine.request import Request, RequestStatus
from swaserve.engine.sampler import Sampler
from swaserve.engine.sampling_state import SamplingState
from swaserve.engine.scheduler import Scheduler
from swaserve.engine.speculative import SpeculativeStep
from swaserve.engine.stats import EngineStats
from swaserve.engine.structured import StructuredDecoder
from swaserve.engine.types import EngineLimits, FinishReason, SamplingParams, TokenLogprob
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvformat import POOL_NAMES
from swaserve.media.placeholders import MediaInputs, text_ids
from swaserve.model.ep import ExpertComm, build_ep_shard
from swaserve.model.loader import load_model
from swaserve.sched.priority import schedule_priority
from swaserve.transfer.kv_transfer import KVPayload, gather, scatter

log = logging.getLogger(__name__)
KIND_OF_POOL = {pool: kind for kind, pool in POOL_NAMES.items()}  # "full" -> FULL, "swa" -> SWA

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class EngineCore:
    """Args:
    model_dir: Hugging Face checkpoint directory.
    config: engine knobs.
    eos_token_ids: ids that end a request (the model's and the tokenizer's EOS).
    clock: seconds, monotonic (injected for tests and simulation).
    ep_comm: with ``config.ep_size`` > 1, this rank's EP group (``model.ep``): the model holds
        its experts only, and every ``step`` runs one forward (an idle one without tokens), so all
        ranks enter each MoE layer's exchange together; the caller steps all ranks in lockstep.

    Raises:
        ValueError: a bad knob, or a KV budget too small for one request.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        eos_token_ids: Collection[int] = (),
        clock: Callable[[], float] = time.monotonic,
        ep_comm: ExpertComm | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.clock = clock
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        self.dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device) if config.device else default_device()
        self.model_config = cfg = ModelConfig.from_pretrained(model_dir)
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.eos_token_ids = set(cfg.eos_token_ids) | set(eos_token_ids)
        torch.manual_seed(config.seed)
        K = config.speculative_num_steps
        if not 0 <= K <= cfg.num_mtp_layers:
            raise ValueError(
                f"speculative_num_steps must be 0 .. {cfg.num_mtp_layers} (the checkpoint's MTP layers), got {K}"
            )
        self.ep = build_ep_shard(config, cfg, ep_comm)
        if self.ep is not None:
            self.ep.on_device(self.device)
        self.model = load_model(model_dir, cfg, self.dtype, self.device, self.ep)
        stack = build_kv_stack(config, cfg, self.dtype, self.device)
        self.kv_formats, self.storage, self.host, self.kv = stack.formats, stack.storage, stack.host, stack.kv
        if not self.kv.fits_ever(min(self.max_model_len, config.max_num_batched_tokens)):
            raise ValueError("kv cache budget too small for even one request; raise --kv-cache-memory")
        kv_tokens = self._max_fit_tokens()  # full pages, and with a shared budget the SWA ones too
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
            priority=schedule_priority(config), lookahead=K,
        )  # fmt: skip
        self.drafter = Drafter(self.model, cfg, self.kv, self.storage, self.device, K) if K else None
        self.spec = SpeculativeStep(self, self.drafter) if self.drafter is not None else None
        self.sampler = Sampler()
        self.structured = StructuredDecoder(model_dir, cfg.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.media_prefills = MediaPrefills(cfg.hidden_size)
        self.steps = 0  # forwards run (stats: the engine's progress)
        self.computed_tokens = 0  # tokens those forwards computed
        self.l3 = build_l3(
            config, model_dir, cfg, self.kv.cache, self.host.store if self.host else None, self.storage, clock
        )
        self.limits = EngineLimits(
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            max_fit_tokens=self._max_fit_tokens(),
            page_size=config.page_size,
            kv_pages=self.kv.full.pool.num_pages,
        )

    def _max_fit_tokens(self) -> int:
        """Largest prompt + output that empty pools could hold (``kv.fits_ever`` is monotonic)."""
        lo, hi = 0, 1 << 40
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.fits_ever(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        export_kv: bool = False,
        media: MediaInputs | None = None,
    ) -> None:
        """Queue a request. Raises ValueError on invalid input (a structured-output constraint
        that does not compile too, media spans that do not match the prompt) or a duplicate id.

        ``media``: the prompt's media items (placeholder spans, and the embeddings known now); the
        prefill does not pass a span whose embeddings are missing until ``supply_media`` brings them.

        ``export_kv`` (prefill role): the request stops after its first token (finish reason
        ``HANDOFF`` unless it really ended there), and its prompt's KV is copied to host memory
        first and returned in the final ``CoreOutput.kv_payload`` (``transfer.kv_transfer``).
        """
        req = self._new_request(request_id, prompt_token_ids, params, arrival_time, media)
        if params.structured is not None:
            req.grammar = self.structured.new(params.structured)
        if export_kv:  # stops after its first token: pages for the prompt and that token only
            req.export_kv = True  # (and with MTP the positions of the first drafts' rows)
            req.max_total_tokens = len(prompt_token_ids) + 1 + (self.drafter.k if self.drafter else 0)
        self.requests[request_id] = req
        if req.media is not None:
            self.media_prefills.add(req)
        if self.l3 is None or req.params.prompt_logprobs is not None or not self.l3.begin(req):
            self.scheduler.add(req)  # else it waits for its L3 fetch (``step`` polls it)

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
        """Queue a request whose prompt another worker prefilled (decode role): ``first_token`` was
        sampled there (and already streamed to the client), ``payload`` holds the prompt's KV in
        host memory. No pool page is taken until the scheduler admits the request; then the KV is
        copied in and decoding goes on from ``first_token``.

        Raises:
            ValueError: invalid input, a duplicate id, a payload that does not cover the prompt, or
                a structured-output constraint that does not compile or rejects ``first_token``.
        """
        self.limits.check_prefilled(request_id, prompt_token_ids, first_token, payload)
        imported = bool(payload.sampler_state)  # the prefill worker's generator state follows
        req = self._new_request(request_id, prompt_token_ids, params, arrival_time, media, imported)
        req.kv_payload = payload
        req.prompt_logprobs = None  # computed and sent by the prefill worker
        gen = req.sampling.generator if req.sampling is not None else None
        if gen is not None and payload.sampler_state:
            try:
                gen.set_state(torch.frombuffer(bytearray(payload.sampler_state), dtype=torch.uint8))
            except RuntimeError as e:
                raise ValueError(f"sampler state from the prefill worker does not fit: {e}") from e
        req.output_token_ids.append(first_token)
        if self.drafter is not None:  # MTP rows from the prompt's end on; drafts from the prefill
            self.drafter.start_imported(req, payload.mtp_hidden, payload.spec_drafts)
        if params.structured is not None:  # the prefill worker sampled it under the same grammar
            req.grammar = self.structured.new(params.structured, [first_token])
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
        media: MediaInputs | None = None,
        generator_imported: bool = False,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.limits.check(prompt_token_ids, params, media)
        if media is not None:
            media.check_embeds(self.model_config.hidden_size)
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.clock() if arrival_time is None else arrival_time,
            max_total_tokens=len(prompt_token_ids) + params.max_tokens,
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = []
        req.media = media if media is not None and media.spans else None
        penalized = req.prompt_token_ids if req.media is None else text_ids(req.prompt_token_ids)
        req.sampling = SamplingState.create(params, penalized, self.device, not generator_imported)
        req.sampling.output_token_ids = req.output_token_ids
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

    def supply_media(self, request_id: str, index: int, embeds: torch.Tensor) -> bool:
        """Hand a waiting request the embeddings [span.length, hidden] of its media item ``index``;
        False when the request is gone.

        Raises:
            ValueError: no such item, or a shape that does not fit it.
        """
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.media_prefills.supply(req, index, embeds)
        return True

    def media_missing(self) -> dict[str, list[int]]:
        """Admitted requests whose prefill waits for embeddings: id -> the media items (spans
        past the prefix hit) still missing. A span the hit covers is never asked for."""
        return self.media_prefills.missing()

    def abort_request(self, request_id: str) -> CoreOutput | None:
        """Stop a request and free its pages; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.l3 is not None and self.l3.cancel(request_id):
            req.status = RequestStatus.FINISHED
        else:
            self.scheduler.finish(req)
        req.finish_reason = FinishReason.ABORT
        return self._output(req, [], [])

    def abort_all(self) -> list[str]:
        """Abort every request (after a failed step); returns their ids. A request whose abort
        fails is dropped anyway (logged): nothing may stay half-finished."""
        rids = list(self.requests)
        for rid in rids:
            try:
                self.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
                self.requests.pop(rid, None)
        return rids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.l3 is not None and self.l3.pending())

    def is_running(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        return req is not None and req.status == RequestStatus.RUNNING

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Run one engine step; returns one output per request that sampled a token."""
        now = self.clock()
        if self.l3 is not None:
            for req in self.l3.poll():
                if req.status == RequestStatus.WAITING:
                    self.scheduler.add(req)
        chunks = self.scheduler.schedule(now)
        asks = self.media_prefills.asks(lambda r: self._output(r, [], [])) if self.media_prefills else []
        if not chunks and self.ep is not None:  # the other ranks' tokens still need our experts
            self.model.idle_forward()
            self.ep.end_step()
        if not chunks:
            if self.l3 is not None and self.l3.pending():
                self.l3.wait(0.005)  # nothing to compute: wait for a fetch rather than spin
            elif not asks and self.media_prefills and self.media_prefills.waiting():
                time.sleep(0.002)  # nothing to compute until embeddings come (``supply_media``)
            if self.media_prefills:
                self.media_prefills.done(self.requests)  # aborted ones leave
            return asks
        logits, prompt_lps, hidden = self.runner.run(chunks, keep_hidden=self.spec is not None)
        if self.ep is not None:
            self.ep.end_step()
        self.steps += 1
        self.computed_tokens += sum(c.n for c in chunks)
        for i, lps in prompt_lps.items():
            have = chunks[i].req.prompt_logprobs
            if have is not None:
                have.extend(lps)
        if self.spec is not None:
            assert hidden is not None
            outputs = asks + self.spec.finish_step(chunks, logits, hidden)
            if self.media_prefills:
                self.media_prefills.done(self.requests)  # after the drafter: its rows read the embeddings too
            return outputs
        ends = [c for c in chunks if c.samples]
        sampling = [c for c in ends if c.req.params.max_tokens > 0]  # max_tokens 0: the prompt only
        if len(sampling) < len(ends):
            logits = logits[[j for j, c in enumerate(ends) if c.req.params.max_tokens > 0]]
        states = [c.req.sampling for c in sampling]
        grammars = [c.req.grammar for c in sampling]
        masked = self.structured.mask(logits, grammars) if any(grammars) else None
        sampled = self.sampler.sample(logits, states, masked) if sampling else []  # type: ignore[arg-type]
        for c in chunks:
            c.req.num_computed = c.start + c.n
            # a prefill chunk (the prompt's last one too): share its whole pages now, so requests
            # with the same prefix (a chat's next turn, the other choices of n) hit them at once
            if c.start < c.req.num_prompt and self.kv.cache is not None:
                self.kv.cache_partial(c.req.request_id, c.req.token_slice(0, c.req.num_computed))
        now = self.clock()
        outputs = asks + [self._prompt_only(c.req) for c in ends if c.req.params.max_tokens == 0]
        outputs += [
            self._append(c.req, s.token_id, s.logprob, now) for c, s in zip(sampling, sampled, strict=True)
        ]
        if self.media_prefills:
            self.media_prefills.done(self.requests)
        return outputs

    def _prompt_only(self, req: Request) -> CoreOutput:
        """End a ``max_tokens`` 0 request once its prompt is computed: no token, reason LENGTH."""
        req.finish_reason = FinishReason.LENGTH
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        return self._output(req, [], [])

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None, now: float) -> CoreOutput:
        return self._append_tokens(req, [token], [logprob], now)

    def _append_tokens(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
        defer: list[Request] | None = None,
    ) -> CoreOutput:
        """Append tokens one by one (speculative steps emit several), ending the request at the
        first that finishes it; one output for all. With ``defer``, a finishing request is put
        there instead of leaving now (the caller then calls ``_finish``)."""
        if req.first_token_time is None:
            req.first_token_time = now
        out_tokens: list[int] = []
        out_lps: list[TokenLogprob] = []
        stop_token = False
        g = req.grammar
        for token, logprob in zip(tokens, logprobs, strict=True):
            if g is not None:
                g.accept(token)
                if g.error:  # a broken grammar fails its request, never the engine
                    log.warning("request %s: %s", req.request_id, g.error)
                    out = self.abort_request(req.request_id)
                    assert out is not None
                    out.error = g.error
                    out.new_token_ids, out.new_logprobs = out_tokens, out_lps
                    return out
            req.output_token_ids.append(token)
            out_tokens.append(token)
            if logprob is not None:
                out_lps.append(logprob)
            reason: FinishReason | None = None
            stop_token = check_stop_token(token, req.params, self.eos_token_ids)
            if stop_token or (g is not None and g.done):
                reason = FinishReason.STOP
            elif len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            elif req.export_kv:
                reason = FinishReason.HANDOFF
            if reason is not None:
                req.finish_reason = reason
                if defer is None:
                    self._finish(req)
                else:
                    defer.append(req)
                break
        out = self._output(req, out_tokens, out_lps)
        out.structured_end = req.finish_reason == FinishReason.STOP and not stop_token
        return out

    def _finish(self, req: Request) -> None:
        """A request whose ``finish_reason`` is set leaves: its KV exported (prefill role), its
        pages freed (cached)."""
        if req.export_kv:
            req.kv_payload = gather(self.kv, self.storage, req.request_id, req.num_prompt)
            gen = req.sampling.generator if req.sampling is not None else None
            if gen is not None:  # the decoder continues this random stream
                req.kv_payload.sampler_state = gen.get_state().numpy().tobytes()
            if req.mtp is not None:  # the first drafts, and the hidden states their rows read
                req.kv_payload.spec_drafts = list(req.spec_drafts)
                req.kv_payload.mtp_hidden = self.drafter.hidden_tail(req) if self.drafter else None
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)

    def _output(self, req: Request, tokens: list[int], lps: list[TokenLogprob]) -> CoreOutput:
        finished = req.finish_reason is not None
        prompt_lps = None
        if req.prompt_logprobs is not None and req.num_computed >= req.num_prompt:
            prompt_lps, req.prompt_logprobs = req.prompt_logprobs, None  # sent once
        return CoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=lps,
            prompt_logprobs=prompt_lps,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_prompt,
            completion_tokens=len(req.output_token_ids),
            cached_tokens=req.cached_tokens,
            cached_host_tokens=req.cached_host_tokens,
            cached_l3_tokens=min(req.l3_tokens, req.cached_host_tokens),
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            kv_payload=req.kv_payload if finished and req.export_kv else None,
        )

    # -- state ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Pools, queue and load now (token counters are the front's: ``OutputProcessor``)."""
        reqs = self.requests.values()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            pools={
                name: dataclasses.replace(
                    p, kv_format=self.kv_formats[kind].describe(), page_size=self.config.page_size
                )
                for name, p in self.kv.stats().items()
                for kind in [KIND_OF_POOL[name]]
            },
            prefix_cache=self.kv.cache.stats if self.kv.cache is not None else None,
            cache_pages=self.kv.cached_pages() if self.kv.cache is not None else {},
            outstanding_tokens=sum(
                max(0, r.num_prompt - r.num_computed) + r.params.max_tokens - len(r.output_token_ids)
                for r in reqs
            ),
            prefill_tokens=sum(max(0, r.num_prompt - r.num_computed) for r in reqs),
            steps_total=self.steps,
            computed_tokens_total=self.computed_tokens,
            spec=dataclasses.replace(self.spec.stats, accepted_per_pos=list(self.spec.stats.accepted_per_pos))
            if self.spec is not None
            else None,
            ep=copy.deepcopy(self.ep.stats) if self.ep is not None else None,
            l3=self.l3.counters() if self.l3 is not None else {},
        )

    def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        """Prefix-cache block events since the last call, oldest first (``config.index_block_tokens``;
        empty when off). The caller publishes them (``routing.events``). With ``resync``: a snapshot
        of the whole cache instead (``cleared`` + stored chains of every cached block), for a
        publisher that lost events; later calls return what happens after it."""
        return self.kv.drain_cache_events(self.clock(), resync)

    def flush_cache(self) -> None:
        """Drop every unlocked page the prefix cache holds (device and host)."""
        self.kv.flush_cache()

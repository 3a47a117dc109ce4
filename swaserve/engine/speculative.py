"""The engine step with MTP speculative decoding (``--speculative-num-steps K``).

One step: the scheduled chunks (prefill chunks, decode chunks, verify chunks: the last token then
the request's drafts) run in one target forward; each sampling chunk's first row is sampled in one
batched call as without speculation, then ``engine.spec.verify`` walks a verify chunk's later rows
(lazily: a row is sampled only when the previous one accepted its draft; penalties see the tokens
emitted before it). Committed rows' hidden states go to the drafter, whose pass writes the MTP KV
of the new positions and proposes the next drafts (``engine.drafter``); only then do finished
requests leave (their pages, and a prefill-role payload, carry final MTP KV). Rejected rows are
undone by length: ``num_computed`` stops after the last accepted one, the stale KV behind it is
overwritten by the next step's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from swaserve.engine.core_output import CoreOutput
from swaserve.engine.detokenizer import check_stop_token
from swaserve.engine.drafter import Drafter, DraftItem
from swaserve.engine.request import Request
from swaserve.engine.sampler import SampledToken, Sampler
from swaserve.engine.scheduler import ScheduledChunk
from swaserve.engine.spec import SpecStats, verify
from swaserve.engine.structured import StructuredDecoder
from swaserve.engine.types import FinishReason, TokenLogprob
from swaserve.kvcache.manager import KVCacheManager


class Core(Protocol):
    """What the step needs of ``EngineCore`` (which holds it)."""

    kv: KVCacheManager
    sampler: Sampler
    structured: StructuredDecoder
    clock: Callable[[], float]
    max_model_len: int
    eos_token_ids: set[int]

    def _output(self, req: Request, tokens: list[int], lps: list[TokenLogprob]) -> CoreOutput: ...

    def _append_tokens(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
        defer: list[Request] | None = None,
    ) -> CoreOutput: ...

    def _finish(self, req: Request) -> None: ...


class SpeculativeStep:
    """``EngineCore.step`` after its forward when MTP is on (module docstring)."""

    def __init__(self, core: Core, drafter: Drafter) -> None:
        self.core = core
        self.drafter = drafter
        self.k = drafter.k
        self.stats = SpecStats()

    def finish_step(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor, hidden: torch.Tensor
    ) -> list[CoreOutput]:
        """Sample, verify, draft, finish; returns one output per request that emitted or ended.
        ``logits``: the runner's sampled rows (``1 + draft`` per sampling chunk); ``hidden``: the
        pre-final-norm states of every row."""
        core = self.core
        first: dict[int, int] = {}  # chunk index -> its first sampled row
        off = 0
        for i, c in enumerate(chunks):
            if c.samples:
                first[i] = off
                off += 1 + c.draft
        ends = [i for i in first if chunks[i].req.params.max_tokens > 0]
        states = [chunks[i].req.sampling for i in ends]
        grammars = [chunks[i].req.grammar for i in ends]
        rows0 = logits[[first[i] for i in ends]] if ends else logits[:0]
        masked = core.structured.mask(rows0, grammars) if any(grammars) else None
        sampled = core.sampler.sample(rows0, states, masked) if ends else []  # type: ignore[arg-type]
        emitted: dict[int, tuple[list[int], list[TokenLogprob | None]]] = {}
        for i, s in zip(ends, sampled, strict=True):
            c = chunks[i]
            emitted[i] = self._verify(c, logits, first[i], s) if c.draft else ([s.token_id], [s.logprob])
            if c.draft:
                self.stats.record(c.req.spec_drafts[: c.draft], emitted[i][0])
        now = core.clock()
        outputs: list[CoreOutput] = []
        finishing: list[Request] = []
        items: list[DraftItem] = []
        row = 0
        for i, c in enumerate(chunks):
            req = c.req
            toks, lps = emitted.get(i, ([], []))
            committed = c.n - c.draft + max(0, len(toks) - 1)
            self.drafter.absorb(req, c.start, hidden[row : row + committed])
            row += c.n
            req.num_computed = c.start + committed
            if c.samples and req.params.max_tokens == 0:
                req.finish_reason = FinishReason.LENGTH  # the prompt only
                finishing.append(req)
                outputs.append(core._output(req, [], []))
            elif toks:
                out = core._append_tokens(req, toks, lps, now, finishing)
                outputs.append(out)
                if out.error:  # aborted (a broken grammar): its pages are gone
                    continue
            end = req.num_tokens if c.samples else req.num_computed
            drafts = self._drafts(req, end, req in finishing) if c.samples else 0  # mid-prompt: none
            items.append(DraftItem(req, end, drafts))
        self.drafter.run(items)
        for c in chunks:  # as without MTP: running prefills share their whole pages at once
            r = c.req
            if c.start < r.num_prompt and core.kv.cache is not None and r.finish_reason is None:
                core.kv.cache_partial(r.request_id, r.token_slice(0, r.num_computed))
        by_id = {o.request_id: o for o in outputs}
        for req in finishing:
            core._finish(req)
            if req.export_kv:
                by_id[req.request_id].kv_payload = req.kv_payload
        return outputs

    def _drafts(self, req: Request, end: int, finishing: bool) -> int:
        """Drafts to propose for ``req`` with tokens ``< end`` committed (0: none)."""
        if req.grammar is not None or (finishing and not req.export_kv):
            return 0
        room = req.spec_end - end + 1  # draft k's row sits at end - 1 + k, inside the held pages
        if req.export_kv:  # the decode worker verifies them
            return max(0, min(self.k, room))
        left = min(req.params.max_tokens - len(req.output_token_ids), self.core.max_model_len - end)
        return max(0, min(self.k, room, left - 1))

    def _verify(
        self, c: ScheduledChunk, logits: torch.Tensor, r0: int, s0: SampledToken
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens and logprobs a verify chunk emits (``engine.spec.verify``); row 0 was
        sampled already (``s0``), later rows are sampled with the earlier tokens in the output."""
        req = c.req
        state = req.sampling
        assert state is not None
        p = req.params
        drafts = req.spec_drafts[: c.draft]
        plain = p.greedy and not state.needs_penalties and p.logprobs is None and not p.logit_bias
        argmax = logits[r0 : r0 + 1 + c.draft].argmax(dim=-1).tolist() if plain else []
        toks: list[int] = []
        lps: list[TokenLogprob | None] = []
        n0 = len(req.output_token_ids)

        def row(j: int) -> int:
            if j == 0:
                tok, lp = s0.token_id, s0.logprob
            elif plain:
                tok, lp = argmax[j], None
            else:
                req.output_token_ids.append(toks[-1])  # penalties see the tokens before this row
                s = self.core.sampler.sample(logits[r0 + j : r0 + j + 1], [state])[0]
                tok, lp = s.token_id, s.logprob
            toks.append(tok)
            lps.append(lp)
            return tok

        budget = min(p.max_tokens - n0, self.core.max_model_len - req.num_tokens)
        try:
            verify(drafts, row, max(1, budget), lambda t: check_stop_token(t, p, self.core.eos_token_ids))
        finally:
            del req.output_token_ids[n0:]
        return toks, lps

"""Turn a step's scheduled chunks into one flat ``ForwardBatch`` and run the model.

For every chunk ``[start, end)`` of a request, both attention kinds get the pool slots of the new
tokens (``write_slots``) and the slots of the keys the chunk reads: full layers every position
``[0, end)``; SWA layers ``[max(0, start - window), end)`` with the window mask
``q_pos - window <= kv_pos <= q_pos`` (``window = sliding_window - 1``). The metadata is built once
per step and shared by all layers of a kind (of a unit group, with a shared KV arena: the slots
are then the arena rows of that group, ``KVStorage.locate``). Requests with ``prompt_logprobs`` also get the
logprob of every prompt token from the logits at the position before it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.engine.media_rows import MediaRows
from swaserve.engine.sampler import fill_logprobs
from swaserve.engine.scheduler import ScheduledChunk
from swaserve.engine.sinks import SinkTable
from swaserve.engine.types import TokenLogprob
from swaserve.kvcache.host import HostKVStorage
from swaserve.kvcache.kind import KindManager
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.storage import KVStorage
from swaserve.model.attention import KindMeta, KiviSpan, kind_meta, kivi_mask
from swaserve.model.mimo_v2 import ForwardBatch, MiMoV2ForCausalLM

# Prompt-logprob rows whose logits are computed at once: bounds memory to rows x vocab x 4 bytes.
PROMPT_LOGITS_ROWS = 512


class ModelRunner:
    def __init__(
        self,
        model: MiMoV2ForCausalLM,
        cfg: ModelConfig,
        kv: KVCacheManager,
        storage: KVStorage,
        device: torch.device,
        host: HostKVStorage | None = None,
    ) -> None:
        self.model, self.cfg, self.kv, self.storage, self.device = model, cfg, kv, storage, device
        self.host = host
        sinks = storage.formats[FULL].sinks
        self.sinks = SinkTable(model, cfg, storage.formats, device) if sinks else None

    def build(self, chunks: Sequence[ScheduledChunk]) -> tuple[ForwardBatch, list[int]]:
        """Returns the batch and the flat rows whose logits are sampled: each sampling chunk's last
        token, and before it its ``draft`` verify rows (speculative decoding)."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row = 0
        media = MediaRows()
        for c in chunks:
            media.add(c.req, c.start, c.start + c.n - c.draft, row)
            ids.extend(c.req.token_slice(c.start, c.start + c.n - c.draft))
            ids.extend(c.req.spec_drafts[: c.draft])  # verify rows: the drafts after the last token
            pos.append(torch.arange(c.start, c.start + c.n, dtype=torch.int64))
            row += c.n
            if c.samples:
                sample_rows.extend(range(row - 1 - c.draft, row))
        kivi = self.storage.formats[FULL].kivi
        residual = self._residual_layers() if kivi else None
        meta = {
            FULL: self._kivi_metas(chunks, residual)
            if residual
            else self._kind_metas(chunks, FULL, self.kv.full, None)
        }
        if self.cfg.swa_layers:
            meta[SWA] = self._kind_metas(chunks, SWA, self.kv.swa, self.cfg.window)
        batch = ForwardBatch(
            input_ids=media.clear_pads(ids, self.device),
            positions=torch.cat(pos).to(self.device),
            meta=meta,
            kv=self.storage.kv,
            groups=self.storage.groups,
            before_layer=self.host.wait_layer if self.host is not None and self.host.pending() else None,
            embeds=media.build(self.device),
            residual=residual,
            sink_tokens=self.sinks.step(chunks) if self.sinks is not None else None,
        )
        return batch, sample_rows

    def _residual_layers(self) -> list[int]:
        """KIVI: each full layer's residual, by index among the storage's SWA layers (the last
        ones, ``config.kv_config``)."""
        n_full, n_swa = len(self.cfg.full_layers), len(self.storage.kv[SWA][0])
        return [n_swa - n_full + j for j in range(n_full)]

    def _kivi_metas(self, chunks: Sequence[ScheduledChunk], residual: list[int]) -> list[KindMeta]:
        """A KIVI full pool's metadata per unit group: each chunk's full-pool slots of ``[0, end)``
        and its residual slots of ``[start - W, end)`` in every SWA group a residual layer uses."""
        fmt, window = self.storage.formats[FULL], self.cfg.window
        res_groups = sorted({self.storage.groups[SWA][r] for r in residual})
        spans = []
        for c in chunks:
            rid, start, end = c.req.request_id, c.start, c.start + c.n
            lo = max(0, start - window)
            res = self.kv.swa.slots(rid, lo, end)
            located = {rg: self.storage.locate(SWA, rg, res).to(self.device) for rg in res_groups}
            mask = kivi_mask(start, end, lo, fmt.residual, self.device)  # shared by the full layers
            spans.append((start, end, lo, self.kv.full.slots(rid, 0, end), located, mask))
        out = []
        for g in range(self.storage.num_groups(FULL)):
            row, items = 0, []
            for seq, (start, end, lo, full, located, mask) in enumerate(spans):
                full_g = self.storage.locate(FULL, g, full).to(self.device)
                items.append(KiviSpan(row, start, end, lo, full_g, located, mask, seq))
                row += end - start
            out.append(
                KindMeta(
                    write_slots=torch.empty(0, dtype=torch.int64),
                    fmt=fmt,
                    kivi=items,
                    resid_fmt=self.storage.formats[SWA],
                )
            )
        return out

    def _kind_metas(
        self, chunks: Sequence[ScheduledChunk], kind: str, mgr: KindManager, window: int | None
    ) -> list[KindMeta]:
        """``kind``'s metadata for each unit group of the storage (one with pools of their own)."""
        spans = [(c.req.request_id, c.start, c.start + c.n) for c in chunks]
        pool_slots: dict[tuple[str, int, int], torch.Tensor] = {}  # page-table walks once per step

        def slots(rid: str, lo: int, end: int) -> torch.Tensor:
            key = (rid, lo, end)
            if key not in pool_slots:
                pool_slots[key] = mgr.slots(rid, lo, end)
            return pool_slots[key]

        fmt = self.storage.formats[kind]
        return [
            kind_meta(spans, slots, window, functools.partial(self.storage.locate, kind, g), self.device, fmt)
            for g in range(self.storage.num_groups(kind))
        ]

    @torch.inference_mode()
    def run(
        self, chunks: Sequence[ScheduledChunk], keep_hidden: bool = False
    ) -> tuple[torch.Tensor, dict[int, list[TokenLogprob]], torch.Tensor | None]:
        """Forward one step.

        Returns:
            fp32 logits [sampled rows, vocab] (``build``: a sampling chunk's ``draft + 1`` last
            rows); for each chunk (by index) of a request with ``prompt_logprobs`` the logprobs of
            the prompt tokens it predicts: positions ``start+1 .. min(start+n, prompt_len-1)``
            (token 0 has no logprob); with ``keep_hidden`` the decoder's pre-final-norm output
            [T, hidden] of every row (what the MTP layers read), else None.
        """
        batch, rows = self.build(chunks)
        pre = self.model.forward_hidden(batch)
        hidden = self.model.norm(pre)
        prompt = self._prompt_logprobs(hidden, chunks)
        kept = pre if keep_hidden else None
        if not rows:
            return hidden.new_empty(0, self.cfg.vocab_size, dtype=torch.float32), prompt, kept
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)]), prompt, kept

    def _prompt_logprobs(
        self, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk]
    ) -> dict[int, list[TokenLogprob]]:
        out: dict[int, list[TokenLogprob]] = {}
        row = 0
        for i, c in enumerate(chunks):
            k = c.req.params.prompt_logprobs
            m = min(c.start + c.n, c.req.num_prompt - 1) - c.start  # prompt tokens this chunk predicts
            if k is not None and m > 0:
                targets = c.req.prompt_token_ids[c.start + 1 : c.start + 1 + m]
                lps: list[TokenLogprob | None] = []
                for b in range(0, m, PROMPT_LOGITS_ROWS):
                    e = min(m, b + PROMPT_LOGITS_ROWS)
                    block: list[TokenLogprob | None] = [None] * (e - b)
                    ids = torch.tensor(targets[b:e], dtype=torch.long, device=hidden.device)
                    logits = self.model.logits(hidden[row + b : row + e])
                    fill_logprobs(logits, ids, list(range(e - b)), [k] * (e - b), block, with_rank=True)
                    lps.extend(block)
                out[i] = [lp for lp in lps if lp is not None]
            row += c.n
        return out

"""Turn a step's scheduled chunks into one flat ``ForwardBatch`` and run the model.

For every chunk ``[start, end)`` of a request, both attention kinds get the pool slots of the new
tokens (``write_slots``) and the slots of the keys the chunk reads: full layers every position
``[0, end)``; SWA layers ``[max(0, start - window), end)`` with the window mask
``q_pos - window <= kv_pos <= q_pos`` (``window = sliding_window - 1``). The metadata is built once
per step and shared by all layers of a kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.engine.scheduler import ScheduledChunk
from swaserve.kvcache.host import HostKVStorage
from swaserve.kvcache.kind import KindManager
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.storage import KVStorage
from swaserve.model.attention import KindMeta, SeqAttn
from swaserve.model.mimo_v2 import ForwardBatch, MiMoV2ForCausalLM


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

    def build(self, chunks: Sequence[ScheduledChunk]) -> tuple[ForwardBatch, list[int]]:
        """Returns the batch and the flat row of each sampling chunk's last token."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row = 0
        for c in chunks:
            ids.extend(c.req.token_slice(c.start, c.start + c.n))
            pos.append(torch.arange(c.start, c.start + c.n, dtype=torch.int64))
            row += c.n
            if c.samples:
                sample_rows.append(row - 1)
        meta = {FULL: self._kind_meta(chunks, self.kv.full, None)}
        if self.cfg.swa_layers:
            meta[SWA] = self._kind_meta(chunks, self.kv.swa, self.cfg.window)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.cat(pos).to(self.device),
            meta=meta,
            kv=self.storage.kv,
            before_layer=self.host.wait_layer if self.host is not None and self.host.pending() else None,
        )
        return batch, sample_rows

    def _kind_meta(self, chunks: Sequence[ScheduledChunk], mgr: KindManager, window: int | None) -> KindMeta:
        dev = self.device
        writes: list[torch.Tensor] = []
        prefills: list[SeqAttn] = []
        dec_rows: list[int] = []
        dec_slots: list[torch.Tensor] = []
        row = 0
        for c in chunks:
            rid = c.req.request_id
            end = c.start + c.n
            writes.append(mgr.slots(rid, c.start, end))
            lo = 0 if window is None else max(0, c.start - window)
            slots = mgr.slots(rid, lo, end)
            if c.n == 1:
                dec_rows.append(row)
                dec_slots.append(slots)
            else:
                kv_pos = torch.arange(lo, end, dtype=torch.int64)
                q_pos = torch.arange(c.start, end, dtype=torch.int64)
                mask = kv_pos[None, :] <= q_pos[:, None]
                if window is not None:
                    mask &= kv_pos[None, :] >= q_pos[:, None] - window
                prefills.append(SeqAttn(row, c.n, slots.to(dev), mask.to(dev)))
            row += c.n
        meta = KindMeta(write_slots=torch.cat(writes).to(dev), prefills=prefills)
        if dec_rows:
            lengths = torch.tensor([len(s) for s in dec_slots])
            slots_pad = pad_sequence(dec_slots, batch_first=True)
            valid = torch.arange(slots_pad.shape[1])[None, :] < lengths[:, None]
            meta.decode_rows = torch.tensor(dec_rows, dtype=torch.int64, device=dev)
            meta.decode_slots = slots_pad.to(dev)
            meta.decode_mask = valid.to(dev)
        return meta

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Forward one step; returns fp32 logits [num sampling chunks, vocab]."""
        batch, rows = self.build(chunks)
        hidden = self.model(batch)
        if not rows:
            return hidden.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return self.model.logits(hidden[torch.tensor(rows, device=hidden.device)])

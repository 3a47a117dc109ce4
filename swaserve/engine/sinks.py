"""Sink tokens in full precision (``--kv-sink-tokens S``) over a quantized full pool.

Quantization error on the first tokens, which draw a large share of attention (the "attention
sink", Xiao et al., arXiv:2309.17453), costs more than elsewhere; KVQuant keeps them in 16 bits
(arXiv:2401.18079, attention-sink-aware quantization). Here the full layers read the K/V of a
request's first ``S' = min(S, prompt length, first media placeholder)`` positions from a table,
not from the pages.

An entry is defined as the full layers' K/V from a forward over those S' tokens alone (full
layers unquantized, SWA layers in their pool's format, as the engine reads them), so it depends
on the tokens only: chunking, prefix hits from any tier, PD and speculation read the same values
without carrying them. Entries are kept by token content in an LRU of ``capacity`` (a template's
first tokens are shared by most requests); an evicted one is computed again, to the same bits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.engine.request import Request
from swaserve.engine.scheduler import ScheduledChunk
from swaserve.kvcache.storage import PagedKV
from swaserve.kvformat import AUTO_FORMAT, KVFormat
from swaserve.model.attention import KindMeta, SinkTokens, kind_meta
from swaserve.model.mimo_v2 import ForwardBatch, MiMoV2ForCausalLM

SINK_CAPACITY = 256  # distinct first-token sequences kept


class SinkTable:
    """The full layers' sink-token K/V by the tokens they cover.

    Args:
        model: the target; cfg: its config (``model.cfg``, no MTP or residual layers).
        formats: the engine's pool formats; ``formats[FULL].sinks`` is S.
        device: where the model runs; capacity: entries kept (LRU).
    """

    def __init__(
        self,
        model: MiMoV2ForCausalLM,
        cfg: ModelConfig,
        formats: Mapping[str, KVFormat],
        device: torch.device,
        capacity: int = SINK_CAPACITY,
    ) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        self.size = formats[FULL].sinks
        self.swa_format = formats[SWA]
        self.capacity = capacity
        self.dtype = model.embed_tokens.weight.dtype
        self.entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.computed = 0  # forwards run (stats, tests)

    def count(self, req: Request) -> int:
        """S' for ``req``: its first prompt tokens up to S, stopping at a media placeholder (an id
        past the vocabulary: its embedding comes from an encoder, not the tokens)."""
        n = 0
        for t in req.prompt_token_ids[: self.size]:
            if t >= self.cfg.vocab_size:
                break
            n += 1
        return n

    def entry(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """k [n_full, len(tokens), Hkv, Dk], v [..., Dv] for ``tokens`` (computed on a miss)."""
        key = tuple(tokens)
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            return hit
        kv = self.compute(key)
        self.entries[key] = kv
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return kv

    @torch.inference_mode()
    def compute(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The full layers' K/V of a forward over ``tokens`` alone, on one page per kind of a
        ``PagedKV`` of its own (full layers: the model dtype; SWA layers: the SWA pool's format)."""
        cfg, n, dev = self.cfg, len(tokens), self.device
        self.computed += 1
        formats = {FULL: AUTO_FORMAT, SWA: self.swa_format}
        store = PagedKV(cfg, n, self.dtype, dev, pages={FULL: 1, SWA: 1}, formats=formats)
        windows = {FULL: None, SWA: cfg.window}
        metas: dict[str, list[KindMeta]] = {
            kind: [
                kind_meta(
                    [("sinks", 0, n)],
                    lambda _rid, lo, end: torch.arange(lo, end, dtype=torch.int64),
                    windows[kind],
                    lambda slots: slots,
                    dev,
                    formats[kind],
                )
            ]
            for kind in store.kv
            if store.kv[kind][0]
        }
        batch = ForwardBatch(
            input_ids=torch.tensor(list(tokens), dtype=torch.int64, device=dev),
            positions=torch.arange(n, dtype=torch.int64, device=dev),
            meta=metas,
            kv={kind: store.kv[kind] for kind in metas},
            groups={kind: store.groups[kind] for kind in metas},
        )
        self.model.forward_hidden(batch)
        ks, vs = store.kv[FULL]
        return torch.stack([k[0] for k in ks]), torch.stack([v[0] for v in vs])

    def step(self, chunks: Sequence[ScheduledChunk]) -> SinkTokens | None:
        """The step's sink tokens, spans in ``chunks`` order; None when no chunk has any."""
        counts = [self.count(c.req) for c in chunks]
        if not any(counts):
            return None
        keys: dict[tuple[int, ...], int] = {}
        entry: list[int] = []
        for c, n in zip(chunks, counts, strict=True):
            key = tuple(c.req.prompt_token_ids[:n]) if n else ()
            entry.append(keys.setdefault(key, len(keys)))
        ks, vs = [], []
        for key in keys:
            k, v = self.entry(key) if key else self._empty()
            pad = self.size - k.shape[1]
            ks.append(torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)))
            vs.append(torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)))
        return SinkTokens(
            k=torch.stack(ks, dim=1),
            v=torch.stack(vs, dim=1),
            entry=torch.tensor(entry, dtype=torch.int64, device=self.device),
            count=torch.tensor(counts, dtype=torch.int64, device=self.device),
        )

    def _empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        f, nf = self.cfg.full, len(self.cfg.full_layers)
        z = torch.zeros(nf, 0, f.num_kv_heads, f.head_dim, dtype=self.dtype, device=self.device)
        return z, z.new_zeros(nf, 0, f.num_kv_heads, f.v_head_dim)

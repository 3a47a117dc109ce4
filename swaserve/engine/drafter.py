"""MTP drafting: runs the model's MTP layers over the new positions of every request each step and
proposes the next step's draft tokens (``engine.spec`` verifies them).

Indexing (chosen here; SGLang indexes a draft row by its hidden state's position, which RoPE and
the window make equivalent): MTP layer ``k``'s KV row at position ``j`` is computed from the token
at ``j`` and the target's pre-final-norm hidden state at ``j - 1 - k`` (zeros where that is before
``MTPState.base``: the sequence start, a prefix-cache hit or an imported prompt), with RoPE at
``j``. A row then depends only on tokens ``<= j``, so a page's MTP KV is a function of the tokens
up to its end, like the target's: MTP layers are extra SWA layers in the same pages
(``config.kv_config``), and prefix-cache hits, the host tier and PD transfer carry it unchanged.

Each step, after the target forward, for a request whose tokens ``< end`` are committed:
layer ``k`` computes rows ``fin .. end-1`` (final: committed tokens) and, when the request
drafts ``d`` tokens and ``k < d``, rows ``end .. end-1+k`` over the drafts of layers ``< k``
(provisional: rewritten next step). Row ``end-1+k`` of layer ``k`` gives draft ``k`` (greedy). Rows
below ``fin`` are never rewritten, so pages shared with the prefix cache stay immutable.
Design notes: docs/DESIGN.md#enginedrafterpy
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from swaserve.config import SWA, ModelConfig
from swaserve.engine.media_rows import MediaRows
from swaserve.engine.mtp_state import MTPState
from swaserve.engine.request import Request
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.storage import KVStorage
from swaserve.model.attention import kind_meta
from swaserve.model.mimo_v2 import MiMoV2ForCausalLM


@dataclass(frozen=True)
class DraftItem:
    """One request in a drafting pass: tokens ``< end`` committed; ``drafts``: how many to propose."""

    req: Request
    end: int
    drafts: int


class Drafter:
    """Runs MTP layers ``0 .. k-1`` (module docstring) over the SWA storage's extra layers.

    Args:
        model: the target with its MTP layers; cfg: its config (not ``kv_config``'s).
        k: draft tokens per step (MTP layers used), 1 <= k <= ``cfg.num_mtp_layers``.

    Raises:
        ValueError: ``k`` out of range.
    """

    def __init__(
        self,
        model: MiMoV2ForCausalLM,
        cfg: ModelConfig,
        kv: KVCacheManager,
        storage: KVStorage,
        device: torch.device,
        k: int,
    ) -> None:
        if not 1 <= k <= cfg.num_mtp_layers:
            raise ValueError(
                f"speculative_num_steps must be 0 .. {cfg.num_mtp_layers} (the checkpoint's MTP layers), got {k}"
            )
        self.model, self.cfg, self.kv, self.storage, self.device, self.k = model, cfg, kv, storage, device, k
        self.first_layer = len(cfg.swa_layers)  # MTP layer k's index within the SWA storage

    def start(self, req: Request, position: int) -> MTPState:
        """The state of a request whose target computes from ``position`` on (0, a cache hit)."""
        req.mtp = MTPState(fin=position, base=position, hidden_start=position)
        return req.mtp

    def start_imported(self, req: Request, hidden: torch.Tensor | None, drafts: list[int]) -> None:
        """A prefilled request (decode role): MTP rows from its prompt's end ``n`` on, reading the
        prefill worker's last hidden states (``hidden`` [m, H], positions ``[n - m, n)``; zeros
        before), and the prefill worker's drafts for the first step."""
        n = req.num_prompt
        m = 0 if hidden is None else min(hidden.shape[0], n)
        st = self.start(req, n - m)
        st.fin = n
        if hidden is not None and m:
            st.hidden = hidden[hidden.shape[0] - m :].to(self.device, like_dtype(self.model))
        req.spec_drafts = list(drafts[: self.k])

    def hidden_tail(self, req: Request) -> torch.Tensor | None:
        """The kept hidden states of the prompt's last positions, which a decode worker's first MTP
        rows read (``start_imported``), on the CPU; None without any."""
        st = req.mtp
        if st is None or st.hidden is None:
            return None
        n = req.num_prompt
        lo = max(st.hidden_start, st.base, n - self.k)
        return st.hidden[lo - st.hidden_start : n - st.hidden_start].cpu()

    def absorb(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """Keep the target's hidden states [n, H] of committed positions ``start .. start+n-1``.

        Raises:
            RuntimeError: they do not follow the kept ones (internal error)."""
        st = req.mtp or self.start(req, start)
        if st.hidden is None:
            st.hidden, st.hidden_start = hidden, start
        elif st.hidden_start + st.hidden.shape[0] == start:
            st.hidden = torch.cat((st.hidden, hidden))
        else:
            raise RuntimeError("MTP hidden states out of order (internal error)")

    @torch.inference_mode()
    def run(self, items: list[DraftItem]) -> None:
        """One drafting pass (module docstring): writes the rows' MTP KV, sets each request's
        ``spec_drafts`` (``item.drafts`` tokens) and advances ``fin`` to ``end``."""
        items = [it for it in items if it.req.mtp is not None and it.end > it.req.mtp.fin]
        if not items:
            return
        W = self.cfg.window
        H = self.cfg.hidden_size
        drafts: list[list[int]] = [[] for _ in items]
        like = next(iter(self.model.parameters()))
        for k in range(self.k):
            spans: list[tuple[str, int, int]] = []
            ids: list[int] = []
            pos: list[int] = []
            hid: list[torch.Tensor] = []
            last_rows: list[int] = []  # row giving draft k, per item that drafts at this layer
            row = 0
            media = MediaRows()
            for i, it in enumerate(items):
                st = it.req.mtp
                assert st is not None
                last = it.end - 1 + (k if k < it.drafts else 0)
                span = range(st.fin, last + 1)
                spans.append((it.req.request_id, st.fin, last + 1))
                media.add(it.req, st.fin, min(it.end, last + 1), row)  # row p: token p (media rows)
                ids.extend(it.req.token_slice(st.fin, min(it.end, last + 1)))
                ids.extend(drafts[i][: max(0, last + 1 - it.end)])
                pos.extend(span)
                hid.append(st.hidden_at(torch.arange(st.fin - 1 - k, last - k), H, like))
                row += len(span)
                if k < it.drafts:
                    last_rows.append(row - 1)
            layer = self.first_layer + k
            g = self.storage.groups[SWA][layer]
            meta = kind_meta(
                spans,
                self.kv.swa.slots,
                W,
                functools.partial(self.storage.locate, SWA, g),
                self.device,
                self.storage.formats[SWA],
            )
            ks, vs = self.storage.kv[SWA]
            out = self.model.mtp_forward(
                k,
                media.clear_pads(ids, self.device),
                torch.tensor(pos, dtype=torch.int64, device=self.device),
                torch.cat(hid).to(self.device),
                ks[layer],
                vs[layer],
                meta,
                media.build(self.device),
            )
            if last_rows:
                logits = self.model.logits(out[torch.tensor(last_rows, device=out.device)])
                toks = logits.argmax(dim=-1).tolist()
                it_rows = [i for i, it in enumerate(items) if k < it.drafts]
                for i, t in zip(it_rows, toks, strict=True):
                    drafts[i].append(t)
        for i, it in enumerate(items):
            st = it.req.mtp
            assert st is not None
            st.fin = it.end
            it.req.spec_drafts = drafts[i]
            keep_from = it.end - self.k - 1  # rows from ``end`` on read hidden states >= end - 1 - k
            if st.hidden is not None and keep_from > st.hidden_start:
                st.hidden = st.hidden[keep_from - st.hidden_start :]
                st.hidden_start = keep_from


def like_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's weights (and so of its hidden states)."""
    return next(iter(model.parameters())).dtype

"""Logits of our paged engine equal transformers' MiMoV2FlashForCausalLM on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import Harness, reference_logits

TOL = 1e-4


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=g).tolist()


@pytest.fixture(
    scope="module", params=[(4, False), (16, False), (4, True), (16, True)],
    ids=["page4<W", "page16>W", "page4<W-arena", "page16>W-arena"],
)  # fmt: skip
def harness(request, tiny_dir):  # type: ignore[no-untyped-def]
    page, shared = request.param
    return Harness(tiny_dir, page_size=page, shared=shared)


def test_tiny_checkpoint_exercises_sinks_and_biases(hf_tiny) -> None:  # type: ignore[no-untyped-def]
    sinks = [m.sinks for m in hf_tiny.modules() if getattr(m, "sinks", None) is not None]
    biases = [b for n, b in hf_tiny.named_buffers() if n.endswith("e_score_correction_bias")]
    assert sinks and all(s.abs().min() > 0 for s in sinks)
    assert biases and all(b.abs().max() > 0 for b in biases)
    assert hf_tiny.config.sliding_window == 9  # W = 8 previous tokens + the query


def test_one_shot_prefill(harness: Harness, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    toks = _tokens(45, 0)
    ours = harness.run_alone("a", toks, [45])
    assert (ours - reference_logits(hf_tiny, toks)).abs().max().item() <= TOL


@pytest.mark.parametrize("chunks", [[3] * 15, [5, 11, 13, 16], [20, 25]], ids=["3s", "mixed", "long"])
def test_chunked_prefill_shorter_and_longer_than_window(harness: Harness, hf_tiny, chunks) -> None:  # type: ignore[no-untyped-def]
    toks = _tokens(45, 1)
    ours = harness.run_alone("b", toks, chunks)
    assert (ours - reference_logits(hf_tiny, toks)).abs().max().item() <= TOL


def test_token_by_token_decode_crosses_window_many_times(harness: Harness, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    toks = _tokens(41, 2)  # W = 8: crosses the window boundary 4+ times, page boundaries many times
    ours = harness.run_alone("c", toks, [6] + [1] * 35)
    ref = reference_logits(hf_tiny, toks)
    assert (ours - ref).abs().max().item() <= TOL
    assert harness.kv.stats()["swa"].used_pages == 0
    # the window really binds: the same weights without a window give different logits, so an
    # engine that attended past the window would fail the comparison above
    from transformers import MiMoV2FlashForCausalLM

    no_window = MiMoV2FlashForCausalLM.from_pretrained(str(harness.model_dir), sliding_window=4096).eval()
    assert (reference_logits(no_window, toks) - ref)[20:].abs().max().item() > 1e-2


def test_mixed_batch_equals_each_request_alone(harness: Harness, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    seqs = {f"r{i}": _tokens(n, 10 + i) for i, n in enumerate([30, 7, 19, 26])}
    reqs = {rid: harness.new(rid, t) for rid, t in seqs.items()}
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    # step 1: two prefills of different lengths; then mixes of prefill chunks and decodes
    plans = [
        [("r0", 12), ("r1", 7)],
        [("r0", 10), ("r1", 0), ("r2", 9)],
    ]
    for plan in plans:
        step = [(reqs[r], n) for r, n in plan if n]
        for (req, _), lg in zip(step, harness.step(step), strict=True):
            got[req.request_id].append(lg)
    # now everyone advances one token per step (decode-like) while r3 prefills in chunks
    r3_chunks = [5, 9, 12]
    while any(r.num_computed < len(seqs[rid]) for rid, r in reqs.items()):
        step = []
        for rid, r in reqs.items():
            left = len(seqs[rid]) - r.num_computed
            if left <= 0:
                continue
            if rid == "r3":
                n = r3_chunks.pop(0) if r3_chunks else left
            elif r.num_computed == 0:
                n = left
            else:
                n = 1
            step.append((r, min(n, left)))
        for (req, _), lg in zip(step, harness.step(step), strict=True):
            got[req.request_id].append(lg)
    for rid, toks in seqs.items():
        harness.kv.free(rid)
        ours = torch.cat(got[rid])
        assert ours.shape[0] == len(toks)
        assert (ours - reference_logits(hf_tiny, toks)).abs().max().item() <= TOL, rid
    stats = harness.kv.stats()
    assert stats["full"].used_pages == 0 and stats["swa"].used_pages == 0


def test_full_layout_gives_same_logits(tiny_dir, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    h = Harness(tiny_dir, page_size=4, layout="full")
    toks = _tokens(33, 3)
    ours = h.run_alone("f", toks, [7, 1, 1, 24])
    assert (ours - reference_logits(hf_tiny, toks)).abs().max().item() <= TOL

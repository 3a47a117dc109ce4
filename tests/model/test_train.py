"""The default model's training (swaserve.model.train) and writing weights back (loader.save_weights):
weights round-trip exactly, the training's MTP rows are the engine's, pretraining lowers the loss,
and distillation raises the held-out accept length on a target whose greedy output is learnable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from swaserve.model.checkpoint import CORPUS_PATH, tiny_model_dir, write_mtp_layers
from swaserve.model.loader import iter_checkpoint, load_model, save_weights
from swaserve.model.train import (
    DistillConfig,
    PretrainConfig,
    _crops,
    corpus_prompts,
    distill,
    engine_walk,
    greedy_sequences,
    mtp_logits,
    pretrain,
    shift_hidden,
    target_states,
)
from tests.helpers.mtp import one_sequence_batch, reference_layer


@pytest.fixture()
def mtp_copy(tmp_path: Path) -> Path:
    d = shutil.copytree(tiny_model_dir(), tmp_path / "tiny-mtp")
    write_mtp_layers(d, "tiny", 2, 0)
    return d


def test_save_weights_round_trips_and_writes_what_the_model_holds(mtp_copy: Path) -> None:
    model = load_model(mtp_copy)
    before = dict(iter_checkpoint(mtp_copy))
    save_weights(model, mtp_copy)
    after = dict(iter_checkpoint(mtp_copy))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    save_weights(model, mtp_copy)
    again = load_model(mtp_copy)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_training_rows_are_the_engines_mtp_rows(mtp_copy: Path) -> None:
    """Teacher-forced MTP logits (training) equal the dense reference of the engine's convention:
    row j reads token j and the target's hidden state at j - 1 - k, zeros before 0."""
    model = load_model(mtp_copy)
    w = dict(iter_checkpoint(mtp_copy))
    tokens = torch.randint(3, 500, (2, 30), generator=torch.Generator().manual_seed(1))
    hidden, _ = target_states(model, tokens)
    for b in range(2):
        dense_h = model.forward_hidden(one_sequence_batch(model, tokens[b]))
        torch.testing.assert_close(hidden[b], dense_h, rtol=1e-4, atol=1e-5)
    for k in range(2):
        got = mtp_logits(model, k, tokens, shift_hidden(hidden, k))
        for b in range(2):
            shifted = torch.cat((torch.zeros(k + 1, hidden.shape[-1]), hidden[b, : 30 - k - 1]))
            want = model.logits(reference_layer(w, k, model.cfg, tokens[b], shifted))
            torch.testing.assert_close(got[b], want, rtol=1e-4, atol=1e-4)


def test_a_crop_with_a_window_of_context_gives_the_whole_sequences_mtp_logits(mtp_copy: Path) -> None:
    """Training crops (``_crops``): MTP layers are SWA layers, so a crop's loss rows, RoPE from 0 in
    the crop, read what they read in the whole sequence (RoPE is relative: float noise only)."""
    import random

    model = load_model(mtp_copy)
    t = 60
    tokens = torch.randint(3, 500, (3, t), generator=torch.Generator().manual_seed(4))
    hidden, _ = target_states(model, tokens)
    cfg = DistillConfig(crop_tokens=20, start_share=0.5)
    window = model.cfg.window  # a row at q reads keys from q - window on
    seen_start = seen_inner = False
    rng = random.Random(0)
    for _ in range(8):
        idx, pos, keep = _crops(rng, 3, t, cfg, window, 2)
        assert pos.shape == keep.shape == (2, 20 + window) and idx.shape == (2, 1)
        for r in range(2):
            start = int(pos[r, 0])
            seen_start |= start == 0
            seen_inner |= start > 0
            assert bool(keep[r].all()) == (start == 0) and bool(keep[r, window:].all())
        for k in range(2):
            shifted = shift_hidden(hidden, k)
            with torch.no_grad():
                full = mtp_logits(model, k, tokens, shifted)
                got = mtp_logits(model, k, tokens[idx, pos], shifted[idx, pos], keep)
            torch.testing.assert_close(got, full[idx, pos][keep], rtol=1e-4, atol=1e-4)
    assert seen_start and seen_inner


def test_the_engine_walk_moves_one_plus_accepted_tokens_per_step() -> None:
    K = 3
    right = [[[True] * K for _ in range(20)]]
    assert engine_walk(right, 4) == (K + 1, [1.0] * K)  # every draft right: K + 1 per step
    assert engine_walk([[[False] * K for _ in range(20)]], 4) == (1.0, [0.0] * K)
    # draft 0 right everywhere, draft 1 right only at the step whose newest token is at 4: steps
    # at 4 (accepts 2: drafts at rows 4 and 5), 7, 9, 11, 13, 15, 17 (accept 1 each); 18 > 20 - K
    ok = [[[True, s == 5, False] for s in range(20)]]
    accept, per_pos = engine_walk(ok, 4)
    assert per_pos == [1.0, 1 / 7, 0.0] and accept == 1 + 8 / 7
    with pytest.raises(ValueError, match="no step"):
        engine_walk([[[True] * K for _ in range(5)]], 4)


def test_greedy_sequences_are_the_targets_argmax_continuation(mtp_copy: Path) -> None:
    model = load_model(mtp_copy)
    prompts = torch.randint(3, 500, (3, 7), generator=torch.Generator().manual_seed(2))
    seqs = greedy_sequences(model, prompts, 12)
    _, labels = target_states(model, seqs)
    assert torch.equal(seqs[:, :7], prompts)
    assert torch.equal(seqs[:, 7:], labels[:, 6:-1])  # each new token is the argmax before it


@pytest.mark.slow
def test_pretraining_lowers_the_loss_and_distillation_raises_the_accept_length(mtp_copy: Path) -> None:
    from tokenizers import Tokenizer

    model = load_model(mtp_copy)
    tok = Tokenizer.from_file(str(mtp_copy / "tokenizer.json"))
    windows = corpus_prompts(tok, CORPUS_PATH, 64, 33, 0)
    losses = pretrain(model, windows, PretrainConfig(steps=60, batch=8, tokens=32, windows=64, lr=1e-2))
    assert losses[-1] < 0.6 * losses[0]
    prompts = corpus_prompts(tok, CORPUS_PATH, 24, 16, 1)
    log = distill(model, prompts, DistillConfig(sequences=24, heldout=4, prompt_tokens=16, new_tokens=48,
                                                steps=150, batch=8, lr=1e-2))  # fmt: skip
    assert log.loss[-1] < log.loss[0]
    assert log.accept_length > log.accept_length_before + 0.1  # measured: 1.0 -> 1.18 (engine_walk)
    assert all(p.requires_grad is False for p in model.parameters())

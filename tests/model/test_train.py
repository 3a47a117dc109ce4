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
    corpus_prompts,
    distill,
    greedy_sequences,
    mtp_logits,
    pretrain,
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
        got = mtp_logits(model, k, tokens, hidden)
        for b in range(2):
            shifted = torch.cat((torch.zeros(k + 1, hidden.shape[-1]), hidden[b, : 30 - k - 1]))
            want = model.logits(reference_layer(w, k, model.cfg, tokens[b], shifted))
            torch.testing.assert_close(got[b], want, rtol=1e-4, atol=1e-4)


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
    assert log.accept_length > log.accept_length_before + 0.1  # measured: 1.0 -> 1.23
    assert all(p.requires_grad is False for p in model.parameters())

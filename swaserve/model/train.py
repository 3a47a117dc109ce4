"""Short CPU training of the bundled default model, so that it behaves like a (very small) language
model and its MTP layers are worth using.

1. **Target pretraining** (``pretrain``): next-token cross-entropy on windows of the bundled corpus.
   A few hundred steps take a random MiMo-V2 to repetitive, text-like greedy output, as small
   trained models write. The corpus has no EOS, so the model does not learn to stop (trace
   replays keep their output lengths).
2. **MTP self-distillation** (``distill``). The target is frozen. Data: corpus prompts continued
   greedily by the target, and the label of every position is the target's argmax there (its own
   next-token choice). Each MTP layer k is trained with teacher forcing exactly as the engine runs
   it (``engine.drafter``): row j reads token j and the target's pre-final-norm hidden state at
   j - 1 - k (zeros before 0), RoPE at j, the SWA window, and predicts the label at j. Loss:
   cross-entropy through the shared ``lm_head``, summed over layers (DeepSeek-V3 §2.2 trains its
   MTP modules the same way on data; MiMo-V2 drafts with its MTP layers).

Evaluation on held-out sequences gives the greedy accept length the engine would see. At a step
whose newest token is at L - 1, draft k is layer k's row L - 1 + k, with its earlier drafts right.
A draft is accepted while it equals the label there; accept length = 1 + leading accepted drafts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from swaserve.config import FULL, SWA
from swaserve.model.attention import KindMeta, kind_meta
from swaserve.model.mimo_v2 import ForwardBatch, MiMoV2ForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainConfig:
    """LM pretraining of the target: ``steps`` of ``batch`` corpus windows of ``tokens`` tokens."""

    steps: int = 100
    batch: int = 8
    tokens: int = 128
    windows: int = 1024
    lr: float = 2e-3
    seed: int = 0


@dataclass(frozen=True)
class DistillConfig:
    """Data and optimizer settings (sequences: ``prompt_tokens`` + ``new_tokens`` tokens each)."""

    sequences: int = 56
    heldout: int = 8
    prompt_tokens: int = 512
    new_tokens: int = 256
    crop_tokens: int = 256
    start_share: float = 0.25
    steps: int = 300
    batch: int = 8
    lr: float = 3e-3
    seed: int = 0


@dataclass
class DistillLog:
    """What a run did: the loss every ``every`` steps, per-layer held-out top-1 accuracy and the
    held-out greedy accept length (mean, and the fraction of steps accepting each draft)."""

    config: dict[str, object]
    loss: list[float] = field(default_factory=list)
    every: int = 25
    accuracy: list[float] = field(default_factory=list)
    accept_length: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    accept_length_before: float = 0.0


def _dense_meta(
    n_seq: int, length: int, start: int, end: int, window: int | None, dev: torch.device | None = None
) -> KindMeta:
    """``kind_meta`` for rows ``start .. end-1`` of ``n_seq`` equal-length sequences over a dense
    cache (slot = sequence * length + position; one row per page)."""

    def slots(rid: str, lo: int, e: int) -> torch.Tensor:
        return int(rid) * length + torch.arange(lo, e)

    return kind_meta(
        [(str(b), start, end) for b in range(n_seq)], slots, window, lambda s: s, torch.device("cpu")
    )


class DenseRunner:
    """The target over ``n_seq`` equal-length sequences with dense per-sequence caches (no pages):
    a prefill, then one token per sequence per step."""

    def __init__(self, model: MiMoV2ForCausalLM, n_seq: int, length: int) -> None:
        self.model, self.n, self.length = model, n_seq, length
        cfg = model.cfg
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for kind, shape in ((FULL, cfg.full), (SWA, cfg.swa)):
            n = cfg.layer_types.count(kind)
            rows = n_seq * length
            self.kv[kind] = (
                [
                    torch.zeros(rows, 1, shape.num_kv_heads, shape.head_dim, device=dev, dtype=dtype)
                    for _ in range(n)
                ],
                [
                    torch.zeros(rows, 1, shape.num_kv_heads, shape.v_head_dim, device=dev, dtype=dtype)
                    for _ in range(n)
                ],
            )
        self.groups = {kind: [0] * len(self.kv[kind][0]) for kind in self.kv}

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [n_seq, m]: tokens at positions ``start .. start+m-1`` -> pre-norm hidden [n_seq, m, H]."""
        cfg = self.model.cfg
        m = ids.shape[1]
        meta = {
            FULL: [_dense_meta(self.n, self.length, start, start + m, None, ids.device)],
            SWA: [_dense_meta(self.n, self.length, start, start + m, cfg.window, ids.device)],
        }
        pos = torch.arange(start, start + m).repeat(self.n)
        batch = ForwardBatch(ids.reshape(-1), pos.to(ids.device), meta, self.kv, self.groups)
        return self.model.forward_hidden(batch).view(self.n, m, -1)


def lm_logits(model: MiMoV2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target over ``ids`` [B, T] (positions 0..T-1) with autograd: fp32 logits [B, T, vocab]."""
    b, t = ids.shape
    runner = DenseRunner(model, b, t)
    cfg = model.cfg
    meta = {
        FULL: [_dense_meta(b, t, 0, t, None, ids.device)],
        SWA: [_dense_meta(b, t, 0, t, cfg.window, ids.device)],
    }
    pos = torch.arange(t, device=ids.device).repeat(b)
    batch = ForwardBatch(ids.reshape(-1), pos, meta, runner.kv, runner.groups)
    return model.lm_head(model.norm(model.hidden_states(batch))).float().view(b, t, -1)


def pretrain(model: MiMoV2ForCausalLM, windows: torch.Tensor, cfg: PretrainConfig) -> list[float]:
    """Train the target (not its MTP layers) in place on corpus ``windows`` [N, tokens + 1] by
    next-token cross-entropy; returns the mean loss of every 10 steps."""
    params = [p for n, p in model.named_parameters() if not n.startswith("mtp.")]
    rng = random.Random(cfg.seed)
    losses: list[float] = []
    with _training(model, params):
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        sched = _cosine(opt, cfg.steps)
        running = 0.0
        bar = _bar(cfg.steps, "target pretraining")
        for step in bar:
            x = windows[torch.tensor(rng.sample(range(windows.shape[0]), min(cfg.batch, windows.shape[0])))]
            loss = F.cross_entropy(lm_logits(model, x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            running += float(loss.detach())
            if (step + 1) % 10 == 0:
                losses.append(round(running / 10, 4))
                log.info("target pretraining step %d/%d: loss %.4f", step + 1, cfg.steps, running / 10)
                bar.set_postfix(loss=f"{running / 10:.3f}", refresh=False)
                running = 0.0
    return losses


def _bar(steps: int, what: str) -> tqdm[int]:
    """A progress bar on stderr for a training loop (a checkpoint is built on first use, for
    minutes on a CPU: a user sees it move); at most one refresh per 10 s off a terminal."""
    return tqdm(range(steps), desc=what, unit="step", mininterval=0.5 if sys.stderr.isatty() else 10.0)


@contextlib.contextmanager
def _training(model: MiMoV2ForCausalLM, params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Gradients for ``params`` only, for the duration; everything frozen again after."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(False)


def _cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """20 warm-up steps, then a cosine decay to 0 at ``steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )


def greedy_sequences(model: MiMoV2ForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens]: each continued greedily by the target."""
    b, p = prompts.shape
    runner = DenseRunner(model, b, p + new_tokens)
    seqs = [prompts]
    h = runner.forward(prompts, 0)[:, -1]
    for t in range(new_tokens):
        nxt = model.logits(model.norm(h)).argmax(-1)[:, None]
        seqs.append(nxt)
        if t + 1 < new_tokens:
            h = runner.forward(nxt, p + t)[:, -1]
    return torch.cat(seqs, dim=1)


@torch.inference_mode()
def target_states(model: MiMoV2ForCausalLM, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs [B, T] -> (pre-norm hidden [B, T, H], the target's argmax at every position [B, T])."""
    b, t = seqs.shape
    h = DenseRunner(model, b, t).forward(seqs, 0)
    return h, model.logits(model.norm(h)).argmax(-1)


def shift_hidden(hidden: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, H] target hidden states -> [B, T, H] what MTP layer ``k``'s rows read: row j holds
    row j - 1 - k (zeros before 0; module docstring)."""
    shifted = torch.zeros_like(hidden)
    t = hidden.shape[1]
    if t > k + 1:
        shifted[:, k + 1 :] = hidden[:, : t - k - 1]
    return shifted


def mtp_logits(
    model: MiMoV2ForCausalLM,
    k: int,
    seqs: torch.Tensor,
    shifted: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """MTP layer ``k`` with teacher forcing over ``seqs`` [B, T] (RoPE positions 0..T-1), reading
    ``shifted`` [B, T, H] (``shift_hidden``): logits [B, T, vocab], or [R, vocab] for the R rows
    where ``keep`` [B, T] (bool) is set; differentiable in the MTP layer's weights."""
    from typing import cast

    from swaserve.model.layers import PartialRope
    from swaserve.model.mtp import MTPLayer

    b, t = seqs.shape
    cfg = model.cfg
    shape = cfg.swa
    dev, dtype = shifted.device, shifted.dtype
    kc = torch.zeros(b * t, 1, shape.num_kv_heads, shape.head_dim, device=dev, dtype=dtype)
    vc = torch.zeros(b * t, 1, shape.num_kv_heads, shape.v_head_dim, device=dev, dtype=dtype)
    meta = _dense_meta(b, t, 0, t, cfg.window, dev)
    pos = torch.arange(t, device=dev).repeat(b)
    cos_sin = cast(PartialRope, model.rope[SWA]).cos_sin(pos, dtype)
    layer = cast(MTPLayer, model.mtp[k])
    with torch.no_grad():
        emb = model.embed_tokens(seqs.reshape(-1))
    out = layer(emb, shifted.reshape(b * t, -1), cos_sin, kc, vc, meta, model.backend)
    if keep is not None:
        return model.lm_head(out[keep.reshape(-1)]).float()
    return model.lm_head(out).float().view(b, t, -1)


def evaluate(
    model: MiMoV2ForCausalLM, seqs: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, first: int
) -> tuple[list[float], float, list[float]]:
    """(per-layer top-1 accuracy over rows ``first..``, mean greedy accept length, fraction of
    steps accepting each draft) of ``seqs`` [B, T] decoded as the engine decodes them: the first
    step's newest token at ``first``, each step then ``1 + accepted`` tokens on (module
    docstring), until fewer than K drafts would fit. Steps land more often where drafts fail, so
    this is below the mean over every position."""
    K = len(model.mtp)
    with torch.no_grad():
        right = [mtp_logits(model, k, seqs, shift_hidden(hidden, k)).argmax(-1) == labels for k in range(K)]
    acc = [float(r[:, first:].float().mean()) for r in right]
    return acc, *engine_walk(torch.stack(right, dim=-1).tolist(), first)


def engine_walk(ok: list[list[list[bool]]], first: int) -> tuple[float, list[float]]:
    """(mean accept length, fraction of steps accepting each draft) of the engine's greedy steps
    over ``ok`` [B][T][K]: ``ok[b][s + k][k]`` says whether draft k of the step whose newest token
    is at s is right (earlier drafts right). Each sequence's first step is at ``first``; a step
    accepts the leading right drafts and moves ``1 + accepted`` tokens on, while K drafts fit.

    Raises:
        ValueError: no step fits."""
    steps = 0
    per_pos = [0] * (len(ok[0][0]) if ok and ok[0] else 0)
    K = len(per_pos)
    for row in ok:
        s = first
        while s <= len(row) - K:
            a = 0
            while a < K and row[s + a][a]:
                a += 1
            steps += 1
            for k in range(a):
                per_pos[k] += 1
            s += a + 1
    if steps == 0:
        raise ValueError(f"no step with {K} drafts fits from token {first} on")
    return 1 + sum(per_pos) / steps, [n / steps for n in per_pos]


def _crops(
    rng: random.Random, n_seq: int, t: int, cfg: DistillConfig, window: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training batch: ``batch`` crops of ``cfg.crop_tokens`` rows plus ``window`` rows of
    attention context before them (a row at q reads keys from q - ``window`` on) (the whole sequence when shorter), cut from sequences of ``t``
    tokens. Returns (sequence index [batch, 1], positions [batch, L], loss rows [batch, L] bool):
    the crop's rows, and its context rows too for a crop at the sequence start (a share
    ``cfg.start_share``), whose context is the sequence start itself. MTP layers are SWA layers, so
    a crop's rows see what they see in the whole sequence."""
    length = min(t, cfg.crop_tokens + window)
    idx = torch.tensor(rng.sample(range(n_seq), min(batch, n_seq)))
    starts = [
        0 if length == t or rng.random() < cfg.start_share else rng.randint(1, t - length)
        for _ in range(len(idx))
    ]
    pos = torch.stack([torch.arange(s, s + length) for s in starts])
    loss = torch.zeros(len(idx), length, dtype=torch.bool)
    loss[:, min(window, length) :] = True
    loss[torch.tensor(starts) == 0] = True
    return idx[:, None], pos, loss


def distill(model: MiMoV2ForCausalLM, prompts: torch.Tensor, cfg: DistillConfig) -> DistillLog:
    """Train ``model.mtp`` in place (the target frozen) on ``prompts`` [N, P] continued greedily;
    the last ``cfg.heldout`` are held out for evaluation. Each step trains on crops (``_crops``).

    Raises:
        ValueError: no MTP layers, or too few prompts."""
    K = len(model.mtp)
    if K == 0:
        raise ValueError("the model has no MTP layers to train")
    if prompts.shape[0] <= cfg.heldout:
        raise ValueError(f"{prompts.shape[0]} prompts, {cfg.heldout} of them held out: none to train on")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    seqs = torch.cat([greedy_sequences(model, chunk, cfg.new_tokens) for chunk in prompts.split(16)])
    parts = [target_states(model, chunk) for chunk in seqs.split(16)]
    hidden = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    n_train = seqs.shape[0] - cfg.heldout
    p_len = prompts.shape[1]
    out = DistillLog(config=asdict(cfg))
    held = (seqs[n_train:], hidden[n_train:], labels[n_train:])
    out.accept_length_before = evaluate(model, *held, first=p_len)[1]
    shifted = [shift_hidden(hidden[:n_train], k) for k in range(K)]
    params = list(model.mtp.parameters())
    with _training(model, params):
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        sched = _cosine(opt, cfg.steps)
        running = 0.0
        bar = _bar(cfg.steps, "MTP self-distillation")
        for step in bar:
            idx, pos, keep = _crops(rng, n_train, seqs.shape[1], cfg, model.cfg.window, cfg.batch)
            loss = torch.stack([
                F.cross_entropy(mtp_logits(model, k, seqs[idx, pos], shifted[k][idx, pos], keep), labels[idx, pos][keep])
                for k in range(K)
            ]).sum()  # fmt: skip
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            running += float(loss.detach()) / K
            if (step + 1) % out.every == 0:
                out.loss.append(round(running / out.every, 4))
                log.info("MTP distillation step %d/%d: loss %.4f", step + 1, cfg.steps, running / out.every)
                bar.set_postfix(loss=f"{running / out.every:.3f}", refresh=False)
                running = 0.0
    out.accuracy, out.accept_length, out.accepted_per_pos = evaluate(model, *held, first=p_len)
    log.info(
        "MTP distillation: held-out accept length %.2f (before %.2f), accuracy per layer %s",
        out.accept_length,
        out.accept_length_before,
        [round(a, 3) for a in out.accuracy],
    )
    return out


def corpus_prompts(tokenizer: object, corpus: Path, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] token windows cut at random from the corpus's messages (JSON lines, "content")."""
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["content"] for line in f]
    rng = random.Random(seed)
    out: list[list[int]] = []
    encode = tokenizer.encode  # type: ignore[attr-defined]
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:
            raise ValueError(f"corpus {corpus} has too few messages of {length} tokens")
        ids = encode(rng.choice(texts))
        ids = ids.ids if hasattr(ids, "ids") else ids
        if len(ids) < length:
            continue
        s = rng.randrange(len(ids) - length + 1)
        out.append(list(ids[s : s + length]))
    return torch.tensor(out, dtype=torch.int64)

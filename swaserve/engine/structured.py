"""Structured output: a request's ``StructuredOutput`` enforced token by token with llguidance.

``engine.grammar`` compiles and checks a constraint (``grammar_of``, ``validate``: the front's 400,
torch-free). In the core, ``StructuredDecoder`` builds the ``LLTokenizer`` once, lazily on
the first constrained request, from the model directory's Hugging Face tokenizer; each request gets
its own ``Grammar`` (one ``LLMatcher``). Each step ``StructuredDecoder.mask`` fills one token
bitmask for every constrained row (in the calling thread, or with ``num_threads`` > 1 in one
parallel ``LLExecutor`` call), applies it in one batched op and returns a copy of the logits with the disallowed tokens at -inf (None when no row is constrained: unconstrained batches
do nothing new); after the sampler picks, ``Grammar.accept`` feeds the token to the matcher, which
says when the constraint is complete (``done``) or broken (``error``: the request fails, the engine
goes on). EOS is allowed only where the grammar accepts.

Source: llguidance (https://github.com/guidance-ai/llguidance), ``LLMatcher`` API; vLLM's
llguidance backend (vllm/v1/structured_output/backend_guidance.py). Design notes:
docs/DESIGN.md#enginestructuredpy
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import llguidance
import torch

from swaserve.engine.grammar import Grammar, grammar_of
from swaserve.engine.types import StructuredOutput

_BITS = torch.arange(32, dtype=torch.int32)


class StructuredDecoder:
    """The core's structured-output backend: one ``LLTokenizer``, one ``Grammar`` per request.

    Args:
        tokenizer_dir: directory of the model's Hugging Face tokenizer (a fast one), loaded on the
            first constrained request.
        vocab_size: logits width V (the model's vocabulary; may exceed the tokenizer's).
        eos_token_ids: the ids that end a request; the grammar allows them where it accepts.
        num_threads: > 1: fill the rows' masks in parallel on that many threads (``LLExecutor``);
            None or 1: one after the other in the calling thread, which on a few busy cores is
            much faster than handing small masks to a pool (16 JSON rows on 2 loaded cores:
            2-3 ms serially, 45-90 ms through the pool).
    """

    def __init__(
        self,
        tokenizer_dir: str | Path,
        vocab_size: int,
        eos_token_ids: Collection[int],
        num_threads: int | None = None,
    ) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.num_threads = num_threads
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (built on first use, ~10-100 ms). Raises ValueError if the
        model's tokenizer is not a fast (Rust ``tokenizers``) one."""
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            from swaserve.hf_tokenizer import load_tokenizer

            hf = load_tokenizer(self.tokenizer_dir)
            try:
                self._tokenizer = from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)  # type: ignore[arg-type]
            except ValueError as e:
                raise ValueError(f"structured output needs a fast tokenizer: {e}") from e
            if self.num_threads is not None and self.num_threads > 1:
                self._executor = llguidance.LLExecutor(self.num_threads)
        return self._tokenizer

    def new(self, so: StructuredOutput, consumed: Sequence[int] = ()) -> Grammar:
        """A request's grammar, having consumed ``consumed`` (a prefilled request's first token).

        Raises:
            ValueError: the constraint does not compile, or ``consumed`` breaks it.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(so), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {matcher.get_error()}")
        grammar = Grammar(matcher)
        for t in consumed:
            grammar.accept(t)
        if grammar.error:
            raise ValueError(grammar.error)
        return grammar

    def mask(self, logits: torch.Tensor, grammars: Sequence[Grammar | None]) -> torch.Tensor | None:
        """Logits with every token a row's grammar does not allow next at -inf.

        Args:
            logits: [B, V] last-position logits (not modified), one row per entry of ``grammars``.
            grammars: each row's grammar, None for an unconstrained row.

        Returns:
            A [B, V] masked copy (unconstrained rows and rows whose matcher failed keep their
            logits), or None when no row is constrained.
        """
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.error]
        if not rows:
            return None
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        matchers = [(grammars[i].matcher, j) for j, i in enumerate(rows)]  # type: ignore[union-attr]
        if self._executor is not None:
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        else:
            for m, j in matchers:
                m.unsafe_compute_mask_ptr(bitmask.data_ptr() + j * words * 4, words * 4)
        ok = [j for j, i in enumerate(rows) if grammars[i].healthy()]  # type: ignore[union-attr]
        if not ok:
            return None
        if len(ok) < len(rows):
            rows, bitmask = [rows[j] for j in ok], bitmask[ok]
        vocab = logits.shape[1]
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).reshape(len(rows), -1).bool()
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
        idx = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        out = logits.clone()
        out[idx] = logits.index_select(0, idx).masked_fill(~allowed, -torch.inf)
        return out

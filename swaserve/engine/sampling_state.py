"""Per-request sampling state that persists across engine steps: the prompt and output ids the
penalties read, and a seeded request's own generator (``engine.sampler`` draws from it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from swaserve.engine.types import SamplingParams


def generator_seed(seed: int) -> int:
    """The seed a request's generator gets for its ``seed`` (in [-2^63, 2^64)): ``seed`` itself in
    [0, 2^32), else a 32-bit hash of it. torch's CPU generator (mt19937) keeps only the low 32 bits
    of its seed, so 5 and 5 + 2^32 would draw the same stream; hashed, they do not (seeds still
    share 2^32 streams)."""
    if 0 <= seed < 1 << 32:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass
class SamplingState:
    """Per-request sampling inputs that persist across engine steps.

    The engine appends each accepted token to ``output_token_ids`` after :meth:`Sampler.sample`
    returns; the list must only grow by appending (a shorter list is detected and re-read, but an
    in-place edit of an existing element is not).

    Attributes:
        params: The request's sampling settings.
        prompt_token_ids: Prompt tokens (used by the repetition penalty).
        output_token_ids: Tokens generated so far.
        generator: Per-request RNG on the logits' device when ``params.seed`` is set, else None
            (the global RNG is used).
        prior_output_ids: Output of this request from before a resume (the prompt's last
            ``params.prior_output_tokens``): presence and frequency penalties count it as output.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    prior_output_ids: list[int] = field(default_factory=list)
    _prior_t: torch.Tensor | None = field(default=None, init=False, repr=False)
    _prompt_t: torch.Tensor | None = field(default=None, init=False, repr=False)
    _prompt_max: int | None = field(default=None, init=False, repr=False)
    _out_buf: torch.Tensor | None = field(default=None, init=False, repr=False)
    _out_len: int = field(default=0, init=False, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        device: torch.device | str,
        skip_prior_draws: bool = True,
    ) -> SamplingState:
        """Build the state of a new request.

        Args:
            params: Sampling settings (already validated).
            prompt_token_ids: The prompt; kept by reference. Its last ``params.prior_output_tokens``
                are the request's output before a resume (``prior_output_ids``).
            device: Device the logits will live on; a seeded generator is created there.
            skip_prior_draws: Move a seeded sampled request's generator on by one draw per prior
                output token (``_draw`` takes one per token sampled); False when its state is set
                from elsewhere (a prefill worker's).
        """
        prior = params.prior_output_tokens
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(generator_seed(params.seed))
            if skip_prior_draws and prior and not params.greedy:  # greedy rows never draw
                skip_draws(generator, prior)
        return cls(
            params, prompt_token_ids, [], generator, list(prompt_token_ids[len(prompt_token_ids) - prior :])
        )

    @property
    def needs_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        """Prompt ids as an int64 tensor on ``device`` (built once, then cached)."""
        if self._prompt_t is None or self._prompt_t.device != device:
            self._prompt_t = torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)
        return self._prompt_t

    def max_prompt_id(self) -> int:
        """Largest prompt token id (-1 for an empty prompt); computed once."""
        if self._prompt_max is None:
            self._prompt_max = max(self.prompt_token_ids, default=-1)
        return self._prompt_max

    def penalized_output(self, device: torch.device) -> torch.Tensor:
        """What presence and frequency penalties count: prior output + output, int64 on ``device``."""
        out = self.output_tensor(device)
        if not self.prior_output_ids:
            return out
        if self._prior_t is None or self._prior_t.device != device:
            self._prior_t = torch.tensor(self.prior_output_ids, dtype=torch.long, device=device)
        return torch.cat([self._prior_t, out])

    def output_tensor(self, device: torch.device) -> torch.Tensor:
        """Output ids as an int64 tensor on ``device``; only newly appended ids are copied."""
        n = len(self.output_token_ids)
        buf = self._out_buf
        if buf is None or buf.device != device or n < self._out_len:
            buf, self._out_len = None, 0
        if buf is None or n > buf.numel():
            new_buf = torch.empty(max(16, 2 * n), dtype=torch.long, device=device)
            if buf is not None:
                new_buf[: self._out_len] = buf[: self._out_len]
            buf = new_buf
        if n > self._out_len:
            new = self.output_token_ids[self._out_len : n]
            buf[self._out_len : n] = torch.tensor(new, dtype=torch.long).to(device, non_blocking=True)
            self._out_len = n
        self._out_buf = buf
        return buf[:n]


def skip_draws(generator: torch.Generator, n: int) -> None:
    """Move ``generator`` on by ``n`` one-number draws (what ``n`` tokens sampled consume). On the
    CPU one ``uniform_`` over ``n`` numbers does it (mt19937, one number after another); elsewhere
    (CUDA's Philox offset advances per call) one call per draw."""
    device = generator.device
    if device.type == "cpu":
        torch.empty(n, dtype=torch.float32).uniform_(generator=generator)
        return
    u = torch.empty(1, dtype=torch.float32, device=device)
    for _ in range(n):
        u.uniform_(generator=generator)

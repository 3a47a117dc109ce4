"""The plan of a trace replay (``swaserve.replay``): its options (``ReplayOptions``), the token
space of a checkpoint, and the timed token-id requests (``PlannedRequest``) a trace turns into;
``RequestResult`` is what one request's replay records. Times in seconds.

Design notes: docs/DESIGN.md#replaypy"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swaserve.traces import MooncakeRequest, TokenBlocks

DEFAULT_VOCAB_SIZE = 4096
"""Vocabulary size assumed without ``--model-dir`` (the default checkpoint's)."""

DEFAULT_RESERVED_IDS = (0, 1, 2)
"""Special token ids assumed without a model dir: the bundled checkpoints' tokenizers put
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` first (``swaserve.model.checkpoint``)."""


class ReplayError(RuntimeError):
    """The replay could not start (server unreachable, model unknown)."""


@dataclass(frozen=True)
class ReplayOptions:
    """How to turn trace requests into HTTP requests.

    Attributes:
        url: Server base URL, e.g. ``http://127.0.0.1:8000``.
        model: ``model`` field of each request (None = the first id of ``GET /v1/models``).
        time_scale: Arrival times are divided by this (2.0 = twice as fast as the trace).
        block_tokens: Tokens per trace block after scaling (the trace's blocks are 512 tokens).
        max_output_tokens: Cap on ``max_tokens`` (None = the trace's output length).
        vocab_size: Prompt ids are drawn from ``[0, vocab_size)``.
        reserved_ids: Ids never put in a prompt (special tokens).
        seed: Seed of the token blocks.
        request_timeout_s: Limit for one request, send to last byte, seconds.
        max_model_len: Longest prompt + output the server accepts (None = read it from
            ``GET /v1/models`` when present there, else no limit). Longer requests get their prompt
            cut (prefix kept), then their output, and are counted as ``clipped``.
        progress: Show a tqdm progress bar on stderr.
    """

    url: str
    model: str | None = None
    time_scale: float = 1.0
    block_tokens: int = 16
    max_output_tokens: int | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    reserved_ids: tuple[int, ...] = DEFAULT_RESERVED_IDS
    seed: int = 0
    request_timeout_s: float = 600.0
    max_model_len: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {self.block_tokens}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")


@dataclass(frozen=True)
class PlannedRequest:
    """One HTTP request to send: when (seconds after the replay start) and what."""

    index: int
    send_at_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    clipped: bool = False


@dataclass
class RequestResult:
    """What happened to one request. Times in seconds."""

    index: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    expected_output_tokens: int = 0
    cached_tokens: int = 0
    end_s: float = 0.0  # seconds after the replay start


def parse_id_ranges(spec: str) -> tuple[int, ...]:
    """Parse ``"0,5-7,100"`` into ``(0, 5, 6, 7, 100)`` (inclusive ranges; empty string -> ())."""
    ids: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if b < a:
                    raise ValueError
                ids.extend(range(a, b + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise ValueError(f"bad token id range {part!r} (expected N or A-B with A <= B)") from None
    return tuple(ids)


def token_space_from_model_dir(model_dir: str | Path) -> tuple[int, tuple[int, ...]]:
    """Vocabulary size and special token ids of a checkpoint directory.

    The size is the smaller of ``config.json``'s ``vocab_size`` and the tokenizer's size (so every
    prompt id decodes); reserved ids are the tokenizer's special added tokens plus BOS/EOS ids.

    Raises:
        swaserve.config.ConfigError: ``config.json`` is missing or unusable.
    """
    from swaserve.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    vocab = cfg.vocab_size
    reserved: set[int] = set(cfg.eos_token_ids)
    if cfg.bos_token_id is not None:
        reserved.add(int(cfg.bos_token_id))
    tok_path = Path(model_dir) / "tokenizer.json"
    if tok_path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        vocab = min(vocab, tok.get_vocab_size(with_added_tokens=True))
        reserved.update(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return vocab, tuple(sorted(i for i in reserved if i < vocab))


def plan_requests(trace: Sequence[MooncakeRequest], opts: ReplayOptions) -> list[PlannedRequest]:
    """Turn trace requests into timed token-id requests (deterministic)."""
    blocks = TokenBlocks(opts.block_tokens, opts.vocab_size, opts.reserved_ids, opts.seed)
    t_first = trace[0].timestamp_ms if trace else 0
    planned = []
    for i, req in enumerate(trace):
        prompt = blocks.prompt(req)
        max_tokens = req.output_length
        if opts.max_output_tokens is not None:
            max_tokens = min(max_tokens, opts.max_output_tokens)
        clipped = False
        limit = opts.max_model_len
        if limit is not None and len(prompt) + max_tokens > limit:
            clipped = True
            prompt = prompt[: max(1, limit - max_tokens)]
            max_tokens = max(1, min(max_tokens, limit - len(prompt)))
        send_at = (req.timestamp_ms - t_first) / 1000.0 / opts.time_scale
        planned.append(PlannedRequest(i, send_at, prompt, max_tokens, clipped))
    return planned

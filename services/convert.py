"""Conversions between the engine's value types and the swaserve.v1 worker messages: sampling
parameters, output chunks, media spans, and the status texts workers and routers share. Torch-free,
so the router imports no torch; the KV transfer messages are in ``services.kv_convert``."""

from __future__ import annotations

from collections.abc import Iterable

from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams, StructuredOutput, TokenLogprob
from swaserve.media.placeholders import KEY_BYTES, MODALITIES, MediaInputs, MediaSpan
from swaserve.v1 import worker_pb2 as pb

ENGINE_NOT_RUNNING = "engine not running"  # how a worker's GetLoad UNAVAILABLE details begin
# how a draining worker's UNAVAILABLE refusal of Generate or KVTransfer.Push begins (the router keeps
# its requests in flight there and sends it nothing new)
WORKER_DRAINING = "worker is draining"
# a worker's Load.features entry: it honors SamplingParams.prior_output_tokens (a resume's count)
PRIOR_OUTPUT_FEATURE = "prior_output_tokens"
WORKER_FEATURES = (PRIOR_OUTPUT_FEATURE,)  # what this release's workers list
MEDIA_FETCH_FAILED = "media fetch"  # a prefill worker's error: its encoder failed (retry, items resubmitted)


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k or 0,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        logit_bias=dict(p.logit_bias),
        prior_output_tokens=p.prior_output_tokens,
    )
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.seed is not None:
        m.seed = str(p.seed)
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.structured is not None:
        m.structured.kind, m.structured.spec = p.structured.kind, p.structured.spec
    return m


def params_from_proto(m: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (via ``SamplingParams.validate``) on out-of-range values."""
    p = SamplingParams(
        max_tokens=m.max_tokens,
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k or None,
        min_p=m.min_p,
        seed=_seed(m),
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        skip_special_tokens=m.skip_special_tokens,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        structured=(
            StructuredOutput(m.structured.kind, m.structured.spec)  # type: ignore[arg-type]  # validate() checks
            if m.HasField("structured")
            else None
        ),
        prior_output_tokens=m.prior_output_tokens,
    )
    p.validate()
    return p


def _seed(m: pb.SamplingParams) -> int | None:
    if not m.HasField("seed"):
        return None
    try:
        return int(m.seed)
    except ValueError as e:
        raise ValueError(f"seed must be an integer, got {m.seed!r}") from e


def usage(o: RequestOutput) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens, cached_tokens=o.cached_tokens,
        cached_host_tokens=o.cached_host_tokens, cached_l3_tokens=o.cached_l3_tokens,
    )  # fmt: skip


def _logprobs_to_proto(lps: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            rank=lp.rank,
        )
        for lp in lps
    ]


def _logprobs_from_proto(lps: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top), lp.rank)
        for lp in lps
    ]


def chunk_message(o: RequestOutput) -> pb.GenerateResponse:
    chunk = pb.Chunk(
        token_ids=o.new_token_ids,
        text=o.new_text,
        logprobs=_logprobs_to_proto(o.new_logprobs),
        token_text_starts=o.token_text_starts,
    )
    if o.prompt_logprobs is not None:
        chunk.prompt_logprobs.extend(_logprobs_to_proto(o.prompt_logprobs))
        chunk.has_prompt_logprobs = True
    return pb.GenerateResponse(chunk=chunk, usage=usage(o))


def output_from_chunk(request_id: str, m: pb.GenerateResponse) -> RequestOutput:
    """A streamed delta (not finished) from a ``chunk`` message."""
    c = m.chunk
    return RequestOutput(
        request_id=request_id,
        new_token_ids=list(c.token_ids),
        new_text=c.text,
        new_logprobs=_logprobs_from_proto(c.logprobs),
        token_text_starts=list(c.token_text_starts),
        prompt_logprobs=_logprobs_from_proto(c.prompt_logprobs) if c.has_prompt_logprobs else None,
        prompt_tokens=m.usage.prompt_tokens,
        completion_tokens=m.usage.completion_tokens,
        cached_tokens=m.usage.cached_tokens,
        cached_host_tokens=m.usage.cached_host_tokens,
        cached_l3_tokens=m.usage.cached_l3_tokens,
    )


def finish_reason(name: str) -> FinishReason:
    try:
        return FinishReason(name)
    except ValueError:
        return FinishReason.ABORT


def media_to_proto(media: MediaInputs | None) -> list[pb.MediaSpan]:
    """A prompt's media spans with the encoder each is fetched from."""
    if media is None:
        return []
    return [
        pb.MediaSpan(
            start=s.start,
            length=s.length,
            key=s.key,
            modality=s.modality,
            offset=s.offset,
            encoder=media.sources.get(i, ""),
        )
        for i, s in enumerate(media.spans)
    ]


def media_from_proto(spans: Iterable[pb.MediaSpan]) -> MediaInputs | None:
    """``MediaInputs`` without embeddings (a worker fetches what its prefix hit does not cover);
    None for a text prompt. Raises ValueError on a malformed span (the engine checks the rest)."""
    out: list[MediaSpan] = []
    sources: dict[int, str] = {}
    for i, m in enumerate(spans):
        if len(m.key) != KEY_BYTES or m.modality not in MODALITIES or m.length == 0:
            raise ValueError(f"media span {i} is malformed (a {KEY_BYTES}-byte key, a modality, rows > 0)")
        out.append(MediaSpan(m.start, m.length, bytes(m.key), m.modality, m.offset))
        if m.encoder:
            sources[i] = m.encoder
    return MediaInputs(tuple(out), {}, sources) if out else None


def needs_prior_output(p: SamplingParams) -> bool:
    """A resumed request whose tokens depend on its workers honoring ``prior_output_tokens``: a
    seeded sampled one (the generator's skip-ahead) or one with presence/frequency penalties."""
    seeded = p.seed is not None and not p.greedy
    return p.prior_output_tokens > 0 and (seeded or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)

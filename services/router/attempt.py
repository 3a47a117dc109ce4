"""One attempt of a request: ``Generate`` on a prefill worker with ``kv_target`` = the decode worker,
then ``Generate`` on the decode worker with ``first_token``, relayed as ``RequestOutput`` deltas.
Failures become ``DispatchError`` (worker to avoid, gRPC code, retry reason) or ValueError.
``Progress``: what a request sent its client across attempts, and its resume after output started
(original prompt + generated tokens, router-side text and stop strings).

Design notes: docs/DESIGN.md#servicesrouterattemptpy"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from services.convert import (
    MEDIA_FETCH_FAILED,
    WORKER_DRAINING,
    finish_reason,
    media_to_proto,
    output_from_chunk,
    params_to_proto,
)
from services.router.worker_handle import Attempt, WorkerHandle
from services.router.workers import WorkerPool
from swaserve.engine.client import Unavailable
from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams
from swaserve.media.placeholders import MediaInputs
from swaserve.routing.load import Lease
from swaserve.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Overloaded(Unavailable):
    """No decode worker had room for the request's KV (staging full) in any attempt."""

    code = "overloaded"


class NoWorkerAvailable(Unavailable):
    """No worker of a role could be reached for the request."""

    code = "no_worker_available"


class Interrupted(Unavailable):
    """A request whose output had started failed and could not be resumed (resumes used up, or
    the resumed request refused); what the client got so far is all there is."""

    code = "interrupted"


class DispatchError(RuntimeError):
    """A worker failed a request; ``worker`` is the one to avoid on a retry; ``code`` the gRPC
    status of the failure (RESOURCE_EXHAUSTED: no room; UNAVAILABLE: not reachable);
    ``why`` overrides the retry reason the code implies."""

    def __init__(
        self,
        message: str,
        worker: WorkerHandle | None,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        why: str | None = None,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.code = code
        self.why = why

    @property
    def reason(self) -> str:
        """The retry reason it counts under (``swaserve.metrics_router.RETRY_REASONS``)."""
        if self.why is not None:
            return self.why
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "overloaded"
        return "unavailable" if self.code == grpc.StatusCode.UNAVAILABLE else "error"

    def final(self) -> Exception:
        """What ``generate`` raises when this was the last attempt's failure (OUT_OF_RANGE: the
        request's KV is larger than a decode worker's whole staging: a 400, no retry helps)."""
        if self.code == grpc.StatusCode.OUT_OF_RANGE:
            return ValueError(f"the prompt is too long for this deployment's decode workers ({self})")
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Overloaded(f"no decode worker has room for the request's KV now, retry later ({self})")
        if self.code == grpc.StatusCode.UNAVAILABLE:
            role = f"{self.worker.role} " if self.worker is not None else ""
            return NoWorkerAvailable(f"no {role}worker available, retry later ({self})")
        return RuntimeError(f"request failed: {self}")

    def no_other_worker(self, role: str) -> DispatchError:
        """This failure when no worker of ``role`` is left for a retry of the request (it never
        goes back to one that failed it): a 503 class whatever the failure, ``Overloaded`` when
        it was no room, else ``NoWorkerAvailable`` (through ``final``/``interrupted``); a KV larger
        than a decode worker's staging stays a 400 (``final``)."""
        kept = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE)
        code = self.code if self.code in kept else grpc.StatusCode.UNAVAILABLE
        return DispatchError(f"{self}; no other {role} worker to retry it on", self.worker, code, self.why)

    def interrupted(self, generated: int) -> Unavailable:
        """What ``generate`` raises when this failure hit a request whose output had started and
        no resume is left: a 503-class error (``Overloaded``/``NoWorkerAvailable`` by its code,
        else ``Interrupted``) saying how far it got."""
        msg = f"request interrupted after {generated} generated tokens and not resumed, retry later ({self})"
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Overloaded(msg)
        if self.code == grpc.StatusCode.UNAVAILABLE:
            return NoWorkerAvailable(msg)
        return Interrupted(msg)


def _lost(att: Attempt) -> DispatchError:
    w = att.lost
    assert w is not None
    return DispatchError(
        f"{w.role} worker {w.address} was marked down ({w.down_reason or 'unreachable'})",
        w,
        grpc.StatusCode.UNAVAILABLE,
        why="worker_down",
    )


class AttemptRunner:
    """Runs attempts. Args: pool: the router's workers (attempt registration);
    release: gives leases back (non-blocking); timeout_s: deadline of each worker call (s)."""

    def __init__(self, pool: WorkerPool, release: Callable[..., None], timeout_s: float) -> None:
        self.pool, self.release, self.timeout_s = pool, release, timeout_s

    async def run(
        self,
        p: WorkerHandle,
        d: WorkerHandle,
        wire_id: str,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        first_sent: int | None,
        started: list[bool],
        leases: list[Lease],
        media: MediaInputs | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One attempt on ``p`` then ``d`` under ``wire_id``, yielding deltas of request ``rid``.
        ``first_sent``: the first token a previous attempt already sent (this one must sample
        the same); ``started[0]`` is set once decode output was yielded; ``leases`` (prefill,
        decode) are released as each worker's part ends.

        Raises:
            DispatchError: a worker failed or went down (retryable while ``started[0]`` is False).
            ValueError: a worker refused the request as invalid.
            RuntimeError: a retried prefill sampled another first token.
        """
        sampling = params_to_proto(params)
        spans = media_to_proto(media)
        n = len(prompt)
        p.outstanding += n
        d.outstanding += params.max_tokens
        att = self.pool.begin(wire_id, p, d)
        done = False
        try:
            if att.lost is not None:
                raise _lost(att)
            att.call = p.stub.Generate(
                pb.GenerateRequest(
                    request_id=wire_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    kv_target=d.address,
                    media=spans,
                ),
                timeout=self.timeout_s,
            )
            first, reason, usage = None, "", pb.Usage()
            async for m in self._messages(att, p, d):
                kind = m.WhichOneof("kind")
                if kind == "chunk":
                    out = _output(rid, m)
                    first = out.new_token_ids[0] if out.new_token_ids else first
                    if first_sent is not None and first != first_sent:
                        raise RuntimeError("a retried prefill sampled another first token")
                    done = out.finished  # ended at its first token: the last chunk
                    if first_sent is None:
                        yield out
                    elif done:  # its tokens were sent already
                        yield dataclasses.replace(
                            out, new_token_ids=[], new_text="", new_logprobs=[], prompt_logprobs=None
                        )
                    if done:
                        return
                elif kind == "complete":
                    reason, usage = m.complete.finish_reason, m.usage
            p.outstanding -= n
            n = 0
            self.pool.leave(att, p)  # the prefill's part is done: a decode-side request now
            self.release(leases.pop(0))
            if reason != FinishReason.HANDOFF.value:
                done = True
                yield RequestOutput(
                    rid, finished=True, finish_reason=finish_reason(reason), prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                    cached_host_tokens=usage.cached_host_tokens, cached_l3_tokens=usage.cached_l3_tokens,
                )  # fmt: skip
                return
            if first is None:
                raise DispatchError(f"prefill worker {p.address} handed off without a first token", p)
            cached = usage.cached_tokens
            tiers = {
                "cached_host_tokens": usage.cached_host_tokens,
                "cached_l3_tokens": usage.cached_l3_tokens,
            }
            if att.lost is not None:
                raise _lost(att)
            att.call = d.stub.Generate(
                pb.GenerateRequest(
                    request_id=wire_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    first_token=first,
                    media=spans,
                ),
                timeout=self.timeout_s,
            )
            async for m in self._messages(att, d, d):
                kind = m.WhichOneof("kind")
                if kind == "chunk":
                    out = _output(rid, m)
                    out.cached_tokens = cached
                    out.cached_host_tokens = tiers["cached_host_tokens"]
                    out.cached_l3_tokens = tiers["cached_l3_tokens"]
                    started[0] = True
                    done = out.finished
                    yield out
                    if done:
                        return
                elif kind == "complete":
                    done = True
                    yield RequestOutput(
                        rid, finished=True, finish_reason=finish_reason(m.complete.finish_reason),
                        prompt_tokens=m.usage.prompt_tokens, completion_tokens=m.usage.completion_tokens,
                        cached_tokens=cached,
                    )  # fmt: skip
                    return
            raise DispatchError(f"decode worker {d.address} ended the stream without completing", d)
        finally:
            p.outstanding -= n
            d.outstanding -= params.max_tokens
            self.release(*leases)
            call = att.call
            self.pool.end(att)
            if call is not None:  # not done: the worker's stream ends and its engine aborts the
                call.cancel()  # request; done: only the `complete` after the last chunk is left

    async def _messages(
        self, att: Attempt, worker: WorkerHandle, decode: WorkerHandle
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The stream of ``att``'s current call on ``worker``; gRPC failures, error envelopes and
        a cancellation because a worker went down become DispatchError (ValueError for a request
        the worker refused as invalid)."""
        call = att.call
        assert call is not None
        try:
            async for m in call:
                if m.WhichOneof("kind") == "error":
                    msg = m.error.message
                    if not m.error.retryable:
                        raise ValueError(msg)  # the worker refused the request itself
                    code = _CODES.get(m.error.code, grpc.StatusCode.UNKNOWN)
                    if msg.startswith(MEDIA_FETCH_FAILED):  # the encoder's fault, not the worker's
                        raise DispatchError(
                            f"{worker.role} worker {worker.address}: {msg}", None, code, "encoder"
                        )
                    if msg.startswith("KV transfer"):
                        if WORKER_DRAINING in msg:  # it refused the KV: no new requests there
                            self.pool.shutdown_seen(decode, True)
                        elif code == grpc.StatusCode.UNAVAILABLE:
                            decode.healthy = False
                        raise DispatchError(msg, decode, code)
                    raise DispatchError(f"{worker.role} worker {worker.address}: {msg}", worker, code)
                yield m
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if att.lost is None or (task is not None and task.cancelling()):
                raise  # the client went away (or the router stops)
            raise _lost(att) from None  # the call was cancelled because a worker went down
        except grpc.aio.AioRpcError as e:
            if att.lost is not None:
                raise _lost(att) from e
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                if (e.details() or "").startswith(WORKER_DRAINING):  # up, but takes nothing new
                    self.pool.shutdown_seen(worker, True)
                else:
                    worker.healthy = False
            raise DispatchError(
                f"{worker.role} worker {worker.address}: {e.code().name} {e.details()}", worker, e.code()
            ) from e


def _output(rid: str, m: pb.GenerateResponse) -> RequestOutput:
    """A chunk as a delta; the chunk a worker marked as the last one is the final output."""
    out = output_from_chunk(rid, m)
    if m.chunk.finish_reason:
        out.finished, out.finish_reason = True, finish_reason(m.chunk.finish_reason)
    return out


class Progress:
    """What one request sent its client so far, across attempts, and its resume after a failure
    once output started (the request's own state lives on the workers and dies with them).

    Resume = recompute, as vLLM does for a preempted request: the next attempt's prompt is the
    original prompt + every token already sent, its ``max_tokens`` what is left, so the new
    prefill worker rebuilds the KV (a prefix-cache hit for the original prompt where it has it)
    and the new decode worker goes on. The client sees one stream: ``relay`` turns every output
    of a resumed attempt into the delta the uninterrupted request would have produced:

    - text: the workers' text of a resumed attempt is dropped (their detokenizer starts at the
      boundary, where held-back bytes of a split UTF-8 character or a possible stop-string start
      would be lost); the router detokenizes the whole output itself (``IncrementalDetokenizer``
      over the original prompt, the sent tokens replayed one at a time as the worker added them)
      and emits only the characters beyond those already sent;
    - stop strings are matched there, on the whole output (one spanning the boundary too), and
      left out of the resumed request (the router ends it on a hit: ``cut``); stop tokens (EOS,
      ``stop_token_ids``) and ``max_tokens`` stay with the workers, against the remaining budget;
    - usage: ``prompt_tokens`` is the original prompt's, ``completion_tokens`` every token sent,
      ``cached_tokens`` what the first attempt's prefill found cached of the original prompt;
      logprobs are the resumed workers' (computed over the same context).

    Exactness: greedy output is token-for-token that of an uninterrupted run (up to float
    rounding of recomputed KV against incrementally built KV: argmax near-ties). The resumed
    request says how many of its prompt's tokens are output already (``prior_output_tokens``):
    ``presence_penalty``/``frequency_penalty`` count them as output, and a seeded generator starts
    that many draws in (the engine draws once per token sampled, with MTP too), so a seeded
    sampled request goes on with the tokens an uninterrupted run would give (same float caveat);
    ``repetition_penalty`` covers prompt + output anyway; an unseeded sampled request goes on
    with the same distribution. There is no ``min_tokens`` and ``n`` is 1 (the API refuses
    others). Structured output is not resumed (``resume`` raises ``Interrupted``: a clean error,
    never other tokens; its grammar's state over the tokens sent died with the worker), though
    retried like any other request before decode output.

    Args:
        tokenizer: the model's tokenizer (the workers', from the same checkpoint).
        prompt: the request's prompt token ids. params: its sampling settings.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt: list[int], params: SamplingParams) -> None:
        self.prompt, self.params = prompt, params
        self.tokens: list[int] = []  # output tokens sent to the client
        self.text_len = 0  # characters of text sent to the client
        self.cached = 0  # cached prompt tokens the first prefill reported
        self.resumes = 0
        self.cut = False  # the router ended the request on a stop string before the worker did
        self._tokenizer = tokenizer
        self._detok: IncrementalDetokenizer | None = None  # the router's, from the first resume
        self._produced = 0  # characters the router's detokenizer produced
        self._pending = ""  # produced by the replay but not sent yet (normally empty)

    @property
    def resumed(self) -> bool:
        """Some attempt was a resume: later outputs go through the router's detokenizer."""
        return self._detok is not None

    def resume(self) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling settings of the next attempt (class docstring); counts it.

        Raises:
            Interrupted: nothing is left to generate (the last token was sent without its finish
                reason: a worker that broke the protocol), or the request's continuation on new
                workers would differ from an uninterrupted run's (structured output: class
                docstring).
        """
        why = self._not_resumable()
        if why:
            raise Interrupted(
                f"request interrupted after {len(self.tokens)} generated tokens: {why} is not resumed "
                "on another worker"
            )
        left = self.params.max_tokens - len(self.tokens)
        if left < 1:
            raise Interrupted(
                f"request interrupted after all {len(self.tokens)} tokens without a finish reason"
            )
        if self._detok is None:
            p = self.params
            self._detok = IncrementalDetokenizer(self._tokenizer, self.prompt, p.skip_special_tokens, p.stop)
            replay = "".join(self._detok.add([t]) for t in self.tokens)
            self._produced = len(replay)
            self._pending = replay[self.text_len :]
        self.resumes += 1
        # prompt logprobs went out with the first token: the longer prompt must not send them again
        params = dataclasses.replace(
            self.params, max_tokens=left, stop=(), prompt_logprobs=None, prior_output_tokens=len(self.tokens)
        )
        return self.prompt + self.tokens, params

    def should_resume(self, decode_started: bool) -> bool:
        """Whether a failed attempt goes on as a resume (``resume``) rather than a retry of the
        original request: once decode output reached the client, after an earlier resume, or
        when only the prefill's first token was sent and a retried prefill would not sample it
        again (an unseeded sampled request; greedy and seeded requests sample the same first token,
        and structured output is not resumed)."""
        if decode_started or self.resumed:
            return True
        p = self.params
        return bool(self.tokens) and not p.greedy and p.seed is None and p.structured is None

    def _not_resumable(self) -> str:
        """What keeps the request from resuming exactly ("" when nothing does)."""
        p = self.params
        if p.structured is not None:
            return "structured output"
        return ""

    def relay(self, out: RequestOutput) -> RequestOutput:
        """Record an attempt's output and return it as the client's delta (rewritten after a
        resume: text, stop strings, usage; class docstring)."""
        if not self.tokens and out.new_token_ids:
            self.cached = out.cached_tokens
        if self._detok is None:
            self.tokens += out.new_token_ids
            self.text_len += len(out.new_text)
            return out
        ids, lps = list(out.new_token_ids), list(out.new_logprobs)
        reason = out.finish_reason if out.finished else None
        # the resumed request has no stop strings: STOP is a stop token, which is not text
        skip_last = reason == FinishReason.STOP
        text = ""
        starts: list[int] = []  # per token, where its text starts in the delta's text
        for i, t in enumerate(ids):
            if skip_last and i == len(ids) - 1:
                break
            starts.append(len(text))
            text += self._emit(self._detok.add([t]))
            if self._detok.stopped:  # a stop string over the whole output: cut after this token
                ids, lps = ids[: i + 1], lps[: i + 1]
                self.cut, reason = not out.finished, FinishReason.STOP
                break
        starts += [len(text)] * (len(ids) - len(starts))
        if reason is not None and not self._detok.stopped:
            text += self._emit(self._detok.flush())
        self.tokens += ids
        return dataclasses.replace(
            out, new_token_ids=ids, new_text=text, new_logprobs=lps, token_text_starts=starts[: len(ids)],
            finished=reason is not None,
            finish_reason=reason, prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens),
            cached_tokens=self.cached,
        )  # fmt: skip

    def _emit(self, piece: str) -> str:
        """The part of the router's detokenizer output ``piece`` the client has not got yet."""
        start = self._produced
        self._produced += len(piece)
        new = self._pending + piece[max(0, self.text_len - start) :]
        self._pending = ""
        self.text_len += len(new)
        return new

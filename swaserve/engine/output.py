"""The front's half of the engine: core outputs (token ids) -> ``RequestOutput`` deltas with text.

Per request it keeps an ``IncrementalDetokenizer``; a stop string ends the request here (finish
reason ``stop``, text cut before the match) and its id is returned so the caller aborts it in the
core. The core may have computed a few tokens past that point; they are dropped, so the client
sees exactly what an engine that checked stop strings inside its step would have produced.
Prompt / generation token counters for ``/metrics`` are counted here too (delivered tokens).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from swaserve.engine.core_output import CoreOutput
from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams
from swaserve.media.placeholders import text_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    """Args: tokenizer: the model's tokenizer (detokenization only).

    Attributes:
        prompt_tokens_total, generation_tokens_total: tokens of the requests added (not
            counting prefilled prompts) and tokens delivered, since start.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, IncrementalDetokenizer] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token: int | None = None,
    ) -> None:
        """Track a new request. ``first_token``: a prefilled request's token sampled elsewhere
        (its text already went out there; it is decoding context here).

        Raises:
            ValueError: the id is already tracked.
        """
        if request_id in self._states:
            raise ValueError(f"duplicate request id {request_id!r}")
        detok = IncrementalDetokenizer(  # media pad ids are no text
            self.tokenizer, text_ids(prompt_token_ids[-64:]), params.skip_special_tokens, params.stop
        )
        if first_token is None:
            self.prompt_tokens_total += len(prompt_token_ids)
        else:
            detok.add([first_token])
        self._states[request_id] = detok

    def remove(self, request_id: str) -> None:
        """Forget a request (it ended in the front, e.g. its client went away)."""
        self._states.pop(request_id, None)

    def with_counters(self, stats: EngineStats) -> EngineStats:
        """The core's ``stats`` with this front's token counters."""
        return replace(
            stats,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Turn one step's core outputs into deltas.

        Returns:
            The deltas of the tracked requests, in order, and the ids of requests that a stop
            string ended while the core still runs them (abort them there).
        """
        deltas: list[RequestOutput] = []
        aborts: list[str] = []
        for o in outputs:
            detok = self._states.get(o.request_id)
            if detok is None:  # ended here already (stop string, abort): the core's extra tokens
                continue
            delta = self._delta(detok, o)
            if delta.finished:
                del self._states[o.request_id]
                if not o.finished:
                    aborts.append(o.request_id)
            deltas.append(delta)
        return deltas, aborts

    def _delta(self, detok: IncrementalDetokenizer, o: CoreOutput) -> RequestOutput:
        reason = o.finish_reason
        text = ""
        ids, lps = list(o.new_token_ids), list(o.new_logprobs)
        starts: list[int] = []  # per token, where its text starts in this delta's text
        completion = o.completion_tokens
        if ids:
            # a stop token (EOS...) has no text; several tokens (a speculative step): token by
            # token, so a stop string drops the ones after the token that completed it
            stop_token = reason == FinishReason.STOP and not o.structured_end
            texted = ids[:-1] if stop_token else ids
            for i in range(len(texted)):
                starts.append(len(text))
                text += detok.add(texted[i : i + 1] if len(texted) > 1 else texted)
                if detok.stopped:
                    reason = FinishReason.STOP
                    completion -= len(ids) - (i + 1)
                    ids, lps = ids[: i + 1], lps[: i + 1]
                    break
            starts += [len(text)] * (len(ids) - len(starts))  # the stop token: no text of its own
            self.generation_tokens_total += len(ids)
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and not detok.stopped:
            text += detok.flush()  # HANDOFF: text held back stays with the decoder
        finished = reason is not None
        return RequestOutput(
            request_id=o.request_id,
            new_token_ids=ids,
            new_text=text,
            new_logprobs=lps,
            token_text_starts=starts,
            prompt_logprobs=o.prompt_logprobs,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=o.prompt_tokens,
            completion_tokens=completion,
            cached_tokens=o.cached_tokens,
            cached_host_tokens=o.cached_host_tokens,
            cached_l3_tokens=o.cached_l3_tokens,
            arrival_time=o.arrival_time,
            first_scheduled_time=o.first_scheduled_time,
            first_token_time=o.first_token_time,
            kv_payload=o.kv_payload if finished else None,
            error=o.error,
            media_wanted=o.media_wanted,
        )

"""The router's encoder workers: where each media item of a request is encoded.

An item goes to the encoder rendezvous hashing ranks first for its content key
(``swaserve.encoder.placement.choose``: the same image lands on the same encoder, whose embedding
cache then has it; an encoder over the load bound is passed over), submitted at once; if that
encoder refuses or is down, the next candidate takes it. Loads come from polling ``GetLoad``
(queued + running items); an encoder that does not answer is left out until it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.encoder.client import EncoderClients
from services.tls import Dialer
from swaserve.encoder.items import EncodeItem
from swaserve.encoder.placement import choose
from swaserve.engine.client import Unavailable
from swaserve.media.placeholders import MediaInputs, MediaSpan
from swaserve.metrics_router import EncoderStats

log = logging.getLogger("swaserve.router.encoders")


class NoEncoder(Unavailable):
    """No encoder could take a media item (all down, refusing or full): a 503."""

    code = "no_encoder_available"


@dataclass
class EncoderState:
    address: str
    up: bool = True
    load: float = 0.0
    submitted: int = 0  # items sent here by this router
    failures: int = 0


class EncoderPool:
    """Args: addresses: the encoders (``host:port``). fingerprint: the router's model (an encoder
    of another model refuses). dialer: plaintext or TLS. poll_s: ``GetLoad`` period."""

    def __init__(
        self, addresses: Sequence[str], fingerprint: str, dialer: Dialer | None = None, poll_s: float = 1.0
    ) -> None:
        self.fingerprint, self.dialer, self.poll_s = fingerprint, dialer or Dialer(), poll_s
        self.states = {a: EncoderState(a) for a in dict.fromkeys(addresses)}
        self.clients = EncoderClients(self.dialer)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.poll()
        self._task = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.clients.close()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.poll()

    async def poll(self) -> None:
        """One ``GetLoad`` round: loads and liveness."""

        async def one(st: EncoderState) -> None:
            try:
                m = await asyncio.wait_for(self.clients.get(st.address).load(), timeout=max(1.0, self.poll_s))
            except (grpc.aio.AioRpcError, TimeoutError, OSError) as e:
                if st.up:
                    why = f"{e.code().name} {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                    log.warning("encoder %s is down: %s", st.address, why)
                st.up, st.load = False, 0.0
                return
            if m.model_fingerprint and m.model_fingerprint != self.fingerprint:
                if st.up:
                    log.error(
                        "encoder %s serves another model (%s): left out", st.address, m.model_fingerprint
                    )
                st.up = False
                return
            st.up = not m.draining
            st.load = float(m.queued_items + m.running_items)

        await asyncio.gather(*(one(s) for s in self.states.values()))

    def stats(self) -> tuple[EncoderStats, ...]:
        return tuple(EncoderStats(s.address, s.up, s.load, s.submitted) for s in self.states.values())

    def describe(self) -> list[dict[str, object]]:
        """The encoders for ``GET /workers``."""
        return [
            {"url": s.address, "role": "encoder", "state": "up" if s.up else "down", "load": s.load,
             "submitted": s.submitted, "failures": s.failures}
            for s in self.states.values()
        ]  # fmt: skip

    def live(self) -> list[str]:
        return [a for a, s in self.states.items() if s.up]

    async def media_inputs(
        self, spans: Sequence[MediaSpan], items: Sequence[EncodeItem], item_spans: Sequence[Sequence[int]]
    ) -> MediaInputs:
        """Submit every item to its encoder; the spans with the encoder each is fetched from.

        Raises:
            NoEncoder: an item no live encoder took.
        """
        if not self.states:
            raise ValueError("this router has no encoders for images, audio or video (--encoder)")
        sources: dict[int, str] = {}
        placed = await asyncio.gather(*(self._place(it) for it in items))
        for idx, address in zip(item_spans, placed, strict=True):
            for j in idx:
                sources[j] = address
        return MediaInputs(tuple(spans), {}, sources, tuple(items), tuple(tuple(i) for i in item_spans))

    async def resubmit(self, media: MediaInputs) -> MediaInputs:
        """``media`` with its items submitted again (a retry: their encoder may have died)."""
        await self.poll()
        return await self.media_inputs(media.spans, media.items, media.item_spans)

    async def _place(self, item: EncodeItem) -> str:
        live = self.live() or list(self.states)  # all marked down: try them anyway
        load = {a: self.states[a].load for a in live}
        last = ""
        for address in choose(item.key, live, load):
            st = self.states[address]
            try:
                ok = (await self.clients.get(address).submit([item], self.fingerprint))[0]
            except grpc.aio.AioRpcError as e:
                st.failures += 1
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT,):
                    raise ValueError(f"{item.modality}: {e.details()}") from e
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    st.up = False
                last = f"{address}: {e.code().name} {e.details()}"
                continue
            if ok:
                st.submitted += 1
                st.load += 1
                return address
            last = f"{address}: refused"
        log.warning("no encoder took a %s item: %s", item.modality, last or "none live")
        raise NoEncoder(
            "no media encoder is available now; retry later (text-only requests are still served)"
        )

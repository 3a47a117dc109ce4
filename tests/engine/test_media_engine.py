"""Prompts with media: encoder outputs replace placeholder rows; greedy output equals transformers
``inputs_embeds``, through chunked prefill across a span, MTP, a prefix hit on the same media, a miss
on other media, and a prefill that waits for embeddings that come later."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.media.placeholders import MediaInputs, MediaSpan, item_key, pad_ids
from swaserve.model.checkpoint import make_checkpoint
from tests.helpers.media import reference_greedy

NEW = 12


def _item(tag: bytes, n: int, hidden: int, seed: int) -> tuple[MediaSpan, torch.Tensor, list[int]]:
    key = item_key("test-encoder", "image", {}, tag)
    g = torch.Generator().manual_seed(seed)
    return MediaSpan(0, n, key, "image"), torch.randn(n, hidden, generator=g), pad_ids(key, n)


def _prompt(
    hidden: int, items: list[tuple[bytes, int, int]], text: list[list[int]]
) -> tuple[list[int], MediaInputs]:
    """text[0] item0 text[1] item1 ... text[-1]; items (tag, length, seed)."""
    ids: list[int] = list(text[0])
    spans, embeds = [], {}
    for i, (tag, n, seed) in enumerate(items):
        span, e, pads = _item(tag, n, hidden, seed)
        spans.append(MediaSpan(len(ids), n, span.key, "image"))
        embeds[i] = e
        ids += pads + list(text[i + 1])
    return ids, MediaInputs(tuple(spans), embeds)


def _reference(hf, ids: list[int], media: MediaInputs, new: int) -> list[int]:  # type: ignore[no-untyped-def]
    return reference_greedy(hf, ids, media.spans, media.embeds, new)


@pytest.fixture(scope="module")
def case(tiny_dir: Path, hf_tiny):  # type: ignore[no-untyped-def]
    hidden = hf_tiny.config.hidden_size
    ids, media = _prompt(hidden, [(b"cat", 9, 1), (b"dog", 14, 2)], [[1, 5, 6, 7], [40, 41], [42, 2, 1, 9]])
    return ids, media, _reference(hf_tiny, ids, media, NEW)


def _copy(m: MediaInputs, drop: tuple[int, ...] = ()) -> MediaInputs:
    return MediaInputs(m.spans, {i: e for i, e in m.embeds.items() if i not in drop})


def _run(eng: LLMEngine, rid: str, ids: list[int], media: MediaInputs) -> list[int]:
    eng.add_request(rid, ids, SamplingParams(max_tokens=NEW, temperature=0.0), media=media)
    out: list[int] = []
    while eng.has_unfinished():
        for d in eng.step():
            if d.request_id == rid:
                out.extend(d.new_token_ids)
    return out


@pytest.mark.parametrize(
    "ecfg",
    [
        EngineConfig(page_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20),
        EngineConfig(page_size=4, max_num_batched_tokens=5, kv_cache_memory=4 << 20),  # chunks cross spans
        EngineConfig(page_size=4, max_num_batched_tokens=7, kv_cache_memory=4 << 20, speculative_num_steps=3),
    ],
    ids=["one-chunk", "chunk5", "mtp-chunk7"],
)
def test_greedy_with_media_equals_transformers_inputs_embeds(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, case, ecfg: EngineConfig
) -> None:  # type: ignore[no-untyped-def]
    ids, media, ref = case
    d = tiny_dir
    if ecfg.speculative_num_steps:  # the tiny target with random MTP layers (its own weights unchanged)
        d = make_checkpoint("tiny", tmp_path_factory.mktemp("mm-mtp") / "m", mtp_layers=3)
    eng = LLMEngine(d, ecfg)
    assert _run(eng, "a", ids, _copy(media)) == ref


def test_same_media_hits_the_prefix_cache_and_other_media_misses_at_its_span(
    tiny_dir: Path, case, hf_tiny
) -> None:  # type: ignore[no-untyped-def]
    ids, media, ref = case
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20))
    assert _run(eng, "first", ids, _copy(media)) == ref
    # the same prompt and media, with no embeddings at all: the hit covers every span
    eng.add_request("again", ids, SamplingParams(max_tokens=NEW, temperature=0.0), media=_copy(media, (0, 1)))
    out = []
    while eng.has_unfinished():
        assert eng.core.media_missing() == {}
        out += [t for d in eng.step() for t in d.new_token_ids]
    assert out == ref
    assert eng.core.requests == {}
    # another second image of the same size: a miss from its span on, and its own output; the
    # first image's span lies inside the hit (the shared text after it fills a page), so only the
    # second is asked for
    hidden = hf_tiny.config.hidden_size
    text = [[1, 5, 6, 7], [40, 41, 43, 44, 45, 46], [42, 2, 1, 9]]
    ids1, media1 = _prompt(hidden, [(b"cat", 9, 1), (b"dog", 14, 2)], text)
    assert _run(eng, "warm", ids1, _copy(media1)) == _reference(hf_tiny, ids1, media1, NEW)
    ids2, media2 = _prompt(hidden, [(b"cat", 9, 1), (b"eel", 14, 3)], text)
    assert ids2[: media2.spans[1].start] == ids1[: media1.spans[1].start] and ids2 != ids1
    eng.add_request(
        "other", ids2, SamplingParams(max_tokens=NEW, temperature=0.0), media=_copy(media2, (0, 1))
    )
    req = eng.core.requests["other"]
    got, asked = [], []
    while eng.has_unfinished():
        for rid, missing in eng.core.media_missing().items():
            asked.append(missing)
            for i in missing:
                assert eng.core.supply_media(rid, i, media2.embeds[i])
        got += [t for d in eng.step() for t in d.new_token_ids]
    assert asked == [[1]]  # the first image came from the cache, the second was fetched
    assert media2.spans[0].end <= req.cached_tokens <= media2.spans[1].start
    assert got == _reference(hf_tiny, ids2, media2, NEW)


def test_prefill_waits_at_a_span_until_its_embeddings_come(tiny_dir: Path, case) -> None:  # type: ignore[no-untyped-def]
    ids, media, ref = case
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20))
    eng.add_request("w", ids, SamplingParams(max_tokens=NEW, temperature=0.0), media=_copy(media, (1,)))
    req = eng.core.requests["w"]
    for i in range(3):
        out = eng.step()
        if i == 0:  # admitted: the span past its hit without embeddings is asked for, once
            assert [(d.request_id, d.media_wanted, d.new_token_ids, d.finished) for d in out] == [
                ("w", [1], [], False)
            ]
        else:
            assert out == []
        assert req.num_computed == media.spans[1].start  # up to the missing span, no further
        assert eng.core.media_missing() == {"w": [1]}
    with pytest.raises(ValueError, match="shape"):
        eng.core.supply_media("w", 1, torch.zeros(3, media.embeds[1].shape[1]))
    assert eng.core.supply_media("w", 1, media.embeds[1])
    out = []
    while eng.has_unfinished():
        out += [t for d in eng.step() for t in d.new_token_ids]
    assert out == ref


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda ids, m: ([*ids[:5], ids[5] + 1, *ids[6:]], m), "placeholders"),
        (lambda ids, m: (ids, MediaInputs((m.spans[1], m.spans[0]), {})), "overlaps"),
        (lambda ids, m: (ids, MediaInputs(m.spans[:1], {})), "out of range"),
        (lambda ids, m: (ids, MediaInputs(m.spans, {0: m.embeds[1]})), "shape"),
    ],
    ids=["wrong-pad", "out-of-order", "pads-outside-spans", "embeds-shape"],
)
def test_bad_media_inputs_are_refused(tiny_dir: Path, case, mutate, msg: str) -> None:  # type: ignore[no-untyped-def]
    ids, media, _ = case
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, kv_cache_memory=4 << 20))
    bad_ids, bad_media = mutate(list(ids), _copy(media))
    with pytest.raises(ValueError, match=msg):
        eng.add_request("bad", bad_ids, SamplingParams(max_tokens=2), media=bad_media)
    assert eng.core.requests == {}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("process", ["inline", pytest.param("separate", marks=pytest.mark.cluster)])
async def test_engine_clients_ask_for_media_and_take_it(tiny_dir: Path, case, process: str) -> None:  # type: ignore[no-untyped-def]
    """What a prefill worker does: the stream's first delta names the spans to fetch; the
    embeddings handed over (one of them malformed first, in a second request) finish it."""
    ids, media, ref = case
    cfg = EngineConfig(
        page_size=4, kv_cache_memory=4 << 20, dtype="float32", device="cpu", engine_process=process
    )
    eng = build_engine_client(str(tiny_dir), cfg)
    await eng.start()
    try:
        params = SamplingParams(max_tokens=NEW, temperature=0.0)
        got: list[int] = []
        async for d in eng.generate(ids, params, "a", media=_copy(media, (0, 1))):
            if d.media_wanted is not None:
                assert d.media_wanted == [0, 1] and not d.new_token_ids
                for i in d.media_wanted:
                    await eng.supply_media("a", i, media.embeds[i])
            got += d.new_token_ids
        assert got == ref
        with pytest.raises(ValueError, match="shape"):
            other = [7, *ids[1:]]  # no prefix hit: span 1 is asked for
            async for d in eng.generate(other, params, "b", media=_copy(media, (1,))):
                if d.media_wanted:
                    await eng.supply_media("b", 1, media.embeds[0])
    finally:
        await eng.stop()

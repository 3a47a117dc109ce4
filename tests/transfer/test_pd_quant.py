"""PD transfer of quantized KV pages (``--kv-cache-dtype``): the packed rows travel byte for byte,
page messages name their format, and a decode worker storing another format refuses the pages
(outputs of quantized PD: ``test_pd_inprocess.py::test_pd_equals_single_engine``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from swaserve.config import FULL, SWA
from swaserve.engine.llm_engine import LLMEngine
from swaserve.transfer.kv_transfer import TransferError, scatter, to_pages
from tests.transfer.test_pd_inprocess import CFG as PD_CFG
from tests.transfer.test_pd_inprocess import PARAMS, QUANT, staging_for

CFG = dataclasses.replace(PD_CFG, **QUANT)  # type: ignore[arg-type]


def _export(eng: LLMEngine, rid: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    eng.add_request(rid, prompt, PARAMS, export_kv=True)
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    (o,) = done
    return o


def test_pages_arrive_byte_for_byte_and_name_their_format(tiny_dir: Path) -> None:
    pre = LLMEngine(str(tiny_dir), CFG)
    o = _export(pre, "a", list(range(3, 40)))
    st = staging_for(pre)
    st.begin("a", 37)
    pages = list(to_pages(o.kv_payload, 4))
    assert {pg.dtype for pg in pages if pg.kind == FULL} == {"int8/g8/scale=f32-after-data"}
    assert {pg.dtype for pg in pages if pg.kind == SWA} == {"fp8_e4m3/g8/scale=f32-after-data"}
    for pg in pages:
        st.add(pg)
    st.finish("a")
    got = st.claim("a")
    assert got.formats == o.kv_payload.formats
    for kind, layers in o.kv_payload.kv.items():
        for (k, v), (k2, v2) in zip(layers, got.kv[kind], strict=True):
            assert k.dtype == torch.uint8 and torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize(
    "decode", [{"kv_cache_dtype": "auto", "kv_cache_dtype_swa": None, "kv_quant_group": 0}, {"kv_cache_dtype_swa": "int8"},
               {"kv_quant_group": 0}],
    ids=["auto", "other-swa-format", "other-group"],
)  # fmt: skip
def test_a_decode_worker_with_another_format_refuses_the_pages(tiny_dir: Path, decode: dict) -> None:  # type: ignore[type-arg]
    pre = LLMEngine(str(tiny_dir), CFG)
    o = _export(pre, "a", list(range(3, 40)))
    dec = LLMEngine(str(tiny_dir), dataclasses.replace(CFG, enable_prefix_caching=False, **decode))
    st = staging_for(dec)
    st.begin("a", 37)
    pages = [
        pg for pg in to_pages(o.kv_payload, 4) if decode.get("kv_cache_dtype_swa") is None or pg.kind == SWA
    ]
    with pytest.raises(TransferError, match=r"this decode worker stores .*--kv-cache-dtype"):
        st.add(pages[0])
    with pytest.raises(ValueError, match="this engine stores"):
        dec.kv.admit("a", 38)
        dec.kv.allocate("a", 0, 37)
        scatter(dec.kv, dec.core.storage, o.kv_payload)

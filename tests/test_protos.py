"""The committed generated code (swaserve/v1) matches protos/ (scripts/gen_protos.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_bytes() for p in gen.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in (ROOT / "swaserve" / "v1").iterdir() if p.is_file()}
    assert set(fresh) == set(committed), "run: python scripts/gen_protos.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"generated code drifted from the protos ({stale}); run: python scripts/gen_protos.py"


def test_messages_round_trip() -> None:
    from swaserve.v1 import kv_transfer_pb2, worker_pb2

    r = worker_pb2.GenerateRequest(request_id="a", prompt_token_ids=[1, 2], first_token=7)
    assert worker_pb2.GenerateRequest.FromString(r.SerializeToString()) == r
    m = kv_transfer_pb2.TransferMessage(page=kv_transfer_pb2.KVPage(request_id="a", k=b"\x00\x01"))
    assert m.WhichOneof("kind") == "page"

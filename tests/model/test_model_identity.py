"""The model fingerprint routers and workers compare (swaserve.model.identity): equal for the same
model however it is spelled or stored, different when the config or the tokenizer differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from swaserve.config import ModelConfig
from swaserve.model.hub_format import quantize_fp8, to_hub_style
from swaserve.model.identity import ModelIdentity, model_identity


def identity(d: Path) -> ModelIdentity:
    return model_identity(ModelConfig.from_pretrained(d), AutoTokenizer.from_pretrained(str(d)), d.name)


def copy_with(src: Path, dst: Path, config: dict | None = None, tokenizer: dict | None = None) -> Path:  # type: ignore[type-arg]
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dst


def test_the_same_model_has_the_same_fingerprint_however_stored(tiny_dir: Path, tmp_path: Path) -> None:
    base = identity(tiny_dir)
    assert len(base.fingerprint) == 16 and int(base.fingerprint, 16) >= 0
    assert base.description == f"{tiny_dir.name}: vocab 512, 8 layers, hidden 64"
    assert identity(tiny_dir) == base  # stable
    renamed = identity(copy_with(tiny_dir, tmp_path / "renamed"))
    assert renamed.fingerprint == base.fingerprint and renamed.description != base.description
    assert identity(to_hub_style(tiny_dir, tmp_path / "hub")).fingerprint == base.fingerprint
    fp8 = quantize_fp8(tiny_dir, tmp_path / "fp8", block=(16, 16), num_shards=1)
    assert identity(fp8).fingerprint == base.fingerprint  # quantization is not compared
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    templ = copy_with(tiny_dir, tmp_path / "templ")
    (templ / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": "{{ messages }}"}))
    assert identity(templ).fingerprint == base.fingerprint  # only the router renders chat


def test_another_config_or_tokenizer_changes_the_fingerprint(tiny_dir: Path, tmp_path: Path) -> None:
    base = identity(tiny_dir).fingerprint
    cfg = json.loads((tiny_dir / "config.json").read_text())
    rope = json.loads(json.dumps(cfg["rope_parameters"]))
    rope["full_attention"]["rope_theta"] = 1e6
    seen = {base}
    for name, change in [
        ("rope", {"rope_parameters": rope}),
        ("context", {"max_position_embeddings": 2048}),
        ("eos", {"eos_token_id": [2]}),
    ]:
        fp = identity(copy_with(tiny_dir, tmp_path / name, config=cfg | change)).fingerprint
        assert fp not in seen, name
        seen.add(fp)
    tok = json.loads((tiny_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same size, other meaning
    assert identity(copy_with(tiny_dir, tmp_path / "tok", tokenizer=tok)).fingerprint not in seen

"""``load_tokenizer`` returns what ``AutoTokenizer`` does (class, ids, text, chats, init kwargs): on
the ``TokenizersBackend`` path for MiMo-V2 checkpoints (no torch import) and on the fallback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from swaserve.hf_tokenizer import auto_gives_backend, load_tokenizer
from swaserve.model.checkpoint import TOKENIZER_FILES

TEXTS = [
    "def f(x):\n    return x  # ünïcödé, 中文, emoji \U0001f600",
    "<|im_start|>user\nhi<|im_end|>\n<|image_pad|><|audio_pad|> trailing  spaces  ",
]
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
]


def _tokenizer_copy(src: Path, dst: Path, model: dict[str, object] | None = None, **config: object) -> Path:
    """The tokenizer files and config.json of ``src`` with ``config`` in tokenizer_config.json and
    ``model`` in config.json."""
    dst.mkdir()
    for name in (*TOKENIZER_FILES, "config.json"):
        shutil.copy(src / name, dst / name)
    for name, extra in (("tokenizer_config.json", config), ("config.json", model or {})):
        cfg = json.loads((dst / name).read_text())
        cfg.update(extra)
        (dst / name).write_text(json.dumps(cfg))
    return dst


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        ids = a.encode(text)  # type: ignore[attr-defined]
        assert ids == b.encode(text)  # type: ignore[attr-defined]
        assert a.decode(ids) == b.decode(ids)  # type: ignore[attr-defined]
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    kw = {"tokenize": False, "add_generation_prompt": True}
    assert a.apply_chat_template(CHAT, **kw) == b.apply_chat_template(CHAT, **kw)  # type: ignore[attr-defined]
    assert a.all_special_ids == b.all_special_ids  # type: ignore[attr-defined]
    assert (a.eos_token_id, a.pad_token_id, len(a)) == (b.eos_token_id, b.pad_token_id, len(b))  # type: ignore[attr-defined]
    assert a.init_kwargs == b.init_kwargs  # type: ignore[attr-defined]


def test_the_backend_path_equals_auto_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    """Ours (generic class), the hub's (``Qwen2Tokenizer`` named, ``mimo_v2_flash``) and the
    ``mimo_v2`` spelling with a generic class: ``AutoTokenizer`` gives ``TokenizersBackend``."""
    hub = _tokenizer_copy(tiny_dir, tmp_path / "hub", tokenizer_class="Qwen2Tokenizer")
    v2 = _tokenizer_copy(tiny_dir, tmp_path / "v2", model={"model_type": "mimo_v2"})
    for d in (tiny_dir, hub, v2):
        assert auto_gives_backend(d), d
        _same(load_tokenizer(d), AutoTokenizer.from_pretrained(str(d)))
        assert type(load_tokenizer(d)).__name__ == "TokenizersBackend"


def test_other_checkpoints_go_through_auto_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    remote = _tokenizer_copy(tiny_dir, tmp_path / "remote", auto_map={"AutoTokenizer": ["x.T", None]})
    # a generic class that AutoTokenizer replaces by the model type's own (Qwen2Tokenizer here)
    qwen_type = _tokenizer_copy(tiny_dir, tmp_path / "qwen-type", model={"model_type": "qwen2"})
    v2_qwen = _tokenizer_copy(
        tiny_dir, tmp_path / "v2-qwen", model={"model_type": "mimo_v2"}, tokenizer_class="Qwen2Tokenizer"
    )
    broken = _tokenizer_copy(tiny_dir, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    assert not any(auto_gives_backend(d) for d in (remote, qwen_type, v2_qwen, broken, tmp_path / "missing"))
    for d in (qwen_type, v2_qwen):
        _same(load_tokenizer(d), AutoTokenizer.from_pretrained(str(d)))
    assert type(load_tokenizer(qwen_type)).__name__ == "Qwen2Tokenizer"
    with pytest.raises((OSError, ValueError)):
        load_tokenizer(tmp_path / "missing")


@pytest.mark.cluster  # a child interpreter
def test_the_backend_path_imports_no_torch(tiny_dir: Path) -> None:
    code = (
        "import sys\nfrom swaserve.hf_tokenizer import load_tokenizer\n"
        f"load_tokenizer({str(tiny_dir)!r}).encode('hi')\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

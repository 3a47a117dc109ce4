"""``load_tokenizer`` returns what ``AutoTokenizer`` does: the same class, ids, text and chats, on
the generic fast path (no torch import) and on the fallback for any other tokenizer class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from swaserve.hf_tokenizer import is_generic, load_tokenizer
from swaserve.model.checkpoint import TOKENIZER_FILES

TEXTS = [
    "def f(x):\n    return x  # ünïcödé, 中文, emoji \U0001f600",
    "<|im_start|>user\nhi<|im_end|>\n<|image_pad|><|audio_pad|> trailing  spaces  ",
]
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
]


def _tokenizer_copy(src: Path, dst: Path, **config: object) -> Path:
    dst.mkdir()
    for name in (*TOKENIZER_FILES, "config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
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


def test_the_generic_path_equals_auto_tokenizer(tiny_dir: Path) -> None:
    assert is_generic(tiny_dir)
    _same(load_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(str(tiny_dir)))


def test_other_classes_go_through_auto_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    qwen = _tokenizer_copy(tiny_dir, tmp_path / "qwen", tokenizer_class="Qwen2Tokenizer")
    remote = _tokenizer_copy(tiny_dir, tmp_path / "remote", auto_map={"AutoTokenizer": ["x.T", None]})
    assert not is_generic(qwen) and not is_generic(remote)
    _same(load_tokenizer(qwen), AutoTokenizer.from_pretrained(str(qwen)))
    assert not is_generic(tmp_path / "missing")
    with pytest.raises((OSError, ValueError)):
        load_tokenizer(tmp_path / "missing")


@pytest.mark.cluster  # a child interpreter
def test_the_generic_path_imports_no_torch(tiny_dir: Path) -> None:
    code = (
        "import sys\nfrom swaserve.hf_tokenizer import load_tokenizer\n"
        f"load_tokenizer({str(tiny_dir)!r}).encode('hi')\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

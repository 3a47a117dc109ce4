"""``load_tokenizer``: a checkpoint's Hugging Face tokenizer, as ``AutoTokenizer`` loads it, without
importing torch where that can be avoided.

transformers' ``AutoTokenizer`` imports ``configuration_utils``, which imports torch (about 3
CPU-seconds and a few hundred MB in the router, which runs no model). For a MiMo-V2 checkpoint
``AutoTokenizer`` (transformers 5) returns ``TokenizersBackend.from_pretrained(model_dir)``:
transformers registers ``TokenizersBackend`` for ``model_type`` ``mimo_v2_flash`` and uses it
whatever class ``tokenizer_config.json`` names (the hub's ``Qwen2Tokenizer`` included), and for the
``mimo_v2`` spelling when it names the generic fast tokenizer. There ``load_tokenizer`` calls
``TokenizersBackend`` directly (``auto_gives_backend``); remote code (an ``auto_map``), a
``tokenizer_class`` in config.json, no ``tokenizer.json`` and every other model go through
``AutoTokenizer`` itself. ``tests/test_hf_tokenizer.py`` checks both against ``AutoTokenizer``,
so a transformers release that changes its rules fails there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def auto_gives_backend(model_dir: str | Path) -> bool:
    """Whether ``AutoTokenizer.from_pretrained(model_dir)`` returns a ``TokenizersBackend`` loaded
    from ``model_dir`` alone (the module doc says when); False when unsure."""
    d = Path(model_dir)
    try:
        tok = json.loads((d / "tokenizer_config.json").read_text())
        model = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(tok, dict) and isinstance(model, dict)) or not (d / "tokenizer.json").is_file():
        return False
    if "auto_map" in tok or "auto_map" in model or "tokenizer_class" in model:
        return False
    kind = model.get("model_type")
    return kind == "mimo_v2_flash" or (kind == "mimo_v2" and tok.get("tokenizer_class") in GENERIC_CLASSES)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(model_dir)`` returns (the same class and state).

    Raises:
        OSError, ValueError: as ``from_pretrained`` (no tokenizer files, a malformed config).
    """
    if auto_gives_backend(model_dir):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))

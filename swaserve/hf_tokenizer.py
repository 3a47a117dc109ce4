"""``load_tokenizer``: a checkpoint's Hugging Face tokenizer, as ``AutoTokenizer`` loads it, without
importing torch where that can be avoided.

transformers' ``AutoTokenizer`` imports ``configuration_utils``, which imports torch (about 3
CPU-seconds and a few hundred MB in a process that runs no model: the router, the API front). A
checkpoint whose ``tokenizer_config.json`` names the generic fast tokenizer (``PreTrainedTokenizerFast``
or ``TokenizersBackend``, with a ``tokenizer.json`` and no ``auto_map``) is one that ``AutoTokenizer``
(transformers 5) loads with ``TokenizersBackend.from_pretrained``, so that is called directly. Any
other checkpoint goes through ``AutoTokenizer`` itself: its class resolution has model-type and
hub-specific rules this module does not repeat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def is_generic(model_dir: str | Path) -> bool:
    """Whether the checkpoint's tokenizer is the generic fast one (see the module doc)."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(cfg, dict)
        and cfg.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in cfg
        and (d / "tokenizer.json").is_file()
    )


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(model_dir)`` returns (the same class and state).

    Raises:
        OSError, ValueError: as ``from_pretrained`` (no tokenizer files, a malformed config).
    """
    if is_generic(model_dir):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))

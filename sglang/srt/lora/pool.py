"""Which adapters' weights are in memory: a pool of at most `--max-loaded-loras` adapters. When a request needs
an adapter that is not in it and the pool is full, one is evicted by `--lora-eviction-policy` (`lru`: the one
used longest ago; `fifo`: the one loaded first); pinned adapters and those the running batch uses never are."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import Optional

EVICTION_POLICIES = ("lru", "fifo")


class AdapterPool:
    def __init__(self, capacity: Optional[int], policy: str) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"--lora-eviction-policy must be one of {list(EVICTION_POLICIES)}, got {policy!r}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"--max-loaded-loras must be at least 1, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        # resident adapter names, the next one to evict first
        self._order: OrderedDict[str, None] = OrderedDict()
        self.pinned: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._order

    def __len__(self) -> int:
        return len(self._order)

    def resident(self) -> list[str]:
        """The resident adapters, the next to evict first."""
        return list(self._order)

    def full(self) -> bool:
        return self.capacity is not None and len(self._order) >= self.capacity

    def add(self, name: str, pinned: bool = False) -> None:
        self._order[name] = None
        if pinned:
            self.pinned.add(name)

    def touch(self, name: str) -> None:
        """`name` serves a request now: under LRU it becomes the last to evict."""
        if self.policy == "lru" and name in self._order:
            self._order.move_to_end(name)

    def remove(self, name: str) -> None:
        self._order.pop(name, None)
        self.pinned.discard(name)

    def victim(self, protected: Collection[str]) -> Optional[str]:
        """The adapter to evict to make room, None when every resident one is pinned or `protected` (in use)."""
        return next((n for n in self._order if n not in self.pinned and n not in protected), None)

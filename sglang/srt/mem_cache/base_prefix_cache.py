"""The prefix-cache interface the scheduler talks to; the radix tree and the no-op cache implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 KV slots of the matched prefix (len == matched tokens)
    last_node: Any  # handle to lock while a request uses the prefix (None when nothing can be shared)


class BasePrefixCache(ABC):
    """Maps token prefixes to KV slots so requests that share a prefix compute it once.

    The scheduler hands a request's KV to the cache after each prefill chunk (`cache_unfinished_req`) and when
    the request ends (`cache_finished_req`); the cache decides what it keeps and frees the rest.
    """

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key`."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: take over the request's computed KV and point the request at it."""

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """Take (or free) a finished, aborted or retracted request's KV and free its request row."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots if possible; returns how many were freed."""

    @abstractmethod
    def inc_lock_ref(self, node: Optional[Any]) -> None:
        """Protect the prefix ending at `node` from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Optional[Any]) -> None:
        """Undo one inc_lock_ref."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Forget everything cached (callers clear the allocator too)."""

"""The prefix cache of `--disable-radix-cache`: shares nothing, every request owns and frees its slots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class NoPrefixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenSlotAllocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(self._empty, None)

    def cache_unfinished_req(self, req: Req) -> None:
        return None

    def cache_finished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        self.allocator.free(self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len].clone())
        self.req_to_token_pool.free(row)

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Optional[Any]) -> None:
        return None

    def dec_lock_ref(self, node: Optional[Any]) -> None:
        return None

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None

"""The engine's KV memory: request rows, the slot allocator, the per-layer K/V buffers and the prefix cache.

`build_memory_pools` sizes and builds all four; the scheduler owns the result and hands the K/V buffers to the
model runner through each ForwardBatch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import psutil
import torch

from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.mem_cache.mla_kv_pool import MLAKVPool
from sglang.srt.mem_cache.no_prefix_cache import NoPrefixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool
from sglang.srt.mem_cache.swa_pool import SWAKVPool, SWASlotAllocator
from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
from sglang.srt.model_loader.dtype import dtype_name

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

# Fewer KV slots than this cannot hold a useful request.
MIN_KV_TOKENS = 256
# A decoding request takes its KV slots in runs of up to this many positions (alloc_decode_runs), so that each
# sequence's K/V rows lie together in the head-major pool (kv_pool.py) however many sequences decode at once. Taken
# one per step, the slots of concurrent sequences interleave and decode attention reads each sequence's rows strided:
# 1.7x slower at 4 sequences of 3,000 bf16 tokens (benchmarks/RESULTS.md).
DECODE_SLOT_RUN = 32
# A decoding request gives its out-of-window window slots back in batches of at least this many tokens (one tensor
# pass per batch instead of one per step); they go back once past its window by this many positions too, so
# that nothing still in reach of a query is ever freed.
WINDOW_RELEASE_BATCH = 32


class OutOfKVMemory(RuntimeError):
    """Slot allocation failed even after evicting the cache; the scheduler's budgets should prevent this."""


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one token's K/V across the model's layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # Multi-head latent attention: one row of head_dim (kv_lora_rank + rope) channels per token and layer, no
    # separate values (mem_cache/mla_kv_pool.py).
    latent: bool = False

    @property
    def pool_class(self) -> type[KVPool]:
        return MLAKVPool if self.latent else KVPool

    @property
    def bytes_per_token(self) -> int:
        return self.pool_class.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def layer_bytes_per_token(self, num_layers: int) -> int:
        return self.pool_class.bytes_per_token(num_layers, self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class SWASpec:
    """Hybrid sliding-window memory: which layers attend within a window, the largest window, and the window pool's
    size per full-pool slot (--swa-full-tokens-ratio)."""

    window_layers: frozenset[int]
    window: int
    full_tokens_ratio: float

    def applies_to(self, spec: KVCacheSpec) -> bool:
        """Only a model with both kinds of layers gets two pools; a latent (MLA) cache has no windows."""
        return not spec.latent and 0 < len(self.window_layers) < spec.num_layers and self.window > 0


@dataclass
class MemoryPools:
    """The three memory levels plus the prefix cache."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenSlotAllocator
    kv_pool: KVPool
    tree_cache: BasePrefixCache
    # The largest sliding window when the windowed layers keep their K/V in a window pool (mem_cache/swa_pool.py);
    # 0 with one pool for every layer.
    window: int = 0

    @property
    def max_total_num_tokens(self) -> int:
        return self.allocator.size

    @property
    def max_running_requests(self) -> int:
        return self.req_to_token_pool.size - 1

    @property
    def window_allocator(self) -> Optional[SWASlotAllocator]:
        return self.allocator if isinstance(self.allocator, SWASlotAllocator) else None

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request can hold at once: a prompt takes a slot of each pool per token."""
        window = self.window_allocator
        return self.allocator.size if window is None else min(self.allocator.size, window.window.size)

    def window_available(self) -> int:
        window = self.window_allocator
        return 0 if window is None else window.window_available_size()

    def full_available(self) -> int:
        window = self.window_allocator
        return self.allocator.available_size() if window is None else window.full_available_size()

    @property
    def kv_bytes(self) -> int:
        if isinstance(self.kv_pool, SWAKVPool):
            return self.kv_pool.total_bytes()
        return self.kv_pool.bytes_per_token(self.kv_pool.num_layers, self.kv_pool.num_kv_heads,
                                            self.kv_pool.head_dim, self.kv_pool.dtype) * self.allocator.size

    def pool_report(self) -> dict[str, int]:
        """Token counts and bytes of the pools, for /get_server_info."""
        if not isinstance(self.kv_pool, SWAKVPool):
            return {"full_tokens": self.allocator.size, "full_bytes": self.kv_bytes}
        pool = self.kv_pool
        one_pool = (pool.full_token_bytes() + pool.window_token_bytes()) * pool.size
        return {"full_tokens": pool.size, "full_bytes": pool.full_token_bytes() * pool.size,
                "window_tokens": pool.window_size, "window_bytes": pool.window_token_bytes() * pool.window_size,
                "sliding_window": self.window, "single_pool_bytes": one_pool,
                "saved_bytes": one_pool - pool.total_bytes()}

    def alloc_slots(self, n: int) -> torch.Tensor:
        # With two pools a node may free full slots but no window slots: evict until both suffice.
        while self.allocator.available_size() < n:
            if self.tree_cache.evict(n - self.allocator.available_size()) == 0:
                break
        slots = self.allocator.alloc(n)
        if slots is None:
            raise OutOfKVMemory(f"cannot allocate {n} KV slots")
        return slots

    def alloc_decode_runs(self, rows: list[int], starts: list[int], wanted: list[int]) -> list[int]:
        """Slots for the decode positions from starts[i] on of request row rows[i], written into the row: wanted[i]
        (>= 1) of them when the free list holds them all without evicting cached prefixes, else one each. Returns
        how many each row got; the slots beyond the current position stay the row's (freed with it)."""
        counts = wanted if self.allocator.available_size() >= sum(wanted) else [1] * len(rows)
        slots = self.alloc_slots(sum(counts))
        table = self.req_to_token_pool.req_to_token
        offset = 0
        for row, start, count in zip(rows, starts, counts):
            table[row, start : start + count] = slots[offset : offset + count]
            offset += count
        return counts

    def available_tokens(self) -> int:
        """Tokens that could be allocated after evicting every unlocked cached prefix: O(1), as the scheduler asks
        on every step (the radix caches keep their evictable counts as they change)."""
        window = self.window_allocator
        if window is None:
            return self.allocator.available_size() + self.tree_cache.evictable_size()
        full = window.full_available_size() + self.tree_cache.evictable_size()
        if window.window_available_size() >= full:  # the window pool cannot be the tighter one
            return full
        evictable = (self.tree_cache.window_evictable_size() if isinstance(self.tree_cache, SWARadixCache) else 0)
        return min(full, window.window_available_size() + evictable)

    def release_out_of_window(self, reqs: list[Req]) -> None:
        """Give back the window slots of tokens that every active request (`reqs`: the running ones and the one in
        chunked prefill) has moved past: a request's tokens before committed length - window - margin, unless
        another request still has the same slot within its own window (a shared prefix it reached later)."""
        window = self.window_allocator
        if window is None:
            return
        reach = self.window + WINDOW_RELEASE_BATCH
        due = [r for r in reqs if r.req_pool_idx is not None
               and r.kv_committed_len - reach - r.window_released_len >= WINDOW_RELEASE_BATCH]
        if not due:
            return
        table = self.req_to_token_pool.req_to_token
        candidates = []
        for req in due:
            end = req.kv_committed_len - reach
            candidates.append(table[req.req_pool_idx, req.window_released_len : end])
            req.window_released_len = end
        # requests that share a prefix hold the same slots: each goes back once
        slots = candidates[0] if len(candidates) == 1 else torch.unique(torch.cat(candidates))
        in_reach = [table[r.req_pool_idx, max(0, r.kv_committed_len - reach) : r.kv_allocated_len]
                    for r in reqs if r.req_pool_idx is not None]
        if in_reach:
            slots = slots[~torch.isin(slots, torch.cat(in_reach))]
        window.free_window(slots)

    def idle_window_error(self) -> Optional[str]:
        """With two pools, when idle: every window slot is free or held by a token of the prefix cache, and the
        cache's kept counts agree with a walk of its tree."""
        window = self.window_allocator
        if window is None:
            return None
        held = 0
        if isinstance(self.tree_cache, SWARadixCache):
            count_error = self.tree_cache.window_count_error()
            if count_error is not None:
                return count_error
            held = self.tree_cache.window_slots_held()
        if window.window_available_size() + held != window.window.size:
            return (f"window memory leak: free={window.window_available_size()} cached={held} "
                    f"total={window.window.size}")
        return None

    def clear(self) -> None:
        """Forget every cached prefix and free every slot and row (only when no request holds any)."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()


def profile_kv_tokens(bytes_per_token: float, device: torch.device, mem_fraction_static: float) -> int:
    """How many tokens of `bytes_per_token` fit in `mem_fraction_static` of the memory still free on `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * mem_fraction_static - (total - free)
    else:
        budget = psutil.virtual_memory().available * mem_fraction_static
    tokens = int(budget // bytes_per_token)
    if tokens < MIN_KV_TOKENS:
        raise RuntimeError(
            f"Not enough memory for the KV cache ({tokens} tokens); raise --mem-fraction-static "
            "or set --max-total-tokens"
        )
    return tokens


def build_memory_pools(
    spec: KVCacheSpec,
    device: torch.device,
    context_len: int,
    max_total_tokens: Optional[int],
    mem_fraction_static: float,
    max_running_requests: Optional[int],
    disable_radix_cache: bool,
    swa: Optional[SWASpec] = None,
) -> MemoryPools:
    """The pools for `spec`; with `swa` (and a model that has both windowed and global layers) the windowed layers'
    K/V go to a window pool of full_tokens_ratio times the full pool's slots."""
    if swa is not None and swa.applies_to(spec):
        return _build_hybrid_pools(spec, swa, device, context_len, max_total_tokens, mem_fraction_static,
                                   max_running_requests, disable_radix_cache)
    total = max_total_tokens or profile_kv_tokens(spec.bytes_per_token, device, mem_fraction_static)
    req_to_token_pool = _request_rows(total, max_running_requests, context_len, device)
    allocator = TokenSlotAllocator(total, device=device)
    kv_pool = (MLAKVPool(total, spec.num_layers, spec.head_dim, spec.dtype, device) if spec.latent
               else KVPool(total, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, device))
    tree_cache: BasePrefixCache = (NoPrefixCache(req_to_token_pool, allocator) if disable_radix_cache
                                   else RadixCache(req_to_token_pool, allocator))
    layout = (f"MLA latent of {spec.head_dim} channels" if spec.latent
              else "head-major" if kv_pool.head_major else "slot-major")
    logger.info("KV cache: %d tokens (%.1f MB, %d bytes per token, %s, %s), %d request rows, prefix cache: %s",
                total, spec.bytes_per_token * total / 2**20, spec.bytes_per_token, dtype_name(spec.dtype), layout,
                req_to_token_pool.size - 1, type(tree_cache).__name__)
    return MemoryPools(req_to_token_pool, allocator, kv_pool, tree_cache)


def _request_rows(total: int, max_running_requests: Optional[int], context_len: int,
                  device: torch.device) -> ReqToTokenPool:
    if max_running_requests is None:
        max_running_requests = max(1, min(total // 2, 256))
    return ReqToTokenPool(max_running_requests + 1, context_len + 8, device=device)


def _build_hybrid_pools(spec: KVCacheSpec, swa: SWASpec, device: torch.device, context_len: int,
                        max_total_tokens: Optional[int], mem_fraction_static: float,
                        max_running_requests: Optional[int], disable_radix_cache: bool) -> MemoryPools:
    num_window = len(swa.window_layers)
    full_bytes = spec.layer_bytes_per_token(spec.num_layers - num_window)
    window_bytes = spec.layer_bytes_per_token(num_window)
    # --max-total-tokens sizes the full pool; otherwise the memory budget holds both pools at the ratio
    total = max_total_tokens or profile_kv_tokens(full_bytes + swa.full_tokens_ratio * window_bytes, device,
                                                  mem_fraction_static)
    window_total = max(1, int(total * swa.full_tokens_ratio))
    req_to_token_pool = _request_rows(total, max_running_requests, context_len, device)
    allocator = SWASlotAllocator(total, window_total, device=device)
    kv_pool = SWAKVPool(total, window_total, swa.window_layers, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                        spec.dtype, allocator.full_to_window, device)
    tree_cache: BasePrefixCache = (NoPrefixCache(req_to_token_pool, allocator) if disable_radix_cache
                                   else SWARadixCache(req_to_token_pool, allocator, swa.window))
    one_pool = spec.bytes_per_token * total
    saved = one_pool - kv_pool.total_bytes()
    logger.info(
        "KV cache: hybrid sliding-window memory: full pool %d tokens x %d global layers (%.1f MB), window pool %d "
        "tokens x %d sliding-window layers of window %d (%.1f MB); %.1f MB in all, %.1f MB (%.0f%%) less than one "
        "pool of %d tokens for every layer, which would hold %d tokens in this memory (%s, %s), %d request rows, "
        "prefix cache: %s",
        total, spec.num_layers - num_window, full_bytes * total / 2**20, window_total, num_window, swa.window,
        window_bytes * window_total / 2**20, kv_pool.total_bytes() / 2**20, saved / 2**20, 100 * saved / one_pool,
        total, kv_pool.total_bytes() // spec.bytes_per_token, dtype_name(spec.dtype),
        "head-major" if kv_pool.head_major else "slot-major",
        req_to_token_pool.size - 1, type(tree_cache).__name__)
    return MemoryPools(req_to_token_pool, allocator, kv_pool, tree_cache, window=swa.window)

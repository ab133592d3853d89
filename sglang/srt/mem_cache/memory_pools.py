"""The engine's KV memory: request rows, the slot allocator, the per-layer K/V buffers and the prefix cache.

`build_memory_pools` sizes and builds all four; the scheduler owns the result and hands the K/V buffers to the
model runner through each ForwardBatch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.mem_cache.mla_kv_pool import MLAKVPool
from sglang.srt.mem_cache.no_prefix_cache import NoPrefixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool
from sglang.srt.model_loader.dtype import dtype_name

logger = logging.getLogger(__name__)

# Fewer KV slots than this cannot hold a useful request.
MIN_KV_TOKENS = 256
# A decoding request takes its KV slots in runs of up to this many positions (alloc_decode_runs), so that each
# sequence's K/V rows lie together in the head-major pool (kv_pool.py) however many sequences decode at once. Taken
# one per step, the slots of concurrent sequences interleave and decode attention reads each sequence's rows strided:
# 1.7x slower at 4 sequences of 3,000 bf16 tokens (benchmarks/RESULTS.md).
DECODE_SLOT_RUN = 32


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


@dataclass
class MemoryPools:
    """The three memory levels plus the prefix cache."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenSlotAllocator
    kv_pool: KVPool
    tree_cache: BasePrefixCache

    @property
    def max_total_num_tokens(self) -> int:
        return self.allocator.size

    @property
    def max_running_requests(self) -> int:
        return self.req_to_token_pool.size - 1

    @property
    def kv_bytes(self) -> int:
        return self.kv_pool.bytes_per_token(self.kv_pool.num_layers, self.kv_pool.num_kv_heads,
                                            self.kv_pool.head_dim, self.kv_pool.dtype) * self.allocator.size

    def alloc_slots(self, n: int) -> torch.Tensor:
        if self.allocator.available_size() < n:
            self.tree_cache.evict(n - self.allocator.available_size())
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
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def clear(self) -> None:
        """Forget every cached prefix and free every slot and row (only when no request holds any)."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()


def profile_kv_tokens(spec: KVCacheSpec, device: torch.device, mem_fraction_static: float) -> int:
    """How many tokens of K/V fit in `mem_fraction_static` of the memory still free on `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * mem_fraction_static - (total - free)
    else:
        budget = psutil.virtual_memory().available * mem_fraction_static
    tokens = int(budget // spec.bytes_per_token)
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
) -> MemoryPools:
    total = max_total_tokens or profile_kv_tokens(spec, device, mem_fraction_static)
    if max_running_requests is None:
        max_running_requests = max(1, min(total // 2, 256))
    req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_len + 8, device=device)
    allocator = TokenSlotAllocator(total, device=device)
    kv_pool = (MLAKVPool(total, spec.num_layers, spec.head_dim, spec.dtype, device) if spec.latent
               else KVPool(total, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, device))
    tree_cache: BasePrefixCache = (NoPrefixCache(req_to_token_pool, allocator) if disable_radix_cache
                                   else RadixCache(req_to_token_pool, allocator))
    layout = (f"MLA latent of {spec.head_dim} channels" if spec.latent
              else "head-major" if kv_pool.head_major else "slot-major")
    logger.info("KV cache: %d tokens (%.1f MB, %d bytes per token, %s, %s), %d request rows, prefix cache: %s",
                total, spec.bytes_per_token * total / 2**20, spec.bytes_per_token, dtype_name(spec.dtype), layout,
                max_running_requests, type(tree_cache).__name__)
    return MemoryPools(req_to_token_pool, allocator, kv_pool, tree_cache)

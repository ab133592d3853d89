"""window_evictable_size() (what MemoryPools.available_tokens() asks the tree on every scheduler step) on trees of
100 to 10,000 nodes: the walk of commit 3dca16e (cached per change of the tree, but every step's slot allocation is
such a change) against the kept counts. One step = allocate a slot for each of 16 requests, then ask. The old classes
come from the commit:

   mkdir -p /tmp/oldswa/oldswa && touch /tmp/oldswa/oldswa/__init__.py
   git show 3dca16e:sglang/srt/mem_cache/swa_pool.py > /tmp/oldswa/oldswa/swa_pool.py
   git show 3dca16e:sglang/srt/mem_cache/swa_radix_cache.py | sed 's/sglang.srt.mem_cache.swa_pool/oldswa.swa_pool/' \
       > /tmp/oldswa/oldswa/swa_radix_cache.py
   python benchmarks/results/2026-11-27-gemma3/bench_window_count.py
"""

from __future__ import annotations

import importlib
import random
import sys
import time

import torch

from sglang.srt.mem_cache.req_to_token import ReqToTokenPool

sys.path.insert(0, "/tmp/oldswa")
torch.set_num_threads(1)
VERSIONS = (("walk (before)", "oldswa.swa_pool", "oldswa.swa_radix_cache"),
            ("kept counts", "sglang.srt.mem_cache.swa_pool", "sglang.srt.mem_cache.swa_radix_cache"))


def build(pool_module: str, cache_module: str, nodes: int):
    alloc = importlib.import_module(pool_module).SWASlotAllocator(300_000, 300_000)
    cache = importlib.import_module(cache_module).SWARadixCache(ReqToTokenPool(20, 64), alloc, 512)
    rng = random.Random(0)
    for i in range(nodes):  # branching prompts over shared stems
        key = [i % 7, (i // 7) % 11, i] + [rng.randrange(1000) for _ in range(20)]
        cache.insert(key, alloc.alloc(len(key)))
    alloc.window.alloc(alloc.window.available_size() - 1000)  # the window pool is the tighter one
    return cache, alloc


def main() -> None:
    for nodes in (100, 1000, 10000):
        for name, pool_module, cache_module in VERSIONS:
            cache, alloc = build(pool_module, cache_module, nodes)
            steps, asking = 200, 0.0
            for _ in range(steps):
                alloc.alloc(16)
                start = time.perf_counter()
                cache.window_evictable_size()
                asking += time.perf_counter() - start
            print(f"{nodes:6d} tree nodes  {name:14s} window_evictable_size: {asking / steps * 1e6:9.1f} us per step")


if __name__ == "__main__":
    main()

"""The window-slot counts the hybrid radix cache keeps for the scheduler (mem_cache/swa_radix_cache.py), which asks
for them on every step: they equal a walk of the tree through random tree operations, and through a mixed Engine
workload on a tiny random Gemma 3 (shared prefixes decoded in lockstep, aborted requests, radix hits, evictions
under a small pool) whenever the scheduler is idle (its invariant check compares them with a walk).
"""

from __future__ import annotations

import asyncio
import random

import torch

from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
from tests.decoder_variant_checks import hf_greedy
from tests.test_swa_memory import assert_idle_pools_whole, engine_prompts, gemma3_dir, hybrid_pools

__all__ = ["gemma3_dir"]  # the module-scoped checkpoint fixture, shared with test_swa_memory.py


def test_kept_window_counts_equal_a_walk_through_random_operations():
    """Inserts over shared prefixes (duplicates freed, window slots taken over), locks and unlocks of matches,
    window slots given back, evictions under a full pool: after each, the counts kept for available_tokens equal a
    walk of the tree, and available_tokens is what evicting everything unlocked really makes free."""
    mem = hybrid_pools(window=4, ratio=0.5)
    cache, alloc = mem.tree_cache, mem.window_allocator
    assert isinstance(cache, SWARadixCache) and alloc is not None
    rng = random.Random(3)
    locked: list = []
    for step in range(400):
        op = rng.random()
        if op < 0.4:  # a request's tokens: a few shared stems, then its own
            key = [rng.randrange(3)] * rng.randrange(1, 12) + [rng.randrange(50) for _ in range(rng.randrange(30))]
            if mem.available_tokens() < len(key):
                continue
            slots = mem.alloc_slots(len(key))
            if rng.random() < 0.5:  # some of the copy already gave its window slots back
                alloc.free_window(slots[: rng.randrange(len(key))])
            cached = cache.insert(key, slots)
            alloc.free(slots[:cached])
        elif op < 0.6:
            match = cache.match_prefix([rng.randrange(3)] * rng.randrange(1, 12) + [rng.randrange(50)])
            cache.inc_lock_ref(match.last_node)
            locked.append(match.last_node)
        elif op < 0.75 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        elif op < 0.9:
            held = torch.cat([n.value for n in cache._nodes()] or [torch.empty(0, dtype=torch.int64)])
            if held.numel():
                alloc.free_window(held[torch.randperm(held.numel())[: rng.randrange(1, 20)]])
        else:
            cache.evict(rng.randrange(1, 80))
        assert cache.window_count_error() is None, step
        cache.check_integrity()
        assert mem.idle_window_error() is None
    while locked:
        cache.dec_lock_ref(locked.pop())
    assert cache.window_count_error() is None and mem.idle_window_error() is None
    expected = mem.available_tokens()
    cache.evict(10**6)
    assert expected == alloc.available_size() and cache.window_slots_held() == cache.window_evictable_size() == 0


def test_window_counts_stay_exact_through_a_mixed_engine_workload(gemma3_dir, smollm2_tokenizer):
    """A small pool (320 full, 256 window slots) under shared prefixes of four windows and more decoded in lockstep
    (their out-of-window slots go back in the same step), requests aborted in chunked prefill and in decode, radix
    hits and evictions: whenever idle, the counts the scheduler reads on every step equal a walk of the tree (the
    idle invariant check) and both pools are whole again after a flush; the shared-prefix outputs equal
    transformers'."""
    from sglang import Engine

    directory, model = gemma3_dir
    tokenizer = smollm2_tokenizer
    stem = engine_prompts(tokenizer)["first"][:40]
    tails = [tokenizer.encode(f" and then {word} again") for word in ("red", "blue", "green", "gold")]
    shared = [stem + tail for tail in tails]
    long = tokenizer.encode(" ".join(f"row {i} holds {i * 3 % 17} apples," for i in range(24)))
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}

    async def aborted(engine, ids: list[int], rid: str, after: int) -> dict:
        """Streams `ids` (200 new tokens) and aborts the request after `after` streamed chunks (0: 20 ms after
        sending it: in its chunked prefill or early in decode)."""
        stream = await engine.async_generate(input_ids=ids, rid=rid, stream=True,
                                             sampling_params={**params, "max_new_tokens": 200})

        async def consume() -> dict:
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == after:
                    engine.abort_request(rid)
            return chunks[-1]

        task = asyncio.ensure_future(consume())
        if after == 0:
            await asyncio.sleep(0.02)
            engine.abort_request(rid)
        return await task

    async def mixed(engine) -> list:
        return await asyncio.gather(
            aborted(engine, long, "cut-in-prefill", 0), aborted(engine, stem + tails[0][:2], "cut-in-decode", 5),
            *(engine.async_generate(input_ids=ids, sampling_params=params) for ids in shared[1:]))

    with Engine(model_path=str(directory), dtype="float32", max_total_tokens=320, chunked_prefill_size=64,
                max_running_requests=8) as engine:
        def assert_counts_exact() -> None:
            assert engine.get_internal_state()["invariant_error"] is None

        outs = engine.generate(input_ids=shared, sampling_params=params)
        assert [o["output_ids"] for o in outs] == [hf_greedy(model, tokenizer, ids, 40) for ids in shared]
        assert_counts_exact()
        conversation = shared[0] + outs[0]["output_ids"][:30]  # its tail kept its window slots: a long hit
        hit = engine.generate(input_ids=conversation, sampling_params=params)
        assert hit["meta_info"]["cached_tokens"] == len(conversation) - 1
        assert hit["output_ids"] == hf_greedy(model, tokenizer, conversation, 40)
        assert_counts_exact()
        for result in engine.loop.run_until_complete(mixed(engine))[:2]:
            assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert_counts_exact()
        # more distinct tokens than the pools hold: the tree evicts what the earlier requests left
        fresh = [tokenizer.encode(f"Question {i}: what is {i} times {i + 5}? Think it through.") for i in range(6)]
        engine.generate(input_ids=fresh, sampling_params={**params, "max_new_tokens": 60})
        assert_counts_exact()
        again = engine.generate(input_ids=conversation, sampling_params=params)
        assert again["meta_info"]["cached_tokens"] < len(conversation) - 1  # evicted
        assert again["output_ids"] == hit["output_ids"]
        assert_counts_exact()
        assert_idle_pools_whole(engine, hybrid=True)


"""RadixCache: prefix sharing, node splits, LRU eviction, locking, request hand-off and slot accounting."""

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.no_prefix_cache import NoPrefixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool


def make_cache(size: int = 64, rows: int = 4, context: int = 64, disable: bool = False, device: str = "cpu"):
    pool = ReqToTokenPool(rows, context, device=device)
    alloc = TokenSlotAllocator(size, device=device)
    return (NoPrefixCache(pool, alloc) if disable else RadixCache(pool, alloc)), pool, alloc


def insert_new(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with freshly allocated slots, freeing the copies the tree already had."""
    slots = cache.allocator.alloc(len(key))
    already = cache.insert(key, slots)
    cache.allocator.free(slots[:already])
    return slots


def tree_contents(cache: RadixCache) -> dict[tuple, int]:
    """Every cached token as {token prefix ending at it: its KV slot}."""
    out = {}
    stack = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix
            for tok, slot in zip(child.key, child.value.tolist()):
                path = path + (tok,)
                out[path] = slot
            stack.append((child, path))
    return out


def node_count(cache: RadixCache) -> int:
    n, stack = 0, [cache.root_node]
    while stack:
        node = stack.pop()
        n += len(node.children)
        stack.extend(node.children.values())
    return n


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    req_pool_idx: Optional[int] = None
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    kv_allocated_len: int = 0
    kv_committed_len: int = 0


def admit(cache: RadixCache, req: FakeReq, fill_len: int) -> None:
    """What the scheduler does at admission: match, lock, take a row, allocate the uncached part."""
    key = req.origin_input_ids[:fill_len]
    match = cache.match_prefix(key[: len(key) - 1])
    req.prefix_indices, req.last_node = match.indices, match.last_node
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = cache.req_to_token_pool.alloc()
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    prefix_len = len(req.prefix_indices)
    row[:prefix_len] = req.prefix_indices
    new = cache.allocator.alloc(fill_len - prefix_len)
    row[prefix_len:fill_len] = new
    req.fill_ids = key
    req.kv_allocated_len = req.kv_committed_len = fill_len


def extend(cache: RadixCache, req: FakeReq, n: int) -> None:
    """Allocate and 'compute' `n` more positions of the row (a later chunk or decode steps)."""
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    start = req.kv_allocated_len
    row[start : start + n] = cache.allocator.alloc(n)
    req.kv_allocated_len = req.kv_committed_len = start + n


def assert_no_leak(cache: RadixCache, live: list[FakeReq] = ()) -> None:
    held = sum(r.kv_allocated_len - max(r.cache_protected_len, len(r.prefix_indices)) for r in live)
    assert cache.allocator.available_size() + cache.total_size() + held == cache.allocator.size


# ---- sharing, splitting, insert return values -------------------------------------------------------
def test_common_prefix_shares_slots():
    cache, _, _ = make_cache()
    a = insert_new(cache, [1, 2, 3, 4, 5])
    b = insert_new(cache, [1, 2, 3, 9, 9])
    assert cache.total_size() == 7  # 5 + the two new tokens of the second key
    m = cache.match_prefix([1, 2, 3, 9, 9, 7])
    assert m.indices.tolist() == a[:3].tolist() + b[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == a.tolist()
    assert cache.match_prefix([8, 1]).indices.numel() == 0
    assert cache.match_prefix([8]).last_node is cache.root_node
    assert cache.match_prefix([]).indices.numel() == 0
    cache.check_integrity()
    assert_no_leak(cache)


def test_match_ending_inside_a_node_splits_it_exactly():
    cache, _, _ = make_cache()
    slots = insert_new(cache, [10, 11, 12, 13, 14, 15])
    assert node_count(cache) == 1
    m = cache.match_prefix([10, 11, 12, 99])
    assert m.indices.tolist() == slots[:3].tolist()
    assert node_count(cache) == 2
    upper = m.last_node
    assert upper.key == [10, 11, 12] and upper.value.tolist() == slots[:3].tolist()
    assert upper.parent is cache.root_node
    (lower,) = upper.children.values()
    assert lower.key == [13, 14, 15] and lower.value.tolist() == slots[3:].tolist()
    assert lower.parent is upper
    # Splitting does not change what is cached.
    assert cache.match_prefix([10, 11, 12, 13, 14, 15]).indices.tolist() == slots.tolist()
    assert cache.total_size() == 6
    cache.check_integrity()


def test_insert_returns_already_cached_length_and_splits():
    cache, _, _ = make_cache()
    assert cache.insert([1, 2, 3], torch.tensor([11, 12, 13])) == 0
    assert cache.insert([1, 2, 3], torch.tensor([21, 22, 23])) == 3
    assert cache.insert([1, 2, 3, 4], torch.tensor([31, 32, 33, 34])) == 3
    assert cache.insert([1, 5], torch.tensor([41, 42])) == 1  # splits [1,2,3] after one token
    assert cache.insert([7], torch.tensor([51])) == 0
    assert tree_contents(cache) == {
        (1,): 11, (1, 2): 12, (1, 2, 3): 13, (1, 2, 3, 4): 34, (1, 5): 42, (7,): 51,
    }
    assert cache.total_size() == cache.evictable_size() == 6
    cache.check_integrity()


def test_insert_copies_the_value_so_reused_rows_do_not_corrupt_the_tree():
    cache, pool, _ = make_cache()
    row = pool.req_to_token[0]
    row[:3] = torch.tensor([5, 6, 7])
    cache.insert([1, 2, 3], row[:3])
    row[:3] = torch.tensor([40, 41, 42])
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [5, 6, 7]


# ---- eviction and locking ---------------------------------------------------------------------------
def test_evict_lru_leaves_first_parent_after_children():
    cache, _, alloc = make_cache(size=32)
    insert_new(cache, [1, 2, 3, 4])     # becomes parent [1,2] with leaves [3,4] and [5,6]
    insert_new(cache, [1, 2, 5, 6])
    insert_new(cache, [7, 8, 9])
    insert_new(cache, [20, 21])
    cache.match_prefix([7, 8, 9])       # touch [7,8,9]
    cache.match_prefix([1, 2, 5, 6])    # touch [1,2] and [5,6]
    insert_new(cache, [30])             # the most recent of all
    # LRU order of leaves: [3,4], [20,21], [7,8,9], [5,6], [30]; parent [1,2] as old as [5,6].
    # tree_contents() reads the tree without touching access times.
    free_before = alloc.available_size()
    assert cache.evict(1) == 2
    assert (1, 2, 3) not in tree_contents(cache) and (1, 2) in tree_contents(cache)
    assert cache.evict(1) == 2
    assert (20,) not in tree_contents(cache)
    # [7,8,9] and [5,6] go; [1,2] then becomes a childless leaf older than [30] and goes in the
    # same pass, while [30] stays.
    assert cache.evict(6) == 7
    assert set(tree_contents(cache)) == {(30,)}
    assert alloc.available_size() == free_before + 11
    cache.check_integrity()
    assert cache.evict(100) == 1
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


def test_evict_spares_a_parent_that_still_has_children():
    cache, _, _ = make_cache()
    insert_new(cache, [1, 2, 3])
    insert_new(cache, [1, 2, 4])
    cache.match_prefix([1, 2, 4])  # [1,2] and [4] recent, [3] old
    assert cache.evict(1) == 1
    assert set(tree_contents(cache)) == {(1,), (1, 2), (1, 2, 4)}
    cache.check_integrity()


def test_locked_path_survives_evict_and_sizes_move():
    cache, _, alloc = make_cache()
    insert_new(cache, [1, 2, 3, 4, 5])
    insert_new(cache, [1, 2, 3, 9])
    insert_new(cache, [6, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert cache.evictable_size() == 8 and cache.protected_size() == 0
    cache.inc_lock_ref(m.last_node)  # locks [4,5] and [1,2,3]
    assert cache.protected_size() == 5 and cache.evictable_size() == 3
    cache.inc_lock_ref(m.last_node)  # a second user changes nothing in the sizes
    assert cache.protected_size() == 5
    cache.check_integrity()
    assert cache.evict(10**6) == 3
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.numel() == 5
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 5
    assert cache.evict(10**6) == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    cache.check_integrity()
    assert cache.evict(10**6) == 5
    assert alloc.available_size() == alloc.size


def test_lock_on_a_node_that_is_later_split_keeps_both_parts_locked():
    cache, _, _ = make_cache()
    insert_new(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    cache.match_prefix([1, 2])  # splits the locked node
    cache.check_integrity()
    assert cache.protected_size() == 4
    assert cache.evict(10) == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_integrity()


# ---- request hand-off -------------------------------------------------------------------------------
def test_finished_request_shares_prefix_with_next_request():
    cache, pool, alloc = make_cache()
    a = FakeReq([1, 2, 3, 4, 5])
    admit(cache, a, 5)
    a.output_ids = [6, 7]
    extend(cache, a, 1)  # decode step for token 6; token 7 was sampled but never run
    a_slots = pool.req_to_token[a.req_pool_idx, :6].clone()
    cache.cache_finished_req(a)
    assert cache.total_size() == 6 and cache.protected_size() == 0
    assert pool.available_size() == pool.size
    assert_no_leak(cache)

    b = FakeReq([1, 2, 3, 4, 5, 6, 8, 9])
    admit(cache, b, 8)
    assert b.prefix_indices.tolist() == a_slots.tolist()
    assert cache.protected_size() == 6
    assert_no_leak(cache, [b])
    b.output_ids = [10]
    cache.cache_finished_req(b)
    assert cache.total_size() == 8 and cache.protected_size() == 0
    cache.check_integrity()
    assert_no_leak(cache)


def test_duplicate_computation_frees_the_second_copy():
    cache, _, _ = make_cache()
    a, b = FakeReq([1, 2, 3, 4]), FakeReq([1, 2, 3, 4])
    admit(cache, a, 4)
    admit(cache, b, 4)  # both computed the same prompt concurrently
    a.output_ids, b.output_ids = [5], [5]
    cache.cache_finished_req(a)
    assert_no_leak(cache, [b])
    cache.cache_finished_req(b)
    assert cache.total_size() == 4
    cache.check_integrity()
    assert_no_leak(cache)


def test_chunked_request_aborted_midway_leaks_nothing():
    cache, pool, alloc = make_cache(size=40)
    prompt = list(range(100, 120))
    req = FakeReq(prompt)
    admit(cache, req, 8)  # first chunk
    cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 8 and len(req.prefix_indices) == 8
    assert pool.req_to_token[req.req_pool_idx, :8].tolist() == req.prefix_indices.tolist()
    assert cache.protected_size() == 8
    cache.check_integrity()
    assert_no_leak(cache, [req])

    req.fill_ids = prompt[:16]  # second chunk
    extend(cache, req, 8)
    cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 16 and cache.protected_size() == 16 and cache.evictable_size() == 0
    assert_no_leak(cache, [req])

    # Third chunk allocated but aborted before it ran: its slots were never computed.
    row_slots = pool.req_to_token[req.req_pool_idx]
    row_slots[16:20] = alloc.alloc(4)
    req.kv_allocated_len = 20
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert cache.total_size() == 16  # only the computed positions were cached
    assert pool.available_size() == pool.size
    cache.check_integrity()
    assert_no_leak(cache)
    cache.evict(10**6)
    assert alloc.available_size() == alloc.size


def test_abort_after_partial_output_leaks_nothing():
    cache, pool, alloc = make_cache(size=40)
    other = FakeReq([1, 2, 3, 4, 5, 6])
    admit(cache, other, 6)
    other.output_ids = [7]
    cache.cache_finished_req(other)

    req = FakeReq([1, 2, 3, 4, 9, 9, 9, 9, 9, 9])
    admit(cache, req, 5)  # reuses [1,2,3,4]; chunk of one new token
    cache.cache_unfinished_req(req)
    req.fill_ids = req.origin_input_ids
    extend(cache, req, 5)
    req.output_ids = [50, 51]
    extend(cache, req, 1)  # decode of 50
    extend(cache, req, 1)  # decode of 51 allocated, aborted before it was computed
    req.kv_committed_len -= 1
    assert_no_leak(cache, [req])
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert cache.match_prefix(req.origin_input_ids + [50]).indices.numel() == 11
    cache.check_integrity()
    assert_no_leak(cache)
    cache.evict(10**6)
    assert alloc.available_size() == alloc.size and cache.total_size() == 0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_stay_on_the_configured_device(device):
    cache, pool, alloc = make_cache(size=32, device=device)
    a = FakeReq([1, 2, 3, 4, 5, 6])
    admit(cache, a, 3)
    cache.cache_unfinished_req(a)
    a.fill_ids = a.origin_input_ids
    extend(cache, a, 3)
    a.output_ids = [7, 8]
    extend(cache, a, 1)
    cache.cache_finished_req(a)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9])
    assert m.indices.device.type == device and len(m.indices) == 7
    assert alloc.free_slots.device.type == device
    cache.check_integrity()
    assert_no_leak(cache)
    assert cache.evict(100) == 7 and alloc.available_size() == alloc.size


# ---- no prefix cache (--disable-radix-cache) ----------------------------------------------------------
def test_no_prefix_cache_shares_nothing_and_frees_everything():
    cache, pool, alloc = make_cache(disable=True)
    assert cache.total_size() == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.numel() == 0 and m.last_node is None
    for _ in range(2):
        req = FakeReq([1, 2, 3, 4, 5])
        admit(cache, req, 3)
        assert req.prefix_indices.numel() == 0
        cache.cache_unfinished_req(req)  # no-op
        assert req.cache_protected_len == 0
        req.fill_ids = req.origin_input_ids
        extend(cache, req, 2)
        req.output_ids = [6]
        cache.cache_finished_req(req)
        assert alloc.available_size() == alloc.size and pool.available_size() == pool.size
    assert cache.evict(100) == 0
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0


def test_reset_forgets_everything():
    cache, _, alloc = make_cache()
    insert_new(cache, [1, 2, 3])
    cache.reset()
    alloc.clear()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3]).indices.numel() == 0
    cache.check_integrity()


# ---- randomized against a reference model -----------------------------------------------------------
def test_random_operations_match_reference_model():
    rng = random.Random(1234)
    cache, _, alloc = make_cache(size=120)
    ref: dict[tuple, int] = {}  # token prefix -> slot, as in tree_contents
    locks: list[tuple[Any, tuple]] = []  # (locked node, matched key)

    def locked_prefixes() -> set[tuple]:
        return {key[:i] for _, key in locks for i in range(1, len(key) + 1)}

    def random_key() -> list[int]:
        if ref and rng.random() < 0.6:
            base = list(rng.choice(list(ref)))  # extend or cut a cached sequence
            base = base[: rng.randint(1, len(base))]
        else:
            base = []
        return base + [rng.randrange(4) for _ in range(rng.randint(0 if base else 1, 6))]

    for _ in range(1500):
        op = rng.random()
        if op < 0.4:
            key = random_key()
            if alloc.available_size() < len(key):
                cache.evict(len(key) - alloc.available_size())
                ref = {k: v for k, v in ref.items() if k in tree_contents(cache)}
            slots = alloc.alloc(len(key))
            if slots is None:
                continue
            expected = 0
            while expected < len(key) and tuple(key[: expected + 1]) in ref:
                expected += 1
            assert cache.insert(key, slots) == expected
            alloc.free(slots[:expected])
            for i in range(expected, len(key)):
                ref[tuple(key[: i + 1])] = int(slots[i])
        elif op < 0.6:
            key = random_key()
            m = cache.match_prefix(key)
            n = 0
            while n < len(key) and tuple(key[: n + 1]) in ref:
                n += 1
            assert m.indices.tolist() == [ref[tuple(key[: i + 1])] for i in range(n)]
            if n and rng.random() < 0.7:
                cache.inc_lock_ref(m.last_node)
                locks.append((m.last_node, tuple(key[:n])))
        elif op < 0.8 and locks:
            node, _ = locks.pop(rng.randrange(len(locks)))
            cache.dec_lock_ref(node)
        else:
            evictable_before = cache.evictable_size()
            want = rng.randint(1, 30)
            freed = cache.evict(want)
            after = tree_contents(cache)
            removed = set(ref) - set(after)
            assert set(after) <= set(ref)
            assert freed == len(removed)
            assert freed >= min(want, evictable_before)
            assert not removed & locked_prefixes()
            ref = {k: v for k, v in ref.items() if k in after}

        cache.check_integrity()
        assert tree_contents(cache) == ref
        assert cache.protected_size() == len(locked_prefixes())
        assert cache.total_size() == len(ref)
        assert alloc.available_size() + cache.total_size() == alloc.size

    for node, _ in locks:
        cache.dec_lock_ref(node)
    cache.evict(10**6)
    assert alloc.available_size() == alloc.size
    assert sorted(alloc.alloc(alloc.size).tolist()) == list(range(1, alloc.size + 1))


def test_random_request_lifecycles_leak_nothing():
    rng = random.Random(99)
    cache, pool, alloc = make_cache(size=90, rows=6, context=64)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(2, 20))] for _ in range(8)]
    live: list[FakeReq] = []
    for _ in range(300):
        if live and rng.random() < 0.5:
            req = rng.choice(live)
            action = rng.random()
            if req.fill_ids != req.origin_input_ids and action < 0.6:  # next prefill chunk
                end = min(len(req.origin_input_ids), len(req.fill_ids) + rng.randint(1, 6))
                step = end - len(req.fill_ids)
                if alloc.available_size() < step:
                    cache.evict(step)
                if alloc.available_size() < step:
                    continue
                req.fill_ids = req.origin_input_ids[:end]
                extend(cache, req, step)
                if req.fill_ids != req.origin_input_ids:
                    cache.cache_unfinished_req(req)
            elif req.fill_ids == req.origin_input_ids and action < 0.6 and len(req.fill_ids) + len(req.output_ids) < 60:
                # decode step
                if alloc.available_size() < 1:
                    cache.evict(1)
                if alloc.available_size() < 1:
                    continue
                if req.output_ids:
                    extend(cache, req, 1)
                req.output_ids.append(rng.randrange(3))
            else:  # finish or abort
                if rng.random() < 0.3 and req.kv_allocated_len < len(req.origin_input_ids) + len(req.output_ids):
                    # allocated but never computed
                    row = pool.req_to_token[req.req_pool_idx]
                    slot = alloc.alloc(1)
                    if slot is not None:
                        row[req.kv_allocated_len] = slot
                        req.kv_allocated_len += 1
                if not req.output_ids:
                    req.output_ids = [0]
                live.remove(req)
                cache.cache_finished_req(req)
        elif pool.available_size():
            prompt = rng.choice(prompts) + [rng.randrange(3) for _ in range(rng.randint(0, 4))]
            first = min(len(prompt), rng.randint(2, 12))
            need = first - len(cache.match_prefix(prompt[: first - 1]).indices)
            if alloc.available_size() < need:
                cache.evict(need - alloc.available_size())
                # The eviction may have taken part of the unlocked prefix too.
                need = first - len(cache.match_prefix(prompt[: first - 1]).indices)
            if alloc.available_size() < need:
                continue
            req = FakeReq(prompt)
            admit(cache, req, first)
            live.append(req)
            if first < len(prompt):
                cache.cache_unfinished_req(req)
        cache.check_integrity()
        assert_no_leak(cache, live)
    for req in list(live):
        if not req.output_ids:
            req.output_ids = [0]
        cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    cache.evict(10**6)
    assert alloc.available_size() == alloc.size and pool.available_size() == pool.size

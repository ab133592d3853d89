"""Waiting-queue ordering of each schedule policy, against a real radix cache."""

import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler.policy import SchedulePolicy
from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams


def make_cache() -> RadixCache:
    allocator = TokenSlotAllocator(1000)
    cache = RadixCache(ReqToTokenPool(8, 128), allocator)
    for key in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9], [20, 21, 22]):
        cache.insert(key, allocator.alloc(len(key)))
    return cache


def req(rid: str, ids: list[int]) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=4), stop_token_ids=set(), sampling_seed=0)


def queue() -> list[Req]:
    return [
        req("none", [50, 51, 52]),
        req("short", [1, 2, 3, 30]),
        req("long", [1, 2, 3, 4, 5, 6, 7, 40]),
        req("other", [20, 21, 22, 23]),
        req("short2", [1, 2, 3, 9, 31]),
    ]


def test_lpm_orders_by_cached_prefix_length():
    order = SchedulePolicy("lpm", make_cache()).order(queue())
    assert [r.rid for r in order] == ["long", "short2", "short", "other", "none"]
    assert [len(r.prefix_indices) for r in order] == [7, 4, 3, 3, 0]


def test_fcfs_keeps_arrival_order_and_still_matches_prefixes():
    q = queue()
    order = SchedulePolicy("fcfs", make_cache()).order(q)
    assert [r.rid for r in order] == [r.rid for r in q]
    assert len(order[2].prefix_indices) == 7


def test_random_is_a_seeded_permutation():
    a = [r.rid for r in SchedulePolicy("random", make_cache(), seed=3).order(queue())]
    b = [r.rid for r in SchedulePolicy("random", make_cache(), seed=3).order(queue())]
    assert a == b and sorted(a) == sorted(r.rid for r in queue())


def test_dfs_weight_keeps_subtrees_together_heaviest_first():
    order = [r.rid for r in SchedulePolicy("dfs-weight", make_cache()).order(queue())]
    # The [1, 2, 3] subtree holds three waiting requests, so all three come before the others.
    assert set(order[:3]) == {"short", "long", "short2"}
    assert set(order[3:]) == {"other", "none"}


def test_prefix_match_never_covers_the_whole_prompt():
    cache = make_cache()
    r = req("exact", [1, 2, 3, 4, 5, 6, 7, 8])
    SchedulePolicy("lpm", cache).order([r])
    assert len(r.prefix_indices) == 7  # one token must run to produce logits
    assert torch.equal(r.prefix_indices, cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).indices)

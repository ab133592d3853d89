"""Prefill admission by priority: online requests before batch-file lines, never mixed into one prefill, and
batch lines admitted in bounded groups."""

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler.policy import SchedulePolicy
from sglang.srt.managers.scheduler.priority import LOW_PRIORITY_PREFILL_TOKENS, PriorityGate, by_priority
from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams


def req(rid: str, n_tokens: int, priority: int) -> Req:
    r = Req(rid, list(range(100, 100 + n_tokens)), SamplingParams(max_new_tokens=4), stop_token_ids=set(),
            sampling_seed=0)
    r.priority = priority
    return r


def ordered(reqs: list[Req]) -> list[Req]:
    cache = RadixCache(ReqToTokenPool(8, 4096), TokenSlotAllocator(10000))
    return by_priority(SchedulePolicy("fcfs", cache).order(reqs))


def admitted(reqs: list[Req]) -> list[str]:
    gate, selected = PriorityGate(), []
    for r in ordered(reqs):
        if not gate.admits(r, selected):
            break
        selected.append(r)
    return [r.rid for r in selected]


def test_online_requests_go_first_and_alone():
    reqs = [req("b0", 40, -1), req("b1", 40, -1), req("o0", 10, 0), req("b2", 40, -1), req("o1", 10, 0)]
    assert [r.rid for r in ordered(reqs)] == ["o0", "o1", "b0", "b1", "b2"]
    assert admitted(reqs) == ["o0", "o1"]


def test_batch_lines_are_admitted_in_bounded_groups():
    per = 60
    reqs = [req(f"b{i}", per, -1) for i in range(20)]
    got = admitted(reqs)
    assert len(got) == LOW_PRIORITY_PREFILL_TOKENS // per
    assert got == [f"b{i}" for i in range(len(got))]
    # One long line still runs on its own rather than starving.
    assert admitted([req("long", 5 * LOW_PRIORITY_PREFILL_TOKENS, -1), req("b", 10, -1)]) == ["long"]

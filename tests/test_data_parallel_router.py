"""The data-parallel router without a server: each balancing method, the prefix index, the dispatcher's routing
and broadcasting, and how N replicas' replies fold into one."""

from __future__ import annotations

import pytest

from sglang.srt.managers.data_parallel import (
    CacheAwareBalancer,
    DataParallelDispatcher,
    PrefixIndex,
    RoundRobinBalancer,
    ShortestQueueBalancer,
    canonical_method,
    make_balancer,
    merge_replies,
)
from sglang.srt.managers.io_struct import (
    AbortReq,
    ExpertDistributionReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    SchedulerInfo,
    SchedulerState,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqOutput,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def test_method_names_and_aliases():
    assert canonical_method("minimum_tokens") == "shortest_queue"
    assert isinstance(make_balancer("cache_aware", 2), CacheAwareBalancer)
    assert isinstance(make_balancer("minimum_tokens", 2), ShortestQueueBalancer)
    with pytest.raises(ValueError, match="--load-balance-method"):
        canonical_method("random")
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerArgs(model_path="m", load_balance_method="nope").validate()
    with pytest.raises(ValueError, match="--dp-size"):
        ServerArgs(model_path="m", dp_size=0).validate()
    with pytest.raises(ValueError, match="each needs at least 16"):
        ServerArgs(model_path="m", dp_size=4, max_total_tokens=32).validate()
    assert "dp_size" not in ServerArgs(model_path="m", dp_size=2).not_applicable_settings()


def test_round_robin_cycles_whatever_the_load():
    b = RoundRobinBalancer(3)
    assert [b.choose([1, 2], [9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_picks_least_loaded_and_rotates_ties():
    b = ShortestQueueBalancer(3)
    assert b.choose([1], [5, 2, 7]) == 1
    assert b.choose([1], [0, 4, 0]) == 2  # the tie after the last pick
    assert b.choose([1], [0, 4, 0]) == 0
    assert [b.choose([1], [0, 0, 0]) for _ in range(3)] == [1, 2, 0]


def test_prefix_index_matches_whole_blocks_and_is_bounded():
    index = PrefixIndex(block_size=4, max_blocks=3)
    index.insert(list(range(10)))  # two full blocks; the tail of two tokens is not indexed
    assert index.match_len(list(range(10))) == 8
    assert index.match_len(list(range(6)) + [99, 99]) == 4
    assert index.match_len([99] + list(range(1, 10))) == 0  # a different first block: nothing matches
    index.insert([50, 51, 52, 53, 54, 55, 56, 57])  # two more blocks: the oldest one is forgotten
    assert len(index) == 3
    assert index.match_len(list(range(10))) == 0
    assert index.match_len([50, 51, 52, 53, 54, 55, 56, 57]) == 8


def test_cache_aware_follows_the_longest_prefix():
    b = CacheAwareBalancer(2, block_size=4)
    group_a, group_b = list(range(100, 140)), list(range(200, 240))
    first_a = b.choose(group_a + [1, 2], [0, 0])
    first_b = b.choose(group_b + [3, 4], [0, 0])
    assert first_a != first_b  # new prefixes go to the least loaded replica, ties taking turns
    for i in range(5):
        assert b.choose(group_a + [10 + i], [3, 3]) == first_a
        assert b.choose(group_b + [20 + i], [3, 3]) == first_b
    # A short match (under half the prompt) does not pull: the least loaded replica wins.
    loads = [0, 0]
    loads[first_a] = 5
    assert b.choose(group_a[:8] + list(range(500, 540)), loads) == 1 - first_a


def test_cache_aware_gives_way_to_balance():
    b = CacheAwareBalancer(2, block_size=4, balance_abs=4, balance_rel=1.5)
    prompt = list(range(64))
    home = b.choose(prompt, [0, 0])
    loads = [0, 0]
    loads[home] = 10  # far busier than the other replica: the prefix no longer decides
    assert b.choose(prompt, loads) == 1 - home
    b.reset()
    assert all(len(index) == 0 for index in b.indexes)


class _Socket:
    def __init__(self) -> None:
        self.sent: list = []

    def send_pyobj(self, obj) -> None:
        self.sent.append(obj)


def _req(rid: str, ids: list[int]) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=ids, sampling_params=SamplingParams())


def test_dispatcher_routes_requests_and_broadcasts_control():
    sockets = [_Socket(), _Socket()]
    live: set[str] = set()
    d = DataParallelDispatcher(sockets, ShortestQueueBalancer(2), live.__contains__)
    for rid in ("a", "b", "c"):
        live.add(rid)
        d.send_pyobj(_req(rid, [1, 2, 3]))
    assert [[r.rid for r in s.sent] for s in sockets] == [["a", "c"], ["b"]]
    assert d.loads() == [2, 1]
    live.discard("a")
    live.discard("c")  # finished: the router forgets them, replica 0 is now the idle one
    assert d.loads() == [0, 1]
    live.add("d")
    d.send_pyobj(_req("d", [1]))
    assert sockets[0].sent[-1].rid == "d"
    d.send_pyobj(AbortReq(rid="d"))
    assert all(isinstance(s.sent[-1], AbortReq) for s in sockets)
    assert d.routed == [3, 1]


def test_dispatcher_flush_forgets_the_prefix_index():
    b = CacheAwareBalancer(2, block_size=4)
    d = DataParallelDispatcher([_Socket(), _Socket()], b, lambda rid: True)
    d.send_pyobj(_req("x", list(range(32))))
    assert sum(len(i) for i in b.indexes) == 8
    d.send_pyobj(FlushCacheReq())
    assert sum(len(i) for i in b.indexes) == 0


def _state(load: int, capacity: int, hit: float) -> SchedulerState:
    info = SchedulerInfo(max_total_num_tokens=capacity, max_req_input_len=capacity - 8, max_running_requests=16,
                         context_len=2048, weight_bytes=100, kv_bytes=capacity * 10)
    return SchedulerState(info=info, last_gen_throughput=1.0, num_running_reqs=1, num_queue_reqs=2,
                          num_grammar_queue_reqs=0, num_jump_forward_tokens=0, token_usage=load / capacity,
                          used_kv_tokens=load, cache_hit_rate=hit, evictable_size=3, free_kv_tokens=capacity - load,
                          invariant_error=None, load=load)


def test_replies_fold_into_one():
    assert merge_replies([FlushCacheReqOutput(True), FlushCacheReqOutput(True)]).success
    assert not merge_replies([FlushCacheReqOutput(True), FlushCacheReqOutput(False)]).success
    ok = UpdateWeightFromDiskReqOutput(True, "Succeeded to update model weights.")
    failed = merge_replies([ok, UpdateWeightFromDiskReqOutput(False, "bad shape")])
    assert not failed.success and failed.message == "1 of 2 replicas failed: bad shape"
    assert merge_replies([ok, ok]) == ok
    dumped = merge_replies([ExpertDistributionReqOutput(True, "/tmp/a.pt"), ExpertDistributionReqOutput(True, "/b")])
    assert dumped.success and dumped.message == "/tmp/a.pt"
    state = merge_replies([GetInternalStateReqOutput(_state(10, 100, 0.5)),
                           GetInternalStateReqOutput(_state(30, 300, 0.1))]).state
    assert (state.load, state.used_kv_tokens, state.num_queue_reqs) == (40, 40, 4)
    assert state.info.max_total_num_tokens == 400 and state.info.max_req_input_len == 92
    assert state.info.max_running_requests == 32
    assert state.token_usage == pytest.approx(0.1) and state.cache_hit_rate == pytest.approx(0.3)


def test_each_replica_gets_its_share_and_its_own_input_socket():
    from sglang.srt.entrypoints.replicas import replica_port_args, replica_server_args
    from sglang.srt.server_args import PortArgs

    args = ServerArgs(model_path="m", device="cpu", dp_size=2, max_total_tokens=8192, mem_fraction_static=0.3)
    share = replica_server_args(args)
    assert (share.max_total_tokens, share.mem_fraction_static) == (4096, 0.15)
    assert share.num_threads is not None and share.num_threads >= 1
    assert replica_server_args(ServerArgs(model_path="m", device="cpu", dp_size=2, num_threads=3)).num_threads == 3
    single = ServerArgs(model_path="m", device="cpu")
    assert replica_server_args(single) is single
    ports = PortArgs("ipc:///x/tok", "ipc:///x/sched", "ipc:///x/detok")
    assert replica_port_args(ports, 0, 1) == ports
    names = [replica_port_args(ports, r, 2) for r in range(2)]
    assert [p.scheduler_input_ipc_name for p in names] == ["ipc:///x/sched-0", "ipc:///x/sched-1"]
    assert {p.detokenizer_ipc_name for p in names} == {"ipc:///x/detok"}  # one shared detokenizer


def test_control_gathers_one_reply_per_replica_even_after_a_caller_gives_up():
    import asyncio

    from sglang.srt.managers.control_channel import ControlChannel

    sent: list = []
    channel = ControlChannel(sent.append, replicas=2, ensure_receiving=lambda: None)

    async def scenario() -> None:
        first = asyncio.ensure_future(channel.request(FlushCacheReq(), FlushCacheReqOutput))
        await asyncio.sleep(0)
        channel.deliver(FlushCacheReqOutput(False))
        first.cancel()  # the caller gives up with one of its two replies still to come
        second = asyncio.ensure_future(channel.request(FlushCacheReq(), FlushCacheReqOutput))
        await asyncio.sleep(0)
        assert len(sent) == 1  # the second exchange waits for the first one's last reply
        channel.deliver(FlushCacheReqOutput(False))
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(sent) == 2
        channel.deliver(FlushCacheReqOutput(True))
        channel.deliver(FlushCacheReqOutput(True))
        assert (await second).success  # neither stale failure reached it

    asyncio.run(scenario())

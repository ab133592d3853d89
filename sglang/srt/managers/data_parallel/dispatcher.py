"""The tokenizer manager's link to N scheduler replicas: route each request to one, send control to all.

`DataParallelDispatcher` stands in for the manager's single PUSH socket (it has the same `send_pyobj`), so the
request paths (generate, embedding, abort) need no change: a tokenized request goes to the replica the balancer
picks, and every other message (abort, flush, weight update, internal state, expert recording) reaches every
replica. The replies of a broadcast come back through the shared detokenizer; `merge_replies` folds the N of
them into the one reply the callers expect.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from sglang.srt.managers.data_parallel.balancer import LoadBalancer
from sglang.srt.managers.io_struct import (
    ExpertDistributionReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    GetWeightsByNameReqOutput,
    SchedulerInfo,
    SchedulerState,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqOutput,
)

logger = logging.getLogger(__name__)


def check_data_parallel_rank(rank: Any, dp_size: int) -> None:
    """ValueError (a 400 naming the field) unless `rank` is None or a replica index of this server."""
    if rank is None:
        return
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp_size:
        raise ValueError(f"data_parallel_rank must be an integer in [0, {dp_size - 1}] (the server runs "
                         f"--dp-size {dp_size}), got {rank!r}.")


class DataParallelDispatcher:
    def __init__(self, sockets: Sequence[Any], balancer: LoadBalancer, is_live: Callable[[str], bool]) -> None:
        """`sockets[i]` pushes to replica i; `is_live(rid)` tells whether a routed request is still in flight
        (the manager drops a request's state when it ends, which is how the router learns of finished work)."""
        self.sockets = list(sockets)
        self.balancer = balancer
        self.is_live = is_live
        self.in_flight: dict[str, int] = {}  # rid -> replica
        self.routed = [0] * len(self.sockets)  # requests ever sent to each replica

    def loads(self) -> list[int]:
        """Requests in flight per replica, after forgetting the ones that ended."""
        for rid in [r for r in self.in_flight if not self.is_live(r)]:
            del self.in_flight[rid]
        counts = [0] * len(self.sockets)
        for replica in self.in_flight.values():
            counts[replica] += 1
        return counts

    def send_pyobj(self, obj: Any) -> None:
        if isinstance(obj, (TokenizedGenerateReqInput, TokenizedEmbeddingReqInput)):
            hint = getattr(obj, "data_parallel_rank", None)
            if hint is not None:  # the client chose the replica (validated by the tokenizer manager)
                replica = hint
                self.balancer.record(replica, obj.input_ids)
            else:
                replica = self.balancer.choose(obj.input_ids, self.loads())
            self.in_flight[obj.rid] = replica
            self.routed[replica] += 1
            self.sockets[replica].send_pyobj(obj)
            return
        if isinstance(obj, FlushCacheReq):
            # The replicas drop their prefix caches: what the router remembers of them is void too.
            self.balancer.reset()
        for sock in self.sockets:
            sock.send_pyobj(obj)

    def close(self, linger: int = 0) -> None:
        for sock in self.sockets:
            sock.close(linger=linger)


def merge_infos(infos: Sequence[SchedulerInfo]) -> SchedulerInfo:
    """The server-wide view of N replicas' startup reports: capacities add up, a prompt must fit any replica."""
    first = infos[0]
    return dataclasses.replace(
        first,
        max_total_num_tokens=sum(i.max_total_num_tokens for i in infos),
        max_req_input_len=min(i.max_req_input_len for i in infos),
        max_running_requests=sum(i.max_running_requests for i in infos),
        weight_bytes=sum(i.weight_bytes for i in infos),
        kv_bytes=sum(i.kv_bytes for i in infos),
        weights={name: sum(i.weights.get(name, 0) for i in infos) for name in first.weights},
    )


def merge_states(states: Sequence[SchedulerState]) -> SchedulerState:
    """One state for the whole server (what /get_load, /metrics and Engine.get_internal_state report)."""
    if len(states) == 1:
        return states[0]
    info = merge_infos([s.info for s in states])
    used = sum(s.used_kv_tokens for s in states)
    errors = [s.invariant_error for s in states if s.invariant_error]
    return SchedulerState(
        info=info,
        last_gen_throughput=sum(s.last_gen_throughput for s in states),
        num_running_reqs=sum(s.num_running_reqs for s in states),
        num_queue_reqs=sum(s.num_queue_reqs for s in states),
        num_grammar_queue_reqs=sum(s.num_grammar_queue_reqs for s in states),
        num_jump_forward_tokens=sum(s.num_jump_forward_tokens for s in states),
        token_usage=used / max(1, info.max_total_num_tokens),
        used_kv_tokens=used,
        # The replicas report rates without their prompt counts: the plain mean is the best estimate.
        cache_hit_rate=sum(s.cache_hit_rate for s in states) / len(states),
        evictable_size=sum(s.evictable_size for s in states),
        free_kv_tokens=sum(s.free_kv_tokens for s in states),
        free_window_kv_tokens=sum(s.free_window_kv_tokens for s in states),
        invariant_error="; ".join(errors) if errors else None,
        load=sum(s.load for s in states),
    )


def merge_replies(replies: Sequence[Any]) -> Any:
    """Fold one reply per replica into one: an action succeeds only where it succeeded on every replica."""
    first = replies[0]
    if len(replies) == 1:
        return first
    if isinstance(first, FlushCacheReqOutput):
        return FlushCacheReqOutput(all(r.success for r in replies))
    if isinstance(first, (UpdateWeightFromDiskReqOutput, ExpertDistributionReqOutput)):
        failed = [r.message for r in replies if not r.success]
        if failed:
            reasons = list(dict.fromkeys(failed))
            if len(failed) == len(replies) and len(reasons) == 1:
                # Every replica refused for the same reason (a wrong path): the single-replica answer, verbatim.
                return type(first)(False, reasons[0])
            # Replies carry no replica id; identical messages are said once.
            return type(first)(False, f"{len(failed)} of {len(replies)} replicas failed: {'; '.join(reasons)}")
        if len(set(r.message for r in replies)) > 1:
            # A dump writes one file per replica; the first is the answer, the others are logged.
            logger.info("Replica replies: %s", [r.message for r in replies])
        return first
    if isinstance(first, GetInternalStateReqOutput):
        return GetInternalStateReqOutput(merge_states([r.state for r in replies]))
    if isinstance(first, GetWeightsByNameReqOutput):
        # Every replica holds the same weights; one that found the parameter answers for all.
        return next((r for r in replies if r.parameter is not None), first)
    return first

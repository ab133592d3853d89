"""Data parallelism: N scheduler replicas behind one tokenizer manager (--dp-size, --load-balance-method)."""

from sglang.srt.managers.data_parallel.balancer import (
    LOAD_BALANCE_METHODS,
    CacheAwareBalancer,
    LoadBalancer,
    PrefixIndex,
    RoundRobinBalancer,
    ShortestQueueBalancer,
    canonical_method,
    make_balancer,
)
from sglang.srt.managers.data_parallel.dispatcher import (
    DataParallelDispatcher,
    merge_infos,
    merge_replies,
    merge_states,
)

__all__ = [
    "LOAD_BALANCE_METHODS", "CacheAwareBalancer", "DataParallelDispatcher", "LoadBalancer", "PrefixIndex",
    "RoundRobinBalancer", "ShortestQueueBalancer", "canonical_method", "make_balancer", "merge_infos",
    "merge_replies", "merge_states",
]

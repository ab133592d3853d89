"""Load-balancing methods of the data-parallel router: which replica runs a new request.

Pure logic (no sockets, no processes), so every method is unit-testable. A balancer sees the prompt's token ids
and the router's own count of requests in flight per replica; it never asks the replicas, because a round trip
per request would cost more than the balancing gains.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
# Upstream names accepted for the same method.
LOAD_BALANCE_ALIASES = {"minimum_tokens": "shortest_queue"}


def canonical_method(name: str) -> str:
    """The method `name` selects; ValueError naming the flag when it is none of them."""
    method = LOAD_BALANCE_ALIASES.get(name, name)
    if method not in LOAD_BALANCE_METHODS:
        choices = ", ".join(LOAD_BALANCE_METHODS + tuple(LOAD_BALANCE_ALIASES))
        raise ValueError(f"--load-balance-method must be one of {choices}; got {name!r}")
    return method


class LoadBalancer(ABC):
    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.num_replicas = num_replicas
        # Rotates ties so that equally loaded replicas take turns instead of the first taking everything.
        self._next = 0

    @abstractmethod
    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a request with prompt `input_ids`; `loads[i]`: requests in flight on replica i."""

    def record(self, replica: int, input_ids: Sequence[int]) -> None:  # noqa: B027 (cache-aware only)
        """A request was sent to `replica` without asking (a data_parallel_rank hint)."""

    def reset(self) -> None:  # noqa: B027 (only the cache-aware method remembers anything)
        """Forget what the replicas cache (their prefix caches were flushed)."""

    def _least_loaded(self, loads: Sequence[int], among: Sequence[int] | None = None) -> int:
        candidates = list(range(self.num_replicas)) if among is None else list(among)
        low = min(loads[i] for i in candidates)
        ties = [i for i in candidates if loads[i] == low]
        # The first tie at or after the rotating pointer.
        pick = min(ties, key=lambda i: (i - self._next) % self.num_replicas)
        self._next = (pick + 1) % self.num_replicas
        return pick


class RoundRobinBalancer(LoadBalancer):
    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        pick = self._next
        self._next = (pick + 1) % self.num_replicas
        return pick


class ShortestQueueBalancer(LoadBalancer):
    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        return self._least_loaded(loads)


class PrefixIndex:
    """An approximate, bounded index of the token prefixes one replica has seen.

    Prompts are cut into blocks of `block_size` tokens; each block is keyed by a hash chained over all blocks
    before it, so a key stands for a whole prefix (the radix tree's path, flattened). The keys live in an LRU of
    at most `max_blocks` entries: the oldest prefixes are forgotten first, as the replica's own cache would evict
    them. Forgetting an inner block only shortens later matches, so the index stays a safe under-estimate.
    """

    def __init__(self, block_size: int = 16, max_blocks: int = 1 << 16) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, input_ids: Sequence[int]) -> list[int]:
        keys, key, b = [], 0, self.block_size
        for start in range(0, len(input_ids) - b + 1, b):
            # Tuples of ints hash deterministically (no per-process salt), and the chain makes a key a prefix.
            key = hash((key, tuple(input_ids[start:start + b])))
            keys.append(key)
        return keys

    def match_len(self, input_ids: Sequence[int]) -> int:
        """Tokens of the longest indexed prefix of `input_ids` (a multiple of the block size)."""
        n = 0
        for key in self._keys(input_ids):
            if key not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def insert(self, input_ids: Sequence[int]) -> None:
        for key in self._keys(input_ids):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class CacheAwareBalancer(LoadBalancer):
    """Send a request where its prefix is likely cached, unless that would overload a replica.

    As upstream's cache-aware router: when the loads are out of balance (the busiest replica has more than
    `balance_abs` requests more than the idlest and more than `balance_rel` times as many) the least loaded
    replica wins; otherwise the replica with the longest matching prefix wins when the match covers at least
    `match_threshold` of the prompt (and one block); otherwise the least loaded replica.
    """

    def __init__(self, num_replicas: int, match_threshold: float = 0.5, balance_abs: int = 32,
                 balance_rel: float = 1.5, block_size: int = 16, max_blocks_per_replica: int = 1 << 16) -> None:
        super().__init__(num_replicas)
        self.match_threshold = match_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.indexes = [PrefixIndex(block_size, max_blocks_per_replica) for _ in range(num_replicas)]

    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        pick = self._pick(input_ids, loads)
        self.indexes[pick].insert(input_ids)
        return pick

    def _pick(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            return self._least_loaded(loads)
        matches = [index.match_len(input_ids) for index in self.indexes]
        best = max(matches)
        needed = max(self.indexes[0].block_size, self.match_threshold * len(input_ids))
        if best > 0 and best >= needed:
            return self._least_loaded(loads, [i for i, m in enumerate(matches) if m == best])
        return self._least_loaded(loads)

    def record(self, replica: int, input_ids: Sequence[int]) -> None:
        self.indexes[replica].insert(input_ids)

    def reset(self) -> None:
        for index in self.indexes:
            index.clear()


def make_balancer(method: str, num_replicas: int) -> LoadBalancer:
    method = canonical_method(method)
    if method == "round_robin":
        return RoundRobinBalancer(num_replicas)
    if method == "shortest_queue":
        return ShortestQueueBalancer(num_replicas)
    return CacheAwareBalancer(num_replicas)

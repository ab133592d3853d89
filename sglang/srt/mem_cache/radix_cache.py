"""RadixAttention prefix cache: a radix tree from token sequences to the KV slots that hold them.

Requests whose prompts share a prefix reuse the prefix's KV slots instead of recomputing them.
Nodes on a running request's prefix path are locked (lock_ref > 0) and never evicted; unlocked
leaves are evicted least recently used first when the allocator runs short.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.lora.cache_key import prefix_key
from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots holding them."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access_time")

    def __init__(
        self,
        key: Optional[list[int]] = None,
        value: Optional[torch.Tensor] = None,
        parent: Optional[TreeNode] = None,
    ) -> None:
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        # Keyed by the first token of the child's key: siblings never share a first token.
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = 0

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


# Where a node's slots stand, for subclasses that keep counts per slot (_node_state_changed).
OUTSIDE, UNLOCKED, LOCKED = 0, 1, 2


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    """Prefix cache over KV slots, shared by every request whose tokens start the same way."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenSlotAllocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.device = allocator.device
        # A logical clock rather than wall time: equal timestamps would make LRU order arbitrary.
        self._clock = itertools.count(1)
        self.reset()

    # ---- tree state -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every node. The slots they held are not freed here: callers clear the allocator too."""
        self.root_node = TreeNode(value=self._empty_indices())
        self.root_node.lock_ref = 1  # the root is never evicted nor counted
        self._evictable_size = 0
        self._protected_size = 0

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- lookups and inserts --------------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key`. A match that ends inside a node splits that node, so
        the returned last_node covers exactly the matched tokens and can be locked on its own."""
        if not key:
            return MatchResult(self._empty_indices(), self.root_node)
        now = next(self._clock)
        node = self.root_node
        node.last_access_time = now
        pieces: list[torch.Tensor] = []
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access_time = now
            matched = _common_prefix_len(child.key, key)
            if matched < len(child.key):
                node = self._split_node(child, matched)
                pieces.append(node.value)
                break
            pieces.append(child.value)
            node = child
            key = key[matched:]
        indices = torch.cat(pieces) if pieces else self._empty_indices()
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Store `value[i]` as the slot of `key[i]`; returns how many leading tokens were already cached.

        For those, the tree keeps its own slots and the caller's copies (value[:returned]) remain the
        caller's to free.
        """
        if len(key) != len(value):
            raise ValueError(f"key has {len(key)} tokens but value has {len(value)} slots")
        # A private copy: callers often pass a view of a req_to_token row that is reused later.
        value = value.detach().to(device=self.device, dtype=torch.int64).clone()
        now = next(self._clock)
        node = self.root_node
        node.last_access_time = now
        already_cached = 0
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access_time = now
            matched = _common_prefix_len(child.key, key)
            if matched < len(child.key):
                child = self._split_node(child, matched)
            already_cached += matched
            key = key[matched:]
            value = value[matched:]
            node = child
        if key:
            leaf = TreeNode(list(key), value, parent=node)
            leaf.last_access_time = now
            node.children[key[0]] = leaf
            self._evictable_size += len(key)
            self._node_state_changed(leaf, OUTSIDE, UNLOCKED)
        return already_cached

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` tokens; returns the new upper part, which takes child's place."""
        upper = TreeNode(child.key[:split_len], child.value[:split_len], parent=child.parent)
        # Whoever locked child locked the whole path through it, the upper part included.
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[child.key[0]] = child
        upper.parent.children[upper.key[0]] = upper
        return upper

    # ---- locking --------------------------------------------------------------------------------------
    def inc_lock_ref(self, node: Optional[TreeNode]) -> None:
        if node is None:
            return
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                self._node_state_changed(node, UNLOCKED, LOCKED)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Optional[TreeNode]) -> None:
        if node is None:
            return
        while node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlocking {node}, which is not locked")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                self._node_state_changed(node, LOCKED, UNLOCKED)
            node.lock_ref -= 1
            node = node.parent

    def _node_state_changed(self, node: TreeNode, old: int, new: int) -> None:
        """A node's slots went from `old` to `new` (OUTSIDE / UNLOCKED / LOCKED): inserted, locked, unlocked or
        evicted (after its slots were freed). Splitting a node changes no slot's state."""

    # ---- eviction -------------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible, least recently used unlocked leaves first.

        Returns how many slots were freed (whole nodes go, so it may exceed `num_tokens`).
        """
        if num_tokens <= 0:
            return 0
        tie = itertools.count()
        heap = [(leaf.last_access_time, next(tie), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        self.allocator.free_group_begin()
        try:
            while freed < num_tokens and heap:
                _, _, leaf = heapq.heappop(heap)
                self.allocator.free(leaf.value)
                self._node_state_changed(leaf, UNLOCKED, OUTSIDE)
                freed += len(leaf.key)
                self._evictable_size -= len(leaf.key)
                parent = leaf.parent
                del parent.children[leaf.key[0]]
                leaf.parent = None
                if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access_time, next(tie), parent))
        finally:
            self.allocator.free_group_end()
        return freed

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    # ---- request hand-off -----------------------------------------------------------------------------
    def cache_finished_req(self, req: Req) -> None:
        """Give a finished (or aborted, or retracted) request's KV to the tree and free its row."""
        row = req.req_pool_idx
        table_row = self.req_to_token_pool.req_to_token[row]
        allocated = req.kv_allocated_len

        # The last output token never ran through the model, so it has no K/V; and slots that were
        # allocated but never computed (request stopped mid-step) must not be shared.
        token_ids = prefix_key(req, (list(req.origin_input_ids) + list(req.output_ids))[:-1])
        cached_len = min(len(token_ids), allocated, req.kv_committed_len)
        protected = self._protected_len(req)
        kv = table_row[:allocated].clone()

        new_prefix_len = self.insert(token_ids[:cached_len], kv[:cached_len])
        # Slots the tree already had its own copies of are our duplicates.
        self.allocator.free(kv[protected:new_prefix_len])
        self.allocator.free(kv[max(cached_len, protected):])
        self.req_to_token_pool.free(row)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: move the request's computed KV into the tree and lock it there."""
        row = req.req_pool_idx
        token_ids = prefix_key(req, list(req.fill_ids))
        kv = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
        protected = self._protected_len(req)

        new_prefix_len = self.insert(token_ids, kv)
        self.allocator.free(kv[protected:new_prefix_len])

        match = self.match_prefix(token_ids)
        new_indices = match.indices
        if len(new_indices) != len(token_ids):
            raise RuntimeError(f"inserted {len(token_ids)} tokens but only {len(new_indices)} match")
        self.req_to_token_pool.req_to_token[row, : len(new_indices)] = new_indices
        # Lock the new path before unlocking the old one so the shared part never looks evictable.
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = match.last_node
        req.cache_protected_len = len(new_indices)

    @staticmethod
    def _protected_len(req: Req) -> int:
        # The matched prefix belongs to the tree from admission on, even while cache_protected_len
        # still says 0 (it is only raised once a prefill chunk has been cached).
        return max(req.cache_protected_len, len(req.prefix_indices))

    # ---- checks ---------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert that the size counters and tree links agree with a full walk of the tree."""
        evictable = protected = 0
        values = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            for first_token, child in node.children.items():
                assert child.parent is node, f"{child} has a wrong parent"
                assert child.key and child.key[0] == first_token, f"{child} is filed under {first_token}"
                assert len(child.key) == len(child.value), f"{child}: key/value lengths differ"
                assert child.lock_ref >= 0, f"{child} has a negative lock_ref"
                if node is not self.root_node:
                    assert child.lock_ref <= node.lock_ref, f"{child} is locked more than its parent"
                if child.lock_ref:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                values.append(child.value)
                stack.append(child)
        assert self.root_node.lock_ref == 1, "the root lost its lock"
        assert evictable == self._evictable_size, f"evictable {self._evictable_size} != walked {evictable}"
        assert protected == self._protected_size, f"protected {self._protected_size} != walked {protected}"
        if values:
            slots = torch.cat(values)
            assert len(torch.unique(slots)) == len(slots), "a KV slot is held by two tree positions"
            assert int(slots.min()) >= 1 and int(slots.max()) <= self.allocator.size, "slot out of range"

    def _empty_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

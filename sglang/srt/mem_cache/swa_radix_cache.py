"""The radix cache over hybrid sliding-window memory (mem_cache/swa_pool.py).

The tree keeps full slots, as RadixCache does; some of its tokens may have given their window slots back (tokens
a request had moved past when it finished). A prefix is reusable only if the window layers can still see what its
next token needs: the K/V of its last `window` tokens. `match_prefix` returns the longest such prefix of the
stored match (a shorter one, never wrong K/V). Evicting a node frees both slot kinds (SWASlotAllocator.free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool
from sglang.srt.mem_cache.swa_pool import SWASlotAllocator

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def usable_prefix_len(has_window: torch.Tensor, window: int) -> int:
    """The longest n <= len(has_window) whose last `window` tokens (all of them when n < window) all hold window
    K/V, given a bool per token of the prefix."""
    n = has_window.shape[0]
    if n == 0 or bool(has_window[-min(n, window):].all()):
        return n
    missing = torch.cat([has_window.new_zeros(1, dtype=torch.int64), (~has_window).to(torch.int64).cumsum(0)])
    ends = torch.arange(n + 1, device=has_window.device)
    starts = (ends - window).clamp(min=0)
    usable = (missing[ends] - missing[starts]) == 0
    return int(usable.nonzero()[-1])


class SWARadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWASlotAllocator, window: int) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.swa_allocator = allocator
        # Bumped by every change to the tree or its locks: window_evictable_size is cached against it.
        self._version = 0
        self._window_evictable: Optional[tuple[tuple[int, int], int]] = None
        self._whole_matches = False
        super().__init__(req_to_token_pool, allocator)

    def reset(self) -> None:
        super().reset()
        self._version += 1

    def match_prefix(self, key: list[int]) -> MatchResult:
        match = super().match_prefix(key)
        if self._whole_matches:
            return match
        usable = usable_prefix_len(self.swa_allocator.has_window(match.indices), self.window)
        if usable == len(match.indices):
            return match
        # matched again, shorter: the split lands at the usable end, so last_node covers exactly that prefix
        return super().match_prefix(key[:usable])

    def cache_unfinished_req(self, req: Req) -> None:
        # The request's own row already holds every window K/V its next chunk reads (nothing within its reach gives
        # its window slot back), so it takes back the whole of what it just stored.
        self._whole_matches = True
        try:
            super().cache_unfinished_req(req)
        finally:
            self._whole_matches = False

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        cached = super().insert(key, value)
        if cached:
            self._adopt_window_slots(key[:cached], value[:cached])
        self._version += 1
        return cached

    def _adopt_window_slots(self, key: list[int], value: torch.Tensor) -> None:
        """The tree kept its own slots for these tokens and the caller frees its copies. Where a tree token has lost
        its window slot and the caller's copy still holds one, the tree takes that window slot over: the same token
        at the same position after the same prefix, hence the same K/V (so a chunked request whose row now points at
        the tree's slots still sees its window)."""
        tree_slots = super().match_prefix(key).indices
        mine = value.to(device=self.device, dtype=torch.int64)
        table = self.swa_allocator.full_to_window
        theirs, my_window = table[tree_slots], table[mine]
        move = (theirs == 0) & (my_window > 0) & (tree_slots != mine)
        if bool(move.any()):
            table[tree_slots[move]] = my_window[move]
            table[mine[move]] = 0

    def inc_lock_ref(self, node: Optional[TreeNode]) -> None:
        super().inc_lock_ref(node)
        self._version += 1

    def dec_lock_ref(self, node: Optional[TreeNode]) -> None:
        super().dec_lock_ref(node)
        self._version += 1

    def evict(self, num_tokens: int) -> int:
        freed = super().evict(num_tokens)
        self._version += 1
        return freed

    def window_evictable_size(self) -> int:
        """Window slots that evicting every unlocked node would free."""
        stamp = (self._version, self.swa_allocator.window_changes)
        if self._window_evictable is None or self._window_evictable[0] != stamp:
            self._window_evictable = (stamp, self._window_slots_of([n for n in self._nodes() if n.lock_ref == 0]))
        return self._window_evictable[1]

    def window_slots_held(self) -> int:
        """Window slots held by tree tokens, locked or not."""
        return self._window_slots_of(self._nodes())

    def _window_slots_of(self, nodes: list[TreeNode]) -> int:
        if not nodes:
            return 0
        return int(self.swa_allocator.has_window(torch.cat([node.value for node in nodes])).sum())

    def _nodes(self) -> list[TreeNode]:
        nodes: list[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

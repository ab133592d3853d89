"""The radix cache over hybrid sliding-window memory (mem_cache/swa_pool.py).

The tree keeps full slots, as RadixCache does; some of its tokens may have given their window slots back (tokens
a request had moved past when it finished). A prefix is reusable only if the window layers can still see what its
next token needs: the K/V of its last `window` tokens. `match_prefix` returns the longest such prefix of the
stored match (a shorter one, never wrong K/V). Evicting a node frees both slot kinds (SWASlotAllocator.free).

The scheduler asks on every step how many window slots evicting would free (MemoryPools.available_tokens), so
the tree keeps that count, and the count of window slots its tokens hold, as it changes: each full slot's place
(outside the tree, in an unlocked node, in a locked one) in a table; nodes entering, leaving, locked or unlocked
move their window-holding slots between the counts, and a window slot given back or taken over moves one slot.
`window_count_error` checks both counts against a walk of the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.radix_cache import LOCKED, OUTSIDE, UNLOCKED, RadixCache, TreeNode
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
        # OUTSIDE / UNLOCKED / LOCKED per full slot (0 is the dummy slot)
        self._slot_state = torch.zeros(allocator.size + 1, dtype=torch.int8, device=allocator.device)
        self._window_held = 0  # window slots held by tree tokens
        self._window_evictable = 0  # ... by tokens of unlocked nodes
        self._whole_matches = False
        super().__init__(req_to_token_pool, allocator)
        allocator.on_window_freed = self._window_slots_gone

    def reset(self) -> None:
        super().reset()
        self._slot_state.zero_()
        self._window_held = self._window_evictable = 0

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
            self._count_window_slots(tree_slots[move], 1)
            self._count_window_slots(mine[move], -1)

    # ---- the kept counts ------------------------------------------------------------------------------
    def _node_state_changed(self, node: TreeNode, old: int, new: int) -> None:
        self._slot_state[node.value] = new
        held = int(self.swa_allocator.has_window(node.value).sum())
        self._window_held += held * ((new != OUTSIDE) - (old != OUTSIDE))
        self._window_evictable += held * ((new == UNLOCKED) - (old == UNLOCKED))

    def _window_slots_gone(self, slots: torch.Tensor) -> None:
        """The allocator took the window slots of full slots `slots` back."""
        self._count_window_slots(slots, -1)

    def _count_window_slots(self, slots: torch.Tensor, sign: int) -> None:
        """Full slots `slots` each gained (sign 1) or lost (-1) a window slot: count those of the tree."""
        if slots.numel() == 0:
            return
        state = self._slot_state[slots]
        self._window_held += sign * int((state != OUTSIDE).sum())
        self._window_evictable += sign * int((state == UNLOCKED).sum())

    def window_evictable_size(self) -> int:
        """Window slots that evicting every unlocked node would free."""
        return self._window_evictable

    def window_slots_held(self) -> int:
        """Window slots held by tree tokens, locked or not."""
        return self._window_held

    def window_count_error(self) -> Optional[str]:
        """Where the kept counts (and slot places) disagree with a walk of the tree, or None."""
        nodes = self._nodes()
        unlocked = [n for n in nodes if n.lock_ref == 0]
        walked = (self._window_slots_of(nodes), self._window_slots_of(unlocked))
        if walked != (self._window_held, self._window_evictable):
            return (f"window counts drifted: held {self._window_held} (walk {walked[0]}), evictable "
                    f"{self._window_evictable} (walk {walked[1]})")
        places = torch.zeros_like(self._slot_state)
        for place, group in ((UNLOCKED, unlocked), (LOCKED, [n for n in nodes if n.lock_ref])):
            if group:
                places[torch.cat([n.value for n in group])] = place
        wrong = int((places != self._slot_state).sum())
        return f"{wrong} full slots have the wrong place in the tree" if wrong else None

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

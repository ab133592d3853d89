"""Waiting-queue ordering: lpm (longest prefix match), fcfs, random, dfs-weight."""

from __future__ import annotations

import random
from collections import defaultdict

from sglang.srt.lora.cache_key import prefix_key
from sglang.srt.managers.schedule_batch import Req

# Past this queue length, prefix matching every request each step costs more than it saves.
LPM_FALLBACK_QUEUE_LEN = 128


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache, seed: int = 0) -> None:
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)

    def match_prefix(self, req: Req) -> None:
        req.init_next_round_input()
        key = prefix_key(req, req.fill_ids[: req.max_prefix_len()])
        match = self.tree_cache.match_prefix(key)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    def order(self, waiting: list[Req]) -> list[Req]:
        """Compute every request's cached prefix and return the queue in admission order."""
        for req in waiting:
            self.match_prefix(req)
        policy = self.policy
        if policy == "lpm" and len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            policy = "fcfs"
        if policy == "lpm":
            return sorted(waiting, key=lambda r: -len(r.prefix_indices))  # stable: FCFS among equals
        if policy == "random":
            shuffled = list(waiting)
            self.rng.shuffle(shuffled)
            return shuffled
        if policy == "dfs-weight":
            return self._dfs_weight(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda r: -r.sampling_params.max_new_tokens if
                          r.sampling_params.max_new_tokens is not None else 0)
        return list(waiting)

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        """Visit the radix tree depth-first, heaviest subtree (most waiting requests) first, so requests that
        share a prefix run together."""
        by_node: dict = defaultdict(list)
        for req in waiting:
            by_node[id(req.last_node)].append(req)
        weight: dict = defaultdict(int)
        nodes = {}
        for req in waiting:
            node = req.last_node
            while node is not None:
                weight[id(node)] += 1
                nodes[id(node)] = node
                node = node.parent
        out: list[Req] = []

        def visit(node) -> None:
            # Post-order: deeper (longer shared prefix) requests of a subtree before the node's own.
            children = [c for c in node.children.values() if id(c) in weight]
            for child in sorted(children, key=lambda c: -weight[id(c)]):
                visit(child)
            out.extend(by_node.get(id(node), []))

        visit(self.tree_cache.root_node)
        seen = {id(r) for r in out}
        out.extend(r for r in waiting if id(r) not in seen)
        return out

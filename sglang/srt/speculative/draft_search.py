"""Draft trees from a draft model or EAGLE head (--speculative-eagle-topk above 1), as SGLang's EAGLE drafts them.

From the root (the request's last token) the draft's top-k tokens are the first beams. Each further step runs every
beam's token through the draft in one forward and scores its top-k children (a node's score: the sum of the draft's
log-probabilities along its path); the k best children of the step are its new beams. After
--speculative-num-steps steps the tree keeps the `size` best-scoring nodes of all that were scored (a parent scores
at least as high as its children, so the kept nodes hang together), the deepest levels last.

Each beam runs in a request row of the draft's memory lent for the step: a copy of its parent's row (the request's
row: its tokens' K/V up to `base`; a deeper beam's parent's row: that and its ancestors' slots) and a slot of its
own. The K/V of draft tokens is dropped afterwards: the draft runs the accepted tokens again at its next catch-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.mem_cache.memory_pools import MemoryPools
from sglang.srt.speculative.draft_tree import DraftTree

# One forward of the draft over parts (row, position, token), each with the context its token goes with (EAGLE: the
# head's hidden state; a draft model: None): each part's output context and its top-k (ids, log-probabilities).
StepFn = Callable[[list[tuple[int, int, int]], list[Any]], tuple[list[Any], list[list[int]], list[list[float]]]]


@dataclass
class _Node:
    token: int
    parent: int
    score: float
    depth: int


def top_candidates(logits: torch.Tensor, k: int, ids: Optional[torch.Tensor] = None
                   ) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's k most likely tokens (mapped through `ids` where the logits index a reduced vocabulary) and their
    log-probabilities."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, index = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    if ids is not None:
        index = ids[index.cpu()]
    return index.tolist(), values.tolist()


def rows_and_slots_needed(topk: int, steps: int) -> tuple[int, int]:
    """Request rows (held at most two steps at a time) and KV slots a request's search takes."""
    return (2 * topk, topk * (steps - 1)) if steps > 1 else (0, 0)


class SearchBudget:
    """What the draft's memory can give the requests of one proposal, admitted one at a time: the slots of their
    catch-ups and searches, the rows their searches will lend, and a row for a request new to the draft."""

    def __init__(self, mem: MemoryPools) -> None:
        self.mem = mem
        self.slots = mem.allocator.available_size()
        self.promised_rows = 0

    def take_row(self) -> Optional[int]:
        """A row for a request new to the draft, unless the searches admitted so far need every free one."""
        pool = self.mem.req_to_token_pool
        return pool.alloc() if pool.available_size() > self.promised_rows else None

    def admit(self, catch_up: int, topk: int, steps: int) -> int:
        """The levels a request's search may take: `steps`, 1 (its draft's top-k alone) where the search does not
        fit, 0 where even its catch-up does not."""
        if catch_up > self.slots:
            return 0
        rows, slots = rows_and_slots_needed(topk, steps)
        if catch_up + slots > self.slots or rows > self.mem.req_to_token_pool.available_size() - self.promised_rows:
            steps, rows, slots = 1, 0, 0
        self.slots -= catch_up + slots
        self.promised_rows += rows
        return steps


def search_trees(mem: MemoryPools, requests: list[tuple[int, int]], first: list[tuple[list[int], list[float], Any]],
                 steps: list[int], topk: int, sizes: list[int], step: StepFn) -> list[DraftTree]:
    """The draft tree of each request, given its (draft row, base: the positions its row holds) and the draft's
    top-k after its last token (ids, log-probabilities, the context its children go with). A node at depth d runs at
    position base + d - 1. The caller checked that the rows and slots are free (rows_and_slots_needed)."""
    table = mem.req_to_token_pool.req_to_token
    nodes: list[list[_Node]] = []
    beams: list[list[tuple[int, Any]]] = []
    for root_ids, root_lps, ctx in first:
        nodes.append([_Node(t, -1, lp, 1) for t, lp in zip(root_ids[:topk], root_lps[:topk])])
        beams.append([(n, ctx) for n in range(len(nodes[-1]))])
    prev: list[int] = []  # the rows lent in the previous step (the current beams' parents' rows)
    cur: list[int] = []
    held_slots: list[int] = []
    rows_of: list[dict[int, int]] = [{} for _ in requests]  # node -> the row it ran in
    try:
        for j in range(1, max(steps, default=1)):
            parts, ctxs, owners = [], [], []
            for i, (row, base) in enumerate(requests):
                if steps[i] <= j:
                    continue
                pos = base + j - 1
                for n, ctx in beams[i]:
                    node = nodes[i][n]
                    lent = mem.req_to_token_pool.alloc()
                    assert lent is not None
                    cur.append(lent)
                    src = row if node.parent < 0 else rows_of[i][node.parent]
                    table[lent, :pos] = table[src, :pos]
                    rows_of[i][n] = lent
                    parts.append((lent, pos, node.token))
                    ctxs.append(ctx)
                    owners.append((i, n))
            if not parts:
                break
            slots = mem.alloc_slots(len(parts))
            held_slots += slots.tolist()
            where = torch.tensor([[lent for lent, _, _ in parts], [pos for _, pos, _ in parts]], dtype=torch.int64,
                                 device=table.device)
            table[where[0], where[1]] = slots.to(table.device)
            outs, ids, lps = step(parts, ctxs)
            scored: dict[int, list[tuple[float, int, Any]]] = {}
            for (i, n), out, tokens, values in zip(owners, outs, ids, lps):
                parent = nodes[i][n]
                for t, lp in zip(tokens[:topk], values[:topk]):
                    nodes[i].append(_Node(t, n, parent.score + lp, j + 1))
                    scored.setdefault(i, []).append((parent.score + lp, len(nodes[i]) - 1, out))
            for i, found in scored.items():
                found.sort(key=lambda c: -c[0])  # stable: the earlier beam's first among equal scores
                beams[i] = [(n, out) for _, n, out in found[:topk]]
            done, prev, cur = prev, cur, []
            for lent in done:  # two steps back: no beam copies these rows any more
                mem.req_to_token_pool.free(lent)
    finally:
        for lent in prev + cur:
            mem.req_to_token_pool.free(lent)
        if held_slots:
            mem.allocator.free(torch.tensor(held_slots, dtype=torch.int64, device=table.device))
    return [_best(found, size) for found, size in zip(nodes, sizes)]


def _best(nodes: list[_Node], size: int) -> DraftTree:
    """The tree of the `size` best-scoring nodes whose parents are kept, levels in order."""
    order = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth, n))
    kept: set[int] = set()
    for n in order:
        if len(kept) >= size:
            break
        if nodes[n].parent < 0 or nodes[n].parent in kept:
            kept.add(n)
    ranked = sorted(kept, key=lambda n: (nodes[n].depth, -nodes[n].score, n))
    index = {n: k for k, n in enumerate(ranked)}
    return DraftTree([nodes[n].token for n in ranked],
                     [-1 if nodes[n].parent < 0 else index[nodes[n].parent] for n in ranked])

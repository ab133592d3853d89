"""An n-gram draft as a tree (--speculative-ngram-match-type, --speculative-ngram-min/max-bfs-breadth,
--speculative-ngram-branch-length).

The candidates are the continuations (up to branch-length tokens) of the earlier occurrences of a request's suffix,
ranked: the longest match first, the request's own tokens before the shared cache's, the most recent first. They
make a trie whose children keep that rank order and count the candidates through them. The draft takes at most
`budget` of its nodes:

- BFS: level by level. The root's children number `breadth`, from max-bfs-breadth for a match of the shortest
  window down to min-bfs-breadth for one of the longest (a long match is trusted, a short one hedged); each level
  below takes `scale` fewer (at least one), scale = (max_breadth - min_breadth) / (max_window - min_window + 1).
- PROB: best first by probability, a child's being its parent's times its share of the candidates among its
  parent's (up to max-bfs-breadth) most frequent children.

With one breadth of 1 (or one candidate) the draft is the best candidate's continuation: a chain.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from sglang.srt.speculative.draft_tree import DraftTree


@dataclass
class TreeShape:
    match_type: str = "BFS"
    min_breadth: int = 1
    max_breadth: int = 10
    min_window: int = 1
    max_window: int = 12
    branch_length: int = 18

    @property
    def scale(self) -> float:
        return (self.max_breadth - self.min_breadth) / (self.max_window - self.min_window + 1)

    def root_breadth(self, match_len: int) -> float:
        return (self.max_window - min(match_len, self.max_window)) * self.scale + self.min_breadth


@dataclass
class _Trie:
    count: int = 0
    children: dict[int, _Trie] = field(default_factory=dict)  # insertion order: the candidates' rank order


def _trie(candidates: list[list[int]]) -> _Trie:
    root = _Trie()
    for cont in candidates:
        node = root
        node.count += 1
        for token in cont:
            node = node.children.setdefault(token, _Trie())
            node.count += 1
    return root


def build_draft(candidates: list[tuple[int, list[int]]], budget: int, shape: TreeShape) -> DraftTree:
    """The draft of at most `budget` nodes from ranked (match length, continuation) candidates."""
    conts = [cont[: shape.branch_length] for _, cont in candidates if cont]
    tree = DraftTree()
    if not conts or budget <= 0:
        return tree
    root = _trie(conts)
    if shape.match_type == "PROB":
        return _prob(root, budget, shape.max_breadth)
    queue: deque[tuple[int, float, _Trie]] = deque([(-1, shape.root_breadth(candidates[0][0]), root)])
    while queue and len(tree) < budget:
        parent, breadth, node = queue.popleft()
        for token, child in list(node.children.items())[: max(1, int(breadth))]:
            if len(tree) >= budget:
                break
            queue.append((tree.add(parent, token), breadth - shape.scale, child))
    return tree


def _prob(root: _Trie, budget: int, top: int) -> DraftTree:
    tree = DraftTree()
    heap: list[tuple[float, int, int, int, _Trie]] = []
    order = 0

    def push(parent: int, node: _Trie, prob: float) -> None:
        nonlocal order
        ranked = sorted(node.children.items(), key=lambda kv: -kv[1].count)[:top]  # stable: rank breaks ties
        total = sum(child.count for _, child in ranked) or 1
        for token, child in ranked:
            heapq.heappush(heap, (-prob * child.count / total, order, parent, token, child))
            order += 1

    push(-1, root, 1.0)
    while heap and len(tree) < budget:
        neg, _, parent, token, child = heapq.heappop(heap)
        push(tree.add(parent, token), child, -neg)
    return tree

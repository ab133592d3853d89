"""A request's draft: a tree of proposed tokens hanging from its last token (a chain is a tree of one branch).

Node i holds `tokens[i]` and its parent `parents[i]` (-1: the root, the request's last token); parents come before
their children, and siblings hold different tokens. The node at depth d proposes the token at position pos + d (pos:
the last token's position). Verification runs the root and every node as one decode row each and keeps the path
from the root whose every token is the one chosen after its parent (`accepted_path`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """The node holding `token` under `parent` (made when missing)."""
        for i in range(len(self.tokens)):
            if self.parents[i] == parent and self.tokens[i] == token:
                return i
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def depth(self) -> int:
        return max(self.depths(), default=0)

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def main_path(self) -> list[int]:
        """The path to the first of the deepest nodes: it runs in the request's own KV row (the other nodes get
        slots and rows of their own for the verify step)."""
        depths = self.depths()
        if not depths:
            return []
        return self.path_to(depths.index(max(depths)))

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def accepted_path(self, chosen: list[int]) -> list[int]:
        """The nodes a request keeps: from the root, the child holding the token chosen after it (chosen[0]: after
        the root, chosen[1 + i]: after node i), as long as there is one."""
        path: list[int] = []
        node = -1
        while True:
            want = chosen[node + 1]
            nxt = next((i for i in range(node + 1, len(self.tokens))
                        if self.parents[i] == node and self.tokens[i] == want), None)
            if nxt is None:
                return path
            path.append(nxt)
            node = nxt

    def pruned(self, keep: list[int]) -> DraftTree:
        """The tree of the nodes in `keep` (closed under parents), renumbered in order."""
        kept = sorted(set(keep))
        index = {old: new for new, old in enumerate(kept)}
        return DraftTree([self.tokens[i] for i in kept],
                         [-1 if self.parents[i] < 0 else index[self.parents[i]] for i in kept])

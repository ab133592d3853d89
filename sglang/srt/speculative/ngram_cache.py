"""N-gram drafts: the continuation of the longest earlier occurrence of a sequence's suffix.

A `TokenIndex` holds a token stream and, for each position, the key made of the `min_window` tokens ending there;
a lookup takes the occurrences of the query's last `min_window` tokens (the most recent ones first), extends each
match backwards up to `max_window` tokens and returns what followed each, the longest matches first.
Each request indexes its own prompt and output as they grow; `NgramCache` keeps the finished requests' sequences
in one bounded stream (oldest dropped first), so that text that recurs across requests is drafted too. The matches'
continuations make the draft tree (ngram_tree.py).
"""

from __future__ import annotations

from collections import defaultdict

from sglang.srt.speculative.draft_tree import DraftTree
from sglang.srt.speculative.ngram_tree import TreeShape, build_draft

# Occurrences kept per key, the most recent ones: a frequent key (a single common token) would otherwise make
# each lookup scan the whole stream.
MAX_CANDIDATES = 16
# Separates sequences in the shared stream, so that no match runs from one request into the next.
_SEPARATOR = -1


class TokenIndex:
    """A growing token stream with its occurrences indexed by their last `min_window` tokens."""

    def __init__(self, min_window: int, max_window: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.tokens: list[int] = []
        self.positions: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 0  # positions before this one are in `positions`

    def extend(self, tokens: list[int], index_all: bool = True) -> None:
        """Append tokens; index every position that has a successor (all but the last one unless index_all)."""
        self.tokens.extend(tokens)
        self.index_upto(len(self.tokens) if index_all else len(self.tokens) - 1)

    def index_upto(self, end: int) -> None:
        w = self.min_window
        for pos in range(max(self.indexed, w - 1), end):
            key = tuple(self.tokens[pos - w + 1 : pos + 1])
            if _SEPARATOR in key:
                continue
            found = self.positions[key]
            found.append(pos)
            if len(found) > 2 * MAX_CANDIDATES:
                del found[:-MAX_CANDIDATES]
        self.indexed = max(self.indexed, end)

    def matches(self, suffix: list[int], max_len: int, before: int) -> list[tuple[int, list[int]]]:
        """(match length, continuation of up to max_len tokens) of each of the latest MAX_CANDIDATES occurrences of
        `suffix`'s end that end before position `before` and match at least min_window tokens: the longest matches
        first, the most recent first among equals; a continuation stops at the end of its sequence."""
        w = self.min_window
        if len(suffix) < w or max_len <= 0:
            return []
        found = self.positions.get(tuple(suffix[-w:]))
        if not found:
            return []
        limit = min(self.max_window, len(suffix))
        tokens = self.tokens
        out = []
        for pos in reversed(found[-MAX_CANDIDATES:]):
            if pos + 1 >= before:
                continue
            n = w
            while n < limit and pos - n >= 0 and tokens[pos - n] == suffix[-n - 1]:
                n += 1
            cont = tokens[pos + 1 : min(pos + 1 + max_len, before)]
            if _SEPARATOR in cont:
                cont = cont[: cont.index(_SEPARATOR)]
            if cont:
                out.append((n, cont))
        out.sort(key=lambda m: -m[0])  # stable: the most recent first among equal lengths
        return out


class NgramCache:
    """The token sequences of recent requests, at most `capacity` tokens in all (the oldest dropped first)."""

    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        """Forget every sequence."""
        self.index = TokenIndex(self.min_window, self.max_window)

    def add(self, tokens: list[int]) -> None:
        if self.capacity <= self.min_window + 1 or len(tokens) <= self.min_window:
            return
        tokens = tokens[-(self.capacity - 1) :]  # room for the separator
        if len(self.index.tokens) + len(tokens) + 1 > self.capacity:
            # Rebuilt from the newer half (amortized: at most once per capacity / 2 tokens added).
            kept = self.index.tokens[len(self.index.tokens) // 2 :]
            kept = kept[kept.index(_SEPARATOR) + 1 :] if _SEPARATOR in kept else []
            if len(kept) + len(tokens) + 1 > self.capacity:
                kept = []
            self.clear()
            self.index.extend(kept)
        self.index.extend(list(tokens) + [_SEPARATOR])

    def matches(self, suffix: list[int], max_len: int) -> list[tuple[int, list[int]]]:
        return self.index.matches(suffix, max_len, len(self.index.tokens)) if self.index.tokens else []

    def __len__(self) -> int:
        return len(self.index.tokens)


def propose_draft(own: TokenIndex, shared: NgramCache, budget: int, shape: TreeShape) -> DraftTree:
    """The draft (at most `budget` nodes) of a request whose tokens so far are `own.tokens`: a tree of the
    continuations of its suffix's matches in its own tokens and in the recent requests' tokens (ngram_tree.py),
    ranked longest match first, its own before the cache's among equals."""
    seq = own.tokens
    suffix = seq[-own.max_window :]
    length = min(budget, shape.branch_length)
    found = own.matches(suffix, length, len(seq)) + shared.matches(suffix, length)
    found.sort(key=lambda m: -m[0])
    return build_draft(found, budget, shape)

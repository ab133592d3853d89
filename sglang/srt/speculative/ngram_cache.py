"""N-gram drafts: the continuation of the longest earlier occurrence of a sequence's suffix.

A `TokenIndex` holds a token stream and, for each position, the key made of the `min_window` tokens ending there;
a lookup takes the occurrences of the query's last `min_window` tokens (the most recent ones first), extends each
match backwards up to `max_window` tokens and proposes what followed the longest one (the most recent of equals).
Each request indexes its own prompt and output as they grow; `NgramCache` keeps the finished requests' sequences
in one bounded stream (oldest dropped first), so that text that recurs across requests is drafted too.
"""

from __future__ import annotations

from collections import defaultdict

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

    def lookup(self, suffix: list[int], max_len: int, before: int) -> tuple[int, list[int]]:
        """(match length, continuation of up to max_len tokens) of the best occurrence of `suffix`'s end that
        ends before position `before`; (0, []) when none has at least min_window tokens and a continuation."""
        w = self.min_window
        if len(suffix) < w or max_len <= 0:
            return 0, []
        found = self.positions.get(tuple(suffix[-w:]))
        if not found:
            return 0, []
        best_len, best_pos = 0, -1
        limit = min(self.max_window, len(suffix))
        tokens = self.tokens
        for pos in reversed(found[-MAX_CANDIDATES:]):
            if pos + 1 >= before:
                continue
            n = w
            while n < limit and pos - n >= 0 and tokens[pos - n] == suffix[-n - 1]:
                n += 1
            if n > best_len:
                best_len, best_pos = n, pos
                if n == limit:
                    break
        if best_pos < 0:
            return 0, []
        cont = tokens[best_pos + 1 : min(best_pos + 1 + max_len, before)]
        if _SEPARATOR in cont:
            cont = cont[: cont.index(_SEPARATOR)]
        return (best_len, cont) if cont else (0, [])


class NgramCache:
    """The token sequences of recent requests, at most `capacity` tokens in all (the oldest dropped first)."""

    def __init__(self, min_window: int, max_window: int, capacity: int) -> None:
        self.min_window = min_window
        self.max_window = max_window
        self.capacity = capacity
        self.index = TokenIndex(min_window, max_window)

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
            self.index = TokenIndex(self.min_window, self.max_window)
            self.index.extend(kept)
        self.index.extend(list(tokens) + [_SEPARATOR])

    def lookup(self, suffix: list[int], max_len: int) -> tuple[int, list[int]]:
        return self.index.lookup(suffix, max_len, len(self.index.tokens))

    def __len__(self) -> int:
        return len(self.index.tokens)


def propose_draft(own: TokenIndex, shared: NgramCache, max_len: int) -> list[int]:
    """The draft of a request whose tokens so far are `own.tokens`: the continuation of the longest match of its
    suffix in its own tokens, else (or when the shared cache matches longer) in the recent requests' tokens."""
    seq = own.tokens
    suffix = seq[-own.max_window :]
    own_len, own_cont = own.lookup(suffix, max_len, len(seq))
    shared_len, shared_cont = shared.lookup(suffix, max_len) if len(shared) else (0, [])
    return shared_cont if shared_len > own_len else own_cont

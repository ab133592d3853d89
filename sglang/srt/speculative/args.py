"""The speculative-decoding flags: their help text and their checks (ServerArgs.validate calls the checks)."""

from __future__ import annotations

from typing import Any

SUPPORTED_ALGORITHMS = ("NGRAM",)
# SGLang's other algorithms, which need a draft model: refused at startup with a clear message.
KNOWN_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "LOOKAHEAD")
# Tokens verified per step (the draft plus the bonus token) when --speculative-num-draft-tokens is not given.
DEFAULT_NUM_DRAFT_TOKENS = 8

_TREE_KNOB = ("accepted for compatibility with SGLang; this engine drafts a single chain (the longest n-gram "
              "match's continuation), not a BFS/PROB tree, so it has no effect")

SPECULATIVE_HELP = {
    "speculative_algorithm": "Speculative decoding algorithm. Only NGRAM is supported: drafts come from the "
                             "request's own tokens and a bounded cache of recent requests' tokens (no draft model); "
                             "the draft is a chain, not a tree. Off by default.",
    "speculative_num_draft_tokens": "Tokens verified per decode step, the bonus token included (the draft has up to "
                                    f"this many minus one). Default with NGRAM: {DEFAULT_NUM_DRAFT_TOKENS}.",
    "speculative_ngram_min_match_window_size": "Shortest suffix (in tokens) that must match to propose a draft.",
    "speculative_ngram_max_match_window_size": "Longest suffix (in tokens) compared when looking for a match.",
    "speculative_ngram_capacity": "How many tokens of recent requests the n-gram cache keeps (oldest dropped first).",
    "speculative_ngram_min_bfs_breadth": _TREE_KNOB,
    "speculative_ngram_max_bfs_breadth": _TREE_KNOB,
    "speculative_ngram_match_type": _TREE_KNOB,
    "speculative_ngram_branch_length": _TREE_KNOB,
}


def check_speculative_args(args: Any) -> None:
    """Raise ValueError naming the flag for a bad speculative setting; fill in the NGRAM default draft size."""
    algo = args.speculative_algorithm
    if algo is None:
        return
    if algo.upper() not in SUPPORTED_ALGORITHMS:
        known = "a known SGLang algorithm, " if algo.upper() in KNOWN_ALGORITHMS else ""
        raise ValueError(f"--speculative-algorithm {algo}: {known}not supported yet; supported: "
                         f"{', '.join(SUPPORTED_ALGORITHMS)}")
    args.speculative_algorithm = algo.upper()
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
    if args.speculative_num_draft_tokens < 2:
        raise ValueError("--speculative-num-draft-tokens must be at least 2 (one draft token plus the bonus token), "
                         f"got {args.speculative_num_draft_tokens}")
    low, high = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if low < 1:
        raise ValueError(f"--speculative-ngram-min-match-window-size must be at least 1, got {low}")
    if high < low:
        raise ValueError(f"--speculative-ngram-max-match-window-size ({high}) must be at least "
                         f"--speculative-ngram-min-match-window-size ({low})")
    if args.speculative_ngram_capacity < 0:
        raise ValueError(f"--speculative-ngram-capacity must be at least 0, got {args.speculative_ngram_capacity}")
    if args.speculative_ngram_min_bfs_breadth < 1 or args.speculative_ngram_max_bfs_breadth < 1:
        raise ValueError("--speculative-ngram-min-bfs-breadth and --speculative-ngram-max-bfs-breadth must be at "
                         "least 1")
    if args.speculative_ngram_branch_length < 1:
        raise ValueError(f"--speculative-ngram-branch-length must be at least 1, got "
                         f"{args.speculative_ngram_branch_length}")

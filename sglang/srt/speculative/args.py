"""The speculative-decoding flags: their help text and their checks (ServerArgs.validate calls the checks)."""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
# Algorithms with a draft model or head (--speculative-draft-model-path, --speculative-num-steps, a chain).
DRAFTING_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
# Algorithms whose draft head reads the served model's hidden states.
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
# SGLang's other algorithms: refused at startup with a clear message.
KNOWN_ALGORITHMS = ("NEXTN", "LOOKAHEAD")
# Tokens verified per step (the draft plus the bonus token) when --speculative-num-draft-tokens is not given.
DEFAULT_NUM_DRAFT_TOKENS = 8
# STANDALONE's draft chain length when neither --speculative-num-steps nor --speculative-num-draft-tokens is given.
DEFAULT_NUM_STEPS = 3

_TREE_KNOB = ("accepted for compatibility with SGLang; this engine drafts a single chain (the longest n-gram "
              "match's continuation), not a BFS/PROB tree, so it has no effect")

SPECULATIVE_HELP = {
    "speculative_algorithm": "Speculative decoding algorithm: NGRAM (drafts come from the request's own tokens and a "
                             "bounded cache of recent requests' tokens, no draft model), STANDALONE (a smaller model "
                             "with the same vocabulary drafts, --speculative-draft-model-path), EAGLE (an EAGLE-1 "
                             "head drafts from the served model's final hidden states, --speculative-draft-model-path) "
                             "or EAGLE3 (an EAGLE-3 head drafts from three of the served model's intermediate layers' "
                             "hidden states, over its own reduced vocabulary). The draft is a chain, not a tree. Off "
                             "by default.",
    "speculative_num_draft_tokens": "Tokens verified per decode step, the bonus token included (the draft has up to "
                                    f"this many minus one). Default with NGRAM: {DEFAULT_NUM_DRAFT_TOKENS}. With "
                                    "STANDALONE, EAGLE or EAGLE3 and --speculative-eagle-topk 1 it is "
                                    "--speculative-num-steps + 1, as SGLang sets it (another value is adjusted, with a "
                                    "warning); given alone, it sets --speculative-num-steps to this minus one.",
    "speculative_draft_model_path": "STANDALONE: the draft model (a directory, .gguf file or hub id this engine "
                                    "loads), whose vocabulary must equal the served model's. EAGLE: the directory of "
                                    "an EAGLE-1 head for the served model (config.json with architectures "
                                    "LlamaForCausalLMEagle, fc and layers.0 weights). EAGLE3: the directory of an "
                                    "EAGLE-3 head (config.json with architectures LlamaForCausalLMEagle3 and "
                                    "draft_vocab_size; fc, midlayer.*, norm, lm_head, d2t and t2d weights).",
    "speculative_token_map": "EAGLE3: a .pt file holding the served-model token id of each draft-vocabulary id (a "
                             "list or 1-D tensor of draft_vocab_size ids), used where the head's checkpoint has no "
                             "d2t tensor, or instead of it.",
    "speculative_num_steps": "STANDALONE, EAGLE, EAGLE3: draft tokens the draft model or head proposes per decode "
                             f"step (a chain, proposed greedily). Default {DEFAULT_NUM_STEPS}.",
    "speculative_eagle_topk": "STANDALONE, EAGLE, EAGLE3: draft branches per step; only 1 (a chain) is supported. "
                              "Default 1.",
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
        if args.speculative_token_map is not None:
            raise ValueError("--speculative-token-map is only used with --speculative-algorithm EAGLE3")
        return
    if algo.upper() not in SUPPORTED_ALGORITHMS:
        known = "a known SGLang algorithm, " if algo.upper() in KNOWN_ALGORITHMS else ""
        raise ValueError(f"--speculative-algorithm {algo}: {known}not supported yet; supported: "
                         f"{', '.join(SUPPORTED_ALGORITHMS)}")
    args.speculative_algorithm = algo.upper()
    if args.speculative_token_map is not None:
        _check_token_map_flag(args)
    if args.speculative_algorithm in DRAFTING_ALGORITHMS:
        _check_drafting(args)
        return
    if args.speculative_draft_model_path is not None:
        raise ValueError("--speculative-draft-model-path is only used with --speculative-algorithm "
                         f"{' or '.join(DRAFTING_ALGORITHMS)}")
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


def _check_drafting(args: Any) -> None:
    """The draft model's (STANDALONE) or head's (EAGLE) flags; --speculative-num-draft-tokens derived from the chain
    length as SGLang does."""
    algo = args.speculative_algorithm
    if not args.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    if args.tp_size > 1:
        raise ValueError(f"--speculative-algorithm {algo} runs with --tp-size 1 only (the draft is not sharded)")
    topk = 1 if args.speculative_eagle_topk is None else args.speculative_eagle_topk
    if topk != 1:
        raise ValueError(f"--speculative-eagle-topk {topk}: only 1 is supported (the draft is a chain, not a tree)")
    args.speculative_eagle_topk = topk
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is None:
        steps = tokens - 1 if tokens is not None else DEFAULT_NUM_STEPS
    if steps < 1:
        raise ValueError(f"--speculative-num-steps must be at least 1, got {steps}")
    if tokens is not None and tokens != steps + 1:
        logger.warning("--speculative-num-draft-tokens is adjusted to --speculative-num-steps + 1 (%d) when "
                       "--speculative-eagle-topk is 1", steps + 1)
    args.speculative_num_steps, args.speculative_num_draft_tokens = steps, steps + 1


def _check_token_map_flag(args: Any) -> None:
    """--speculative-token-map goes with EAGLE3 and names a file (its contents are checked when the head loads)."""
    path = args.speculative_token_map
    if args.speculative_algorithm != "EAGLE3":
        raise ValueError(f"--speculative-token-map is only used with --speculative-algorithm EAGLE3, not "
                         f"{args.speculative_algorithm}")
    if not os.path.isfile(path):
        raise ValueError(f"--speculative-token-map {path}: no such file")

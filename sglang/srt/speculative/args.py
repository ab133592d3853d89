"""The speculative-decoding flags: their help text and their checks (ServerArgs.validate calls the checks)."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterable
from typing import Any

from sglang.srt.layers.arithmetic import choose_gguf_activations
from sglang.srt.model_loader.dtype import read_cpu_flags

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
# NGRAM's default on a CPU whose GGUF kernels take float32 activations (no AVX512-VNNI, or float32 asked for): there
# a verified row costs 0.35-0.5x a one-row step (bound by arithmetic, not by reading the weights), and SmolLM2-135M
# on two AVX2 cores decoded copy-heavy answers at 1.29x plain with 4 tokens per step, 1.08x with 3 and 1.06x with 8
# (benchmarks/RESULTS.md, "Speculative verify steps on the AVX2 class"; 1.22-1.42x with 4 since the tiles of 3 and 4
# rows got faster).
CPU_FLOAT_NUM_DRAFT_TOKENS = 4
# --speculative-ngram-max-bfs-breadth where not given: SGLang's default on GPUs, where a verify step's extra rows
# cost little; 1 (chains) on CPUs, where each row adds its arithmetic to the step: SmolLM2-135M on two cores decoded
# copy-heavy answers at 1.49-1.50x plain with chains and 1.24-1.40x with breadth 10 (benchmarks/RESULTS.md,
# "Draft trees").
NGRAM_GPU_BREADTH = 10
# STANDALONE's draft chain length when neither --speculative-num-steps nor --speculative-num-draft-tokens is given.
DEFAULT_NUM_STEPS = 3


SPECULATIVE_HELP = {
    "speculative_algorithm": "Speculative decoding algorithm: NGRAM (drafts come from the request's own tokens and a "
                             "bounded cache of recent requests' tokens, no draft model), STANDALONE (a smaller model "
                             "with the same vocabulary drafts, --speculative-draft-model-path), EAGLE (an EAGLE-1 "
                             "head drafts from the served model's final hidden states, --speculative-draft-model-path) "
                             "or EAGLE3 (an EAGLE-3 head drafts from three of the served model's intermediate layers' "
                             "hidden states, over its own reduced vocabulary). Drafts are verified as trees "
                             "(NGRAM: --speculative-ngram-*-bfs-breadth; the others: --speculative-eagle-topk). Off "
                             "by default.",
    "speculative_num_draft_tokens": "Tokens verified per decode step, the request's last token included (the draft "
                                    "has up to this many minus one nodes). Default with NGRAM: "
                                    f"{DEFAULT_NUM_DRAFT_TOKENS} ({CPU_FLOAT_NUM_DRAFT_TOKENS} on a CPU whose block "
                                    "kernels take float32 activations (no AVX512-VNNI, or float32 asked for), where "
                                    "each verified row costs much of a step). With "
                                    "STANDALONE, EAGLE or EAGLE3 and --speculative-eagle-topk 1 it is "
                                    "--speculative-num-steps + 1, as SGLang sets it (another value is adjusted, with "
                                    "a warning); given alone, it sets "
                                    "--speculative-num-steps to this minus one. With a larger top-k: the tree's "
                                    f"nodes plus one, default {DEFAULT_NUM_DRAFT_TOKENS} (at most all the nodes the "
                                    "search scores).",
    "speculative_draft_model_path": "STANDALONE: the draft model (a directory, .gguf file or hub id this engine "
                                    "loads), whose vocabulary must equal the served model's. EAGLE: the directory of "
                                    "an EAGLE-1 head for the served model (config.json with architectures "
                                    "LlamaForCausalLMEagle, fc and layers.0 weights). EAGLE3: the directory of an "
                                    "EAGLE-3 head (config.json with architectures LlamaForCausalLMEagle3 and "
                                    "draft_vocab_size; fc, midlayer.*, norm, lm_head, d2t and t2d weights).",
    "speculative_token_map": "EAGLE3: a .pt file holding the served-model token id of each draft-vocabulary id (a "
                             "list or 1-D tensor of draft_vocab_size ids), used where the head's checkpoint has no "
                             "d2t tensor, or instead of it.",
    "speculative_num_steps": "STANDALONE, EAGLE, EAGLE3: draft steps per decode step: the depth of the draft (a "
                             f"chain proposed greedily, or a tree with --speculative-eagle-topk). Default "
                             f"{DEFAULT_NUM_STEPS}.",
    "speculative_eagle_topk": "STANDALONE, EAGLE, EAGLE3: the draft's top-k tokens expanded per step. 1 (the "
                              "default): a chain of its greedy tokens. Above 1: a tree, as SGLang's EAGLE drafts "
                              "it: k beams per step, the best-scoring nodes (sum of the draft's log-probabilities) "
                              "kept, --speculative-num-draft-tokens - 1 of them.",
    "speculative_ngram_min_match_window_size": "Shortest suffix (in tokens) that must match to propose a draft.",
    "speculative_ngram_max_match_window_size": "Longest suffix (in tokens) compared when looking for a match.",
    "speculative_ngram_capacity": "How many tokens of recent requests the n-gram cache keeps (oldest dropped first).",
    "speculative_ngram_min_bfs_breadth": "NGRAM, BFS: the draft tree's breadth at the root after a match of the "
                                         "longest window (longer matches are trusted: fewer branches).",
    "speculative_ngram_max_bfs_breadth": "NGRAM: BFS: the root's breadth after a match of the shortest window (each "
                                         "level below takes (max - min) / (max window - min window + 1) fewer, at "
                                         "least one); PROB: the children ranked per node. Default: 1 on CPU (a "
                                         f"chain: measured faster there), {NGRAM_GPU_BREADTH} on GPUs.",
    "speculative_ngram_match_type": "NGRAM: how the draft tree is filled from the matches' continuations: BFS "
                                    "(level by level, in match order) or PROB (the most frequent continuations "
                                    "first).",
    "speculative_ngram_branch_length": "NGRAM: the longest continuation of a match taken into the draft tree.",
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
        args.speculative_num_draft_tokens = ngram_default_draft_tokens(
            args.device, read_cpu_flags(), args.dtype, args.cpu_gemm, args.gguf_activations)
    if args.speculative_num_draft_tokens < 2:
        raise ValueError("--speculative-num-draft-tokens must be at least 2 (one draft token plus the bonus token), "
                         f"got {args.speculative_num_draft_tokens}")
    low, high = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    if low < 1:
        raise ValueError(f"--speculative-ngram-min-match-window-size must be at least 1, got {low}")
    if high < low:
        raise ValueError(f"--speculative-ngram-max-match-window-size ({high}) must be at least "
                         f"--speculative-ngram-min-match-window-size ({low})")
    if args.speculative_ngram_max_bfs_breadth is None:
        args.speculative_ngram_max_bfs_breadth = max(args.speculative_ngram_min_bfs_breadth,
                                                     NGRAM_GPU_BREADTH if args.device == "cuda" else 1)
    if args.speculative_ngram_capacity < 0:
        raise ValueError(f"--speculative-ngram-capacity must be at least 0, got {args.speculative_ngram_capacity}")
    if args.speculative_ngram_min_bfs_breadth < 1 or args.speculative_ngram_max_bfs_breadth < 1:
        raise ValueError("--speculative-ngram-min-bfs-breadth and --speculative-ngram-max-bfs-breadth must be at "
                         "least 1")
    if args.speculative_ngram_max_bfs_breadth < args.speculative_ngram_min_bfs_breadth:
        raise ValueError(f"--speculative-ngram-max-bfs-breadth ({args.speculative_ngram_max_bfs_breadth}) must be at "
                         f"least --speculative-ngram-min-bfs-breadth ({args.speculative_ngram_min_bfs_breadth})")
    if args.speculative_ngram_branch_length < 1:
        raise ValueError(f"--speculative-ngram-branch-length must be at least 1, got "
                         f"{args.speculative_ngram_branch_length}")


def ngram_default_draft_tokens(device: str, cpu_flags: Iterable[str], dtype: str = "auto", cpu_gemm: str = "auto",
                               gguf_activations: str = "auto") -> int:
    """NGRAM's --speculative-num-draft-tokens where not given: DEFAULT_NUM_DRAFT_TOKENS on GPUs and where the CPU's
    block kernels take int8 activations (AVX512-VNNI, automatic arithmetic), CPU_FLOAT_NUM_DRAFT_TOKENS where they
    take float32 ones (no VNNI, or --dtype / --cpu-gemm / --gguf-activations asking for float32)."""
    if device != "cpu":
        return DEFAULT_NUM_DRAFT_TOKENS
    activations, _ = choose_gguf_activations(True, device, dtype, cpu_gemm, gguf_activations, cpu_flags,
                                             platform.machine())
    return DEFAULT_NUM_DRAFT_TOKENS if activations == "int8" else CPU_FLOAT_NUM_DRAFT_TOKENS


def _check_drafting(args: Any) -> None:
    """The draft model's (STANDALONE) or head's (EAGLE) flags; --speculative-num-draft-tokens derived from the chain
    length as SGLang does."""
    algo = args.speculative_algorithm
    if not args.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    if args.tp_size > 1:
        raise ValueError(f"--speculative-algorithm {algo} runs with --tp-size 1 only (the draft is not sharded)")
    topk = 1 if args.speculative_eagle_topk is None else args.speculative_eagle_topk
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk must be at least 1, got {topk}")
    args.speculative_eagle_topk = topk
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is None:
        steps = tokens - 1 if tokens is not None and topk == 1 else DEFAULT_NUM_STEPS
    if steps < 1:
        raise ValueError(f"--speculative-num-steps must be at least 1, got {steps}")
    if topk > 1:
        most = topk + (steps - 1) * topk * topk  # the nodes a search scores
        if tokens is None:
            tokens = min(most, DEFAULT_NUM_DRAFT_TOKENS - 1) + 1
        if not 2 <= tokens <= most + 1:
            raise ValueError(f"--speculative-num-draft-tokens must be between 2 and {most + 1} (the tree's nodes "
                             f"plus the last token) with --speculative-eagle-topk {topk} and --speculative-num-steps "
                             f"{steps}, got {tokens}")
        args.speculative_num_steps, args.speculative_num_draft_tokens = steps, tokens
        return
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

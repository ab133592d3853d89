"""How many tokens n-gram drafts could win per decode forward, apart from any machine's speed: greedy outputs of the
model (sglang.Engine, no speculation), replayed through the NGRAM drafter offline.

    python benchmarks/ngram_acceptance.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--max-new-tokens 128]
        [--draft-tokens 2 3 4 8 16] [--outputs FILE.json]

Workloads: the batch-1 prompts of bench_speculative_ngram.py (copy-heavy and free). For each
--speculative-num-draft-tokens N, three drafters replay every output, request after request (finished requests join
the shared n-gram cache, as in the server):
- server: the scheduler's chains (propose_draft, a request's budget shrinking after a partial match and doubling after
  a full one, back-off after misses: DraftState);
- fixed: the same lookups, always N - 1 tokens when a match exists;
- oracle: the longest run of the coming output found anywhere in the request's prompt and output so far, up to
  N - 1 tokens (no drafter that copies earlier text can do better).
Printed: output tokens per decode forward (accepted drafts plus the bonus token; the first token comes from the
prefill) and drafted rows per forward (what a verify step adds to a plain one). With --outputs the greedy outputs are
kept in (or read from) that file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculative_ngram import workloads  # noqa: E402

from sglang.srt.managers.scheduler.speculative import DraftState  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.ngram_cache import NgramCache, TokenIndex, propose_draft  # noqa: E402
from sglang.srt.speculative.ngram_tree import TreeShape  # noqa: E402

WORKLOADS = ("copy-heavy", "free")


def greedy_outputs(model: str, max_new: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """workload -> (prompt ids, greedy output ids) per prompt."""
    import sglang as sgl

    engine = sgl.Engine(model_path=model, log_level="warning")
    try:
        tokenizer = engine.tokenizer_manager.tokenizer
        out = {}
        for name in WORKLOADS:
            prompts = workloads()[name]
            results = engine.generate(prompts, {"temperature": 0, "max_new_tokens": max_new})
            out[name] = [(tokenizer.encode(p, add_special_tokens=False), r["output_ids"])
                         for p, r in zip(prompts, results)]
        return out
    finally:
        engine.shutdown()


def oracle_run(seq: list[int], coming: list[int], most: int) -> int:
    """The longest prefix (at most `most`) of `coming` that occurs in `seq`."""
    best = 0
    for start in range(len(seq)):
        n = 0
        while n < most and start + n < len(seq) and n < len(coming) and seq[start + n] == coming[n]:
            n += 1
        best = max(best, n)
    return best


def replay(cases: list[tuple[list[int], list[int]]], draft_tokens: int, drafter: str) -> tuple[float, float]:
    """(output tokens per decode forward, drafted rows per forward) over `cases`, one request after another."""
    defaults = ServerArgs(model_path="-")
    low, high = defaults.speculative_ngram_min_match_window_size, defaults.speculative_ngram_max_match_window_size
    shape = TreeShape("BFS", 1, 1, low, high, defaults.speculative_ngram_branch_length)
    shared = NgramCache(low, high, defaults.speculative_ngram_capacity)
    most = draft_tokens - 1
    tokens = forwards = rows = 0
    for prompt, output in cases:
        index = TokenIndex(low, high)
        index.extend(prompt + output[:1])
        state = DraftState(index, most)
        pos = 1
        while pos < len(output):
            coming = output[pos:]
            if drafter == "oracle":
                accepted, drafted = oracle_run(index.tokens, coming, most), 0
            else:
                chain: list[int] = []
                if drafter == "server" and state.skip > 0:
                    state.skip -= 1
                else:
                    tree = propose_draft(index, shared, state.budget if drafter == "server" else most, shape)
                    chain = tree.tokens if len(tree) else []
                accepted = 0
                while accepted < len(chain) and accepted < len(coming) and chain[accepted] == coming[accepted]:
                    accepted += 1
                drafted = len(chain)
                if chain and drafter == "server":
                    state.update(accepted, drafted, most)
            gained = min(accepted + 1, len(coming))
            index.extend(coming[:gained])
            pos += gained
            tokens += gained
            forwards += 1
            rows += drafted
        shared.add(prompt + output)
    return tokens / max(forwards, 1), rows / max(forwards, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 3, 4, 8, 16])
    parser.add_argument("--outputs", type=Path, default=None, help="keep / reuse the greedy outputs in this file")
    args = parser.parse_args()
    if args.outputs is not None and args.outputs.is_file():
        outputs = json.loads(args.outputs.read_text())
    else:
        outputs = greedy_outputs(args.model, args.max_new_tokens)
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(outputs))
    print(f"# {args.model}, greedy, {args.max_new_tokens} new tokens: output tokens per decode forward "
          "(drafted rows per forward)")
    print("\n| workload | tokens per step | server | fixed | oracle |")
    print("|---|---:|---:|---:|---:|")
    for name in WORKLOADS:
        for n in args.draft_tokens:
            cells = [replay(outputs[name], n, d) for d in ("server", "fixed", "oracle")]
            print(f"| {name} | {n} | " + " | ".join(f"{t:.2f} ({r:.2f})" if d != "oracle" else f"{t:.2f}"
                                                   for (t, r), d in zip(cells, ("server", "fixed", "oracle")))
                  + " |")


if __name__ == "__main__":
    main()

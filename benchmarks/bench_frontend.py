"""Frontend-language programs with and without the radix cache.

    python benchmarks/bench_frontend.py [--model-path ...] [--fork-programs 8] [--few-shot-programs 24]
                                        [--append-results benchmarks/RESULTS.md]

Two programs, each run as one `run_batch` against a server started with and then without
`--disable-radix-cache` (the same server arguments otherwise, one server at a time):
  fork-heavy  a ~400-token document, a question, `fork(4)` branches that each write one step (16 tokens),
              then a 16-token conclusion over the joined steps (SGLang's tree-of-thought shape)
  few-shot    five worked examples (~450 tokens) before each of many questions, 8-token answers
Printed per workload and setting: wall time, programs/s, generated tokens/s and the cache hit rate
(cached prompt tokens / prompt tokens over the programs' generation requests, from their `meta_info`; the
max_new_tokens=0 requests that commit a shared prefix are not counted).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from sglang import assistant, function, gen, system, user
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process

DOCUMENT = " ".join(
    f"Section {i}: the city council reviewed proposal {i} about parks, transport and housing, and asked for "
    f"a cost estimate before the next meeting." for i in range(1, 15)
)
EXAMPLES = [
    ("What is 12 plus 7?", "19"), ("What is 9 times 8?", "72"), ("What is 100 minus 37?", "63"),
    ("What is 144 divided by 12?", "12"), ("What is 15 plus 26?", "41"),
]
FEW_SHOT = "Answer each arithmetic question with a number only.\n\n" + "".join(
    f"Question: {q} Think about the numbers carefully, then give the result.\nAnswer: {a}\n\n"
    for q, a in EXAMPLES * 3
)


@function
def fork_heavy(s, question):
    s += system("You are a careful analyst. Read the document and reason step by step.\n\n" + DOCUMENT)
    s += user(question)
    forks = s.fork(4)
    for i, f in enumerate(forks):
        f += assistant(f"Step {i + 1}: " + gen("step", max_tokens=16, ignore_eos=True))
    forks.join()
    s += assistant("Conclusion: " + gen("conclusion", max_tokens=16, ignore_eos=True))
    return forks


@function
def few_shot(s, question):
    s += FEW_SHOT
    s += f"Question: {question} Think about the numbers carefully, then give the result.\nAnswer:"
    s += gen("answer", max_tokens=8, ignore_eos=True)


def fork_args(n: int) -> list[dict]:
    return [{"question": f"What should the council do first about proposal {i % 14 + 1}, and why?"} for i in range(n)]


def few_shot_args(n: int) -> list[dict]:
    return [{"question": f"What is {13 + i} plus {29 + 2 * i}?"} for i in range(n)]


def run_workload(endpoint: RuntimeEndpoint, program: Any, batch: list[dict],
                 collect: Callable[[Any], list[dict]]) -> dict:
    endpoint.flush_cache()
    start = time.perf_counter()
    states = program.run_batch(batch, temperature=0, backend=endpoint, num_threads=len(batch))
    metas = [m for state in states for m in collect(state)]  # waits for every program to finish
    wall = time.perf_counter() - start
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    generated = sum(m["completion_tokens"] for m in metas)
    return {"wall_s": wall, "programs_per_s": len(batch) / wall, "gen_tok_per_s": generated / wall,
            "cache_hit_rate": cached / prompt if prompt else 0.0, "requests": len(metas), "prompt_tokens": prompt}


def collect_fork_heavy(state: Any) -> list[dict]:
    """The conclusion's meta_info plus each branch's (the program returns its fork states)."""
    metas = [state.get_meta_info("conclusion")]
    metas += [f.get_meta_info("step") for f in state.ret_value]
    return metas


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"]
                    return " ".join(x for x in wanted if x in flags)
    except OSError:
        pass
    return "unknown"


def cpu_model() -> str:
    from sglang.srt.model_loader.dtype import cpu_model_name

    return cpu_model_name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--fork-programs", type=int, default=8)
    parser.add_argument("--few-shot-programs", type=int, default=24)
    parser.add_argument("--server-args", nargs="*", default=[], help="extra flags for both servers")
    parser.add_argument("--append-results", default=None, help="append a markdown section to this file")
    args = parser.parse_args()

    workloads = {
        "fork-heavy": (fork_heavy, fork_args(args.fork_programs), collect_fork_heavy),
        "few-shot": (few_shot, few_shot_args(args.few_shot_programs), lambda s: [s.get_meta_info("answer")]),
    }
    results: dict[str, dict[str, dict]] = {name: {} for name in workloads}
    for setting, extra in (("radix cache", []), ("--disable-radix-cache", ["--disable-radix-cache"])):
        port = find_free_port()
        base_url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix="bench-frontend-", suffix=".log", delete=False)
        proc = popen_launch_server(args.model_path, base_url, other_args=[*extra, *args.server_args],
                                   log_path=log.name)
        try:
            endpoint = RuntimeEndpoint(base_url)
            for name, (program, batch, collect) in workloads.items():
                run_workload(endpoint, program, batch[:2], collect)  # warm-up, not measured
                results[name][setting] = run_workload(endpoint, program, batch, collect)
                r = results[name][setting]
                print(f"{name:11s} {setting:22s} wall {r['wall_s']:7.2f} s  {r['programs_per_s']:6.2f} programs/s  "
                      f"{r['gen_tok_per_s']:7.1f} gen tok/s  cache hit {r['cache_hit_rate']:.1%}  "
                      f"({r['requests']} requests, {r['prompt_tokens']} prompt tokens)", flush=True)
        finally:
            terminate_process(proc)
            os.unlink(log.name)

    lines = []
    for name in workloads:
        on, off = results[name]["radix cache"], results[name]["--disable-radix-cache"]
        ratio = on["programs_per_s"] / off["programs_per_s"]
        lines.append((name, on, off, ratio))
        print(f"{name}: throughput with / without radix cache = {ratio:.2f}x, "
              f"cache hit rate {on['cache_hit_rate']:.1%} vs {off['cache_hit_rate']:.1%}")
    if args.append_results:
        append_results(args, lines)


def append_results(args: argparse.Namespace, lines: list) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    out = [
        f"\n## Frontend language: fork-heavy and few-shot programs, radix cache on / off ({now:%Y-%m-%d})\n",
        f"`python benchmarks/bench_frontend.py --fork-programs {args.fork_programs} "
        f"--few-shot-programs {args.few_shot_programs}"
        + (f" --server-args {' '.join(args.server_args)}" if args.server_args else "") + "`, "
        f"{now:%H:%M} UTC, {cpu_model()}, {os.cpu_count()} CPUs, flags: {cpu_flags()}. "
        "One server at a time, same arguments except `--disable-radix-cache`; every program is one `run_batch` "
        "item with all items concurrent, temperature 0, `ignore_eos`. Cache hit rate = cached prompt tokens / "
        "prompt tokens over the generation requests (`meta_info`), prefix-commit requests not counted.\n",
        "| workload | programs | radix: programs/s | radix: cache hit | no radix: programs/s | "
        "no radix: cache hit | throughput ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, on, off, ratio in lines:
        n = args.fork_programs if name == "fork-heavy" else args.few_shot_programs
        out.append(f"| {name} | {n} | {on['programs_per_s']:.2f} | {on['cache_hit_rate']:.1%} | "
                   f"{off['programs_per_s']:.2f} | {off['cache_hit_rate']:.1%} | **{ratio:.2f}x** |")
    with open(args.append_results, "a") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

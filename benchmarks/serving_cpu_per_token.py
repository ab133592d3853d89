"""CPU time per streamed token of each server process (HTTP, scheduler, detokenizer) and of the client, for one
greedy request streamed at a time.

    python benchmarks/serving_cpu_per_token.py [--tokens 400] [--reps 3] [--route native|openai] [-- SERVER FLAGS...]

Starts a server on a free port, streams --tokens tokens (`ignore_eos`) --reps times, and prints per rep the time
per output token seen by the client and the CPU milliseconds per token of every process of the server's tree
(user + system time from psutil, sampled before and after the request).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psutil
import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from server_fixtures import running_server  # noqa: E402


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def role(p: psutil.Process, server_pid: int, rss_max: int) -> str:
    if p.pid == server_pid:
        return "http"
    cmd = " ".join(p.cmdline())
    if "resource_tracker" in cmd:
        return "resource tracker"
    if p.memory_info().rss == rss_max:
        return "scheduler"
    return "detokenizer / fork server"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--route", choices=["native", "openai"], default="openai")
    parser.add_argument("flags", nargs="*")
    args = parser.parse_args()
    with running_server(*args.flags) as url:
        server = next(c for c in psutil.Process().children() if "launch_server" in " ".join(c.cmdline()))
        tree = [server, *server.children(recursive=True)]
        rss_max = max(p.memory_info().rss for p in tree)
        roles = {p.pid: role(p, server.pid, rss_max) for p in tree}
        if args.route == "openai":
            route, body = "/v1/completions", {"model": "default", "prompt": "Tell me a long story about a dragon.",
                                              "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True,
                                              "stream": True}
        else:
            route, body = "/generate", {"text": "Tell me a long story about a dragon.", "stream": True,
                                        "sampling_params": {"max_new_tokens": args.tokens, "temperature": 0,
                                                            "ignore_eos": True}}
        requests.post(url + route, json={**body, "stream": False}, timeout=300)  # warm
        for rep in range(args.reps):
            before = {p.pid: cpu_seconds(p) for p in tree}
            client_before = time.process_time()
            arrivals = []
            with requests.post(url + route, json=body, stream=True, timeout=300) as r:
                for line in r.iter_lines():
                    if line:
                        arrivals.append(time.perf_counter())
            client = (time.process_time() - client_before) / args.tokens * 1e3
            after = {p.pid: cpu_seconds(p) for p in tree}
            per_token = (arrivals[-2] - arrivals[0]) / max(1, len(arrivals) - 3) * 1e3  # excluding [DONE]
            parts = ", ".join(f"{roles[pid]} {(after[pid] - before[pid]) / args.tokens * 1e3:.3f}"
                              for pid in after if after[pid] > before[pid])
            print(f"rep {rep + 1}: {per_token:.2f} ms per token; CPU ms per token: {parts}, client {client:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()

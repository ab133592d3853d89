"""Time per streamed token of the servers of two or more checkouts, side by side: every server runs at once, one
greedy request is streamed at a time, and the servers take turns, in reversed order every other round.

    python benchmarks/serving_ab_stream.py --checkout before=/work/before --checkout after=. \
        [--tokens 300] [--rounds 6] [--log-dir DIR] [-- SERVER FLAGS...]

Each server is `python -m sglang.launch_server` run from its checkout's root (so it imports that checkout) with the
same flags, started in the order given; an idle server waits on its sockets. The first token is left out of each
request's figure (it includes the prefill). On a VM whose speed drifts, turns keep the servers' figures comparable;
the order the servers were started in can still shift them by a few percent, so a comparison is worth running a
second time with the --checkout arguments swapped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sglang.test.test_utils import find_free_port  # noqa: E402
from sglang.utils import terminate_process, wait_until_healthy  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def start(label: str, checkout: Path, flags: list[str], log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = find_free_port()
    log = open(log_dir / f"{label}.server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--port", str(port),
                             *flags], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)}, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, 600, lambda: None if proc.poll() is None else f"{label} exited ({proc.returncode})")
    except BaseException:
        terminate_process(proc)
        raise
    return proc, url


def ms_per_token(url: str, tokens: int) -> float:
    body = {"text": "Tell me a long story about a dragon.", "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    arrivals = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line and line != b"data: [DONE]":
                arrivals.append(time.perf_counter())
    return (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", required=True, help="LABEL=PATH, two or more")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    parser.add_argument("flags", nargs="*", help="server flags, after --")
    args = parser.parse_args()
    checkouts = [(label, Path(path).resolve()) for label, path in (c.split("=", 1) for c in args.checkout)]
    log_dir = Path(args.log_dir) if args.log_dir else Path(os.environ.get("TMPDIR", "/tmp")) / "serving_ab_stream"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for label, path in checkouts:
            servers[label] = start(label, path, args.flags, log_dir)
        for _, url in servers.values():
            ms_per_token(url, 32)  # warm
        figures: dict[str, list[float]] = {label: [] for label in servers}
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            for label in order:
                figures[label].append(ms_per_token(servers[label][1], args.tokens))
            print(f"round {rnd + 1}: " + ", ".join(f"{label} {figures[label][-1]:.2f}" for label in order), flush=True)
        print(f"{args.tokens} streamed tokens per request, {args.rounds} requests per server, flags: {args.flags}")
        for label, values in figures.items():
            print(f"{label}: median {statistics.median(values):.2f} ms per token "
                  f"(min {min(values):.2f}, max {max(values):.2f})")
    finally:
        for proc, _ in servers.values():
            terminate_process(proc)


if __name__ == "__main__":
    main()

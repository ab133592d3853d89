"""Server start and stop times: `python -m sglang.launch_server` until /health answers 200 (after the warm-up
request), then SIGTERM until the whole process tree (workers, fork server, resource tracker) is gone. With
`--engine`: three `Engine`s one after the other in one fresh process, each timed from construction to the end of a
first 8-token generation, then its shutdown.

    python benchmarks/bench_startup.py [--runs 5] [--engine] [--checkout DIR] [-- SERVER FLAGS...]

`--checkout` runs another checkout's server (its root goes first on PYTHONPATH) with this script, for a before /
after comparison in one run; the runs of the checkouts alternate. Prints one line per run and the medians.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil

from sglang.utils import wait_until_healthy

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(checkout: str, flags: list[str]) -> tuple[float, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": checkout}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", MODEL, "--host",
                             "127.0.0.1", "--port", str(port), *flags], cwd=checkout, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(url, 600, lambda: None if proc.poll() is None else f"exited with {proc.returncode}")
        ready = time.perf_counter() - start
        parent = psutil.Process(proc.pid)
        tree = [parent, *parent.children(recursive=True)]
        stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=30)
        if alive:
            raise RuntimeError(f"{len(alive)} process(es) still alive 30 s after SIGTERM")
        return ready, time.perf_counter() - stop
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


ENGINE_RUN = """
import json, sys, time
from sglang.srt.entrypoints.engine import Engine
rows = []
for _ in range(3):
    start = time.perf_counter()
    engine = Engine(model_path=sys.argv[1], log_level="error")
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    ready = time.perf_counter() - start
    stop = time.perf_counter()
    engine.shutdown()
    rows.append((ready, time.perf_counter() - stop))
print(json.dumps(rows))
"""


def engine_runs(checkout: str) -> list[tuple[float, float]]:
    import json

    done = subprocess.run([sys.executable, "-c", ENGINE_RUN, MODEL], cwd=checkout, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": checkout}, timeout=600, check=True)
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="time in-process Engines instead of servers")
    parser.add_argument("--checkout", action="append", default=[],
                        help="another checkout to measure (repeatable); this one is always measured")
    parser.add_argument("flags", nargs="*", help="server flags (after --)")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkouts = [os.path.abspath(c) for c in args.checkout] + [here]
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in checkouts}
    for run in range(args.runs):
        for c in checkouts:
            for i, (ready, stop) in enumerate(engine_runs(c) if args.engine else [one_run(c, args.flags)]):
                results[c].append((ready, stop))
                label = f"engine {i + 1} of its process, " if args.engine else ""
                print(f"run {run + 1} {c}: {label}ready {ready:.2f} s, stopped {stop:.2f} s", flush=True)
    for c, rows in results.items():
        print(f"{c}: median ready {statistics.median(r for r, _ in rows):.2f} s "
              f"(min {min(r for r, _ in rows):.2f}), median stop {statistics.median(s for _, s in rows):.2f} s")


if __name__ == "__main__":
    main()

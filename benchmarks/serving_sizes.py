"""Serving workloads at realistic model sizes, one server at a time, with the resident memory of its processes.

Starts a server (ours, vLLM-CPU or llama.cpp's llama-server) on a checkpoint written by make_random_checkpoints.py,
waits for it, runs the workloads with the repository's bench_serving client, samples the resident memory (RSS) of
the server's whole process tree every half second, stops it and appends one JSON line per workload to --out:

  1-at-a-time   4 prompts of 100 random token ids, 32 output tokens (ignore_eos), concurrency 1
  16-concurrent 32 prompts of 100 ids, 32 output tokens, concurrency 16
  64-concurrent 128 prompts of 100 ids, 32 output tokens, concurrency 64
  prefill       4 prompts of 900 ids (about 700 words), 1 output token, one at a time
  long          8 prompts of 4000 ids, 32 output tokens, concurrency 8 (how many long requests the KV pools hold
                at once: the server log's #running-req)

  python benchmarks/serving_sizes.py --engine ours --model ~/.cache/sglang-lite/bench-models/smollm2-1.7b \
      --out benchmarks/results/sizes.jsonl [--label main] [--workloads prefill,1] [-- extra server flags]
  --engine vllm --python /path/to/vllm-venv/bin/python      (vLLM-CPU with the flags of benchmarks/RESULTS.md)
  --engine llamacpp --llama-server /path/to/llama-server --model /path/to/model.Q8_0.gguf

Each line holds the client's figures (output tok/s, median TTFT / TPOT, ...), the workload, the engine, the label,
the load average before the workload, the peak and final RSS of the server tree in bytes, and the server's
/get_server_info `weights`, `kv_pools`, `max_total_num_tokens` and `arithmetic` where it has them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TOKENIZER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # every shape of make_random_checkpoints.py uses its vocabulary
RANDOM = ["--dataset-name", "random-ids", "--random-range-ratio", "1.0"]
WORKLOADS = {
    "1": [*RANDOM, "--random-input-len", "100", "--random-output-len", "32", "--num-prompts", "4",
          "--max-concurrency", "1", "--seed", "51"],
    "16": [*RANDOM, "--random-input-len", "100", "--random-output-len", "32", "--num-prompts", "32",
           "--max-concurrency", "16", "--seed", "52"],
    "64": [*RANDOM, "--random-input-len", "100", "--random-output-len", "32", "--num-prompts", "128",
           "--max-concurrency", "64", "--seed", "53"],
    "prefill": [*RANDOM, "--random-input-len", "900", "--random-output-len", "1", "--num-prompts", "4",
                "--max-concurrency", "1", "--seed", "54"],
    "long": [*RANDOM, "--random-input-len", "4000", "--random-output-len", "32", "--num-prompts", "8",
             "--max-concurrency", "8", "--seed", "55"],
}
SERVER_INFO = ("weights", "kv_pools", "max_total_num_tokens", "arithmetic")


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.last, self.running = pid, 0, 0, True

    def run(self) -> None:
        while self.running:
            self.last = tree_rss(self.pid)
            self.peak = max(self.peak, self.last)
            time.sleep(0.5)


def server_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str], str]:
    """(command, environment, bench_serving backend) of the server to measure."""
    env = dict(os.environ)
    if args.engine == "ours":
        cmd = [args.python or sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
               "--port", str(port), "--log-level", "info", *args.server_args]
        env = with_repo_path(env)
        return cmd, env, "sglang-oai"
    if args.engine == "vllm":
        venv = Path(args.python).resolve().parent.parent
        iomp = next(venv.rglob("libiomp5.so"), None)
        if iomp is not None:
            env["LD_PRELOAD"] = str(iomp)
        env.update(VLLM_CPU_OMP_THREADS_BIND=args.cpus, VLLM_CPU_KVCACHE_SPACE="4")
        cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(port),
               "--dtype", "bfloat16", "--served-model-name", TOKENIZER, *args.server_args]
        return cmd, env, "vllm"
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-np", "64",
           "-c", str(64 * 1024), *args.server_args]
    return cmd, env, "openai"


def with_repo_path(env) -> dict:
    """`env` with the repository first on PYTHONPATH (and whatever was there after it)."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])}


def client_tokenizer(model: str) -> str:
    """The checkpoint's own tokenizer files where its folder has them (no package needed), else SmolLM2's."""
    folder = Path(model).expanduser()
    folder = folder if folder.is_dir() else folder.parent
    return str(folder) if (folder / "tokenizer.json").is_file() else TOKENIZER


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the server did not answer {url}/health in {timeout:.0f} s")


def server_info(url: str) -> dict:
    """The SERVER_INFO fields of /get_server_info (None where the server has no such field or endpoint)."""
    try:
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
            info = json.load(r)
    except (OSError, ValueError):
        info = {}
    return {key: info.get(key) for key in SERVER_INFO}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["ours", "vllm", "llamacpp"], default="ours")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--workloads", default="1,16,64,prefill")
    parser.add_argument("--python", default=None, help="the Python of the engine's venv (vLLM: required)")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--cpus", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--port", type=int, default=31890)
    parser.add_argument("--ready-timeout", type=float, default=1800)
    parser.add_argument("server_args", nargs="*", help="extra server flags (after --)")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    cmd, env, backend = server_command(args, args.port)
    log = open(Path(args.out).with_suffix(f".{args.engine}{('-' + args.label) if args.label else ''}.log"), "w")
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE, start_new_session=True)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        wait_ready(url, proc, args.ready_timeout)
        ready_s = time.time() - started
        info = server_info(url)
        for name in args.workloads.split(","):
            load_before = os.getloadavg()  # a figure taken while something else ran is no figure
            tmp = Path(args.out).with_suffix(".tmp.jsonl")
            tmp.unlink(missing_ok=True)
            client = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
                      "--disable-tqdm", "--tokenizer", client_tokenizer(args.model), "--model", TOKENIZER,
                      "--output-file", str(tmp),
                      *WORKLOADS[name]]
            subprocess.run(client, check=True, cwd=HERE, env=with_repo_path(os.environ),
                           stdout=subprocess.DEVNULL)
            result = json.loads(tmp.read_text().splitlines()[-1])
            tmp.unlink()
            row = {**info, **result,  # the client's own "model" (the tokenizer it counted with) gives way to ours
                   "engine": args.engine, "label": args.label, "model": args.model, "workload": name,
                   "ready_s": round(ready_s, 1), "load_avg_before": load_before, "rss_peak": sampler.peak,
                   "rss_now": sampler.last, "date": time.strftime("%Y-%m-%d %H:%M")}
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{args.engine} {args.label} {name}: output {result.get('output_throughput', 0):.1f} tok/s, "
                  f"median TTFT {result.get('median_ttft_ms', 0):.0f} ms, median TPOT "
                  f"{result.get('median_tpot_ms', 0):.1f} ms, RSS peak {sampler.peak / 1e9:.2f} GB", flush=True)
    finally:
        sampler.running = False
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's whole session: its workers too
            proc.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


if __name__ == "__main__":
    main()

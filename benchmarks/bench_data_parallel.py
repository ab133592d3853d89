"""Data parallelism: throughput of one replica vs two, and the prefix-cache hit rate of each balancing method.

    python benchmarks/bench_data_parallel.py [--model-path ...] [--groups 8] [--per-group 8] [--concurrency 16]
                                             [--output-len 32] [--configs dp1,round_robin,shortest_queue,cache_aware]

Workload: `groups` groups of `per-group` prompts; the prompts of a group share a ~300-token prefix and end in a
short distinct question. The prompts are shuffled (fixed seed) and sent `concurrency` at a time to `/generate`
(greedy, `output-len` tokens, ignore_eos). Servers run one after another with the same flags; each config is a
server: `dp1` (--dp-size 1) or a --load-balance-method of --dp-size 2. Printed per config: wall time, requests/s,
output tokens/s and the cache hit rate (cached prompt tokens / prompt tokens, from each response's meta_info).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process

TOPICS = ["harbor logistics", "orchard irrigation", "violin making", "glacier surveys", "copper mining",
          "falcon training", "canyon hiking", "marble carving", "saffron farming", "thunderstorm forecasting",
          "ribbon weaving", "quartz clocks"]


def workload(groups: int, per_group: int, seed: int = 0) -> list[str]:
    prompts = []
    for g in range(groups):
        topic = TOPICS[g % len(TOPICS)]
        prefix = f"Reference notes {g} on {topic}. " + " ".join(
            f"Note {i}: practitioners of {topic} record step {i} carefully, compare it with earlier seasons "
            f"and keep the results for the annual review." for i in range(12))
        prompts += [f"{prefix}\nQuestion {q}: what does note {q % 12} say about {topic}?" for q in range(per_group)]
    random.Random(seed).shuffle(prompts)
    return prompts


def run_config(model: str, flags: list[str], prompts: list[str], concurrency: int, output_len: int) -> dict:
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-dp-", suffix=".log", delete=False).name
    proc = popen_launch_server(model, url, other_args=flags, log_path=log)
    try:
        params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}

        def one(text: str) -> dict:
            r = requests.post(f"{url}/generate", json={"text": text, "sampling_params": params}, timeout=600)
            r.raise_for_status()
            return r.json()["meta_info"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            metas = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
        states = requests.get(f"{url}/get_server_info", timeout=60).json()["internal_states"]
    finally:
        terminate_process(proc)
        os.unlink(log)
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    return {
        "wall_s": round(wall, 2), "req_per_s": round(len(prompts) / wall, 3),
        "output_tok_per_s": round(sum(m["completion_tokens"] for m in metas) / wall, 1),
        "cache_hit_rate": round(sum(m["cached_tokens"] for m in metas) / prompt_tokens, 3),
        "prompt_tokens": prompt_tokens, "replicas": len(states),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--configs", default="dp1,round_robin,shortest_queue,cache_aware")
    ap.add_argument("--server-args", default="--dtype float32 --cpu-gemm float32 --max-total-tokens 16384 "
                                             "--log-level warning")
    args = ap.parse_args()
    prompts = workload(args.groups, args.per_group)
    print(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "load_avg": os.getloadavg(), "requests": len(prompts), **vars(args)}))
    for config in args.configs.split(","):
        flags = args.server_args.split()
        if config != "dp1":
            flags += ["--dp-size", "2", "--load-balance-method", config]
        result = run_config(args.model_path, flags, prompts, args.concurrency, args.output_len)
        print(json.dumps({"config": config, **result, "load_avg_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()

"""Interactive chat latency while a large batch file runs (Batches API).

    python benchmarks/bench_batch_latency.py [--url http://127.0.0.1:30000] [--batch-lines 1000]
        [--requests 100] [--batch-max-inflight 16] [--model-path HuggingFaceTB/SmolLM2-135M-Instruct]

Without --url a server is started (with --batch-max-inflight and a temporary --file-storage-path) and stopped.
Three phases, each sending the same streamed chat requests one after another (a short pause between them) and
timing the first streamed chunk (TTFT: the chunk comes with the first generated token):
  idle       nothing else runs
  batch      a --batch-lines batch (chat lines, --batch-max-tokens each) is in progress
  online     the same lines sent instead as online requests by a client keeping --online-concurrency in flight,
             at normal priority: what the batch work would cost interactive traffic without its in-flight bound
             and lower priority
Printed: p50/p90/p99/max TTFT per phase, and how many batch lines finished during the batch phase.
The batch is cancelled after its phase, so the run stays short.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time

import openai


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs: list[float]) -> dict:
    ms = [x * 1000 for x in xs]
    return {"n": len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99),
            "max": max(ms), "mean": statistics.fmean(ms)}


def batch_line(i: int, model: str, max_tokens: int) -> dict:
    return {"custom_id": f"bench-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                     "messages": [{"role": "system", "content": f"{i}: You are a helpful AI assistant"},
                                  {"role": "user", "content": "Write a detailed story about topic. Make it long."}]}}


async def interactive(client: openai.AsyncOpenAI, model: str, n: int, max_tokens: int, pause: float) -> list[float]:
    ttfts = []
    for i in range(n):
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Question {i}: name a colour."}],
            max_tokens=max_tokens, temperature=0, stream=True)
        first = None
        async for _chunk in stream:
            if first is None:
                first = time.perf_counter() - start
        ttfts.append(first)
        await asyncio.sleep(pause)
    return ttfts


async def online_load(client: openai.AsyncOpenAI, lines: list[dict], concurrency: int, stop: asyncio.Event) -> int:
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(line: dict) -> None:
        nonlocal done
        async with sem:
            if stop.is_set():
                return
            body = dict(line["body"])
            extra = {"ignore_eos": body.pop("ignore_eos")}
            await client.chat.completions.create(**body, extra_body=extra)
            done += 1

    tasks = [asyncio.ensure_future(one(x)) for x in lines]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return done


async def run(args: argparse.Namespace, url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="None", max_retries=0, timeout=600)
    model = args.model_path
    await interactive(client, model, 3, args.max_tokens, 0)  # warm-up
    results: dict = {"idle": summary(await interactive(client, model, args.requests, args.max_tokens, args.pause))}

    lines = [batch_line(i, model, args.batch_max_tokens) for i in range(args.batch_lines)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = await client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    while (b := await client.batches.retrieve(batch.id)).request_counts.completed == 0:
        await asyncio.sleep(0.2)  # measure once the batch is in full swing
    before = b.request_counts.completed
    t0 = time.perf_counter()
    results["batch"] = summary(await interactive(client, model, args.requests, args.max_tokens, args.pause))
    elapsed = time.perf_counter() - t0
    b = await client.batches.retrieve(batch.id)
    results["batch"]["lines_done_during"] = b.request_counts.completed - before
    results["batch"]["lines_per_s"] = (b.request_counts.completed - before) / elapsed
    await client.batches.cancel(batch.id)
    while (await client.batches.retrieve(batch.id)).status != "cancelled":
        await asyncio.sleep(0.2)

    if not args.skip_online:
        stop = asyncio.Event()
        load = asyncio.ensure_future(online_load(client, lines, args.online_concurrency, stop))
        await asyncio.sleep(5)
        t0 = time.perf_counter()
        results["online"] = summary(await interactive(client, model, args.online_requests, args.max_tokens,
                                                      args.pause))
        elapsed = time.perf_counter() - t0
        stop.set()
        done = await load
        results["online"]["lines_per_s_overall"] = done / (elapsed + 5)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="an already running server (else one is started)")
    p.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--batch-lines", type=int, default=1000)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--batch-max-inflight", type=int, default=16)
    p.add_argument("--requests", type=int, default=100, help="interactive requests per phase")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per interactive request")
    p.add_argument("--pause", type=float, default=0.1, help="seconds between interactive requests")
    p.add_argument("--online-concurrency", type=int, default=64)
    p.add_argument("--online-requests", type=int, default=30, help="interactive requests in the online phase")
    p.add_argument("--skip-online", action="store_true")
    args = p.parse_args()
    if args.url:
        results = asyncio.run(run(args, args.url))
    else:
        from sglang.test.test_utils import find_free_port, popen_launch_server
        from sglang.utils import terminate_process

        url = f"http://127.0.0.1:{find_free_port()}"
        with tempfile.TemporaryDirectory() as storage:
            proc = popen_launch_server(args.model_path, url, other_args=[
                "--log-level", "warning", "--file-storage-path", storage,
                "--batch-max-inflight", str(args.batch_max_inflight)])
            try:
                results = asyncio.run(run(args, url))
            finally:
                terminate_process(proc)
    print(json.dumps({"args": vars(args), "results": results}, indent=2))
    for phase, r in results.items():
        print(f"{phase:>7}: TTFT p50 {r['p50']:.0f} ms, p90 {r['p90']:.0f} ms, p99 {r['p99']:.0f} ms, "
              f"max {r['max']:.0f} ms (n={r['n']})")


if __name__ == "__main__":
    main()

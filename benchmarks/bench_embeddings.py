"""Sentence embeddings per second for all-MiniLM-L6-v2 at batch 1 and 64, side by side on the same inputs.

    python benchmarks/bench_embeddings.py [--num-sentences 256] [--batch1-sentences 64] [--no-server]

On a machine shared with other work, run it with OMP_NUM_THREADS=1 (inherited by the servers it starts): with
more OpenMP threads than free cores every row spends its time in thread barriers, and the figures say more about
the load than about the code.

Rows (all float32 unless the name says otherwise; tokenization is included everywhere):
  transformers            AutoModel + padded batch + mean pooling + normalize (what a user writes by hand)
  sentence-transformers   SentenceTransformer(...).encode(batch, batch_size=B), when the package is importable
  ours: runner            ModelRunner.pool in this process (flat unpadded batch, no HTTP)
  ours: server            --is-embedding server, POST /v1/embeddings with B strings per request (one at a time)
  ours: server, auto      the same with --dtype auto (bf16 on CPUs with native bf16)
Each row is the best of --repeats passes over the same sentences, passes of all rows interleaved; the cosine of every row's vectors
against the transformers row is checked (> 0.999) so a fast wrong answer cannot pass.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import types
from collections.abc import Callable

import requests
import torch
import torch.nn.functional as F

from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.resolve import resolve_model_path

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WORDS = ("the a of to and in is was for on that with as by at from it an be this are or which his her their one "
         "model server request vector sentence token batch quickly slowly quiet river mountain city music paper "
         "green blue small large ancient modern learning network graph search answer question result").split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "." for _ in range(n)]


Encoder = Callable[[list[str]], torch.Tensor]


def transformers_encoder(model_dir: str) -> Encoder:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def encode(batch: list[str]) -> torch.Tensor:
        enc = tokenizer(batch, padding=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    return encode


def sentence_transformers_encoder(model_dir: str) -> Encoder | None:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    model = SentenceTransformer(model_dir, device="cpu")

    def encode(batch: list[str]) -> torch.Tensor:
        return model.encode(batch, batch_size=len(batch), convert_to_tensor=True)

    return encode


def runner_encoder(model_dir: str) -> Encoder:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = ModelRunner(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    spec = runner.kv_cache_spec()
    # Encoders never touch the KV pool; a one-slot pool satisfies the ForwardBatch fields.
    pool = KVPool(1, spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32)

    def encode(batch: list[str]) -> torch.Tensor:
        ids = tokenizer(batch)["input_ids"]
        lens = [len(x) for x in ids]
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(ids),
            input_ids=torch.tensor([t for x in ids for t in x]),
            positions=build_positions([0] * len(ids), lens, torch.device("cpu")),
            req_pool_indices=torch.zeros(len(ids), dtype=torch.int64), seq_lens=torch.tensor(lens),
            out_cache_loc=torch.zeros(sum(lens), dtype=torch.int64), seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[0] * len(ids), extend_seq_lens_cpu=lens,
            req_to_token_pool=types.SimpleNamespace(req_to_token=None),  # type: ignore[arg-type]
            token_to_kv_pool=pool,
        )
        return runner.pool(forward_batch)

    return encode


def server_encoder(url: str) -> Encoder:
    session = requests.Session()

    def encode(batch: list[str]) -> torch.Tensor:
        r = session.post(url + "/v1/embeddings", json={"input": batch, "model": MODEL, "encoding_format": "float"})
        r.raise_for_status()
        return torch.tensor([d["embedding"] for d in r.json()["data"]])

    return encode


def timed_pass(encode: Encoder, sentences: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    """(seconds, vectors) of one pass over `sentences` in batches of `batch_size`."""
    start = time.perf_counter()
    out = [encode(sentences[i : i + batch_size]) for i in range(0, len(sentences), batch_size)]
    return time.perf_counter() - start, torch.cat(out).float()


def launch(dtype: str):
    from sglang.test.test_utils import find_free_port, popen_launch_server

    url = f"http://127.0.0.1:{find_free_port()}"
    log = tempfile.NamedTemporaryFile(prefix="bench-embeddings-server-", suffix=".log", delete=False)
    proc = popen_launch_server(MODEL, url, other_args=["--is-embedding", "--dtype", dtype], log_path=log.name)
    return url, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sentences", type=int, default=256, help="sentences for the batch-64 rows")
    parser.add_argument("--batch1-sentences", type=int, default=64, help="sentences for the batch-1 rows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-server", action="store_true", help="skip the HTTP rows")
    args = parser.parse_args()
    from sglang.utils import terminate_process

    model_dir = resolve_model_path(MODEL)
    sentences = make_sentences(args.num_sentences)
    print(f"torch threads: {torch.get_num_threads()}, {len(sentences)} sentences, "
          f"{sum(len(s.split()) for s in sentences) / len(sentences):.1f} words on average")
    encoders: list[tuple[str, Callable[[], tuple[Encoder | None, object]]]] = [
        ("transformers", lambda: (transformers_encoder(model_dir), None)),
        ("sentence-transformers", lambda: (sentence_transformers_encoder(model_dir), None)),
        ("ours: runner", lambda: (runner_encoder(model_dir), None)),
    ]
    if not args.no_server:
        for label, dtype in (("ours: server", "float32"), ("ours: server, auto", "auto")):
            def start(dtype: str = dtype) -> tuple[Encoder, object]:
                url, proc = launch(dtype)
                return server_encoder(url), proc
            encoders.append((label, start))
    # Every system is built (servers started) first, then the passes are interleaved round-robin, so that load
    # from other processes on a shared machine falls on all rows alike; each row keeps its best pass.
    built: dict[str, Encoder] = {}
    procs = []
    try:
        for label, build in encoders:
            encode, proc = build()
            if proc is not None:
                procs.append(proc)
            if encode is None:
                print(f"{label}: not installed, skipped")
                continue
            encode(sentences[:64])  # warm-up
            built[label] = encode
        workloads = {1: sentences[: args.batch1_sentences], 64: sentences}
        best: dict[str, dict[int, float]] = {label: {1: float("inf"), 64: float("inf")} for label in built}
        vectors: dict[str, dict[int, torch.Tensor]] = {label: {} for label in built}
        for _ in range(args.repeats):
            for label, encode in built.items():
                for batch_size, subset in workloads.items():
                    seconds, rows = timed_pass(encode, subset, batch_size)
                    best[label][batch_size] = min(best[label][batch_size], seconds)
                    vectors[label][batch_size] = rows
    finally:
        for proc in procs:
            terminate_process(proc)
    results: dict[str, dict[int, float]] = {}
    for label in built:
        results[label] = {}
        for batch_size, subset in workloads.items():
            rows, ref = vectors[label][batch_size], vectors["transformers"][batch_size]
            cos = float(F.cosine_similarity(rows.double(), ref.double(), dim=-1).min())
            assert cos > 0.999, f"{label} batch {batch_size}: vectors differ from transformers (cos {cos})"
            results[label][batch_size] = len(subset) / best[label][batch_size]
            print(f"{label:24s} batch {batch_size:3d}: {results[label][batch_size]:8.1f} sentences/s  "
                  f"(min cosine vs transformers {cos:.6f})", flush=True)
    print("\n| | batch 1 (sent/s) | batch 64 (sent/s) | batch 1 vs transformers | batch 64 vs transformers |")
    print("|---|---:|---:|---:|---:|")
    base = results["transformers"]
    for label, rates in results.items():
        print(f"| {label} | {rates[1]:.1f} | {rates[64]:.1f} | {rates[1] / base[1]:.2f}x | {rates[64] / base[64]:.2f}x |")


if __name__ == "__main__":
    main()

"""Static-batch latency of the model runner without a server: `python -m sglang.bench_one_batch`.

Runs one prefill of `--batch-size` prompts of `--input-len` tokens, then `--output-len` decode steps, and
prints prefill throughput and the median decode step time for each batch size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch

from sglang.srt.layers.small_batch_rows import resolve_small_batch_rows
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.memory_pools import MemoryPools, build_memory_pools
from sglang.srt.model_executor.model_runner import ModelRunner, StepOutput
from sglang.srt.model_loader.model_info import ModelInfo, load_model_info
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def make_reqs(batch_size: int, input_len: int, output_len: int, vocab: int) -> list[Req]:
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(batch_size):
        params = SamplingParams(temperature=0, max_new_tokens=output_len)
        params.normalize(None)
        ids = torch.randint(100, vocab - 1, (input_len,), generator=gen).tolist()
        req = Req(f"bench-{i}", ids, params, stop_token_ids=set(), sampling_seed=i)
        req.init_next_round_input()
        reqs.append(req)
    return reqs


def build_runner(info: ModelInfo, device: str, total_tokens: int, max_requests: int,
                 gguf_kernel_max_rows: Optional[int]) -> tuple[ModelRunner, MemoryPools]:
    """A model runner and its KV memory (with a radix cache), as the scheduler builds them (None rows: the
    arithmetic plan's choice)."""
    rows = resolve_small_batch_rows(gguf_kernel_max_rows, info.arithmetic)
    runner = ModelRunner(info.model_dir, info.hf_config, info.dtype, device, gguf_path=info.gguf_path,
                         gguf_kernel_max_rows=rows, arithmetic=info.arithmetic)
    mem = build_memory_pools(runner.kv_cache_spec(), runner.device, info.context_len, total_tokens, 0.3,
                             max_requests, disable_radix_cache=False)
    runner.bind_kv_pool(mem.kv_pool)
    return runner, mem


def run_step(runner: ModelRunner, mem: MemoryPools, batch: ScheduleBatch) -> StepOutput:
    forward_batch, sampling = batch.forward_inputs(mem, runner.vocab_size, runner.device)
    return runner.forward(forward_batch, sampling)


def timed_prefill(runner: ModelRunner, mem: MemoryPools, batch_size: int, input_len: int) -> float:
    """Seconds of one prefill of `batch_size` random prompts of `input_len` tokens (the forward and sampling); the
    requests are then cached as finished and the memory cleared."""
    reqs = make_reqs(batch_size, input_len, 2, runner.vocab_size)
    batch = ScheduleBatch(reqs, is_decode=False)
    batch.prepare_for_extend(mem)
    start = time.perf_counter()
    run_step(runner, mem, batch)
    elapsed = time.perf_counter() - start
    for req in reqs:
        req.kv_committed_len = len(req.fill_ids)
        mem.tree_cache.cache_finished_req(req)
    mem.clear()
    return elapsed


def prefill_and_decode(runner: ModelRunner, mem: MemoryPools, batch_size: int, input_len: int,
                       decode_steps: int) -> tuple[float, list[float]]:
    """Prefill `batch_size` random prompts, then run `decode_steps` greedy decode steps; (prefill seconds, seconds
    of each decode step). The memory is cleared afterwards."""
    reqs = make_reqs(batch_size, input_len, decode_steps + 1, runner.vocab_size)
    batch = ScheduleBatch(reqs, is_decode=False)
    batch.prepare_for_extend(mem)
    start = time.perf_counter()
    out = run_step(runner, mem, batch)
    prefill_s = time.perf_counter() - start
    for req, tok in zip(reqs, out.sample.next_token_ids.tolist()):
        req.output_ids.append(tok)
        req.kv_committed_len = len(req.fill_ids)
    steps = []
    for _ in range(decode_steps):
        batch = ScheduleBatch(reqs, is_decode=True)
        batch.prepare_for_decode(mem)
        start = time.perf_counter()
        out = run_step(runner, mem, batch)
        steps.append(time.perf_counter() - start)
        for req, tok in zip(reqs, out.sample.next_token_ids.tolist()):
            req.output_ids.append(tok)
    for req in reqs:
        mem.tree_cache.cache_finished_req(req)
    mem.clear()
    return prefill_s, steps


def run_once(runner: ModelRunner, mem: MemoryPools, batch_size: int, input_len: int, output_len: int) -> dict:
    prefill_s, steps = prefill_and_decode(runner, mem, batch_size, input_len, output_len - 1)
    median = statistics.median(steps) if steps else float("nan")
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_s": round(prefill_s, 4), "prefill_tok_s": round(batch_size * input_len / prefill_s, 1),
        "decode_step_ms": round(median * 1000, 2), "decode_tok_s": round(batch_size / median, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--result-file", default=None, help="append one JSON line per batch size")
    parser.add_argument("--gguf-kernel-max-rows", type=int, default=ServerArgs.gguf_kernel_max_rows,
                        help="matmuls of at most this many rows use the GGUF blocks (0: float weights only; "
                             "default: the arithmetic plan's choice)")
    parser.add_argument("--cpu-gemm", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                        help="GEMM for prefill and larger batches with float32 weights (see --cpu-gemm of the server)")
    parser.add_argument("--gguf-activations", default="auto", choices=["auto", "float32", "int8"],
                        help="activations of the GGUF block kernels (see --gguf-activations of the server)")
    parser.add_argument("--small-batch-quantization", default="auto", choices=["auto", "none", "q8_0", "q4_1"],
                        help="Q8_0 blocks for the small batches of a checkpoint without GGUF blocks (see the server)")
    parser.add_argument("--prefill-attention", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="prefill attention over bf16 K/V (see --prefill-attention of the server)")
    parser.add_argument("--large-batch-weights", default="auto", choices=["auto", "blocks", "dense"],
                        help="what large batches of a checkpoint without GGUF blocks read (see the server)")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    server_args = ServerArgs(model_path=args.model_path, dtype=args.dtype, cpu_gemm=args.cpu_gemm,
                             gguf_activations=args.gguf_activations,
                             small_batch_quantization=args.small_batch_quantization,
                             prefill_attention=args.prefill_attention,
                             large_batch_weights=args.large_batch_weights)
    info = load_model_info(server_args)
    need = max(args.batch_size) * (args.input_len + args.output_len) + 16
    runner, mem = build_runner(info, server_args.device, need, max(args.batch_size), args.gguf_kernel_max_rows)
    run_once(runner, mem, 1, 16, 4)  # warm-up
    for bs in args.batch_size:
        gemm = info.arithmetic.large_batch_gemm if info.arithmetic is not None else ""
        act = info.arithmetic.gguf_activations if info.arithmetic is not None else ""
        small = info.arithmetic.small_batch_quantization if info.arithmetic is not None else ""
        large = info.arithmetic.large_batch_weights if info.arithmetic is not None else ""
        attention = info.arithmetic.prefill_attention if info.arithmetic is not None else ""
        result = {"dtype": str(info.dtype), "large_batch_gemm": gemm, "gguf_activations": act,
                  "prefill_attention": attention,
                  "small_batch_quantization": small, "large_batch_weights": large, "gguf": bool(info.gguf_path),
                  "gguf_kernel_max_rows": runner.gguf_kernel_max_rows, "threads": torch.get_num_threads(),
                  **run_once(runner, mem, bs, args.input_len, args.output_len)}
        print(json.dumps(result))
        if args.result_file:
            with open(args.result_file, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

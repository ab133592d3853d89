"""Where a decode step of the scheduler goes: the real Scheduler, in-process, without sockets traffic.

    PYTHONPATH=. python benchmarks/profile_decode_step.py [--batch-size 64] [--steps 30] [--cprofile]

Builds the server's Scheduler for the default model (default arithmetic plan), admits --batch-size requests of
--input-len random tokens, prefills them, then times --steps decode steps split the way the event loop runs them:
batch building, forward inputs, the forward (model + sampling), result processing, the output message and its
pickling. `--cprofile` prints the functions (and compiled kernels) by own time. `--stack-only` instead times the
fused decode step's layer stack alone (one compiled call, no embedding, LM head or sampling) for --seconds, the same
decode batch over and over (a loop to attach `perf record -p` to); with `--attention-paths` it alternates the
AVX512 and AVX2 paths of bf16 attention every 10 calls and reports each (where the CPU has AVX512), with
`--shared-input` each matmul's input built once for the team and in every thread, and with `--items-per-thread
1,4` the matmuls cut into that many items per thread, with `--dequant-min-rows 0,16` the float32 matmuls' row
groups converted once for all rows from that many rows on (0: never); `--with-head` adds the LM head to each call (it evicts the
layers' weights from L3, as in a real step). `--one-call` times whole scheduler steps with the fused step run in one
call from token ids to logits and fed from Python (embedding and RoPE rows, then the LM head apart), alternated
every 10 steps. OMP_WAIT_POLICY defaults to PASSIVE, as the server sets it, unless the environment sets it or GOMP_SPINCOUNT.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pickle
import pstats
import random
import time

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read by libgomp when torch loads

import torch  # noqa: E402

from sglang.srt.layers import cpu_ops  # noqa: E402
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.process_utils import load_tokenizer_for  # noqa: E402
from sglang.srt.managers.scheduler.loop import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler.output import build_output_message  # noqa: E402
from sglang.srt.managers.scheduler.results import process_result  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode  # noqa: E402
from sglang.srt.model_loader.model_info import load_model_info  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs  # noqa: E402

PARTS = ("batch", "inputs", "forward", "process", "message", "pickle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=130)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf-activations", choices=["auto", "float32", "int8"], default="auto")
    parser.add_argument("--gguf-kernel-max-rows", type=int, default=None,
                        help="the server flag: batches above it run layer by layer on the large-batch GEMM")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--stack-only", action="store_true")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--attention-paths", action="store_true",
                        help="with --stack-only: the AVX512 and AVX2 attention paths interleaved")
    parser.add_argument("--shared-input", action="store_true",
                        help="with --stack-only: matmul inputs built once for the team and per thread, interleaved")
    parser.add_argument("--items-per-thread", default="",
                        help="with --stack-only: comma-separated matmul items per thread, interleaved")
    parser.add_argument("--with-head", action="store_true", help="with --stack-only: the LM head after the stack")
    parser.add_argument("--dequant-min-rows", default="",
                        help="with --stack-only: comma-separated settings of the step's float32 matmuls' row count "
                             "from which each row group is converted once (0: never), interleaved")
    parser.add_argument("--one-call", action="store_true",
                        help="scheduler steps with the fused step fed from token ids and ending with the LM head "
                             "(one call) and fed from Python (embedding, RoPE rows, head apart), alternated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server_args = ServerArgs(model_path=args.model_path, gguf_activations=args.gguf_activations,
                             gguf_kernel_max_rows=args.gguf_kernel_max_rows)
    server_args.validate()
    ports = PortArgs.init_new()
    sched = Scheduler(server_args, ports, load_model_info(server_args), load_tokenizer_for(server_args))
    rng = random.Random(0)
    for i in range(args.batch_size):
        ids = [rng.randrange(1000, 40000) for _ in range(args.input_len)]
        params = SamplingParams(max_new_tokens=decode_steps(args) + 2, temperature=0.0, ignore_eos=True)
        sched.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_text=None, input_ids=ids,
                                                    sampling_params=params, stream=True))
    while sched.waiting or sched.chunked_req is not None:  # prefill every request
        batch = sched.get_next_batch()
        assert batch is not None and not batch.is_decode
        forward_batch, sampling = batch.forward_inputs(sched.mem, sched.runner.vocab_size, sched.runner.device)
        process_result(sched, batch, sched.runner.forward(forward_batch, sampling))
    if args.stack_only:
        time_stack(sched, args)
        return
    if args.one_call:
        time_one_call(sched, args)
        return
    totals = dict.fromkeys(PARTS, 0.0)

    def step() -> None:
        t0 = time.perf_counter()
        batch = sched.get_next_batch()
        assert batch is not None and batch.is_decode and len(batch) == args.batch_size
        t1 = time.perf_counter()
        forward_batch, sampling = batch.forward_inputs(sched.mem, sched.runner.vocab_size, sched.runner.device)
        t2 = time.perf_counter()
        result = sched.runner.forward(forward_batch, sampling)
        t3 = time.perf_counter()
        reported = process_result(sched, batch, result)
        t4 = time.perf_counter()
        message = build_output_message(reported)
        t5 = time.perf_counter()
        pickle.dumps(message)
        t6 = time.perf_counter()
        for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            totals[part] += seconds

    for _ in range(args.warmup):
        step()
    totals.update(dict.fromkeys(PARTS, 0.0))
    profiler = cProfile.Profile() if args.cprofile else None
    if profiler is not None:
        profiler.enable()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    print(f"{args.batch_size} sequences, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}: step {elapsed / args.steps * 1e3:.2f} ms; "
          + ", ".join(f"{part} {totals[part] / args.steps * 1e3:.3f}" for part in PARTS))
    print(sched.runner.decode_plan.description if sched.runner.decode_plan is not None else "no decode plan")


def decode_steps(args: argparse.Namespace) -> int:
    """Decode steps run after the prefill: --warmup + --steps, a whole number of 20-step rounds with --one-call."""
    steps = args.warmup + args.steps
    return -(-steps // 20) * 20 if args.one_call else steps


def time_one_call(sched: Scheduler, args: argparse.Namespace) -> None:
    """Whole scheduler steps (batch, inputs, forward with sampling, results), the fused step in one call from token
    ids to logits and fed from Python, alternated every 10 steps; the mean and median of each after a warm-up."""
    fused = sched.runner.decode_plan.fused if sched.runner.decode_plan is not None else None
    assert fused is not None and fused.from_tokens, "the fused step cannot run from token ids for this model"
    one_call = (True, fused.with_head)
    variants = {"one call from token ids": one_call, "fed from Python": (False, False)}
    times: dict[str, list[float]] = {label: [] for label in variants}
    try:
        for i in range(decode_steps(args)):
            label = list(variants)[(i // 10) % 2]
            fused.from_tokens, fused.with_head = variants[label]
            t0 = time.perf_counter()
            batch = sched.get_next_batch()
            assert batch is not None and batch.is_decode and len(batch) == args.batch_size
            forward_batch, sampling = batch.forward_inputs(sched.mem, sched.runner.vocab_size, sched.runner.device)
            process_result(sched, batch, sched.runner.forward(forward_batch, sampling))
            times[label].append(time.perf_counter() - t0)
    finally:
        fused.from_tokens, fused.with_head = one_call
    for label, steps in times.items():
        steps = sorted(steps[len(steps) // 10:])  # the first tenth warms up
        print(f"{args.batch_size} sequences, scheduler step, fused step {label} ({fused.name.split(' (')[0]}): "
              f"mean {sum(steps) / len(steps) * 1e3:.3f} ms, median {steps[len(steps) // 2] * 1e3:.3f} ms "
              f"over {len(steps)} steps")


def time_stack(sched: Scheduler, args: argparse.Namespace) -> None:
    """Mean and median time of the fused layer stack on the scheduler's next decode batch (per variant)."""
    fused = sched.runner.decode_plan.fused if sched.runner.decode_plan is not None else None
    batch = sched.get_next_batch()
    assert fused is not None and batch is not None and batch.is_decode, "no fused decode step for this batch"
    fb, _ = batch.forward_inputs(sched.mem, sched.runner.vocab_size, sched.runner.device)
    assert fused.accepts(fb), f"{len(batch)} sequences are above the fused step's {fused.max_rows} rows"
    model = sched.runner.model
    hidden, (cos, sin) = model.model.embed(fb.input_ids, fb.positions)
    rows = hidden.shape[0]
    call_args = (hidden, cos.view(rows, -1), sin.view(rows, -1), fb.out_cache_loc,
                 fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens)

    def call() -> None:
        out = fused.stack.forward(*call_args)
        if args.with_head:
            model.compute_logits(out, fb)

    def setting(get, put, value):  # -> a function that puts the previous value back
        previous = get()
        put(value)
        return lambda: put(previous)

    def attention(on: bool):  # the setter returns the previous value
        previous = fused_cpu_decode.set_decode_attention_avx512(on)
        return lambda: fused_cpu_decode.set_decode_attention_avx512(previous)

    def dequant_rows(n: int):  # the setter returns the previous value
        previous = fused_cpu_decode.set_dequant_min_rows(n)
        return lambda: fused_cpu_decode.set_dequant_min_rows(previous)

    stack = fused.stack
    variants: dict = {"": lambda: (lambda: None)}
    if args.attention_paths and cpu_ops.has_decode_attention_avx512():
        variants = {f" (attention {name})": (lambda on=on: attention(on))
                    for name, on in (("avx512", True), ("avx2", False))}
    elif args.shared_input:
        variants = {f" (input built {name})": (lambda on=on: setting(stack.shared_input, stack.set_shared_input, on))
                    for name, on in (("once", True), ("per thread", False))}
    elif args.dequant_min_rows:
        variants = {f" (row groups converted once from {n} rows)": (lambda n=n: dequant_rows(n))
                    for n in (int(v) for v in args.dequant_min_rows.split(","))}
    elif args.items_per_thread:
        variants = {f" ({n} matmul items per thread)": (lambda n=n: setting(
            stack.matmul_items_per_thread, stack.set_matmul_items_per_thread, n))
            for n in (int(v) for v in args.items_per_thread.split(","))}
    times: dict[str, list[float]] = {label: [] for label in variants}
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for label, apply in variants.items():
            restore = apply()
            for _ in range(10):
                t0 = time.perf_counter()
                call()
                times[label].append(time.perf_counter() - t0)
            restore()
    for label, calls in times.items():
        calls = sorted(calls[len(calls) // 10:])  # the first tenth warms up
        what = "fused layer stack and LM head" if args.with_head else "fused layer stack alone"
        print(f"{rows} sequences, {what}{label}: mean {sum(calls) / len(calls) * 1e3:.3f} ms, "
              f"median {calls[len(calls) // 2] * 1e3:.3f} ms over {len(calls)} calls")


if __name__ == "__main__":
    main()

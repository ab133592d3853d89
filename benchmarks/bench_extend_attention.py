"""Prefill / extend attention: the compiled CPU kernel (cpu_ops.extend_attention) against the SDPA path it replaces.

`PYTHONPATH=. python benchmarks/bench_extend_attention.py` times one layer's attention (9 query / 3 KV heads, 64
channels, float32 K/V in scattered pool slots) for a few batch shapes: the kernel over the whole batch, and SDPA
per sequence on K/V gathered with index_select (what torch_sdpa_backend.forward_extend runs without the kernel).
Then, over bf16 K/V, the kernel's float32 path against its AVX512-BF16 dot products (where the CPU has them),
alternated six times per shape; medians.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_ops
from tests.test_extend_attention import make_batch, run_kernel

SHAPES = [  # (new tokens per sequence, cached prefix per sequence, sequences)
    (130, 0, 16), (20, 400, 16), (1, 400, 16), (256, 0, 1), (512, 0, 1), (1024, 0, 1),
]


def timed(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def sdpa_per_sequence(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale):
    start = 0
    for b, (ext, pre) in enumerate(zip(extend_lens, prefix_lens)):
        idx = rows[b, : pre + ext]
        keys = k_cache.index_select(0, idx).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, idx).transpose(0, 1).unsqueeze(0)
        queries = q[start : start + ext].transpose(0, 1).unsqueeze(0)
        mask = None
        if pre > 0 and ext > 1:
            mask = torch.arange(pre + ext)[None, :] <= torch.arange(pre, pre + ext)[:, None]
        F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=pre == 0 and ext > 1,
                                       scale=scale, enable_gqa=True)
        start += ext


def main() -> None:
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels are unavailable")
    print(f"threads {torch.get_num_threads()}")
    for ext, pre, n in SHAPES:
        extend_lens, prefix_lens = [ext] * n, [pre] * n
        q, k_cache, v_cache, rows = make_batch(9, 3, 64, extend_lens, prefix_lens)
        kernel = timed(lambda: run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 0.125))
        sdpa = timed(lambda: sdpa_per_sequence(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 0.125))
        print(f"{n} x {ext} new tokens after {pre} cached: kernel {kernel:.2f} ms, SDPA per sequence {sdpa:.2f} ms "
              f"({sdpa / kernel:.2f}x)")
    bf16_paths()


def bf16_paths() -> None:
    if not cpu_ops.has_extend_attention_bf16():
        print("bf16 K/V: this CPU has no AVX512-BF16 dot products")
        return
    previous = cpu_ops.set_extend_attention_bf16(True)
    for ext, pre, n in SHAPES + [(2048, 0, 1)]:
        extend_lens, prefix_lens = [ext] * n, [pre] * n
        q, k_cache, v_cache, rows = make_batch(9, 3, 64, extend_lens, prefix_lens, kv_dtype=torch.bfloat16)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(6):
            for on in (False, True):
                cpu_ops.set_extend_attention_bf16(on)
                times[on].append(timed(lambda: run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens,
                                                          0.125), reps=10))
        f32, bf16 = (sorted(times[on])[3] for on in (False, True))
        print(f"bf16 K/V, {n} x {ext} new tokens after {pre} cached: float32 kernel {f32:.2f} ms, bf16 dot products "
              f"{bf16:.2f} ms ({f32 / bf16:.2f}x)")
    cpu_ops.set_extend_attention_bf16(previous)


if __name__ == "__main__":
    main()

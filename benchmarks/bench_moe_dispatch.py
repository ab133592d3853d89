"""Micro-benchmark of the MoE expert computation (sglang/srt/layers/moe/fused_moe.py) for one layer.

Compares, for `--tokens` rows routed to top-k of `--experts` SwiGLU experts:
- grouped: `fused_experts` (one sort + bincount, two matmuls per active expert, index_add_);
- mask loop: the per-expert loop of transformers' eager experts (one-hot mask, torch.where per expert);
- per token: a Python loop over (token, chosen expert) pairs, only for up to `--max-per-token` tokens.
Prints the median milliseconds per layer and checks that all variants agree.

    .venv/bin/python benchmarks/bench_moe_dispatch.py [--tokens 1 16 256] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sglang.srt.layers.moe.fused_moe import fused_experts
from sglang.srt.layers.moe.topk import TopKConfig, select_experts


def mask_loop(x, gate_up, down, weights, ids):
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(expert[0])
        pos, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def per_token(x, gate_up, down, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(x[t : t + 1], gate_up[e]).chunk(2, dim=-1)
            out[t] += (F.linear(F.silu(gate) * up, down[e]) * weights[t, k])[0].to(out.dtype)
    return out


def median_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-per-token", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    gate_up = (torch.randn(args.experts, 2 * args.intermediate, args.hidden) * 0.02).to(dtype)
    down = (torch.randn(args.experts, args.hidden, args.intermediate) * 0.02).to(dtype)
    router = torch.randn(args.experts, args.hidden).to(dtype)
    config = TopKConfig(args.experts, args.top_k, renormalize=True, float32_weights=False)
    print(f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.dtype}, {torch.get_num_threads()} threads; median ms per layer")
    print(f"{'tokens':>7} {'active':>7} {'grouped':>9} {'mask loop':>10} {'per token':>10}")
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden).to(dtype)
        topk = select_experts(F.linear(x, router), config)
        variants = {"grouped": fused_experts, "mask": mask_loop}
        if tokens <= args.max_per_token:
            variants["per_token"] = per_token
        results = {name: fn(x, gate_up, down, topk.weights, topk.ids) for name, fn in variants.items()}
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        for name, out in results.items():
            assert (out.float() - results["grouped"].float()).abs().max() < tol, name
        ms = {name: median_ms(lambda fn=fn: fn(x, gate_up, down, topk.weights, topk.ids), args.repeats)
              for name, fn in variants.items()}
        active = len(torch.unique(topk.ids))
        per_token_ms = f"{ms['per_token']:10.2f}" if "per_token" in ms else f"{'-':>10}"
        print(f"{tokens:>7} {active:>7} {ms['grouped']:9.2f} {ms['mask']:10.2f} {per_token_ms}")


if __name__ == "__main__":
    main()

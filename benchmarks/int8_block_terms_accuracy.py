"""How far the GGUF kernels' int8 activations move SmolLM2's next-token choices, per activation-term policy.

The GGUF int8 kernels (layers/quantization/csrc/gguf_int8.h) write each 32-value block of an activation row as
int8 terms: one (x ~ d1 * q1) or two (plus the rounding remainder, d2 * q2). Two terms cost twice the integer work
and are what keeps greedy outputs equal to float32 today. This script measures, teacher-forced on the greedy tests'
prompts (as benchmarks/int8_gemm_accuracy.py), one term everywhere, two terms everywhere, and two terms only in the
blocks whose max |x| exceeds T times the block's RMS (a block holding an outlier activation, which quantizes the
other 31 values coarsely), for several T, with the fraction of blocks that would need the second term. Every linear
layer, the LM head included, sees the quantized activations; weights stay float32, so only activation rounding is
measured.

    python benchmarks/int8_block_terms_accuracy.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_gemm_accuracy import compare, reference_model, teacher_forced_logprobs  # noqa: E402

BLOCK = 32


def round_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., nb, 32] rounded to int8 per block with scale max|x| / 127: (dequantized value, scale)."""
    d = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(x / d.clamp_min(1e-30)), torch.zeros_like(x))
    return q * d, d


def block_quantizer(threshold: float | None, counts: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> its int8 block approximation: one term, plus a second term in the blocks where max|x| > threshold *
    RMS (threshold None: never; 0: always). counts accumulates [blocks with two terms, blocks]."""

    def quantize(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        blocks = x.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
        first, _ = round_blocks(blocks)
        if threshold is None:
            counts[1] += blocks[..., 0].numel()
            return first.reshape(shape).to(x.dtype)
        rms = blocks.pow(2).mean(-1, keepdim=True).sqrt()
        need = blocks.abs().amax(-1, keepdim=True) > threshold * rms
        second, _ = round_blocks(blocks - first)
        counts[0] += int(need.sum())
        counts[1] += need.numel()
        return (first + torch.where(need, second, torch.zeros_like(second))).reshape(shape).to(x.dtype)

    return quantize


def outlier_quantizer(columns: int, tile: int = 8) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> one int8 term per block, where in each tile of `tile` rows the `columns` input columns of largest max |x|
    stay exact (zeroed before the rounding, so they set no block's scale), as the block kernels' one-term form."""

    def quantize(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.float().reshape(-1, shape[-1])
        out = torch.empty_like(rows)
        k = min(columns, shape[-1] // 8)
        for m0 in range(0, rows.shape[0], tile):
            t = rows[m0 : m0 + tile]
            cols = t.abs().amax(0).topk(k).indices
            rest = t.index_fill(1, cols, 0.0)
            first, _ = round_blocks(rest.reshape(t.shape[0], -1, BLOCK))
            out[m0 : m0 + tile] = first.reshape(t.shape).index_copy(1, cols, t.index_select(1, cols))
        return out.reshape(shape).to(x.dtype)

    return quantize


def main() -> None:
    model, sequences = reference_model()
    base = teacher_forced_logprobs(model, sequences)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    policies: list[tuple[str, float | None]] = [("one term everywhere", None), ("two terms everywhere", 0.0)]
    policies += [(f"two terms where max > {t:g} x RMS", t) for t in (2.5, 3.0, 3.5, 4.0, 5.0, 6.0)]
    for name, threshold in policies:
        counts = [0, 0]
        quantize = block_quantizer(threshold, counts)
        for m in layers:
            m.forward = (lambda layer: lambda x: F.linear(quantize(x), layer.weight, layer.bias))(m)
        result = compare(base, teacher_forced_logprobs(model, sequences))
        share = counts[0] / counts[1] if counts[1] else 0.0
        print(f"{name:36s} {result}, blocks with two terms {100 * share:.1f}%", flush=True)
    for columns in (16, 32, 64):
        quantize = outlier_quantizer(columns)
        for m in layers:
            m.forward = (lambda layer: lambda x: F.linear(quantize(x), layer.weight, layer.bias))(m)
        result = compare(base, teacher_forced_logprobs(model, sequences))
        print(f"{f'one term, {columns} columns per 8 rows exact':36s} {result}", flush=True)


if __name__ == "__main__":
    main()

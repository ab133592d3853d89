"""MXFP4 expert weights (GPT-OSS checkpoints as published): dequantized to a float dtype at load.

A checkpoint whose `quantization_config.quant_method` is "mxfp4" stores each stacked expert projection `P` as two
tensors: `P_blocks` [E, rows, groups, 16] uint8, two FP4 (E2M1) values per byte, the low nibble first, 32 values
per group; and `P_scales` [E, rows, groups] uint8, a shared power-of-two exponent per group, biased by 127. A value
is fp4(nibble) * 2 ** (scale - 127). Dequantized, the rows of `P` are its output features and the 32-value groups
run along its input features; transformers' expert layout is the transpose ([E, in, out]), which is what
`dequantize_mxfp4` returns, so the result loads where a float checkpoint's `P` does. The values are computed in
the target dtype with the same steps as transformers' reference conversion (table lookup, then ldexp), one expert
at a time to bound the temporary memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from sglang.srt.model_loader.dtype import dtype_name

logger = logging.getLogger(__name__)

# The 16 FP4 E2M1 values by nibble: sign bit 3, then two exponent bits and one mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
SCALE_BIAS = 127


def _dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert: blocks [rows, groups, 16], scales [rows, groups] -> [groups * 32, rows] in `dtype`."""
    rows, groups, width = blocks.shape
    table = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    values = torch.empty(rows, groups, width * 2, dtype=dtype, device=blocks.device)
    values[..., 0::2] = table[(blocks & 0x0F).long()]
    values[..., 1::2] = table[(blocks >> 4).long()]
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    torch.ldexp(values, exponents, out=values)
    return values.view(rows, groups * width * 2).t()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked MXFP4 experts: blocks [E, rows, groups, 16] uint8 and scales [E, rows, groups] uint8 ->
    [E, groups * 32, rows] in `dtype` (transformers' [E, in, out] expert layout)."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                         "expected [E, rows, groups, 16] and [E, rows, groups]")
    blocks, scales = blocks.view(torch.uint8), scales.view(torch.uint8)
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * width * 2, rows, dtype=dtype, device=blocks.device)
    for expert in range(experts):
        out[expert] = _dequantize_expert(blocks[expert], scales[expert], dtype)
    return out


def dequantize_mxfp4_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every `P_blocks` / `P_scales` pair replaced by `P` dequantized to `dtype` (the
    pair may come in either order, anywhere in the stream); other tensors pass through. Logs one line when it
    dequantizes anything, and raises ValueError for a half pair left at the end."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    for name, tensor in weights:
        suffix = next((s for s in (BLOCKS_SUFFIX, SCALES_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        pair = pending.setdefault(base, {})
        pair[suffix] = tensor
        if len(pair) == 2:
            del pending[base]
            count += 1
            yield base, dequantize_mxfp4(pair[BLOCKS_SUFFIX], pair[SCALES_SUFFIX], dtype)
    if pending:
        halves = [f"{base}{next(iter(pair))}" for base, pair in sorted(pending.items())]
        raise ValueError(f"MXFP4 weights without their blocks or scales: {', '.join(halves)}")
    if count:
        logger.info("MXFP4 experts dequantized to %s at load (%d stacked projections)", dtype_name(dtype), count)

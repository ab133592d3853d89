"""Giving a loaded float32 model the large-batch GEMM its arithmetic plan chose (layers/arithmetic.py).

Runs after the GGUF blocks are attached (model_loader/gguf_quant.py): a layer that has blocks keeps them for
batches of at most `max_rows` rows and gets the reduced-precision GEMM beyond (the LM head, where that GEMM is bf16,
for at most 16 rows: layers/arithmetic.py); a layer without blocks (a plain
safetensors checkpoint, or a GGUF model on a CPU without the kernels) uses it for every batch, because there a
bf16 weight is also half the bytes a small decode step reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.bf16_linear import BF16LinearMethod
from sglang.srt.layers.linear import DENSE, Linear, LinearMethod, linear_methods
from sglang.srt.layers.quantization.block_gemm import BlockGEMMLinearMethod
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.layers.small_batch_rows import head_small_batch_rows

logger = logging.getLogger(__name__)


def method_factory(gemm: str) -> Callable[[torch.Tensor], LinearMethod]:
    """Makes the linear method of a large-batch GEMM from a float32 weight (float32: the layer's own dense GEMM)."""
    if gemm == "float32":
        return lambda weight: DENSE
    if gemm == "bfloat16":
        return BF16LinearMethod
    if gemm == "int8":
        from sglang.srt.layers.int8_linear import method_for_this_cpu

        return method_for_this_cpu()
    raise ValueError(f"no large-batch linear method for GEMM {gemm!r}")


def blocks_large_method(large_batch_gemm: str, block_gemm: str) -> Callable[
        [GGUFQuantWeight, Callable[[], torch.Tensor]], LinearMethod]:
    """Makes the large-batch method of a layer whose Q8_0 blocks replace its float weight
    (model_loader/q8_blocks.py), from its blocks and the values its float weight holds (a function: only the int8
    copy reads them): the int8 GEMM where the plan measured it fastest (an int8 copy; the outlier columns' weights
    are read from the blocks), else the `block_gemm` GEMM (float32 or bf16) over the blocks themselves."""
    if large_batch_gemm == "int8":
        from sglang.srt.layers.int8_linear import method_for_this_cpu

        make = method_for_this_cpu()
        return lambda blocks, values: make(values(), columns=blocks, out_dtype=torch.float32)
    dtype = torch.float32 if block_gemm == "float32" else torch.bfloat16
    return lambda blocks, values: BlockGEMMLinearMethod(blocks, dtype)


def _with_large(current: LinearMethod, weight: torch.Tensor,
                make: Callable[[torch.Tensor], LinearMethod]) -> LinearMethod:
    if isinstance(current, GGUFLinearMethod):
        current.large = make(weight)
        return current
    if current is DENSE:
        return make(weight)
    return current  # a method this module does not know keeps its own arithmetic


def attach_large_batch_gemm(model: nn.Module, gemm: str) -> int:
    """Give every linear layer and the LM head of a float32 model the `gemm` method for large batches; returns
    the bytes of the reduced-precision weight copies (0 for float32, which is the layers' own weight)."""
    if gemm == "float32":
        return 0
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(f"--cpu-gemm {gemm} applies to float32 weights (--dtype auto or float32)")
    make = method_factory(gemm)
    for module in model.modules():
        if isinstance(module, Linear):
            module.set_linear_method(_with_large(module.linear_method, module.weight, make))
    processor: Any = getattr(model, "logits_processor", None)
    head = getattr(model, "lm_head", None)
    if processor is not None and head is not None:
        method = _with_large(processor.head_method, head.weight, make)
        if isinstance(method, GGUFLinearMethod):
            method.max_rows = head_small_batch_rows(gemm, method.max_rows)
        processor.set_head_method(method)
    attached = sum(int(getattr(getattr(m, "large", m), "nbytes", 0)) for m in linear_methods(model))
    logger.info("Attached %.1f MB of %s weight copies for large batches", attached / 2**20, gemm)
    return attached

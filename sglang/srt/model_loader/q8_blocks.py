"""Q8_0 blocks for the small batches of a model loaded without a GGUF file (a plain safetensors checkpoint).

A decode step of a small batch is bound by reading the weights. A model read from a GGUF file multiplies small
batches straight from the file's blocks (model_loader/gguf_quant.py) and runs its decode steps in the fused CPU
step; a plain checkpoint has no blocks, so without this its decode steps read every weight in float32 or bf16.
Here each decoder linear layer and the LM head get Q8_0 blocks quantized at load time (`gguf.quants.quantize`,
the reference quantizer: per 32 weights an fp16 scale max|w| / 127 and 32 int8), which brings the fused decode
step and the GGUF kernels to such models: a quarter of the float32 bytes per step, half of bf16's. Q8_0 keeps
about as much of each weight as bf16 does (a relative rounding of at most 1/254 of its block's largest weight),
and only batches of at most `max_rows` rows use it; prefill and larger batches keep the float weights (or their
bf16 copies: model_loader/gemm_methods.py).

The arithmetic plan (layers/arithmetic.py) decides where this applies: `--small-batch-quantization`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from sglang.srt.layers.linear import Linear
from sglang.srt.layers.quantization.gguf_blocks import (
    QK,
    GGUFQuantWeight,
    kernels_available,
    kernels_unavailable_reason,
)
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod

logger = logging.getLogger(__name__)


def quantize_q8_0(weight: torch.Tensor) -> GGUFQuantWeight:
    """A float weight [n, k] (k a multiple of 32) as Q8_0 blocks, as llama.cpp's reference quantizer makes them."""
    import gguf

    n, k = weight.shape
    raw = gguf.quants.quantize(weight.detach().to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q8_0)
    return GGUFQuantWeight("Q8_0", np.ascontiguousarray(raw), n, k)


def _decoder_linears(model: Any) -> list[Linear]:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    out: list[Linear] = []
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            module = getattr(owner, name, None)
            if not isinstance(module, Linear):
                return []
            out.append(module)
    return out


def why_no_q8_0_blocks(model: Any) -> str | None:
    """Why `attach_q8_0_blocks` leaves `model` as it is, or None when it applies."""
    if not kernels_available():
        return f"the GGUF kernels are unavailable ({kernels_unavailable_reason()})"
    linears = _decoder_linears(model)
    if not linears:
        return f"{type(model).__name__} is not a dense Llama-family decoder"
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return "the model is not float32 on CPU"
    if any(isinstance(m.linear_method, GGUFLinearMethod) for m in linears):
        return "the model already has GGUF blocks"
    if any(m.weight.shape[1] % QK for m in linears):
        return f"an input width is not a multiple of {QK}"
    return None


def attach_q8_0_blocks(model: Any, max_rows: int) -> int:
    """Give every decoder linear layer and the LM head of a float32 Llama-family model Q8_0 blocks for batches of
    at most `max_rows` rows; returns the bytes attached (0 when it does not apply, with the reason logged)."""
    reason = why_no_q8_0_blocks(model) if max_rows > 0 else "--gguf-kernel-max-rows is 0"
    if reason is not None:
        logger.info("No Q8_0 blocks for small batches: %s", reason)
        return 0
    attached = 0
    for module in _decoder_linears(model):
        weight = quantize_q8_0(module.weight)
        module.set_linear_method(GGUFLinearMethod(weight, max_rows))
        attached += weight.nbytes
    head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    if head is not None and processor is not None and head.weight.shape[1] % QK == 0:
        weight = quantize_q8_0(head.weight)
        processor.set_head_method(GGUFLinearMethod(weight, max_rows))
        attached += weight.nbytes
    logger.info("Attached %.1f MB of Q8_0 blocks (quantized at load) for matmuls of up to %d rows",
                attached / 2**20, max_rows)
    return attached

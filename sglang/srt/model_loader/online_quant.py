"""`--quantization w8a8_int8` and `--quantization fp8` on a float checkpoint: each decoder linear weight quantized as
it is read, into the tensors a checkpoint of the kind served the same way would store, then read by that kind's own
reader (model_loader/dequantize.py), so that everything after is the quantized-checkpoint path.

- w8a8_int8 (SGLang's W8A8 int8: static symmetric int8 weights, one scale per output channel; activations are
  quantized per token at run time where the plan's kernels quantize them): scale = max|row| / 127 rounded to fp16
  (the scale a Q8_0 block keeps: a relative change of at most 2^-11, so |w| / scale stays under 127.07), values
  round(w / scale) in [-127, 127]. These are a compressed-tensors int8 channel-strategy weight (`weight` int8,
  `weight_scale` [out, 1]): served from Q8_0 blocks made exactly from them as each weight is quantized, once
  (model_loader/int_blocks.py, model_loader/checkpoint_blocks.py), the int8 GEMM on large batches where the plan
  measured it fastest, or dequantized where the plan makes no blocks.
- fp8 (SGLang's online FP8: one scale per tensor): values (w * 448 / max|w|) clamped to +-448 and rounded to float8
  e4m3, scale max|w| / 448 (the reciprocal of 448 / max|w|, as SGLang's `input_to_float8` computes it). These are
  an FP8 checkpoint's per-tensor weight: dequantized at load to the checkpoint's dtype, as such a checkpoint is here.

Which weights: the 2-d `*proj*.weight` tensors of the decoder layers (`layers.N.`), as SGLang quantizes the linear
layers of the decoder. Embeddings, norms, the LM head (not a quantized linear in SGLang), MoE routers and vision
towers stay as stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from sglang.srt.model_loader.dequantize import FP8_DTYPES, AffineWeight, ScaleLayout, compressed_weight, fp8_weight
from sglang.srt.model_loader.quant_config import OnlineScheme, QuantizedCheckpointError

INT8_MAX = 127
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# The smallest positive fp16 value: the scale of a row whose largest weight rounds below it (an all-zero row).
FP16_TINY = 2.0**-24
# A module of the decoder whose weight is quantized: `...layers.<i>.<...>.<name containing proj>`.
_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(.+\.)?[^.]*proj[^.]*$")


def is_decoder_linear(module: str) -> bool:
    return _DECODER_LINEAR.search(module) is not None


def plan_online(names: Iterable[str], scheme: OnlineScheme) -> dict[str, str]:
    """module -> "weight" for every decoder linear weight of a float checkpoint's tensor `names`."""
    plan = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and is_decoder_linear(module):
            plan[module] = leaf
    if not plan:
        raise QuantizedCheckpointError(f"--quantization {scheme.method} quantizes the decoder's linear weights "
                                       "(layers.N.*proj.weight) at load, and the checkpoint has none")
    return plan


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [out, in], fp16 scales [out, 1]) of a float weight (see the module doc)."""
    w = weight.to(torch.float32)
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = (absmax / INT8_MAX).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, FP16_TINY))
    values = torch.round(w / scale.to(torch.float32)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scale


def fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 values [out, in], float32 scale [1]) of a float weight (see the module doc)."""
    w = weight.to(torch.float32)
    inverse = FP8_E4M3_MAX / w.abs().amax().clamp(min=1e-12)
    values = (w * inverse).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return values, inverse.reciprocal().reshape(1)


def quantize_at_load(scheme: OnlineScheme, weight: torch.Tensor, name: str) -> AffineWeight:
    """The checkpoint float weight `name` quantized by `scheme`, as its served checkpoint kind's reader returns it."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.dtype in FP8_DTYPES:
        raise QuantizedCheckpointError(f"Checkpoint tensor {name} is {weight.dtype} {list(weight.shape)}; "
                                       f"--quantization {scheme.method} quantizes 2-d float weights at load")
    if not bool(torch.isfinite(weight).all()):
        raise QuantizedCheckpointError(f"Checkpoint tensor {name} holds non-finite values: it cannot be quantized")
    names = {"weight": name, "scale": f"{name}_scale (made at load)", "zero_point": ""}
    if scheme.method == "fp8":
        values, scale = fp8_per_tensor(weight)
        return fp8_weight(values, scale, ScaleLayout("tensor"), names)
    values, scale = int8_per_channel(weight)
    if not bool(torch.isfinite(scale).all()):
        raise QuantizedCheckpointError(f"Checkpoint tensor {name} has a row whose int8 scale overflows fp16")
    return compressed_weight(values, scale, None, ScaleLayout("channel"), 8, names)

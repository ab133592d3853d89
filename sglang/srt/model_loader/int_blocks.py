"""Q4_1 and Q8_0 blocks made exactly from the integers of a GPTQ, AWQ or compressed-tensors checkpoint.

A 4-bit weight stored as w = s * (q - z), with q in [0, 16) and one scale s and zero point z per group of input
columns, is llama.cpp's Q4_1 block w = d * q + m on every 32 columns of one group: d = s and m = -s * z. The block
keeps d and m in fp16, so:

- d is the checkpoint's scale itself wherever that scale is an fp16 value (GPTQ and AWQ store fp16 scales; a bf16
  scale is one within fp16's range); a scale that is not makes the checkpoint keep the dequantize path.
- m is -s * z (exact in float32: 11 bits times 5) rounded once to fp16. Where that product needs more than fp16's
  11 significant bits the block's values differ from the checkpoint's by that rounding alone: at most half an fp16
  ulp of s * z, i.e. |error| <= 2^-11 * |s * z| <= 2^-7 * s (z <= 16), under 1/128 of one quantization step (below
  fp16's normal range, 2^-25 at most). Symmetric checkpoints (z = 8, compressed-tensors' zero point 0) have m = -8s,
  always exact. d * q + m is then exact in float32 (both terms are multiples of d's ulp, their sum under 32 d).

An 8-bit symmetric weight (GPTQ with every zero point 128, compressed-tensors int8 without zero point) is the Q8_0
block w = d * q with q the signed integer and d = s, exact where s is an fp16 value.

Anything else (a group that starts inside a 32-column block: a group size that is not a multiple of 32, or
act-order group indices that are not constant on aligned 32 columns; 2- or 3-bit values; asymmetric int8; FP8)
has no such block; `checkpoint_block_reason` / `blocks_of` say why, and the checkpoint keeps the dequantize path.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from sglang.srt.layers.quantization.gguf_blocks import QK, RawBlocks
from sglang.srt.model_loader.dequantize import AffineWeight
from sglang.srt.model_loader.quant_config import AWQScheme, CTScheme, FP8Scheme, GPTQScheme, OnlineScheme, Scheme

# The blocks of a checkpoint's quantized modules made as their weights are first read
# (model_loader/quantized_weights.iterate_dequantized), in file order: module -> its raw blocks, or why it has none.
MadeBlocks = dict[str, Union[RawBlocks, str]]


def checkpoint_block_reason(scheme: Scheme) -> Optional[str]:
    """Why a checkpoint of `scheme` cannot be served from blocks made of its integers, as far as its settings tell
    (None: it can, if its tensors agree: `blocks_of`). A float checkpoint quantized at load is the kind it becomes."""
    if isinstance(scheme, OnlineScheme):
        scheme = scheme.served_as
    if isinstance(scheme, FP8Scheme):
        return "FP8 weights have no integer block layout here"
    if isinstance(scheme, (GPTQScheme, AWQScheme)):
        if scheme.bits not in (4, 8):
            return f"{scheme.bits}-bit values have no block layout here (Q4_1 and Q8_0 hold 4- and 8-bit integers)"
        if scheme.group_size > 0 and scheme.group_size % QK:
            return f"group size {scheme.group_size} is not a multiple of {QK}"
        if isinstance(scheme, GPTQScheme) and scheme.bits == 8 and not scheme.sym:
            return "asymmetric int8 has no Q8_0 form (Q8_0 blocks have no zero point)"
        return None
    assert isinstance(scheme, CTScheme)
    for group in scheme.groups:
        if group.type != "int":
            return f"{group.type}{group.num_bits} weights have no integer block layout here"
        if group.num_bits not in (4, 8):
            return f"{group.num_bits}-bit values have no block layout here (Q4_1 and Q8_0 hold 4- and 8-bit integers)"
        if group.strategy == "block":
            return "block-strategy scales have no block layout here"
        if group.strategy == "group" and group.group_size is not None and group.group_size % QK:
            return f"group size {group.group_size} is not a multiple of {QK}"
        if group.num_bits == 8 and not group.symmetric:
            return "asymmetric int8 has no Q8_0 form (Q8_0 blocks have no zero point)"
    return None


def _per_block(values: torch.Tensor, out_f: int, in_f: int) -> Optional[torch.Tensor]:
    """[out, in / 32]: the one value of each 32-column block of `values` broadcast over [out, in], or None where a
    block holds more than one."""
    blocks = values.expand(out_f, in_f).reshape(out_f, in_f // QK, QK)
    first = blocks[..., 0]
    return first if bool((blocks == first.unsqueeze(-1)).all()) else None


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float values [out, nb] (fp16-representable) as their fp16 bytes [out, nb, 2]."""
    return values.to(torch.float16).unsqueeze(-1).contiguous().view(torch.uint8)


def blocks_of(weight: AffineWeight, name: str) -> Union[RawBlocks, str]:
    """The raw Q4_1 (4-bit) or Q8_0 (8-bit) blocks whose values are `weight`'s (see the module doc for Q4_1's m), or
    why there are none (naming the tensor `name`)."""
    out_f, in_f = weight.values.shape
    if weight.bits not in (4, 8) or weight.values.is_floating_point():
        return f"{name} holds {weight.bits}-bit {'float' if weight.values.is_floating_point() else 'integer'} values"
    if in_f % QK:
        return f"the input width {in_f} of {name} is not a multiple of {QK}"
    scale = _per_block(weight.scale, out_f, in_f)
    offset = 1 << (weight.bits - 1)
    # zero points in the unsigned domain of q, as Q4_1 reads it; compressed-tensors' signed values are stored + offset
    zero = (torch.zeros(1, 1) if weight.zero is None else weight.zero) + (offset if weight.signed else 0)
    zero = _per_block(zero, out_f, in_f)
    if scale is None or zero is None:
        return (f"the scales or zero points of {name} change within {QK} input columns (act-order group indices, or "
                f"groups that do not start at a multiple of {QK})")
    if not torch.equal(scale.to(torch.float16).to(torch.float32), scale):
        return f"the {weight.scale_dtype} scales of {name} are not all fp16 values (a block keeps an fp16 scale)"
    q = weight.values.to(torch.int32) + (offset if weight.signed else 0)  # unsigned, [0, 2^bits)
    nb = in_f // QK
    if weight.bits == 8:
        if not bool((zero == offset).all()):
            return f"{name} has zero points other than {offset}: asymmetric int8 has no Q8_0 form"
        signed = (q - offset).to(torch.int8).reshape(out_f, nb, QK).view(torch.uint8)
        raw = torch.cat([_fp16_bytes(scale), signed], dim=-1)
        return "Q8_0", raw.reshape(out_f, nb * 34), out_f, in_f
    m = -(scale * zero)  # exact in float32; rounded once to fp16 below
    if not bool(torch.isfinite(m.to(torch.float16)).all()):
        return f"the offsets -scale * zero of {name} overflow fp16"
    nibbles = q.reshape(out_f, nb, QK).to(torch.uint8)
    packed = nibbles[..., : QK // 2] | (nibbles[..., QK // 2 :] << 4)  # byte j: q[j] low, q[j + 16] high
    raw = torch.cat([_fp16_bytes(scale), _fp16_bytes(m), packed], dim=-1)
    return "Q4_1", raw.reshape(out_f, nb * 20), out_f, in_f

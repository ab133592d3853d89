"""Read one linear weight of a GPTQ, AWQ, FP8 or compressed-tensors checkpoint, as each format publishes it.

Every function returns the weight's `AffineWeight`: its values [out_features, in_features] unpacked, with the zero
point and scale of each value, which come from its group, channel, block or the whole tensor. Its `dequantize()` is
the float32 weight (the caller rounds it once to the checkpoint's dtype): the value minus its zero point, times its
scale; model_loader/int_blocks.py repacks the same integers into Q4_1 / Q8_0 blocks instead. The products are exact
in float32 for the integer formats (at most 9 significant bits of value times 11 of an fp16 / 8 of a bf16 scale), so
the result is the format's own dequantization in its scale dtype. Shapes are checked against each other; a mismatch
raises QuantizedCheckpointError naming the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.model_loader.quant_config import QuantizedCheckpointError

# AutoAWQ packs the 8 output columns c*8 + AWQ_PACK_ORDER[i] of a word into its nibble i.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit values of int32 words holding 32 // bits of them along `dim`, lowest bits first:
    value j * (32 // bits) + i sits at bits [i * bits, (i + 1) * bits) of word j. int32, `dim` widened."""
    per_word = 32 // bits
    shifts = torch.arange(0, per_word * bits, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, per_word, 1)) & mask
        return values.reshape(words.shape[0] * per_word, words.shape[1])
    values = (words.unsqueeze(2) >> shifts.view(1, 1, per_word)) & mask
    return values.reshape(words.shape[0], words.shape[1] * per_word)


@dataclass(frozen=True)
class ScaleLayout:
    """How a scale (or zero point) tensor covers a weight: one value (tensor), one per output row (channel), one per
    row and group of input columns (group: `group_size`, or the group index of each column in `g_idx`), or one per
    `block` of rows x columns."""

    strategy: str
    group_size: Optional[int] = None
    g_idx: Optional[torch.Tensor] = None
    g_idx_name: str = ""
    block: Optional[tuple[int, int]] = None

    def expand(self, param: torch.Tensor, out_f: int, in_f: int, name: str) -> torch.Tensor:
        """`param` as a float32 tensor that broadcasts over the [out_f, in_f] weight."""
        values = param.to(torch.float32)
        if self.strategy == "tensor":
            _check(values.numel() == 1, name, param, "one value")
            return values.reshape(1, 1)
        if self.strategy == "channel":
            _check(values.numel() == out_f, name, param, f"{out_f} values, one per output row")
            return values.reshape(out_f, 1)
        if self.strategy == "block":
            assert self.block is not None
            rows, cols = self.block
            expected = (math.ceil(out_f / rows), math.ceil(in_f / cols))
            _check(tuple(values.shape) == expected, name, param, f"shape {list(expected)} ({rows}x{cols} blocks)")
            return values.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:out_f, :in_f]
        groups = self.column_groups(out_f, in_f)
        num_groups = 1 if not self.group_size or self.group_size < 0 else math.ceil(in_f / self.group_size)
        _check(tuple(values.shape) == (out_f, num_groups), name, param, f"shape {[out_f, num_groups]}")
        return values[:, groups]

    def column_groups(self, out_f: int, in_f: int) -> torch.Tensor:
        """The group of each input column: `g_idx` when the checkpoint has one (act-order), else column // size."""
        size = self.group_size if self.group_size and self.group_size > 0 else in_f
        if self.g_idx is None:
            return torch.arange(in_f) // size
        groups = self.g_idx.to(torch.int64).reshape(-1)
        num_groups = math.ceil(in_f / size)
        if groups.numel() != in_f or (in_f and (int(groups.min()) < 0 or int(groups.max()) >= num_groups)):
            raise QuantizedCheckpointError(
                f"Checkpoint tensor {self.g_idx_name} must hold {in_f} group indices in [0, {num_groups}), "
                f"got shape {list(self.g_idx.shape)}")
        return groups


def _check(ok: bool, name: str, tensor: torch.Tensor, expected: str) -> None:
    if not ok:
        raise QuantizedCheckpointError(f"Checkpoint tensor {name} has shape {list(tensor.shape)}; expected {expected}")


@dataclass(frozen=True)
class AffineWeight:
    """One linear weight as a checkpoint stores it: (values - zero) * scale, values [out, in] (integers, or fp8 values
    for the float formats), zero (None: 0) and scale float32 broadcasting over [out, in] (one per value, row or the
    whole tensor); `scale_dtype` is the dtype the scales are stored in. Integer values are unsigned (GPTQ, AWQ) or
    signed (compressed-tensors), `bits` wide."""

    values: torch.Tensor
    zero: Optional[torch.Tensor]
    scale: torch.Tensor
    scale_dtype: torch.dtype
    bits: int
    signed: bool

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        centred = self.values.to(torch.float32) if self.zero is None else self.values.to(torch.float32) - self.zero
        return centred * self.scale


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, layout: ScaleLayout,
                  bits: int, zero_offset: int, names: dict[str, str]) -> AffineWeight:
    """GPTQ: qweight int32 [in / per_word, out] packed along the input, qzeros int32 [groups, out / per_word] packed
    along the output, scales [groups, out]; weight = (q - (zero + zero_offset)) * scale of the column's group."""
    per_word = 32 // bits
    in_f, out_f = qweight.shape[0] * per_word, qweight.shape[1]
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2, names["qweight"], qweight, "a 2-d int32 tensor")
    num_groups = 1 if layout.group_size is None or layout.group_size < 0 else math.ceil(in_f / layout.group_size)
    _check(tuple(qzeros.shape) == (num_groups, math.ceil(out_f / per_word)), names["qzeros"], qzeros,
           f"{[num_groups, math.ceil(out_f / per_word)]} int32 for {bits}-bit values of a [{out_f}, {in_f}] weight")
    _check(tuple(scales.shape) == (num_groups, out_f), names["scales"], scales, f"{[num_groups, out_f]}")
    q = unpack_int32(qweight, bits, 0).t()
    zeros = unpack_int32(qzeros, bits, 1)[:, :out_f].t() + zero_offset
    return AffineWeight(q, layout.expand(zeros, out_f, in_f, names["qzeros"]),
                        layout.expand(scales.t(), out_f, in_f, names["scales"]), scales.dtype, bits, signed=False)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, layout: ScaleLayout,
                 names: dict[str, str]) -> AffineWeight:
    """AWQ GEMM: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8] packed along the output in
    AWQ_PACK_ORDER, scales [groups, out]; weight = (q - zero) * scale of the column's group."""
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2, names["qweight"], qweight, "a 2-d int32 tensor")
    num_groups = 1 if layout.group_size is None or layout.group_size < 0 else math.ceil(in_f / layout.group_size)
    _check(tuple(qzeros.shape) == (num_groups, out_f // 8), names["qzeros"], qzeros, f"{[num_groups, out_f // 8]}")
    _check(tuple(scales.shape) == (num_groups, out_f), names["scales"], scales, f"{[num_groups, out_f]}")
    q = _awq_columns(unpack_int32(qweight, 4, 1)).t()
    zeros = _awq_columns(unpack_int32(qzeros, 4, 1)).t()
    return AffineWeight(q, layout.expand(zeros, out_f, in_f, names["qzeros"]),
                        layout.expand(scales.t(), out_f, in_f, names["scales"]), scales.dtype, 4, signed=False)


def _awq_columns(nibbles: torch.Tensor) -> torch.Tensor:
    """Nibbles in word order -> values in column order: column c * 8 + AWQ_PACK_ORDER[i] is nibble i of word c."""
    position_of_column = torch.tensor(AWQ_PACK_ORDER).argsort()
    rows = nibbles.shape[0]
    return nibbles.reshape(rows, -1, 8)[:, :, position_of_column].reshape(rows, -1)


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, layout: ScaleLayout, names: dict[str, str]) -> AffineWeight:
    """FP8: weight float8 [out, in] times its scale (one, one per row, or one per block: `weight_scale_inv`, which
    despite its name multiplies, as DeepSeek's and Qwen's checkpoints use it)."""
    _check(weight.dtype in FP8_DTYPES and weight.dim() == 2, names["weight"], weight, "a 2-d float8 tensor")
    out_f, in_f = weight.shape
    return AffineWeight(weight, None, layout.expand(scale, out_f, in_f, names["scale"]), scale.dtype, 8, signed=True)


def compressed_weight(values: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                      layout: ScaleLayout, bits: int, names: dict[str, str]) -> AffineWeight:
    """compressed-tensors: (value - zero_point) * scale; `values` are the signed integers (or fp8 values) of the
    [out, in] weight, `zero_point` already unpacked (None: symmetric)."""
    out_f, in_f = values.shape
    s = layout.expand(scale, out_f, in_f, names["scale"])
    z = layout.expand(zero_point, out_f, in_f, names["zero_point"]) if zero_point is not None else None
    return AffineWeight(values, z, s, scale.dtype, bits, signed=True)


def unpack_compressed(packed: torch.Tensor, shape: torch.Tensor, bits: int, names: dict[str, str]) -> torch.Tensor:
    """compressed-tensors pack-quantized: weight_packed int32 [out, ceil(in / per_word)] packed along the input, each
    value stored plus 2^(bits - 1); weight_shape [out, in]. The signed values [out, in], int32."""
    _check(shape.numel() == 2, names["shape"], shape, "2 values, [out, in]")
    out_f, in_f = (int(v) for v in shape.reshape(-1).tolist())
    per_word = 32 // bits
    _check(packed.dtype == torch.int32 and tuple(packed.shape) == (out_f, math.ceil(in_f / per_word)),
           names["packed"], packed, f"{[out_f, math.ceil(in_f / per_word)]} int32 for weight_shape {[out_f, in_f]}")
    return unpack_int32(packed, bits, 1)[:, :in_f] - (1 << (bits - 1))


def unpack_compressed_zero_point(zero_point: torch.Tensor, out_f: int, bits: int, name: str) -> torch.Tensor:
    """A pack-quantized zero point: int32 packed along the output rows (as the weight's values, offset by
    2^(bits - 1)) for group / channel strategies; an unpacked one (int8) is returned as it is."""
    if zero_point.dtype != torch.int32:
        return zero_point
    per_word = 32 // bits
    _check(zero_point.dim() == 2 and zero_point.shape[0] == math.ceil(out_f / per_word), name, zero_point,
           f"{math.ceil(out_f / per_word)} packed rows for {out_f} output rows")
    return unpack_int32(zero_point, bits, 0)[:out_f] - (1 << (bits - 1))

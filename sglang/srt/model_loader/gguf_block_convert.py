"""Q4_1 / Q8_0 blocks made at load from the other block types of a GGUF file, one tensor at a time.

The GGUF kernels (layers/quantization/gguf_blocks.py) read Q4_1 and Q8_0 blocks. A file's Q4_0, Q5_0, Q5_1 and
K-quant (Q2_K .. Q6_K) matrices are turned into those from the file's own values, a slice of rows at a time, never
through a float copy of the whole model:

- Q4_0 -> Q4_1 (model_loader/gguf_reader.q4_0_as_q4_1): exact.
- Q4_K -> Q4_1. Each 32-weight sub-block of a Q4_K super-block holds w = d*sc*q - dmin*m (d, dmin fp16; sc, m
  6-bit; q 4-bit), a Q4_1 block with d' = fp16(d*sc) and m' = fp16(-dmin*m). Each product is exact in float32 and
  rounded once to fp16 (11 significant bits), so |w' - w| <= 2^-11 * (15*|d*sc| + |dmin*m|), plus the float32
  rounding of both sums (2^-23 of the same magnitude) and 2^-25 where a product is an fp16 subnormal: 1/2048 of
  the sub-block's span 15*d*sc plus its offset.
- Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K (and Q4_0 / Q4_1 / Q4_K stacked with one of them in a fused layer) -> Q8_0.
  Where a 32-weight block's values are integers a (|a| <= 127) times the type's fp16 scale s (the block's d, or
  its super-block's d), the Q8_0 block is (s, a): exact. That holds for every block of Q4_0 (a = q - 8) and Q5_0
  (a = q - 16), for Q3_K (a = (sc - 32) * q) except blocks holding a +-128, and for Q6_K (a = sc * (q - 32)),
  Q2_K or Q4_1 / Q5_1 blocks whose integers happen to fit. Every other block (the offsets of Q4_1 / Q5_1 / Q2_K /
  Q4_K / Q5_K, Q6_K's larger products) is rounded once: d = the smallest fp16 >= max|w| / 127, q = round(w / d),
  so |w' - w| <= d / 2 <= max|w| / 254 * (1 + 2^-10) (w / d is divided in float32: 2^-23 more at a half-way
  point), as for Q8_0 blocks quantized from float weights.

The K-quants are converted by the compiled kernels where they are available (csrc/gguf_kquant_convert.h: the same
rules, bit for bit, on both cores: 0.9 s instead of 13.6 s for SmolLM2-1.7B's Q4_K_M file), else here in numpy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.layers.quantization.gguf_blocks import (
    KQUANT_TYPES,
    PACKED_FROM,
    QK,
    ROW_GROUP,
    GGUFQuantWeight,
    dequantize_raw,
    kernel_module,
    pack_stored,
)
from sglang.srt.model_loader.gguf_reader import GGML_BLOCK_TYPES, gguf_tensor_table, q4_0_as_q4_1

# The block type each stored type is served as when a layer's parts all allow Q4_1; otherwise Q8_0.
SERVED_AS = {"Q4_0": "Q4_1", "Q4_1": "Q4_1", "Q4_K": "Q4_1", "Q8_0": "Q8_0", "Q5_0": "Q8_0", "Q5_1": "Q8_0",
             "Q2_K": "Q8_0", "Q3_K": "Q8_0", "Q5_K": "Q8_0", "Q6_K": "Q8_0"}
KERNEL_TYPES = ("Q4_1", "Q8_0")
# Stored types: (weights per block, bytes per block), and the byte offset of the fp16 scale tried as Q8_0's exact
# scale.
_SIZES = {name: (per_block, block_bytes) for name, per_block, block_bytes in GGML_BLOCK_TYPES.values()}
_SCALE_AT = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q8_0": 0, "Q2_K": 80, "Q3_K": 108, "Q4_K": 0, "Q5_K": 0,
             "Q6_K": 208}
# Values converted per slice of rows: the float64 temporaries of a slice stay a few tens of MB.
SLICE_VALUES = 1 << 20


def served_type(qtypes: Iterable[str]) -> str:
    """The block type a layer stacking parts of `qtypes` is served as: Q4_1 where every part allows it, else Q8_0."""
    return "Q4_1" if all(SERVED_AS[t] == "Q4_1" for t in qtypes) else "Q8_0"


def file_served_type(path: str | os.PathLike) -> Optional[str]:
    """The block type most of a GGUF file's matrix weights are served as (by their count of weights; a layer's parts
    counted one by one), or None where it holds none of `SERVED_AS`'s types. Reads the header only."""
    counts: dict[str, int] = {}
    for _, dims, ttype, _ in gguf_tensor_table(path)[1]:
        name = GGML_BLOCK_TYPES.get(ttype, ("",))[0]
        if name in SERVED_AS and len(dims) >= 2:
            counts[SERVED_AS[name]] = counts.get(SERVED_AS[name], 0) + int(np.prod(dims))
    return max(counts, key=lambda t: counts[t]) if counts else None


def _numpy(raw: Any) -> np.ndarray:
    return raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)


def _rows(raw: Any) -> torch.Tensor:
    """Stored blocks [n, row_bytes] as a uint8 tensor (a view where they are one)."""
    return raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))


def file_values(qtype: str, raw: Any, n: int, k: int) -> torch.Tensor:
    """Float32 [n, k]: the values of stored blocks, as the reference (`gguf.quants.dequantize`) computes them (Q4_0,
    Q4_1 and Q8_0 packed and read back by the kernels where they are available)."""
    if qtype in PACKED_FROM:
        rows = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.array(raw, dtype=np.uint8))
        target = PACKED_FROM[qtype][1]
        packed = pack_stored(target, [(qtype, rows)], k)
        if packed is not None:
            return GGUFQuantWeight.from_packed(target, packed, n, k).dequantize()
    if qtype in KERNEL_TYPES:
        return dequantize_raw(qtype, torch.as_tensor(_numpy(raw)), n, k)
    if qtype == "Q4_0":  # the Q4_1 blocks of the same values, dequantized faster than the reference's numpy
        return dequantize_raw("Q4_1", torch.from_numpy(q4_0_as_q4_1(_numpy(raw))), n, k)
    ext = kernel_module() if qtype in KQUANT_TYPES else None
    if ext is not None:  # the reference's values, bit for bit (csrc/gguf_kquant_rows.h)
        return ext.gather_kquant_rows(_rows(raw).contiguous(), KQUANT_TYPES[qtype], k, torch.arange(n))
    import gguf

    values = gguf.quants.dequantize(np.ascontiguousarray(_numpy(raw)), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(n, k))


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block from its 12 packed bytes [B, 12]: for sub-block
    j < 4, sc = byte j & 63 and m = byte j+4 & 63; for j >= 4 the low 4 bits sit in byte j+4 (sc low nibble, m high
    nibble) and the high 2 bits in the top bits of bytes j-4 (sc) and j (m)."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mins


def q4_k_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K blocks [n, blocks * 144] as Q4_1 blocks [n, blocks * 8 * 20]: per 32-weight sub-block
    d' = fp16(d * sc), m' = fp16(-dmin * m), and the same 4-bit q (module docstring: the rounding bound)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = _k4_scales(blocks[:, 4:16])
    with np.errstate(over="ignore"):  # an overflow is reported below
        scale = (d * sc.astype(np.float32)).astype(np.float16)  # the float32 product is exact; one rounding to fp16
        offset = (-(dmin * mins.astype(np.float32))).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError("a Q4_K scale product exceeds fp16's range")
    # 4 chunks of 32 bytes: low nibbles hold sub-block 2c's 32 values, high nibbles sub-block 2c+1's. A Q4_1 block
    # keeps value j in the low nibble of byte j and value j + 16 in its high nibble.
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    first, second = qs[..., :16], qs[..., 16:]
    even = (first & 0x0F) | ((second & 0x0F) << 4)
    odd = (first >> 4) | (second & 0xF0)
    q = np.stack([even, odd], axis=2).reshape(-1, 8, 16)
    out = np.concatenate([scale.view(np.uint8).reshape(-1, 8, 2), offset.view(np.uint8).reshape(-1, 8, 2), q],
                         axis=-1)
    return out.reshape(n, -1)


def _block_scales(qtype: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Float32 [n, k / 32]: the fp16 scale each 32-weight block of stored blocks is tried against as an exact Q8_0
    scale (the block's d, or its super-block's d repeated over its 32-weight blocks)."""
    (per_block, block_bytes), at = _SIZES[qtype], _SCALE_AT[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per_block, block_bytes)
    d = torch.from_numpy(blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32))
    return d.repeat_interleave(per_block // QK, dim=1)


def q8_0_from_values(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks uint8 [n, k / 32 * 34] of float32 values [n, k]: (s, w / s) where a block is exactly integers of
    at most 127 times its candidate fp16 scale s (`scales`, [n, k / 32]; checked by multiplying back), else rounded
    with the smallest fp16 d >= max|w| / 127 (module docstring: the bound; w / d is computed in float32, which can
    move a value within 2^-23 of a half-way point to the other side)."""
    n, k = values.shape
    w = values.reshape(n, k // QK, QK)
    need = w.abs().amax(dim=-1) / 127
    d16 = need.to(torch.float16)
    short = d16.float() < need  # rounded down: the next fp16 up (the bits of a non-negative fp16 count up with it)
    d16 = torch.where(short, (d16.view(torch.int16) + 1).view(torch.float16), d16)
    if not bool(torch.isfinite(d16).all()):
        raise ValueError("a block's values exceed the range of a Q8_0 scale")
    d = d16.float().unsqueeze(-1)
    s = scales.unsqueeze(-1)
    q = torch.where(d > 0, torch.round(w / d), torch.zeros(()))
    a = torch.where(s != 0, torch.round(w / s), torch.zeros(()))
    exact = (a.abs().amax(dim=-1) <= 127) & (a * s == w).all(dim=-1)
    scale = torch.where(exact, scales.to(torch.float16), d16)
    ints = torch.where(exact.unsqueeze(-1), a, q).clamp(-127, 127).to(torch.int8)
    out = torch.cat([scale.unsqueeze(-1).view(torch.uint8), ints.view(torch.uint8)], dim=-1)
    return out.reshape(n, -1)


def convert_blocks(qtype: str, raw: Any, n: int, k: int, target: str) -> torch.Tensor:
    """Stored blocks of `qtype` [n, row_bytes] as `target` (Q4_1 / Q8_0) blocks, uint8 [n, k / 32 * block bytes],
    converted a slice of rows at a time."""
    if target not in KERNEL_TYPES or (target == "Q4_1" and SERVED_AS[qtype] != "Q4_1"):
        raise ValueError(f"GGUF {qtype} blocks cannot be served as {target}")
    data = _numpy(raw)
    if qtype == target:
        return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    if qtype == "Q4_0" and target == "Q4_1":
        return torch.from_numpy(q4_0_as_q4_1(data))
    ext = kernel_module() if qtype in KQUANT_TYPES else None
    if ext is not None:
        try:
            return ext.convert_kquant_rows(_rows(raw), KQUANT_TYPES[qtype], k, target == "Q4_1")
        except RuntimeError as err:  # a scale beyond fp16's range, as the rules below raise it
            raise ValueError(str(err).splitlines()[0]) from err
    rows_per_slice = max(1, SLICE_VALUES // k)
    out = []
    for start in range(0, n, rows_per_slice):
        rows = data[start : start + rows_per_slice]
        if target == "Q4_1":  # Q4_K
            out.append(torch.from_numpy(q4_k_as_q4_1(rows)))
            continue
        values = file_values(qtype, rows, rows.shape[0], k)
        out.append(q8_0_from_values(values, _block_scales(qtype, rows, rows.shape[0], k)))
    return torch.cat(out).contiguous()


# Rows converted and packed at a time by `converted_packed` (about this many values): a slice's converted blocks are
# a few MB beside the packed weight, not a whole converted copy of it (an LM head's: 0.2 GB at a 7B shape).
PACK_SLICE_VALUES = 1 << 22


def converted_packed(parts: Sequence[tuple[str, Any, int, int]], target: str, k: int) -> Optional[torch.Tensor]:
    """Stored matrices `parts` ((type, raw [rows, row bytes], rows, k)) stacked along N, converted to `target` blocks
    and packed into its row groups a slice of rows at a time (bit for bit what packing the whole converted stack
    gives); None where the compiled packer is unavailable."""
    n = sum(p[2] for p in parts)
    step = max(ROW_GROUP, PACK_SLICE_VALUES // k // ROW_GROUP * ROW_GROUP)
    out: Optional[torch.Tensor] = None
    for start in range(0, n, step):
        stop, first, pieces = min(n, start + step), 0, []
        for qtype, raw, rows, _ in parts:
            lo, hi = max(start, first), min(stop, first + rows)
            if lo < hi:
                piece = raw[lo - first : hi - first]
                stored = PACKED_FROM.get(qtype, (0, ""))[1] == target  # packed as it is
                pieces.append((qtype, piece) if stored else (target, convert_blocks(qtype, piece, hi - lo, k, target)))
            first += rows
        packed = pack_stored(target, [(t, _rows(r)) for t, r in pieces], k)
        if packed is None:
            return None
        if out is None:
            out = torch.empty((-(-n // ROW_GROUP), *packed.shape[1:]), dtype=torch.uint8)
        out[start // ROW_GROUP : start // ROW_GROUP + packed.shape[0]].copy_(packed)
    return out

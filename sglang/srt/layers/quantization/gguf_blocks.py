"""Weight-only GGUF Q4_1 / Q8_0 linear layers for CPU decode.

A `GGUFQuantWeight` keeps the blocks of a GGUF tensor (repacked into a SIMD-friendly layout of the same size) and
multiplies activations against them with a small C++ extension, so a model loaded from a Q4_1 GGUF computes with
exactly the weight values the reference dequantizer produces (`d * q + m` for Q4_1, `d * q` for Q8_0) while reading
0.625 / 1.0625 bytes per weight instead of 4.

Raw GGUF blocks cover 32 consecutive inputs (K) of one output row (N); a tensor is stored as a uint8 array
[N, K / 32 * block_bytes]:

- Q4_1: 20 bytes = fp16 d, fp16 m, 16 bytes qs; w[j] = d * (qs[j] & 15) + m, w[j + 16] = d * (qs[j] >> 4) + m.
- Q8_0: 34 bytes = fp16 d, 32 int8 qs; w[j] = d * qs[j].

The packed layout interleaves 16 output rows per "row group" (see `pack_raw` and csrc/gguf_linear.cpp).
Row selection, permutation and concatenation along N work on raw blocks (`GGUFQuantWeight.raw()` recovers them
exactly), so Q/K row permutations and fused QKV / gate-up weights are built before repacking.

The extension is compiled on first use with torch's JIT loader into
`$SGLANG_CACHE_DIR/torch_extensions` (default `~/.cache/sglang-lite/torch_extensions`), one build per torch version,
compiler flags and source. `kernels_available()` is False (with one logged warning) when the build is impossible
or fails, or when `SGLANG_DISABLE_GGUF_KERNELS=1`; `GGUFQuantWeight.linear` then falls back to a dense matmul with
the dequantized weight, which is correct but slow, so callers should keep dense weights in that case.

Performance (2-core AMD EPYC with AVX2, 2 threads, SmolLM2-135M shapes): a batch-1 decode step of matmuls (30
layers + lm_head, 66 MB Q4_1 + 30 MB Q8_0) takes about 5.7 ms against 38 ms for float32 `F.linear`. Time grows
about linearly with the number of rows of x beyond 2, so dense float32 (MKL) overtakes the kernels at around
M = 64-96 rows with weights streamed from DRAM (M = 32-48 when they stay in cache): dispatch on M accordingly.
Calls smaller than `set_min_thread_bytes()` per thread run on one thread, since waking an OpenMP worker costs
about as much as streaming 100-200 KB of weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sglang.srt.layers.cpu_extension import CpuExtension

logger = logging.getLogger(__name__)

QK = 32  # weights per GGUF block
ROW_GROUP = 16  # output rows interleaved in the packed layout ...
HALF = 8  # ... as two halves of 8 (one 32-bit SIMD lane per row)
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
SUPPORTED_QTYPES = tuple(BLOCK_BYTES)
# The K-quant types the compiled kernels read as stored (csrc/gguf_kquant_rows.h), by GGML type id.
KQUANT_TYPES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

DISABLE_ENV = "SGLANG_DISABLE_GGUF_KERNELS"
_SOURCE = Path(__file__).resolve().parent / "csrc" / "gguf_linear.cpp"
# The headers of the kernels (decode_stack.cpp includes them too): part of each extension's build hash.
KERNEL_HEADERS = [_SOURCE.parent / name
                  for name in ("gguf_kernels.h", "gguf_avx2_kernels.h", "gguf_int8.h", "gguf_int8_input.h",
                                "gguf_layout.h",
                                "gguf_dequant_gemm.h", "gguf_dequant_rows.h", "gguf_kquant_rows.h",
                                "gguf_kquant_checks.h")]
KERNEL_HEADERS.append(_SOURCE.parent.parent.parent / "csrc" / "vpdpbusd.h")  # included by gguf_int8_input.h


# ---------------------------------------------------------------------------------------------------------------------
# Extension loading


_EXTENSION = CpuExtension("sglang_gguf_linear", _SOURCE, "GGUF quantized CPU kernels", DISABLE_ENV,
                          headers=[*KERNEL_HEADERS, _SOURCE.parent / "gguf_pack.h",
                                   _SOURCE.parent / "gguf_kquant_convert.h"])


def kernels_available() -> bool:
    """Whether the compiled Q4_1 / Q8_0 kernels can be used (builds them on the first call)."""
    return _EXTENSION.available()


def kernels_unavailable_reason() -> str | None:
    """Why `kernels_available()` is False, or None."""
    return _EXTENSION.unavailable_reason()


def kernel_module() -> Any:
    """The loaded extension module (with `q4_1_linear`, `q8_0_linear`), or None when unavailable."""
    return _EXTENSION.module()


def set_min_thread_bytes(nbytes: int) -> int | None:
    """Minimum weight bytes each thread must get before one call is split between torch's intra-op threads
    (default 128 KiB; 0 splits every call). Returns the previous value, or None without the kernels."""
    ext = kernel_module()
    return None if ext is None else int(ext.set_min_thread_bytes(int(nbytes)))


def set_dequant_min_rows(rows: int) -> int | None:
    """From how many rows of x the float32 matmuls convert each row group of weights once for all the rows, instead
    of once per tile of 8 rows (AVX2 kernels; default 10; 0 never). For tests and benchmarks; the fused decode step
    has its own switch (fused_cpu_decode.set_dequant_min_rows). Returns the previous value, or None without the
    kernels."""
    if rows < 0:
        raise ValueError("rows must be >= 0")
    ext = kernel_module()
    return None if ext is None else int(ext.set_dequant_min_rows(int(rows)))


# ---------------------------------------------------------------------------------------------------------------------
# Raw block helpers (pure torch)


def normalize_qtype(qtype: Any) -> str:
    """'Q4_1' / 'Q8_0' from a name, a gguf.GGMLQuantizationType or its integer value."""
    name = getattr(qtype, "name", None)
    if name is None and isinstance(qtype, (int, np.integer)):
        from gguf import GGMLQuantizationType

        name = GGMLQuantizationType(int(qtype)).name
    if name is None:
        name = str(qtype)
    name = name.upper()
    if name not in BLOCK_BYTES:
        raise ValueError(f"unsupported GGUF quantization type {qtype!r}; supported: {SUPPORTED_QTYPES}")
    return name


def row_bytes(qtype: Any, k: int) -> int:
    """Bytes of one output row of raw blocks."""
    qtype = normalize_qtype(qtype)
    if k <= 0 or k % QK:
        raise ValueError(f"K must be a positive multiple of {QK}, got {k}")
    return k // QK * BLOCK_BYTES[qtype]


def as_raw_tensor(raw: Any, qtype: Any, n: int, k: int) -> torch.Tensor:
    """Raw blocks (numpy array, torch tensor or bytes) as a contiguous uint8 tensor [n, row_bytes] (numpy data is
    copied, since it is typically a read-only memory map; a torch tensor may be returned as is)."""
    rb = row_bytes(qtype, k)
    if isinstance(raw, torch.Tensor):
        t = raw.detach().to("cpu")
        if t.dtype != torch.uint8:
            raise TypeError(f"raw blocks must be uint8, got {t.dtype}")
    else:
        arr = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        arr = np.asarray(arr)
        if arr.dtype != np.uint8:
            raise TypeError(f"raw blocks must be uint8, got {arr.dtype}")
        # Copy: the source is typically a read-only memory map of the GGUF file.
        t = torch.from_numpy(np.array(arr, copy=True))
    if t.numel() != n * rb:
        raise ValueError(f"raw blocks have {t.numel()} bytes, expected {n} x {rb} for N={n}, K={k}")
    return t.reshape(n, rb).contiguous()


def _half_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 at byte `offset` of each block [..., block_bytes] -> float32 [..., 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def dequantize_raw(qtype: Any, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Float32 [n, k] weights from raw blocks, bit-identical to `gguf.quants.dequantize`."""
    qtype = normalize_qtype(qtype)
    raw = as_raw_tensor(raw, qtype, n, k)
    nb = k // QK
    blocks = raw.view(n, nb, BLOCK_BYTES[qtype])
    d = _half_field(blocks, 0)
    if qtype == "Q4_1":
        m = _half_field(blocks, 2)
        qs = blocks[..., 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.float32)
        w = d * q + m  # two roundings, as the reference (numpy float32) does
    else:
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
        w = q * d
    return w.reshape(n, k)


# GGML type ids of the stored types the compiled packer writes into row groups (csrc/gguf_pack.h), and the type each
# is served as.
PACKED_FROM = {"Q4_0": (2, "Q4_1"), "Q4_1": (3, "Q4_1"), "Q8_0": (8, "Q8_0")}

# A matrix of GGUF blocks as stored, before packing: (stored type, raw uint8 [n, row bytes], n, k).
RawBlocks = tuple[str, torch.Tensor, int, int]


def pack_stored(target: str, parts: Sequence[tuple[str, torch.Tensor]], k: int) -> torch.Tensor | None:
    """The stored matrices `parts` ((type, uint8 [rows, row bytes as stored]), e.g. views of a GGUF file) stacked
    along N, packed as `target` row groups by the compiled packer in one pass: no converted or stacked copy of the
    raw blocks (Q4_0 becomes Q4_1 of the same values as on the way, as model_loader/gguf_reader.q4_0_as_q4_1 makes
    them). None where the kernels are unavailable or a part is not of a type packed as `target`."""
    if not parts or any(PACKED_FROM.get(qtype, (0, ""))[1] != target for qtype, _ in parts):
        return None
    ext = kernel_module()
    if ext is None:
        return None
    return ext.pack_blocks([raw for _, raw in parts], [PACKED_FROM[qtype][0] for qtype, _ in parts],
                           target == "Q4_1", k)


def pack_raw(qtype: Any, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Repack raw blocks [n, row_bytes] into the row-group layout used by the kernels (same byte count, plus zero
    padding of N up to a multiple of 16): uint8 [ceil(n/16), k/32, 16 * block_bytes]: by the compiled packer where
    the kernels are available, else by `pack_raw_torch`."""
    qtype = normalize_qtype(qtype)
    raw = as_raw_tensor(raw, qtype, n, k)
    packed = pack_stored(qtype, [(qtype, raw)], k)
    return pack_raw_torch(qtype, raw, n, k) if packed is None else packed


def pack_raw_torch(qtype: Any, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_raw` in torch operations (without the kernels).

    Per row group (16 output rows = 2 halves of 8) and block of 32 inputs: the fp16 scales of the 16 rows (then the
    16 mins for Q4_1), then for each 8 inputs (Q4_1; 4 for Q8_0) one 32-byte vector per half whose 4-byte lane r
    holds row r's quants: 8 nibbles, input i at bits 4i (Q4_1), or 4 int8 (Q8_0).
    """
    qtype = normalize_qtype(qtype)
    raw = as_raw_tensor(raw, qtype, n, k)
    bb = BLOCK_BYTES[qtype]
    nb = k // QK
    groups = -(-n // ROW_GROUP)
    blocks = raw.view(n, nb, bb)
    if groups * ROW_GROUP != n:
        pad = torch.zeros(groups * ROW_GROUP - n, nb, bb, dtype=torch.uint8)
        blocks = torch.cat([blocks, pad], dim=0)
    blocks = blocks.view(groups, ROW_GROUP, nb, bb)

    def per_row_field(lo: int, hi: int) -> torch.Tensor:  # [G, 16, nb, w] -> [G, nb, 16 * w]
        return blocks[..., lo:hi].permute(0, 2, 1, 3).reshape(groups, nb, ROW_GROUP * (hi - lo))

    if qtype == "Q4_1":
        qs = blocks[..., 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [G, 16, nb, 32]: q[k] for k = 0..31
        # Byte t of a lane for inputs 8j .. 8j+7 is q[8j + 2t] | q[8j + 2t + 1] << 4.
        q = q.view(groups, 2, HALF, nb, 4, 4, 2)  # [G, half, row, nb, j, t, lo/hi]
        lanes = (q[..., 0] | (q[..., 1] << 4)).permute(0, 3, 4, 1, 2, 5)  # [G, nb, j, half, row, t]
        packed = torch.cat(
            [per_row_field(0, 2), per_row_field(2, 4), lanes.reshape(groups, nb, 4 * ROW_GROUP * 4)], dim=-1
        )
    else:
        q = blocks[..., 2:].reshape(groups, 2, HALF, nb, 8, 4)  # [G, half, row, nb, j, i]
        lanes = q.permute(0, 3, 4, 1, 2, 5)  # [G, nb, j, half, row, i]
        packed = torch.cat([per_row_field(0, 2), lanes.reshape(groups, nb, 8 * ROW_GROUP * 4)], dim=-1)
    return packed.contiguous()


def unpack_to_raw(qtype: Any, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_raw`: the raw GGUF blocks [n, row_bytes]."""
    qtype = normalize_qtype(qtype)
    bb = BLOCK_BYTES[qtype]
    nb = k // QK
    groups = -(-n // ROW_GROUP)
    p = packed.view(groups, nb, ROW_GROUP * bb)

    def per_row_field(lo: int, width: int) -> torch.Tensor:  # [G, nb, 16 * w] -> [G, 16, nb, w]
        return p[..., lo : lo + ROW_GROUP * width].reshape(groups, nb, ROW_GROUP, width).permute(0, 2, 1, 3)

    if qtype == "Q4_1":
        lanes = p[..., 4 * ROW_GROUP :].reshape(groups, nb, 4, 2, HALF, 4)  # [G, nb, j, half, row, t]
        lanes = lanes.permute(0, 3, 4, 1, 2, 5).reshape(groups, ROW_GROUP, nb, 4, 4)  # [G, 16, nb, j, t]
        q = torch.stack([lanes & 0x0F, lanes >> 4], dim=-1).reshape(groups, ROW_GROUP, nb, QK)
        qs = q[..., :16] | (q[..., 16:] << 4)
        blocks = torch.cat([per_row_field(0, 2), per_row_field(2 * ROW_GROUP, 2), qs], dim=-1)
    else:
        lanes = p[..., 2 * ROW_GROUP :].reshape(groups, nb, 8, 2, HALF, 4)  # [G, nb, j, half, row, i]
        lanes = lanes.permute(0, 3, 4, 1, 2, 5).reshape(groups, ROW_GROUP, nb, QK)
        blocks = torch.cat([per_row_field(0, 2), lanes], dim=-1)
    return blocks.reshape(groups * ROW_GROUP, nb * bb)[:n].contiguous()


def rotary_rows_gguf_to_hf(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row permutation taking a llama-style GGUF attn_q / attn_k weight to the Hugging Face layout, as transformers
    does when it loads a GGUF (`perm[i]` = GGUF row of HF row i): within each head, GGUF interleaves the two rotary
    halves. Use n_heads = num_attention_heads for Q and num_key_value_heads for K."""
    if n_rows % (2 * n_heads):
        raise ValueError(f"{n_rows} rows do not split into {n_heads} heads of even size")
    return torch.arange(n_rows).view(n_heads, n_rows // n_heads // 2, 2).transpose(1, 2).reshape(-1)


# ---------------------------------------------------------------------------------------------------------------------
# Quantized weight


class GGUFQuantWeight:
    """A linear weight W [n, k] (out_features x in_features) held as GGUF Q4_1 / Q8_0 blocks.

    `linear(x)` computes x @ W.T with W exactly the reference-dequantized weight.
    """

    __slots__ = ("qtype", "n", "k", "packed", "_kernel")

    def __init__(self, qtype: Any, raw: Any, n: int, k: int):
        self.qtype = normalize_qtype(qtype)
        self.n = int(n)
        self.k = int(k)
        if self.n <= 0:
            raise ValueError(f"N must be positive, got {n}")
        self.packed = pack_raw(self.qtype, raw, self.n, self.k)
        self._kernel = None

    # -- construction helpers (all work on the raw blocks, then repack) --

    @classmethod
    def from_packed(cls, qtype: Any, packed: torch.Tensor, n: int, k: int) -> GGUFQuantWeight:
        obj = cls.__new__(cls)
        obj.qtype = normalize_qtype(qtype)
        obj.n, obj.k = int(n), int(k)
        expected = -(-obj.n // ROW_GROUP) * row_bytes(obj.qtype, obj.k) * ROW_GROUP
        if packed.dtype != torch.uint8 or packed.numel() != expected:
            raise ValueError("packed tensor does not match qtype / shape")
        obj.packed = packed.contiguous()
        obj._kernel = None
        return obj

    def raw(self) -> torch.Tensor:
        """The raw GGUF blocks, uint8 [n, row_bytes]."""
        return unpack_to_raw(self.qtype, self.packed, self.n, self.k)

    def select_rows(self, index: Any) -> GGUFQuantWeight:
        """A weight made of output rows `index` (a slice, a bool mask or integer indices, repeats allowed)."""
        raw = self.raw()
        if not isinstance(index, slice):
            index = torch.as_tensor(index)
            if index.dtype != torch.bool:
                index = index.to(torch.int64)
        rows = raw[index]
        if rows.dim() != 2 or rows.shape[0] == 0:
            raise ValueError("row selection must keep a 2-D, non-empty set of rows")
        return GGUFQuantWeight(self.qtype, rows, rows.shape[0], self.k)

    def permute_rows(self, perm: Any) -> GGUFQuantWeight:
        """Output rows reordered: row i of the result is row perm[i] of this weight."""
        perm = torch.as_tensor(perm, dtype=torch.int64)
        if perm.shape != (self.n,) or not torch.equal(torch.sort(perm).values, torch.arange(self.n)):
            raise ValueError(f"perm must be a permutation of range({self.n})")
        return self.select_rows(perm)

    @staticmethod
    def concat(weights: Sequence[GGUFQuantWeight]) -> GGUFQuantWeight:
        """Concatenation along N (output rows), e.g. fused QKV or gate/up. All parts must share qtype and K."""
        if not weights:
            raise ValueError("nothing to concatenate")
        qtype, k = weights[0].qtype, weights[0].k
        for w in weights:
            if w.qtype != qtype or w.k != k:
                raise ValueError(
                    f"cannot concatenate {w.qtype} K={w.k} with {qtype} K={k}: qtype and K must match"
                )
        raws = [w.raw() for w in weights]
        return GGUFQuantWeight(qtype, torch.cat(raws, dim=0), sum(w.n for w in weights), k)

    # -- numerics --

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def dequantize(self) -> torch.Tensor:
        """Float32 [n, k], bit-identical to `gguf.quants.dequantize` of the raw blocks."""
        return self.dequantize_rows(0, self.n)

    def dequantize_rows(self, start: int, count: int) -> torch.Tensor:
        """Float32 [count, k]: rows start .. start + count of `dequantize()` (start a multiple of 16), read from the
        blocks by the kernels (d * q is exact in float32, so d * q + m rounds once with or without an FMA)."""
        if start % ROW_GROUP or not 0 <= start <= start + count <= self.n:
            raise ValueError(f"rows {start} .. {start + count} are not a run of rows of {self.n} from a row group")
        ext = kernel_module()
        if ext is None:  # only the row groups that hold those rows are unpacked
            first, end = start // ROW_GROUP, -(-(start + count) // ROW_GROUP)
            groups = self.packed.view(-(-self.n // ROW_GROUP), -1)[first:end]
            raw = unpack_to_raw(self.qtype, groups, (end - first) * ROW_GROUP, self.k)[:count]
            return dequantize_raw(self.qtype, raw, count, self.k)
        out = torch.empty(count, self.k, dtype=torch.float32)
        ext.dequant_rows(self.packed, self.qtype == "Q4_1", self.n, self.k, start, out)
        return out

    def columns(self, cols: torch.Tensor) -> torch.Tensor:
        """Float32 [n, len(cols)]: the dequantized weight's columns `cols` (int64), read from the blocks."""
        ext = kernel_module()
        if ext is None:
            return self.dequantize().index_select(1, cols)
        return ext.gather_columns(self.packed, self.qtype == "Q4_1", self.n, self.k, cols.contiguous())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 [len(ids), k]: the dequantized weight's rows `ids` (int64), read from the blocks."""
        ext = kernel_module()
        if ext is None:
            return self.dequantize().index_select(0, ids)
        return ext.gather_rows(self.packed, self.qtype == "Q4_1", self.n, self.k, ids.contiguous())

    def _resolve_kernel(self) -> Any:
        ext = kernel_module()
        if ext is not None:
            kernel = ext.q4_1_linear if self.qtype == "Q4_1" else ext.q8_0_linear
        else:

            def kernel(x2: torch.Tensor, packed: torch.Tensor, n: int, k: int, int8: bool = False,
                       one_term: bool = False) -> torch.Tensor:
                return x2 @ self.dequantize().T  # without the extension x stays float32

        self._kernel = kernel
        return kernel

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False,
               one_term: bool = False) -> torch.Tensor:
        """x [..., k] -> [..., n] = x @ W.T (+ bias), computed in float32 and returned in x's dtype.

        With `int8` the kernel quantizes x to int8 per 32-value block first (csrc/gguf_int8.h: integer dot
        products, AVX512-VNNI where the CPU has it); `one_term` in the one-term form (csrc/gguf_int8_input.h).
        Whether the compiled kernel or the dense fallback is used is decided on the first call.
        """
        kernel = self._kernel or self._resolve_kernel()
        if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return kernel(x, self.packed, self.n, self.k, int8, one_term)  # fast path: the kernel checks the shape
        if x.shape[-1] != self.k:
            raise ValueError(f"expected input with last dim {self.k}, got {tuple(x.shape)}")
        out_dtype = x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.dtype != torch.float32:
            x2 = x2.to(torch.float32)
        y = kernel(x2.contiguous(), self.packed, self.n, self.k, int8, one_term)
        if bias is not None:
            y = y + bias.to(torch.float32)
        if out_dtype != torch.float32:
            y = y.to(out_dtype)
        return y.reshape(*lead, self.n)

    __call__ = linear

    def __getstate__(self) -> dict[str, Any]:  # the resolved kernel is process-local
        return {"qtype": self.qtype, "n": self.n, "k": self.k, "packed": self.packed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.qtype, self.n, self.k, self.packed = state["qtype"], state["n"], state["k"], state["packed"]
        self._kernel = None

    def __repr__(self) -> str:
        return f"GGUFQuantWeight({self.qtype}, n={self.n}, k={self.k}, nbytes={self.nbytes})"

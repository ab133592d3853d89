"""Reading the quantized tensors of a GGUF file straight from its header, without decoding its metadata."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# GGUF metadata value types: fixed sizes in bytes; 8 = string, 9 = array.
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_ALIGNMENT_KEY = "general.alignment"
# Type ids of every block format served from blocks (the kernels' own, and those converted into them at load:
# model_loader/gguf_block_convert.py): name, weights per block, bytes per block.
GGML_BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                    8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
                    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
Q4_0_BLOCK_BYTES = 18
_STRING_LENGTH = struct.Struct("<Q")


def q4_0_as_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_0 blocks [n, blocks * 18] (fp16 d, 16 bytes of nibbles, w = d * (q - 8)) as Q4_1 blocks
    [n, blocks * 20] of exactly the same values: d kept, m = -8 d (a power-of-two scale: exact in fp16 for the
    scales of real weights). The kernels read Q4_1; the copy is 11% larger than the file's blocks."""
    n = raw.shape[0]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, -1, Q4_0_BLOCK_BYTES)
    m = (blocks[..., :2].copy().view(np.float16) * np.float16(-8)).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([blocks[..., :2], m, blocks[..., 2:]], axis=-1).reshape(n, -1))


def gguf_tensor_table(path: str | os.PathLike) -> tuple[np.ndarray, list[tuple[str, list[int], int, int]]]:
    """(the memory-mapped file, [(name, dims as listed, ggml type id, absolute data offset)]).

    Reads only the header: metadata values are skipped, not decoded (gguf's own reader decodes every one,
    which costs seconds for a tokenizer vocabulary of tens of thousands of strings)."""
    data = np.memmap(os.fspath(path), dtype=np.uint8, mode="c")  # private: a view written to never reaches the file
    buf = memoryview(data)  # type: ignore[arg-type]  # np.memmap exposes the buffer protocol
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal pos
        length = take("Q")
        text = bytes(buf[pos : pos + length]).decode("utf-8")
        pos += length
        return text

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype in _GGUF_SCALAR_SIZES:
            pos += _GGUF_SCALAR_SIZES[vtype]
        elif vtype == _GGUF_STRING:
            length = take("Q")  # read before adding: `pos += take(...)` would lose take's own advance
            pos += length
        elif vtype == _GGUF_ARRAY:
            elem_type, count = take("IQ")
            if elem_type in _GGUF_SCALAR_SIZES:
                pos += _GGUF_SCALAR_SIZES[elem_type] * count
            elif elem_type == _GGUF_STRING:  # a tokenizer's vocabulary: tens of thousands of length-prefixed strings
                length_at = _STRING_LENGTH.unpack_from
                for _ in range(count):
                    pos += 8 + length_at(buf, pos)[0]
            else:
                for _ in range(count):
                    skip_value(elem_type)
        else:
            raise ValueError(f"{path}: unknown GGUF metadata type {vtype}")

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF file of version 2 or later")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if key == _GGUF_ALIGNMENT_KEY and vtype == 4:
            alignment = take("I")
        else:
            skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("I")
        dims = [take("Q") for _ in range(n_dims)]
        infos.append((name, dims, take("I"), take("Q")))
    start = -(-pos // alignment) * alignment
    return data, [(name, dims, ttype, start + offset) for name, dims, ttype, offset in infos]


def read_gguf_quant_tensors(
    path: str | os.PathLike, names: Sequence[str] | None = None
) -> dict[str, tuple[str, np.ndarray, int, int]]:
    """The Q4_0 / Q4_1 / Q8_0 matrices of a GGUF file: {name: (qtype_name, raw uint8 [N, row_bytes], N, K)}, Q4_0
    ones as Q4_1 blocks of the same values (`q4_0_as_q4_1`).

    The Q4_1 / Q8_0 arrays are views of the file's private memory map. Only 2-D tensors are returned (gguf lists dims
    reversed, [K, N]); `names` restricts the result to those tensors.
    """
    out: dict[str, tuple[str, np.ndarray, int, int]] = {}
    for name, (qname, raw, n, k) in read_gguf_block_tensors(path, names).items():
        if qname == "Q4_0":
            out[name] = ("Q4_1", q4_0_as_q4_1(raw), n, k)
        elif qname in ("Q4_1", "Q8_0"):
            out[name] = (qname, raw, n, k)
    return out


def read_gguf_block_tensors(
    path: str | os.PathLike, names: Sequence[str] | None = None, stacked: bool = False
) -> dict[str, tuple[str, np.ndarray, int, int]]:
    """The 2-D matrices of a GGUF file in any type of `GGML_BLOCK_TYPES`, as stored: {name: (type name, raw uint8
    [N, row_bytes] (a view of the file's private memory map), N, K)}; `names` restricts the result. `stacked`:
    the 3-D tensors too (MoE experts, [experts, N, K] in row-major order), as matrices of experts * N rows."""
    wanted = set(names) if names is not None else None
    data, table = gguf_tensor_table(path)
    out: dict[str, tuple[str, np.ndarray, int, int]] = {}
    for name, dims, ttype, offset in table:
        if ((wanted is not None and name not in wanted) or ttype not in GGML_BLOCK_TYPES
                or len(dims) not in ((2, 3) if stacked else (2,))):
            continue
        qname, per_block, block_bytes = GGML_BLOCK_TYPES[ttype]
        k, n = dims[0], int(np.prod(dims[1:]))
        if k % per_block:
            continue
        row = k // per_block * block_bytes
        out[name] = (qname, data[offset : offset + n * row].reshape(n, row), n, k)
    return out


def mapped_page_dropper(tensors: Mapping[str, tuple[str, np.ndarray, int, int]]) -> Callable[[int, int], None]:
    """For the arrays `read_gguf_block_tensors` returned (views of one private mapping of the file): a function
    drop(address, nbytes) that drops the whole pages of that range from this process where the range lies in the
    mapping, once its blocks are copied out (madvise MADV_DONTNEED: the pages stay in the page cache and are read
    from the file again if touched; nothing writes to them), so the mapped file does not add to the load's resident
    peak. Ranges elsewhere (copies of rows) are left alone; without madvise it does nothing."""
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for _, a, _, _ in tensors.values()]
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if not spans or advice is None:
        return lambda address, nbytes: None
    low, high = min(start for start, _ in spans), max(end for _, end in spans)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    page = mmap.PAGESIZE

    def drop(address: int, nbytes: int) -> None:
        if low <= address and address + nbytes <= high:
            start, stop = -(-address // page) * page, (address + nbytes) // page * page
            if stop > start:
                madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), advice)

    return drop

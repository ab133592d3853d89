"""A model's weights in 2 MB pages (Linux transparent huge pages).

A CPU decode step streams every weight of the model once (1.8 GB at 1.7B parameters). In 4 KB pages that is a TLB
miss and a page walk per 4 KB, and the hardware prefetchers stop at every page boundary: batch-1 matmuls over a 1.7B
model's Q8_0 blocks read 22 GB/s from 4 KB pages and 26 GB/s from 2 MB pages on one 2-core machine, and when other
processes share the cores the gap grows to 2x (benchmarks/RESULTS.md, "Huge pages").

Once a model is loaded (its blocks, GEMM copies and float weights final), `move_weights` copies every large CPU
tensor it holds into one anonymous mapping advised into huge pages (madvise(MADV_HUGEPAGE)) and points the tensors at
it (`Tensor.set_`: every holder of the tensor object sees the move). Only the weights: activations, allocated and
freed at every step, stay in the allocator's pages (PyTorch's own THP_MEM_ALLOC_ENABLE=1 puts every allocation of
2 MB or more in huge pages, which made a 900-token prefill ~10% slower here: each fresh buffer faults in 2 MB pages,
compacting memory for them). A buffer that fills slowly (the K/V pool: sized for the whole memory budget, written a
token at a time) is kept in 4 KB pages even where the kernel would give huge pages to everything (mode `always`):
`keep_small_pages`.

The move costs a copy of the weights, and where the machine's free memory is fragmented the kernel compacts it for
the first huge pages: 0.3 s for 2 GB on compacted memory, 1.9 s for SmolLM2-135M's 0.76 GB on a machine that had
been starting servers for hours. Below AUTO_MIN_BYTES of weights (where the gain measured 1.03x) the weights stay
unless SGLANG_HUGE_PAGES=1; SGLANG_HUGE_PAGES=0 never moves them, nor does a kernel whose mode
(/sys/kernel/mm/transparent_hugepage/enabled) is `never`. Either way the heap's free pages are handed back once the
weights are final: what loading freed (a GGUF file's tensors, float copies released for blocks) would otherwise stay
resident. This module imports torch only inside its functions.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import time
from collections.abc import Iterable
from typing import Any, Optional

ENV = "SGLANG_HUGE_PAGES"
MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE = 2 << 20
PAGE = 4096
# Tensors whose storage is smaller stay where they are (a few norms and biases: not worth a page of their own).
MIN_BYTES = 256 << 10
# Models with fewer bytes of weights keep them where they are unless SGLANG_HUGE_PAGES=1.
AUTO_MIN_BYTES = 1 << 30
# While weights move, the heap's free pages are handed back after each this many bytes.
TRIM_BYTES = 256 << 20


def kernel_mode(path: str = MODE_FILE) -> Optional[str]:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), or None where it has none."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def why_not_huge() -> Optional[str]:
    """Why weights stay in the allocator's pages here, or None."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    mode = kernel_mode()
    if mode not in ("madvise", "always") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"no transparent huge pages on this system (mode {mode})"
    return None


def anon_huge_bytes(pid: int | str = "self") -> int:
    """Bytes of the process's anonymous memory in huge pages (0 where the kernel does not report them)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def held_tensors(model: Any, depth: int = 4) -> list[Any]:
    """Every tensor `model` holds: its modules' parameters and buffers and the tensors of the objects their
    attributes hold (linear methods, their blocks and GEMM copies), up to `depth` objects deep."""
    import torch
    from torch import nn

    found: dict[int, Any] = {}

    def visit(obj: Any, left: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
        elif left > 0 and not isinstance(obj, (nn.Module, str, bytes, int, float, type)):
            if isinstance(obj, dict):
                values: Iterable[Any] = obj.values()
            elif isinstance(obj, (list, tuple)):
                values = obj
            else:  # an object's attributes, those of __slots__ classes (GGUFQuantWeight) included
                slots = (getattr(obj, name, None) for c in type(obj).__mro__ for name in getattr(c, "__slots__", ()))
                values = [*getattr(obj, "__dict__", {}).values(), *slots]
            for value in values:
                visit(value, left - 1)

    for module in model.modules():
        for value in vars(module).values():  # _parameters and _buffers are dicts here; submodules are walked above
            visit(value, depth)
    return list(found.values())


def _storage_groups(tensors: Iterable[Any]) -> dict[int, list[Any]]:
    """The tensors that can move (CPU, strided, storage of MIN_BYTES or more), by storage."""
    import torch

    groups: dict[int, list[Any]] = {}
    for t in tensors:
        if (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
                and t.untyped_storage().nbytes() >= MIN_BYTES):
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return groups


def move_to_huge_pages(tensors: Iterable[Any]) -> int:
    """Copy the storages of `tensors` (CPU, strided, of MIN_BYTES or more) into one mapping advised into huge pages
    and point every given tensor at its copy, views included (same offsets, sizes and strides); returns the bytes
    moved. A storage some tensor not given here also uses keeps its old copy for that one."""
    return _move_groups(_storage_groups(tensors))


def _move_groups(groups: dict[int, list[Any]]) -> int:
    import torch

    if not groups:
        return 0
    sizes = {ptr: ts[0].untyped_storage().nbytes() for ptr, ts in groups.items()}
    places, total = {}, 0
    for ptr, size in sizes.items():
        places[ptr] = total
        total += -(-size // PAGE) * PAGE  # each storage on its own 4 KB pages
    arena = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE)  # anonymous: shared memory has its own THP rule
    arena.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive as long as a tensor uses it
    start = (-raw.data_ptr()) % HUGE
    unreleased = 0
    with torch.no_grad():
        for ptr, ts in groups.items():
            at = start + places[ptr]
            old = torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage())
            raw[at : at + sizes[ptr]].copy_(old)
            del old
            for t in ts:
                t.set_(raw.untyped_storage(), at // t.element_size() + t.storage_offset(), t.size(), t.stride())
            unreleased += sizes[ptr]
            if unreleased >= TRIM_BYTES:  # the old copies' pages go back as the new ones fill: no second model at once
                release_free_heap()
                unreleased = 0
    release_free_heap()
    return sum(sizes.values())


def move_weights(model: Any) -> str:
    """Move the large CPU tensors `model` holds into huge pages (see the module's docstring); returns the startup
    log's line on it."""
    reason = why_not_huge()
    if reason is not None:
        release_free_heap()  # what loading freed (a checkpoint's raw blocks, float copies released) goes back
        return f"weights in the allocator's pages ({reason})"
    groups = _storage_groups(held_tensors(model))
    size = sum(ts[0].untyped_storage().nbytes() for ts in groups.values())
    if size < AUTO_MIN_BYTES and os.environ.get(ENV) != "1":
        release_free_heap()
        return (f"weights in the allocator's pages ({size / 1e9:.2f} GB, below {AUTO_MIN_BYTES / 2**30:.0f} GiB: "
                f"{ENV}=1 moves them to 2 MB pages)")
    before, start = anon_huge_bytes(), time.perf_counter()
    moved = _move_groups(groups)
    return (f"{moved / 1e9:.2f} GB of weights moved to 2 MB pages in {time.perf_counter() - start:.1f} s "
            f"({(anon_huge_bytes() - before) / 1e9:.2f} GB backed by huge pages; {ENV}=0 leaves them where they are)")


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    libc = _libc()
    if libc is None:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def release_free_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim): the weights' old copies leave holes in
    the heap that would otherwise stay resident until activations happen to reuse them."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def keep_small_pages(tensor: Any) -> bool:
    """Keep the untouched CPU memory of `tensor` (contiguous storage, before it is written) in 4 KB pages, resident
    as it is written rather than 2 MB at a time; returns whether the kernel took the advice. Only the whole 4 KB pages
    inside the storage are advised."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return False
    storage = tensor.untyped_storage()
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    begin, end = (begin + PAGE - 1) // PAGE * PAGE, end // PAGE * PAGE
    return end > begin and madvise(begin, end - begin, mmap.MADV_NOHUGEPAGE) == 0

"""Large CPU tensors in 2 MB pages (Linux transparent huge pages).

A CPU decode step streams every weight of the model once (1.8 GB at 1.7B parameters) and, late in a long generation,
as many bytes of K/V. In 4 KB pages that is one TLB miss and one page walk per 4 KB, and the hardware prefetchers
stop at each page boundary: a batch-1 step of a 1.7B model took 2x longer than with the same weights in 2 MB pages
(benchmarks/RESULTS.md, "Huge pages").

PyTorch's CPU allocator asks the kernel for huge pages (madvise(MADV_HUGEPAGE) on each allocation of 2 MB or more)
when the environment variable THP_MEM_ALLOC_ENABLE is 1 as it makes its first allocation (not at `import torch`); it
reads the variable once. `import sglang` sets it unless it is set already, so it holds in every process that imports
sglang before it allocates a tensor (the server, its scheduler processes, `python -m sglang.*`, scripts that import
torch and then sglang) and in every process they start. THP_MEM_ALLOC_ENABLE=0
keeps 4 KB pages. Where the kernel's mode (/sys/kernel/mm/transparent_hugepage/enabled) is `never` nothing changes;
under `always` every large allocation gets huge pages anyway.

A buffer that fills up slowly (the K/V pool: sized for the whole memory budget, written a token at a time) is the
exception: in 2 MB pages the first token written to each layer's and head's stretch of the head-major pool would make
2 MB resident (3 GB of a 1.7B model's 5.6 GB pool after one request). `keep_small_pages` keeps such a buffer in 4 KB
pages, resident as it is written.

This module imports nothing heavy: it runs before torch is loaded.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any, Optional

ENV = "THP_MEM_ALLOC_ENABLE"
MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def request_huge_pages() -> None:
    """Ask PyTorch for huge pages in this process (if torch has not allocated yet) and the processes it starts,
    unless the environment says otherwise."""
    os.environ.setdefault(ENV, "1")


def kernel_mode(path: str = MODE_FILE) -> Optional[str]:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), or None where it has none."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def describe() -> str:
    """One line on the pages that large CPU tensors get in this process, for the startup log."""
    mode = kernel_mode()
    if mode is None:
        return "large CPU tensors in the system's default pages (no transparent huge pages on this system)"
    if mode == "never":
        return "large CPU tensors in 4 KB pages (transparent huge pages are off in the kernel: never)"
    if mode == "always":
        return "large CPU tensors in 2 MB pages (transparent huge pages: always)"
    if os.environ.get(ENV) == "1":
        return f"large CPU tensors in 2 MB pages (transparent huge pages: madvise, {ENV}=1)"
    return f"large CPU tensors in 4 KB pages ({ENV}={os.environ.get(ENV, '')!r}; 1 asks for 2 MB pages)"


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


MADV_NOHUGEPAGE = 15  # linux/mman.h
PAGE = 4096


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def keep_small_pages(tensor: Any) -> bool:
    """Keep the untouched CPU memory of `tensor` (contiguous storage, before it is written) in 4 KB pages, resident
    as it is written rather than 2 MB at a time; returns whether the kernel took the advice. Only the whole 4 KB pages
    inside the storage are advised."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    begin, end = (begin + PAGE - 1) // PAGE * PAGE, end // PAGE * PAGE
    return end > begin and madvise(begin, end - begin, MADV_NOHUGEPAGE) == 0

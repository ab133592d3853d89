"""Large activation buffers reused across layers and steps on CPU instead of being faulted in afresh.

A prefill batch's intermediates are large (at SmolLM2-1.7B's shape and 2,048 tokens the gate/up product alone is
134 MB of float32, with its int32 accumulator beside it) and are allocated and freed in every layer. glibc hands
blocks above its mmap threshold (at most 32 MB) back to the kernel when freed, so each new one takes a page fault
per 4 KB page the first time it is written, the kernel zeroing each page: 55 ms to allocate and fill 134 MB against 6
ms to fill a buffer already mapped (2-core AMD EPYC, Zen 4), and about a quarter of a 1.7B prefill's CPU time was the
kernel's. `reuse_large_buffers` installs an allocator (csrc/buffer_cache.h) that keeps freed blocks of at least
MIN_BYTES, up to a cap, and serves the next request of at least half a kept block's size from it: the pages stay
mapped and are written without faults. Smaller blocks stay with torch's allocator, from glibc's heap (its mmap
threshold is fixed at MIN_BYTES: it rises by itself only when glibc frees a block it mapped, which the kept blocks
never are, and every mid-sized block would be mapped and faulted in afresh). Measured (2-core AMD EPYC, Zen 4,
benchmarks/RESULTS.md 2026-11-29): a 2,048-token prefill of the 1.7B shape 178 -> 213 tok/s with 1.58M page faults
per prefill gone; SmolLM2-135M's 4,096-token prefill 1.5-1.6k -> 1.68k tok/s.

The cap is the resident memory it may keep between steps: CAP_BYTES (1 GiB, about one layer's intermediates of a
7B model's 2,048-token prefill batch with room to spare), SGLANG_CPU_BUFFER_CACHE_MB=N to change it, 0 to keep
none. The model runner installs it once the weights are loaded (weights and their load-time copies never pass
through it: installed before the load, it cut a 7B Q4_0 file's load from 82 to 57 s, most of that time the kernel's
page faults, but raised the 1.7B load's peak from 5.4 to 7.3 GB and left the glibc heap small enough that the
forwards' mid-sized blocks faulted again, ~99k faults a prefill). Where the CPU extension is not built nothing
changes.
"""

from __future__ import annotations

import os

from sglang.srt.layers import cpu_ops

ENV = "SGLANG_CPU_BUFFER_CACHE_MB"
CAP_BYTES = 1 << 30
MIN_BYTES = 8 << 20


def cap_bytes() -> int:
    """The bytes of freed buffers kept: CAP_BYTES, or SGLANG_CPU_BUFFER_CACHE_MB's MiB."""
    value = os.environ.get(ENV)
    if value is None or value.strip() == "":
        return CAP_BYTES
    try:
        mib = int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of MiB, not {value!r}") from None
    if mib < 0:
        raise ValueError(f"{ENV} must be >= 0, not {mib}")
    return mib << 20


def reuse_large_buffers() -> str:
    """Install the reusing allocator in this process with the configured cap; returns the startup log's line."""
    if not cpu_ops.available():
        return "freed large buffers go back to the system (the CPU extension is not built)"
    cap = cap_bytes()
    cpu_ops.configure_buffer_cache(cap, MIN_BYTES)
    if cap == 0:
        return f"freed large buffers go back to the system ({ENV}=0)"
    return (f"freed buffers of {MIN_BYTES >> 20} MiB or more kept for reuse, up to {cap / (1 << 30):.2f} GiB "
            f"({ENV})")

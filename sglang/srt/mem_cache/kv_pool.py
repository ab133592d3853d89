"""Per-layer K/V buffers addressed by KV slot index."""

from __future__ import annotations

import torch

from sglang.huge_pages import keep_small_pages
from sglang.srt.mem_cache.kv_dtype import to_kv_dtype


class KVPool:
    """K and V buffers for every layer: `[size + 1, kv_heads, head_dim]` each.

    Slot 0 is a reserved dummy slot (padded tokens may write there); the allocator hands out
    slots 1..size.

    On CPU the buffers are head-major: views `[size + 1, kv_heads, head_dim]` of `[kv_heads, size + 1, head_dim]`
    storage, so one KV head's rows of a sequence lie together. Decode attention reads one KV head at a time and is
    bound by memory late in a long generation; with slot-major storage each of its passes would fetch every slot's
    rows of all heads to use one head's share (benchmarks/RESULTS.md). Every reader and writer indexes the view
    (the compiled kernels take its strides, layers/csrc/kv_layout.h), so the layout is invisible above the pool.
    `head_major=False` keeps contiguous slot-major buffers (the default on other devices).
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
        head_major: bool | None = None,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.head_major = self.device.type == "cpu" if head_major is None else head_major
        # Uninitialised memory: a slot is always written before it is read, so zero-filling gigabytes at
        # startup would only cost time (and commit RAM the OS would otherwise hand out lazily). The dummy
        # slot is read by padded attention and must hold finite values.
        self.k_buffer = [self._buffer(size, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.v_buffer = [self._buffer(size, num_kv_heads, self.v_head_dim) for _ in range(num_layers)]

    def _buffer(self, size: int, heads: int, dim: int) -> torch.Tensor:
        if self.head_major:
            buf = torch.empty(heads, size + 1, dim, dtype=self.dtype, device=self.device).transpose(0, 1)
        else:
            buf = torch.empty(size + 1, heads, dim, dtype=self.dtype, device=self.device)
        keep_small_pages(buf)  # resident as tokens are written (sglang/huge_pages.py)
        buf[0].zero_()
        return buf

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v of shape [num_tokens, kv_heads, head_dim] at slots `loc`, converted to the pool's dtype."""
        self.k_buffer[layer_id][loc] = to_kv_dtype(k, self.dtype)
        self.v_buffer[layer_id][loc] = to_kv_dtype(v, self.dtype)

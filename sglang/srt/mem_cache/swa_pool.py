"""Hybrid sliding-window memory: the K/V of sliding-window layers in a second, smaller pool, as SGLang does.

A layer with a window of W only ever reads the last W positions of a sequence, so its K/V of older tokens can go.
Global layers keep the K/V of every token in the full pool; windowed layers keep theirs in a window pool with its
own slots. Every full slot handed out takes a window slot with it, and a translation table maps full slot ->
window slot (0, the window pool's dummy slot, once the window slot is given back). Request rows and the radix tree
keep speaking full slots; attention of a windowed layer translates them (layers/attention/torch_sdpa_backend.py).
A token's window slot goes back early when every request using it has moved past its window
(MemoryPools.release_out_of_window); its full slot stays until the request ends or the tree evicts it.

A freed entry reads the dummy slot rather than failing: it is always in range for the kernels, holds finite values
and is hidden by the window mask, since only tokens out of every reader's window lose their window slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.kv_pool import KVPool


class SWASlotAllocator(TokenSlotAllocator):
    """Full slots 1..size, each allocated with a window slot from a second free list of `window_size` slots."""

    def __init__(self, size: int, window_size: int, device: torch.device | str = "cpu") -> None:
        self.window = TokenSlotAllocator(window_size, device=device)
        # full slot -> window slot; entry 0 (the dummy full slot) maps to the dummy window slot
        self.full_to_window = torch.zeros(size + 1, dtype=torch.int64, device=torch.device(device))
        # Told the full slots that just gave their window slots back (the radix cache keeps counts of what its
        # tokens hold: swa_radix_cache.py).
        self.on_window_freed: Optional[Callable[[torch.Tensor], None]] = None
        super().__init__(size, device=device)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.window.available_size() or n > self.full_available_size():
            return None
        full = super().alloc(n)
        window = self.window.alloc(n)
        if full is None or window is None:  # unreachable after the checks above; keeps both lists intact
            raise RuntimeError(f"allocating {n} slots failed after the free counts allowed it")
        self.full_to_window[full] = window
        return full

    def free(self, slots: torch.Tensor) -> None:
        """Give back full slots and the window slots they still hold."""
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        self.free_window(slots)
        super().free(slots)

    def free_window(self, slots: torch.Tensor) -> None:
        """Give back the window slots of full slots `slots` (those that still hold one); the full slots stay."""
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        window = self.full_to_window[slots]
        held = window > 0
        self.window.free(window[held])
        self.full_to_window[slots] = 0
        if self.on_window_freed is not None:
            self.on_window_freed(slots[held])

    def has_window(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool per full slot: whether it still holds a window slot."""
        return self.full_to_window[slots] > 0

    def free_group_begin(self) -> None:
        super().free_group_begin()
        self.window.free_group_begin()

    def free_group_end(self) -> None:
        super().free_group_end()
        self.window.free_group_end()

    def full_available_size(self) -> int:
        return super().available_size()

    def window_available_size(self) -> int:
        return self.window.available_size()

    def available_size(self) -> int:
        """Tokens that can be allocated now: each takes one slot of each pool."""
        return min(self.full_available_size(), self.window.available_size())

    def clear(self) -> None:
        super().clear()
        self.window.clear()
        self.full_to_window.zero_()


class SWAKVPool(KVPool):
    """K/V buffers of every layer, those of the layers in `window_layers` with `window_size` slots (+ the dummy)
    instead of `size`. get_kv_buffer / set_kv_buffer address a layer's own buffers: a windowed layer's by window
    slots (translate full slots with `window_slots` first), a global layer's by full slots."""

    def __init__(self, size: int, window_size: int, window_layers: frozenset[int], num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, full_to_window: torch.Tensor,
                 device: torch.device | str = "cpu", head_major: Optional[bool] = None) -> None:
        # KVPool's own constructor would size every layer's buffers for the full pool
        self.size = size
        self.window_size = window_size
        self.window_layers = window_layers
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = self.v_head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.head_major = self.device.type == "cpu" if head_major is None else head_major
        self.full_to_window = full_to_window
        sizes = [window_size if i in window_layers else size for i in range(num_layers)]
        self.k_buffer = [self._buffer(n, num_kv_heads, head_dim) for n in sizes]
        self.v_buffer = [self._buffer(n, num_kv_heads, head_dim) for n in sizes]

    def is_windowed(self, layer_id: int) -> bool:
        return layer_id in self.window_layers

    def window_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The window slots of full slots (any shape); 0, the dummy slot, where none is held."""
        return self.full_to_window[full_slots]

    def window_token_bytes(self) -> int:
        """Bytes of one token's K/V in the window pool (all windowed layers)."""
        return self.bytes_per_token(len(self.window_layers), self.num_kv_heads, self.head_dim, self.dtype)

    def full_token_bytes(self) -> int:
        """Bytes of one token's K/V in the full pool (all global layers)."""
        return self.bytes_per_token(self.num_layers - len(self.window_layers), self.num_kv_heads, self.head_dim,
                                    self.dtype)

    def total_bytes(self) -> int:
        return self.full_token_bytes() * self.size + self.window_token_bytes() * self.window_size

"""Free list of KV slots of the KV pool."""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free list of KV slots 1..size (slot 0 is the pool's dummy slot and never handed out).

    The free list is a device tensor so that allocating a batch of slots is one slice, with no
    host/device round trip per token.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.free_slots = torch.empty(0, dtype=torch.int64, device=self.device)
        # Frees made between free_group_begin/free_group_end wait here, so evicting many tree
        # nodes costs one concatenation instead of one per node.
        self._pending_frees: list[torch.Tensor] | None = None
        self._pending_count = 0
        self.clear()

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots as an int64 tensor, or None if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > len(self.free_slots) and self._pending_count:
            self._merge_pending()
        if n > len(self.free_slots):
            return None
        slots = self.free_slots[:n]
        self.free_slots = self.free_slots[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if self._pending_frees is not None:
            self._pending_frees.append(slots)
            self._pending_count += slots.numel()
        else:
            self.free_slots = torch.cat((self.free_slots, slots))

    def free_group_begin(self) -> None:
        if self._pending_frees is None:
            self._pending_frees = []
            self._pending_count = 0

    def free_group_end(self) -> None:
        if self._pending_frees is None:
            return
        self._merge_pending()
        self._pending_frees = None

    def available_size(self) -> int:
        return len(self.free_slots) + self._pending_count

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        if self._pending_frees is not None:
            self._pending_frees = []
        self._pending_count = 0

    def _merge_pending(self) -> None:
        if self._pending_frees:
            self.free_slots = torch.cat([self.free_slots, *self._pending_frees])
            self._pending_frees.clear()
        self._pending_count = 0

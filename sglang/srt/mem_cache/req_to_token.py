"""Per-request token tables: row r, column p holds the KV slot of token p of the request in row r."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A fixed number of rows, each long enough for one request's whole context.

    Attention kernels read a request's KV slots straight out of its row, so the table lives on the
    compute device. Rows are handed out lowest-first, which keeps runs reproducible.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size and max_context_len must be positive, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # Zeros point every unused entry at the KV pool's dummy slot 0.
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=self.device)
        self._free_rows: list[int] = []
        self._is_free: list[bool] = []
        self.clear()

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise IndexError(f"row {row} out of range [0, {self.size})")
        if self._is_free[row]:
            raise ValueError(f"row {row} freed twice")
        self._is_free[row] = True
        self._free_rows.append(row)

    def available_size(self) -> int:
        return len(self._free_rows)

    def clear(self) -> None:
        # Stored in reverse so that pop() hands out row 0 first.
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size

"""This rank's part of an adapter under tensor parallelism (--tp-size N): every rank reads each adapter whole and
keeps what its shard of the model multiplies with.

- A column-parallel layer (q/k/v, gate/up) holds some output rows of each projection and the whole input: the rank
  keeps lora_A whole and the rows of lora_B that match its output rows; its delta is exact for those rows.
- A row-parallel layer (o_proj, down_proj) holds some input columns and sums the ranks' partial products with one
  all_reduce: the rank keeps lora_A's columns of its input slice and lora_B whole, and its partial delta
  B @ (A_slice @ x_slice) is added before that all_reduce, so the sum over the ranks is B @ (A @ x). Adding the
  delta once, after the all_reduce, would need the whole input on one rank: one more collective per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear


@dataclass(frozen=True)
class RankSlice:
    """Where this rank's part of one projection's adapter weights lies in the full ones."""

    full_in: int  # the projection's input features in the checkpoint
    full_out: int  # its output features in the checkpoint
    cols: Optional[tuple[int, int]] = None  # (first, count) of lora_A's input columns kept; None: all
    rows: Optional[tuple[int, int]] = None  # (first, count) of lora_B's output rows kept; None: all

    def take(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (lora_A, lora_B) of the full ones (A [rank, full_in], B [full_out, rank])."""
        if self.cols is not None:
            a = a.narrow(1, *self.cols).contiguous()
        if self.rows is not None:
            b = b.narrow(0, *self.rows).contiguous()
        return a, b


def rank_slice(linear: Linear, shard: Optional[str], rows: int) -> RankSlice:
    """The slice of `linear` (of its projection `shard` when fused) that this rank holds; `rows` is the number of
    output rows the projection has on this rank."""
    if isinstance(linear, ColumnParallelLinear) and shard is not None:
        full, start = linear.checkpoint_rows[shard]
        return RankSlice(linear.in_features, full, rows=(start, rows))
    if isinstance(linear, RowParallelLinear):
        return RankSlice(linear.full_in_features, linear.out_features, cols=(linear.col_start, linear.in_features))
    return RankSlice(linear.in_features, rows)

"""Per-request LoRA on the linear layers, grouped: every adapted layer adds the deltas of all the adapters of the
batch with two matmuls, whatever the number of adapters and how their rows interleave.

For the adapters of a forward, a layer stacks their low-rank parts: A_all [K, in] (every adapter's lora_A of every
projection the layer holds, one block of rows each) and B_all [K, out] (lora_B transposed and scaled, in the output
columns of its projection's slice, zero elsewhere). Then `h = x @ A_all^T` [rows, K]; a 0/1 mask keeps, in each
row, only the columns of that row's own adapter (none for the base model's rows); `out += h @ B_all`. The stack of
an adapter set is built once and reused by the following forwards with the same adapters (decode steps)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.lora.packed import PackedAdapter

# One LoRA part of a layer: (A [rank, in], B [rows, rank], scaling of B, first output row of its slice).
LoraPart = tuple[torch.Tensor, torch.Tensor, float, int]

# Stacks kept per layer: the adapter sets of the prefill and the decode batches alternate.
_MAX_STACKS = 2


class LoraBatchState:
    """The adapters of the forward that is running, shared by every LoRA layer of the model: `active` (the distinct
    adapter names, sorted) and `row_slot` (each row's index into `active`, -1 for the base model).
    Empty outside a forward with adapter rows. Also the weights of the adapters in memory in the fused CPU decode
    step's layout (`packed`, lora/packed.py), with a count of its changes (`generation`)."""

    def __init__(self) -> None:
        self.active: tuple[str, ...] = ()
        self.row_slot: Optional[torch.Tensor] = None
        self.uniform = False  # every row runs the one adapter of `active`: no mask needed
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self.packed: dict[str, PackedAdapter] = {}
        self.generation = 0

    def add_packed(self, name: str, packed: PackedAdapter) -> None:
        self.packed[name] = packed
        self.generation += 1

    def drop_packed(self, name: str) -> None:
        if self.packed.pop(name, None) is not None:
            self.generation += 1

    def set_rows(self, lora_names: list[Optional[str]], rows_per_seq: list[int]) -> None:
        # sorted: the same adapters give the same set, so the layers' stacks serve again whatever the row order
        slots = {name: i for i, name in enumerate(sorted({n for n in lora_names if n is not None}))}
        row_slot: list[int] = []
        for name, rows in zip(lora_names, rows_per_seq):
            row_slot.extend([-1 if name is None else slots[name]] * rows)
        self.active = tuple(slots)
        self.row_slot = torch.tensor(row_slot, dtype=torch.long) if slots else None
        self.uniform = len(slots) == 1 and -1 not in row_slot
        self._masks = {}

    def clear(self) -> None:
        self.active, self.row_slot, self.uniform, self._masks = (), None, False, {}

    def mask(self, col_slots: tuple[int, ...], col_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, K] 1 where the column belongs to the row's adapter; one per column layout and forward."""
        mask = self._masks.get(col_slots)
        if mask is None or mask.dtype != dtype:
            assert self.row_slot is not None
            row_slot = self.row_slot.to(col_slot.device)
            mask = (row_slot.unsqueeze(1) == col_slot.unsqueeze(0)).to(dtype)
            self._masks[col_slots] = mask
        return mask


@dataclass
class _Stack:
    a: torch.Tensor  # [K, in]
    b: torch.Tensor  # [K, out], scaled
    col_slot: torch.Tensor  # [K] the index into the adapter set of each column of h
    col_slots: tuple[int, ...]  # the same, hashable: the key of the mask


class LoraLinear:
    """Attached to a Linear as its `lora`: the adapters' parts for that layer, by adapter name. A fused layer
    (qkv_proj, gate_up_proj) has one part per projection it holds, each writing its slice of the output."""

    def __init__(self, state: LoraBatchState, out_features: int) -> None:
        self.state = state
        self.out_features = out_features
        self.parts: dict[str, list[LoraPart]] = {}
        self._stacks: dict[tuple[str, ...], Optional[_Stack]] = {}

    def set_parts(self, name: str, parts: list[LoraPart]) -> None:
        self.parts[name] = parts
        self._stacks.clear()

    def drop(self, name: str) -> None:
        if self.parts.pop(name, None) is not None:
            self._stacks.clear()

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        state = self.state
        if not state.active:
            return out
        stack = self._stack(state.active)
        if stack is None:
            return out
        h = x.to(stack.a.dtype) @ stack.a.t()
        if not state.uniform:
            h.mul_(state.mask(stack.col_slots, stack.col_slot, h.dtype))
        if out.dtype == h.dtype:
            out.addmm_(h, stack.b)
        else:
            out += (h @ stack.b).to(out.dtype)
        return out

    def _stack(self, active: tuple[str, ...]) -> Optional[_Stack]:
        if active in self._stacks:
            return self._stacks[active]
        a_blocks, b_blocks, col_slots = [], [], []
        for slot, name in enumerate(active):
            for a, b, scaling, row in self.parts.get(name, ()):
                rank = a.shape[0]
                b_block = a.new_zeros(rank, self.out_features)
                b_block[:, row : row + b.shape[0]] = b.t() * scaling
                a_blocks.append(a)
                b_blocks.append(b_block)
                col_slots.extend([slot] * rank)
        stack = None
        if a_blocks:
            slots = tuple(col_slots)
            stack = _Stack(torch.cat(a_blocks).contiguous(), torch.cat(b_blocks).contiguous(),
                           torch.tensor(slots, dtype=torch.long, device=a_blocks[0].device), slots)
        if len(self._stacks) >= _MAX_STACKS:
            self._stacks.pop(next(iter(self._stacks)))
        self._stacks[active] = stack
        return stack


@contextmanager
def lora_rows(state: Optional[LoraBatchState], lora_names: Optional[list[Optional[str]]],
              rows_per_seq: list[int]) -> Iterator[None]:
    """The adapters of one forward's rows, set for its duration (nothing to do for a batch without adapters)."""
    if state is None or lora_names is None:
        yield
        return
    state.set_rows(lora_names, rows_per_seq)
    try:
        yield
    finally:
        state.clear()


def carry_lora(old_model: torch.nn.Module, new_model: torch.nn.Module) -> None:
    """Move the LoRA of every layer of `old_model` to the same-named layer of `new_model` (a weight update builds
    a new model of the same architecture): the loaded adapters keep serving, now beside the new base weights."""
    for name, module in old_model.named_modules():
        lora = getattr(module, "lora", None)
        if isinstance(lora, LoraLinear):
            target: Any = new_model.get_submodule(name)
            target.lora = lora

"""Linear layers and the methods that multiply with them.

A `LinearMethod` is how a layer's matmul is computed: the dense float GEMM by default, the GGUF quantized blocks
(layers/quantization/gguf_linear.py) for small batches, and later bf16 / int8 / tensor-parallel shards. The model
builds `Linear` layers; the loader picks each layer's method once, at load time, with `set_linear_method`.
The LM head takes a method the same way (layers/logits_processor.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import TPGroup, get_tp_group
from sglang.srt.distributed.partition import check_partition_fits, partition


class LinearMethod(ABC):
    """Computes `x @ weight.T + bias` for one layer, from the layer's float weight or its own copy of it."""

    @abstractmethod
    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The product in the weight's dtype; x may be in the weight's dtype or, for a float32 model, bf16 (the
        output of another layer's `apply_native`)."""

    def apply_native(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """As `apply`, but the output may stay in the dtype the method computes in (bf16 for the bf16 GEMM of a
        float32 model), for a caller whose next step reads that dtype."""
        return self.apply(weight, x, bias)

    def input_dtype(self, rows: int) -> Optional[torch.dtype]:
        """The dtype this method converts an input of `rows` rows to before multiplying (None: the weight's), so
        the layer before can write it in that dtype directly."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    @property
    def weight_format(self) -> str:
        """What the weight copy this method holds is, for the weights report (model_loader/weight_report.py)."""
        return self.describe()


class DenseLinearMethod(LinearMethod):
    """The framework GEMM on the float weight (MKL / oneDNN on CPU, cuBLAS on CUDA)."""

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x.to(weight.dtype), weight, bias)

    def describe(self) -> str:
        return "dense"


DENSE = DenseLinearMethod()


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is delegated to a LinearMethod (dense unless the loader chose another)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device | str] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.linear_method: LinearMethod = DENSE
        # LoRA adapters of this layer (lora/layers.py LoraLinear), attached only when the server serves LoRA.
        self.lora: Optional[Any] = None

    def set_linear_method(self, method: LinearMethod) -> None:
        self.linear_method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self.weight, x, self.bias)
        return out if self.lora is None else self.lora.apply(x, out)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The output in the method's own compute dtype (LinearMethod.apply_native)."""
        out = self.linear_method.apply_native(self.weight, x, self.bias)
        return out if self.lora is None else self.lora.apply(x, out)

    def input_dtype(self, rows: int) -> Optional[torch.dtype]:
        """The dtype the method multiplies an input of `rows` rows in (LinearMethod.input_dtype)."""
        return self.linear_method.input_dtype(rows)


def linear_methods(model: nn.Module) -> list[LinearMethod]:
    """The method of every linear layer of `model` and of its LM head (`model.logits_processor.head_method`)."""
    methods: list[LinearMethod] = [m.linear_method for m in model.modules() if isinstance(m, Linear)]
    processor = getattr(model, "logits_processor", None)
    if processor is not None:
        methods.append(processor.head_method)
    return methods


class MergedLinear(Linear):
    """Several projections of the same input in one matmul; the output rows are the shards, in order."""

    def __init__(
        self,
        in_features: int,
        shards: list[tuple[str, int]],
        bias: bool,
        dtype: Optional[torch.dtype],
        device: Optional[torch.device | str],
    ) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias, dtype, device)
        # checkpoint module name (e.g. "k_proj") -> (first output row, number of rows)
        self.shard_rows: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_name, size in shards:
            self.shard_rows[shard_name] = (offset, size)
            offset += size

    def load_shard(self, param_name: str, shard_name: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        start, size = self.shard_rows[shard_name]
        target = getattr(self, param_name).data.narrow(0, start, size)
        copy_checked(target, tensor, checkpoint_name)


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, checkpoint_name: str) -> None:
    """Copy a checkpoint tensor into a parameter, refusing a shape mismatch with a message naming both."""
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"Checkpoint weight {checkpoint_name} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)


def hold_as(owner: nn.Module, name: str, dtype: torch.dtype, device: Optional[torch.device | str] = None) -> None:
    """Replace the parameter `owner.<name>` with an empty one of the same shape in `dtype` on `device` (None: the
    old one's): before a checkpoint is read, to store it in another dtype; once its values live elsewhere, "meta"
    releases it, keeping the shape and dtype that code reads."""
    old: torch.Tensor = getattr(owner, name)
    empty = torch.empty(old.shape, dtype=dtype, device=old.device if device is None else device)
    setattr(owner, name, nn.Parameter(empty, requires_grad=False))


def held_parameter(model: nn.Module) -> torch.Tensor:
    """The first parameter of `model` with storage, whose device and dtype are the model's: parameters released by
    hold_as(..., "meta") (their values served from blocks) come first in a model read from blocks, e.g. the input
    embeddings."""
    params = list(model.parameters())
    return next((p for p in params if not p.is_meta), params[0])


# ---- tensor parallelism ---------------------------------------------------------------------------------------
# With --tp-size N each scheduler rank holds 1/N of every projection: column-parallel layers (q/k/v, gate/up)
# keep a slice of the output rows of each shard and need no communication; row-parallel layers (o_proj,
# down_proj) keep a slice of the input columns and sum their partial outputs over the ranks. The checkpoint is
# sliced while it is read, so no rank ever holds a full weight. Slices are as even as possible
# (distributed/partition.py): sizes that do not divide by the number of ranks differ by one item between ranks.


def divide(total: int, tp_size: int, what: str) -> int:
    """`total / tp_size`, refusing a size that does not divide it with a message naming both."""
    if total % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's {what} ({total}); "
                         f"choose a tensor-parallel size that divides it")
    return total // tp_size


class ColumnParallelLinear(MergedLinear):
    """A MergedLinear holding a slice of the output rows of each of its shards: by default rank r's
    `partition(rows, tp, r)`, or the (first row, rows) given per shard (the attention heads of a rank)."""

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str], tp: TPGroup,
                 slices: Optional[list[tuple[int, int]]] = None) -> None:
        if slices is None:
            for name, size in shards:
                check_partition_fits(size, tp.size, f"{name} output size")
            slices = [partition(size, tp.size, tp.rank) for _, size in shards]
        super().__init__(in_features, [(name, size) for (name, _), (_, size) in zip(shards, slices)], bias, dtype,
                         device)
        self.tp = tp
        # checkpoint shard name -> (its full number of rows, this rank's first row in it)
        self.checkpoint_rows = {name: (full, start) for (name, full), (start, _) in zip(shards, slices)}

    def load_shard(self, param_name: str, shard_name: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        size = self.shard_rows[shard_name][1]
        full, start = self.checkpoint_rows[shard_name]
        check_full_rows(tensor, full, checkpoint_name)
        super().load_shard(param_name, shard_name, tensor.narrow(0, start, size), checkpoint_name)


class RowParallelLinear(Linear):
    """A Linear holding a slice of the input columns (rank r's `partition(n, tp, r)` unless `cols` gives its
    (first column, columns)); the partial products are summed over the ranks with one all_reduce (the bias is
    added once, by rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str], tp: TPGroup, cols: Optional[tuple[int, int]] = None) -> None:
        if cols is None:
            check_partition_fits(in_features, tp.size, "projection input size")
            cols = partition(in_features, tp.size, tp.rank)
        super().__init__(cols[1], out_features, bias, dtype, device)
        self.tp = tp
        self.full_in_features, self.col_start = in_features, cols[0]

    def checkpoint_slicers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Parameter leaf -> this rank's part of the checkpoint tensor (the bias is whole on every rank)."""
        cols = self.in_features

        def weight(t: torch.Tensor) -> torch.Tensor:
            if t.dim() != 2 or t.shape[1] != self.full_in_features:
                return t  # the copy reports the shape mismatch
            return t.narrow(1, self.col_start, cols)

        return {"weight": weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        out = self.linear_method.apply(self.weight, x, bias)
        if self.lora is not None:  # this rank's partial LoRA delta joins the sum (lora/tp_slice.py)
            out = self.lora.apply(x, out)
        return self.tp.all_reduce(out)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The partial products are summed in the model's dtype, whatever the method computes in."""
        return self.forward(x)


def check_full_rows(tensor: torch.Tensor, rows: int, checkpoint_name: str) -> None:
    if tensor.shape[0] != rows:
        raise ValueError(f"Checkpoint weight {checkpoint_name} has shape {tuple(tensor.shape)}, "
                         f"the model expects {rows} rows")


def merged_linear(in_features: int, shards: list[tuple[str, int]], bias: bool, dtype: Optional[torch.dtype],
                  device: Optional[torch.device | str],
                  slices: Optional[list[tuple[int, int]]] = None) -> MergedLinear:
    """A MergedLinear, column-parallel over the current tensor-parallel group when it has several ranks
    (`slices`: this rank's (first row, rows) of each shard, when not the even partition)."""
    tp = get_tp_group()
    if tp.size == 1:
        return MergedLinear(in_features, shards, bias, dtype, device)
    return ColumnParallelLinear(in_features, shards, bias, dtype, device, tp, slices)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, dtype: Optional[torch.dtype],
                        device: Optional[torch.device | str], cols: Optional[tuple[int, int]] = None) -> Linear:
    """A Linear, row-parallel over the current tensor-parallel group when it has several ranks
    (`cols`: this rank's (first column, columns) of the input, when not the even partition)."""
    tp = get_tp_group()
    if tp.size == 1:
        return Linear(in_features, out_features, bias, dtype=dtype, device=device)
    return RowParallelLinear(in_features, out_features, bias, dtype, device, tp, cols)

"""The expert computation of a mixture-of-experts layer, batched per expert.

Expert weights are stacked: `gate_up_proj` [E, 2*I, H] (the gate rows, then the up rows, of every expert) and
`down_proj` [E, H, I]. A forward groups the (token, expert) pairs chosen by the router by expert with one stable
sort of the flattened top-k ids and one bincount, then runs two matmuls (gate/up and down) per expert that at
least one token chose, scales the rows by their routing weights and adds all of them into the output with one
index_add_. Experts nobody chose cost nothing; the only Python loop is over experts, never over tokens.

Experts are visited in increasing index order, the order transformers adds them in, so in bfloat16 the output is
rounded the same way as the reference.

Under tensor parallelism each rank holds every expert's slice of the intermediate size (its gate and up rows, the
matching down columns), as the dense MLP is split, and the ranks' partial outputs are summed with one all_reduce.

Where blocks serve every batch, a layer's experts are computed from their GGUF blocks instead and the stacked float
parameters are released (`FusedMoE.serve_from_blocks`, layers/moe/expert_blocks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.distributed.partition import check_partition_fits, partition
from sglang.srt.layers.linear import LinearMethod, copy_checked, hold_as
from sglang.srt.layers.moe.expert_blocks import ExpertBlocks
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.model_loader.dtype import dtype_name

# The per-expert checkpoint module names of the gate, up and down projections.
HF_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def dispatch_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden_states[t]) for every token t: the rows of each
    chosen expert gathered, `expert(e, rows)` called once per expert with rows, the weighted outputs added back.

    hidden_states [T, H]; topk_weights / topk_ids [T, top_k]. Returns [T, H] in the dtype of hidden_states.
    """
    top_k = topk_ids.shape[1]
    output = torch.zeros_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return output
    flat_ids = topk_ids.reshape(-1)
    # Stable, so within an expert the rows keep token order (experts in increasing index order, as transformers
    # adds them).
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    weight_of_row = topk_weights.reshape(-1)[order]
    # One host sync per layer: the row count of each expert.
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    # The weighted output of every (token, expert) row, grouped by expert in increasing index order.
    rows = torch.empty(flat_ids.shape[0], hidden_states.shape[1], dtype=hidden_states.dtype,
                       device=hidden_states.device)
    start = 0
    for index, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        rows[start:end] = expert(index, hidden_states[token_of_row[start:end]]) * weight_of_row[start:end, None]
        start = end
    # One accumulation for the whole layer. On CPU index_add_ visits the rows in order, so each token sums its
    # experts in increasing index order, rounding after each addition as the per-expert reference does; and every
    # index_add_ call opens an OpenMP parallel region, which costs far more than the addition for a few rows.
    output.index_add_(0, token_of_row, rows)
    return output


def fused_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]) for every token t (SwiGLU experts).

    hidden_states [T, H]; gate_up_proj [E, 2*I, H]; down_proj [E, H, I]; topk_weights / topk_ids [T, top_k].
    Returns [T, H] in the dtype of hidden_states.
    """
    intermediate = down_proj.shape[2]

    def swiglu_expert(index: int, tokens: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(tokens, gate_up_proj[index])
        return F.linear(F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:], down_proj[index])

    return dispatch_experts(hidden_states, topk_weights, topk_ids, gate_up_proj.shape[0], swiglu_expert)


PieceLoader = Callable[[torch.Tensor, str], None]


class FusedMoE(nn.Module):
    """The stacked SwiGLU experts of one layer. Parameter names follow transformers' fused layout
    (`experts.gate_up_proj`, `experts.down_proj`); `checkpoint_pieces` maps the per-expert hub names onto them."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
        expert_names: tuple[str, str, str] = HF_EXPERT_NAMES,
        checkpoint_block: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        check_partition_fits(intermediate_size, self.tp.size, "expert intermediate size")
        # This rank's rows of each expert's gate and up projections (and columns of its down projection).
        self.full_intermediate_size = intermediate_size
        self.intermediate_start, intermediate_size = partition(intermediate_size, self.tp.size, self.tp.rank)
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.expert_names = expert_names
        # What per-expert checkpoints call the MoE block when it is not this module's parent name
        # (Mixtral: `block_sparse_moe`, where the fused layout and this model say `mlp`).
        self.checkpoint_block = checkpoint_block
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        # Set when the experts' blocks alone serve them (serve_from_blocks).
        self.expert_blocks: Optional[ExpertBlocks] = None

    def forward(self, hidden_states: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        if self.expert_blocks is not None:
            out = dispatch_experts(hidden_states, topk.weights, topk.ids, self.num_experts, self.expert_blocks.expert)
        else:
            out = fused_experts(hidden_states, self.gate_up_proj, self.down_proj, topk.weights, topk.ids)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def serve_from_blocks(self, blocks: ExpertBlocks, release_dtype: torch.dtype) -> None:
        """Compute the experts from `blocks` from now on and release the stacked float parameters: meta tensors of
        `release_dtype` (the model's) keep the shapes a weight update compares, and any arithmetic on them fails
        loudly instead of reading stale values."""
        if blocks.num_experts != self.num_experts or blocks.intermediate_size != self.intermediate_size:
            raise ValueError(f"blocks of {blocks.num_experts} experts of intermediate size {blocks.intermediate_size} "
                             f"for a layer of {self.num_experts} x {self.intermediate_size}")
        self.expert_blocks = blocks
        self.hold_stacked(release_dtype, "meta")

    def stacked_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj, self.down_proj

    def hold_stacked(self, dtype: Optional[torch.dtype] = None, device: Optional[str] = None) -> None:
        """Replace both stacked parameters with empty ones in `dtype` (None: theirs) on `device` (None: theirs):
        "meta" releases them (loading skips meta parameters; their shapes stay for a weight update to compare)."""
        for name in ("gate_up_proj", "down_proj"):
            hold_as(self, name, dtype or getattr(self, name).dtype, device)

    def served_values(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The values the experts compute with for a released stacked parameter (`gate_up_proj` or `down_proj`,
        [E, ...] float32, dequantized from the blocks); None for any other parameter or while the experts are
        dense."""
        blocks = self.expert_blocks
        if blocks is None or (param is not self.gate_up_proj and param is not self.down_proj):
            return None
        methods = blocks.gate_up if param is self.gate_up_proj else blocks.down
        return torch.stack([m.quant_weight.dequantize() for m in methods])

    def describe(self) -> str:
        """How the experts compute, for the decode-path log line."""
        if self.expert_blocks is not None:
            return self.expert_blocks.describe()
        return f"dense {dtype_name(self.gate_up_proj.dtype)}"

    def _rows(self, t: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """This rank's slice of the intermediate axis `dim` of a whole checkpoint tensor."""
        if t.dim() <= dim or t.shape[dim] != self.full_intermediate_size:
            raise ValueError(f"Checkpoint weight {name} has shape {tuple(t.shape)}, the model expects "
                             f"{self.full_intermediate_size} along dimension {dim}")
        return t.narrow(dim, self.intermediate_start, self.intermediate_size)

    def checkpoint_slicers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The fused layout's stacked tensors ([E, 2*I, H] gate then up rows, [E, H, I]) cut to this rank's slice."""
        if self.tp.size == 1:
            return {}
        full = self.full_intermediate_size

        def gate_up(t: torch.Tensor) -> torch.Tensor:
            if t.dim() != 3 or t.shape[1] != 2 * full:
                return t  # the copy reports the shape mismatch
            return torch.cat([self._rows(t[:, :full], 1, "gate_up_proj"), self._rows(t[:, full:], 1, "gate_up_proj")],
                             dim=1)

        def down(t: torch.Tensor) -> torch.Tensor:
            return self._rows(t, 2, "down_proj") if t.dim() == 3 and t.shape[2] == full else t

        return {"gate_up_proj": gate_up, "down_proj": down}

    def checkpoint_expert_modules(self, prefix: str) -> list[tuple[str, str, str]]:
        """Per expert, the names of its gate, up and down projections in a per-expert checkpoint
        (`{prefix}.{e}.gate_proj`, ...; Mixtral's `block_sparse_moe.experts.{e}.w1`, ...)."""
        hub_prefix = prefix
        if self.checkpoint_block is not None:  # model.layers.N.mlp.experts -> model.layers.N.<block>.experts
            hub_prefix = f"{prefix.rsplit('.', 2)[0]}.{self.checkpoint_block}.experts"
        gate, up, down = self.expert_names
        return [(f"{hub_prefix}.{e}.{gate}", f"{hub_prefix}.{e}.{up}", f"{hub_prefix}.{e}.{down}")
                for e in range(self.num_experts)]

    def checkpoint_pieces(self, prefix: str) -> dict[str, tuple[str, PieceLoader]]:
        """Per-expert checkpoint name (`{prefix}.{e}.gate_proj.weight`, ...) -> (stacked parameter, loader)."""
        size = self.intermediate_size
        pieces: dict[str, tuple[str, PieceLoader]] = {}
        for e, modules in enumerate(self.checkpoint_expert_modules(prefix)):
            for name, param, row in zip(modules, ("gate_up_proj", "gate_up_proj", "down_proj"), (0, size, None)):
                pieces[f"{name}.weight"] = (f"{prefix}.{param}", partial(self._load_piece, param, e, row))
        return pieces

    def _load_piece(self, param: str, expert: int, row: Optional[int], tensor: torch.Tensor, name: str) -> None:
        target = getattr(self, param).data[expert]
        if row is not None:
            target = target.narrow(0, row, self.intermediate_size)
        if self.tp.size > 1 and tensor.dim() == 2:  # gate / up: rows; down: columns
            tensor = self._rows(tensor, 0 if row is not None else 1, name)
        copy_checked(target, tensor, name)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}"


def expert_linear_methods(model: nn.Module) -> list[LinearMethod]:
    """The linear methods of every expert served from blocks in `model` (none where the experts are dense)."""
    return [method for module in model.modules() if isinstance(module, FusedMoE) and module.expert_blocks is not None
            for method in module.expert_blocks.methods()]

"""An adapter's weights in the layout the fused CPU decode step reads (layers/csrc/lora_deltas.h), built once when
the adapter comes into memory. The layer-by-layer path's parts (lora/layers.py) are views of the same tensors, so
an adapter's weights are held once.

Per layer, the four linears of the step, each with the PEFT modules it holds in the order of its output rows:
  a  [shards * rank, in]: shard s's lora_A in rows [s * rank, (s + 1) * rank), zero for a module the adapter lacks
  b  [rank, out]: each module's lora_B times the adapter's scaling, transposed, in that module's output columns,
     zero elsewhere
  mask: bit s set where the adapter has shard s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# The fused step's linears of a decoder layer and the modules each holds, in the order of their output rows.
SITE_SHARDS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# module -> (its linear's index in SITE_SHARDS, its shard index there)
SITE_OF = {module: (kind, shard) for kind, modules in enumerate(SITE_SHARDS) for shard, module in enumerate(modules)}


@dataclass
class PackedAdapter:
    rank: int
    # len(SITE_SHARDS) entries per layer, None where the adapter leaves the linear alone
    a: list[Optional[torch.Tensor]]
    b: list[Optional[torch.Tensor]]
    masks: list[int]


# One module's part for the layer-by-layer path, keyed by (layer, module): (A [rank, in], scaled B [rows, rank]).
PackedParts = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def pack_adapter(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], rank: int, scaling: float,
                 num_layers: int, out_rows: dict[tuple[int, str], tuple[int, int, int]],
                 device: torch.device) -> tuple[PackedAdapter, PackedParts]:
    """`weights`: (layer, module) -> (A, B) as read from the adapter; `out_rows`: (layer, module) -> (the output
    features of the linear holding it, its first output row there, its rows)."""
    n = num_layers * len(SITE_SHARDS)
    packed = PackedAdapter(rank, [None] * n, [None] * n, [0] * n)
    parts: PackedParts = {}
    for (layer, module), (a, b) in weights.items():
        kind, shard = SITE_OF[module]
        index = layer * len(SITE_SHARDS) + kind
        out_features, row, rows = out_rows[(layer, module)]
        if packed.a[index] is None:
            packed.a[index] = a.new_zeros(len(SITE_SHARDS[kind]) * rank, a.shape[1], device=device)
            packed.b[index] = b.new_zeros(rank, out_features, device=device)
        a_site, b_site = packed.a[index], packed.b[index]
        assert a_site is not None and b_site is not None
        a_part = a_site[shard * rank : (shard + 1) * rank]
        b_part = b_site[:, row : row + rows].t()  # [rows, rank], as the adapter's lora_B
        a_part.copy_(a)
        b_part.copy_(b * scaling)
        packed.masks[index] |= 1 << shard
        parts[(layer, module)] = (a_part, b_part)
    return packed, parts

"""The experts of a mixture-of-experts layer served from GGUF blocks alone: one copy of the weights.

Where the arithmetic plan serves every batch from blocks (`--large-batch-weights blocks`), each expert's gate/up
projection [2*I, H] and down projection [H, I] become Q8_0 blocks made at load (model_loader/moe_blocks.py) and the
layer's stacked float parameters are released. `fused_moe.dispatch_experts` still groups the rows of each chosen
expert; each projection of an expert then runs a `GGUFLinearMethod` over its own blocks: the block kernels for at
most `max_rows` rows (a decode step routes a few rows to each chosen expert), the plan's large-batch method beyond
(the float32 / bf16 GEMM over the same blocks, converted a slab at a time, or an int8 copy beside them), which a
prefill chunk that routes many rows to one expert takes.

The SwiGLU between the two projections and the routing-weighted sum stay in the model dtype (float32), as the
stacked float experts compute them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sglang.srt.layers.linear import LinearMethod
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod


class ExpertBlocks:
    """Per expert, the linear methods of its fused gate/up projection and of its down projection."""

    def __init__(self, gate_up: Sequence[GGUFLinearMethod], down: Sequence[GGUFLinearMethod],
                 dtype: torch.dtype = torch.float32) -> None:
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"every expert needs a gate/up and a down projection, got {len(gate_up)} and {len(down)}")
        self.gate_up = list(gate_up)
        self.down = list(down)
        self.intermediate_size = self.down[0].quant_weight.k
        for index, (gu, dn) in enumerate(zip(self.gate_up, self.down)):
            if gu.quant_weight.n != 2 * self.intermediate_size or dn.quant_weight.k != self.intermediate_size:
                raise ValueError(f"expert {index}: gate/up {gu.quant_weight.shape} and down {dn.quant_weight.shape} "
                                 f"do not share the intermediate size {self.intermediate_size}")
        # The `weight` argument of LinearMethod.apply: these methods multiply their own blocks and read only the
        # dtype the input is given in.
        self._weight = torch.empty(0, dtype=dtype)

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def expert(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert `index` on its rows `tokens` [rows, H] -> [rows, H] (the `expert` of dispatch_experts)."""
        gate_up = self.gate_up[index].apply(self._weight, tokens, None)
        size = self.intermediate_size
        return self.down[index].apply(self._weight, F.silu(gate_up[:, :size]) * gate_up[:, size:], None)

    def methods(self) -> list[LinearMethod]:
        """Every projection's method (for the weights report)."""
        return [*self.gate_up, *self.down]

    @property
    def nbytes(self) -> int:
        return sum(m.quant_weight.nbytes for m in self.gate_up + self.down)

    def describe(self) -> str:
        return self.gate_up[0].describe()

"""An input embedding table held as GGUF Q4_1 / Q8_0 blocks: the lookups read rows of the blocks.

A model read from a GGUF file whose blocks serve every batch keeps no float weights for its linear layers
(model_loader/gguf_quant.py), but its embedding table stayed a float32 copy of the file's values beside them: the LM
head's blocks of the same table where the two are tied (0.40 GB at SmolLM2-1.7B's shape), or the file's own blocks
of `token_embd` where they are not. Here the table is those blocks alone. A row is dequantized per lookup as the
blocks' values d * q (+ m), exact in float32 up to Q4_1's one rounding of the sum, so every lookup returns the
float table's row bit for bit (`GGUFQuantWeight.rows`; the fused CPU decode step gathers the same rows itself:
DecodeStack.set_token_blocks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight


class BlockEmbedding(nn.Module):
    """nn.Embedding's lookup over a table [vocab, hidden] held as blocks. `weight` is a meta placeholder of the
    table's shape and dtype (float32), so the model's parameter names and shapes stay those of its checkpoint; the
    values are `quant_weight`'s."""

    def __init__(self, quant_weight: GGUFQuantWeight) -> None:
        super().__init__()
        self.quant_weight = quant_weight
        self.num_embeddings, self.embedding_dim = quant_weight.n, quant_weight.k
        self.weight = nn.Parameter(torch.empty(quant_weight.n, quant_weight.k, device="meta"), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.quant_weight.rows(input_ids.reshape(-1).to(torch.int64))
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.quant_weight.qtype} blocks"


def serve_embeddings_from(model: Any, quant_weight: GGUFQuantWeight) -> None:
    """Replace the input embeddings of `model` (a Llama-family backbone's nn.Embedding, float32, with the values of
    `quant_weight`: the caller checks) by a BlockEmbedding over `quant_weight`. An LM head that is the same table
    becomes the same module, so the two stay one (its logits come from the logits processor's blocks method)."""
    backbone = model.model
    embed = backbone.embed_tokens
    replacement = BlockEmbedding(quant_weight)
    if getattr(model, "lm_head", None) is embed:
        model.lm_head = replacement
    backbone.embed_tokens = replacement

"""An input embedding table held as GGUF Q4_1 / Q8_0 blocks, or as a file's K-quant rows: the lookups read rows of
the blocks.

A model read from a GGUF file whose blocks serve every batch keeps no float weights for its linear layers
(model_loader/gguf_quant.py), but its embedding table stayed a float32 copy of the file's values beside them: the LM
head's blocks of the same table where the two are tied (0.40 GB at SmolLM2-1.7B's shape), or the file's own blocks
of `token_embd` where they are not. Here the table is those blocks alone. A row is dequantized per lookup as the
blocks' values d * q (+ m), exact in float32 up to Q4_1's one rounding of the sum, so every lookup returns the
float table's row bit for bit (`GGUFQuantWeight.rows`; the fused CPU decode step gathers the same rows itself:
DecodeStack.set_token_blocks).

A K-quant `token_embd` (Q2_K-Q6_K, as llama.cpp's K-quant files store it) would round to other values as Q4_1 / Q8_0
blocks, so it is kept as the file stores it (`KQuantTable`), each looked-up row dequantized by the reference
formula (csrc/gguf_kquant_rows.h): at SmolLM2-1.7B's shape a Q6_K table is 83 MB instead of 403 MB of float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.layers.quantization.gguf_blocks import KQUANT_TYPES, GGUFQuantWeight, kernel_module


class KQuantTable:
    """A table [n, k] (k a multiple of 256) as a GGUF file stores it in a K-quant type: `packed` holds the stored
    rows, uint8 [n, k / 256 * super-block bytes]; `rows` dequantizes only the rows asked for."""

    def __init__(self, qtype: str, packed: torch.Tensor, n: int, k: int) -> None:
        assert qtype in KQUANT_TYPES and k % 256 == 0 and packed.shape[0] == n and packed.dtype == torch.uint8
        self.qtype, self.packed, self.n, self.k = qtype, packed.contiguous(), n, k

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 [len(ids), k]: rows `ids` (int64) of the table, each as the reference dequantization gives it."""
        ext = kernel_module()
        if ext is not None:
            return ext.gather_kquant_rows(self.packed, KQUANT_TYPES[self.qtype], self.k, ids.contiguous())
        import gguf

        picked = self.packed.index_select(0, ids).numpy()
        return torch.from_numpy(gguf.quants.dequantize(picked, gguf.GGMLQuantizationType[self.qtype]))

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.n))


class BlockEmbedding(nn.Module):
    """nn.Embedding's lookup over a table [vocab, hidden] held as blocks. `weight` is a meta placeholder of the
    table's shape and dtype (float32), so the model's parameter names and shapes stay those of its checkpoint; the
    values are `quant_weight`'s."""

    def __init__(self, quant_weight: GGUFQuantWeight | KQuantTable) -> None:
        super().__init__()
        self.quant_weight = quant_weight
        self.num_embeddings, self.embedding_dim = quant_weight.n, quant_weight.k
        self.weight = nn.Parameter(torch.empty(quant_weight.n, quant_weight.k, device="meta"), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.quant_weight.rows(input_ids.reshape(-1).to(torch.int64))
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.quant_weight.qtype} blocks"


def serve_embeddings_from(model: Any, quant_weight: GGUFQuantWeight | KQuantTable) -> None:
    """Replace the input embeddings of `model` (a Llama-family backbone's nn.Embedding, float32, with the values of
    `quant_weight`: the caller checks) by a BlockEmbedding over `quant_weight`. An LM head that is the same table
    becomes the same module, so the two stay one (its logits come from the logits processor's blocks method)."""
    backbone = model.model
    embed = backbone.embed_tokens
    replacement = BlockEmbedding(quant_weight)
    if getattr(model, "lm_head", None) is embed:
        model.lm_head = replacement
    backbone.embed_tokens = replacement

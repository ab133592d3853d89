"""A GGUF file's embedding table and LM head read from the file's blocks alone, never loaded as floats.

Where the file's blocks serve every batch, the decoder's linear weights are released before the checkpoint is read
(model_loader/gguf_quant.linears_read_from_file). The vocabulary-sized tables were still read as float32 first:
the input embeddings (then served from blocks of the same values, layers/quantization/block_embedding.py) and an
untied LM head (then served from its blocks): 0.4 GB at SmolLM2-1.7B's shape, 1.6 GB at a 7B Llama's, all of it
in the load's resident peak. They are released with the linears where the file can serve them:
- the input embeddings, where `token_embd` is Q4_0 / Q4_1 / Q8_0 (blocks that hold the file's values exactly) or a
  K-quant (kept as the file stores it, its rows dequantized per lookup) of the table's shape, the table a plain
  float32 `nn.Embedding`; a table tied to the LM head only where the file has no `output` tensor (the head reads
  `output` first; a K-quant table's head then computes with Q8_0 blocks converted from it);
- an untied LM head, where `output` is a block type the kernels serve (as stored or converted, as the linears).
`attach_gguf_quant_weights` then gives them the file's blocks; one it cannot serve is a startup error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.linear import hold_as
from sglang.srt.layers.quantization.gguf_blocks import KQUANT_TYPES, PACKED_FROM
from sglang.srt.model_loader.gguf_reader import GGML_BLOCK_TYPES, gguf_tensor_table


def tables_read_from_file(model: nn.Module, gguf_path: str
                          ) -> tuple[Optional[Callable[[nn.Module], None]], list[str]]:
    """For a model built on the meta device whose decoder linears are read from the file's blocks alone: a function
    to run once the model has storage, before the checkpoint is read, that releases its embedding table and untied
    LM head where the file's blocks serve them (above), and the names of what it releases (for the startup log);
    (None, []) where neither is."""
    backbone: Any = getattr(model, "model", None)
    embed = getattr(backbone, "embed_tokens", None)
    if type(embed) is not nn.Embedding or embed.weight.dtype != torch.float32:
        return None, []
    head = getattr(model, "lm_head", None)
    tied = head is embed
    _, table = gguf_tensor_table(gguf_path)
    listed = {name: (dims, GGML_BLOCK_TYPES.get(ttype, ("",))[0]) for name, dims, ttype, _ in table}
    shape = list(reversed(embed.weight.shape))  # GGUF lists dims innermost first

    def served(name: str, types: Any) -> bool:
        dims, qtype = listed.get(name, (None, None))
        return dims == shape and qtype in types

    embeddings = (served("token_embd.weight", {*PACKED_FROM, *KQUANT_TYPES})
                  and not (tied and "output.weight" in listed))
    untied_head = (not tied and head is not None and hasattr(model, "logits_processor")
                   and tuple(getattr(head, "weight", torch.empty(0)).shape) == tuple(embed.weight.shape)
                   and served("output.weight", {qtype for qtype, _, _ in GGML_BLOCK_TYPES.values()}))
    what = ["the embedding table" + (" (tied to the LM head)" if tied else "")] if embeddings else []
    what += ["the LM head"] if untied_head else []
    if not what:
        return None, []

    def release(allocated: Any) -> None:
        owners = ([allocated.model.embed_tokens] if embeddings else []) + ([allocated.lm_head] if untied_head else [])
        for owner in owners:
            hold_as(owner, "weight", owner.weight.dtype, "meta")

    return release, what

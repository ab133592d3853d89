"""Q8_0 blocks for the small batches of a model loaded without a GGUF file (a plain safetensors checkpoint).

A decode step of a small batch is bound by reading the weights. A model read from a GGUF file multiplies small
batches straight from the file's blocks (model_loader/gguf_quant.py) and runs its decode steps in the fused CPU
step; a plain checkpoint has no blocks, so without this its decode steps read every weight in float32 or bf16.
Here each decoder linear layer and the LM head get Q8_0 blocks quantized at load time (`gguf.quants.quantize`,
the reference quantizer: per 32 weights an fp16 scale max|w| / 127 and 32 int8), which brings the fused decode
step and the GGUF kernels to such models: a quarter of the float32 bytes per step, half of bf16's. Q8_0 keeps
about as much of each weight as bf16 does (a relative rounding of at most 1/254 of its block's largest weight),
and only batches of at most `max_rows` rows use it; prefill and larger batches keep the float weights (or their
bf16 copies: model_loader/gemm_methods.py).

The arithmetic plan (layers/arithmetic.py) decides where this applies: `--small-batch-quantization`. A model read
from a GPTQ / AWQ / compressed-tensors checkpoint gets blocks made exactly from the checkpoint's integers there
instead, where its format has them (model_loader/checkpoint_blocks.py, model_loader/int_blocks.py).

With `--large-batch-weights blocks` (the plan's choice on CPUs with native bf16) the blocks are the layers' only
weights: the model is loaded with its linear weights in the checkpoint's dtype (`keep_linears_in`, so
no float32 copy of a bf16 checkpoint is ever made), each layer's blocks are made from them, and the float weight
is then released; large batches multiply the blocks through the float32 or bf16 GEMM a slab at a time
(layers/quantization/block_gemm.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from sglang.srt.layers.linear import Linear, LinearMethod, hold_as
from sglang.srt.layers.quantization.gguf_blocks import (
    QK,
    GGUFQuantWeight,
    kernels_available,
    kernels_unavailable_reason,
)
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod

logger = logging.getLogger(__name__)


def quantize_blocks(weight: torch.Tensor, qtype: str = "Q8_0") -> GGUFQuantWeight:
    """A float weight [n, k] (k a multiple of 32) as Q8_0 or Q4_1 blocks, as llama.cpp's reference quantizer makes
    them."""
    import gguf

    n, k = weight.shape
    raw = gguf.quants.quantize(weight.detach().to(torch.float32).numpy(), gguf.GGMLQuantizationType[qtype])
    return GGUFQuantWeight(qtype, np.ascontiguousarray(raw), n, k)


def quantize_q8_0(weight: torch.Tensor) -> GGUFQuantWeight:
    """A float weight [n, k] (k a multiple of 32) as Q8_0 blocks."""
    return quantize_blocks(weight, "Q8_0")


def decoder_linears(model: Any) -> list[Linear]:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    out: list[Linear] = []
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            module = getattr(owner, name, None)
            if not isinstance(module, Linear):
                return []
            out.append(module)
    return out


def untied_head(model: Any) -> Optional[nn.Module]:
    """The LM head module when it holds a weight of its own (not the input embeddings)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or getattr(head, "weight", None) is None or head is embed:
        return None
    return head


def head_for_blocks(model: Any) -> Any:
    """The LM head module when it can get blocks: the logits processor multiplies with it (set_head_method) and its
    input width is a multiple of the block size; else None."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(model, "logits_processor", None) is None or head.weight.shape[1] % QK:
        return None
    return head


def kernels_missing() -> Optional[str]:
    """Why no blocks can be multiplied here, or None."""
    return None if kernels_available() else f"the GGUF kernels are unavailable ({kernels_unavailable_reason()})"


def _shape_reason(model: Any) -> Optional[str]:
    """Why the decoder of `model` cannot be held as blocks, or None."""
    missing = kernels_missing()
    if missing is not None:
        return missing
    linears = decoder_linears(model)
    if not linears:
        return f"{type(model).__name__} is not a dense Llama-family decoder"
    if any(m.weight.shape[1] % QK for m in linears):
        return f"an input width is not a multiple of {QK}"
    return None


def why_no_q8_0_blocks(model: Any) -> str | None:
    """Why `attach_q8_0_blocks` leaves `model` as it is, or None when it applies."""
    reason = _shape_reason(model)
    if reason is not None:
        return reason
    # the linear weights (and a bf16 embedding table) may be in the checkpoint's dtype (keep_linears_in), or released
    # for the blocks of a quantized checkpoint's integers (checkpoint_blocks.linears_released_for_checkpoint_blocks)
    linears = decoder_linears(model)
    kept = {id(m.weight) for m in kept_owners(model, linears, torch.bfloat16)}
    released = frozenset(id(m.weight) for m in linears if m.weight.is_meta)
    if not float32_on_cpu_except(model, kept, released):
        return "the model is not float32 on CPU"
    if any(isinstance(m.linear_method, GGUFLinearMethod) for m in decoder_linears(model)):
        return "the model already has GGUF blocks"
    return None


def table_kept_as_stored(model: Any, dtype: torch.dtype) -> Optional[nn.Module]:
    """The input embedding module when its table can stay in the checkpoint's `dtype` under a float32 model: a bf16
    table (its rows widen to float32 exactly, in LlamaModel.embed and the fused step's token tables) looked up by
    LlamaModel.embed, whose LM head, where it is the same table, gets blocks (attach_q8_0_blocks) for every batch."""
    from sglang.srt.models.llama import LlamaModel

    backbone = getattr(model, "model", None)
    embed = getattr(backbone, "embed_tokens", None)
    if (dtype != torch.bfloat16 or type(embed) is not nn.Embedding
            or getattr(type(backbone), "embed", None) is not LlamaModel.embed
            or getattr(model, "logits_processor", None) is None or embed.weight.shape[1] % QK):
        return None
    return embed


def kept_owners(model: Any, linears: Sequence[nn.Module], dtype: torch.dtype,
                keep_table: bool = True) -> list[nn.Module]:
    """The modules whose `weight` may be held in the checkpoint's `dtype` until blocks replace it: `linears`, an LM
    head that is not the input embeddings and, with `keep_table`, the input embeddings where `table_kept_as_stored`
    keeps them."""
    owners: list[nn.Module] = list(linears)
    head = untied_head(model)
    if head is not None:
        owners.append(head)
    table = table_kept_as_stored(model, dtype) if keep_table else None
    if table is not None:
        owners.append(table)
    return owners


def float32_on_cpu_except(model: nn.Module, kept: set[int], released: frozenset[int] = frozenset()) -> bool:
    """Whether every parameter of `model` is on CPU and, but for those whose id is in `kept` (held in the
    checkpoint's dtype), float32; those in `released` and meta tensors (released: blocks serve their values, e.g. an
    input embedding table read from blocks) aside."""
    return not any(id(p) not in released and not p.is_meta and (
        p.device.type != "cpu" or (p.dtype != torch.float32 and id(p) not in kept)) for p in model.parameters())


def keep_linears_in(model: nn.Module, dtype: torch.dtype, keep_table: bool = True) -> Optional[str]:
    """On a model built on the meta device, give the decoder's linear weights (and an LM head that is not the input
    embeddings) `dtype` instead of the model's, so that loading a checkpoint stored in `dtype` makes no wider copy;
    `attach_q8_0_blocks(..., blocks_only=True)` then turns them into blocks. With `keep_table` (a checkpoint that
    stores the table in `dtype`: not a GGUF file's dequantized values) a bf16 input embedding table stays bf16 too
    (`table_kept_as_stored`): half the bytes of a float32 one. Returns why it does not apply (the model is left as
    it is), or None."""
    reason = _shape_reason(model)
    if reason is not None:
        return reason
    for module in kept_owners(model, decoder_linears(model), dtype, keep_table):
        hold_as(module, "weight", dtype)
    return None


# Makes the method for the large batches of a layer whose float weight is released: from its blocks and a function
# giving the values it computes with (its float weight while it is still there, or the blocks' values), called only
# where a copy is made of them (model_loader/gemm_methods.blocks_large_method).
LargeFromBlocks = Callable[[GGUFQuantWeight, Callable[[], torch.Tensor]], LinearMethod]


def large_batch_values(weight: torch.Tensor, blocks: GGUFQuantWeight, made_here: bool) -> Callable[[], torch.Tensor]:
    """What a large-batch copy of `blocks` (which replace the float `weight`) is made from, so that every batch size
    computes with the same weights: `weight` itself where the blocks are Q8_0 made from it at load (`made_here`:
    within 1/254 of it), else the blocks' values (Q4_1 is coarser; blocks read from a file or made from a quantized
    checkpoint may differ from `weight`, its bf16 rounding)."""
    if blocks.qtype == "Q8_0" and made_here:
        return lambda: weight
    return blocks.dequantize


def blocks_method(module: nn.Module, weight: GGUFQuantWeight, max_rows: int, large: Optional[LargeFromBlocks],
                  release_dtype: Optional[torch.dtype], from_file: bool = False) -> GGUFLinearMethod:
    """The linear method of a layer that gets `weight`'s blocks for batches of at most `max_rows` rows. With `large`
    the blocks serve every batch: large batches run the method `large` makes, and the layer's float weight is
    released (as a meta tensor of `release_dtype`; None keeps it, for a weight shared with the embeddings).
    A large-batch copy of Q4_1 blocks, or of blocks read from a file (`from_file`: the layer's weight may be their
    bf16 rounding), is made from the blocks' values, so that every batch size computes with the same weights (Q8_0
    blocks made at load are within 1/254 of the float weight they round: that weight serves)."""
    method = GGUFLinearMethod(weight, max_rows)
    if large is not None:
        method.large = large(weight, large_batch_values(module.weight, weight, made_here=not from_file))  # type: ignore[arg-type]
        if release_dtype is not None:  # a meta tensor: arithmetic on it fails loudly instead of reading stale values
            hold_as(module, "weight", release_dtype, "meta")
    return method


def attach_q8_0_blocks(model: Any, max_rows: int, large: Optional[LargeFromBlocks] = None,
                       qtype: str = "Q8_0") -> int:
    """Give every decoder linear layer and the LM head of a float32 Llama-family model blocks quantized at load
    (`qtype`: Q8_0, or Q4_1 with `--small-batch-quantization q4_1`; the LM head Q8_0 either way: in Q4_1 it alone
    moves most of the log-probability error, benchmarks/weight_format_accuracy.py) for batches of at most
    `max_rows` rows; returns the bytes attached (0 when it does not apply, with the reason logged).

    A model loaded from a GPTQ / AWQ / compressed-tensors checkpoint whose integers make blocks gets those instead
    (model_loader/checkpoint_blocks.py), exactly its own weights: its float weights, where they stay for large
    batches, are set to the blocks' values, so that every batch computes with the same weights.

    `large`: no float weights are kept. Each layer's large batches run the method `large` makes from its blocks and
    float weight (the GEMM over the blocks, or an int8 copy whose outlier columns come from the blocks), and the
    float weight is released as soon as that is made, so the model never holds all of it twice."""
    from sglang.srt.model_loader.checkpoint_blocks import checkpoint_blocks, release_made_blocks, reload_released

    source = getattr(model, "quantized_checkpoint", None)
    reason = why_no_q8_0_blocks(model) if max_rows > 0 else "--gguf-kernel-max-rows is 0"
    if reason is not None:
        logger.info("No %s blocks for small batches: %s", qtype, reason)
        release_made_blocks(model)  # those made from a quantized checkpoint's integers as it was read
        if source is not None:
            reload_released(model, source, "The linear layers' weights were")
        return 0
    dtype = model.model.norm.weight.dtype  # the model's (the embedding table may be kept bf16: keep_linears_in)
    head = head_for_blocks(model)
    heads = [head] if head is not None else []
    from_file: dict[int, Any] = {}
    if source is not None:
        found = checkpoint_blocks(model, source, decoder_linears(model), heads)
        from_file = found if isinstance(found, dict) else {}
        if not from_file:  # the weights released for these blocks are read as floats after all
            reload_released(model, source, "The linear layers' weights were")

    def make(module: nn.Module, fallback: str) -> GGUFLinearMethod:
        own_weight = module is not head or untied_head(model) is not None  # not the input embeddings
        raw = from_file.pop(id(module), None)  # packed below: the raw copy goes
        if raw is None:
            weight = quantize_blocks(module.weight, fallback)  # type: ignore[arg-type]
        else:
            assert source is not None
            weight = source.serve(raw)
            if large is None and own_weight:  # the float weight serves large batches: the blocks' values then
                with torch.no_grad():
                    module.weight.copy_(weight.dequantize())  # type: ignore[operator]
        release = dtype if own_weight else None
        return blocks_method(module, weight, max_rows, large, release, from_file=raw is not None)

    attached = made_here = 0
    made_types: set[str] = set()
    for module, fallback in [(m, qtype) for m in decoder_linears(model)] + [(h, "Q8_0") for h in heads]:
        # the LM head Q8_0 as llama.cpp keeps a Q4 model's output weight wider
        from_checkpoint = id(module) in from_file
        method = make(module, fallback)
        if module is head:
            model.logits_processor.set_head_method(method)
        else:
            module.set_linear_method(method)
        attached += method.quant_weight.nbytes
        if not from_checkpoint:
            made_here += method.quant_weight.nbytes
            made_types.add(method.quant_weight.qtype)
    what = "every matmul (no float weights kept)" if large is not None else f"matmuls of up to {max_rows} rows"
    if source is not None:
        from sglang.srt.model_loader.checkpoint_blocks import log_outcome

        log_outcome(source, found, attached - made_here, what)
    if made_here:
        logger.info("Attached %.1f MB of %s blocks (quantized at load) for %s", made_here / 2**20,
                    "/".join(sorted(made_types)), what)
    return attached

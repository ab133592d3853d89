"""One copy of a mixture-of-experts model's weights: its experts, too, served from Q8_0 blocks made at load.

The counterpart of model_loader/q8_blocks.py for decoders with stacked experts (layers/moe/fused_moe.FusedMoE:
Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2), where the plan serves every batch from blocks (`--large-batch-weights
blocks`, model_executor/model_runner.blocks_only):

- `keep_experts_in` runs on the model while it is on the meta device: every `Linear` of the decoder (attention, the
  dense MLPs, shared experts), an LM head of its own, a bf16 input embedding table and the stacked expert parameters
  take the checkpoint's dtype (bf16 / fp16), so that loading makes no float32 copy of them.
- `attach_expert_blocks` then gives each of those linear layers and the LM head Q8_0 blocks (q8_blocks.blocks_method:
  the block kernels for small batches, the plan's large-batch method over the blocks beyond) and each expert one
  block weight for its fused gate/up projection and one for its down projection (layers/moe/expert_blocks.py), and
  releases every float weight as soon as its blocks exist: a layer's stacked experts once all of its experts have
  blocks. The load thus peaks at the checkpoint's own bytes plus one expert's float32 copy (what the quantizer
  reads), and the served model holds ~1.06 bytes per weight.

A GPTQ / AWQ / compressed-tensors checkpoint's experts and linear layers get the blocks made from its integers as it
was read instead (model_loader/checkpoint_blocks.py), for every layer or none (its float weights then stay).

The routers (`gate`, Qwen2-MoE's `shared_expert_gate`, DeepSeek's router) stay float32: they are a few rows per
layer, and routing decisions are computed in the model dtype to pick the experts the checkpoint's authors trained
with (layers/moe/moe_block.py). So do the norms and, where they are not kept as stored, the embeddings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.linear import Linear, hold_as
from sglang.srt.layers.moe.expert_blocks import ExpertBlocks
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.quantization.gguf_blocks import QK, GGUFQuantWeight, RawBlocks
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.checkpoint_blocks import checkpoint_blocks, expert_blocks, log_outcome, reload_released
from sglang.srt.model_loader.q8_blocks import (
    LargeFromBlocks,
    blocks_method,
    float32_on_cpu_except,
    head_for_blocks,
    kept_owners,
    kernels_missing,
    large_batch_values,
    quantize_blocks,
    untied_head,
)
from sglang.srt.model_loader.quant_config import describe_checkpoint_quantization

logger = logging.getLogger(__name__)


def has_experts(model: nn.Module) -> bool:
    """Whether `model` has stacked experts (FusedMoE layers)."""
    return any(isinstance(m, FusedMoE) for m in model.modules())


def _parts(model: Any) -> tuple[list[Linear], list[FusedMoE]]:
    backbone = getattr(model, "model", None)
    if backbone is None:
        return [], []
    return ([m for m in backbone.modules() if isinstance(m, Linear)],
            [m for m in backbone.modules() if isinstance(m, FusedMoE)])


def moe_linears(model: Any) -> list[Linear]:
    """The decoder's linear layers beside the stacked experts (attention, dense and shared-expert MLPs)."""
    return _parts(model)[0]


def _shape_reason(model: Any, quantized_ok: bool = False) -> Optional[str]:
    """Why the decoder of `model` cannot be held as blocks, or None (`quantized_ok`: blocks may come from a quantized
    checkpoint's integers)."""
    missing = kernels_missing()
    if missing is not None:
        return missing
    linears, experts = _parts(model)
    if not experts:
        return f"{type(model).__name__} has no stacked experts"
    if not quantized_ok and describe_checkpoint_quantization(getattr(model, "config", None)) is not None:
        return "the checkpoint is quantized: its experts are read as their dequantized values"
    narrow = [m for m in linears if m.weight.shape[1] % QK]
    if narrow:
        return f"a linear layer's input width ({narrow[0].weight.shape[1]}) is not a multiple of {QK}"
    for fused in experts:
        for width in (fused.gate_up_proj.shape[2], fused.intermediate_size):
            if width % QK:
                return f"an expert's input width ({width}) is not a multiple of {QK}"
    return None


def keep_experts_in(model: nn.Module, dtype: torch.dtype, from_gguf: bool = False) -> Optional[str]:
    """On an MoE model built on the meta device, give the decoder's linear weights, the stacked experts (and an LM
    head that is not the input embeddings, a bf16 input embedding table) `dtype`, so that loading a checkpoint stored
    in `dtype` makes no wider copy; `attach_expert_blocks` turns them into blocks. Returns why it does not apply (the
    model is left as it is), or None. A GGUF file's weights stay float32 (its values exactly): its blocks are matched
    against them, or Q8_0 blocks made of them with no bf16 rounding between; its experts in blocks are not loaded at
    all (model_loader/gguf_experts.experts_read_from_file)."""
    reason = ("a GGUF file's values are matched against its blocks, or quantized, in float32 (its experts in blocks "
              "are read from the file alone)") if from_gguf else _shape_reason(model)
    if reason is not None:
        return reason
    linears, experts = _parts(model)
    for module in kept_owners(model, linears, dtype):
        hold_as(module, "weight", dtype)
    for fused in experts:
        fused.hold_stacked(dtype)
    return None


def experts_released_for_checkpoint_blocks(model: nn.Module) -> Callable[[nn.Module], None]:
    """For an MoE model on the meta device read from a quantized checkpoint whose integers make blocks: a function
    to run once the model has storage that releases its stacked experts (meta tensors: loading skips them), so that
    they never exist as floats; `attach_expert_blocks` gives them the blocks made as the checkpoint is read, or, where
    it has none for them, reads their dequantized values again (`_reload_experts`)."""
    def release(allocated: nn.Module) -> None:
        experts = _parts(allocated)[1]
        for fused in experts:
            fused.hold_stacked(device="meta")
        logger.info("The experts of %d layers are not loaded as floats: the blocks made from the checkpoint's "
                    "integers serve them", len(experts))

    return release


def _reload_experts(model: Any, source: Any) -> None:
    """Stacked experts (and linear layers) released before loading (experts_released_for_checkpoint_blocks,
    checkpoint_blocks.linears_released_for_checkpoint_blocks) that get no blocks: read their dequantized values from
    the checkpoint again, as loading would have."""
    layers = sum(1 for m in model.modules() if isinstance(m, FusedMoE) and m.gate_up_proj.is_meta)
    linears = sum(1 for m in moe_linears(model) if m.weight.is_meta)
    if layers or linears:
        reload_released(model, source, f"The experts of {layers} layers and {linears} linear layers' weights were")


def why_no_expert_blocks(model: Any, max_rows: int, large: Optional[LargeFromBlocks],
                         quantized_ok: bool = False) -> Optional[str]:
    """Why `attach_expert_blocks` leaves `model` as it is, or None."""
    if max_rows <= 0:
        return "--gguf-kernel-max-rows is 0"
    if large is None:
        return "experts get blocks only where blocks serve every batch (--large-batch-weights blocks)"
    reason = _shape_reason(model, quantized_ok)
    if reason is not None:
        return reason
    # the kept weights may be in the checkpoint's dtype (keep_experts_in); those a GGUF file's blocks serve, released
    linears, experts = _parts(model)
    kept = {id(m.weight) for m in kept_owners(model, linears, torch.bfloat16)}
    kept.update(id(p) for fused in experts for p in fused.stacked_params())
    released = {id(m.weight) for m in linears if isinstance(m.linear_method, GGUFLinearMethod) or m.weight.is_meta}
    released.update(id(p) for fused in experts for p in fused.stacked_params() if p.is_meta)
    head = head_for_blocks(model)
    if head is not None and _head_in_blocks(model):
        released.add(id(head.weight))
    if not float32_on_cpu_except(model, kept, frozenset(released)):
        return "the model is not float32 on CPU"
    return None


def _head_in_blocks(model: Any) -> bool:
    """The LM head runs on blocks already (a GGUF file's own)."""
    return isinstance(model.logits_processor.head_method, GGUFLinearMethod)


def _expert_blocks(fused: FusedMoE, max_rows: int, large: LargeFromBlocks, qtype: str, int8_activations: bool,
                   dtype: torch.dtype, made: Optional[list[tuple[GGUFQuantWeight, GGUFQuantWeight]]] = None
                   ) -> ExpertBlocks:
    """The blocks of every expert of `fused`, which compute in the model's `dtype`: quantized from its float values,
    or `made` from a quantized checkpoint's integers (checkpoint_blocks.expert_blocks: per expert gate/up, down)."""
    methods: dict[str, list[GGUFLinearMethod]] = {"gate_up_proj": [], "down_proj": []}
    for expert in range(fused.num_experts):
        for index, (name, out) in enumerate(methods.items()):
            weight = getattr(fused, name)[expert]
            blocks = quantize_blocks(weight, qtype) if made is None else made[expert][index]
            method = GGUFLinearMethod(blocks, max_rows, int8_activations=int8_activations)
            method.large = large(blocks, large_batch_values(weight, blocks, made_here=made is None))
            out.append(method)
    return ExpertBlocks(methods["gate_up_proj"], methods["down_proj"], dtype)


def attach_expert_blocks(model: Any, max_rows: int, large: Optional[LargeFromBlocks], qtype: str = "Q8_0",
                         activations: str = "float32", expert_large: Optional[LargeFromBlocks] = None) -> int:
    """Serve every linear layer, expert and the LM head of a float32 MoE decoder from `qtype` blocks made at load
    (the LM head Q8_0 either way, as q8_blocks.attach_q8_0_blocks keeps it), for every batch: the block kernels up
    to `max_rows` rows (with int8 activations for `activations` "int8"), the method `large` makes beyond, for the
    experts the one `expert_large` makes where given (the GEMM over their blocks: an int8 copy of every expert would
    double what the experts, most of such a model, hold, for the few rows a prefill routes to each). Float weights
    are released as their blocks are made. Returns the bytes of the blocks (0 when it does not apply, with the
    reason logged)."""
    all_linears, all_experts = _parts(model)
    # a GGUF file's own blocks may serve some already (model_loader/gguf_quant.py, gguf_experts.py)
    linears = [m for m in all_linears if not isinstance(m.linear_method, GGUFLinearMethod)]
    experts = [m for m in all_experts if m.expert_blocks is None]
    from_file = len(linears) < len(all_linears) or len(experts) < len(all_experts)
    head = head_for_blocks(model)
    if head is not None and _head_in_blocks(model):
        head = None
    if not linears and not experts and head is None:
        return 0
    source = getattr(model, "quantized_checkpoint", None)
    reason = why_no_expert_blocks(model, max_rows, large, quantized_ok=source is not None)
    if reason is not None:
        logger.info("No %s blocks for the experts and linear layers: %s", qtype, reason)
        if source is not None:
            _reload_experts(model, source)
        return 0
    assert large is not None
    found: dict[Any, RawBlocks] = {}
    if source is not None:  # a quantized checkpoint: blocks of its own integers for every layer, or none
        made = checkpoint_blocks(model, source, linears, [head] if head is not None else [], experts)
        if isinstance(made, str):
            log_outcome(source, made, 0, "")
            _reload_experts(model, source)
            return 0
        found = made
    dtype = model.model.norm.weight.dtype  # the model's (the embedding table may be kept bf16)
    attached = 0
    for module, fallback in [(m, qtype) for m in linears] + ([(head, "Q8_0")] if head is not None else []):
        raw = found.pop(id(module), None)
        weight = quantize_blocks(module.weight, fallback) if raw is None else source.serve(raw)
        own_weight = module is not head or untied_head(model) is not None  # else the input embeddings, which stay
        method = blocks_method(module, weight, max_rows, large, dtype if own_weight else None,
                               from_file=raw is not None)
        if module is head:
            model.logits_processor.set_head_method(method)
        else:
            module.set_linear_method(method)
        attached += method.quant_weight.nbytes
    expert_bytes = 0
    for fused in experts:  # one layer at a time: its float experts go as soon as their blocks exist
        raws = expert_blocks(found, fused) if source is not None else None
        own = [(source.serve(gate_up), source.serve(down)) for gate_up, down in raws] if raws is not None else None
        blocks = _expert_blocks(fused, max_rows, expert_large or large, qtype, activations == "int8", dtype, own)
        fused.serve_from_blocks(blocks, dtype)
        expert_bytes += blocks.nbytes
    if source is not None:
        log_outcome(source, found, attached + expert_bytes, "every matmul and expert (no float weights kept)")
        return attached + expert_bytes
    which = "the matmuls the file's blocks do not serve" if from_file else "every matmul"
    logger.info("Attached %.1f MB of %s blocks (quantized at load) for %s (no float weights kept), %.1f MB of them "
                "for the experts of %d layers; routers stay float32", (attached + expert_bytes) / 2**20, qtype, which,
                expert_bytes / 2**20, len(experts))
    return attached + expert_bytes

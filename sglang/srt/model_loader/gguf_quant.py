"""Choosing the GGUF-blocks linear method at load time for a model read from a GGUF file.

Every linear layer and the LM head get the file's original blocks through `GGUFLinearMethod`
(layers/quantization/gguf_linear.py), which runs batches of at most `max_rows` rows on them. The blocks are attached
only where their dequantized values equal the loaded float weights bit for bit, so every path computes with the
same weights. Where the plan serves every batch from blocks (`--large-batch-weights blocks`, the default on CPUs
with native bf16) the float weights are then released and large batches multiply the blocks too (or an int8 copy
made from them: model_loader/gemm_methods.blocks_large_method): the model holds the file's bytes, not a float32 copy.
Otherwise the float weights stay for large batches. In an MoE model the shared experts are linear layers like the
others, and under that plan each expert of the stacked layers gets its own blocks too (model_loader/gguf_experts.py).

Under that plan the decoder's linear weights need not be loaded at all: where the file holds every one of them as
blocks and its conversion records the order of the Q / K rows (`linears_read_from_file`), they are released as soon
as the model has storage, loading skips them, and each layer takes the file's blocks of its shape in the recorded
order; the load then holds the file's blocks and the small float tensors, never a float copy of the linears (the
conversion's tests check those blocks against transformers' reading of the file).

Q4_0 tensors become the Q4_1 blocks of the same values. A file's other types (Q4_K, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K,
Q6_K, mixed within one file as K-quant "M" files mix them) are checked the same way against their own values, then
converted into Q4_1 / Q8_0 blocks one layer at a time (model_loader/gguf_block_convert.py: the bounds), and the
layer computes with the converted blocks' values at every batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

import torch
from torch import nn

from sglang.huge_pages import TRIM_BYTES, release_free_heap
from sglang.srt.layers.linear import Linear, hold_as
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.quantization.block_embedding import KQuantTable, serve_embeddings_from
from sglang.srt.layers.quantization.gguf_blocks import (
    KQUANT_TYPES,
    GGUFQuantWeight,
    RawBlocks,
    kernels_available,
    kernels_unavailable_reason,
    pack_stored,
    rotary_rows_gguf_to_hf,
)
from sglang.srt.model_loader.gguf_block_convert import convert_blocks, converted_packed, served_type
from sglang.srt.model_loader.gguf_convert import conversion_record
from sglang.srt.model_loader.gguf_experts import attach_file_experts, block_origins
from sglang.srt.model_loader.gguf_reader import (
    GGML_BLOCK_TYPES,
    gguf_tensor_table,
    mapped_page_dropper,
    read_gguf_block_tensors,
)
from sglang.srt.model_loader.gguf_values import Parts, dequantizes_to, holds
from sglang.srt.model_loader.q8_blocks import LargeFromBlocks, blocks_method

logger = logging.getLogger(__name__)

# Largest number of token rows sent to the quantized kernel (benchmarks/RESULTS.md: the dense float32 GEMM
# wins beyond this on the development machine).
DEFAULT_MAX_ROWS = 64


# Ways to read one weight from the file, tried in turn (the first whose values equal the loaded weight wins).
Candidates = list[Callable[[], Optional[RawBlocks | Parts]]]


def _rows(blocks: RawBlocks, index: torch.Tensor) -> RawBlocks:
    qtype, raw, n, k = blocks
    return qtype, raw[index], n, k


def _stack(parts: Sequence[Optional[RawBlocks]]) -> Optional[Parts]:
    """Matrices stacked along N (fused QKV, gate/up), each in its own stored type; None when a part is missing or
    the parts' K differ."""
    if not parts or any(p is None for p in parts):
        return None
    full = [p for p in parts if p is not None]
    return full if all(p[3] == full[0][3] for p in full) else None


def _as_parts(found: Optional[RawBlocks | Parts]) -> Optional[Parts]:
    return [found] if isinstance(found, tuple) else found


def _matching_parts(candidates: Sequence[Callable[[], Optional[RawBlocks | Parts]]],
                    target: torch.Tensor) -> Optional[Parts]:
    """The first candidate whose stored values equal `target` exactly; for a weight never loaded (a meta tensor:
    linears_read_from_file), the first of its shape (the candidates come in the order the conversion records)."""
    for make in candidates:
        parts = _as_parts(make())
        if parts and _matches(parts, target):
            return parts
    return None


def _matches(parts: Parts, target: torch.Tensor) -> bool:
    """The parts hold `target`'s values exactly, or, for a weight never loaded (a meta tensor), its shape."""
    return _fits(parts, target) if target.is_meta else dequantizes_to(parts, target)


def _fits(parts: Parts, target: torch.Tensor) -> bool:
    return target.dim() == 2 and (sum(p[2] for p in parts), parts[0][3]) == tuple(target.shape) and all(
        p[3] == parts[0][3] for p in parts)


def _served(parts: Parts) -> tuple[GGUFQuantWeight, bool]:
    """The parts as one weight the kernels read, and whether it holds the file's blocks as stored (Q4_1 / Q8_0 of
    one type) rather than blocks converted from them (model_loader/gguf_block_convert.py)."""
    types = {p[0] for p in parts}
    target = served_type(types)
    as_stored = types == {target}
    n, k = sum(p[2] for p in parts), parts[0][3]
    packed = pack_stored(target, [(p[0], p[1]) for p in parts], k)  # Q4_0 / Q4_1 / Q8_0: straight into row groups
    if packed is not None:
        return GGUFQuantWeight.from_packed(target, packed, n, k), as_stored
    packed = converted_packed(parts, target, k)  # a slice of rows at a time: no whole converted copy
    if packed is not None:
        return GGUFQuantWeight.from_packed(target, packed, n, k), as_stored
    raws = [p[1] if as_stored else convert_blocks(p[0], p[1], p[2], p[3], target) for p in parts]
    return GGUFQuantWeight(target, torch.cat(raws), n, k), as_stored


def attach_gguf_quant_weights(model: Any, gguf_path: str, config: Any, max_rows: int = DEFAULT_MAX_ROWS,
                              large: Optional[LargeFromBlocks] = None, expert_large: Optional[LargeFromBlocks] = None,
                              int8_activations: bool = False) -> int:
    """Attach GGUF blocks to the linear layers of a Llama-family model and, where blocks serve every batch, to the
    experts of its MoE layers (model_loader/gguf_experts.py); returns the bytes attached (0: none were, the float
    weights serve). `large`: the blocks serve every batch and the float weights are released
    (model_loader/q8_blocks.blocks_method); `expert_large`: the experts' large-batch method (default `large`), and
    `int8_activations` their small-batch activations (the linear layers take theirs with set_gguf_activations)."""
    if not kernels_available():
        logger.info("Quantized GGUF kernels unavailable (%s); using float weights only", kernels_unavailable_reason())
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        linear_weights.add(id(head.weight))
    # linear weights may have loaded in bf16 (model_executor/model_runner.load_for_plan); everything else float32
    if layers is None or any(p.dtype != torch.float32 and id(p) not in linear_weights for p in model.parameters()):
        return 0
    experts = any(isinstance(m, FusedMoE) for m in model.modules())
    if experts and large is None:
        logger.info("GGUF blocks serve an MoE model only where blocks serve every batch (--large-batch-weights "
                    "blocks); %s keeps its float weights", type(model).__name__)
        return 0
    tensors = read_gguf_block_tensors(gguf_path, stacked=experts)

    def block(name: str) -> Optional[RawBlocks]:
        entry = tensors.get(name)
        if entry is None:
            return None
        qtype, raw, n, k = entry
        return qtype, torch.from_numpy(raw), n, k  # a view of the file's (private) mapping: read as it is served

    drop = mapped_page_dropper(tensors)
    expert_bytes = 0
    if experts:
        assert large is not None
        expert_bytes = attach_file_experts(model, block, _matches, _served, max_rows, expert_large or large,
                                           int8_activations, drop)
    interleaved = conversion_record(gguf_path).get("qk_rows", "interleaved") == "interleaved"
    return expert_bytes + _attach_linears(model, block, config, max_rows, large, interleaved, drop)


def _decoder_linears(model: Any) -> Optional[list[nn.Module]]:
    """The linear layers of every decoder layer that the file's blocks may serve (fused QKV, output, dense MLPs and
    shared experts' projections); None where a layer has others."""
    linears: list[nn.Module] = []
    for layer in getattr(getattr(model, "model", None), "layers", None) or []:
        attn, mlps = getattr(layer, "self_attn", None), _mlp_linears(getattr(layer, "mlp", None))
        if mlps is None or not hasattr(attn, "qkv_proj") or not hasattr(attn, "o_proj"):
            return None
        linears += [attn.qkv_proj, attn.o_proj, *(m for mlp, _ in mlps for m in (mlp.gate_up_proj, mlp.down_proj))]
    return linears or None


def _file_names(model: Any, layer: int, split_qkv: bool) -> list[str]:
    """The file tensors that serve the decoder linears of `layer`."""
    names = [f"blk.{layer}.attn_{n}.weight" for n in (("q", "k", "v") if split_qkv else ("qkv",))]
    names.append(f"blk.{layer}.attn_output.weight")
    for _, role in _mlp_linears(model.model.layers[layer].mlp) or []:
        gate = [f"blk.{layer}.ffn_gate{role}.weight"] if split_qkv or role else []  # Phi-3: gate and up in ffn_up
        names += [*gate, f"blk.{layer}.ffn_up{role}.weight", f"blk.{layer}.ffn_down{role}.weight"]
    return names


def linears_read_from_file(model: nn.Module, gguf_path: str) -> Optional[Callable[[nn.Module], None]]:
    """For a model built on the meta device whose decoder linears the file holds as 2-D blocks of a type the kernels
    serve (as stored or converted), and whose conversion records the file's Q / K row order: a function to run once
    the model has storage, before the checkpoint is read, that releases those weights (meta tensors: reading the
    checkpoint skips them), so that they never exist as floats; `attach_gguf_quant_weights` reads them from the
    file. None where that does not hold (they load as floats and the file's blocks are matched against them)."""
    linears = _decoder_linears(model)
    if linears is None or not kernels_available() or "qk_rows" not in conversion_record(gguf_path):
        return None
    _, table = gguf_tensor_table(gguf_path)
    blocks = {name for name, dims, ttype, _ in table if len(dims) == 2 and ttype in GGML_BLOCK_TYPES}
    for i in range(len(model.model.layers)):  # type: ignore[union-attr, arg-type]
        split = all(f"blk.{i}.attn_{n}.weight" in blocks for n in ("q", "k", "v"))
        if not blocks.issuperset(_file_names(model, i, split)):
            return None

    def release(allocated: nn.Module) -> None:
        for linear in _decoder_linears(allocated) or []:
            weight: torch.Tensor = linear.weight  # type: ignore[assignment]
            hold_as(linear, "weight", weight.dtype, "meta")

    return release


def _attach_linears(model: Any, block: Callable[[str], Optional[RawBlocks]], config: Any, max_rows: int,
                    large: Optional[LargeFromBlocks], interleaved: bool, drop: Callable[[int, int], None]) -> int:
    """The file's blocks for every linear layer (attention, dense MLPs, shared experts) and the LM head, where every
    one of them matches; returns their bytes (0: none attached, with the reason logged). `interleaved`: the file's
    Q / K rows are in llama.cpp's order for its rotary embedding (the conversion's record), tried first. Weights
    never loaded (linears_read_from_file) that the file cannot serve are a startup error naming the layer."""
    layers = model.model.layers
    if _decoder_linears(model) is None:
        logger.info("GGUF blocks are attached to layers of fused QKV and gate/up projections; %s has others",
                    type(model).__name__)
        return 0
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    plan: list[tuple[nn.Module, Parts]] = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = (block(f"blk.{i}.attn_{n}.weight") for n in ("q", "k", "v"))
        if q is None or k is None or v is None:
            # Phi-3's files hold Q, K and V as one tensor, and gate and up as `ffn_up`, in the checkpoint's row order
            qkv_candidates: Candidates = [partial(block, f"blk.{i}.attn_qkv.weight")]
            gate_up_candidates: Candidates = [partial(block, f"blk.{i}.ffn_up.weight")]
        else:
            def qkv_hf_order(q: RawBlocks = q, k: RawBlocks = k, v: RawBlocks = v) -> Optional[Parts]:
                # llama.cpp's converter interleaves the rotary halves of Q and K for Llama models.
                parts = _stack([_rows(q, rotary_rows_gguf_to_hf(q[2], num_heads)),
                                _rows(k, rotary_rows_gguf_to_hf(k[2], num_kv_heads)), v])
                for copied in (q, k):  # their rows are copied: the file's pages of them leave this process
                    drop(copied[1].data_ptr(), copied[1].numel())
                return parts

            as_stored = partial(_stack, [q, k, v])
            qkv_candidates = [qkv_hf_order, as_stored] if interleaved else [as_stored, qkv_hf_order]
            gate_up_candidates = [partial(_stack, [block(f"blk.{i}.ffn_gate.weight"), block(f"blk.{i}.ffn_up.weight")])]
        matches = [
            (attn.qkv_proj, _matching_parts(qkv_candidates, attn.qkv_proj.weight)),
            (attn.o_proj, _matching_parts([partial(block, f"blk.{i}.attn_output.weight")], attn.o_proj.weight)),
        ]
        for dense, role in _mlp_linears(mlp) or []:
            candidates = gate_up_candidates if role == "" else [partial(_stack, [
                block(f"blk.{i}.ffn_gate{role}.weight"), block(f"blk.{i}.ffn_up{role}.weight")])]
            matches += [
                (dense.gate_up_proj, _matching_parts(candidates, dense.gate_up_proj.weight)),
                (dense.down_proj, _matching_parts([partial(block, f"blk.{i}.ffn_down{role}.weight")],
                                                  dense.down_proj.weight)),
            ]
        if any(parts is None for _, parts in matches):
            if any(module.weight.is_meta for module, _ in matches):
                raise ValueError(f"the GGUF tensors of layer {i} ({', '.join(_file_names(model, i, q is not None))}) "
                                 "do not fit the model's linear layers")
            logger.info("GGUF blocks of layer %d do not match the loaded weights; using float weights only", i)
            return 0
        plan += [(module, parts) for module, parts in matches if parts is not None]
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(model, "logits_processor"):
        head_parts = _matching_parts([lambda: block("output.weight"), lambda: block("token_embd.weight")],
                                     head.weight)
        if head_parts is not None:
            plan.append((head, head_parts))
        elif head.weight.is_meta:
            raise ValueError("the GGUF file's output / token_embd blocks do not fit the model's LM head")
    return _attach(model, plan, max_rows, large, model.model.embed_tokens.weight.dtype,
                   lambda: _as_parts(block("token_embd.weight")), drop)


def _mlp_linears(mlp: nn.Module) -> Optional[list[tuple[Any, str]]]:
    """The dense SwiGLU MLPs of a layer and the suffix of their file names: the MLP itself (""), or an MoE block's
    shared expert(s) ("_shexp"; none where it has none); None for an MLP of any other kind."""
    if hasattr(mlp, "gate_up_proj"):
        return [(mlp, "")]
    shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
    if not isinstance(getattr(mlp, "experts", None), FusedMoE) or (
            shared is not None and not hasattr(shared, "gate_up_proj")):
        return None
    return [] if shared is None else [(shared, "_shexp")]


def _attach(model: Any, plan: list[tuple[nn.Module, Parts]], max_rows: int, large: Optional[LargeFromBlocks],
            dtype: torch.dtype, token_embd: Callable[[], Optional[Parts]], drop: Callable[[int, int], None]) -> int:
    """Give each module of `plan` (the LM head last, if there) the blocks of its matched parts; returns their
    bytes. Converted blocks are named by what was read (`model.gguf_block_origins`, the weights report); where the
    float weights stay for large batches they are set to the converted blocks' values, and an LM head that is the
    input embeddings takes blocks only where their values are the embeddings' own. The input embeddings are then
    read from blocks where those hold the table's values (`_embeddings_from_blocks`; `token_embd`: the file's)."""
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.model.embed_tokens.weight
    served: list[tuple[nn.Module, GGUFQuantWeight, bool, str]] = []
    never_loaded = any(module.weight.is_meta for module, _ in plan)
    unreleased = 0  # bytes of blocks converted since the heap last gave its free pages back
    try:  # every layer's blocks first: a tensor that cannot be converted leaves the model as it is
        while plan:  # each layer's parts go as soon as its blocks exist
            module, parts = plan.pop(0)
            served.append((module, *_served(parts), "+".join(sorted({p[0] for p in parts}))))
            for part in parts:  # its blocks are copied: the file's pages of them leave this process
                drop(part[1].data_ptr(), part[1].numel())
            unreleased += 0 if served[-1][2] else served[-1][1].nbytes
            if unreleased >= TRIM_BYTES:  # the conversions' freed slices would stay resident in the heap
                release_free_heap()
                unreleased = 0
    except ValueError as err:
        if never_loaded:  # no float weights to fall back on
            raise ValueError(f"GGUF blocks of weights never loaded as floats could not be converted: {err}") from err
        logger.info("GGUF blocks could not be converted (%s); using float weights only", err)
        return 0
    origins = block_origins(model)
    routes: set[str] = set()
    attached = 0
    head_blocks: Optional[GGUFQuantWeight] = None
    file_table = not tied  # whether the embeddings may be read from the file's own token_embd
    for module, weight, as_stored, read in served:
        # a tied head whose converted blocks round the table (a K-quant table as Q8_0, whether or not it was loaded
        # as floats): it computes with them where they serve every batch, and the embeddings keep the table's own
        # values (the file's K-quant rows, or the float table)
        rounded_table = module is head and tied and not as_stored and (
            read in KQUANT_TYPES or not holds(weight, module.weight))
        if rounded_table and large is None:
            logger.info("GGUF %s LM head tied to the embeddings keeps its float weights", read)
            continue
        if rounded_table:
            file_table = True
            logger.info("GGUF %s LM head tied to the embeddings: its matmuls read %s blocks converted at load, the "
                        "input embeddings keep the table's float values", read, weight.qtype)
        if not as_stored:
            origins[id(weight.packed)] = f"GGUF {read}"
            routes.add(f"{read} as {weight.qtype}")
            if large is None and not (module is head and tied):
                with torch.no_grad():  # the float weight serves large batches: the blocks' values then
                    module.weight.copy_(weight.dequantize())  # type: ignore[operator]
        if module is head:
            head_blocks = None if rounded_table else weight
            release = dtype if not tied else None
            model.logits_processor.set_head_method(blocks_method(head, weight, max_rows, large, release,
                                                                 from_file=True))
        else:
            module.set_linear_method(blocks_method(module, weight, max_rows, large, dtype, from_file=True))  # type: ignore[operator]
        attached += weight.nbytes
    what = "every matmul (no float weights kept)" if large is not None else f"matmuls of up to {max_rows} rows"
    converted = f" (converted at load: {', '.join(sorted(routes))})" if routes else ""
    logger.info("Attached %.1f MB of GGUF blocks for %s%s", attached / 2**20, what, converted)
    # a tied table whose float copy serves the head's large batches stays
    attached += _embeddings_from_blocks(model, head_blocks if tied and large is not None else None,
                                        token_embd if file_table else None, drop)
    if model.model.embed_tokens.weight.is_meta and type(model.model.embed_tokens) is nn.Embedding:
        raise ValueError("the input embeddings were never loaded as floats and the GGUF file's blocks do not serve "
                         "them")
    return attached


def _embeddings_from_blocks(model: Any, head_blocks: Optional[GGUFQuantWeight],
                            token_embd: Optional[Callable[[], Optional[Parts]]], drop: Callable[[int, int], None]
                            ) -> int:
    """Read the float32 input embeddings from blocks of the same values (layers/quantization/block_embedding.py):
    `head_blocks`, those of the LM head tied to them, or else the file's own `token_embd` blocks where they hold the
    table's values: Q4_0 / Q4_1 / Q8_0 as packed blocks, a K-quant table as the file stores it (its rows
    dequantized per lookup); other types are converted to coarser blocks. Returns the bytes of blocks added (none
    for the head's)."""
    table = model.model.embed_tokens
    if type(table) is not nn.Embedding or table.weight.dtype != torch.float32 or (
            head_blocks is None and token_embd is None):
        return 0
    added = 0
    if head_blocks is None:
        assert token_embd is not None
        parts = _matching_parts([token_embd], table.weight)
        if parts is None:
            return 0
        qtype, raw, n, k = parts[0]
        if len(parts) == 1 and qtype in KQUANT_TYPES and k % 256 == 0:
            kquant = KQuantTable(qtype, raw.clone(), n, k)  # copied: the file's pages of it leave this process
            drop(raw.data_ptr(), raw.numel())
            serve_embeddings_from(model, kquant)
            logger.info("The input embeddings are read from the file's %s rows (%.1f MB of float32 %s)", qtype,
                        n * k * 4 / 2**20, "released" if not table.weight.is_meta else "never loaded")
            return kquant.nbytes
        head_blocks, as_stored = _served(parts)
        if not as_stored and not holds(head_blocks, table.weight):
            logger.info("The input embeddings stay float32: the file's %s blocks of them convert to other values",
                        parts[0][0])
            return 0
        added = head_blocks.nbytes
        if not as_stored:
            block_origins(model)[id(head_blocks.packed)] = f"GGUF {parts[0][0]}"
    never_loaded = table.weight.is_meta
    serve_embeddings_from(model, head_blocks)
    logger.info("The input embeddings are read from %s blocks (%.1f MB of float32 %s)", head_blocks.qtype,
                head_blocks.n * head_blocks.k * 4 / 2**20, "never loaded" if never_loaded else "released")
    return added

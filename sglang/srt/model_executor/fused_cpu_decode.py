"""The fused CPU decode strategy: a Llama-family decode step in one compiled call (layers/csrc/decode_stack.cpp).

Run op by op from Python, a batch-1 decode step of SmolLM2-135M spends more time in dispatch (about 15 aten ops,
5 kernel calls and a dozen module calls per layer, 30 layers) than in arithmetic. When every linear layer of the
model carries GGUF blocks (see sglang/srt/model_loader/gguf_quant.py), the decoder layers of a decode batch of at
most `max_rows` sequences instead run inside one C++ call: one OpenMP team, five phases per layer whose work items
the threads claim from shared counters. For a plain Llama-family backbone (nn.Embedding, RoPE without M-RoPE) the
call also looks up the embedding and RoPE rows of the token ids and positions, and when the LM head is on GGUF
blocks computed like the layers it ends with the head: one call from token ids to logits. Otherwise those stay in
Python (`model.model.embed`, `model.compute_logits`).

A batch whose rows are consecutive positions of one sequence (a speculative verify step,
ForwardBatch.rows_share_sequences) tells the step so: it then stores every row's K/V before any row attends.

EAGLE drafting reads the served model's states of every forward: `forward_with_hidden` returns the final normed hidden
states beside the logits (the head's input, which the step computes anyway), and when the backbone names
`layers_to_capture` (EAGLE3) the step copies those layers' inputs out and leaves them in its `aux_hidden_states`,
as LlamaModel.forward does. Without a capture the step makes no copies.

Rows of LoRA adapters (lora/) get their low-rank deltas inside the step (csrc/lora_deltas.h): each adapter in memory
is registered with the stack once, in a slot, from the tensors lora/packed.py keeps (no copy), and a step passes each
row's slot (-1 for the base model). Rows of different adapters, of different ranks, and of the base model share
the step.

The result equals the layer-by-layer path up to float32 summation order. SGLANG_DISABLE_FUSED_DECODE=1 turns it
off.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.cpu_extension import CpuExtension
from sglang.srt.layers.cpu_ops import CSRC
from sglang.srt.layers.quantization.block_embedding import BlockEmbedding, KQuantTable
from sglang.srt.layers.quantization.gguf_blocks import KERNEL_HEADERS, KQUANT_TYPES
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.lora.layers import LoraBatchState
from sglang.srt.lora.packed import PackedAdapter
from sglang.srt.mem_cache.kv_dtype import KERNEL_KV_DTYPES
from sglang.srt.models.llama import LlamaModel

DISABLE_ENV = "SGLANG_DISABLE_FUSED_DECODE"
_EXTENSION = CpuExtension("sglang_decode_stack", CSRC / "decode_stack.cpp", "fused CPU decode step", DISABLE_ENV,
                          headers=[CSRC / "cpu_kernels.h", CSRC / "kv_types.h", CSRC / "kv_layout.h",
                                   CSRC / "decode_attention.h", CSRC / "decode_attention_avx512.h",
                                   CSRC / "attention_split.h", CSRC / "lora_deltas.h", *KERNEL_HEADERS])


def available() -> bool:
    return _EXTENSION.available()


def unavailable_reason() -> Optional[str]:
    return _EXTENSION.unavailable_reason()


def set_decode_attention_avx512(on: bool) -> bool:
    """The step's switch for the AVX512 path of bf16 attention (as cpu_ops.set_decode_attention_avx512, which sets
    the standalone kernels' own); returns whether it was on."""
    return bool(_EXTENSION.module().set_decode_attention_avx512(on))


def set_dequant_min_rows(rows: int) -> int:
    """The step's switch for when its float32 matmuls convert each row group once for all rows (as
    gguf_blocks.set_dequant_min_rows, which sets the standalone kernels' own); returns the previous value."""
    if rows < 0:
        raise ValueError("rows must be >= 0")
    return int(_EXTENSION.module().set_dequant_min_rows(int(rows)))


class LoraSlots:
    """Which stack slot holds which adapter: an adapter is registered on the first step that uses it, again when its
    weights were read anew (evicted and loaded back), and released once it left memory."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.slots: dict[str, tuple[PackedAdapter, int]] = {}  # adapter name -> (its weights, slot)
        self.generation = -1

    def sync(self, state: LoraBatchState) -> None:
        """Release the slots of adapters that left memory since the last step (or were read anew)."""
        if state.generation != self.generation:
            for name, (packed, slot) in list(self.slots.items()):
                if state.packed.get(name) is not packed:
                    self.stack.clear_lora_adapter(slot)
                    del self.slots[name]
            self.generation = state.generation

    def row_slots(self, state: LoraBatchState, names: list[Optional[str]]) -> torch.Tensor:
        """The slot of each row's adapter (-1: the base model), registering the adapters not yet in the stack."""
        self.sync(state)
        by_name: dict[Optional[str], int] = {None: -1}
        for name in names:
            if name not in by_name:
                by_name[name] = self._slot(name, state.packed[name])
        return torch.tensor([by_name[name] for name in names], dtype=torch.long)

    def _slot(self, name: str, packed: PackedAdapter) -> int:
        held = self.slots.get(name)
        if held is not None and held[0] is packed:
            return held[1]
        used = {slot for _, slot in self.slots.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.stack.set_lora_adapter(slot, packed.rank, packed.a, packed.b, packed.masks)
        self.slots[name] = (packed, slot)
        return slot


class FusedCpuDecode:
    """Runs decode batches of up to `max_rows` sequences: embeddings, the fused layer stack, then the LM head."""

    name = "fused CPU decode step"

    def __init__(self, stack: Any, max_rows: int, int8_activations: bool = False, from_tokens: bool = False,
                 with_head: bool = False, one_term_rows: int = 0) -> None:
        self.stack = stack
        self.max_rows = max_rows
        # Whether the stack builds its input from the token ids (set_token_tables) and ends with the LM head.
        self.from_tokens = from_tokens
        self.with_head = from_tokens and with_head
        reach = ""
        if from_tokens:
            reach = " (token ids to logits)" if self.with_head else " (token ids to final hidden states)"
        act = " with int8 activations" if int8_activations else ""
        if int8_activations and one_term_rows:
            act += f" (one term per block from {one_term_rows} rows, except in speculative verify steps)"
        self.name = f"{FusedCpuDecode.name}{reach}{act}"
        self.lora_slots = LoraSlots(stack)

    def accepts(self, forward_batch: ForwardBatch, lora: Optional[LoraBatchState] = None) -> bool:
        """Whether the step runs this batch: a decode batch of 1-max_rows sequences, whose rows' adapters (if any)
        are in memory with one row per sequence (`lora`: the server's LoRA state)."""
        if not (forward_batch.forward_mode.is_decode() and 0 < forward_batch.batch_size <= self.max_rows):
            return False
        names = forward_batch.lora_ids
        return names is None or (lora is not None and len(names) == forward_batch.input_ids.shape[0]
                                 and all(name is None or name in lora.packed for name in names))

    def forward(self, model: Any, forward_batch: ForwardBatch, lora: Optional[LoraBatchState] = None) -> torch.Tensor:
        """The logits of every row (a decode batch wants them all)."""
        out, _ = self._run(model, forward_batch, lora, want_hidden=False)
        return out if self.with_head else model.compute_logits(out, forward_batch)

    def forward_with_hidden(self, model: Any, forward_batch: ForwardBatch, lora: Optional[LoraBatchState] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final normed hidden states) of every row, from the one call whether or not it ends with the LM
        head."""
        out, hidden = self._run(model, forward_batch, lora, want_hidden=True)
        return (out if self.with_head else model.compute_logits(hidden, forward_batch)), hidden

    def _run(self, model: Any, forward_batch: ForwardBatch, lora: Optional[LoraBatchState], want_hidden: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stack's output: logits with the head, else the hidden states; the final normed hidden states). With
        `layers_to_capture` on the backbone its `aux_hidden_states` is set as LlamaModel.forward sets it."""
        slots = None
        if forward_batch.lora_ids is not None:
            assert lora is not None, "a batch with adapter rows needs the LoRA state"
            slots = self.lora_slots.row_slots(lora, forward_batch.lora_ids)
        elif lora is not None:
            self.lora_slots.sync(lora)
        backbone = model.model
        capture = list(getattr(backbone, "layers_to_capture", ()))
        # Without the head the step's output is the hidden states; with it the capturing call returns them too.
        captures = bool(capture) or (want_hidden and self.with_head)
        tail = (forward_batch.out_cache_loc, forward_batch.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.rows_share_sequences, slots)
        inputs: tuple[torch.Tensor, ...]
        if self.from_tokens:
            inputs = (forward_batch.input_ids, forward_batch.positions)
            method = "forward_tokens"
        else:
            hidden_states, (cos, sin) = backbone.embed(forward_batch.input_ids, forward_batch.positions)
            batch = hidden_states.shape[0]  # cos/sin: [B, 1, rotary_dim]
            inputs = (hidden_states, cos.view(batch, -1), sin.view(batch, -1))
            method = "forward"
        if not captures:
            out = getattr(self.stack, method)(*inputs, *tail)
            return out, out
        out, hidden, aux = getattr(self.stack, f"{method}_capture")(*inputs, *tail, capture)
        if capture:
            backbone.aux_hidden_states = aux
        return out, hidden


def _quant_args(module: nn.Module) -> Optional[tuple[torch.Tensor, str, Optional[torch.Tensor]]]:
    method = getattr(module, "linear_method", None)
    if not isinstance(method, GGUFLinearMethod):
        return None
    bias = getattr(module, "bias", None)
    return method.quant_weight.packed, method.quant_weight.qtype, None if bias is None else bias.detach().contiguous()


def why_not_fused(model: Any, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                  max_rows: int) -> Optional[str]:
    """Why the fused step cannot run this model with these K/V buffers, or None when it can."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not layers or not hasattr(backbone, "embed") or not hasattr(model, "compute_logits"):
        return f"{type(model).__name__} is not a Llama-family decoder"
    # A decoder whose layers compute otherwise than Llama's says why (models/llama_variants.py).
    exclusion = getattr(model, "fused_decode_exclusion", None)
    if exclusion:
        return f"{type(model).__name__}: {exclusion}"
    specs = [getattr(getattr(getattr(layer, "self_attn", None), "attn", None), "spec", None) for layer in layers]
    if any(s is not None and (s.sliding_window is not None or s.logit_softcap is not None) for s in specs):
        return (f"{type(model).__name__} has sliding-window or soft-capped attention layers (the step attends to "
                "whole sequences with plain scores)")
    if any(not hasattr(layer.mlp, "gate_up_proj") for layer in layers):
        return f"{type(model).__name__} has mixture-of-experts layers (the step runs dense MLPs only)"
    if get_tp_group().size > 1:
        return "tensor parallelism splits every layer over the ranks (--tp-size > 1)"
    if max_rows <= 0:
        return "--gguf-kernel-max-rows is 0"
    dtype = backbone.norm.weight.dtype  # the model's (its embedding table may be bf16: model_loader/q8_blocks.py)
    if dtype != torch.float32:
        return f"the model runs in {dtype} (the step and the GGUF blocks compute in float32; --dtype float32)"
    if any(t.dtype not in KERNEL_KV_DTYPES or t.device.type != "cpu" for t in [*k_buffers, *v_buffers]):
        return "the KV cache is not float32, bfloat16 or fp8 on CPU"
    if any(_quant_args(m) is None for layer in layers
           for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)):
        return "not every linear layer runs on GGUF Q4_1/Q8_0 blocks"
    eps = backbone.norm.variance_epsilon
    if any(n is not None and n.variance_epsilon != eps for layer in layers for n in (
            layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)):
        return "the layers' RMSNorm epsilons differ"
    if not available():
        return f"the extension is unavailable ({unavailable_reason()})"
    return None


def build_fused_decode(model: Any, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                       max_rows: int) -> Optional[FusedCpuDecode]:
    """A FusedCpuDecode for a Llama-family `model`, or None when it cannot run it (see why_not_fused)."""
    if why_not_fused(model, k_buffers, v_buffers, max_rows) is not None:
        return None
    backbone = model.model
    layers = backbone.layers
    first = layers[0].self_attn
    rotary = backbone.rotary_emb
    stack = _EXTENSION.module().DecodeStack(
        hidden_size=backbone.config.hidden_size, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim, rotary_dim=rotary.rotary_dim,
        intermediate_size=layers[0].mlp.down_proj.in_features, eps=backbone.norm.variance_epsilon,
        scale=first.attn.spec.scaling, final_norm=backbone.norm.weight.detach(),
    )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_quant_args(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        stack.add_layer(*linears[0], *linears[1], *linears[2], *linears[3],
                        *(None if n is None else n.weight.detach() for n in norms))
    stack.set_kv_cache(k_buffers, v_buffers)
    # The step quantizes activations to int8 when the layers' GGUF methods do (the arithmetic plan sets them all).
    method = layers[0].self_attn.qkv_proj.linear_method
    int8 = bool(method.int8_activations)
    stack.set_int8_activations(int8)
    one_term = int(getattr(method, "one_term_rows", 0)) if int8 else 0
    stack.set_one_term_rows(one_term)
    from_tokens = _plain_token_inputs(backbone)
    if from_tokens:
        table = backbone.embed_tokens
        blocks = table.quant_weight if isinstance(table, BlockEmbedding) else None
        if isinstance(blocks, KQuantTable):  # a file's K-quant rows: the step dequantizes the same rows
            stack.set_token_kquant_rows(blocks.packed, KQUANT_TYPES[blocks.qtype], rotary.cos_cache, rotary.sin_cache)
        elif blocks is not None:  # the table held as blocks: the step gathers the same rows
            stack.set_token_blocks(blocks.packed, blocks.n, blocks.qtype, rotary.cos_cache, rotary.sin_cache)
        else:
            stack.set_token_tables(table.weight.detach(), rotary.cos_cache, rotary.sin_cache)
        head = _fusable_head(model, max_rows, int8, one_term)
        if head is not None:
            stack.set_head(*head)
    return FusedCpuDecode(stack, max_rows, int8, from_tokens, stack.has_head() if from_tokens else False, one_term)


def _plain_token_inputs(backbone: Any) -> bool:
    """Whether the first layer's input is embedding rows and RotaryEmbedding.lookup rows (LlamaModel.embed on an
    nn.Embedding, or its table held as blocks, and a plain RoPE table), so the step can build it from the token ids."""
    rotary = backbone.rotary_emb
    return (type(backbone).embed is LlamaModel.embed
            and (type(backbone.embed_tokens) is nn.Embedding or isinstance(backbone.embed_tokens, BlockEmbedding))
            and type(rotary) is RotaryEmbedding and rotary.cos_cache.dtype == torch.float32
            and rotary.cos_cache.is_contiguous() and rotary.sin_cache.is_contiguous())


def _fusable_head(model: Any, max_rows: int, int8: bool, one_term: int) -> Optional[tuple[torch.Tensor, int, str]]:
    """(packed blocks, vocab, qtype) of an LM head the step can end with: GGUF blocks for every batch it runs,
    computed like the layers (same int8 switch and one-term rows), with logits that need no scaling, bias or
    unpadding."""
    processor = getattr(model, "logits_processor", None)
    method = getattr(processor, "head_method", None)
    if (not isinstance(method, GGUFLinearMethod) or method.max_rows < max_rows or method.int8_activations != int8
            or (method.one_term_rows if int8 else 0) != one_term):
        return None
    weight = method.quant_weight
    if (processor.logit_scale != 1.0 or weight.n != processor.vocab_size or weight.qtype not in ("Q4_1", "Q8_0")
            or getattr(getattr(model, "lm_head", None), "bias", None) is not None):
        return None
    return weight.packed, weight.n, weight.qtype

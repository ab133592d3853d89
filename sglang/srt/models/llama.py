"""Llama-style decoder (pre-norm, RoPE, GQA, SwiGLU); Qwen2 and Qwen3 reuse it with a few switches.

Parameter names mirror the Hugging Face checkpoints except that q/k/v and gate/up are fused into `qkv_proj`
and `gate_up_proj`; `load_weights` slices checkpoint tensors into those fused matrices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.distributed.partition import head_partition
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import merged_linear, row_parallel_linear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_, get_rope
from sglang.srt.layers.vocab_parallel_embedding import lm_head, vocab_embedding
from sglang.srt.model_loader.weights import load_checkpoint_weights

CosSin = tuple[torch.Tensor, torch.Tensor]
# (config, layer_id, dtype, device) -> the MLP of that decoder layer, or None for the dense LlamaMLP.
MlpFactory = Callable[[Any, int, Optional[torch.dtype], Optional[torch.device | str]], Optional[nn.Module]]

@dataclass(frozen=True)
class DecoderOptions:
    """The differences between the families that share this decoder."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        dtype: Optional[torch.dtype],
        device: Optional[torch.device | str],
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"Unsupported hidden_act {hidden_act!r}; only 'silu' is supported")
        self.gate_up_proj = merged_linear(
            hidden_size, [("gate_proj", intermediate_size), ("up_proj", intermediate_size)], bias, dtype, device
        )
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias, dtype, device)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activation(x))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """As forward, with down_proj's output in its compute dtype (bf16 for a float32 model's bf16 GEMM), for the
        residual add of the decoder layer, which reads it."""
        return self.down_proj.forward_native(self._activation(x))

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        # A float32 model's bf16 GEMM (layers/bf16_linear.py) hands its bf16 output on: the activation reads it
        # and writes bf16, which is what down_proj's bf16 GEMM multiplies (no float32 round trip in between).
        gate_up = self.gate_up_proj.forward_native(x)
        return self.act_fn(gate_up, float32_math=gate_up.dtype != self.gate_up_proj.weight.dtype)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        rotary_dim: int,
        options: DecoderOptions,
        dtype: Optional[torch.dtype],
        device: Optional[torch.device | str],
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        # This rank's heads: tensor parallelism splits the K/V heads as evenly as possible over the ranks, each
        # with its group of query heads (distributed/partition.py); q/k/v rows and o_proj columns follow them.
        tp = get_tp_group()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        heads = head_partition(total_heads, total_kv_heads, tp.size, tp.rank)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = merged_linear(
            hidden_size,
            [("q_proj", total_heads * self.head_dim), ("k_proj", total_kv_heads * self.head_dim),
             ("v_proj", total_kv_heads * self.head_dim)],
            options.qkv_bias,
            dtype,
            device,
            slices=heads.row_slices(self.head_dim),
        )
        self.o_proj = row_parallel_linear(total_heads * self.head_dim, hidden_size, options.o_proj_bias, dtype,
                                          device, cols=(heads.q_start * self.head_dim, self.q_size))
        if options.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, eps, dtype=dtype, device=device)
            self.k_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, cos_sin: CosSin, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        num_tokens = qkv.shape[0]
        qk_end = self.q_size + self.kv_size
        cos, sin = cos_sin
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_end].view(num_tokens, self.num_kv_heads, self.head_dim))
            q = apply_rotary_emb(q, cos, sin, self.rotary_dim)
            k = apply_rotary_emb(k, cos, sin, self.rotary_dim)
        else:
            # q and k are adjacent in the fused output: rotate both head groups in one pass, in place where the
            # compiled kernel can (qkv is this layer's own fresh output).
            qk = qkv[:, :qk_end].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rotary_emb_(qk, cos, sin, self.rotary_dim)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        # o_proj's output in its compute dtype (bf16 for a float32 model's bf16 GEMM): the decoder layer's residual
        # add reads it.
        return self.o_proj.forward_native(self.attn(q, k, v, forward_batch))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        rotary_dim: int,
        options: DecoderOptions,
        dtype: Optional[torch.dtype],
        device: Optional[torch.device | str],
        mlp: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary_dim, options, dtype, device)
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            options.mlp_bias,
            dtype,
            device,
        )
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(
        self,
        cos_sin: CosSin,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm writes the dtype the projection after it multiplies in (bf16 into a float32 model's bf16 GEMM);
        # the projections before the residual adds return theirs (the adds read bf16), so a layer of the bf16 GEMM
        # path converts nothing between its kernels.
        rows = hidden_states.shape[0]
        attn_in = self.self_attn.qkv_proj.input_dtype(rows)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states, out_dtype=attn_in)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual, out_dtype=attn_in)
        hidden_states = self.self_attn(cos_sin, hidden_states, forward_batch)
        if isinstance(self.mlp, LlamaMLP):
            mlp_in = self.mlp.gate_up_proj.input_dtype(rows)
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual, out_dtype=mlp_in)
            return self.mlp.forward_native(hidden_states), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def run_layers(layers: nn.ModuleList, norm: RMSNorm, hidden_states: torch.Tensor, cos_sin: CosSin,
               forward_batch: ForwardBatch, capture: tuple[int, ...] = (),
               captured: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """The decoder layers, then the final norm over the residual stream. For each index in `capture` (ascending),
    the residual stream entering that layer is appended to `captured` (EAGLE3 drafts from them)."""
    residual: Optional[torch.Tensor] = None
    for i, layer in enumerate(layers):
        if i in capture:
            assert captured is not None
            # Layer 0's input becomes the residual, which the norms add into in place: capture a copy.
            captured.append(hidden_states.clone() if residual is None else hidden_states + residual)
        hidden_states, residual = layer(cos_sin, hidden_states, forward_batch, residual)
    if residual is None:
        return norm(hidden_states)
    hidden_states, _ = norm(hidden_states, residual)
    return hidden_states


class LlamaModel(nn.Module):
    """The backbone: embeddings, decoder layers and the final norm."""

    def __init__(
        self,
        config: Any,
        options: DecoderOptions,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
        mlp_factory: Optional[MlpFactory] = None,
        rotary_emb: Optional[RotaryEmbedding] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        # A model with its own position scheme (multimodal M-RoPE) passes its rotary embedding in.
        self.rotary_emb: RotaryEmbedding = rotary_emb or get_rope(config, head_dim_of(config), device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb.rotary_dim, options, dtype, device,
                              mlp_factory(config, i, dtype, device) if mlp_factory is not None else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        # Layers whose input (the residual stream) each forward captures, concatenated in `aux_hidden_states`
        # [num_tokens, len * hidden_size] (speculative/eagle3_head.py sets them); none by default.
        self.layers_to_capture: tuple[int, ...] = ()
        self.aux_hidden_states: Optional[torch.Tensor] = None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, CosSin]:
        """Token embeddings and the rotary (cos, sin) of each position: the inputs of the first layer."""
        hidden_states = self.embed_tokens(input_ids)
        if hidden_states.dtype != self.norm.weight.dtype:  # a bf16 table under a float32 model (q8_blocks.py)
            hidden_states = hidden_states.to(self.norm.weight.dtype)
        # One table lookup per forward, shared by every layer.
        return hidden_states, self.rotary_emb.lookup(positions, hidden_states.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden_states, cos_sin = self.embed(input_ids, positions)
        if not self.layers_to_capture:
            return run_layers(self.layers, self.norm, hidden_states, cos_sin, forward_batch)
        captured: list[torch.Tensor] = []
        out = run_layers(self.layers, self.norm, hidden_states, cos_sin, forward_batch, self.layers_to_capture,
                         captured)
        self.aux_hidden_states = torch.cat(captured, dim=-1)
        return out


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        super().__init__()
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in layer_types:
            raise ValueError("Sliding-window attention layers are not supported")
        self.config = config
        self.model = LlamaModel(config, self.decoder_options(config), dtype=dtype, device=device,
                                mlp_factory=self.mlp_factory())
        self.attach_head(config, dtype, device)

    def attach_head(self, config: Any, dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        """The LM head (the input embeddings when tied) and the logits processor, after `self.model` is built."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head: nn.Module = self.model.embed_tokens
        else:
            self.lm_head = lm_head(config.hidden_size, config.vocab_size, dtype, device)
        self.logits_processor = LogitsProcessor(config)

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    @classmethod
    def mlp_factory(cls) -> Optional[MlpFactory]:
        """Builds each decoder layer's MLP; None keeps the dense LlamaMLP everywhere (mixture-of-experts models
        return one that puts an expert block in their sparse layers)."""
        return None

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Final normed hidden states [num_tokens, hidden_size] of every token in the batch."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [num_selected, vocab] for the rows the logits processor selects."""
        return self.logits_processor(hidden_states, self.lm_head.weight, forward_batch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.compute_logits(self.model(input_ids, positions, forward_batch), forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}
        load_checkpoint_weights(self, weights, tied_aliases=aliases)


EntryClass = LlamaForCausalLM

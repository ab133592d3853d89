"""GPT-OSS (gpt-oss-20b / gpt-oss-120b): a pre-norm MoE decoder with attention sinks and alternating windows.

What differs from the Llama decoder (as transformers' GptOss computes it):
- q/k/v and o projections all carry biases; each head has a learned sink logit (`self_attn.sinks`) that joins
  its softmax denominator and contributes no value (layers/attention/masked.py runs those layers);
- the layers marked "sliding_attention" in `layer_types` attend to the last `sliding_window` positions, the
  others to the whole sequence; the rotary embedding is YaRN as the config says (`rope_scaling`);
- every MLP is a mixture of experts: a router with a bias picks the top-k logits and weights them by a softmax
  over those k only; each expert computes `gate_up = x @ W + b` with gate and up interleaved along the columns,
  a clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max=limit)`,
  and `down = h @ W2 + b2`. The expert weights keep transformers' [E, in, out] layout (`experts.gate_up_proj`,
  `experts.down_proj` and their biases).

Published checkpoints store the expert weights in MXFP4 (`*_blocks` + `*_scales`): they are dequantized at load to
the checkpoint's dtype (model_loader/mxfp4.py) and served densely; float checkpoints load as they are.

Under tensor parallelism each rank holds its attention heads (q/k/v rows and biases, o_proj columns, and those
heads' sinks), the whole router (every rank routes every token alike), and every expert's slice of the intermediate
size: gate/up column pairs [2 * start, 2 * end) (the interleave keeps each gate next to its up), the same down_proj
rows; rank 0 alone adds the down_proj bias, and the ranks' partial outputs are summed with one all_reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.distributed.partition import check_partition_fits, head_partition, partition
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.moe.fused_moe import dispatch_experts
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import apply_rotary_emb_
from sglang.srt.model_loader.dtype import checkpoint_dtype
from sglang.srt.model_loader.mxfp4 import dequantize_mxfp4_weights
from sglang.srt.models.gemma2 import layer_types_of
from sglang.srt.models.llama import CosSin, DecoderOptions, LlamaAttention
from sglang.srt.models.llama_variants import PreNormDecoderLayer, VariantForCausalLM, VariantModel

# transformers' defaults for configs that do not name them
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0

# Checkpoint tensor -> this tensor-parallel rank's part of it (model_loader/weights.py applies them).
Slicers = dict[str, Callable[[torch.Tensor], torch.Tensor]]


def narrowed(t: torch.Tensor, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    """`t`'s [start, start + size) along `dim` when that dimension is the whole model's (`full`); otherwise `t`
    unchanged, so that the copy into the parameter reports the shape mismatch."""
    if t.dim() <= dim or t.shape[dim] != full:
        return t
    return t.narrow(dim, start, size)


class GptOssAttention(LlamaAttention):
    """Llama's attention (fused biased q/k/v, RoPE, GQA) with a per-head sink logit and the layer's window."""

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_dim: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, layer_id, rotary_dim, DecoderOptions(qkv_bias=bias, o_proj_bias=bias), dtype,
                         device)
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=None if window is None else int(window))
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype, device=device), requires_grad=False)
        # this rank's query heads among the checkpoint's (the sinks are per query head)
        tp = get_tp_group()
        total_heads = config.num_attention_heads
        heads = head_partition(total_heads, getattr(config, "num_key_value_heads", None) or total_heads, tp.size,
                               tp.rank)
        self.sink_heads = (total_heads, heads.q_start)

    def checkpoint_slicers(self) -> Slicers:
        """This rank's heads' sinks (q/k/v and o_proj slice themselves, layers/linear.py)."""
        total, start = self.sink_heads
        if self.num_heads == total:
            return {}
        return {"sinks": lambda t: narrowed(t, 0, total, start, self.num_heads)}

    def forward(self, cos_sin: CosSin, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        num_tokens = qkv.shape[0]
        qk_end = self.q_size + self.kv_size
        qk = qkv[:, :qk_end].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary_emb_(qk, cos_sin[0], cos_sin[1], self.rotary_dim)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, forward_batch, sinks=self.sinks))


class GptOssRouter(nn.Module):
    """`mlp.router`: biased logits in the model dtype, the top-k of them, a softmax over those k."""

    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts} (the expert count)")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.num_experts, dtype=dtype, device=device), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids), each [T, top_k]; ids in decreasing order of logit."""
        logits = nn.functional.linear(hidden_states, self.weight, self.bias)
        top_logits, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype), ids


class GptOssExperts(nn.Module):
    """The stacked experts of one layer, with biases and the clamped SwiGLU over interleaved gate/up columns; under
    tensor parallelism this rank's slice of every expert's intermediate size."""

    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.tp = get_tp_group()
        GptOssForCausalLM.check_tensor_parallel(config, self.tp.size)
        experts, hidden = config.num_local_experts, config.hidden_size
        self.full_intermediate_size = config.intermediate_size
        self.intermediate_start, inter = partition(config.intermediate_size, self.tp.size, self.tp.rank)
        self.num_experts = experts
        self.alpha = float(getattr(config, "swiglu_alpha", None) or DEFAULT_SWIGLU_ALPHA)
        self.limit = float(getattr(config, "swiglu_limit", None) or DEFAULT_SWIGLU_LIMIT)

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj = param(experts, hidden, 2 * inter)
        self.gate_up_proj_bias = param(experts, 2 * inter)
        self.down_proj = param(experts, inter, hidden)
        self.down_proj_bias = param(experts, hidden)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(hidden_states[t]) for every token t -> [T, H]."""
        out = dispatch_experts(hidden_states, weights, ids, self.num_experts, self.expert)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def expert(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        # product, then bias: the reference's two roundings (an addmm would accumulate onto the bias)
        gate_up = tokens @ self.gate_up_proj[index] + self.gate_up_proj_bias[index]
        down = self.activation(gate_up) @ self.down_proj[index]
        # the down bias once in the sum over the ranks (each token's routing weight scales it on rank 0)
        return down + self.down_proj_bias[index] if self.tp.rank == 0 else down

    def checkpoint_slicers(self) -> Slicers:
        """This rank's gate/up column pairs and down_proj rows of the checkpoint's stacked [E, in, out] tensors."""
        full, start, size = self.full_intermediate_size, self.intermediate_start, self.down_proj.shape[1]
        if size == full:
            return {}
        return {
            "gate_up_proj": lambda t: narrowed(t, 2, 2 * full, 2 * start, 2 * size),
            "gate_up_proj_bias": lambda t: narrowed(t, 1, 2 * full, 2 * start, 2 * size),
            "down_proj": lambda t: narrowed(t, 1, full, start, size),
        }

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, intermediate_size={self.down_proj.shape[1]}, alpha={self.alpha}, "
                f"limit={self.limit}")


class GptOssMoE(nn.Module):
    def __init__(self, config: Any, layer_id: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.router = GptOssRouter(config, dtype, device)
        self.experts = GptOssExperts(config, dtype, device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(hidden_states)
        get_global_expert_distribution_recorder().on_select_experts(self.layer_id, ids)
        return self.experts(hidden_states, weights, ids)


class GptOssDecoderLayer(PreNormDecoderLayer):
    """Pre-norm attention and MoE, with the Llama layer's (cos_sin, hidden, batch, residual) contract."""

    def __init__(self, config: Any, layer_id: int, layer_type: str, rotary_dim: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_id, layer_type, rotary_dim, dtype, device)
        self.mlp = GptOssMoE(config, layer_id, dtype, device)
        self.attach_norms(config, dtype, device)


class GptOssForCausalLM(VariantForCausalLM):
    fused_decode_exclusion = ("attention sinks, biased projections and mixture-of-experts layers with a clamped "
                              "SwiGLU (the step runs plain Llama layers)")

    @staticmethod
    def check_tensor_parallel(config: Any, tp_size: int) -> None:
        """Every rank needs a share of each expert's intermediate size (the heads are checked as for any family)."""
        check_partition_fits(config.intermediate_size, tp_size, "GPT-OSS expert intermediate size")

    def build_model(self, config: Any, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> VariantModel:
        # Configs without layer_types alternate, the first layer sliding (transformers' default).
        layer_types = layer_types_of(config, 2)
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types names {len(layer_types)} layers, the config has {config.num_hidden_layers}")

        def make_layer(layer_id: int, rotary_dim: int) -> nn.Module:
            return GptOssDecoderLayer(config, layer_id, layer_types[layer_id], rotary_dim, dtype, device)

        return VariantModel(config, make_layer, dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # MXFP4 experts become the checkpoint's float dtype (bf16 as published); the copy into the parameters then
        # converts to the model's dtype as for any other weight.
        dequantized = checkpoint_dtype(self.config) or torch.bfloat16
        super().load_weights(dequantize_mxfp4_weights(weights, dequantized))


EntryClass = GptOssForCausalLM

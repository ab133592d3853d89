"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and a mixture of routed and shared experts.

Attention compresses each token's keys and values into a latent of `kv_lora_rank` channels plus a rotated key part
of `qk_rope_head_dim` channels shared by every head; only that row is cached (mem_cache/mla_kv_pool.py), and
attention runs over it with the up projection `kv_b_proj` absorbed into the queries and outputs
(layers/attention/mla.py). Queries come from `q_proj`, or through the low-rank `q_a_proj` / `q_a_layernorm` /
`q_b_proj` when the config sets `q_lora_rank`. The rotary embedding rotates the rope channels only, in DeepSeek's
interleaved-pair layout (V3: unless `rope_interleave` is off); with YaRN the softmax scale is multiplied by
mscale(factor, mscale_all_dim)^2, as the reference implementation does.

The first `first_k_dense_replace` layers (and those off the `moe_layer_freq` step) keep a dense SwiGLU MLP; the
others route each token to `num_experts_per_tok` of `n_routed_experts` experts and add `n_shared_experts` shared
ones. Routing: softmax scores, top-k over all experts (`greedy`) or over the experts of the best `topk_group` of
`n_group` groups (`group_limited_greedy`, a group scored by its best expert); V3's `noaux_tc` scores with a sigmoid,
chooses with a per-expert correction bias added (a group scored by its two best) and weights by the unbiased
scores. Weights are renormalized with `norm_topk_prob` and multiplied by `routed_scaling_factor`, in float32, from
a float32 router as transformers keeps it.

Tensor parallelism splits the attention heads over the ranks (each rank's query rows, `kv_b_proj` rows and `o_proj`
input columns; the latent projection and the cache of the latent are the same on every rank, as every head reads
the whole latent), and the MLPs and experts over their intermediate size (layers/moe/fused_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.distributed.partition import head_partition
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.attention.mla import LatentAttention, deinterleave_pairs
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ColumnParallelLinear, Linear, check_full_rows, row_parallel_linear
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.layers.rotary_embedding import _yarn_mscale, apply_rotary_emb, rope_parameters_from_config
from sglang.srt.models.llama import CosSin, LlamaMLP
from sglang.srt.models.llama_variants import PreNormDecoderLayer, VariantForCausalLM, VariantModel
from sglang.srt.models.moe_common import check_silu

# The reference implementation normalizes the q and kv latents with its RMSNorm's default epsilon.
LATENT_NORM_EPS = 1e-6
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_softmax_scale(config: Any, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope with `mscale_all_dim`."""
    scale = qk_head_dim**-0.5
    params = rope_parameters_from_config(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= _yarn_mscale(float(params.get("factor") or 1.0), mscale_all_dim) ** 2
    return scale


def head_rows(in_features: int, name: str, per_head: int, heads: int, first: int, count: int,
              dtype: Optional[torch.dtype], device: Optional[torch.device | str]) -> Linear:
    """A projection to `per_head` rows for each of `heads` heads; under tensor parallelism this rank's heads' rows
    (heads first .. first + count) only, loaded from the checkpoint's `name`."""
    tp = get_tp_group()
    if tp.size == 1:
        return Linear(in_features, heads * per_head, False, dtype, device)
    return ColumnParallelLinear(in_features, [(name, heads * per_head)], False, dtype, device, tp,
                                [(first * per_head, count * per_head)])


def is_moe_layer(config: Any, layer_id: int) -> bool:
    """Experts from layer `first_k_dense_replace` on, in every `moe_layer_freq`-th layer (as SGLang counts them)."""
    if not getattr(config, "n_routed_experts", None) or layer_id < (config.first_k_dense_replace or 0):
        return False
    return layer_id % (getattr(config, "moe_layer_freq", 1) or 1) == 0


class DeepseekV2Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        hidden, all_heads = config.hidden_size, config.num_attention_heads
        tp = get_tp_group()
        part = head_partition(all_heads, all_heads, tp.size, tp.rank)
        first, heads = part.q_start, part.num_heads
        self.num_heads = heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj: Optional[Linear] = None
        self.q_a_proj: Optional[Linear] = None
        self.q_a_layernorm: Optional[RMSNorm] = None
        self.q_b_proj: Optional[Linear] = None
        if config.q_lora_rank is None:
            self.q_proj = head_rows(hidden, "q_proj", qk_head_dim, all_heads, first, heads, dtype, device)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias, dtype, device)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
            self.q_b_proj = head_rows(config.q_lora_rank, "q_b_proj", qk_head_dim, all_heads, first, heads, dtype,
                                      device)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
        # A plain nn.Linear: attention reads its weight as the absorbed W_UK / W_UV and never runs it as a layer, so
        # the loader gives it no other linear method (blocks, reduced-precision copies).
        kv_b_per_head = self.qk_nope_head_dim + config.v_head_dim
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * kv_b_per_head, bias=False, dtype=dtype, device=device)
        # this rank's heads' rows of the checkpoint's kv_b_proj: (first row, rows, the checkpoint's rows)
        self.kv_b_rows = (first * kv_b_per_head, heads * kv_b_per_head, all_heads * kv_b_per_head)
        self.o_proj = row_parallel_linear(all_heads * config.v_head_dim, hidden, bias, dtype, device,
                                          cols=(first * config.v_head_dim, heads * config.v_head_dim))
        self.interleaved_rope = bool(getattr(config, "rope_interleave", True))
        self.attn = LatentAttention(layer_id, heads, self.qk_nope_head_dim, config.v_head_dim, self.kv_lora_rank,
                                    self.qk_rope_head_dim, yarn_softmax_scale(config, qk_head_dim))

    def checkpoint_slicers(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Under tensor parallelism, this rank's heads' rows of the checkpoint's kv_b_proj."""
        first, rows, full = self.kv_b_rows
        if rows == full:
            return {}

        def kv_b(t: torch.Tensor) -> torch.Tensor:
            check_full_rows(t, full, "kv_b_proj.weight")
            return t.narrow(0, first, rows)

        return {"kv_b_proj.weight": kv_b}

    def _rotate(self, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
        if self.interleaved_rope:
            x = deinterleave_pairs(x)
        return apply_rotary_emb(x, cos_sin[0], cos_sin[1], self.qk_rope_head_dim)

    def forward(self, cos_sin: CosSin, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden_states)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim],
                                                                     dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                                    dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe = self._rotate(q_pe, cos_sin)
        k_pe = self._rotate(k_pe.unsqueeze(1), cos_sin).squeeze(1)
        out = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, forward_batch)
        return self.o_proj(out)


class DeepseekRouter(nn.Module):
    """The router of a sparse layer (`mlp.gate`): float32 logits, then the config's top-k method."""

    def __init__(self, config: Any, device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        default_method = "noaux_tc" if getattr(config, "model_type", "") == "deepseek_v3" else "greedy"
        self.method = getattr(config, "topk_method", None) or default_method
        if self.method not in TOPK_METHODS:
            raise ValueError(f"Unsupported topk_method {self.method!r}; supported: {', '.join(TOPK_METHODS)}")
        self.sigmoid_scores = self.method == "noaux_tc" or getattr(config, "scoring_func", "softmax") == "sigmoid"
        self.num_groups = getattr(config, "n_group", None) or 1
        self.topk_group = getattr(config, "topk_group", None) or self.num_groups
        if self.num_experts % self.num_groups or not 0 < self.topk_group <= self.num_groups:
            raise ValueError(f"n_group={self.num_groups} must divide n_routed_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} be in 1..n_group")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts} (the expert count)")
        self.renormalize = bool(getattr(config, "norm_topk_prob", False)) and self.top_k > 1
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32,
                                               device=device), requires_grad=False)
        self.e_score_correction_bias: Optional[nn.Parameter] = None
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(self.num_experts, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> TopKOutput:
        logits = F.linear(hidden_states.float(), self.weight)
        scores = logits.sigmoid() if self.sigmoid_scores else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.method != "greedy" and self.num_groups > 1:
            groups = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = (groups.topk(2, dim=-1).values.sum(dim=-1) if self.method == "noaux_tc"
                            else groups.max(dim=-1).values)
            best_groups = torch.topk(group_scores, self.topk_group, dim=-1).indices
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            kept = kept.repeat_interleave(self.num_experts // self.num_groups, dim=1)
            choice = choice.masked_fill(~kept, float("-inf") if self.method == "noaux_tc" else 0.0)
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return TopKOutput(weights * self.routed_scaling_factor, ids)


class DeepseekV2MoE(nn.Module):
    """Routed experts (stacked, layers/moe/fused_moe.py) plus the shared experts every token goes through."""

    def __init__(self, config: Any, layer_id: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        check_silu(config)
        self.layer_id = layer_id
        self.gate = DeepseekRouter(config, device)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, dtype,
                                device)
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (LlamaMLP(config.hidden_size, config.moe_intermediate_size * shared, "silu", False,
                                        dtype, device) if shared else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk = self.gate(hidden_states)
        get_global_expert_distribution_recorder().on_select_experts(self.layer_id, topk.ids)
        output = self.experts(hidden_states, topk)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """Pre-norm attention and MLP, with the Llama layer's (cos_sin, hidden, batch, residual) contract."""

    def __init__(self, config: Any, layer_id: int, dtype: Optional[torch.dtype],
                 device: Optional[torch.device | str]) -> None:
        super().__init__()
        self.self_attn = DeepseekV2Attention(config, layer_id, dtype, device)
        self.mlp: nn.Module = (
            DeepseekV2MoE(config, layer_id, dtype, device) if is_moe_layer(config, layer_id)
            else LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                          bool(getattr(config, "mlp_bias", False)), dtype, device)
        )
        self.attach_norms(config, dtype, device)


class DeepseekV2ForCausalLM(VariantForCausalLM):
    fused_decode_exclusion = ("multi-head latent attention (the step runs Llama attention over full K/V heads, "
                              "this model caches one latent row per token)")

    def __init__(self, config: Any, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device | str] = None) -> None:
        super().__init__(config, dtype, device)
        # What each token caches per layer (model_executor/model_runner.kv_cache_spec sizes the pool from it).
        self.kv_latent_dim = config.kv_lora_rank + config.qk_rope_head_dim

    def build_model(self, config: Any, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> VariantModel:
        model = VariantModel(config, lambda i, _rotary_dim: DeepseekV2DecoderLayer(config, i, dtype, device),
                             dtype, device)
        if model.rotary_emb.rotary_dim != config.qk_rope_head_dim:
            raise ValueError(f"the rotary embedding rotates {model.rotary_emb.rotary_dim} channels, the config's "
                             f"qk_rope_head_dim is {config.qk_rope_head_dim} (head_dim must equal it)")
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # V3 checkpoints carry their multi-token-prediction layers after the decoder's (num_nextn_predict_layers):
        # next-token serving does not run them.
        layers = self.config.num_hidden_layers
        super().load_weights((name, tensor) for name, tensor in weights if _layer_index(name) < layers)


def _layer_index(name: str) -> int:
    """N of a `model.layers.N.` weight name; -1 for the weights outside the decoder layers."""
    parts = name.split(".", 3)
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's layout: the same attention; routing by `noaux_tc` (sigmoid scores, correction bias) by default."""


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]

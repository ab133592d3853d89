"""Which code runs a decode step, decided once at startup and logged in one line.

A decode batch of B sequences runs one of two ways:

- the fused CPU decode step (model_executor/fused_cpu_decode.py), when B <= --gguf-kernel-max-rows and the model
  qualifies: a Llama-family decoder whose every linear layer runs on GGUF Q4_1 / Q8_0 blocks, a float32 KV cache
  on CPU, the compiled extension built and SGLANG_DISABLE_FUSED_DECODE unset;
- otherwise layer by layer: the model's own forward, each linear through its LinearMethod (layers/linear.py) and
  attention through the attention backend.

`plan_decode` makes that choice and describes it, including the linear methods and the attention kernel the
layer-by-layer path uses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers import cpu_ops
from sglang.srt.layers.attention.base import AttentionBackend
from sglang.srt.layers.linear import Linear
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_executor.fused_cpu_decode import FusedCpuDecode, build_fused_decode, why_not_fused
from sglang.srt.model_loader.dtype import dtype_name


@dataclass(frozen=True)
class DecodePlan:
    fused: Optional[FusedCpuDecode]
    description: str


def describe_linear_methods(model: nn.Module) -> str:
    counts = Counter(m.linear_method.describe() for m in model.modules() if isinstance(m, Linear))
    head = getattr(getattr(model, "logits_processor", None), "head_method", None)
    parts = [f"{n} x {name}" for name, n in counts.most_common()]
    expert_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if expert_layers:  # experts are not Linear layers: dense in the model dtype, or their blocks (moe_blocks.py)
        parts.append(f"{len(expert_layers)} x {expert_layers[0].num_experts} stacked experts, "
                     f"{expert_layers[0].describe()}")
    if head is not None:
        parts.append(f"LM head {head.describe()}")
    return ", ".join(parts) or "none"


def describe_attention(attn_backend: AttentionBackend, device: torch.device) -> str:
    kernel = ("compiled CPU paged decode kernel" if device.type == "cpu" and cpu_ops.available()
              else "SDPA over gathered KV")
    return f"{type(attn_backend).__name__} ({kernel} for decode)"


def plan_decode(model: nn.Module, kv_pool: KVPool, attn_backend: AttentionBackend, max_rows: int,
                device: torch.device) -> DecodePlan:
    kv = dtype_name(kv_pool.dtype)
    layer_by_layer = (f"layer by layer (linears: {describe_linear_methods(model)}; "
                      f"attention: {describe_attention(attn_backend, device)}; KV cache {kv})")
    reason = (why_not_fused(model, kv_pool.k_buffer, kv_pool.v_buffer, max_rows) if device.type == "cpu"
              else f"device is {device.type}")
    fused = build_fused_decode(model, kv_pool.k_buffer, kv_pool.v_buffer, max_rows) if reason is None else None
    if fused is None:
        return DecodePlan(None, f"Decode path: every batch {layer_by_layer}; fused CPU decode step off: {reason}")
    return DecodePlan(fused, f"Decode path: batches of 1-{max_rows} sequences run the {fused.name} "
                             f"(sglang/srt/model_executor/fused_cpu_decode.py, KV cache {kv}); "
                             f"larger batches {layer_by_layer}")

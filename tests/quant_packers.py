"""Tiny quantized Llama checkpoints in the GPTQ, AWQ, FP8 and compressed-tensors layouts, packed by the published
rules written out here (independently of the engine's loader), each layer with its reference dequantized weight.

Every layer is made from random integer values, zero points and scales (random fp8 values for FP8), so each format
is exercised over its whole value range; the reference weight is the published formula applied to those values:
GPTQ `(q - (stored_zero + 1)) * scale[g_idx]` (v1; v2 without the + 1), AWQ `(q - zero) * scale` by group of
input rows, FP8 `weight * scale` (per tensor, row or 128 x 128 block, in float32 as DeepSeek's reference does),
compressed-tensors `(q - zero_point) * scale`. Integer formats' products are exact in float64, then rounded once to
the checkpoint's dtype, as the formats' own fp16 / bf16 arithmetic rounds them.

Mixture-of-experts models are written as published MoE checkpoints store them: transformers keeps a layer's experts
fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), published checkpoints store each
expert's projections quantized under its own names (`mlp.experts.E.gate_proj`, Mixtral's
`block_sparse_moe.experts.E.w1` / `w3` / `w2`), with the router (`gate`) and Qwen2-MoE's `shared_expert_gate` left
unquantized.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import save_file

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# model_type -> (the per-expert names of the gate, up and down projections, the MoE block's name) in published
# checkpoints, where they are not transformers' own
EXPERT_LAYOUTS = {"mixtral": (("w1", "w3", "w2"), "block_sparse_moe")}
HF_EXPERT_LAYOUT = (("gate_proj", "up_proj", "down_proj"), "mlp")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column word * 8 + AWQ_ORDER[i]
# A layer: (tensors stored under the module's name, reference weight [out, in] in float64 / float32)
Layer = tuple[dict[str, torch.Tensor], torch.Tensor]
LayerMaker = Callable[[int, int, torch.Generator], Layer]


def pack_along(values: torch.Tensor, bits: int, axis: int, order: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """Unsigned `bits`-bit values packed 32 // bits to an int32 word along `axis`: value word * per + order[i] at
    bits [bits * i, bits * (i + 1)) of the word (order: identity unless given); a partial last word zero-filled."""
    v = np.moveaxis(values.numpy().astype(np.int64), axis, 0)
    per = 32 // bits
    assert v.min() >= 0 and v.max() < (1 << bits)
    words = np.zeros((math.ceil(v.shape[0] / per),) + v.shape[1:], dtype=np.int64)
    for word in range(words.shape[0]):
        for i in range(per):
            source = word * per + (order[i] if order else i)
            if source < v.shape[0]:
                words[word] |= v[source] << (bits * i)
    words = np.where(words >= 1 << 31, words - (1 << 32), words).astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, 0, axis)))


def _scales(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=gen) * 0.03 + 0.01


def gptq_layer(bits: int, group_size: int, sym: bool, desc_act: bool, v1: bool) -> LayerMaker:
    def make(out_f: int, in_f: int, gen: torch.Generator) -> Layer:
        maxq = (1 << bits) - 1
        size = in_f if group_size == -1 else group_size
        groups = math.ceil(in_f / size)
        q = torch.randint(0, maxq + 1, (in_f, out_f), generator=gen)
        zero = (torch.full((groups, out_f), 1 << (bits - 1)) if sym
                else torch.randint(0, maxq + 1, (groups, out_f), generator=gen))
        stored_zero = (zero - 1) & maxq if v1 else zero  # v1 stores zero - 1 (a zero of 0 wraps to maxq)
        scales = _scales(gen, groups, out_f).half()
        g_idx = torch.arange(in_f) // size
        if desc_act:
            g_idx = g_idx[torch.randperm(in_f, generator=gen)]
        effective_zero = stored_zero + 1 if v1 else stored_zero
        reference = torch.empty(in_f, out_f, dtype=torch.float64)
        for i in range(in_f):
            g = int(g_idx[i])
            reference[i] = (q[i] - effective_zero[g]).double() * scales[g].double()
        tensors = {"qweight": pack_along(q, bits, 0), "qzeros": pack_along(stored_zero, bits, 1), "scales": scales,
                   "g_idx": g_idx.to(torch.int32)}
        return tensors, reference.t()
    return make


def awq_layer(group_size: int) -> LayerMaker:
    def make(out_f: int, in_f: int, gen: torch.Generator) -> Layer:
        groups = in_f // group_size
        q = torch.randint(0, 16, (in_f, out_f), generator=gen)
        zero = torch.randint(0, 16, (groups, out_f), generator=gen)
        scales = _scales(gen, groups, out_f).half()
        reference = torch.empty(in_f, out_f, dtype=torch.float64)
        for i in range(in_f):
            reference[i] = (q[i] - zero[i // group_size]).double() * scales[i // group_size].double()
        tensors = {"qweight": pack_along(q, 4, 1, AWQ_ORDER), "qzeros": pack_along(zero, 4, 1, AWQ_ORDER),
                   "scales": scales}
        return tensors, reference.t()
    return make


def fp8_layer(kind: str, static_input: bool = False) -> LayerMaker:
    """kind: block (128 x 128 `weight_scale_inv`), tensor or channel (`weight_scale`)."""
    def make(out_f: int, in_f: int, gen: torch.Generator) -> Layer:
        weight = (torch.randn(out_f, in_f, generator=gen) * 2).to(torch.float8_e4m3fn)
        if kind == "block":
            scale = _scales(gen, math.ceil(out_f / 128), math.ceil(in_f / 128))
            full = torch.empty(out_f, in_f)
            for r in range(out_f):
                for c0 in range(0, in_f, 128):
                    full[r, c0 : c0 + 128] = scale[r // 128, c0 // 128]
            tensors = {"weight": weight, "weight_scale_inv": scale}
        else:
            scale = _scales(gen, out_f, 1) if kind == "channel" else _scales(gen, 1)[0]
            full = scale.expand(out_f, in_f)
            tensors = {"weight": weight, "weight_scale": scale}
        if static_input:
            tensors["input_scale"] = torch.tensor(0.05)
        return tensors, weight.to(torch.float32) * full
    return make


def ct_packed_layer(bits: int, strategy: str, group_size: int, symmetric: bool,
                    dtype: torch.dtype = torch.bfloat16) -> LayerMaker:
    """compressed-tensors pack-quantized: signed values stored plus 2^(bits - 1), packed along the input; an
    asymmetric group / channel zero point packed the same way along the output rows."""
    def make(out_f: int, in_f: int, gen: torch.Generator) -> Layer:
        low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        groups = in_f // group_size if strategy == "group" else 1
        q = torch.randint(low, high + 1, (out_f, in_f), generator=gen)
        scale = _scales(gen, out_f, groups).to(dtype)
        zero = torch.zeros(out_f, groups, dtype=torch.int64) if symmetric else torch.randint(
            low, high + 1, (out_f, groups), generator=gen)
        reference = torch.empty(out_f, in_f, dtype=torch.float64)
        for c in range(in_f):
            g = c // group_size if strategy == "group" else 0
            reference[:, c] = (q[:, c] - zero[:, g]).double() * scale[:, g].double()
        offset = 1 << (bits - 1)
        tensors = {"weight_packed": pack_along(q + offset, bits, 1), "weight_scale": scale,
                   "weight_shape": torch.tensor([out_f, in_f])}
        if not symmetric:
            tensors["weight_zero_point"] = pack_along(zero + offset, bits, 0)
        return tensors, reference
    return make


def ct_int8_layer(static_input: bool = True) -> LayerMaker:
    """compressed-tensors int-quantized: int8 weight, one bf16 scale per output channel (W8A8: an input scale)."""
    def make(out_f: int, in_f: int, gen: torch.Generator) -> Layer:
        q = torch.randint(-128, 128, (out_f, in_f), generator=gen).to(torch.int8)
        scale = (_scales(gen, out_f, 1) * 0.1).to(torch.bfloat16)
        tensors = {"weight": q, "weight_scale": scale}
        if static_input:
            tensors["input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        return tensors, q.double() * scale.double()
    return make


def ct_config(fmt: str, weights: dict[str, Any], input_activations: Optional[dict[str, Any]] = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights, "input_activations": input_activations,
                "output_activations": None}}}


# A checkpoint format: (quantization_config, layer packer, checkpoint dtype)
Format = tuple[dict, LayerMaker, torch.dtype]


def gptq_format(bits: int, group: int, sym: bool, desc_act: bool = False, fmt: str = "gptq") -> Format:
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
              "checkpoint_format": fmt}
    return config, gptq_layer(bits, group, sym, desc_act, v1=fmt == "gptq"), torch.float16


def awq_format(group: int) -> Format:
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return config, awq_layer(group), torch.float16


def ct_int4_format(strategy: str, group: int, symmetric: bool) -> Format:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group if strategy == "group" else None, "dynamic": False, "actorder": None}
    return ct_config("pack-quantized", weights), ct_packed_layer(4, strategy, group, symmetric), torch.bfloat16


def published_tensors(hf_model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `hf_model`'s state dict under its name in a published checkpoint, as a view of the model's own
    storage (writing into it sets the model's weight): a fused expert tensor is split into each expert's gate, up and
    down projection [out, in], and Mixtral's MoE block is renamed as its hub checkpoints name it."""
    (gate, up, down), block = EXPERT_LAYOUTS.get(hf_model.config.model_type, HF_EXPERT_LAYOUT)
    for name, param in hf_model.state_dict().items():
        layer, sep, rest = name.partition(".mlp.")
        if sep and (rest.startswith("experts.") or rest == "gate.weight"):  # the MoE block's tensors
            name = f"{layer}.{block}.{rest}"
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and param.dim() == 3 and leaf in ("gate_up_proj", "down_proj"):
            for e in range(param.shape[0]):
                if leaf == "down_proj":
                    yield f"{prefix}.{e}.{down}.weight", param[e]
                else:
                    gate_rows, up_rows = param[e].chunk(2)
                    yield f"{prefix}.{e}.{gate}.weight", gate_rows
                    yield f"{prefix}.{e}.{up}.weight", up_rows
        else:
            yield name, param


def write_quantized_checkpoint(directory: Path, hf_model: Any, quantization_config: dict, make_layer: LayerMaker,
                               dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save `hf_model` as a quantized checkpoint in `directory` (two shards: each quantized weight's scales and zero
    points in the other file than its packed values) and set `hf_model`'s weights to the values the checkpoint
    holds (reference dequantized linears, everything else rounded to `dtype`). Returns each linear's reference
    weight rounded to `dtype`, by its float checkpoint name (an MoE expert's by its published per-expert name)."""
    gen = torch.Generator().manual_seed(seed)
    shards: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    references: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in published_tensors(hf_model):
            module, _, leaf = name.rpartition(".")
            if module.rsplit(".", 1)[-1] in LINEAR_NAMES and leaf == "weight":
                tensors, reference = make_layer(param.shape[0], param.shape[1], gen)
                references[name] = reference.to(dtype)
                param.copy_(references[name].float())
                for key, tensor in tensors.items():
                    primary = key in ("qweight", "weight", "weight_packed")
                    shards[0 if primary else 1][f"{module}.{key}"] = tensor.contiguous()
            else:
                stored = param.to(dtype)
                param.copy_(stored.float())
                shards[0][name] = stored.contiguous()
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf_model.config.save_pretrained(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(dtype=dtype_name, torch_dtype=dtype_name, quantization_config=quantization_config)
    config_path.write_text(json.dumps(config, indent=2))
    return references

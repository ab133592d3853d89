"""How a GGUF file's tensors become the converted checkpoint's (model_loader/gguf_convert.py): renamed and put in
transformers' layout by its per-architecture tensor processors (Q/K row order, MoE experts gathered), the tensors
those do not know placed here (GPT-OSS's experts, DeepSeek's split kv_b_proj), and the block tensors left in the file
(model_loader/gguf_deferred.py) recorded with their row order instead of being dequantized."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.model_loader.gguf_configs import KEY_BUILT
from sglang.srt.model_loader.gguf_deferred import Deferrals

if TYPE_CHECKING:
    from sglang.srt.model_loader.gguf_convert import ShardWriter


def stream_tensors(reader: Any, architecture: str, config: Any, skeleton, writer: ShardWriter,
                    deferrals: Optional[Deferrals] = None) -> None:
    """Dequantize the file's tensors one at a time, rename them as transformers' GGUF loader does (its per-
    architecture tensor processors: Q/K row order, MoE experts gathered; GPT-OSS's experts and DeepSeek's split
    kv_b_proj here: _file_part), and hand each to `writer`."""
    from collections import Counter

    import numpy as np
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    arch = processor_arch(architecture)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    # transformers finds the file's tensor names by the config's model type, which for DeepSeek is not the arch
    mapping = get_gguf_hf_weights_map(skeleton, processor, model_type=architecture if architecture in KEY_BUILT
                                      else None)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    for name in shapes:  # V3's expert correction bias, which the file stores as a bias of its own tensor
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            mapping[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = name
    # A gathered tensor (MoE experts: ffn_gate_exps and ffn_up_exps fill one gate_up_proj) is written once every
    # file tensor mapped to it has been read; writing it earlier would store the half read so far.
    parts = Counter(mapping.values())
    seen: Counter = Counter()
    gathered: dict = {}  # where the MoE processors gather expert tensors
    parsed = {"config": config.to_dict(), "tensors": gathered}
    # `deferrals`: block tensors stay in the file (model_loader/gguf_deferred.py), the Llama processor's Q / K rows
    # put back in the checkpoint's order when read, each checked against the converted tensor here
    heads = ((config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
             if arch == "llama" else ())
    for tensor in reader.tensors:
        target = mapping.get(tensor.name.removesuffix(".weight"))
        counted = target if target is not None else mapping.get(tensor.name)  # the parameter this tensor is part of
        experts = (deferrals.expert_parts(tensor.name, target)
                   if deferrals is not None and arch in _GATHERS_EXPERTS else None)
        if experts is not None and target is not None:  # the processor's layout: gate rows, then up rows
            deferrals.defer(target, experts)
            seen[target] += 1
            continue
        if (deferrals is not None and not _places_itself(architecture, tensor.name)
                and deferrals.block_typed(tensor.name)):
            rows = _rows_processed(processor, tensor, mapping, parsed["config"])
            if rows is not None and deferrals.defer_rows(rows[0], tensor.name, rows[1], shapes.get(rows[0]),
                                                         int(tensor.shape[0]), heads):
                seen[counted] += 1
                continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        placed = _file_part(architecture, tensor.name, weights, shapes, config, gathered)
        if placed is not None:
            parts[placed[0]] = placed[1]
            seen[placed[0]] += 1
        else:
            result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                       parsed_parameters=parsed)
            if result.name in mapping:
                name = mapping[result.name]
                value = torch.from_numpy(np.copy(result.weights))
                want = shapes.get(name)
                if want is not None and tuple(value.shape) != want and value.numel() == int(np.prod(want)):
                    # transformers adds a leading axis to Qwen2-MoE's shared-expert gate, which llama.cpp's
                    # converter already writes as [1, hidden]: the parameter's own shape holds the same values
                    value = value.reshape(want)
                if deferrals is None or not deferrals.defer_matrix(name, tensor.name, weights, value.numpy(),
                                                                   heads):
                    writer.add(name, value)
            seen[counted] += 1
        for name in [n for n in gathered if n not in parts or seen[n] >= parts[n]]:
            writer.add(name, gathered.pop(name))
    if gathered:
        raise ValueError(f"GGUF tensors missing a part (experts' gate or up, DeepSeek's k_b or v_b): "
                         f"{sorted(gathered)}")
    if deferrals is not None:
        deferrals.write(writer.out_dir)


# the tensor processors that gather the file's stacked experts into `gate_up_proj` / `down_proj`
_GATHERS_EXPERTS = ("qwen2moe", "qwen3moe")


# transformers' tensor processor for the architectures it has none for: the Llama path's Q/K rows (Granite and
# SmolLM3 are converted as Llama models), gathered experts (DeepSeek)
_PROCESSOR_OF = {"granite": "llama", "smollm3": "llama", "deepseek2": "qwen2moe"}


def processor_arch(architecture: str) -> str:
    """The architecture whose transformers tensor processor reads a file of `architecture`."""
    return _PROCESSOR_OF.get(architecture, architecture)


def _rows_processed(processor: Any, tensor: Any, mapping: dict, config: dict) -> Optional[tuple[str, Any]]:
    """(the checkpoint tensor, the file row each of its rows is) where the tensor processor renames a 2-D tensor of the
    file and at most reorders its rows, learnt by processing a column of row numbers in place of the dequantized
    tensor (gguf's numpy dequantization reads ~40-80 MB of blocks a second: most of a large file's conversion); None
    where the processor does anything else with it, which the caller then dequantizes and processes as it is."""
    import numpy as np

    if tensor.data.ndim != 2:
        return None
    rows = int(tensor.data.shape[0])
    numbers = np.arange(rows, dtype=np.float32).reshape(rows, 1)  # exact up to 2^24 rows
    scratch: dict = {"config": config, "tensors": {}}  # a processor that stores tensors aside is not followed
    try:
        result = processor.process(weights=numbers, name=tensor.name, tensor_key_mapping=mapping,
                                   parsed_parameters=scratch)
    except Exception:  # a processor that needs the real columns: the full path runs it (and raises its errors)
        return None
    if scratch["tensors"] or result.name not in mapping:
        return None
    order = np.asarray(result.weights)
    if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), numbers[:, 0]):
        return None
    return mapping[result.name], order[:, 0].astype(np.int64)


def _places_itself(architecture: str, name: str) -> bool:
    """Whether `_file_part` places the file tensor `name` (transformers' processors do not know it)."""
    block, _, rest = name.partition(".")
    role = rest.partition(".")[2]
    return block == "blk" and ((architecture == "gpt-oss" and role in _GPT_OSS_PARTS)
                                or (architecture == "deepseek2" and role in ("attn_k_b.weight", "attn_v_b.weight")))


def _file_part(architecture: str, name: str, weights, shapes: dict, config: Any,
               gathered: dict) -> Optional[tuple[str, int]]:
    """Put a tensor of the file that transformers' processors do not know, in transformers' layout, into
    `gathered`; returns (the parameter it went to, how many file tensors make that parameter), None for the
    others."""
    if not _places_itself(architecture, name):
        return None
    layer, _, role = name.partition(".")[2].partition(".")
    if architecture == "gpt-oss":
        return _gpt_oss_part(layer, role, weights, shapes, gathered)
    return _deepseek_kv_b_part(layer, role, weights, config, gathered)


def _deepseek_kv_b_part(layer: str, role: str, weights, config: Any, gathered: dict) -> tuple[str, int]:
    """DeepSeek's kv_b_proj [heads * (qk_nope + v), kv_lora_rank], which llama.cpp's converter splits per head for
    its absorbed attention: attn_k_b [heads, kv_lora_rank, qk_nope] (the key rows transposed) and attn_v_b [heads,
    v, kv_lora_rank]. (Older files hold kv_b_proj whole as attn_kv_b: transformers' name map reads it.)"""
    import numpy as np
    import torch

    nope, v_dim = config.qk_nope_head_dim, config.v_head_dim
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    target = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    whole = gathered.setdefault(target, torch.zeros(heads * (nope + v_dim), rank)).view(heads, nope + v_dim, rank)
    value = torch.from_numpy(np.copy(weights))
    if role == "attn_k_b.weight":
        whole[:, :nope] = value.transpose(1, 2)
    else:
        whole[:, nope:] = value
    return target, 2


# GPT-OSS tensors as llama.cpp's converter writes them (transformers' GGUF processor expects other names):
# file role -> (transformers parameter under the layer, column of the gate/up interleave or None, transposed).
# llama.cpp stores gate and up apart as [experts, intermediate, hidden] and down as [experts, hidden, intermediate];
# transformers holds gate_up_proj [experts, hidden, 2 * intermediate], gate and up interleaved by column, and
# down_proj [experts, intermediate, hidden].
_GPT_OSS_PARTS = {
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", 0, True),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", 1, True),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", None, True),
    "ffn_gate_exps.bias": ("mlp.experts.gate_up_proj_bias", 0, False),
    "ffn_up_exps.bias": ("mlp.experts.gate_up_proj_bias", 1, False),
    "ffn_down_exps.bias": ("mlp.experts.down_proj_bias", None, False),
    "attn_sinks.weight": ("self_attn.sinks", None, False),
}


def _gpt_oss_part(layer: str, role: str, weights, shapes: dict, gathered: dict) -> tuple[str, int]:
    """A GPT-OSS expert tensor or sink of the file (one of _GPT_OSS_PARTS) into `gathered`, in transformers'
    layout."""
    import numpy as np
    import torch

    target, column, transposed = _GPT_OSS_PARTS[role]
    target = f"model.layers.{layer}.{target}"
    value = torch.from_numpy(np.copy(weights))
    value = value.transpose(-1, -2) if transposed else value
    if column is None:
        gathered[target] = value.contiguous()
        return target, 1
    gathered.setdefault(target, torch.zeros(shapes[target]))[..., column::2] = value
    return target, 2

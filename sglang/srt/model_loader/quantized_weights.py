"""Stream a quantized checkpoint's tensors with every quantized linear weight dequantized, one weight at a time.

A quantized linear layer `P` is stored as several tensors (GPTQ / AWQ: `P.qweight`, `P.qzeros`, `P.scales`,
`P.g_idx`; FP8: `P.weight` with `P.weight_scale` or `P.weight_scale_inv`; compressed-tensors: `P.weight_packed` or
`P.weight`, with `P.weight_scale`, `P.weight_zero_point`, `P.weight_shape`, `P.weight_g_idx`), possibly spread over
several shard files. All names are listed first (safetensors headers only) and checked: every quantized weight has
the tensors it needs, no scale is left without its weight. Then, in file order, each quantized weight is read with
its companions, dequantized (model_loader/dequantize.py), rounded to the checkpoint's dtype and yielded as `P.weight`;
every other tensor passes through as it is stored. Only one weight is ever held dequantized, and each tensor is read
through a mapping of its file that lives as long as the tensor, so that the load does not keep every page of the
checkpoint it has read mapped. Where the model may be served from blocks made of the integers, they are made from
each weight as it is read (`made`, model_loader/int_blocks.py); `iterate_quantized` reads the weights unpacked again
for a model loaded without them. A float checkpoint served with an on-the-fly `--quantization` (OnlineScheme) goes
the same way: its decoder linear weights are quantized as they are read (model_loader/online_quant.py), once,
instead of unpacked.

Mixture-of-experts checkpoints store each expert's projections as quantized linears of their own
(`mlp.experts.E.gate_proj.qweight`, Mixtral's `block_sparse_moe.experts.E.w1.qweight`): they are dequantized the
same way, and the model's MoE layer stacks the `P.weight` of every expert into its expert parameters
(layers/moe/fused_moe.py), where they stay dense in the checkpoint's dtype; routers and gates stored unquantized pass
through. Experts stored quantized fused in one tensor over all experts are refused naming the tensor. Under tensor
parallelism every rank dequantizes each weight whole (one at a time) and the model's loaders keep its slice: a
row-parallel layer's input columns are cut after dequantization, so any group size and act-order group indices give
each rank exactly its part of the format's values.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from sglang.srt.model_loader.dequantize import (
    FP8_DTYPES,
    AffineWeight,
    ScaleLayout,
    awq_weight,
    compressed_weight,
    fp8_weight,
    gptq_weight,
    unpack_compressed,
    unpack_compressed_zero_point,
)
from sglang.srt.model_loader.dtype import dtype_name
from sglang.srt.model_loader.int_blocks import MadeBlocks, blocks_of
from sglang.srt.model_loader.online_quant import plan_online, quantize_at_load
from sglang.srt.model_loader.quant_config import (
    ACTIVATION_SCALE_SUFFIXES,
    AWQScheme,
    CTScheme,
    FP8Scheme,
    GPTQScheme,
    OnlineScheme,
    QuantizedCheckpointError,
    Scheme,
)
from sglang.srt.model_loader.weights import read_safetensor, safetensors_names

logger = logging.getLogger(__name__)

Fetch = Callable[[str], torch.Tensor]

# A module of one MoE expert (`...experts.3.gate_proj`), and one holding every expert of a layer fused
# (`...experts.gate_up_proj`).
_EXPERT_MODULE = re.compile(r"\.experts\.\d+\.[^.]+$")
_FUSED_EXPERTS_MODULE = re.compile(r"\.experts\.[^.\d][^.]*$")


class TensorStore:
    """Every tensor of a checkpoint's files by name, read one at a time on request. A safetensors file is opened
    for each read (model_loader/weights.read_safetensor)."""

    def __init__(self, files: list[Path]) -> None:
        self._sources: list[Any] = []  # a safetensors path, or a pickled checkpoint's (memory-mapped) state dict
        self._where: dict[str, int] = {}
        self.names: list[str] = []  # in file order
        for path in files:
            if path.suffix == ".safetensors":
                source: Any = path
                keys = safetensors_names(path)
            else:
                source = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
                keys = list(source.keys())
            for key in keys:
                self._where[key] = len(self._sources)
                self.names.append(key)
            self._sources.append(source)

    def get(self, name: str) -> torch.Tensor:
        source = self._sources[self._where[name]]
        if not isinstance(source, Path):
            return source[name]
        return read_safetensor(source, name)


def _companions(scheme: Scheme) -> tuple[str, ...]:
    if isinstance(scheme, OnlineScheme):
        return ()
    if isinstance(scheme, GPTQScheme):
        return ("qzeros", "scales", "g_idx")
    if isinstance(scheme, AWQScheme):
        return ("qzeros", "scales")
    if isinstance(scheme, FP8Scheme):
        return ("weight_scale_inv", "weight_scale")
    return ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def _primary(scheme: Scheme, leaves: set[str], companions: set[str]) -> Optional[str]:
    """The tensor of module leaves `leaves` that stands for its quantized weight, or None."""
    if isinstance(scheme, (GPTQScheme, AWQScheme)):
        return "qweight" if "qweight" in leaves else None
    if isinstance(scheme, CTScheme) and "weight_packed" in leaves:
        return "weight_packed"
    return "weight" if "weight" in leaves and companions else None


def _required(scheme: Scheme, primary: str, module: str) -> tuple[str, ...]:
    if isinstance(scheme, GPTQScheme):
        return ("qzeros", "scales", "g_idx") if scheme.desc_act else ("qzeros", "scales")
    if isinstance(scheme, AWQScheme):
        return ("qzeros", "scales")
    if isinstance(scheme, FP8Scheme):
        return ("weight_scale_inv",) if scheme.block else ("weight_scale",)
    assert isinstance(scheme, CTScheme)  # an on-the-fly mode has no stored companions (plan_online)
    weights = scheme.weights_for(module)
    if weights is None:
        raise QuantizedCheckpointError(f"Checkpoint tensor {module}.{primary} is quantized but no config group of "
                                       f"the quantization_config targets {module}")
    needed = ("weight_scale", "weight_shape") if primary == "weight_packed" else ("weight_scale",)
    return needed + (() if weights.symmetric or weights.strategy == "tensor" else ("weight_zero_point",))


def plan_quantized_modules(names: list[str], scheme: Scheme) -> dict[str, str]:
    """module -> the leaf name of its quantized weight; raises naming the first tensor missing or left over."""
    if isinstance(scheme, OnlineScheme):
        return plan_online(names, scheme)
    leaves_of: dict[str, set[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        leaves_of.setdefault(module, set()).add(leaf)
    companions = set(_companions(scheme))
    plan: dict[str, str] = {}
    for module, leaves in leaves_of.items():
        present = leaves & companions
        primary = _primary(scheme, leaves, present)
        if primary is None:
            if present:
                expected = "qweight" if isinstance(scheme, (GPTQScheme, AWQScheme)) else "weight"
                raise QuantizedCheckpointError(f"Checkpoint tensor {module}.{sorted(present)[0]} has no "
                                               f"{module}.{expected} beside it")
            continue
        if _FUSED_EXPERTS_MODULE.search(module):
            raise QuantizedCheckpointError(
                f"Checkpoint tensor {module}.{primary} holds the quantized experts of an MoE layer fused in one "
                f"tensor; quantized experts are read one expert per name ({module.rpartition('.')[0]}.0.gate_proj."
                f"{primary}, ...), as published {scheme.method} MoE checkpoints store them")
        missing = [leaf for leaf in _required(scheme, primary, module) if leaf not in leaves]
        if missing:
            raise QuantizedCheckpointError(f"Checkpoint tensor {module}.{missing[0]} is missing: {module}.{primary} "
                                           f"cannot be dequantized without it ({scheme.describe()})")
        plan[module] = primary
    return plan


def check_quantized_checkpoint(model_dir: str, scheme: Scheme) -> int:
    """Check from the file headers alone that every quantized weight of `model_dir` has the tensors it needs (a
    startup error naming the first one missing or left over, before any process starts); returns their count."""
    from sglang.srt.model_loader.weights import weight_files

    return len(plan_quantized_modules(TensorStore(weight_files(model_dir)).names, scheme))


def iterate_dequantized(files: list[Path], scheme: Scheme, dtype: torch.dtype, made: Optional[MadeBlocks] = None,
                        wanted: Optional[Callable[[str], bool]] = None, skip: Container[str] = ()
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint `files`, its quantized weights dequantized to `dtype` (see the module doc);
    with `made`, the raw blocks of each quantized weight (MoE experts' too: model_loader/moe_blocks.py serves them)
    are made from its integers as it is read and added to it. With `wanted`, only the tensors it accepts (by the
    name yielded) are read, and nothing is logged. Quantized weights named in `skip` (the model released them:
    blocks serve them) are not dequantized nor yielded; their blocks are still made."""
    store = TensorStore(files)
    plan = plan_quantized_modules(store.names, scheme)
    companions = set(_companions(scheme))
    skipped: dict[str, int] = {}
    dequantized: list[str] = []
    for name in store.names:
        module, _, leaf = name.rpartition(".")
        primary = plan.get(module)
        if wanted is not None and not wanted(f"{module}.weight" if primary == leaf else name):
            continue
        if primary == leaf:
            stored = read_weight(scheme, module, primary, store.get)
            if made is not None:
                made[module] = blocks_of(stored, module)
            if f"{module}.weight" in skip:
                continue
            dequantized.append(module)
            weight = stored.dequantize()
            del stored
            yield f"{module}.weight", weight.to(dtype)
            del weight
        elif primary is not None and leaf in companions:
            continue
        elif leaf in ACTIVATION_SCALE_SUFFIXES:
            skipped[leaf] = skipped.get(leaf, 0) + 1
        else:
            tensor = store.get(name)
            if tensor.dtype in FP8_DTYPES:
                raise QuantizedCheckpointError(f"Checkpoint tensor {name} is float8 but has no scale beside it "
                                               f"({module}.weight_scale or {module}.weight_scale_inv)")
            yield name, tensor
    if wanted is not None:
        return
    if isinstance(scheme, OnlineScheme):
        logger.info("Quantized at load: %s, %s, %d linears of the decoder (embeddings, norms and the LM head as "
                    "stored), served as the checkpoint kind %s; their values loaded in %s", scheme.method,
                    scheme.weights, len(plan), scheme.served_as.describe(), dtype_name(dtype))
        return
    if skipped:
        logger.info("Read past %s: activation and KV-cache quantization scales are not used here (activations are "
                    "quantized per token at run time where they are quantized; the KV cache has its own "
                    "--kv-cache-dtype)", ", ".join(f"{count} {leaf}" for leaf, count in skipped.items()))
    released = len(plan) - len(dequantized)
    logger.info("Dequantized %d %s weights to %s as they were read%s", len(dequantized), scheme.method,
                dtype_name(dtype), f" ({released} more only made into blocks: the model does not load them)"
                if released else "")
    experts = sum(1 for module in dequantized if _EXPERT_MODULE.search(module))
    if experts:
        logger.info("Of these, %d are MoE expert projections: their %s values fill the stacked expert parameters "
                    "of the MoE layers", experts, dtype_name(dtype))


def iterate_quantized(files: list[Path], scheme: Scheme) -> Iterator[tuple[str, AffineWeight]]:
    """(module, its weight as stored) for every quantized weight of the checkpoint `files`, in file order."""
    store = TensorStore(files)
    plan = plan_quantized_modules(store.names, scheme)
    for name in store.names:
        module, _, leaf = name.rpartition(".")
        if plan.get(module) == leaf:
            yield module, read_weight(scheme, module, leaf, store.get)


def read_weight(scheme: Scheme, module: str, primary: str, fetch: Fetch) -> AffineWeight:
    """The quantized weight of `module` (its tensor `primary` and companions, read with `fetch`), unpacked."""
    names = {leaf: f"{module}.{leaf}" for leaf in ("qweight", "qzeros", "scales", "g_idx", "weight")}
    if isinstance(scheme, OnlineScheme):
        return quantize_at_load(scheme, fetch(names["weight"]), names["weight"])
    if isinstance(scheme, GPTQScheme):
        g_idx = _optional(fetch, f"{module}.g_idx")
        layout = ScaleLayout("group", scheme.group_size, g_idx, names["g_idx"])
        return gptq_weight(fetch(names["qweight"]), fetch(names["qzeros"]), fetch(names["scales"]), layout,
                           scheme.bits, scheme.zero_offset, names)
    if isinstance(scheme, AWQScheme):
        return awq_weight(fetch(names["qweight"]), fetch(names["qzeros"]), fetch(names["scales"]),
                          ScaleLayout("group", scheme.group_size), names)
    if isinstance(scheme, FP8Scheme):
        scale_name = f"{module}.weight_scale_inv" if scheme.block else f"{module}.weight_scale"
        scale = fetch(scale_name)
        layout = ScaleLayout("block", block=scheme.block) if scheme.block else ScaleLayout(
            "tensor" if scale.numel() == 1 else "channel")
        return fp8_weight(fetch(names["weight"]), scale, layout, {"weight": names["weight"], "scale": scale_name})
    return _read_compressed(scheme, module, primary, fetch)


def _read_compressed(scheme: CTScheme, module: str, primary: str, fetch: Fetch) -> AffineWeight:
    weights = scheme.weights_for(module)
    assert weights is not None  # plan_quantized_modules checked it
    names = {"packed": f"{module}.weight_packed", "shape": f"{module}.weight_shape", "weight": f"{module}.weight",
             "scale": f"{module}.weight_scale", "zero_point": f"{module}.weight_zero_point"}
    if primary == "weight_packed":
        values = unpack_compressed(fetch(names["packed"]), fetch(names["shape"]), weights.num_bits, names)
    else:
        values = fetch(names["weight"])
        allowed = FP8_DTYPES if weights.type == "float" else (torch.int8,)
        if values.dtype not in allowed or values.dim() != 2:
            raise QuantizedCheckpointError(f"Checkpoint tensor {names['weight']} is {values.dtype} "
                                           f"{list(values.shape)}; {weights.format} {weights.type}{weights.num_bits} "
                                           f"weights are 2-d {' or '.join(map(str, allowed))}")
    zero_point = _optional(fetch, names["zero_point"])
    if zero_point is not None and primary == "weight_packed":
        zero_point = unpack_compressed_zero_point(zero_point, values.shape[0], weights.num_bits, names["zero_point"])
    layout = ScaleLayout(weights.strategy, weights.group_size, _optional(fetch, f"{module}.weight_g_idx"),
                         f"{module}.weight_g_idx", weights.block)
    return compressed_weight(values, fetch(names["scale"]), zero_point, layout, weights.num_bits, names)


def _optional(fetch: Fetch, name: str) -> Optional[torch.Tensor]:
    try:
        return fetch(name)
    except KeyError:
        return None

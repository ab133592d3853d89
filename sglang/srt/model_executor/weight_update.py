"""Replacing a running model's weights with another checkpoint of the same architecture, and reading them back.

The new weights load into a fresh model built from the serving model's own config, beside the model that keeps
serving; the runner switches to it only once every step succeeded. So a failure anywhere (unresolvable path,
missing or mis-shaped weight, a read error midway) leaves the old weights serving untouched, and the "rollback"
costs nothing. As upstream SGLang, only weights change: the config and tokenizer stay those of the server.

Derived fast paths are rebuilt from the new model, never carried over: the GGUF blocks exist only when the new
checkpoint itself is a GGUF file (model_loader/gguf_quant.py checks they equal the loaded weights), the
large-batch bf16/int8 copies are made again from the new float32 weights (model_loader/gemm_methods.py), and the
decode path is re-planned over the same K/V buffers (`ModelRunner.bind_kv_pool`), so the fused CPU decode step
holds pointers into the new blocks or is dropped when there are none.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.linear import MergedLinear
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.pooler import Pooler
from sglang.srt.lora.layers import carry_lora
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_executor.model_runner import ModelRunner, attach_fast_paths, load_for_plan
from sglang.srt.model_loader.pooling_config import read_pooling_config
from sglang.srt.model_loader.resolve import ModelNotFoundError, gguf_source_for, resolve_model_path
from sglang.srt.model_loader.weights import weight_files

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf")


class WeightUpdateError(Exception):
    """A failed update; the message is the one the API returns."""


def resolve_update_source(model_path: str, load_format: Optional[str]) -> tuple[str, Optional[str]]:
    """(local Hugging Face directory, GGUF file or None) holding the weights of `model_path`."""
    fmt = load_format or "auto"
    if fmt not in LOAD_FORMATS:
        raise WeightUpdateError(
            f"Failed to get model loader: load format {fmt!r} is not supported (use one of {', '.join(LOAD_FORMATS)})."
        )
    not_found = WeightUpdateError(f"Failed to get weights iterator: {model_path} (repository not found).")
    try:
        model_dir = resolve_model_path(model_path)
        files = weight_files(model_dir)
    except (ModelNotFoundError, OSError) as e:
        logger.info("Cannot resolve %s to weights: %s", model_path, e)
        raise not_found from e
    gguf_path = gguf_source_for(model_path)
    actual = "gguf" if gguf_path else ("safetensors" if files[0].suffix == ".safetensors" else "pt")
    if fmt not in ("auto", actual):
        raise WeightUpdateError(
            f"Failed to get model loader: load format {fmt!r} does not match the checkpoint of {model_path} ({actual})."
        )
    return model_dir, gguf_path


def _check_same_parameters(serving: nn.Module, new: nn.Module) -> None:
    old_shapes = {name: tuple(p.shape) for name, p in serving.named_parameters()}
    new_shapes = {name: tuple(p.shape) for name, p in new.named_parameters()}
    for name, shape in old_shapes.items():
        if new_shapes.get(name) != shape:
            raise ValueError(f"parameter {name} has shape {new_shapes.get(name)}, the served model {shape}")


def replace_weights(runner: ModelRunner, kv_pool: KVPool, model_path: str, load_format: Optional[str]) -> None:
    """Serve the weights of `model_path` from now on, with their own fast paths and a re-planned decode path.

    Raises WeightUpdateError with the API's message; the runner is then exactly as it was."""
    model_dir, gguf_path = resolve_update_source(model_path, load_format)
    serving = runner.model
    config = getattr(serving, "config", None)
    try:
        new_model: Any = load_for_plan(model_dir, runner.dtype, runner.device, gguf_path, runner.gguf_kernel_max_rows,
                                       runner.arithmetic, config=config)
        _check_same_parameters(serving, new_model)
        quant_bytes = attach_fast_paths(new_model, gguf_path, runner.hf_config, runner.gguf_kernel_max_rows,
                                        runner.arithmetic)
        pooler = Pooler(read_pooling_config(model_dir, runner.is_encoder))
        carry_lora(serving, new_model)  # the loaded LoRA adapters serve on, over the new weights
    except Exception as e:  # any load error: the serving model was never touched
        logger.warning("Weight update from %s failed: %s", model_path, e)
        raise WeightUpdateError(f"Failed to update weights: {e}.\nRolling back to original weights.") from e
    saved = (runner.model, runner.quant_bytes, runner.pooler)
    runner.model, runner.quant_bytes, runner.pooler = new_model, quant_bytes, pooler
    runner.account_weights()
    try:
        runner.bind_kv_pool(kv_pool)  # the old fused step points into the old blocks: plan again
    except Exception as e:
        runner.model, runner.quant_bytes, runner.pooler = saved
        runner.account_weights()
        runner.bind_kv_pool(kv_pool)
        raise WeightUpdateError(f"Failed to update weights: {e}.\nRolling back to original weights.") from e
    del saved, serving
    gc.collect()


def _served_values(model: nn.Module, module_name: str, param: torch.Tensor) -> torch.Tensor:
    """A parameter's values; for a layer whose blocks alone serve it (a meta placeholder: model_loader/q8_blocks.py),
    the blocks' dequantized values."""
    if param.device.type != "meta":
        return param
    module = model.get_submodule(module_name)
    stacked = module.served_values(param) if isinstance(module, FusedMoE) else None  # experts served from blocks
    if stacked is not None:
        return stacked
    method = getattr(module, "linear_method", None)
    if method is None and module is getattr(model, "lm_head", None):
        method = getattr(getattr(model, "logits_processor", None), "head_method", None)
    # an input embedding table read from blocks holds them itself (layers/quantization/block_embedding.py), also
    # where a tied LM head computes with other blocks (converted from a K-quant table)
    quant_weight = getattr(module, "quant_weight", None) or getattr(method, "quant_weight", None)
    if quant_weight is None:
        raise KeyError(f"Parameter {module_name} holds no values in the served model.")
    return quant_weight.dequantize()


def checkpoint_tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor a checkpoint stores under `name`: a parameter, or its rows of a fused q/k/v or gate/up one."""
    try:
        param = model.get_parameter(name)
        return _served_values(model, name.rsplit(".", 1)[0], param)
    except AttributeError:
        pass
    for prefix, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
        for leaf, param in module.named_parameters(recurse=False):
            for shard_name, (start, size) in module.shard_rows.items():
                if name == (f"{parent}.{shard_name}.{leaf}" if parent else f"{shard_name}.{leaf}"):
                    return _served_values(model, prefix, param).narrow(0, start, size)
    raise KeyError(f"Parameter {name} not found in the served model.")


def weights_by_name(model: nn.Module, name: str, truncate_size: int) -> list:
    """The values of checkpoint weight `name`, its first `truncate_size` rows (dim 0), as nested lists."""
    tensor = checkpoint_tensor(model, name)
    return tensor.detach()[:truncate_size].to(device="cpu", dtype=torch.float32).tolist()

"""What every process needs to know about the served model, computed once in the parent process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang.srt.layers.arithmetic import ArithmeticPlan
from sglang.srt.layers.small_batch_rows import LARGE_MODEL_FLOAT_BYTES
from sglang.srt.model_loader.config_overrides import apply_overrides
from sglang.srt.server_args import ServerArgs

# Prefill batches on CPU: up to 4,096 tokens, or 2,048 for a model of 1B parameters or more (4 GiB of float32 linear
# weights), whose prefill per token is ~18% slower in batches of 4,096 tokens than in batches of 500-2,000 on a Zen 4
# CPU (its float32 intermediates far beyond the caches; benchmarks/RESULTS.md, 2026-11-29: 64 concurrent requests
# 1.06x in two alternated rounds). Smaller models keep 4,096: chunks of 2,048 lengthened SmolLM2-135M's shared-prefix
# TTFT by ~7% on an AVX2 CPU (2026-11-26).
CPU_CHUNKED_PREFILL = 4096
CPU_LARGE_MODEL_CHUNKED_PREFILL = 2048


def default_chunked_prefill_size(linear_float_bytes: Optional[int]) -> int:
    """--chunked-prefill-size on CPU where it is not given, by the float32 bytes of the model's linear weights (None
    where the config does not say)."""
    if (linear_float_bytes or 0) >= LARGE_MODEL_FLOAT_BYTES:
        return CPU_LARGE_MODEL_CHUNKED_PREFILL
    return CPU_CHUNKED_PREFILL


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str  # local Hugging Face directory (converted from GGUF when the source is a .gguf file)
    gguf_path: Optional[str]  # the GGUF file the model came from, when it did
    hf_config: Any  # transformers PretrainedConfig, with --json-model-override-args applied
    dtype: torch.dtype
    context_len: int
    eos_token_ids: tuple[int, ...]
    # Sampling defaults from generation_config.json (temperature, top_p, ...), only those it sets.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # Model dtype and the GEMM of each phase (layers/arithmetic.py); dtype above is arithmetic.weight_dtype.
    arithmetic: Optional[ArithmeticPlan] = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.get_text_config().vocab_size)


def load_model_info(server_args: ServerArgs) -> ModelInfo:
    """Facts every process needs about the model, computed once in the parent."""
    from transformers import AutoConfig, GenerationConfig

    from sglang.srt.model_loader.gemm_measurement import linear_float_bytes, plan_for_this_machine
    from sglang.srt.model_loader.gguf_block_convert import file_served_type
    from sglang.srt.model_loader.quant_config import quantization_settings, resolve_quantization
    from sglang.srt.model_loader.resolve import gguf_source_for, resolve_model_path

    model_dir = resolve_model_path(server_args.model_path)
    gguf_path = gguf_source_for(server_args.model_path)
    # A quantized checkpoint is read (and --quantization checked) before anything starts; /get_server_info then
    # reports the method read.
    scheme = resolve_quantization(model_dir, server_args.quantization, from_gguf=gguf_path is not None)
    server_args.quantization = scheme.method if scheme is not None else ("gguf" if gguf_path else None)
    if scheme is not None:
        from sglang.srt.model_loader.quantized_weights import check_quantized_checkpoint

        check_quantized_checkpoint(model_dir, scheme)
    # The one config every process builds from: the model, its KV pool and the context length.
    hf_config = apply_overrides(AutoConfig.from_pretrained(model_dir, trust_remote_code=server_args.trust_remote_code),
                                server_args.json_model_override_args)
    if scheme is not None and not getattr(hf_config, "quantization_config", None):
        # settings from an older export's side file (or --quantization's on-the-fly mode: every process then
        # quantizes at load), so that the model's config says how its weights were read
        hf_config.quantization_config = quantization_settings(model_dir, scheme)
    # Vision-language configs keep the decoder's settings in text_config.
    context_len = server_args.context_length or _config_context_len(hf_config.get_text_config())
    config_dtype = getattr(hf_config, "dtype", None)
    arithmetic = plan_for_this_machine(server_args.device, server_args.dtype, server_args.cpu_gemm, config_dtype,
                                       server_args.gguf_activations, server_args.small_batch_quantization,
                                       server_args.kv_cache_dtype, server_args.prefill_attention, hf_config,
                                       server_args.num_threads, measure=server_args.nnodes == 1,
                                       large_batch_weights=server_args.large_batch_weights,
                                       embedding=bool(server_args.is_embedding),
                                       quantized_checkpoint=scheme is not None,
                                       gguf_checkpoint=gguf_path is not None,
                                       gguf_blocks=file_served_type(gguf_path) if gguf_path else None)
    if server_args.chunked_prefill_size is None:  # CPU: by the model's size (GPUs have theirs from ServerArgs)
        server_args.chunked_prefill_size = default_chunked_prefill_size(linear_float_bytes(hf_config))
    dtype = arithmetic.weight_dtype
    text_config = hf_config.get_text_config()
    eos = _as_list(getattr(hf_config, "eos_token_id", None) or getattr(text_config, "eos_token_id", None))
    generation_defaults: dict = {}
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
        eos += _as_list(gen.eos_token_id)
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            val = getattr(gen, key, None)
            if val is not None and key in (gen.to_diff_dict() or {}):
                generation_defaults[key] = val
    except (OSError, ValueError):
        pass
    return ModelInfo(
        model_dir=model_dir,
        gguf_path=gguf_path,
        hf_config=hf_config,
        dtype=dtype,
        context_len=context_len,
        eos_token_ids=tuple(sorted(set(eos))),
        generation_defaults=generation_defaults,
        arithmetic=arithmetic,
    )


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, (list, tuple, set)) else [int(x)]


def _config_context_len(hf_config) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        val = getattr(hf_config, key, None)
        if val:
            return int(val)
    return 2048

"""Turn a GGUF checkpoint into a cached Hugging Face directory (config, float32 safetensors shards, tokenizer).

The dequantization is slow (tens of seconds for a 135M model), so the result is stored once per GGUF file under
the cache root and published with an atomic rename: a process that races another one either sees no directory or
a complete one, never a half-written one.

The config is transformers' reading of the file's metadata, corrected where it leaves keys llama.cpp writes unread
(Gemma 2 / 3, Qwen2-MoE / Qwen3-MoE, Mistral: _correct_config), or built from the metadata for GPT-OSS, which
transformers' reader cannot read (_gpt_oss_config).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root

logger = logging.getLogger(__name__)

# Part of every cache key: bump it when the layout of a converted directory changes, so stale entries are rebuilt.
CONVERTER_VERSION = "4"


def file_fingerprint(path: str | os.PathLike) -> str:
    """Short hash of (absolute path, size, mtime): changes when the file is replaced or edited in place."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{CONVERTER_VERSION}\0{real}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def converted_dir_for(gguf_path: str | os.PathLike) -> Path:
    """Where the HF directory converted from `gguf_path` lives (whether or not it exists yet)."""
    name = Path(gguf_path).name
    stem = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    return cache_root() / "gguf" / f"{stem}-{file_fingerprint(gguf_path)}"


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike) -> str:
    """Return a local HF directory equivalent to the GGUF file, converting it on the first call."""
    gguf_path = os.path.realpath(os.path.expanduser(str(gguf_path)))
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_dir_for(gguf_path)
    if not target.is_dir():
        logger.info("Converting %s to a Hugging Face checkpoint in %s", gguf_path, target)
    return str(build_cached_dir(target, functools.partial(_write_hf_dir, gguf_path)))


# Tensors go to safetensors shards of about this many bytes, each written as soon as it fills: the conversion holds
# one shard and one dequantized tensor at a time (a 7B model's float32 weights are ~28 GB; whole they would not fit
# the memory of a machine that serves it from its blocks).
SHARD_BYTES = 2 << 30


class ShardWriter:
    """Writes tensors to numbered safetensors shards, each as soon as it fills, and the index that names them; each
    tensor cast to `dtype` first (None: stored as given)."""

    def __init__(self, out_dir: Path, shard_bytes: int, dtype: Optional[str] = "float32") -> None:
        self.out_dir, self.shard_bytes, self.dtype = out_dir, shard_bytes, dtype
        self.pending: dict = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (file name, tensor names), in writing order
        self.total = 0

    def add(self, name: str, tensor) -> None:
        import torch

        if self.dtype is not None:
            tensor = tensor.to(getattr(torch, self.dtype))
        tensor = tensor.contiguous()
        if self.pending and self.pending_bytes + tensor.nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.total += tensor.nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.out_dir / name), metadata={"format": "pt"})
        os.chmod(self.out_dir / name, 0o644)  # safetensors creates it owner-only, unlike the JSON files beside it
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        if not self.files:
            raise ValueError("No tensors could be read from the GGUF file")
        count = len(self.files)
        weight_map = {}
        for i, (old, names) in enumerate(self.files, start=1):  # model-0000i-of-0000n, as sharded checkpoints are named
            new = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.rename(self.out_dir / old, self.out_dir / new)
            weight_map.update(dict.fromkeys(names, new))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _stream_tensors(reader: Any, architecture: str, config: Any, skeleton, writer: ShardWriter) -> None:
    """Dequantize the file's tensors one at a time, rename them as transformers' GGUF loader does (its per-
    architecture tensor processors: Q/K row order, MoE experts gathered; GPT-OSS's experts here), and hand each to
    `writer`."""
    from collections import Counter

    import numpy as np
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    # A gathered tensor (MoE experts: ffn_gate_exps and ffn_up_exps fill one gate_up_proj) is written once every
    # file tensor mapped to it has been read; writing it earlier would store the half read so far.
    parts = Counter(mapping.values())
    seen: Counter = Counter()
    gathered: dict = {}  # where the MoE processors gather expert tensors
    parsed = {"config": config.to_dict(), "tensors": gathered}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        placed = _gpt_oss_part(tensor.name, weights, shapes, gathered) if architecture == "gpt-oss" else None
        if placed is not None:
            parts[placed] = 2 if placed.endswith(("gate_up_proj", "gate_up_proj_bias")) else 1
            seen[placed] += 1
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
                writer.add(name, value)
            seen[mapping.get(tensor.name.removesuffix(".weight"), mapping.get(tensor.name))] += 1
        for name in [n for n in gathered if n not in parts or seen[n] >= parts[n]]:
            writer.add(name, gathered.pop(name))
    if gathered:
        raise ValueError(f"GGUF expert tensors missing a part (gate or up): {sorted(gathered)}")


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


def _gpt_oss_part(name: str, weights, shapes: dict, gathered: dict) -> Optional[str]:
    """Put a GPT-OSS expert tensor or sink of the file, in transformers' layout, into `gathered`; returns the
    parameter it went to (None: not one of _GPT_OSS_PARTS)."""
    import numpy as np
    import torch

    block, _, rest = name.partition(".")
    layer, _, role = rest.partition(".")
    if block != "blk" or role not in _GPT_OSS_PARTS:
        return None
    target, column, transposed = _GPT_OSS_PARTS[role]
    target = f"model.layers.{layer}.{target}"
    value = torch.from_numpy(np.copy(weights))
    value = value.transpose(-1, -2) if transposed else value
    if column is None:
        gathered[target] = value.contiguous()
    else:
        gathered.setdefault(target, torch.zeros(shapes[target]))[..., column::2] = value
    return target


def _read_metadata(reader: Any) -> tuple[str, dict[str, Any], dict[str, tuple[int, ...]]]:
    """From a GGUFReader: (architecture, the `<architecture>.*` keys without that prefix, the
    `tokenizer.ggml.*_token_id` keys and the values of the LongRoPE factor tensors (`rope_factors_long` /
    `rope_factors_short`, as lists), each tensor's shape in GGML order)."""
    from gguf import GGUFValueType
    from transformers.modeling_gguf_pytorch_utils import read_field

    architecture = read_field(reader, "general.architecture")[0]
    keys: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(architecture + ".") or (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            values = read_field(reader, key)
            name = key.removeprefix(architecture + ".")
            keys[name] = values if field.types[0] == GGUFValueType.ARRAY else values[0]
    for tensor in reader.tensors:
        if tensor.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            keys[tensor.name.removesuffix(".weight")] = [float(v) for v in tensor.data]
    return architecture, keys, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def _gpt_oss_config(keys: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> Any:
    """GPT-OSS's config from the keys llama.cpp writes. transformers' reader cannot be used: it fails on the YaRN
    keys (it reads a field's first part, the key's length, as the value) and maps neither the window nor the head
    width. llama.cpp fixes the SwiGLU limit at 7 and alternates sliding and full layers, the first sliding: the
    config class's defaults. YaRN keeps the model's own untruncated correction range (`truncate` False, as
    transformers' GPT-OSS config has it)."""
    from transformers import GptOssConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": keys.get("rope.freq_base", 150_000.0)}
    if keys.get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=keys["rope.scaling.factor"],
                    original_max_position_embeddings=keys["rope.scaling.original_context_length"],
                    beta_fast=keys.get("rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow=keys.get("rope.scaling.yarn_beta_slow", 1.0), truncate=False)
    return GptOssConfig(
        vocab_size=shapes["token_embd.weight"][1], hidden_size=keys["embedding_length"],
        intermediate_size=keys.get("expert_feed_forward_length") or shapes["blk.0.ffn_up_exps.weight"][1],
        num_hidden_layers=keys["block_count"], num_attention_heads=keys["attention.head_count"],
        num_key_value_heads=keys["attention.head_count_kv"], head_dim=keys["attention.key_length"],
        num_local_experts=keys["expert_count"], num_experts_per_tok=keys["expert_used_count"],
        sliding_window=keys.get("attention.sliding_window", 128), max_position_embeddings=keys["context_length"],
        rms_norm_eps=keys["attention.layer_norm_rms_epsilon"], rope_parameters=rope,
        tie_word_embeddings="output.weight" not in shapes, bos_token_id=keys.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=keys.get("tokenizer.ggml.eos_token_id"), pad_token_id=keys.get("tokenizer.ggml.padding_token_id"))


# llama.cpp scales Gemma's queries by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B models, which it
# knows by their layer count (the file has no key for the scale).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _correct_config(config: Any, architecture: str, keys: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Set what transformers' GGUF reader leaves at its config class's defaults to what llama.cpp reads from the
    same file: Gemma 2 / 3 soft-capping, query scale, sliding-window layer pattern and (Gemma 3) the RoPE of each
    layer type; the expert widths of Qwen2-MoE / Qwen3-MoE; no sliding window for Mistral, whose files are written
    as arch `llama` without one. `keys`, `shapes`: _read_metadata's."""
    if architecture in _GEMMA_27B_LAYERS:
        head_dim = keys.get("attention.key_length") or config.hidden_size // config.num_attention_heads
        big = config.num_hidden_layers == _GEMMA_27B_LAYERS[architecture]
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else head_dim
        window = keys.get("attention.sliding_window", 4096 if architecture == "gemma2" else 0)
        config.sliding_window = window or None
        pattern = keys.get("attention.sliding_window_pattern", 2 if architecture == "gemma2" else 6)
        if isinstance(pattern, list):  # one flag per layer
            sliding = [bool(flag) for flag in pattern]
        else:  # every pattern-th layer global
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(config.num_hidden_layers)]
        config.layer_types = ["sliding_attention" if s and window else "full_attention" for s in sliding]
    # transformers maps neither soft-cap key (its config classes' 50 / 30 stood for every Gemma 2 file and none for
    # Gemma 3), nor the sliding layers' RoPE base or the global layers' scaling of Gemma 3
    if architecture == "gemma2":  # llama.cpp's defaults where the keys are absent
        config.attn_logit_softcapping = keys.get("attn_logit_softcapping", 50.0)
        config.final_logit_softcapping = keys.get("final_logit_softcapping", 30.0)
    elif architecture == "gemma3":
        config.final_logit_softcapping = keys.get("final_logit_softcapping") or None
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": keys.get("rope.freq_base", 1_000_000.0)}
        if keys.get("rope.scaling.type") == "linear" and keys.get("rope.scaling.factor"):
            full.update(rope_type="linear", factor=keys["rope.scaling.factor"])
        config.rope_parameters = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": keys.get("rope.freq_base_swa", 10_000.0)},
        }
    elif architecture in ("qwen2moe", "qwen3moe"):
        # transformers' key mapping has no expert widths: its config classes' defaults (Qwen1.5-MoE-A2.7B's and
        # Qwen3-30B-A3B's) stood for every file. GGML shapes are [hidden, width(, experts)].
        config.moe_intermediate_size = keys.get("expert_feed_forward_length") or shapes["blk.0.ffn_up_exps.weight"][1]
        if architecture == "qwen2moe":
            config.shared_expert_intermediate_size = (keys.get("expert_shared_feed_forward_length")
                                                      or shapes["blk.0.ffn_up_shexp.weight"][1])
    elif architecture == "phi3":
        _correct_phi3(config, keys, shapes)
    elif getattr(config, "model_type", None) == "mistral":
        # transformers reads a `llama` file named "mistral" as Mistral, whose config class defaults to a 4096-token
        # window; llama.cpp attends to every position of such a file
        config.sliding_window = None


def _correct_phi3(config: Any, keys: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Phi-3's partial rotary width, window and LongRoPE, which transformers' GGUF reader leaves at full rotary, no
    window and plain RoPE: the rotary width is `rope.dimension_count`, the factors are the file's
    `rope_factors_long` / `rope_factors_short` tensors (read by the caller into `keys`), a window of 0 is none. The
    padding id is the file's (the config class's default, 32000, is outside a smaller vocabulary)."""
    config.pad_token_id = keys.get("tokenizer.ggml.padding_token_id")
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = keys.get("rope.dimension_count") or head_dim
    config.partial_rotary_factor = rotary / head_dim
    config.sliding_window = keys.get("attention.sliding_window") or None
    original = keys.get("rope.scaling.original_context_length") or config.max_position_embeddings
    config.original_max_position_embeddings = original
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": keys.get("rope.freq_base", 10_000.0),
                            "partial_rotary_factor": config.partial_rotary_factor}
    if "rope_factors_long" in keys and "rope_factors_short" in keys:
        rope.update(rope_type="longrope", long_factor=keys["rope_factors_long"],
                    short_factor=keys["rope_factors_short"], original_max_position_embeddings=original)
    config.rope_parameters = rope


def _write_hf_dir(gguf_path: str, out_dir: Path) -> None:
    import torch
    from gguf import GGUFReader
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        PreTrainedTokenizerFast,
    )

    src_dir, file_name = os.path.split(gguf_path)
    reader = GGUFReader(gguf_path)  # one parse of the file for its metadata and its tensors
    architecture, keys, shapes = _read_metadata(reader)
    if architecture == "gpt-oss":
        config = _gpt_oss_config(keys, shapes)
    else:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
        _correct_config(config, architecture, keys, shapes)
    # The meta-device skeleton only supplies the HF parameter names for the GGUF -> HF name mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # GGUF metadata has no architecture class name; record the one transformers picked.
    config.architectures = [type(skeleton).__name__]
    writer = ShardWriter(out_dir, SHARD_BYTES, "float32")  # float32 keeps the dequantized values exact
    try:
        _stream_tensors(reader, architecture, config, skeleton, writer)
        writer.finish()
    except ValueError as err:
        raise ValueError(f"{err}: {gguf_path}") from err
    del skeleton, reader

    config.save_pretrained(out_dir)
    try:
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    except (ValueError, TypeError) as err:
        logger.warning("No generation_config.json derived from %s: %s", gguf_path, err)
    try:
        # AutoTokenizer would read the config with transformers' reader, which fails on GPT-OSS files; GPT-OSS's
        # tokenizer class is the generic fast one
        tokenizer_class = PreTrainedTokenizerFast if architecture == "gpt-oss" else AutoTokenizer
        tokenizer = tokenizer_class.from_pretrained(src_dir, gguf_file=file_name)
    except (KeyError, ValueError, OSError) as err:
        # A weights-only GGUF is still a usable model when the tokenizer is supplied separately.
        logger.warning("GGUF %s carries no usable tokenizer (%s); the converted dir has none", gguf_path, err)
    else:
        tokenizer.save_pretrained(out_dir)

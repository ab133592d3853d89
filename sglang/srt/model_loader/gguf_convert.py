"""Turn a GGUF checkpoint into a cached Hugging Face directory (config, float32 safetensors shards, tokenizer).

Files of 1 GiB or more leave their block tensors in the file: the directory records where each is read from
(model_loader/gguf_deferred.py) and stores the small float tensors alone, instead of 4 bytes per weight on disk.

The dequantization is slow (tens of seconds for a 135M model), so the result is stored once per GGUF file under
the cache root and published with an atomic rename: a process that races another one either sees no directory or
a complete one, never a half-written one.

The config is transformers' reading of the file's metadata, corrected where it leaves keys llama.cpp writes unread,
or built from the metadata for the architectures transformers' reader cannot read (model_loader/gguf_configs.py).
Tensors are renamed as transformers' GGUF loader names them, with the file's layouts it does not know (GPT-OSS's
experts, DeepSeek's split `kv_b_proj`) put back in the checkpoint's here.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root
from sglang.srt.model_loader.gguf_configs import KEY_BUILT, config_from_keys, correct_config
from sglang.srt.model_loader.gguf_deferred import Deferrals

logger = logging.getLogger(__name__)

# Part of every cache key: bump it when the layout of a converted directory changes, so stale entries are rebuilt.
CONVERTER_VERSION = "7"


def file_fingerprint(path: str | os.PathLike) -> str:
    """Short hash of (absolute path, size, mtime, whether block tensors stay in the file): changes when the file is
    replaced or edited in place."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{CONVERTER_VERSION}\0{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{blocks_stay_in_file(real)}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


# Files of at least this many bytes keep their block tensors in the file (model_loader/gguf_deferred.py): a float32
# copy takes about 4 / (the file's bytes per weight) times the file's size on disk (28 GB for a 7B model's 4 GB Q4
# file). Smaller files are converted whole, so that their converted directory is a plain transformers checkpoint.
BLOCKS_STAY_FROM_BYTES = 1 << 30


def blocks_stay_in_file(gguf_path: str | os.PathLike) -> bool:
    """Whether the conversion of `gguf_path` leaves its block tensors in the file: files of BLOCKS_STAY_FROM_BYTES
    or more; `SGLANG_GGUF_BLOCKS_IN_FILE=1` / `0` for every file / none."""
    forced = os.environ.get("SGLANG_GGUF_BLOCKS_IN_FILE", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return os.path.getsize(gguf_path) >= BLOCKS_STAY_FROM_BYTES


def converted_dir_for(gguf_path: str | os.PathLike) -> Path:
    """Where the HF directory converted from `gguf_path` lives (whether or not it exists yet)."""
    name = Path(gguf_path).name
    stem = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    return cache_root() / "gguf" / f"{stem}-{file_fingerprint(gguf_path)}"


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike) -> str:
    """Return a local HF directory equivalent to the GGUF file, converting it on the first call (and then removing
    the conversions of the same file that this one replaces: _remove_stale_conversions)."""
    gguf_path = os.path.realpath(os.path.expanduser(str(gguf_path)))
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = converted_dir_for(gguf_path)
    if target.is_dir():
        return str(target)
    logger.info("Converting %s to a Hugging Face checkpoint in %s", gguf_path, target)
    built = build_cached_dir(target, functools.partial(_write_source_and_hf_dir, gguf_path))
    _remove_stale_conversions(gguf_path, built)
    return str(built)


# What a converted directory records of the file it was made from.
SOURCE_RECORD = "gguf_source.json"


def _write_source_and_hf_dir(gguf_path: str, out_dir: Path) -> None:
    architecture = _write_hf_dir(gguf_path, out_dir)
    # transformers' Llama processor put the Q / K rows llama.cpp interleaves for its rotary embedding back in the
    # checkpoint's order: the file's blocks of those rows are read in that order (model_loader/gguf_quant.py)
    qk_rows = "interleaved" if _processor_arch(architecture or "") == "llama" else "as stored"
    record = {"path": gguf_path, "converter_version": CONVERTER_VERSION, "architecture": architecture,
              "qk_rows": qk_rows}
    (out_dir / SOURCE_RECORD).write_text(json.dumps(record))


def conversion_record(gguf_path: str | os.PathLike) -> dict[str, Any]:
    """What the current conversion of `gguf_path` records of it (path, architecture, the Q / K rows' order in the
    file); empty where there is none."""
    try:
        record = json.loads((converted_dir_for(gguf_path) / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _remove_stale_conversions(gguf_path: str, kept: Path) -> None:
    """Remove the other conversions of `gguf_path` (made by another converter version, or before the file was
    replaced or edited): each is a float32 copy of the whole model, gigabytes that would otherwise stay behind with
    every upgrade. A directory of the same file name that records no source (made before sources were recorded) is
    one of them too; one recording another file is not (a file of the same name elsewhere)."""
    stem = kept.name[: -len(file_fingerprint(gguf_path)) - 1]
    for other in kept.parent.glob(f"{glob.escape(stem)}-*"):
        if other == kept or not other.is_dir() or not re.fullmatch(rf"{re.escape(stem)}-[0-9a-f]{{12}}", other.name):
            continue
        try:
            source = json.loads((other / SOURCE_RECORD).read_text()).get("path")
        except (OSError, ValueError, AttributeError):
            source = None
        if source in (None, gguf_path):
            logger.info("Removing %s: an earlier conversion of %s", other, gguf_path)
            shutil.rmtree(other, ignore_errors=True)


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


def _stream_tensors(reader: Any, architecture: str, config: Any, skeleton, writer: ShardWriter,
                    deferrals: Optional[Deferrals] = None) -> None:
    """Dequantize the file's tensors one at a time, rename them as transformers' GGUF loader does (its per-
    architecture tensor processors: Q/K row order, MoE experts gathered; GPT-OSS's experts and DeepSeek's split
    kv_b_proj here: _file_part), and hand each to `writer`."""
    from collections import Counter

    import numpy as np
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor_arch = _processor_arch(architecture)
    processor = TENSOR_PROCESSORS.get(processor_arch, TensorProcessor)(config=config.to_dict())
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
             if processor_arch == "llama" else ())
    for tensor in reader.tensors:
        target = mapping.get(tensor.name.removesuffix(".weight"))
        experts = (deferrals.expert_parts(tensor.name, target)
                   if deferrals is not None and processor_arch in _GATHERS_EXPERTS else None)
        if experts is not None and target is not None:  # the processor's layout: gate rows, then up rows
            deferrals.defer(target, experts)
            seen[target] += 1
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
            seen[mapping.get(tensor.name.removesuffix(".weight"), mapping.get(tensor.name))] += 1
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


def _processor_arch(architecture: str) -> str:
    """The architecture whose transformers tensor processor reads a file of `architecture`."""
    return _PROCESSOR_OF.get(architecture, architecture)


def _file_part(architecture: str, name: str, weights, shapes: dict, config: Any,
               gathered: dict) -> Optional[tuple[str, int]]:
    """Put a tensor of the file that transformers' processors do not know, in transformers' layout, into
    `gathered`; returns (the parameter it went to, how many file tensors make that parameter), None for the
    others."""
    block, _, rest = name.partition(".")
    layer, _, role = rest.partition(".")
    if block != "blk":
        return None
    if architecture == "gpt-oss" and role in _GPT_OSS_PARTS:
        return _gpt_oss_part(layer, role, weights, shapes, gathered)
    if architecture == "deepseek2" and role in ("attn_k_b.weight", "attn_v_b.weight"):
        return _deepseek_kv_b_part(layer, role, weights, config, gathered)
    return None


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


def _write_hf_dir(gguf_path: str, out_dir: Path) -> str:
    """Write the converted checkpoint of `gguf_path` to `out_dir`; returns the file's architecture."""
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
    config = config_from_keys(architecture, keys, shapes)
    if config is None:
        config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
        correct_config(config, architecture, keys, shapes)
    # The meta-device skeleton only supplies the HF parameter names for the GGUF -> HF name mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # GGUF metadata has no architecture class name; record the one transformers picked.
    config.architectures = [type(skeleton).__name__]
    writer = ShardWriter(out_dir, SHARD_BYTES, "float32")  # float32 keeps the dequantized values exact
    try:
        deferrals = (Deferrals({t.name: int(t.tensor_type) for t in reader.tensors})
                     if blocks_stay_in_file(gguf_path) else None)
        _stream_tensors(reader, architecture, config, skeleton, writer, deferrals)
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
        # AutoTokenizer would read the config with transformers' reader, which fails on the files whose config is
        # built from the keys; their tokenizer class is the generic fast one
        tokenizer_class = PreTrainedTokenizerFast if architecture in KEY_BUILT else AutoTokenizer
        tokenizer = tokenizer_class.from_pretrained(src_dir, gguf_file=file_name)
    except (KeyError, ValueError, OSError) as err:
        # A weights-only GGUF is still a usable model when the tokenizer is supplied separately.
        logger.warning("GGUF %s carries no usable tokenizer (%s); the converted dir has none", gguf_path, err)
    else:
        tokenizer.save_pretrained(out_dir)
    return architecture

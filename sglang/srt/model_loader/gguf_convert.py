"""Turn a GGUF checkpoint into a cached Hugging Face directory (config, float32 safetensors shards, tokenizer).

The dequantization is slow (tens of seconds for a 135M model), so the result is stored once per GGUF file under
the cache root and published with an atomic rename: a process that races another one either sees no directory or
a complete one, never a half-written one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root

logger = logging.getLogger(__name__)

# Part of every cache key: bump it when the layout of a converted directory changes, so stale entries are rebuilt.
CONVERTER_VERSION = "3"


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


def _stream_tensors(gguf_path: str, skeleton, writer: ShardWriter) -> None:
    """Dequantize the file's tensors one at a time, rename them as transformers' GGUF loader does (its per-
    architecture tensor processors: Q/K row order, MoE experts gathered), and hand each to `writer`."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    parsed = load_gguf_checkpoint(gguf_path, return_tensors=False)  # the config only: no tensor is read
    reader = GGUFReader(gguf_path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    parsed["tensors"] = {}  # where the MoE processors gather expert tensors
    for tensor in reader.tensors:
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=mapping, parsed_parameters=parsed)
        if result.name in mapping:
            writer.add(mapping[result.name], torch.from_numpy(np.copy(result.weights)))
        for name in list(parsed["tensors"]):
            writer.add(name, parsed["tensors"].pop(name))


def _write_hf_dir(gguf_path: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, file_name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
    # The meta-device skeleton only supplies the HF parameter names for the GGUF -> HF name mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # GGUF metadata has no architecture class name; record the one transformers picked.
    config.architectures = [type(skeleton).__name__]
    writer = ShardWriter(out_dir, SHARD_BYTES, "float32")  # float32 keeps the dequantized values exact
    try:
        _stream_tensors(gguf_path, skeleton, writer)
        writer.finish()
    except ValueError as err:
        raise ValueError(f"{err}: {gguf_path}") from err
    del skeleton

    config.save_pretrained(out_dir)
    try:
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    except (ValueError, TypeError) as err:
        logger.warning("No generation_config.json derived from %s: %s", gguf_path, err)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
    except (KeyError, ValueError, OSError) as err:
        # A weights-only GGUF is still a usable model when the tokenizer is supplied separately.
        logger.warning("GGUF %s carries no usable tokenizer (%s); the converted dir has none", gguf_path, err)
    else:
        tokenizer.save_pretrained(out_dir)

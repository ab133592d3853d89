"""Turn a GGUF checkpoint into a cached Hugging Face directory (config, float32 safetensors shards, tokenizer).

Files of 256 MiB or more leave their block tensors in the file: the directory records where each is read from
(model_loader/gguf_deferred.py) and stores the small float tensors alone, instead of 4 bytes per weight on disk;
their row order is learnt without dequantizing them (model_loader/gguf_tensor_stream.py).

The dequantization of a file converted whole is slow (tens of seconds for a 135M model), so the result is stored
once per GGUF file under the cache root and published with an atomic rename: a process that races another one
either sees no directory or a complete one, never a half-written one.

The config is transformers' reading of the file's metadata, corrected where it leaves keys llama.cpp writes unread,
or built from the metadata for the architectures transformers' reader cannot read (model_loader/gguf_configs.py).
Tensors are renamed as transformers' GGUF loader names them, with the file's layouts it does not know (GPT-OSS's
experts, DeepSeek's split `kv_b_proj`) put back in the checkpoint's here.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root
from sglang.srt.model_loader.gguf_configs import KEY_BUILT, config_from_keys, correct_config
from sglang.srt.model_loader.gguf_deferred import Deferrals
from sglang.srt.model_loader.gguf_tensor_stream import processor_arch, stream_tensors

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
# file, 6.4 GB for a 1.7B model's 0.96 GB one), and writing it is most of a first start (a 1.7B Q4_0 file: 51 s
# converted whole, 16 s with its blocks left in the file; 2-core Zen 4). Smaller files (SmolLM2-135M's, ~100 MB)
# are converted whole, so that their converted directory is a plain transformers checkpoint.
BLOCKS_STAY_FROM_BYTES = 256 << 20


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
    qk_rows = "interleaved" if processor_arch(architecture or "") == "llama" else "as stored"
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
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)  # one parse of the file for its metadata and its tensors
    with _parsed_once(gguf_path, reader):
        return _convert(gguf_path, out_dir, reader)


@contextlib.contextmanager
def _parsed_once(gguf_path: str, reader: Any) -> Iterator[None]:
    """While converting: transformers' GGUF config and tokenizer readers get `reader` instead of parsing the file
    again (each parse of a 49k-token vocabulary's strings takes ~3 s), and gguf's tensor name map of an architecture
    is built once instead of once per module of the skeleton (~15 ms each, 319 modules at SmolLM2-1.7B's shape)."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = os.path.realpath(gguf_path)

    def reader_of(file: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and os.path.realpath(file) == path:
            return reader
        return real_reader(file, *args, **kwargs)

    replaced = {"GGUFReader": reader_of, "get_tensor_name_map": functools.lru_cache(maxsize=None)(real_name_map)}
    originals = {"GGUFReader": real_reader, "get_tensor_name_map": real_name_map}
    for name, value in replaced.items():
        setattr(gguf, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


def _convert(gguf_path: str, out_dir: Path, reader: Any) -> str:
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        PreTrainedTokenizerFast,
    )

    src_dir, file_name = os.path.split(gguf_path)
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
        stream_tensors(reader, architecture, config, skeleton, writer, deferrals)
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

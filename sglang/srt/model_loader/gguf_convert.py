"""Turn a GGUF checkpoint into a cached Hugging Face directory (config, float32 safetensors, tokenizer).

The dequantization is slow (tens of seconds for a 135M model), so the result is stored once per GGUF file under
the cache root and published with an atomic rename: a process that races another one either sees no directory or
a complete one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root

logger = logging.getLogger(__name__)

# Part of every cache key: bump it when the layout of a converted directory changes, so stale entries are rebuilt.
CONVERTER_VERSION = "2"


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


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """Silence the per-tensor tqdm bar of transformers' GGUF loader (it uses tqdm directly, not its own switch)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _write_hf_dir(gguf_path: str, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src_dir, file_name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
    # The meta-device skeleton only supplies the HF parameter names for the GGUF -> HF name mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # GGUF metadata has no architecture class name; record the one transformers picked.
    config.architectures = [type(skeleton).__name__]
    with _quiet_gguf_progress():
        checkpoint = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)
    del skeleton
    # Float32 keeps the dequantized values exact; the loader casts to the serving dtype later.
    tensors = {name: t.to(torch.float32).contiguous() for name, t in checkpoint["tensors"].items()}
    if not tensors:
        raise ValueError(f"No tensors could be read from {gguf_path}")
    weights_file = out_dir / "model.safetensors"
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    os.chmod(weights_file, 0o644)  # safetensors creates it owner-only, unlike the JSON files beside it
    del tensors, checkpoint

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

"""Stream (name, tensor) pairs out of a Hugging Face checkpoint directory, one file at a time."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_INDEX = "pytorch_model.bin.index.json"


def weight_files(model_dir: str) -> list[Path]:
    """The checkpoint files to read: safetensors when present, else pytorch_model*.bin.

    When a shard index exists only the files it names are used, because some repos keep an extra consolidated
    copy of the same weights next to the shards.
    """
    root = Path(model_dir)
    for index_name, pattern in ((SAFETENSORS_INDEX, "*.safetensors"), (PYTORCH_INDEX, "pytorch_model*.bin")):
        index = root / index_name
        if index.is_file():
            with open(index) as f:
                shard_names = sorted(set(json.load(f)["weight_map"].values()))
            return [root / name for name in shard_names]
        files = sorted(root.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"No *.safetensors or pytorch_model*.bin weights in {os.path.abspath(model_dir)}")


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint under its stored name, on CPU, in its stored dtype."""
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            yield from _iterate_safetensors(path)
        else:
            yield from _iterate_pickled(path)


def _iterate_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _iterate_pickled(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # weights_only refuses arbitrary pickled code; mmap avoids holding a second copy of a big shard in memory.
    state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    try:
        yield from state.items()
    finally:
        del state

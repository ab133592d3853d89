"""Stream (name, tensor) pairs out of a Hugging Face checkpoint directory, one file at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from sglang.srt.layers.linear import MergedLinear, copy_checked

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


def iterate_weights(model_dir: str, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint under its stored name, on CPU, in its stored dtype; a quantized
    checkpoint's linear weights dequantized to its float dtype instead (model_loader/quantized_weights.py); a
    converted GGUF file's block tensors read from the file (model_loader/gguf_deferred.py). Tensors named in `skip`
    (of a model that does not read them: `released_checkpoint_names`) are not read where the checkpoint allows."""
    from sglang.srt.model_loader.quant_config import dequantized_dtype, resolve_quantization

    scheme = resolve_quantization(model_dir, None)
    if scheme is not None:
        from sglang.srt.model_loader.quantized_weights import iterate_dequantized

        yield from iterate_dequantized(weight_files(model_dir), scheme, dequantized_dtype(model_dir, scheme))
        return
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            yield from _iterate_safetensors(path, skip)
        else:
            yield from _iterate_pickled(path)
    from sglang.srt.model_loader.gguf_deferred import DEFERRED_RECORD, iterate_deferred

    if (Path(model_dir) / DEFERRED_RECORD).is_file():
        yield from iterate_deferred(model_dir, skip)


def safetensors_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, in its order."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def read_safetensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, from a mapping of the file opened for it alone: the tensor is a view of
    that mapping, which goes with it, where one mapping kept open for a whole shard would keep every page read so
    far resident in the process (up to a shard's bytes beside the model being filled)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def _iterate_safetensors(path: Path, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    for name in safetensors_names(path):
        if name not in skip:
            yield name, read_safetensor(path, name)


def _iterate_pickled(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # weights_only refuses arbitrary pickled code; mmap avoids holding a second copy of a big shard in memory.
    state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    try:
        yield from state.items()
    finally:
        del state


# Buffers some checkpoints carry that are derived from the config, not learned.
_DERIVED_BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_checkpoint_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tied_aliases: Optional[dict[str, str]] = None,
    partial: bool = False,
) -> None:
    """Copy checkpoint tensors into `model`, slicing q/k/v and gate/up into their fused modules and per-expert
    tensors into stacked expert parameters (modules with `checkpoint_pieces`, e.g. layers/moe/fused_moe.py).

    `tied_aliases` maps a checkpoint name onto the parameter it shares storage with (lm_head -> embeddings);
    it is used only when the target itself is absent from the checkpoint. Raises ValueError naming every
    missing or unexpected checkpoint weight (`partial`: `weights` are some of the model's, none is missing).
    """
    tied_aliases = tied_aliases or {}
    params = dict(model.named_parameters())
    shard_targets: dict[str, tuple[MergedLinear, str, str]] = {}
    fused_param_names: set[str] = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
        for leaf, _ in module.named_parameters(recurse=False):
            fused_param_names.add(f"{prefix}.{leaf}")
            for shard_name in module.shard_rows:
                checkpoint_name = f"{parent}.{shard_name}.{leaf}" if parent else f"{shard_name}.{leaf}"
                shard_targets[checkpoint_name] = (module, shard_name, leaf)
    expected = set(shard_targets) | {name for name in params if name not in fused_param_names}
    expected -= released_checkpoint_names(model)
    piece_targets = _piece_targets(model)
    slicers = _tp_slicers(model)

    loaded: set[str] = set()
    unexpected: list[str] = []
    alias_tensors: dict[str, tuple[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(_DERIVED_BUFFER_SUFFIXES):
                continue
            if name in shard_targets:
                module, shard_name, leaf = shard_targets[name]
                module.load_shard(leaf, shard_name, tensor, name)
            elif name in piece_targets:
                piece_targets[name][1](tensor, name)
            elif name in params and name not in fused_param_names:
                copy_checked(params[name].data, slicers.get(name, _whole)(tensor), name)
            elif name in tied_aliases:
                if tied_aliases[name] not in loaded:
                    alias_tensors[tied_aliases[name]] = (name, tensor)
                continue
            else:
                unexpected.append(name)
                continue
            loaded.add(name)
            alias_tensors.pop(name, None)
        for target, (source_name, tensor) in alias_tensors.items():
            if target not in loaded:
                copy_checked(params[target].data, slicers.get(target, _whole)(tensor), source_name)
                loaded.add(target)

    missing = [] if partial else _missing_with_pieces(expected, loaded, piece_targets)
    if missing:
        raise ValueError(f"Checkpoint is missing {len(missing)} weight(s): {_name_list(missing)}")
    if unexpected:
        raise ValueError(
            f"Checkpoint has {len(unexpected)} weight(s) the model does not use: {_name_list(sorted(unexpected))}"
        )


PieceLoader = Callable[[torch.Tensor, str], None]


def released_checkpoint_names(model: nn.Module) -> set[str]:
    """The checkpoint names of the parameters released before the checkpoint is read (meta tensors: blocks read
    from elsewhere serve their values, e.g. model_loader/gguf_quant.linears_read_from_file): loading neither reads
    nor expects them. Their own names, the shards of fused layers (`q_proj` of `qkv_proj`) and the per-expert pieces
    of stacked experts."""
    released = {name for name, param in model.named_parameters() if param.is_meta}
    for prefix, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
            for leaf, param in module.named_parameters(recurse=False):
                if param.is_meta:
                    released.update(f"{parent}.{shard}.{leaf}" if parent else f"{shard}.{leaf}"
                                    for shard in module.shard_rows)
    released.update(piece for piece, (param, _) in _piece_targets(model).items() if param in released)
    return released


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _tp_slicers(model: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Parameter name -> this tensor-parallel rank's part of its checkpoint tensor, from every module with
    `checkpoint_slicers()` (row-parallel linears, vocabulary-parallel embeddings; layers/linear.py)."""
    slicers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "checkpoint_slicers", None)
        if callable(own):
            slicers.update({f"{prefix}.{leaf}" if prefix else leaf: fn for leaf, fn in own().items()})
    return slicers


def _piece_targets(model: nn.Module) -> dict[str, tuple[str, PieceLoader]]:
    """Checkpoint names of the pieces of parameters that checkpoints may store split (stacked experts: one tensor
    per expert), from every module with a `checkpoint_pieces(prefix)` method: name -> (parameter, loader)."""
    targets: dict[str, tuple[str, PieceLoader]] = {}
    for prefix, module in model.named_modules():
        pieces = getattr(module, "checkpoint_pieces", None)
        if callable(pieces):
            targets.update(pieces(prefix))
    return targets


def _missing_with_pieces(expected: set[str], loaded: set[str],
                         piece_targets: dict[str, tuple[str, PieceLoader]]) -> list[str]:
    """Expected names not loaded; a parameter loaded piece by piece is complete when all its pieces were, and
    otherwise reported by its missing pieces (the names a checkpoint of that layout lacks)."""
    pieces_of: dict[str, list[str]] = {}
    for piece, (param, _) in piece_targets.items():
        pieces_of.setdefault(param, []).append(piece)
    missing: list[str] = []
    for name in expected - loaded:
        missing += [p for p in pieces_of[name] if p not in loaded] if name in pieces_of else [name]
    return sorted(missing)


def _name_list(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"

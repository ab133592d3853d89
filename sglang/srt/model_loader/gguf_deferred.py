"""A GGUF file's block tensors read from the file when the model loads, instead of float32 copies in the converted
checkpoint.

The conversion (model_loader/gguf_convert.py) writes the tensors of a block type (Q4_0 .. Q8_0, the K-quants) that
map to one checkpoint tensor as they are or with their Q / K rows put back in the checkpoint's order, and the
stacked experts (gate and up rows side by side in `gate_up_proj`, `down_proj` as stored), not as float32 safetensors
but as entries of `gguf_deferred.json`: the checkpoint name, the file tensors it is made of and the row order. Those
are most of a model's bytes: a converted directory then holds the norms and the other small float tensors, where
the float32 copy of the whole model took 4 bytes per weight on disk (28 GB for a 7B model).

`iterate_deferred` yields them when a model is read from the converted directory (model_loader/weights.py), each
dequantized by `gguf`'s reference dequantization as the conversion itself does, and skips those the model does not
read: where blocks serve every batch, the linear layers and experts are read from the file's blocks alone
(model_loader/gguf_quant.py, gguf_experts.py) and never dequantized.
"""

from __future__ import annotations

import json
import os
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.layers.quantization.gguf_blocks import rotary_rows_gguf_to_hf
from sglang.srt.model_loader.gguf_reader import GGML_BLOCK_TYPES, gguf_tensor_table

DEFERRED_RECORD = "gguf_deferred.json"
# the file's stacked experts by role: gate and up fill `gate_up_proj` (gate rows first), down `down_proj`
_EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class Deferrals:
    """The checkpoint tensors a conversion leaves in the file: {checkpoint name: {"parts": [file tensor names],
    "heads": Q / K heads whose rows go back to the checkpoint's order, or None}}."""

    def __init__(self, tensor_types: dict[str, int]) -> None:
        self.types = tensor_types  # file tensor name -> GGML type id
        self.entries: dict[str, dict[str, Any]] = {}

    def block_typed(self, *names: str) -> bool:
        return all(self.types.get(name) in GGML_BLOCK_TYPES for name in names)

    def expert_parts(self, file_name: str, target: Optional[str]) -> Optional[list[str]]:
        """For a stacked expert tensor of the file whose checkpoint tensor is `target`: the file tensors that make
        that tensor (gate and up, or down) where every one is of a block type; None otherwise."""
        stem, _, suffix = file_name.rpartition(".")
        layer, _, role = stem.rpartition(".")
        if target is None or suffix != "weight" or role not in _EXPERT_ROLES:
            return None
        roles = ["ffn_down_exps"] if role == "ffn_down_exps" else ["ffn_gate_exps", "ffn_up_exps"]
        parts = [f"{layer}.{r}.weight" for r in roles]
        return parts if self.block_typed(*parts) else None

    def defer(self, target: str, parts: list[str], heads: Optional[int] = None) -> None:
        self.entries[target] = {"parts": parts, "heads": heads}

    def defer_matrix(self, target: str, file_name: str, stored: np.ndarray, value: np.ndarray,
                     heads: tuple[int, ...]) -> bool:
        """Leave `target` in the file where it is a block tensor's values `stored` as they are, or with the Q / K
        rows of one of `heads` put back in the checkpoint's order (transformers' Llama processor), which `value` (the
        converted tensor) is checked against; returns whether it was left."""
        if not self.block_typed(file_name) or stored.ndim != 2 or value.shape != stored.shape:
            return False
        return self._defer_in_row_order(target, file_name, stored, value, heads)

    def defer_rows(self, target: str, file_name: str, order: np.ndarray, want: Optional[tuple[int, ...]],
                   columns: int, heads: tuple[int, ...]) -> bool:
        """Leave `target` in the file where it is the block tensor `file_name` ([rows, columns], checkpoint shape
        `want`) with its rows in `order` (the file row of each checkpoint row): as stored, or with the Q / K rows of
        one of `heads` put back in the checkpoint's order; returns whether it was left."""
        rows = len(order)
        if not self.block_typed(file_name) or want != (rows, columns):
            return False
        return self._defer_in_row_order(target, file_name, np.arange(rows), order, heads)

    def _defer_in_row_order(self, target: str, file_name: str, stored: np.ndarray, value: np.ndarray,
                            heads: tuple[int, ...]) -> bool:
        """Defer `target` where `value` is `stored` with its rows as they are or with the Q / K rows of one of
        `heads` put back in the checkpoint's order (the first that matches); returns whether it was deferred."""
        for count in (None, *heads):
            if count is not None and stored.shape[0] % (2 * count):
                continue
            if np.array_equal(_rows(stored, count), value):
                self.defer(target, [file_name], count)
                return True
        return False

    def write(self, out_dir: Path) -> None:
        (out_dir / DEFERRED_RECORD).write_text(json.dumps(self.entries, indent=1))


def _rows(values: Any, heads: Optional[int]) -> Any:
    return values if heads is None else values[rotary_rows_gguf_to_hf(values.shape[0], heads).numpy()]


def iterate_deferred(model_dir: str | os.PathLike, skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The deferred tensors of a converted directory (float32, the checkpoint's layout), dequantized one at a time
    from the GGUF file it was converted from (its source record); those named in `skip` are not read."""
    from gguf import GGMLQuantizationType, dequantize

    from sglang.srt.model_loader.gguf_convert import SOURCE_RECORD

    entries = json.loads((Path(model_dir) / DEFERRED_RECORD).read_text())
    gguf_path = json.loads((Path(model_dir) / SOURCE_RECORD).read_text())["path"]
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"{model_dir} reads its weights from the GGUF file {gguf_path}, which is missing")
    data, table = gguf_tensor_table(gguf_path)
    where = {name: (dims, ttype, offset) for name, dims, ttype, offset in table}
    for target, entry in entries.items():
        if target in skip:
            continue
        values = []
        for part in entry["parts"]:
            dims, ttype, offset = where[part]
            _, per_block, block_bytes = GGML_BLOCK_TYPES[ttype]
            shape = [*reversed(dims[1:]), dims[0] // per_block * block_bytes]  # [(experts,) rows, row bytes]
            raw = data[offset : offset + int(np.prod(shape))].reshape(shape)
            values.append(dequantize(raw, GGMLQuantizationType(ttype)))
        value = np.concatenate(values, axis=-2) if len(values) > 1 else values[0]
        yield target, torch.from_numpy(np.ascontiguousarray(_rows(value, entry["heads"]), dtype=np.float32))

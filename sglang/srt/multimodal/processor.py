"""Images -> what a Qwen2-VL-family model needs: pixel patches, the expanded prompt and its M-RoPE positions.

The prompt names each image with one `<|image_pad|>` token (the chat template writes
`<|vision_start|><|image_pad|><|vision_end|>`); it is expanded here to one pad per merged patch, which is the
number of embeddings the vision encoder produces for that image. A run that already has that many pads (a
prompt given as expanded token ids) is kept.

For the prefix cache, the pad ids of each image are replaced by an id derived from a hash of its pixels
(beyond the vocabulary, so no text token equals it): two different images never share a cached prefix and the
same image hits. The model maps those ids back before its embedding lookup and overwrites the rows anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from sglang.srt.layers.mrope import mrope_prompt_positions
from sglang.srt.multimodal.forward_inputs import GridTHW

CACHE_ID_RANGE = 1 << 30


@dataclass
class ImageInput:
    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch]
    grid_thw: GridTHW
    offset: int  # first prompt token of the image
    num_tokens: int  # its pad tokens: t * h * w / merge**2
    cache_id: int  # the id its pad tokens carry in the prompt the scheduler receives


@dataclass
class MultimodalInputs:
    """The image part of one request, carried from the tokenizer manager to the scheduler."""

    images: list[ImageInput]
    prompt_len: int
    mrope_positions: Optional[torch.Tensor] = None  # [3, prompt_len]; None for models without M-RoPE
    mrope_position_delta: int = 0  # text positions after the prompt: sequence index + delta

    def first_image_offset(self) -> int:
        return self.images[0].offset if self.images else -1


def saved_image_processor_config(model_dir: str) -> dict[str, Any]:
    """The image processor settings a checkpoint ships: preprocessor_config.json (the hub's files), else the
    "image_processor" part of processor_config.json (what transformers >= 5 writes); {} when it has neither."""
    for name, part in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                saved = json.load(f)
            saved = saved.get(part) if part else saved
            if isinstance(saved, dict):
                return saved
    return {}


class ImageProcessor(Protocol):
    """What the tokenizer manager needs of a model's image processor."""

    @property
    def placeholder(self) -> str:
        """What a chat prompt writes where an image goes."""
        ...

    def process(self, input_ids: list[int], images: list[Any]) -> tuple[list[int], MultimodalInputs]:
        """(prompt ids with each image's tokens expanded and keyed by its pixels, the multimodal inputs)."""
        ...


class QwenVLImageProcessor:
    """Qwen2-VL / Qwen2.5-VL image preprocessing (the PIL implementation of transformers: no torchvision)."""

    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model_dir: str, hf_config: Any, vocab_size: int) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        saved = saved_image_processor_config(model_dir)
        kwargs: dict[str, Any] = {k: saved[k] for k in ("min_pixels", "max_pixels", "size", "patch_size",
                                                        "merge_size", "temporal_patch_size", "image_mean",
                                                        "image_std") if k in saved}
        vision = hf_config.vision_config
        kwargs.setdefault("patch_size", vision.patch_size)
        kwargs.setdefault("merge_size", vision.spatial_merge_size)
        kwargs.setdefault("temporal_patch_size", vision.temporal_patch_size)
        self.image_processor = Qwen2VLImageProcessorPil(**kwargs)
        self.merge = int(vision.spatial_merge_size)
        self.image_token_id = int(hf_config.image_token_id)
        self.vocab_size = vocab_size

    def preprocess(self, images: list[Any]) -> list[tuple[torch.Tensor, GridTHW]]:
        """(pixel patches, (t, h, w) grid) per PIL image."""
        out = []
        for image in images:
            batch = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
            t, h, w = (int(x) for x in batch["image_grid_thw"][0].tolist())
            out.append((batch["pixel_values"], (t, h, w)))
        return out

    def process(self, input_ids: list[int], images: list[Any]) -> tuple[list[int], MultimodalInputs]:
        """(prompt ids with expanded, hash-keyed image tokens, the request's multimodal inputs)."""
        processed = self.preprocess(images)
        runs = _pad_runs(input_ids, self.image_token_id)
        if len(runs) != len(processed):
            raise ValueError(
                f"image_data has {len(processed)} image(s) but the prompt has {len(runs)} image placeholder(s) "
                "(<|vision_start|><|image_pad|><|vision_end|>)"
            )
        ids: list[int] = []
        inputs: list[ImageInput] = []
        cursor = 0
        for (start, length), (pixels, grid) in zip(runs, processed):
            t, h, w = grid
            n = t * h * w // self.merge**2
            if length not in (1, n):
                raise ValueError(f"an image placeholder has {length} pad tokens; expected 1 or {n}")
            ids.extend(input_ids[cursor:start])
            cache_id = self.vocab_size + pixel_hash(pixels, grid) % CACHE_ID_RANGE
            inputs.append(ImageInput(pixels, grid, len(ids), n, cache_id))
            ids.extend([cache_id] * n)
            cursor = start + length
        ids.extend(input_ids[cursor:])
        positions, delta = mrope_prompt_positions(len(ids), [(im.offset, im.grid_thw) for im in inputs],
                                                  self.merge)
        return ids, MultimodalInputs(inputs, len(ids), positions, delta)


def _pad_runs(ids: list[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive pad tokens."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == pad_id:
            j = i
            while j < len(ids) and ids[j] == pad_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def pixel_hash(pixels: torch.Tensor, grid: GridTHW) -> int:
    digest = hashlib.sha256(repr(grid).encode())
    digest.update(pixels.contiguous().numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little")


def image_processor_for(model_dir: str, hf_config: Any, vocab_size: int, tokenizer_path: Optional[str] = None
                        ) -> Optional[ImageProcessor]:
    """The image processor of a vision-language model, None for a text-only model. `tokenizer_path` (default:
    model_dir) is read by the processors whose prompt expansion re-tokenizes text around an image."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if any(a in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration") for a in architectures):
        return QwenVLImageProcessor(model_dir, hf_config, vocab_size)
    if "Gemma3ForConditionalGeneration" in architectures:
        from sglang.srt.multimodal.gemma3_processor import Gemma3ImageInputProcessor

        return Gemma3ImageInputProcessor(model_dir, hf_config, vocab_size, tokenizer_path or model_dir)
    return None

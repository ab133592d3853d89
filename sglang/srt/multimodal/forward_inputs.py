"""The multimodal part of one model forward: which image embeddings go where, the image spans of each sequence,
and the M-RoPE positions (for the models that use them).

Built by the scheduler (managers/scheduler/multimodal_batch.py) for the tokens a step runs; read by the
vision-language models. Nothing here depends on the managers or the models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

GridTHW = tuple[int, int, int]


@dataclass
class ImageChunk:
    """Rows [embed_start, embed_start + embed_len) of one image's embeddings, placed at flat token offset
    `token_offset` of the forward (a prompt chunk may cover only part of an image)."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch], the whole image
    grid_thw: GridTHW
    token_offset: int
    embed_start: int
    embed_len: int


@dataclass
class MultimodalForward:
    # [3, num_tokens] M-RoPE position ids of every token of the forward (text tokens repeat their position); None
    # when no request of the forward carries M-RoPE positions (models without M-RoPE).
    mrope_positions: Optional[torch.Tensor] = None
    images: list[ImageChunk] = field(default_factory=list)
    # Per sequence of the forward: the [start, end) sequence positions of each image whose tokens it extends
    # (a model that lets an image's tokens attend to each other reads them).
    image_spans: list[list[tuple[int, int]]] = field(default_factory=list)


class RequestImages(Protocol):
    """What the builder reads of a request's multimodal inputs (multimodal/processor.py MultimodalInputs)."""

    mrope_positions: Optional[torch.Tensor]  # None: the model has no M-RoPE
    mrope_position_delta: int
    images: Sequence[Any]


def build_multimodal_forward(
    requests: Sequence[Optional[RequestImages]], prefix_lens: Sequence[int], extend_lens: Sequence[int]
) -> Optional[MultimodalForward]:
    """The multimodal inputs of a forward that runs tokens [prefix, prefix + extend) of each request.

    None when no request has images (the plain positions are then the M-RoPE positions). Tokens past a
    request's prompt (its outputs) are text at sequence index + mrope_position_delta.
    """
    if all(r is None for r in requests):
        return None
    with_mrope = any(r is not None and r.mrope_positions is not None for r in requests)
    rows: list[torch.Tensor] = []
    chunks: list[ImageChunk] = []
    spans: list[list[tuple[int, int]]] = []
    flat = 0
    for mm, prefix, ext in zip(requests, prefix_lens, extend_lens):
        end = prefix + ext
        seq_spans: list[tuple[int, int]] = []
        spans.append(seq_spans)
        if mm is None or mm.mrope_positions is None:
            rows.append(torch.arange(prefix, end).expand(3, -1))
        else:
            prompt_len = mm.mrope_positions.shape[1]
            in_prompt = mm.mrope_positions[:, prefix:min(end, prompt_len)]
            after = torch.arange(max(prefix, prompt_len), max(end, prompt_len)) + mm.mrope_position_delta
            rows.append(torch.cat([in_prompt, after.expand(3, -1)], dim=1))
        for image in (mm.images if mm is not None else []):
            lo, hi = max(prefix, image.offset), min(end, image.offset + image.num_tokens)
            if lo < hi:
                chunks.append(ImageChunk(image.pixel_values, image.grid_thw, flat + lo - prefix,
                                         lo - image.offset, hi - lo))
                seq_spans.append((image.offset, image.offset + image.num_tokens))
        flat += ext
    mrope = torch.cat(rows, dim=1).to(torch.int64) if with_mrope else None
    return MultimodalForward(mrope, chunks, spans)

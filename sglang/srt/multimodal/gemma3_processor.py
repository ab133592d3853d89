"""Images -> what Gemma 3 needs: one 896x896 (the checkpoint's `image_size`) pixel tensor per image and the prompt
expanded as Gemma 3's processor writes it.

A prompt names an image with its begin-of-image token (`<start_of_image>`, what Gemma 3's chat template writes for
an image part). The processor replaces that token, in the text, by
`"\\n\\n" + boi + image_token * mm_tokens_per_image + eoi + "\\n\\n"`. Here the prompt arrives as token ids, so the
ordinary text runs on either side of the token (between it and the nearest special token) are decoded, given
their "\\n\\n" and tokenized again: the ids equal those of tokenizing the expanded text, newlines merged with their
neighbours as the tokenizer merges them. A boi already followed by its image tokens and eoi (a prompt given as
expanded ids) is kept as it is.

The image tokens carry an id derived from a hash of the pixels (as for the other vision models, see
multimodal/processor.py), so the prefix cache never confuses two images. Pan-and-scan (extra crops) is off, as
in the processor's defaults.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from sglang.srt.multimodal.processor import (
    CACHE_ID_RANGE,
    ImageInput,
    MultimodalInputs,
    pixel_hash,
    saved_image_processor_config,
)

# preprocessor_config.json keys that describe the pixels (the rest concern pan-and-scan or the file itself)
_PIXEL_KEYS = ("size", "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
               "image_std", "do_convert_rgb")
_NEWLINES = "\n\n"


class Gemma3ImageInputProcessor:
    def __init__(self, model_dir: str, hf_config: Any, vocab_size: int, tokenizer_path: str) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        vision = hf_config.vision_config
        kwargs: dict[str, Any] = {"size": {"height": vision.image_size, "width": vision.image_size}}
        saved = saved_image_processor_config(model_dir)
        kwargs.update({k: saved[k] for k in _PIXEL_KEYS if saved.get(k) is not None})
        kwargs["do_pan_and_scan"] = False
        self.image_processor = Gemma3ImageProcessorPil(**kwargs)
        self.patch_size = int(vision.patch_size)
        self.tokens_per_image = int(hf_config.mm_tokens_per_image)
        self.image_token_id = _config_id(hf_config, "image_token_id", "image_token_index")
        self.boi_token_id = _config_id(hf_config, "boi_token_id", "boi_token_index")
        self.eoi_token_id = _config_id(hf_config, "eoi_token_id", "eoi_token_index")
        self.vocab_size = vocab_size
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._special_ids: set[int] = set()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on first use (only requests with images and chat prompts need it)."""
        if self._tokenizer is None:
            from sglang.srt.tokenizer_utils import get_tokenizer

            tokenizer = get_tokenizer(self.tokenizer_path)
            self._special_ids = {int(i) for i in tokenizer.added_tokens_decoder} | set(tokenizer.all_special_ids)
            self._special_ids |= {self.boi_token_id, self.eoi_token_id, self.image_token_id}
            self._tokenizer = tokenizer
        return self._tokenizer

    @property
    def special_ids(self) -> set[int]:
        """The ids a tokenizer never merges with text: the text runs between them are tokenized on their own."""
        if self._tokenizer is None:
            self._tokenizer = self.tokenizer
        return self._special_ids

    @property
    def placeholder(self) -> str:
        return str(self.tokenizer.convert_ids_to_tokens(self.boi_token_id))

    def preprocess(self, images: list[Any]) -> list[torch.Tensor]:
        """[1, 3, image_size, image_size] pixels per PIL image."""
        return [self.image_processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
                for image in images]

    def process(self, input_ids: list[int], images: list[Any]) -> tuple[list[int], MultimodalInputs]:
        pixels = self.preprocess(images)
        segments = self._segments(input_ids)
        boi_at = [i for i, s in enumerate(segments) if s == self.boi_token_id]
        if len(boi_at) != len(pixels):
            raise ValueError(f"image_data has {len(pixels)} image(s) but the prompt has {len(boi_at)} image "
                             f"placeholder(s) ({self.placeholder})")
        # Each boi not yet followed by its image tokens gets them, and "\n\n" joins the text on either side of it.
        expanded: list[Union[int, list[int], str]] = []
        for i, seg in enumerate(segments):
            if seg == self.boi_token_id and not self._is_expanded(segments, i):
                previous = expanded[-1] if expanded else None
                if isinstance(previous, (list, str)):
                    expanded[-1] = self._text(previous) + _NEWLINES
                else:
                    expanded.append(_NEWLINES)
                expanded.extend([self.boi_token_id] + [self.image_token_id] * self.tokens_per_image
                                + [self.eoi_token_id])
                expanded.append(_NEWLINES)
            elif isinstance(seg, list) and expanded and isinstance(expanded[-1], str):
                expanded[-1] += self._text(seg)
            else:
                expanded.append(seg)
        ids: list[int] = []
        for item in expanded:
            if isinstance(item, str):
                ids.extend(self.tokenizer.encode(item, add_special_tokens=False))
            elif isinstance(item, list):
                ids.extend(item)
            else:
                ids.append(item)
        return self._key_images(ids, pixels)

    def _text(self, seg: Union[list[int], str]) -> str:
        if isinstance(seg, str):
            return seg
        return str(self.tokenizer.decode(seg, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _segments(self, input_ids: list[int]) -> list[Union[int, list[int]]]:
        """The prompt as special tokens (ints) and the runs of ordinary tokens between them (lists)."""
        special = self.special_ids
        segments: list[Union[int, list[int]]] = []
        for token in input_ids:
            if token in special:
                segments.append(token)
            elif segments and isinstance(segments[-1], list):
                segments[-1].append(token)
            else:
                segments.append([token])
        return segments

    def _is_expanded(self, segments: list[Union[int, list[int]]], i: int) -> bool:
        n = self.tokens_per_image
        following = segments[i + 1 : i + 2 + n]
        if not following or following[0] != self.image_token_id:
            return False
        if following != [self.image_token_id] * n + [self.eoi_token_id]:
            raise ValueError(f"an expanded image must have {n} image tokens followed by the end-of-image token")
        return True

    def _key_images(self, ids: list[int], pixels: list[torch.Tensor]) -> tuple[list[int], MultimodalInputs]:
        """Give each image's tokens its pixel-hash id and record where the images sit."""
        inputs: list[ImageInput] = []
        n = self.tokens_per_image
        starts = [i + 1 for i, t in enumerate(ids) if t == self.boi_token_id]
        for start, image in zip(starts, pixels):
            side = image.shape[-1] // self.patch_size
            grid = (1, image.shape[-2] // self.patch_size, side)
            cache_id = self.vocab_size + pixel_hash(image, grid) % CACHE_ID_RANGE
            ids[start : start + n] = [cache_id] * n
            inputs.append(ImageInput(image, grid, start, n, cache_id))
        return ids, MultimodalInputs(inputs, len(ids))


def _config_id(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"the model config has none of {', '.join(names)}")

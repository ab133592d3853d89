"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (SmolLM2's tokenizer with the vision tokens) and test images."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def vl_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.resolve import resolve_model_path
    from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tokenizer


def tiny_vl_config(family: str, tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    ids = dict(zip(["vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"],
                   tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    eos = tokenizer.eos_token_id
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=eos,
                eos_token_id=eos, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 3, 3]})
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, spatial_merge_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    # window_size 56 = 2 merged tokens of 28 px: images of 4+ merged columns get several windows.
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, window_size=56,
                  fullatt_block_indexes=[1], spatial_merge_size=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def build_tiny_vl(family: str, model_dir: Path, seed: int = 0) -> tuple[Any, Any]:
    """(transformers model, tokenizer), both saved to model_dir (named so the qwen2-vl chat template matches)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    tokenizer = vl_tokenizer()
    config = tiny_vl_config(family, tokenizer)
    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # larger random weights than the init so images visibly change the outputs
        for name, param in model.named_parameters():
            if "visual" in name or "bias" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model, tokenizer


def noise_image(width: int, height: int, seed: int) -> Any:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()

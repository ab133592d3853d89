"""Gemma 3 with images against transformers on a tiny random checkpoint: the prompt as Gemma 3's processor writes
it, prefill logits with the image tokens attending to each other, paged decode, greedy generation through the
Engine and through OpenAI chat with image_url parts, image-keyed prefix caching and text-only prompts."""

from __future__ import annotations

import base64
import types
from typing import Any

import openai
import pytest
import torch

from sglang import Engine
from sglang.srt.model_loader.loader import load_model
from sglang.srt.multimodal.gemma3_processor import Gemma3ImageInputProcessor
from sglang.srt.multimodal.image_attention import image_block_mask
from sglang.srt.multimodal.processor import image_processor_for
from tests.server_fixtures import running_server
from tests.test_vlm_models import Runner
from tests.vlm_fixtures import noise_image, png_bytes

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TOKENS_PER_IMAGE = 4
SLIDING_WINDOW = 8  # shorter than every prompt below
TOL = 2e-4
STEPS = 8
PROMPT = "<|im_start|>user\nLook: <start_of_image> what is in this picture?<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = "<|im_start|>user\n<start_of_image><start_of_image>\nCompare them.<|im_end|>\n<|im_start|>assistant\n"
TEXT_ONLY = "<|im_start|>user\nTell me a story about a red fox.<|im_end|>\n<|im_start|>assistant\n"


def gemma3_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.resolve import resolve_model_path
    from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST),
                                         extra_special_tokens=IMAGE_TOKENS)


def build_tiny_gemma3(model_dir) -> tuple[Any, Any]:
    """(transformers model, tokenizer), saved to model_dir: SigLIP 28x28 px in 7 px patches (a 4x4 grid pooled to
    2x2 = 4 image tokens), a 4-layer Gemma 3 decoder alternating sliding-window and global layers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = gemma3_tokenizer()
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS.values()))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=SLIDING_WINDOW,
                layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=16,
                max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=7, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=boi, eoi_token_index=eoi, image_token_index=image)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger random weights than the init so images visibly change the outputs
        for name, param in model.named_parameters():
            if "vision" in name or "projector" in name or "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(model_dir)
    hf_processor(tokenizer).save_pretrained(model_dir)  # the tokenizer and preprocessor_config.json
    return model, tokenizer


def hf_processor(tokenizer: Any) -> Any:
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                           tokenizer=tokenizer, image_seq_length=TOKENS_PER_IMAGE)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-gemma3-vision")
    reference, tokenizer = build_tiny_gemma3(model_dir)
    processor = image_processor_for(str(model_dir), reference.config, len(tokenizer))
    assert isinstance(processor, Gemma3ImageInputProcessor)
    return types.SimpleNamespace(dir=str(model_dir), reference=reference, tokenizer=tokenizer, processor=processor,
                                 hf=hf_processor(tokenizer))


@pytest.fixture(scope="module")
def ours(gemma3):
    return load_model(gemma3.dir, torch.float32, "cpu")


def reference_inputs(gemma3, text: str, images: list[Any]) -> dict[str, torch.Tensor]:
    inputs = gemma3.hf(images=images or None, text=text, return_tensors="pt")
    if "token_type_ids" not in inputs:
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    return dict(inputs)


def reference_greedy(gemma3, text: str, images: list[Any]) -> list[int]:
    inputs = reference_inputs(gemma3, text, images)
    with torch.inference_mode():
        out = gemma3.reference.generate(**inputs, max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def runner(gemma3, model) -> Runner:
    return Runner(model, types.SimpleNamespace(text_config=gemma3.reference.config.text_config))


@pytest.mark.parametrize("text", [PROMPT, TWO_IMAGES])
def test_prompt_and_pixels_equal_gemma3_processor(gemma3, text):
    images = [noise_image(40 + 8 * i, 30, seed=i) for i in range(text.count("<start_of_image>"))]
    ids, mm = gemma3.processor.process(gemma3.tokenizer.encode(text), images)
    expected = reference_inputs(gemma3, text, images)
    image_id = gemma3.processor.image_token_id
    assert [image_id if i >= gemma3.processor.vocab_size else i for i in ids] == expected["input_ids"][0].tolist()
    assert torch.equal(torch.cat([im.pixel_values for im in mm.images]), expected["pixel_values"])
    assert [im.offset for im in mm.images] == [i for i, t in enumerate(expected["token_type_ids"][0]) if t and
                                                not expected["token_type_ids"][0][i - 1]]
    # A prompt given already expanded keeps its layout; the image tokens get the same keys.
    again, _ = gemma3.processor.process(expected["input_ids"][0].tolist(), images)
    assert again == ids


@pytest.mark.parametrize("text", [PROMPT, TWO_IMAGES])
def test_prefill_and_paged_decode_logits_match_transformers(gemma3, ours, text):
    images = [noise_image(48, 36 + 4 * i, seed=3 + i) for i in range(text.count("<start_of_image>"))]
    ids, mm = gemma3.processor.process(gemma3.tokenizer.encode(text), images)
    assert len(ids) > 2 * SLIDING_WINDOW
    generated = reference_greedy(gemma3, text, images)
    inputs = reference_inputs(gemma3, text, images)
    full_ids = torch.cat([inputs["input_ids"], torch.tensor([generated[:-1]])], dim=1)
    token_types = torch.cat([inputs["token_type_ids"], torch.zeros(1, STEPS - 1, dtype=torch.int64)], dim=1)
    with torch.inference_mode():
        expected = gemma3.reference(input_ids=full_ids, pixel_values=inputs["pixel_values"],
                                    token_type_ids=token_types).logits[0]
        causal_only = gemma3.reference(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0]
    run = runner(gemma3, ours)
    prefill = run.run(ids, 0, mm, all_logits=True)
    assert (prefill - expected[: len(ids)]).abs().max().item() < TOL
    # The image tokens attend to each other: a causal-only reference differs after the first image token.
    assert (prefill - causal_only).abs().max().item() > 1e-2
    for step, token in enumerate(generated[:-1]):
        position = len(ids) + step
        logits = run.run([token], position, mm, all_logits=False)
        assert (logits[-1] - expected[position]).abs().max().item() < TOL


def test_prefix_cached_inside_an_image_equals_one_prefill(gemma3, ours):
    """A cached prefix that ends inside an image (its K/V computed with the whole image) gives the same logits."""
    image = noise_image(30, 44, seed=4)
    ids, mm = gemma3.processor.process(gemma3.tokenizer.encode(PROMPT), [image])
    inputs = reference_inputs(gemma3, PROMPT, [image])
    with torch.inference_mode():
        expected = gemma3.reference(**inputs).logits[0]
    run = runner(gemma3, ours)
    run.run(ids, 0, mm, all_logits=True)
    cut = mm.images[0].offset + TOKENS_PER_IMAGE // 2
    rest = run.run(ids[cut:], cut, mm, all_logits=True)
    assert (rest - expected[cut:]).abs().max().item() < TOL
    # Prefill chunks cut outside the image equal one prefill; a chunk cut inside it runs (its first tokens then
    # miss the later ones, as documented) and leaves the text before the image exact.
    after_image = mm.images[0].offset + TOKENS_PER_IMAGE + 1
    for boundary, exact_until in ((after_image, len(ids)), (cut, mm.images[0].offset)):
        chunked = runner(gemma3, ours)
        logits = torch.cat([chunked.run(ids[:boundary], 0, mm, all_logits=True),
                            chunked.run(ids[boundary:], boundary, mm, all_logits=True)])
        assert (logits[:exact_until] - expected[:exact_until]).abs().max().item() < TOL


def test_image_block_mask_composes_window_and_image():
    # Positions 0..7 of which 2..5 are one image; window 3.
    mask = image_block_mask(0, 8, [(2, 6)], 3, torch.device("cpu"))
    assert mask[2].tolist() == [True, True, True, True, True, True, False, False]  # sees its image's later tokens
    assert mask[5].tolist() == [False, False, False, True, True, True, False, False]  # window bounds from below
    assert mask[7].tolist() == [False] * 5 + [True] * 3  # text after the image is causal within the window
    assert image_block_mask(4, 2, [(2, 6)], 0, torch.device("cpu")).tolist() == [[True] * 6, [True] * 6]


def test_engine_greedy_matches_transformers_and_keys_the_cache_by_image(gemma3):
    first, second = noise_image(48, 36, seed=11), noise_image(48, 36, seed=12)
    expected = {name: reference_greedy(gemma3, PROMPT, [img]) for name, img in (("first", first), ("second", second))}
    expected_text = reference_greedy(gemma3, TEXT_ONLY, [])
    assert expected["first"] != expected["second"]
    greedy = {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}
    image_offset = gemma3.processor.process(gemma3.tokenizer.encode(PROMPT), [first])[1].images[0].offset
    engine = Engine(model_path=gemma3.dir, dtype="float32", cpu_gemm="float32", max_total_tokens=1024)
    try:
        out_first = engine.generate(prompt=PROMPT, image_data=png_bytes(first), sampling_params=greedy)
        out_second = engine.generate(prompt=PROMPT, image_data=png_bytes(second), sampling_params=greedy)
        out_again = engine.generate(prompt=PROMPT, image_data=png_bytes(first), sampling_params=greedy)
        out_text = engine.generate(prompt=TEXT_ONLY, sampling_params=greedy)
    finally:
        engine.shutdown()
    assert out_first["output_ids"] == expected["first"]
    assert out_second["output_ids"] == expected["second"]
    # The second image shares the text before it with the first, never the image tokens.
    assert out_second["meta_info"]["cached_tokens"] <= image_offset
    assert out_again["output_ids"] == expected["first"]
    assert out_again["meta_info"]["cached_tokens"] > image_offset + TOKENS_PER_IMAGE
    assert out_text["output_ids"] == expected_text


def test_openai_chat_with_image_url_parts_matches_transformers(gemma3):
    image = noise_image(40, 40, seed=21)
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    content = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": uri}},
               {"type": "text", "text": " what is in this picture?"}]
    # The chat template sees the image as the model's placeholder, where the part was.
    prompt = gemma3.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Look: <start_of_image> what is in this picture?"}], tokenize=False,
        add_generation_prompt=True)
    expected = gemma3.tokenizer.decode(reference_greedy(gemma3, prompt, [image]), skip_special_tokens=True)
    with running_server("--cpu-gemm", "float32", "--dtype", "float32", model=gemma3.dir) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        response = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=STEPS,
            extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError, match="image"):
            client.chat.completions.create(model="default", temperature=0, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}])
    assert response.choices[0].message.content == expected
    assert response.usage.completion_tokens == STEPS

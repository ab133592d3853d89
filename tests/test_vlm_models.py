"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints: prefill logits with one and two
images of different sizes, a prompt chunk boundary inside an image, and greedy decoding."""

from __future__ import annotations

import types
from typing import Any, Optional

import pytest
import torch

from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
from sglang.srt.layers.mrope import mrope_prompt_positions
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_loader.loader import load_model
from sglang.srt.multimodal.forward_inputs import build_multimodal_forward
from sglang.srt.multimodal.processor import MultimodalInputs, QwenVLImageProcessor
from tests.vlm_fixtures import IMAGE_PLACEHOLDER, build_tiny_vl, noise_image

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
TOL = 2e-4


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(f"tiny-{request.param}")
    reference, tokenizer = build_tiny_vl(request.param, model_dir)
    ours = load_model(str(model_dir), torch.float32, "cpu")
    processor = QwenVLImageProcessor(str(model_dir), reference.config, len(tokenizer))
    return reference, ours, tokenizer, processor


class Runner:
    """One request through our model with a paged KV cache, in prompt chunks and then decode steps."""

    def __init__(self, model: Any, config: Any) -> None:
        text = config.text_config
        head_dim = text.hidden_size // text.num_attention_heads
        self.model = model
        self.pool = KVPool(1024, text.num_hidden_layers, text.num_key_value_heads, head_dim, torch.float32)
        self.table = types.SimpleNamespace(req_to_token=torch.zeros(1, 1024, dtype=torch.int64))
        self.next_slot = 1
        self.backend = TorchSDPABackend()

    def run(self, ids: list[int], prefix: int, mm: Optional[MultimodalInputs], all_logits: bool) -> torch.Tensor:
        ext = len(ids)
        slots = torch.arange(self.next_slot, self.next_slot + ext)
        self.next_slot += ext
        self.table.req_to_token[0, prefix : prefix + ext] = slots
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE if ext == 1 else ForwardMode.EXTEND, batch_size=1,
            input_ids=torch.tensor(ids), positions=build_positions([prefix], [ext], torch.device("cpu")),
            req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([prefix + ext]), out_cache_loc=slots,
            seq_lens_cpu=[prefix + ext], extend_prefix_lens_cpu=[prefix], extend_seq_lens_cpu=[ext],
            req_to_token_pool=self.table, token_to_kv_pool=self.pool, attn_backend=self.backend,
            logits_indices=torch.arange(ext) if all_logits else None,
            multimodal=build_multimodal_forward([mm], [prefix], [ext]),
        )
        self.backend.init_forward_metadata(batch)
        with torch.inference_mode():
            return self.model(batch.input_ids, batch.positions, batch)


def prompt(tokenizer, processor, images) -> tuple[list[int], MultimodalInputs, list[int]]:
    text = "<|im_start|>user\n"
    for i in range(len(images)):
        text += f"Picture {i}: {IMAGE_PLACEHOLDER}\n"
    text += "What differs?<|im_end|>\n<|im_start|>assistant\n"
    ids, mm = processor.process(tokenizer.encode(text), images)
    # transformers sees the plain pad id where we carry the image's cache id.
    reference_ids = [processor.image_token_id if i >= processor.vocab_size else i for i in ids]
    return ids, mm, reference_ids


def reference_inputs(reference_ids: list[int], mm: MultimodalInputs, processor) -> dict[str, torch.Tensor]:
    ids = torch.tensor([reference_ids])
    return dict(
        input_ids=ids,
        pixel_values=torch.cat([im.pixel_values for im in mm.images]),
        image_grid_thw=torch.tensor([im.grid_thw for im in mm.images]),
        mm_token_type_ids=(ids == processor.image_token_id).int(),
    )


IMAGE_SETS = {
    "one": [(112, 84)],
    "two-sizes": [(56, 112), (140, 84)],
}


@pytest.mark.parametrize("image_set", list(IMAGE_SETS))
def test_prefill_logits_match_transformers(models, image_set):
    reference, ours, tokenizer, processor = models
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGE_SETS[image_set])]
    ids, mm, reference_ids = prompt(tokenizer, processor, images)
    assert sum(im.num_tokens for im in mm.images) == reference_ids.count(processor.image_token_id)
    with torch.inference_mode():
        expected = reference(**reference_inputs(reference_ids, mm, processor)).logits[0]
    logits = Runner(ours, reference.config).run(ids, 0, mm, all_logits=True)
    assert (logits - expected).abs().max().item() < TOL
    # The images matter: the same prompt without them (pads embedded as text) gives other logits.
    plain = Runner(ours, reference.config).run(reference_ids, 0, None, all_logits=True)
    assert (plain[-1] - expected[-1]).abs().max().item() > 1e-2


def test_prompt_chunk_boundary_inside_an_image(models):
    reference, ours, tokenizer, processor = models
    images = [noise_image(112, 84, seed=3), noise_image(56, 56, seed=4)]
    ids, mm, reference_ids = prompt(tokenizer, processor, images)
    with torch.inference_mode():
        expected = reference(**reference_inputs(reference_ids, mm, processor)).logits[0]
    runner = Runner(ours, reference.config)
    cut = mm.images[0].offset + mm.images[0].num_tokens // 2
    first = runner.run(ids[:cut], 0, mm, all_logits=True)
    second = runner.run(ids[cut:], cut, mm, all_logits=True)
    assert (torch.cat([first, second]) - expected).abs().max().item() < TOL


def test_greedy_generation_matches_transformers_generate(models):
    reference, ours, tokenizer, processor = models
    images = [noise_image(84, 56, seed=5), noise_image(112, 112, seed=6)]
    ids, mm, reference_ids = prompt(tokenizer, processor, images)
    steps = 8
    with torch.inference_mode():
        generated = reference.generate(**reference_inputs(reference_ids, mm, processor), max_new_tokens=steps,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = generated[0, len(ids):].tolist()
    runner = Runner(ours, reference.config)
    token = int(runner.run(ids, 0, mm, all_logits=False)[-1].argmax())
    out = [token]
    for _ in range(steps - 1):
        token = int(runner.run([token], len(ids) + len(out) - 1, mm, all_logits=False)[-1].argmax())
        out.append(token)
    assert out == expected


def test_mrope_positions_follow_the_image_grid():
    positions, delta = mrope_prompt_positions(9, [(2, (1, 4, 6))], spatial_merge_size=2)
    # 2 text tokens, a 2 x 3 merged grid at position 2, then text resuming at 2 + max(2, 3) = 5.
    assert positions[0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 5]
    assert positions[1].tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 5]
    assert positions[2].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5]
    assert delta == 6 - 9


def test_batch_builder_mixes_text_and_image_requests_and_offsets_outputs():
    mm_positions, delta = mrope_prompt_positions(6, [(1, (1, 4, 4))], spatial_merge_size=2)
    image = types.SimpleNamespace(pixel_values=torch.zeros(16, 4), grid_thw=(1, 4, 4), offset=1, num_tokens=4)
    mm = types.SimpleNamespace(mrope_positions=mm_positions, mrope_position_delta=delta, images=[image])
    # A text request extends 3 tokens after 2 cached ones; the image request runs prompt tokens 3..5 and its
    # first output token (index 6), so the image's last two embedding rows land at flat offsets 3 and 4.
    forward = build_multimodal_forward([None, mm], [2, 3], [3, 4])
    assert forward is not None
    assert forward.mrope_positions[:, :3].tolist() == [[2, 3, 4]] * 3
    assert forward.mrope_positions[:, 3:].tolist() == [[1, 1, 3, 4], [2, 2, 3, 4], [1, 2, 3, 4]]
    assert delta == -2  # the text after the image resumes at 1 + max(2, 2) = 3, so index 6 sits at 4
    [chunk] = forward.images
    assert (chunk.token_offset, chunk.embed_start, chunk.embed_len) == (3, 2, 2)
    assert build_multimodal_forward([None, None], [0, 0], [2, 2]) is None

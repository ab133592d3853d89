"""A tiny random Qwen2-VL behind the HTTP server: notebook 003's image QA cell, OpenAI image_url parts,
prefix caching of images, and the 400s for bad image inputs."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from PIL import Image

from sglang import RuntimeEndpoint, assistant, function, gen, image, set_default_backend, user
from sglang.srt.multimodal.processor import QwenVLImageProcessor
from sglang.srt.utils import load_image
from sglang.utils import print_highlight
from tests.server_fixtures import running_server
from tests.vlm_fixtures import IMAGE_PLACEHOLDER, build_tiny_vl, noise_image, png_bytes

MAX_PIXELS = 300 * 300
MAX_BYTES = 200_000


@pytest.fixture(scope="module")
def image_host(tmp_path_factory):
    """A loopback HTTP server holding one PNG (the only 'remote' image the tests may fetch)."""
    root = tmp_path_factory.mktemp("images")
    (root / "cat.png").write_bytes(png_bytes(noise_image(84, 56, seed=21)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, image_host):
    model_dir = tmp_path_factory.mktemp("tiny-qwen2-vl")
    reference, tokenizer = build_tiny_vl("qwen2_vl", model_dir, seed=1)
    args = ("--max-image-pixels", str(MAX_PIXELS), "--max-image-bytes", str(MAX_BYTES),
            "--allowed-image-url-domains", "127.0.0.1", "--max-total-tokens", "4096",
            "--cpu-gemm", "float32",  # float32 throughout, as the transformers reference computes
            "--chunked-prefill-size", "16")  # prompts run in chunks whose boundaries fall inside images
    with running_server(*args, model=str(model_dir)) as url:
        yield url, str(model_dir), reference, tokenizer


def data_uri(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def processor_of(model_dir, reference, tokenizer) -> QwenVLImageProcessor:
    return QwenVLImageProcessor(model_dir, reference.config, len(tokenizer))


def test_model_info_reports_image_understanding(vlm):
    url, model_dir, _, _ = vlm
    info = requests.get(url + "/get_model_info").json()
    assert info["has_image_understanding"] is True
    assert info["architectures"] == ["Qwen2VLForConditionalGeneration"]


def test_notebook_image_qa_cell(vlm, tmp_path):
    url, model_dir, reference, tokenizer = vlm
    image_path = tmp_path / "example_image.png"
    image_path.write_bytes(png_bytes(noise_image(112, 84, seed=7)))
    set_default_backend(RuntimeEndpoint(url))

    @function
    def image_qa(s, image_file, question):
        s += user(image(image_file) + question)
        s += assistant(gen("answer", max_tokens=256))

    image_url = str(image_path)
    image_bytes, _ = load_image(image_url)
    state = image_qa(image_bytes, "What is in the image?")
    print_highlight(state["answer"])

    assert isinstance(state["answer"], str)
    # The prompt that ran holds the image: 6 x 8 patches merged 2 x 2 into 12 tokens, plus the text.
    meta = state.get_meta_info("answer")
    text_only = len(tokenizer.encode(state.text().split(state["answer"])[0]))
    assert meta["prompt_tokens"] == text_only - 1 + 12


def test_frontend_program_with_two_images(vlm):
    url, _, _, tokenizer = vlm

    @function
    def compare(s, first, second):
        s += user(image(first) + image(second) + "Are they the same?")
        s += assistant(gen("answer", max_tokens=4, temperature=0))

    state = compare.run(noise_image(56, 56, seed=17), noise_image(112, 56, seed=18), backend=RuntimeEndpoint(url))
    prompt_text = state.text().split(state["answer"])[0]
    # 4 x 4 patches -> 4 tokens and 4 x 8 patches -> 8 tokens replace the two pad tokens of the placeholders.
    assert state.get_meta_info("answer")["prompt_tokens"] == len(tokenizer.encode(prompt_text)) - 2 + 12


def test_openai_chat_with_image_url_part_matches_transformers(vlm):
    url, model_dir, reference, tokenizer = vlm
    img = noise_image(84, 112, seed=8)
    client = openai.Client(base_url=url + "/v1", api_key="none")
    response = client.chat.completions.create(
        model=model_dir,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe "},
            {"type": "image_url", "image_url": {"url": data_uri(img)}},
            {"type": "text", "text": " briefly."},
        ]}],
        temperature=0, max_tokens=8,
    )
    messages = [{"role": "user", "content": f"Describe {IMAGE_PLACEHOLDER} briefly."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    processor = processor_of(model_dir, reference, tokenizer)
    ours_ids, mm = processor.process(list(ids), [img])
    ref_ids = torch.tensor([[processor.image_token_id if i >= processor.vocab_size else i for i in ours_ids]])
    with torch.inference_mode():
        out = reference.generate(input_ids=ref_ids, pixel_values=mm.images[0].pixel_values,
                                 image_grid_thw=torch.tensor([mm.images[0].grid_thw]),
                                 mm_token_type_ids=(ref_ids == processor.image_token_id).int(),
                                 max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = tokenizer.decode(out[0, ref_ids.shape[1]:], skip_special_tokens=True)
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(ours_ids)


def generate(url, text, image_data, **extra):
    body = {"text": text, "image_data": image_data, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            **extra}
    return requests.post(url + "/generate", json=body)


def test_repeated_image_hits_the_cache_and_different_images_do_not_share_it(vlm):
    url, model_dir, reference, tokenizer = vlm
    text = f"<|im_start|>user\nLook: {IMAGE_PLACEHOLDER} What is it?<|im_end|>\n<|im_start|>assistant\n"
    first_image, other_image = data_uri(noise_image(112, 112, seed=9)), data_uri(noise_image(112, 112, seed=10))
    processor = processor_of(model_dir, reference, tokenizer)
    _, mm = processor.process(tokenizer.encode(text), [load_image(first_image)[0]])
    image_end = mm.images[0].offset + mm.images[0].num_tokens

    first = generate(url, text, first_image, return_logprob=True).json()
    again = generate(url, text, first_image, return_logprob=True).json()
    other = generate(url, text, other_image, return_logprob=True).json()
    assert again["meta_info"]["cached_tokens"] >= image_end
    assert again["text"] == first["text"]
    assert again["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(
        first["meta_info"]["output_token_logprobs"][0][0], abs=1e-4)
    # The other image shares only the text before it; its outputs differ.
    assert other["meta_info"]["cached_tokens"] <= mm.images[0].offset
    assert other["meta_info"]["output_token_logprobs"][0][0] != pytest.approx(
        first["meta_info"]["output_token_logprobs"][0][0], abs=1e-4)


def test_two_images_in_one_request_and_batch_image_lists(vlm, image_host):
    url, _, _, _ = vlm
    text = f"A {IMAGE_PLACEHOLDER} B {IMAGE_PLACEHOLDER} C"
    images = [data_uri(noise_image(56, 84, seed=11)), f"http://{image_host}/cat.png"]
    single = generate(url, text, images)
    assert single.status_code == 200, single.text
    batch = requests.post(url + "/generate", json={
        "text": [text, f"only {IMAGE_PLACEHOLDER}"], "image_data": [images, images[0]],
        "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    assert batch.status_code == 200, batch.text
    assert batch.json()[0]["text"] == single.json()["text"]


def test_concurrent_text_and_image_requests_match_their_sequential_outputs(vlm):
    url, _, _, _ = vlm
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}?<|im_end|>\n<|im_start|>assistant\n"
    jobs = [("Plain text only, no picture.", None)] + [
        (text, [data_uri(noise_image(56 + 28 * i, 84, seed=30 + i)), data_uri(noise_image(84, 56, seed=40 + i))])
        for i in range(3)
    ]
    def run(job) -> tuple[str, list[float]]:
        out = generate(url, *job, return_logprob=True).json()
        return out["text"], [round(lp, 4) for lp, _, _ in out["meta_info"]["output_token_logprobs"]]

    requests.post(url + "/flush_cache")
    sequential = [run(job) for job in jobs]
    requests.post(url + "/flush_cache")
    with ThreadPoolExecutor(len(jobs)) as pool:
        concurrent = list(pool.map(run, jobs))
    for (text_a, lp_a), (text_b, lp_b) in zip(concurrent, sequential):
        assert text_a == text_b and lp_a == pytest.approx(lp_b, abs=2e-3)
    assert len({tuple(lp) for _, lp in sequential[1:]}) == 3  # different images, different outputs


def test_input_ids_prompt_with_image_equals_text_prompt(vlm):
    url, _, _, tokenizer = vlm
    text = f"Tell me about {IMAGE_PLACEHOLDER} now"
    img = data_uri(noise_image(84, 84, seed=50))
    by_text = generate(url, text, img, return_logprob=True).json()
    body = {"input_ids": tokenizer.encode(text), "image_data": img, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    by_ids = requests.post(url + "/generate", json=body).json()
    assert by_ids["meta_info"]["prompt_tokens"] == by_text["meta_info"]["prompt_tokens"]
    ids_out, text_out = by_ids["meta_info"]["output_token_logprobs"], by_text["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in ids_out] == [t for _, t, _ in text_out]
    assert [lp for lp, _, _ in ids_out] == pytest.approx([lp for lp, _, _ in text_out], abs=1e-4)


def _tiff_bytes() -> bytes:
    buffer = io.BytesIO()
    noise_image(32, 32, seed=12).save(buffer, format="TIFF")
    return buffer.getvalue()


BAD_IMAGES = {
    "corrupt": (base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20).decode(), "corrupt"),
    "not an image": (base64.b64encode(b"plain text, no picture" * 4).decode(), "cannot identify an image"),
    "not base64 or a path": ("no-such-file.png", "not a readable file path"),
    "unsupported format": (base64.b64encode(_tiff_bytes()).decode(), "unsupported image format TIFF"),
    "too many pixels": (lambda: data_uri(Image.new("RGB", (400, 300), "red")), "over the limit of 90000 pixels"),
    "too many bytes": (lambda: data_uri(noise_image(290, 290, seed=14)), f"over the limit of {MAX_BYTES}"),
    "url not allowed": ("http://localhost:9/cat.png", "is not allowed"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_bad_image_inputs_are_400s(vlm, case):
    url, _, _, _ = vlm
    item, message = BAD_IMAGES[case]
    item = item() if callable(item) else item
    response = generate(url, f"See {IMAGE_PLACEHOLDER}", item)
    assert response.status_code == 400, response.text
    assert "image_data[0]" in response.text and message in response.text


def test_placeholder_count_mismatch_is_a_400(vlm):
    url, _, _, _ = vlm
    response = generate(url, "No placeholder here", data_uri(noise_image(56, 56, seed=15)))
    assert response.status_code == 400
    assert "image_data has 1 image(s) but the prompt has 0 image placeholder(s)" in response.text


@pytest.mark.parametrize("extra, message", [
    ({"return_logprob": True, "logprob_start_len": 0}, "logprob_start_len must be at least"),
    ({"sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty is not supported together with image"),
])
def test_options_that_would_read_image_tokens_as_text_are_400s(vlm, extra, message):
    url, _, _, _ = vlm
    response = generate(url, f"See {IMAGE_PLACEHOLDER} here", data_uri(noise_image(56, 56, seed=19)), **extra)
    assert response.status_code == 400 and message in response.text


def test_text_only_model_refuses_images(smollm2_server):
    url = smollm2_server
    response = generate(url, "Hello", data_uri(noise_image(56, 56, seed=16)))
    assert response.status_code == 400
    assert "does not accept images" in response.text
    client = openai.Client(base_url=url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(noise_image(56, 56, seed=16))}}]}])

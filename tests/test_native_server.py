"""The native HTTP API against a real server on SmolLM2 (cells of notebooks 001, 002 and 004)."""

import json
import threading
import time

import pytest
import requests

from sglang.utils import print_highlight
from tests.conftest import SMOLLM2
from tests.server_fixtures import running_server


@pytest.fixture(scope="module")
def base_url(smollm2_server):
    return smollm2_server


def test_generate_cell(base_url):
    response = requests.post(f"{base_url}/generate", json={"text": "What is the capital of France?"})
    print_highlight(response.json())
    out = response.json()
    assert response.status_code == 200
    assert isinstance(out["text"], str)  # sampled at temperature 1: may legitimately stop at once
    meta = out["meta_info"]
    assert meta["completion_tokens"] >= 1
    assert len(meta["id"]) == 32
    assert meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["completion_tokens"] <= 128
    assert "cached_tokens" in meta and "e2e_latency" in meta


def test_get_model_info_cell(base_url):
    response_json = requests.get(f"{base_url}/get_model_info").json()
    assert response_json["model_path"] == SMOLLM2
    assert response_json["is_generation"] is True
    assert response_json["tokenizer_path"] == SMOLLM2
    assert response_json["preferred_sampling_params"] is None
    assert response_json.keys() == {
        "model_path", "is_generation", "tokenizer_path", "preferred_sampling_params", "weight_version",
        "has_image_understanding", "has_audio_understanding", "model_type", "architectures",
    }
    assert response_json["model_type"] == "llama"
    assert response_json["architectures"] == ["LlamaForCausalLM"]
    assert requests.get(f"{base_url}/model_info").json() == response_json


def test_get_server_info_cell(base_url):
    response = requests.get(f"{base_url}/get_server_info")
    assert response.text.startswith('{"model_path":')
    info = response.json()
    assert info["max_total_num_tokens"] == 20480
    assert info["schedule_policy"] == "lpm" and info["grammar_backend"] == "xgrammar"
    assert info["status"] == "ready" and isinstance(info["internal_states"], list)
    assert "version" in info
    # the startup log's decode path line: SmolLM2's GGUF blocks run in the fused CPU step
    assert info["decode_path"].startswith("Decode path: ") and "fused CPU decode step" in info["decode_path"]
    assert requests.get(f"{base_url}/server_info").json()["model_path"] == SMOLLM2


def test_health_cells(base_url):
    for path in ("/health_generate", "/health"):
        response = requests.get(base_url + path)
        assert response.status_code == 200 and response.text == ""


def test_flush_cache_cell(base_url):
    response = requests.post(f"{base_url}/flush_cache")
    assert response.status_code == 200
    assert response.text.startswith("Cache flushed.\nPlease check backend logs for more details.")


def test_tokenize_detokenize_round_trip(base_url):
    text = "SGLang provides efficient tokenization endpoints."
    tok = requests.post(f"{base_url}/tokenize",
                        json={"model": SMOLLM2, "prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert isinstance(tok["max_model_len"], int)
    detok = requests.post(f"{base_url}/detokenize", json={"model": SMOLLM2, "tokens": tok["tokens"]}).json()
    assert detok["text"] == text
    assert requests.post(f"{base_url}/detokenize", json={"tokens": []}).json() == {"text": ""}
    bad = requests.post(f"{base_url}/detokenize", json={"tokens": ["a"]})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "Invalid input: 'tokens' must be a list of integers."


def _stream_text(base_url: str, body: dict) -> tuple[str, list[dict]]:
    events = []
    with requests.post(f"{base_url}/generate", json={**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200
        for line in r.iter_lines(decode_unicode=False):
            if not line:
                continue
            assert line.startswith(b"data: ")
            payload = line[6:]
            if payload == b"[DONE]":
                break
            events.append(json.loads(payload))
    return events[-1]["text"], events


def test_stream_equals_non_stream(base_url):
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 40}}
    full = requests.post(f"{base_url}/generate", json=body).json()
    text, events = _stream_text(base_url, body)
    assert text == full["text"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    # Notebook-style delta computation works because text is cumulative.
    prev, pieces = 0, []
    for e in events:
        pieces.append(e["text"][prev:])
        prev = len(e["text"])
    assert "".join(pieces) == full["text"]


def test_batch_and_n(base_url):
    sp = {"temperature": 0, "max_new_tokens": 8}
    outs = requests.post(f"{base_url}/generate", json={"text": ["Hello", "The sky is"], "sampling_params": sp}).json()
    assert isinstance(outs, list) and len(outs) == 2
    single = requests.post(f"{base_url}/generate", json={"text": "The sky is", "sampling_params": sp}).json()
    assert outs[1]["text"] == single["text"]
    many = requests.post(f"{base_url}/generate", json={
        "text": "Pick a random animal:", "sampling_params": {"max_new_tokens": 8, "n": 3, "temperature": 1.0}}).json()
    assert isinstance(many, list) and len(many) == 3
    assert len({o["meta_info"]["id"] for o in many}) == 3


def test_input_ids_and_logprobs(base_url):
    ids = requests.post(f"{base_url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    out = requests.post(f"{base_url}/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 3},
        "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True, "logprob_start_len": 0,
        "token_ids_logprob": [ids[1], ids[2]],
    }).json()
    meta = out["meta_info"]
    assert meta["input_token_ids_logprobs"][0] is None
    assert [e[1] for e in meta["input_token_ids_logprobs"][1]] == [ids[1], ids[2]]
    # The logprob of the actual next prompt token equals its entry in the requested-ids list.
    assert meta["input_token_ids_logprobs"][1][0][0] == pytest.approx(meta["input_token_logprobs"][1][0], abs=1e-5)
    assert len(meta["output_token_ids_logprobs"]) == 3 and len(meta["output_token_ids_logprobs"][0]) == 2
    assert len(meta["input_token_logprobs"]) == len(ids)
    assert meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in meta["input_token_logprobs"][1:])
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert len(meta["output_token_logprobs"]) == 3
    assert meta["input_top_logprobs"][0] is None
    top = meta["output_top_logprobs"][0]
    assert len(top) == 2 and top[0][0] >= top[1][0]
    assert top[0][1] == meta["output_token_logprobs"][0][1]  # greedy picks the top token
    assert isinstance(meta["output_token_logprobs"][0][2], str)


def test_max_new_tokens_zero(base_url):
    out = requests.post(f"{base_url}/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stop_string_trimmed(base_url):
    sp = {"temperature": 0, "max_new_tokens": 30}
    full = requests.post(f"{base_url}/generate", json={"text": "Count: 1, 2, 3,", "sampling_params": sp}).json()
    words = full["text"].split()
    assert len(words) > 2
    stop = words[1]
    out = requests.post(f"{base_url}/generate", json={
        "text": "Count: 1, 2, 3,", "sampling_params": {**sp, "stop": stop}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and full["text"].startswith(out["text"])
    text, _ = _stream_text(base_url, {"text": "Count: 1, 2, 3,", "sampling_params": {**sp, "stop": stop}})
    assert text == out["text"]


@pytest.mark.parametrize("body,message", [
    ({}, "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": []}, "input_ids cannot be empty."),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature must be non-negative, got -1"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0"),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"text": "hi", "sampling_params": {"min_p": 2}}, "min_p must be in [0, 1], got 2"),
    ({"text": "hi", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty must be in [-2, 2], got 3"),
    ({"text": "hi", "sampling_params": {"presence_penalty": -3}}, "presence_penalty must be in [-2, 2], got -3"),
    ({"text": "hi", "sampling_params": {"repetition_penalty": 5}}, "repetition_penalty must be in [0, 2], got 5"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0, got -1."),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
     "min_new_tokens must be in [0, max_new_tokens(2)], got 3."),
    ({"text": "hi", "sampling_params": {"regex": "a", "json_schema": "{}"}},
     "Only one of regex, json_schema, or ebnf can be set."),
    ({"text": "hi", "sampling_params": {"bogus_key": 1}}, "bogus_key"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 100000}},
     "Requested token count exceeds the model's maximum context length of 8192 tokens."),
    ({"text": ["a", "b"], "rid": ["x"]},
     "The specified rids length mismatch with the batch_size for batch processing."),
    ({"text": "hi", "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
])
def test_validation_errors(base_url, body, message):
    response = requests.post(f"{base_url}/generate", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_non_json_body_is_400(base_url):
    response = requests.post(f"{base_url}/generate", data=b"{not json")
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_concurrent_streaming_clients(base_url):
    results: list = [None] * 32

    def client(i: int) -> None:
        text, events = _stream_text(base_url, {
            "text": f"Tell me a fact about the number {i}.", "sampling_params": {"max_new_tokens": 16}})
        results[i] = events[-1]["meta_info"]["finish_reason"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results)


def _wait_idle(base_url: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = requests.get(f"{base_url}/get_server_info").json()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
            return state
        time.sleep(0.2)
    raise AssertionError("server did not become idle")


def test_client_disconnect_aborts_request(base_url):
    body = {"text": "Write a very long story about a dragon.", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with requests.post(f"{base_url}/generate", json=body, stream=True) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        busy = requests.get(f"{base_url}/get_server_info").json()["internal_states"][0]
        assert busy["num_running_reqs"] == 1
    state = _wait_idle(base_url)
    assert state["token_usage"] == 0.0


def test_abort_request_endpoint(base_url):
    result: dict = {}

    def run() -> None:
        result["out"] = requests.post(f"{base_url}/generate", json={
            "text": "Long text please", "rid": "abort-me-1",
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}).json()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    assert requests.post(f"{base_url}/abort_request", json={"rid": "abort-me-1"}).status_code == 200
    t.join(timeout=60)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["out"]["meta_info"]["completion_tokens"] < 4000


def test_v1_models_and_metrics(base_url):
    models = requests.get(f"{base_url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == SMOLLM2
    assert models["data"][0]["max_model_len"] == 8192
    metrics = requests.get(f"{base_url}/metrics")
    assert metrics.status_code == 200
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                 "sglang:prompt_tokens_total", "sglang:generation_tokens_total"):
        assert name in metrics.text, name


def test_get_load(base_url):
    assert isinstance(requests.get(f"{base_url}/get_load").json()["load"], int)


def test_skip_tokenizer_init_server():
    with running_server("--skip-tokenizer-init", "--max-total-tokens", "4096", "--log-level", "warning") as url:
        from transformers import AutoTokenizer

        from sglang.srt.model_loader.resolve import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2))
        input_tokens = tokenizer.encode("What is the capital of France?")
        output = requests.post(f"{url}/generate", json={
            "input_ids": input_tokens,
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "stop_token_ids": [tokenizer.eos_token_id]},
            "stream": False,
        }).json()
        assert output["token_ids"] == output["output_ids"] and output["token_ids"]
        assert "text" not in output
        reason = output["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            assert output["token_ids"][-1] == tokenizer.eos_token_id
        text_req = requests.post(f"{url}/generate", json={"text": "hi"})
        assert text_req.status_code == 400
        assert "skip_tokenizer_init=True" in text_req.json()["error"]["message"]


def test_non_streaming_client_disconnect_aborts_request(base_url):
    body = {"text": "Write a very long story.", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{base_url}/generate", json=body, timeout=2)
    state = _wait_idle(base_url)
    assert state["token_usage"] == 0.0


def test_log_requests_flag_logs_finished_requests(tmp_path):
    import subprocess
    import sys

    import psutil

    from sglang import huge_pages
    from sglang.test.test_utils import find_free_port, popen_launch_server
    from sglang.utils import terminate_process

    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = popen_launch_server(SMOLLM2, url, other_args=["--log-requests", "--max-total-tokens", "2048",
                                                         "--tp-size", "1", "--cuda-graph-max-bs", "4"],
                               log_path=str(log), env={huge_pages.ENV: "1"})  # moved although under 1 GiB
    try:
        requests.post(f"{url}/generate", json={"text": "Hello there", "rid": "logged-request-1",
                                                "sampling_params": {"max_new_tokens": 4}})
        huge = sum(huge_pages.anon_huge_bytes(p.pid) for p in psutil.Process(proc.pid).children(recursive=True))
    finally:
        terminate_process(proc)
    text = log.read_text()
    # the scheduler holds its weights in 2 MB pages (sglang/huge_pages.py) where the kernel offers them
    if huge_pages.why_not_huge() is None:
        assert "GB of weights moved to 2 MB pages" in text
        assert huge > 100 * 2**20, huge
    else:
        assert f"Memory pages: weights in the allocator's pages ({huge_pages.why_not_huge()})" in text
    assert "The server is fired up and ready to roll!" in text
    assert "Finish: rid=logged-request-1" in text
    assert "Prefill batch. #new-seq: 1" in text
    assert "--cuda-graph-max-bs=4 has no effect" in text
    assert subprocess.run([sys.executable, "-c", "import sglang"]).returncode == 0

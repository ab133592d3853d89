"""Server options as SGLang has them: `--stream-output` (a streamed /generate chunk carries only its new
`output_ids`), `--json-model-override-args` (the model is built from the overridden config, as its KV pool is), and
the `/metrics` SGLang exports with `--enable-metrics` (names, types, the `model_name` label, histogram buckets and
values that follow the requests sent).

Two servers on a four-layer random Llama: one with `--stream-output --enable-metrics`, one with the flag off and the
config overridden to two layers (float32 throughout, so its logprobs can be compared with transformers').
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from sglang.test.test_utils import find_free_port
from sglang.utils import terminate_process, wait_until_healthy
from tests.conftest import save_tiny_llama
from tests.server_fixtures import running_server

PROMPT_IDS = [1, 523, 2045, 311, 905, 77, 1500, 42, 3380, 12, 640, 9001]
GREEDY = {"temperature": 0, "ignore_eos": True}
FLOAT32 = ("--dtype", "float32", "--cpu-gemm", "float32", "--small-batch-quantization", "none")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4-layers"), smollm2_tokenizer,
                           max_position_embeddings=32768, num_hidden_layers=4)


@pytest.fixture(scope="module")
def stream_output_server(model_dir):
    with running_server("--stream-output", "--enable-metrics", "--log-level", "warning", *FLOAT32,
                        model=model_dir) as url:
        wait_until_healthy(url, 120)  # the warm-up request has finished: the metric deltas count ours only
        yield url


@pytest.fixture(scope="module")
def two_layer_server(model_dir):
    with running_server("--json-model-override-args", '{"num_hidden_layers": 2}', "--log-level", "warning",
                        *FLOAT32, model=model_dir) as url:
        yield url


def generate(url: str, **body) -> dict:
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(url: str, **body) -> list[dict]:
    with requests.post(f"{url}/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        return [json.loads(line[len(b"data: "):]) for line in r.iter_lines()
                if line.startswith(b"data: ") and line != b"data: [DONE]"]


# ---- --stream-output ------------------------------------------------------------------------------------------
def test_stream_output_chunks_carry_only_new_output_ids(stream_output_server):
    params = {**GREEDY, "max_new_tokens": 12}
    full = generate(stream_output_server, input_ids=PROMPT_IDS, sampling_params=params, return_logprob=True)
    # The non-streamed response is unchanged by the flag: every id, every logprob.
    assert len(full["output_ids"]) == full["meta_info"]["completion_tokens"] == 12
    chunks = stream_chunks(stream_output_server, input_ids=PROMPT_IDS, sampling_params=params, return_logprob=True)
    assert len(chunks) > 2
    concatenated = [i for c in chunks for i in c["output_ids"]]
    assert concatenated == full["output_ids"]
    # Each chunk's ids are the tokens it added; text and the logprob lists stay cumulative, as SGLang streams them.
    for before, after in zip(chunks, chunks[1:]):
        added = after["meta_info"]["completion_tokens"] - before["meta_info"]["completion_tokens"]
        assert len(after["output_ids"]) == added
        assert after["text"].startswith(before["text"])
    last = chunks[-1]
    assert last["text"] == full["text"]
    assert [t[1] for t in last["meta_info"]["output_token_logprobs"]] == full["output_ids"]


def test_stream_output_batch_streams_each_request_incrementally(stream_output_server):
    prompts = [PROMPT_IDS, PROMPT_IDS[:5]]
    params = {**GREEDY, "max_new_tokens": 6}
    fulls = generate(stream_output_server, input_ids=prompts, sampling_params=params)
    chunks = stream_chunks(stream_output_server, input_ids=prompts, sampling_params=params)
    for index, full in enumerate(fulls):
        mine = [c for c in chunks if c["index"] == index]
        assert [i for c in mine for i in c["output_ids"]] == full["output_ids"]
        assert mine[-1]["text"] == full["text"]


def test_without_stream_output_chunks_stay_cumulative(two_layer_server):
    params = {**GREEDY, "max_new_tokens": 8}
    full = generate(two_layer_server, input_ids=PROMPT_IDS, sampling_params=params)
    chunks = stream_chunks(two_layer_server, input_ids=PROMPT_IDS, sampling_params=params)
    assert len(chunks) > 2
    for before, after in zip(chunks, chunks[1:]):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["text"] == full["text"]


# ---- --json-model-override-args -------------------------------------------------------------------------------
def _reference_logprobs(model_dir: str, num_layers: int, ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each token of `ids` given the ones before it (index 0: none), the checkpoint's
    first `num_layers` layers only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, num_hidden_layers=num_layers, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return torch.tensor([logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))])


def test_layer_override_builds_the_smaller_model(two_layer_server, model_dir):
    out = generate(two_layer_server, input_ids=PROMPT_IDS, sampling_params={**GREEDY, "max_new_tokens": 6},
                   return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    ids = PROMPT_IDS + out["output_ids"]
    served = torch.tensor([t[0] for t in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]])
    two = _reference_logprobs(model_dir, 2, ids)
    four = _reference_logprobs(model_dir, 4, ids)
    # The override changes the model enough to tell the two apart, and the server serves the two-layer one.
    assert (two - four).abs().max() > 0.01
    torch.testing.assert_close(served, two, atol=2e-3, rtol=0)
    info = requests.get(f"{two_layer_server}/get_server_info", timeout=30).json()
    assert json.loads(info["json_model_override_args"]) == {"num_hidden_layers": 2}


@pytest.mark.parametrize("override, message", [
    ('{"architectures": ["NoSuchArchForCausalLM"]}', "NoSuchArchForCausalLM"),
    ('{"num_hidden_layers": ', "--json-model-override-args is not valid JSON"),
    ('["num_hidden_layers"]', "--json-model-override-args must be a JSON object"),
])
def test_bad_override_is_a_startup_error(model_dir, override, message):
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(find_free_port()),
           "--json-model-override-args", override]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        terminate_process(proc)
        pytest.fail(f"the server did not exit: {' '.join(cmd)}")
    assert proc.returncode != 0
    assert message in output


# ---- /metrics -------------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, Any]:
    """Metric family name -> the family parsed from /metrics."""
    r = requests.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(r.text)}


def value(metrics: dict[str, Any], sample: str, model_name: str) -> float:
    """The value of the sample named `sample` (e.g. `..._total`, `..._count`) labelled `model_name` only."""
    found = [s.value for family in metrics.values() for s in family.samples
             if s.name == sample and s.labels == {"model_name": model_name}]
    assert len(found) == 1, sample
    return found[0]


# SGLang's histogram buckets (seconds).
TIME_TO_FIRST_TOKEN_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_REQUEST_LATENCY_BUCKETS = [*TIME_TO_FIRST_TOKEN_BUCKETS, 800]
INTER_TOKEN_LATENCY_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
                               0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8]
SGLANG_METRICS = {
    "sglang:num_running_reqs": "gauge", "sglang:num_used_tokens": "gauge", "sglang:token_usage": "gauge",
    "sglang:gen_throughput": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:num_grammar_queue_reqs": "gauge",
    "sglang:cache_hit_rate": "gauge", "sglang:spec_accept_length": "gauge",
    "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter", "sglang:cached_tokens": "counter",
    "sglang:num_requests": "counter", "sglang:num_so_requests": "counter",
    "sglang:time_to_first_token_seconds": "histogram", "sglang:inter_token_latency_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
}


def test_metrics_names_types_labels_and_buckets(stream_output_server, model_dir):
    metrics = scrape(stream_output_server)
    for name, kind in SGLANG_METRICS.items():
        assert metrics[name].type == kind, name
        assert metrics[name].samples and all(s.labels["model_name"] == model_dir for s in metrics[name].samples)
    for name, buckets in (("sglang:time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS),
                          ("sglang:inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS),
                          ("sglang:e2e_request_latency_seconds", E2E_REQUEST_LATENCY_BUCKETS)):
        bounds = [float(s.labels["le"]) for s in metrics[name].samples if s.name.endswith("_bucket")]
        assert bounds == [float(b) for b in buckets] + [float("inf")], name
    assert value(metrics, "sglang:spec_accept_length", model_dir) == 0.0


def test_metrics_count_the_requests_sent(stream_output_server, model_dir):
    url = stream_output_server
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
    counters = ("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
                "sglang:num_requests_total", "sglang:num_so_requests_total")
    before = scrape(url)
    prefix = PROMPT_IDS * 3
    outs = [
        generate(url, input_ids=prefix + [11], sampling_params={**GREEDY, "max_new_tokens": 5}),
        # Streamed, one token a chunk. The shared prefix is served from the cache the first request left.
        stream_chunks(url, input_ids=prefix + [12, 13], sampling_params={**GREEDY, "max_new_tokens": 4})[-1],
        generate(url, input_ids=PROMPT_IDS[:4], sampling_params={"temperature": 0, "regex": "(yes|no)"}),
    ]
    # Health probes run a request too, but do not count (log_metrics=False).
    assert requests.get(f"{url}/health_generate", timeout=60).status_code == 200
    after = scrape(url)
    delta = {name: value(after, name, model_dir) - value(before, name, model_dir) for name in counters}
    metas = [o["meta_info"] for o in outs]
    assert metas[1]["cached_tokens"] >= len(prefix)
    assert delta["sglang:prompt_tokens_total"] == sum(m["prompt_tokens"] for m in metas) == 2 * len(prefix) + 7
    assert delta["sglang:generation_tokens_total"] == sum(m["completion_tokens"] for m in metas)
    assert delta["sglang:cached_tokens_total"] == sum(m["cached_tokens"] for m in metas)
    assert delta["sglang:num_requests_total"] == 3
    assert delta["sglang:num_so_requests_total"] == 1
    ttft = "sglang:time_to_first_token_seconds_count"
    assert value(after, ttft, model_dir) - value(before, ttft, model_dir) == 3
    e2e = "sglang:e2e_request_latency_seconds_count"
    assert value(after, e2e, model_dir) - value(before, e2e, model_dir) == 3
    # Each token after a request's first output counts one inter-token interval, as SGLang counts them: the
    # streamed request's last three (the others sent all their tokens in one output).
    itl = "sglang:inter_token_latency_seconds_count"
    assert value(after, itl, model_dir) - value(before, itl, model_dir) == metas[1]["completion_tokens"] - 1 == 3
    assert value(after, "sglang:cache_hit_rate", model_dir) > 0


def test_metrics_gauges_show_a_running_request(stream_output_server, model_dir):
    url = stream_output_server
    # long enough to be running at the scrape however loaded the machine; closing the stream aborts it
    body = {"input_ids": PROMPT_IDS, "sampling_params": {**GREEDY, "max_new_tokens": 30000}, "stream": True}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=120) as r:
        # `lines` stays referenced while the gauges are read: a line iterator that is dropped closes the connection,
        # and the server then aborts the request
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        deadline = time.monotonic() + 5  # the scheduler publishes its gauges every few steps
        running = scrape(url)
        while value(running, "sglang:num_running_reqs", model_dir) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            running = scrape(url)
    assert value(running, "sglang:num_running_reqs", model_dir) == 1
    used = value(running, "sglang:num_used_tokens", model_dir)
    assert used > len(PROMPT_IDS)
    assert value(running, "sglang:token_usage", model_dir) > 0
    assert value(running, "sglang:num_queue_reqs", model_dir) == 0
    assert value(running, "sglang:num_grammar_queue_reqs", model_dir) == 0

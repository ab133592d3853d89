"""OpenAI-compatible output shapes as SGLang has them, against a real SmolLM2 server: streamed completions carry each
chunk's logprobs, chat stream deltas keep their null keys, and /v1/score errors speak SGLang's words."""

from __future__ import annotations

import json
import math

import openai
import pytest
import requests

from tests.conftest import SMOLLM2

DELTA_KEYS = {"role", "content", "reasoning_content", "tool_calls"}


@pytest.fixture(scope="module")
def base_url(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(base_url):
    return openai.Client(base_url=f"{base_url}/v1", api_key="None")


def sse_events(response: requests.Response) -> list[dict]:
    """The JSON events of an SSE response, up to [DONE] (which must end it)."""
    lines = [ln for ln in response.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def concat_logprobs(chunks) -> dict[str, list]:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        lp = chunk.choices[0].logprobs
        for key in out:
            out[key] += getattr(lp, key)
    return out


def assert_same_logprobs(streamed: dict[str, list], whole) -> None:
    assert streamed["tokens"] == whole.tokens and streamed["tokens"]
    assert streamed["text_offset"] == whole.text_offset
    assert len(streamed["token_logprobs"]) == len(whole.token_logprobs)
    for a, b in zip(streamed["token_logprobs"], whole.token_logprobs):
        assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
    assert len(streamed["top_logprobs"]) == len(whole.top_logprobs)
    for a, b in zip(streamed["top_logprobs"], whole.top_logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert set(a) == set(b) and len(a) == 5
            assert all(math.isclose(a[t], b[t], rel_tol=1e-4, abs_tol=1e-4) for t in a)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_concatenate_to_the_whole(client, echo):
    kwargs = dict(model=SMOLLM2, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=5,
                  echo=echo)
    response = client.completions.create(**kwargs)
    whole = response.choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    # Every chunk that brings text brings the logprobs of its own new tokens, never null.
    assert all(c.choices[0].logprobs is not None for c in chunks if c.choices[0].text)
    assert_same_logprobs(concat_logprobs(chunks), whole.logprobs)
    first = chunks[0].choices[0].logprobs
    if echo:  # the prompt's logprobs come in the first chunk, its first token without a logprob
        assert len(first.tokens) >= response.usage.prompt_tokens and first.token_logprobs[0] is None
        assert first.top_logprobs[0] is None
    else:
        assert len(first.tokens) < len(whole.logprobs.tokens)


def test_streamed_completion_without_logprobs_sends_null(base_url):
    r = requests.post(base_url + "/v1/completions", stream=True, json={
        "model": "m", "prompt": "The capital of France is", "max_tokens": 2, "stream": True})
    events = sse_events(r)
    assert events and all(e["choices"][0]["logprobs"] is None for e in events)


def test_chat_stream_chunks_have_sglang_keys(base_url):
    r = requests.post(base_url + "/v1/chat/completions", stream=True, json={
        "model": "m", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 6, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r)
    *chunks, usage = events
    for event in chunks:
        assert set(event) == {"id", "object", "created", "model", "choices", "usage"} and event["usage"] is None
        (choice,) = event["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason", "matched_stop"}
        assert set(choice["delta"]) == DELTA_KEYS
    first, *middle, last = [e["choices"][0] for e in chunks]
    assert first["delta"] == {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": None}
    assert first["finish_reason"] is None
    assert middle and all(c["delta"]["role"] is None and c["delta"]["content"] for c in middle)
    assert all(c["delta"]["reasoning_content"] is None and c["delta"]["tool_calls"] is None for c in middle)
    assert last["delta"] == dict.fromkeys(DELTA_KEYS) and last["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert set(usage["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    assert usage["usage"]["completion_tokens"] > 0


def test_openai_client_sees_reasoning_content_in_every_delta(client):
    chunks = [c for c in client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Say hello"}], max_tokens=4, temperature=0,
        stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert delta.reasoning_content is None  # present (null) without a reasoning parser
        assert delta.tool_calls is None
    assert chunks[-1].choices[0].delta.content is None and chunks[-1].choices[0].finish_reason


VOCAB = 49152


@pytest.mark.parametrize("body,message", [
    ({"query": "Is it? ", "items": ["Yes"], "label_token_ids": [5, VOCAB + 7]},
     f"Token ID {VOCAB + 7} is out of vocabulary (vocab size: {VOCAB})"),
    ({"query": "Is it? ", "items": ["Yes"], "label_token_ids": [VOCAB]},
     f"Token ID {VOCAB} is out of vocabulary (vocab size: {VOCAB})"),
    ({"query": "Is it? ", "items": [[1, 2]], "label_token_ids": [5]},
     "Invalid combination of query/items types for score_request."),
    ({"query": [1, 2], "items": ["Yes"], "label_token_ids": [5]},
     "Invalid combination of query/items types for score_request."),
    ({"items": ["Yes"], "label_token_ids": [5]}, "Invalid combination of query/items types for score_request."),
    ({"query": "Is it? ", "label_token_ids": [5]}, "Invalid combination of query/items types for score_request."),
    ({"query": "Is it? ", "items": ["Yes"]}, "label_token_ids must be provided"),
])
def test_score_errors_speak_sglang(base_url, body, message):
    r = requests.post(base_url + "/v1/score", json=body)
    assert r.status_code == 400
    assert r.json() == {"object": "error", "message": message, "type": "BadRequestError", "param": None,
                        "code": 400}


def test_score_with_no_items_scores_nothing(base_url):
    r = requests.post(base_url + "/v1/score", json={"query": "Is it? ", "items": [], "label_token_ids": [5]})
    assert r.status_code == 200 and r.json()["scores"] == []
    ok = requests.post(base_url + "/v1/score", json={"query": "Is it? ", "items": ["Yes"],
                                                     "label_token_ids": [5, VOCAB - 1]})
    assert ok.status_code == 200 and len(ok.json()["scores"][0]) == 2

"""/metrics series that SGLang's own server tests look for: the per-handler latency histogram
(`sglang:func_latency_seconds{name=...}`) and the time per output token after the first
(`sglang:time_per_output_token_seconds`)."""

from __future__ import annotations

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SMOLLM2


def _samples(base_url: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"{base_url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _count(samples: dict, metric: str, **labels: str) -> float:
    return samples.get((f"{metric}_count", tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def base_url(smollm2_server) -> str:
    return smollm2_server


def test_handlers_are_timed_by_name(base_url):
    before = _samples(base_url)
    generate = requests.post(f"{base_url}/generate", json={
        "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert generate.status_code == 200, generate.text
    stream = requests.post(f"{base_url}/generate", stream=True, json={
        "text": "Hello", "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert stream.status_code == 200
    list(stream.iter_lines())
    client = openai.Client(api_key="EMPTY", base_url=f"{base_url}/v1")
    client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    client.completions.create(model=SMOLLM2, prompt="Hi", max_tokens=2)
    bad = requests.post(f"{base_url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}})
    assert bad.status_code == 400
    after = _samples(base_url)

    name = "sglang:func_latency_seconds"
    # Both /generate calls and the rejected one: a handler is timed however it returns.
    assert _count(after, name, name="generate_request") - _count(before, name, name="generate_request") == 3
    for handler in ("openai_v1_chat_completions", "openai_v1_completions"):
        assert _count(after, name, name=handler) - _count(before, name, name=handler) == 1, handler
    assert _count(after, name, name="openai_v1_embeddings") == 0  # a generation server serves no embeddings


def test_time_per_output_token_counts_requests_with_two_or_more_tokens(base_url):
    name, labels = "sglang:time_per_output_token_seconds", {"model_name": SMOLLM2}
    before = _samples(base_url)
    for max_new_tokens in (1, 4):
        # Streamed, so the first token arrives before the last and the time after it is measurable.
        response = requests.post(f"{base_url}/generate", stream=True, json={
            "text": "Count: one, two,", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
        assert response.status_code == 200, response.text
        list(response.iter_lines())
    after = _samples(base_url)

    # One token has no "time per token after the first": only the 4-token request is observed.
    assert _count(after, name, **labels) - _count(before, name, **labels) == 1
    observed = after[(f"{name}_sum", tuple(labels.items()))] - before.get((f"{name}_sum", tuple(labels.items())), 0.0)
    assert 0 < observed < 60


@pytest.fixture(scope="module")
def engine():
    import sglang as sgl

    eng = sgl.Engine(model_path=SMOLLM2, max_total_tokens=2048)
    yield eng
    eng.shutdown()


def test_engine_shares_the_threads_event_loop(engine):
    """Sync calls and `asyncio.get_event_loop().run_until_complete(engine.async_generate(...))` interleave, as
    SGLang's engine allows: both run on this thread's loop."""
    import asyncio

    params = {"temperature": 0, "max_new_tokens": 4}
    sync_text = engine.generate("The capital of France is", params)["text"]
    loop = asyncio.get_event_loop()
    assert loop is engine.loop
    async_out = loop.run_until_complete(asyncio.wait_for(engine.async_generate("The capital of France is", params),
                                                         timeout=60))
    assert async_out["text"] == sync_text
    assert engine.generate("The capital of France is", params)["text"] == sync_text


def test_engine_score_matches_the_score_route_semantics(engine, smollm2_tokenizer):
    labels = [smollm2_tokenizer.encode(t, add_special_tokens=False)[0] for t in (" to", " the")]
    scores = engine.score(query="I pledge allegiance", items=["", " to"], label_token_ids=labels,
                          apply_softmax=True)
    assert len(scores) == 2 and all(len(row) == 2 for row in scores)
    assert all(abs(sum(row) - 1.0) < 1e-6 for row in scores)
    assert scores[0][0] > 0.9  # "I pledge allegiance" -> " to"
    raw = engine.score(query="I pledge allegiance", items=[""], label_token_ids=labels)
    assert 0 < sum(raw[0]) <= 1.0  # without softmax: the probabilities over the whole vocabulary
    assert engine.score(query="x", items=[], label_token_ids=labels) == []
    with pytest.raises(ValueError, match="Token ID 999999 is out of vocabulary"):
        engine.score(query="x", items=["y"], label_token_ids=[999999])

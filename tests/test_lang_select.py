"""`select`'s three choice methods against logprobs computed directly with transformers, and the same
programs through the RuntimeEndpoint, in-process Engine and OpenAI backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sglang as sgl
from sglang import assistant, assistant_begin, function, gen, select, user
from sglang.lang.backend.engine_backend import EngineBackend
from sglang.lang.backend.openai import OpenAI
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from tests.conftest import SMOLLM2
from tests.server_fixtures import running_server

CHOICES = ["Yes", "No", "Yes, definitely", "I am not sure"]
QUESTIONS = ["Is the sky blue? Answer yes or no.", "Is a cat a kind of fish?"]
METHODS = {
    "token_length_normalized": sgl.token_length_normalized,
    "greedy_token_selection": sgl.greedy_token_selection,
    "unconditional_likelihood_normalized": sgl.unconditional_likelihood_normalized,
}


# float32 weights and dense matmuls (on CPUs with bf16 the default is bf16, and small matmuls read the
# quantized blocks), so the server's logprobs are the float32 model's: comparable with transformers'.
DENSE = ("--dtype", "float32", "--gguf-kernel-max-rows", "0")


@pytest.fixture(scope="module")
def base_url():
    with running_server(*DENSE) as url:
        yield url


@pytest.fixture(scope="module")
def endpoint(base_url):
    return RuntimeEndpoint(base_url)


@pytest.fixture(scope="module")
def engine_backend():
    engine = sgl.Engine(model_path=SMOLLM2, dtype="float32", gguf_kernel_max_rows=0)
    backend = EngineBackend.for_engine(engine)
    try:
        yield backend
    finally:
        backend.shutdown()
        engine.shutdown()


@pytest.fixture(scope="module")
def openai_backend(base_url):
    # Completion mode: the prompt is the program's text, exactly as the native backends send it.
    return OpenAI(SMOLLM2, is_chat_model=False, base_url=base_url + "/v1", api_key="unused")


@function
def yes_no(s, question, method):
    s += user(question)
    s += assistant_begin()
    s += select("answer", choices=CHOICES, choices_method=method)


def _reference_entries(model, tokenizer, prefix: str, choice: str):
    """[logprob, token_id, text] from two tokens before the choice, the first one null (as /generate)."""
    prefix_len = len(tokenizer(prefix).input_ids)
    ids = tokenizer(prefix + choice).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = max(prefix_len - 2, 0)
    entries = []
    for t in range(start, len(ids)):
        lp = None if t == start else float(logprobs[t - 1, ids[t]])
        entries.append([lp, ids[t], tokenizer.decode([ids[t]])])
    if len(entries) > 1 and prefix.endswith(entries[0][2]):
        entries = entries[1:]
    return entries


def _unconditional(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [0.0] + [float(logprobs[t - 1, ids[t]]) for t in range(1, len(ids))]


def _scores(method: str, model, entries_per_choice) -> list:
    values = [[lp or 0.0 for lp, _, _ in entries] for entries in entries_per_choice]
    if method == "token_length_normalized":
        return [float(np.mean([v for v, (lp, _, _) in zip(vals, e) if lp])) for vals, e in
                zip(values, entries_per_choice)]
    if method == "unconditional_likelihood_normalized":
        return [float(np.mean(np.array(vals) - np.array(_unconditional(model, [i for _, i, _ in e]))))
                for vals, e in zip(values, entries_per_choice)]
    # greedy: the first position where one choice alone is best decides (shorter ones padded by their mean)
    width = max(map(len, values))
    return [vals + [float(np.mean(vals))] * (width - len(vals)) for vals in values]


def _greedy_winner(rows: list[list[float]]) -> int:
    remaining = list(range(len(rows)))
    for j in range(len(rows[0])):
        best = max(rows[i][j] for i in remaining)
        remaining = [i for i in remaining if rows[i][j] == best]
        if len(remaining) == 1:
            break
    return remaining[0]


@pytest.mark.parametrize("method", list(METHODS))
def test_select_matches_model_logprobs(endpoint, smollm2_hf, smollm2_tokenizer, method):
    question = QUESTIONS[0]
    state = yes_no.run(question, METHODS[method], backend=endpoint)
    decision = state["answer"]
    assert decision in CHOICES
    prefix = state.text()[: -len(decision)]
    entries = [_reference_entries(smollm2_hf, smollm2_tokenizer, prefix, c) for c in CHOICES]
    meta = state.get_meta_info("answer")
    # The server's logprobs of every choice token are the model's.
    for got, want in zip(meta["input_token_logprobs"], entries):
        assert [e[1] for e in got] == [e[1] for e in want]
        np.testing.assert_allclose([e[0] or 0.0 for e in got], [e[0] or 0.0 for e in want], atol=2e-3)
    scores = _scores(method, smollm2_hf, entries)
    if method == "greedy_token_selection":
        np.testing.assert_allclose(meta["greedy_logprob_matrix"], scores, atol=2e-3)
        assert decision == CHOICES[_greedy_winner(scores)]
        return
    key = ("normalized_unconditional_prompt_logprobs" if method == "unconditional_likelihood_normalized"
           else "normalized_prompt_logprobs")
    np.testing.assert_allclose(meta[key], scores, atol=2e-3)
    ranked = sorted(scores, reverse=True)
    if ranked[0] - ranked[1] > 5e-2:  # a clear winner: it must be the one chosen
        assert decision == CHOICES[int(np.argmax(scores))]
    else:
        assert scores[CHOICES.index(decision)] >= ranked[1] - 1e-6


@pytest.mark.parametrize("method", list(METHODS))
def test_same_select_across_backends(endpoint, engine_backend, openai_backend, method):
    for question in QUESTIONS:
        native = yes_no.run(question, METHODS[method], backend=endpoint)["answer"]
        assert yes_no.run(question, METHODS[method], backend=engine_backend)["answer"] == native
        if method != "unconditional_likelihood_normalized":
            assert yes_no.run(question, METHODS[method], backend=openai_backend)["answer"] == native


def test_openai_backend_refuses_unconditional_method(openai_backend):
    state = yes_no.run(QUESTIONS[0], sgl.unconditional_likelihood_normalized, backend=openai_backend)
    with pytest.raises(RuntimeError, match="token ids"):
        state["answer"]


def test_same_generation_across_backends(base_url, endpoint, engine_backend, openai_backend):
    @function
    def fruit(s):
        s += user("Name a fruit and say why you like it.")
        s += assistant(gen("x", max_tokens=16, temperature=0))

    native = fruit.run(backend=endpoint)["x"]
    assert native
    assert fruit.run(backend=engine_backend)["x"] == native
    assert fruit.run(backend=openai_backend)["x"] == native
    chat = OpenAI(SMOLLM2, base_url=base_url + "/v1", api_key="unused")  # chat completions, from messages
    assert fruit.run(backend=chat)["x"] == native
    # Streaming through the engine yields the same text in pieces.
    streamed = fruit.run(backend=engine_backend, stream=True)
    pieces = list(streamed.text_iter("x"))
    assert len(pieces) > 1 and "".join(pieces) == native


def test_set_default_backend_accepts_engine(engine_backend):
    sgl.set_default_backend(engine_backend.engine)
    try:
        assert sgl.global_config.default_backend is engine_backend
        assert sgl.get_server_info()["model_path"] == SMOLLM2
    finally:
        sgl.global_config.default_backend = None

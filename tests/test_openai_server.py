"""The OpenAI-compatible API with the official `openai` client against a real server on SmolLM2."""


import openai
import pytest
import requests

from tests.conftest import SMOLLM2
from tests.server_fixtures import running_server

MODEL = SMOLLM2


@pytest.fixture(scope="module")
def base_url(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(base_url):
    return openai.Client(base_url=f"{base_url}/v1", api_key="None")


def test_chat_cell(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List 3 countries and their capitals."}],
        temperature=0, max_tokens=64,
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and len(response.id) == 32
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= 64
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


HISTORIAN_MESSAGES = [
    {"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
    {"role": "user", "content": "Tell me about ancient Rome"},
    {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
    {"role": "user", "content": "What were their major achievements?"},
]


def test_chat_detailed_parameters_cell(client):
    kwargs = dict(model=MODEL, messages=HISTORIAN_MESSAGES, temperature=0.3, max_tokens=128, top_p=0.95,
                  presence_penalty=0.2, frequency_penalty=0.2, n=1, seed=42)
    response = client.chat.completions.create(**kwargs)
    assert response.choices[0].message.content
    again = client.chat.completions.create(**kwargs)
    assert again.choices[0].message.content == response.choices[0].message.content


def test_chat_stream_cell_concatenates_to_non_stream(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say this is a test"}], temperature=0,
                  max_tokens=48)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices[0].delta.content is not None:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == full


def test_chat_stream_include_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks[:-1])


def test_completions_cells(client):
    response = client.completions.create(
        model=MODEL, prompt="List 3 countries and their capitals.", temperature=0, max_tokens=64, n=1, stop=None)
    assert response.object == "text_completion" and response.choices[0].text
    response = client.completions.create(
        model=MODEL, prompt="Write a short story about a space explorer.", temperature=0.7, max_tokens=150,
        top_p=0.9, stop=["\n\n", "THE END"], presence_penalty=0.3, frequency_penalty=0.3, n=1, seed=123)
    text = response.choices[0].text
    assert "\n\n" not in text and "THE END" not in text
    if response.choices[0].finish_reason == "stop":
        assert response.choices[0].matched_stop in ("\n\n", "THE END") or isinstance(
            response.choices[0].matched_stop, int)


def test_chat_greedy_equals_generate(client, base_url, smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    native = requests.post(f"{base_url}/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 32}}).json()
    assert chat.choices[0].message.content == native["text"]
    assert chat.usage.prompt_tokens == len(ids)


def test_n3_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name an animal."}], n=3, seed=7,
                  temperature=1.0, max_tokens=12)
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    second = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert len(first) == 3 and first == second


def test_stop_string_matched_stop(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20)
    text = full.choices[0].text
    stop = text.strip().split(",")[0].strip() or text.split()[0]
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].matched_stop == stop
    assert stop not in out.choices[0].text


def test_logprobs_shapes(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, logprobs=True, top_logprobs=3, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert content[0].bytes == list(content[0].token.encode("utf-8"))
    comp = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, logprobs=2, echo=True,
                                     temperature=0)
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
    assert comp.choices[0].text.startswith("Hello world")


def test_cached_tokens_in_usage(client):
    prefix = "You are a careful assistant who answers briefly. " * 10
    for q in ("What is 2+2?", "What is 3+3?"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": prefix},
                                                                  {"role": "user", "content": q}], max_tokens=4)
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens > 50


def test_models_routes(client, base_url):
    models = client.models.list()
    assert models.data[0].id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    missing = requests.get(f"{base_url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_curl_and_requests_style(base_url):
    # No max_tokens, as in the notebook: generation runs to EOS. Greedy keeps that short and deterministic;
    # sampled at temperature 1 this small model can ramble for thousands of tokens.
    r = requests.post(f"{base_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert list(body["usage"].keys()) == ["prompt_tokens", "total_tokens", "completion_tokens",
                                          "prompt_tokens_details"]


BAD_REQUESTS = [
    ("chat", {"model": MODEL}, "messages"),
    ("chat", {"model": MODEL, "messages": []}, "messages"),
    ("chat", {"model": MODEL, "messages": "hello"}, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("chat", {"model": MODEL, "messages": [{"content": "x"}]}, "role"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "content"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, "top_p"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": 0}, "top_k"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**7}, "context length"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": "two"}, "n"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 9},
     "presence_penalty"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frequency_penalty": -9},
     "frequency_penalty"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 7},
     "repetition_penalty"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999999": 5}},
     "logit_bias"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "maybe"}, "stream"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "bogus"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "min_tokens": -1}, "min_tokens"),
    ("completions", {"model": MODEL}, "prompt"),
    ("completions", {"model": MODEL, "prompt": ""} , None),
    ("completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens must be positive"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 100}, "logprobs"),
    ("completions", {"model": MODEL, "prompt": [[]]}, "prompt"),
    ("completions", {"model": MODEL, "prompt": [10**9]}, "vocabulary"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, "context length"),
]


@pytest.mark.parametrize("route,body,needle", BAD_REQUESTS)
def test_malformed_requests_get_400(base_url, route, body, needle):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = requests.post(base_url + path, json=body)
    if needle is None:  # an empty prompt is valid: the model continues from nothing
        assert r.status_code in (200, 400)
        return
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400
    assert needle.lower() in err["message"].lower(), err["message"]


def test_non_json_and_wrong_content_type(base_url):
    r = requests.post(f"{base_url}/v1/chat/completions", data=b"not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["message"]
    r = requests.post(f"{base_url}/v1/chat/completions", data=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["message"]
    # and the server keeps serving
    ok = requests.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_streaming_request_with_bad_params_is_400(base_url):
    with requests.post(f"{base_url}/v1/completions", stream=True, json={
            "model": MODEL, "prompt": "x", "max_tokens": 100000, "stream": True}) as r:
        assert r.status_code == 400
        assert "context length" in r.json()["message"]


def test_api_key_served_model_name_and_chat_template():
    args = ("--log-level", "warning", "--max-total-tokens", "2048", "--api-key", "sekret",
            "--served-model-name", "my-model", "--chat-template", "chatml")
    with running_server(*args) as url:
        assert requests.get(f"{url}/health").status_code == 200
        assert requests.get(f"{url}/v1/models").status_code == 401
        assert requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        good = openai.Client(base_url=f"{url}/v1", api_key="sekret")
        assert [m.id for m in good.models.list().data] == ["my-model"]
        assert good.models.retrieve("my-model").root == "my-model"
        # The built-in chatml template has no default system prompt, unlike SmolLM2's own template.
        chat = good.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=1)
        assert chat.usage.prompt_tokens == len(requests.post(
            f"{url}/tokenize", headers={"Authorization": "Bearer sekret"},
            json={"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}).json()["tokens"])
        bad = openai.Client(base_url=f"{url}/v1", api_key="nope")
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert requests.post(f"{url}/generate", json={"text": "hi"}).status_code == 401


def test_continue_final_message_and_template_kwargs(client, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A ripe"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"continue_final_message": True})
    ids = smollm2_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                                return_dict=False)
    assert out.usage.prompt_tokens == len(ids)

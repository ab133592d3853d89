"""Reward and cross-encoder servers (tiny random checkpoints built here) and the pooled routes on a generation
server. The request code mirrors the /classify and /v1/rerank cells of the reference notebooks."""

from __future__ import annotations

import math

import pytest
import requests
import torch

from sglang.srt.model_loader.resolve import resolve_model_path
from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST
from tests.server_fixtures import running_server
from tests.test_embedding_models import MINILM, _random_biases

PROMPT = "What is the range of the numeric output of a sigmoid node in a neural network?"
RESPONSE1 = "The output of a sigmoid node is bounded between -1 and 1."
RESPONSE2 = "The output of a sigmoid node is bounded between 0 and 1."
CONVS = [
    [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE1}],
    [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE2}],
]
QUERY = "what is panda?"
DOCUMENTS = [
    "hi",
    "The giant panda (Ailuropoda melanoleuca), sometimes called a panda bear or simply panda, is a bear species "
    "endemic to China.",
    "Pandas eat bamboo.",
]
SERVER_ARGS = ("--is-embedding", "--dtype", "float32", "--max-total-tokens", "4096")


# ---- reward model (/classify) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    model_dir = tmp_path_factory.mktemp("reward")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, num_labels=1, pad_token_id=tokenizer.pad_token_id or 0)
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    _random_biases(model, 11)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with running_server(*SERVER_ARGS, model=str(model_dir)) as url:
        yield url, str(model_dir), model, tokenizer


def test_classify_cell_returns_reward_scores(reward):
    url, model_dir, model, _ = reward
    from transformers import AutoTokenizer

    # the notebook cell, with our model substituted
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = tokenizer.apply_chat_template(CONVS, tokenize=False, return_dict=False)
    data = {"model": model_dir, "text": prompts}
    responses = requests.post(url + "/classify", json=data).json()
    rewards = [response["embedding"][0] for response in responses]

    with torch.inference_mode():
        expected = [float(model(torch.tensor([tokenizer.encode(p)])).logits[0, 0]) for p in prompts]
    assert len(rewards) == 2 and all(len(r["embedding"]) == 1 for r in responses)
    assert rewards == pytest.approx(expected, abs=1e-4)
    assert requests.get(url + "/get_model_info").json()["is_generation"] is False


# ---- cross-encoder (/v1/rerank) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    model_dir = tmp_path_factory.mktemp("reranker")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MINILM))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                        initializer_range=0.2, num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    _random_biases(model, 13)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with running_server(*SERVER_ARGS, model=str(model_dir)) as url:
        yield url, str(model_dir), model, tokenizer


def test_rerank_cell_sorted_with_original_index(reranker):
    url, model_dir, model, tokenizer = reranker
    data = {"model": model_dir, "query": QUERY, "documents": DOCUMENTS}
    response_json = requests.post(url + "/v1/rerank", json=data).json()
    lines = [f"Score: {item['score']:.2f} - Document: '{item['document']}'" for item in response_json]
    assert len(lines) == len(DOCUMENTS)

    with torch.inference_mode():
        logits = [float(model(**tokenizer(QUERY, doc, return_tensors="pt")).logits[0, 0]) for doc in DOCUMENTS]
    expected = sorted(((1 / (1 + math.exp(-x)), i) for i, x in enumerate(logits)), reverse=True)
    assert [item["index"] for item in response_json] == [i for _, i in expected]
    assert [item["score"] for item in response_json] == pytest.approx([s for s, _ in expected], abs=1e-5)
    assert [item["document"] for item in response_json] == [DOCUMENTS[i] for _, i in expected]
    top = requests.post(url + "/v1/rerank", json={**data, "top_n": 1}).json()
    assert [item["index"] for item in top] == [expected[0][1]]


@pytest.mark.parametrize("body,message", [
    ({"query": "", "documents": ["a"]}, "Query cannot be empty"),
    ({"documents": ["a"]}, "Query cannot be empty"),
    ({"query": "  ", "documents": ["a"]}, "Query cannot be empty or whitespace only"),
    ({"query": "q", "documents": []}, "Documents cannot be empty"),
    ({"query": "q"}, "Documents cannot be empty"),
    ({"query": "q", "documents": ["a", 3]}, "Each document must be a non-empty string"),
    ({"query": "q", "documents": ["a", ""]}, "Each document must be a non-empty string"),
    ({"query": "q", "documents": ["a", " \n"]}, "Each document cannot be empty or whitespace only"),
])
def test_rerank_validation_messages(reranker, body, message):
    r = requests.post(reranker[0] + "/v1/rerank", json=body)
    assert r.status_code == 400
    assert r.json() == {"object": "error", "message": message, "type": "BadRequestError", "param": None,
                        "code": 400}


# ---- generation server: /encode refused, /v1/score ------------------------------------------------------
@pytest.fixture(scope="module")
def generation_server():
    with running_server("--dtype", "float32", "--max-total-tokens", "4096") as url:
        yield url


def test_encode_on_generation_server_refused(generation_server):
    for route in ("/encode", "/classify"):
        r = requests.post(generation_server + route, json={"text": "Once upon a time"})
        assert r.status_code == 400
        assert r.json() == {"error": {"message": (
            "This model does not appear to be an embedding model by default. Please add `--is-embedding` when "
            "launching the server or try another model.")}}
    r = requests.post(generation_server + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "--is-embedding" in r.json()["message"]


def test_score_label_probabilities_match_transformers(generation_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    query = "Is Paris the capital of France? Answer:"
    items = [" Yes", " No"]
    labels = [tokenizer.encode(" Yes")[0], tokenizer.encode(" No")[0]]
    body = {"query": query, "items": items, "label_token_ids": labels, "model": "m"}
    plain = requests.post(generation_server + "/v1/score", json=body).json()
    soft = requests.post(generation_server + "/v1/score", json={**body, "apply_softmax": True}).json()
    assert plain["object"] == "scoring" and len(plain["scores"]) == 2
    for i, item in enumerate(items):
        with torch.inference_mode():
            logits = model(torch.tensor([tokenizer.encode(query + item)])).logits[0, -1].float()
        probs = torch.softmax(logits, -1)[labels]
        assert plain["scores"][i] == pytest.approx(probs.tolist(), rel=1e-3, abs=1e-6)
        assert soft["scores"][i] == pytest.approx((probs / probs.sum()).tolist(), rel=1e-3)
    r = requests.post(generation_server + "/v1/score", json={"query": query, "items": items})
    assert r.status_code == 400 and r.json()["message"] == "label_token_ids must be provided"


# ---- decoder as embedder (gte-Qwen2 style: last token, normalized) through /encode ----------------------
@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    model_dir = tmp_path_factory.mktemp("qwen2-embedder")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False)
    config.matryoshka_dimensions = [16, 32]  # /v1/embeddings may truncate to these sizes
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    _random_biases(model, 17)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with running_server(*SERVER_ARGS, model=str(model_dir)) as url:
        yield url, str(model_dir), model, tokenizer


def test_encode_cell_on_decoder_embedder(decoder_embedder):
    url, model_dir, model, tokenizer = decoder_embedder
    texts = ["Once upon a time", "A much longer sentence about pandas, bamboo and the mountains of China.", "Hi"]
    data = {"model": model_dir, "text": texts[0]}
    response_json = requests.post(url + "/encode", json=data).json()
    first_ten = response_json["embedding"][:10]
    batch = requests.post(url + "/encode", json={"text": texts}).json()

    with torch.inference_mode():
        expected = [torch.nn.functional.normalize(
            model.model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, -1], dim=-1) for t in texts]
    assert first_ten == pytest.approx(expected[0][:10].tolist(), abs=1e-5)
    for out, exp in zip(batch, expected):
        assert out["embedding"] == pytest.approx(exp.tolist(), abs=1e-5)
    # the KV of pooled requests is freed: the pool is whole again once they are done
    state = requests.get(url + "/get_server_info").json()["internal_states"][0]
    assert state["token_usage"] == 0 and state["num_running_reqs"] == 0


def test_matryoshka_dimensions(decoder_embedder):
    import openai

    url, model_dir = decoder_embedder[0], decoder_embedder[1]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    full = client.embeddings.create(model=model_dir, input="pandas", encoding_format="float").data[0].embedding
    short = client.embeddings.create(model=model_dir, input="pandas", dimensions=16).data[0].embedding
    assert len(full) == 64 and len(short) == 16
    expected = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
    assert short == pytest.approx(expected.tolist(), abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions 20 is not supported"):
        client.embeddings.create(model=model_dir, input="pandas", dimensions=20)

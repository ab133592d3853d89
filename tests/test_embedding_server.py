"""An --is-embedding server on all-MiniLM-L6-v2: /encode, /v1/embeddings (openai client), errors, batching."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import requests
import torch
import torch.nn.functional as F

from sglang.srt.model_loader.resolve import resolve_model_path
from tests.server_fixtures import running_server
from tests.test_embedding_models import MINILM, SENTENCES, st_mean_pooling


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("storage"))
    with running_server("--is-embedding", "--dtype", "float32", "--max-total-tokens", "8192",
                        "--file-storage-path", storage, model=MINILM) as url:
        yield url


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModel, AutoTokenizer

    model_dir = resolve_model_path(MINILM)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    return tokenizer, st_mean_pooling(model, tokenizer, SENTENCES)


def cosines(rows: list[list[float]], expected: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(rows, dtype=torch.float64), expected.double(), dim=-1)


def test_model_info_is_not_generation(server):
    info = requests.get(server + "/get_model_info").json()
    assert info["is_generation"] is False and info["architectures"] == ["BertModel"]


def test_encode_single_and_batch_match_transformers(server, reference):
    tokenizer, expected = reference
    single = requests.post(server + "/encode", json={"model": MINILM, "text": SENTENCES[1]}).json()
    assert single["meta_info"]["prompt_tokens"] == len(tokenizer.encode(SENTENCES[1]))
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert float(cosines([single["embedding"]], expected[1:2])[0]) > 0.9999
    batch = requests.post(server + "/encode", json={"text": SENTENCES}).json()
    assert [len(b["embedding"]) for b in batch] == [384] * len(SENTENCES)
    assert float(cosines([b["embedding"] for b in batch], expected).min()) > 0.9999


def test_concurrent_requests_are_batched_and_correct(server, reference):
    _, expected = reference

    def one(i: int) -> list[float]:
        return requests.post(server + "/encode", json={"text": SENTENCES[i]}).json()["embedding"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(one, range(len(SENTENCES))))
    assert float(cosines(rows, expected).min()) > 0.9999
    state = requests.get(server + "/get_server_info").json()["internal_states"][0]
    # every request's KV slots were freed once it was pooled
    assert state["token_usage"] == 0 and state["num_running_reqs"] == 0


def test_encode_token_ids(server, reference):
    tokenizer, expected = reference
    ids = tokenizer.encode(SENTENCES[5])
    out = requests.post(server + "/encode", json={"input_ids": ids}).json()
    assert float(cosines([out["embedding"]], expected[5:6])[0]) > 0.9999


def test_openai_client_float_and_base64(server, reference):
    tokenizer, expected = reference
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    as_float = client.embeddings.create(model=MINILM, input=SENTENCES[:4], encoding_format="float")
    as_b64 = client.embeddings.create(model=MINILM, input=SENTENCES[:4])  # the client asks for base64
    assert [d.index for d in as_float.data] == [0, 1, 2, 3]
    rows_f = [d.embedding for d in as_float.data]
    rows_b = [d.embedding for d in as_b64.data]
    assert float(cosines(rows_f, expected[:4]).min()) > 0.9999
    assert torch.allclose(torch.tensor(rows_f), torch.tensor(rows_b), atol=1e-6)
    assert as_float.usage.prompt_tokens == sum(len(tokenizer.encode(s)) for s in SENTENCES[:4])
    assert as_float.usage.total_tokens == as_float.usage.prompt_tokens
    ids = client.embeddings.create(model=MINILM, input=[tokenizer.encode(SENTENCES[2])], encoding_format="float")
    assert float(cosines([ids.data[0].embedding], expected[2:3])[0]) > 0.9999
    single = client.embeddings.create(model=MINILM, input=SENTENCES[0], encoding_format="float")
    assert len(single.data) == 1 and single.model == MINILM


@pytest.mark.parametrize("value,message", [
    ("", "Input cannot be empty"),
    ([], "Input cannot be empty"),
    ("   ", "Input cannot be empty or whitespace only"),
    (["ok", " "], "Input at index 1 cannot be empty or whitespace only"),
    ([1, "a", 3], "All items in input list must be integers"),
    ([5, -2], "Token ID at index 1 must be non-negative"),
    ([[1, 2], [3, 1.5]], "All items in input list must be integers"),
])
def test_openai_input_validation(server, value, message):
    r = requests.post(server + "/v1/embeddings", json={"model": MINILM, "input": value})
    assert r.status_code == 400
    body = r.json()
    assert body["message"] == message and body["type"] == "BadRequestError" and body["code"] == 400


def test_openai_other_errors(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=MINILM, input="hi", dimensions=64)
    r = requests.post(server + "/v1/embeddings", json={"input": "hi", "encoding_format": "int8"})
    assert r.status_code == 400 and "encoding_format" in r.json()["message"]
    r = requests.post(server + "/v1/embeddings", json={"input": [10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["message"]
    with pytest.raises(openai.BadRequestError, match="does not support generation"):
        client.chat.completions.create(model=MINILM, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("body,message", [
    ({"text": "a", "input_ids": [1]}, "text and input_ids cannot be provided at the same time"),
    ({"model": MINILM}, "At least one of text, input_ids, or image should be provided"),
    ({"text": 5}, "text must be"),
    ({"text": ["ok", 3]}, "text[1] must be a string"),
    ({"input_ids": [1, "x"]}, "input_ids must be"),
    ({"text": "word " * 600}, "exceeds the maximum allowed length"),
])
def test_native_validation(server, body, message):
    r = requests.post(server + "/encode", json=body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_rerank_needs_a_cross_encoder(server):
    r = requests.post(server + "/v1/rerank", json={"query": "q", "documents": ["a"]})
    assert r.status_code == 400 and "needs a cross-encoder" in r.json()["message"]


def test_generation_routes_refused(server):
    r = requests.post(server + "/generate", json={"text": "hi"})
    assert r.status_code == 400 and "does not support generation" in r.json()["error"]["message"]
    assert requests.get(server + "/health_generate", timeout=30).status_code == 200


def test_engine_encode(reference):
    from sglang import Engine

    tokenizer, expected = reference
    with Engine(model_path=MINILM, is_embedding=True, dtype="float32", max_total_tokens=4096) as engine:
        single = engine.encode(SENTENCES[3])
        batch = engine.encode(SENTENCES[:6])
        by_ids = engine.encode(input_ids=[tokenizer.encode(SENTENCES[7])])
        with pytest.raises(ValueError, match="cannot be provided at the same time"):
            engine.encode("a", input_ids=[1, 2])
    assert float(cosines([single["embedding"]], expected[3:4])[0]) > 0.9999
    assert float(cosines([b["embedding"] for b in batch], expected[:6]).min()) > 0.9999
    assert float(cosines([by_ids[0]["embedding"]], expected[7:8])[0]) > 0.9999


def test_embeddings_batch_file(server, reference):
    """A /v1/embeddings batch on an embedding server: every line's vectors equal the online endpoint's."""
    import io
    import json
    import time

    _, expected = reference
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MINILM, "input": SENTENCES[i] if i % 2 else SENTENCES[i:i + 2]}} for i in range(4)]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    upload = client.files.create(file=io.BytesIO(data), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 4
    results = {}
    for raw in client.files.content(batch.output_file_id).text.splitlines():
        row = json.loads(raw)
        assert row["response"]["status_code"] == 200
        results[row["custom_id"]] = [d["embedding"] for d in row["response"]["body"]["data"]]
    for i in range(4):
        rows = results[f"e{i}"]
        want = expected[i:i + 1] if i % 2 else expected[i:i + 2]
        assert len(rows) == len(want) and float(cosines(rows, want).min()) > 0.9999

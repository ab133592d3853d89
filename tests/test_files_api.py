"""/v1/files and /v1/batches error handling with the official `openai` client against a real server."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
import requests

from tests.conftest import SMOLLM2
from tests.server_fixtures import running_server

MAX_FILE_SIZE = 256 * 1024


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("data") / "storage"


@pytest.fixture(scope="module")
def base_url(storage):
    with running_server("--log-level", "warning", "--file-storage-path", str(storage),
                        "--max-file-size", str(MAX_FILE_SIZE), "--batch-max-inflight", "4") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.Client(base_url=f"{base_url}/v1", api_key="None", max_retries=0)


def chat_line(i: int, max_tokens: int = 4, url: str = "/chat/completions") -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": SMOLLM2, "messages": [{"role": "user", "content": f"Say {i}"}],
                     "max_tokens": max_tokens, "temperature": 0}}


def jsonl(lines: list) -> bytes:
    return b"".join((json.dumps(x) if not isinstance(x, str) else x).encode() + b"\n" for x in lines)


def upload(client, data: bytes, name: str = "in.jsonl"):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def wait_done(client, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not finish: {b.status}")


def test_storage_folder_is_created_on_first_upload(client, storage):
    assert client.files.list().data == [] and client.batches.list().data == []
    assert not storage.exists()
    upload(client, jsonl([chat_line(0)]))
    assert (storage / "metadata.db").exists()


def test_file_crud(client):
    data = jsonl([chat_line(0), chat_line(1)])
    f = upload(client, data, "mine.jsonl")
    assert f.id.startswith("backend_input_file-") and f.bytes == len(data) and f.filename == "mine.jsonl"
    assert f.purpose == "batch"
    got = client.files.retrieve(f.id)
    assert got.id == f.id and got.bytes == len(data)
    assert client.files.content(f.id).read() == data
    assert f.id in [x.id for x in client.files.list()]
    assert client.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(f.id)


def test_malformed_jsonl_is_refused(client, base_url):
    before = [x.id for x in client.files.list()]
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, b'{"custom_id": "a"}\n{not json\n')
    assert "line 2" in str(e.value) and "JSON" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="empty"):
        upload(client, b"\n\n")
    r = requests.post(f"{base_url}/v1/files", data=b"{}", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["object"] == "error"
    assert [x.id for x in client.files.list()] == before


def test_oversized_upload_is_refused_and_nothing_is_lost(client):
    keep = upload(client, jsonl([chat_line(0)]))
    big = jsonl([{"custom_id": f"x{i}", "pad": "a" * 1000} for i in range(400)])
    assert len(big) > MAX_FILE_SIZE
    with pytest.raises(openai.APIStatusError) as e:
        upload(client, big)
    assert e.value.status_code == 413 and "--max-file-size" in str(e.value)
    assert client.files.content(keep.id).read() == jsonl([chat_line(0)])
    assert all(x.bytes <= MAX_FILE_SIZE for x in client.files.list())


@pytest.mark.parametrize("bad_id", ["../x", "..%2Fx", "backend_input_file-00", "/etc/passwd"])
def test_unknown_and_path_like_ids(client, base_url, bad_id):
    for method, path in (("GET", f"/v1/files/{bad_id}"), ("GET", f"/v1/files/{bad_id}/content"),
                         ("DELETE", f"/v1/files/{bad_id}")):
        r = requests.request(method, base_url + path)
        assert 400 <= r.status_code < 500, (method, path, r.status_code)
        if r.headers.get("content-type", "").startswith("application/json") and r.status_code != 404:
            assert r.json()["object"] == "error"
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("backend_input_file-" + "0" * 32)
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
        client.batches.create(input_file_id=bad_id, endpoint="/v1/chat/completions", completion_window="24h")


def test_batch_create_errors(client):
    f = upload(client, jsonl([chat_line(0)]))
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/images", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="backend_input_file-" + "1" * 32, endpoint="/v1/chat/completions",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)
    with pytest.raises(openai.BadRequestError):
        client.batches.retrieve("batch_not-hex")
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
        client.batches.retrieve("../../x")


def test_bad_lines_go_to_the_error_file(client):
    lines = [
        chat_line(0),
        chat_line(1, url="/completions"),  # wrong endpoint for this batch
        chat_line(2, url="/v1/embeddings"),  # endpoint not served by batches
        {"method": "POST", "url": "/chat/completions", "body": {}},  # no custom_id
        {"custom_id": "req-4", "method": "POST", "url": "/chat/completions", "body": {"messages": "hi"}},
        chat_line(0),  # duplicate custom_id
        {**chat_line(6), "body": {**chat_line(6)["body"], "stream": True}},
        chat_line(7),
    ]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_done(client, b.id)
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (8, 2, 6)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).read().splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["req-0", "req-7"]
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and isinstance(body["choices"], list)
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
    errs = [json.loads(x) for x in client.files.content(b.error_file_id).read().splitlines()]
    codes = sorted(e["error"]["code"] for e in errs)
    assert codes == sorted(["invalid_url", "unsupported_url", "missing_custom_id", "invalid_body",
                            "duplicate_custom_id", "invalid_body"])
    assert all(e["response"] is None for e in errs)
    assert sorted(e["error"]["line"] for e in errs) == [2, 3, 4, 5, 6, 7]
    assert b.completed_at and b.in_progress_at and b.finalizing_at and b.created_at


def test_completions_batch_and_list(client):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": SMOLLM2, "prompt": f"{i} + {i} =", "max_tokens": 3, "temperature": 0}}
             for i in range(3)]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"k": "v"})
    assert b.status == "validating" and b.metadata == {"k": "v"}
    b = wait_done(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 3 and b.error_file_id is None
    out = [json.loads(x) for x in client.files.content(b.output_file_id).read().splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["c0", "c1", "c2"]
    assert all(x["response"]["body"]["object"] == "text_completion" for x in out)
    page = client.batches.list(limit=1)
    assert page.data[0].id == b.id and page.has_more
    older = client.batches.list(limit=100, after=b.id)
    assert b.id not in [x.id for x in older.data] and older.data
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)  # completed is terminal


def test_delete_while_running_is_refused(client):
    lines = [chat_line(i, max_tokens=24) for i in range(12)]
    f = upload(client, jsonl(lines))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError, match="in use by batch"):
        client.files.delete(f.id)
    assert client.files.content(f.id).read() == jsonl(lines)
    b = wait_done(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 12
    assert client.files.delete(f.id).deleted
    assert len(client.files.content(b.output_file_id).read().splitlines()) == 12


def test_generate_priority_is_validated(base_url):
    """Batch lines ride on the request priority; on /generate it must be an integer."""
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    r = requests.post(f"{base_url}/generate", json={**body, "priority": "high"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]
    assert requests.post(f"{base_url}/generate", json={**body, "priority": 5}).status_code == 200
    assert requests.post(f"{base_url}/generate", json={**body, "priority": -3}).status_code == 200

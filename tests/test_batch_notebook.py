"""The batch cells of the OpenAI completions notebook (000), unchanged except for the model name, with the
official `openai` client against a real server: a 2-request batch, 20-request status polling, and a
5,000-request batch that is cancelled."""

from __future__ import annotations

import json
import os
import time

import pytest
import requests

from sglang.utils import print_highlight
from tests.server_fixtures import running_server

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    storage = tmp_path_factory.mktemp("storage")
    with running_server("--log-level", "warning", "--file-storage-path", str(storage)) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the cells write batch_requests.jsonl into the working directory


def queue_is_empty(port: int) -> bool:
    state = requests.get(f"http://127.0.0.1:{port}/get_server_info").json()["internal_states"][0]
    return state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0


def test_cells_7_and_8_two_request_batch(port, capsys):
    # ---- In [7] ----
    import json
    import time

    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="None")

    requests = [
        {
            "custom_id": "request-1",
            "method": "POST",
            "url": "/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "Tell me a joke about programming"}
                ],
                "max_tokens": 50,
            },
        },
        {
            "custom_id": "request-2",
            "method": "POST",
            "url": "/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": "What is Python?"}],
                "max_tokens": 50,
            },
        },
    ]

    input_file_path = "batch_requests.jsonl"

    with open(input_file_path, "w") as f:
        for req in requests:
            f.write(json.dumps(req) + "\n")

    with open(input_file_path, "rb") as f:
        file_response = client.files.create(file=f, purpose="batch")

    batch_response = client.batches.create(
        input_file_id=file_response.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )

    print_highlight(f"Batch job created with ID: {batch_response.id}")

    # ---- In [8] ----
    while batch_response.status not in ["completed", "failed", "cancelled"]:
        time.sleep(3)
        print(f"Batch job status: {batch_response.status}...trying again in 3 seconds...")
        batch_response = client.batches.retrieve(batch_response.id)

    if batch_response.status == "completed":
        print("Batch job completed successfully!")
        print(f"Request counts: {batch_response.request_counts}")

        result_file_id = batch_response.output_file_id
        file_response = client.files.content(result_file_id)
        result_content = file_response.read().decode("utf-8")

        results = [
            json.loads(line) for line in result_content.split("\n") if line.strip() != ""
        ]

        for result in results:
            print_highlight(f"Request {result['custom_id']}:")
            print_highlight(f"Response: {result['response']}")

        print_highlight("Cleaning up files...")
        # Only delete the result file ID since file_response is just content
        client.files.delete(result_file_id)
    else:
        print_highlight(f"Batch job failed with status: {batch_response.status}")
        if hasattr(batch_response, "errors"):
            print_highlight(f"Errors: {batch_response.errors}")

    # ---- checks ----
    out = capsys.readouterr().out
    assert "Batch job completed successfully!" in out
    assert "Request counts: BatchRequestCounts(completed=2, failed=0, total=2)" in out
    assert sorted(r["custom_id"] for r in results) == ["request-1", "request-2"]
    for r in results:
        body = r["response"]["body"]
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert isinstance(body["choices"], list) and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 50
    assert client.batches.retrieve(batch_response.id).status == "completed"


def test_cell_9_status_polling(port, capsys):
    # ---- In [9] ----
    import json
    import time

    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="None")

    requests = []
    for i in range(20):
        requests.append(
            {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "system",
                            "content": f"{i}: You are a helpful AI assistant",
                        },
                        {
                            "role": "user",
                            "content": "Write a detailed story about topic. Make it very long.",
                        },
                    ],
                    "max_tokens": 64,
                },
            }
        )

    input_file_path = "batch_requests.jsonl"
    with open(input_file_path, "w") as f:
        for req in requests:
            f.write(json.dumps(req) + "\n")

    with open(input_file_path, "rb") as f:
        uploaded_file = client.files.create(file=f, purpose="batch")

    batch_job = client.batches.create(
        input_file_id=uploaded_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )

    print_highlight(f"Created batch job with ID: {batch_job.id}")
    print_highlight(f"Initial status: {batch_job.status}")

    time.sleep(10)

    max_checks = 5
    for i in range(max_checks):
        batch_details = client.batches.retrieve(batch_id=batch_job.id)

        print_highlight(
            f"Batch job details (check {i+1} / {max_checks}) // ID: {batch_details.id} // Status: {batch_details.status} // Created at: {batch_details.created_at} // Input file ID: {batch_details.input_file_id} // Output file ID: {batch_details.output_file_id}"
        )
        print_highlight(
            f"<strong>Request counts: Total: {batch_details.request_counts.total} // Completed: {batch_details.request_counts.completed} // Failed: {batch_details.request_counts.failed}</strong>"
        )

        time.sleep(3)

    # ---- checks ----
    out = capsys.readouterr().out
    assert "Initial status: validating" in out
    assert out.count("Request counts: Total: 20") == 5
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch_job.id).status != "completed" and time.monotonic() < deadline:
        time.sleep(1)
    done = client.batches.retrieve(batch_job.id)
    assert done.status == "completed" and done.request_counts.completed == 20
    # JSONL lines end at b"\n" (bytes.splitlines): str.splitlines would also split a sampled answer holding U+2028 or
    # U+0085, which JSON keeps as they are inside strings
    lines = client.files.content(done.output_file_id).read().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == sorted(f"request-{i}" for i in range(20))


def test_cell_10_cancel_5000_request_batch(port, capsys):
    # ---- In [10] ----
    import json
    import os
    import time

    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="None")

    requests = []
    for i in range(5000):
        requests.append(
            {
                "custom_id": f"request-{i}",
                "method": "POST",
                "url": "/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "system",
                            "content": f"{i}: You are a helpful AI assistant",
                        },
                        {
                            "role": "user",
                            "content": "Write a detailed story about topic. Make it very long.",
                        },
                    ],
                    "max_tokens": 128,
                },
            }
        )

    input_file_path = "batch_requests.jsonl"
    with open(input_file_path, "w") as f:
        for req in requests:
            f.write(json.dumps(req) + "\n")

    with open(input_file_path, "rb") as f:
        uploaded_file = client.files.create(file=f, purpose="batch")

    batch_job = client.batches.create(
        input_file_id=uploaded_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )

    print_highlight(f"Created batch job with ID: {batch_job.id}")
    print_highlight(f"Initial status: {batch_job.status}")

    time.sleep(10)

    try:
        cancelled_job = client.batches.cancel(batch_id=batch_job.id)
        print_highlight(f"Cancellation initiated. Status: {cancelled_job.status}")
        assert cancelled_job.status == "cancelling"

        # Monitor the cancellation process
        while cancelled_job.status not in ["failed", "cancelled"]:
            time.sleep(3)
            cancelled_job = client.batches.retrieve(batch_job.id)
            print_highlight(f"Current status: {cancelled_job.status}")

        # Verify final status
        assert cancelled_job.status == "cancelled"
        print_highlight("Batch job successfully cancelled")

    except Exception as e:
        print_highlight(f"Error during cancellation: {e}")
        raise e

    finally:
        try:
            del_response = client.files.delete(uploaded_file.id)
            if del_response.deleted:
                print_highlight("Successfully cleaned up input file")
            if os.path.exists(input_file_path):
                os.remove(input_file_path)
                print_highlight("Successfully deleted local batch_requests.jsonl file")
        except Exception as e:
            print_highlight(f"Error cleaning up: {e}")
            raise e

    # ---- checks ----
    out = capsys.readouterr().out
    assert "Successfully cleaned up input file" in out
    final = client.batches.retrieve(batch_job.id)
    counts = final.request_counts
    assert final.status == "cancelled" and final.cancelling_at and final.cancelled_at
    assert counts.total == 5000 and 0 <= counts.completed < 5000 and counts.failed == 0
    lines = client.files.content(final.output_file_id).read().splitlines()  # JSONL: b"\n" ends a line
    assert len(lines) == counts.completed
    # The aborted requests left the scheduler promptly: nothing runs or waits a moment later.
    deadline = time.monotonic() + 5
    while not queue_is_empty(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert queue_is_empty(port)
    time.sleep(1)
    again = client.batches.retrieve(batch_job.id)
    assert again.status == "cancelled" and again.request_counts.completed == counts.completed

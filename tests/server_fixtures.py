"""Start a real server on a free port for a test module; always stop it (whole process tree). Stream a request to
it from a thread while the test does something else."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator

import requests

from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST, find_free_port, popen_launch_server
from sglang.utils import terminate_process


@contextlib.contextmanager
def running_server(*other_args: str, model: str = DEFAULT_SMALL_MODEL_NAME_FOR_TEST) -> Iterator[str]:
    port = find_free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="sglang-server-", suffix=".log", delete=False)
    log.close()
    proc = popen_launch_server(model, base_url, other_args=list(other_args), log_path=log.name)
    try:
        yield base_url
    finally:
        terminate_process(proc)
        if os.environ.get("SGLANG_TEST_SHOW_SERVER_LOG"):
            print(open(log.name).read())
        os.unlink(log.name)


def stream_generate_in_thread(base_url: str, body: dict, result: dict, timeout: float = 120) -> threading.Thread:
    """POST `body` to /generate with streaming on, in a thread; return it once the first chunk has come (within
    `timeout`). `result["last"]` holds the last chunk, `result["done_at"]` the time.monotonic() the stream ended."""
    started = threading.Event()

    def run() -> None:
        with requests.post(f"{base_url}/generate", json={**body, "stream": True}, stream=True, timeout=timeout) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    result["last"] = json.loads(line[6:])
                    started.set()
        result["done_at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(timeout)
    return thread

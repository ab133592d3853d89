"""Malformed bodies, request limits, overload and timeouts, and how the server stops (SIGTERM, a dead child)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from unittest import mock

import psutil
import pytest
import requests

from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST, find_free_port, popen_launch_server
from sglang.utils import terminate_process
from tests.server_fixtures import running_server

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_url():
    # Requests whose id starts with "fault-" fail inside the scheduler (sglang/srt/managers/scheduler/results.py).
    limits = ["--max-running-requests", "2", "--max-queued-requests", "1", "--request-timeout", "6",
              "--max-request-body-bytes", "65536", "--max-total-tokens", "8192"]
    with mock.patch.dict(os.environ, {"SGLANG_TEST_FAULT_RID_PREFIX": "fault-"}), running_server(*limits) as url:
        yield url


def _wait_idle(base_url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if requests.get(f"{base_url}/get_load").json()["load"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the server did not become idle")


@pytest.mark.parametrize("body, field", [
    ({"text": 9223372036854775808, "sampling_params": {"max_new_tokens": 4}}, "text"),
    ({"text": True, "sampling_params": {"max_new_tokens": "\u0000"}}, "text"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "\u0000"}}, "max_new_tokens"),
    ({"input_ids": [99999999999999999999]}, "input_ids"),
    ({"input_ids": [[1, 2], [3, "x"]]}, "input_ids"),
    ({"text": "hi", "rid": {"a": 1}}, "rid"),
    ({"text": "hi", "logprob_start_len": "a", "return_logprob": True}, "logprob_start_len"),
    ({"text": "hi", "stream": "yes"}, "stream"),
    ({"text": "hi", "sampling_params": 5}, "sampling_params"),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ({"text": "hi", "sampling_params": {"n": 1000}}, "n"),
    ({"text": "hi", "sampling_params": {"stop": ["s"] * 100}}, "stop"),
    ({"text": "hi", "custom_logit_processor": "x"}, "custom-logit-processor"),
])
def test_malformed_or_oversized_generate_body_is_400_naming_the_field(base_url, body, field):
    r = requests.post(f"{base_url}/generate", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 2], "skip_special_tokens": 3}, "skip_special_tokens"),
    ("/detokenize", {"tokens": [10**12]}, "tokens"),
    ("/abort_request", {"rid": 5}, "rid"),
    ("/separate_reasoning", {"text": "x", "reasoning_parser": 7}, "reasoning_parser"),
])
def test_other_native_bodies_are_checked(base_url, path, body, field):
    r = requests.post(f"{base_url}{path}", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_body_over_the_size_limit_is_413_in_each_api_shape(base_url):
    big = {"text": "a" * 70000}
    native = requests.post(f"{base_url}/generate", json=big)
    assert native.status_code == 413 and "--max-request-body-bytes" in native.json()["error"]["message"]
    openai = requests.post(f"{base_url}/v1/completions", json={"model": "m", "prompt": "a" * 70000})
    assert openai.status_code == 413 and openai.json()["code"] == 413

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(20):
            yield b" " * 4096

    chunked = requests.post(f"{base_url}/generate", data=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413


def test_full_queue_gets_503_with_retry_after_and_timeouts_get_504(base_url):
    results: list[int] = []

    def long_request() -> None:
        results.append(requests.post(f"{base_url}/generate", json={"text": "Tell me a story",
                                                                   "sampling_params": LONG}).status_code)

    threads = [threading.Thread(target=long_request) for _ in range(3)]  # 2 running + 1 waiting
    for t in threads:
        t.start()
    time.sleep(1.0)
    refused = requests.post(f"{base_url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 503, refused.text
    assert refused.headers["Retry-After"] == "1"
    assert "--max-queued-requests" in refused.json()["error"]["message"]
    for t in threads:
        t.join()
    # 1500 tokens take longer than --request-timeout 6 here: each was aborted and answered 504.
    assert results == [504, 504, 504]
    _wait_idle(base_url)
    ok = requests.post(f"{base_url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_streaming_timeout_ends_with_an_error_event(base_url):
    with requests.post(f"{base_url}/v1/completions", stream=True, json={
            "model": "m", "prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    assert b'"code":504' in lines[-2] and b"--request-timeout" in lines[-2]
    _wait_idle(base_url)


def test_a_request_failing_in_the_scheduler_gets_a_500_and_the_others_carry_on(base_url):
    innocent: list[requests.Response] = []
    t = threading.Thread(target=lambda: innocent.append(requests.post(f"{base_url}/generate", json={
        "text": "Count slowly", "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}})))
    t.start()
    time.sleep(0.3)  # the two share decode batches
    failed = requests.post(f"{base_url}/generate", json={
        "text": "Count slowly", "rid": "fault-1", "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}})
    assert failed.status_code == 500
    assert "Internal server error while running the request" in failed.json()["error"]["message"]
    t.join()
    assert innocent[0].status_code == 200 and innocent[0].json()["meta_info"]["completion_tokens"] == 48
    stream = requests.post(f"{base_url}/v1/completions", json={
        "model": "m", "prompt": "x", "max_tokens": 4, "stream": True, "rid": "fault-2"})
    # It fails before its first event, so the stream is answered as a plain OpenAI error.
    assert stream.status_code == 500 and stream.json()["type"] == "InternalServerError"
    _wait_idle(base_url)
    ok = requests.post(f"{base_url}/generate", json={"text": "Count slowly", "sampling_params": {
        "max_new_tokens": 48, "ignore_eos": True, "temperature": 0}})
    assert ok.json()["text"] == innocent[0].json()["text"]


def _ipc_dir(log_path: str) -> str:
    with open(log_path) as f:
        match = re.search(r"Worker sockets in (\S+)", f.read())
    assert match, "the server logs where its sockets are"
    return match.group(1)


@contextlib.contextmanager
def _own_server(tmp_path, *args: str) -> Iterator[tuple[str, subprocess.Popen, str, str]]:
    """(url, process, log path, socket folder) of a server this test stops itself; killed in any case."""
    url = f"http://127.0.0.1:{find_free_port()}"
    log = str(tmp_path / "server.log")
    proc = popen_launch_server(DEFAULT_SMALL_MODEL_NAME_FOR_TEST, url, log_path=log, other_args=list(args))
    try:
        yield url, proc, log, _ipc_dir(log)
    finally:
        terminate_process(proc)


def _assert_stopped_cleanly(children: list[psutil.Process], ipc_dir: str) -> None:
    assert not os.path.exists(ipc_dir)
    time.sleep(1)  # children notice their parent is gone within a second
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_finishes_in_flight_requests_and_removes_its_sockets(tmp_path):
    with _own_server(tmp_path, "--max-total-tokens", "2048") as (url, proc, _, ipc_dir):
        assert os.path.isdir(ipc_dir)
        children = psutil.Process(proc.pid).children(recursive=True)
        answer: list[requests.Response] = []
        t = threading.Thread(target=lambda: answer.append(requests.post(f"{url}/generate", json={
            "text": "Count to one hundred", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}})))
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        t.join(timeout=30)
        assert answer and answer[0].status_code == 200
        assert answer[0].json()["meta_info"]["completion_tokens"] == 64
        _assert_stopped_cleanly(children, ipc_dir)


def test_killed_scheduler_makes_the_server_exit_nonzero_within_seconds(tmp_path):
    with _own_server(tmp_path, "--max-total-tokens", "2048") as (url, proc, log, ipc_dir):
        children = psutil.Process(proc.pid).children(recursive=True)
        scheduler = max(children, key=lambda c: c.memory_info().rss)  # the process that holds the model
        answer: list[requests.Response] = []
        t = threading.Thread(target=lambda: answer.append(requests.post(f"{url}/generate", json={
            "text": "Go", "sampling_params": LONG}, timeout=30)))
        t.start()
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(scheduler.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
        assert time.monotonic() - start < 10
        t.join(timeout=30)
        # The request in flight is answered, not left hanging.
        assert answer and answer[0].status_code == 503
        assert "scheduler process died" in answer[0].json()["error"]["message"]
        assert "Child process sglang-scheduler died" in open(log).read()
        _assert_stopped_cleanly(children, ipc_dir)


def test_watchdog_ends_a_forward_pass_that_runs_too_long(tmp_path):
    # A warm-up forward takes milliseconds; a 4,000-token prefill chunk takes seconds on a CPU.
    with _own_server(tmp_path, "--max-total-tokens", "8192", "--watchdog-timeout", "0.5") as (url, proc, log,
                                                                                               ipc_dir):
        children = psutil.Process(proc.pid).children(recursive=True)
        start = time.monotonic()
        r = requests.post(f"{url}/generate", timeout=60, json={
            "text": "word " * 4000, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 503 and "scheduler process died" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) != 0
        assert time.monotonic() - start < 15
        assert "Scheduler watchdog: the extend forward pass has run for more than 0.5 s" in open(log).read()
        _assert_stopped_cleanly(children, ipc_dir)

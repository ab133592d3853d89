"""The helpers SGLang's own server tests import: every name they use imports, and the server helpers work against
real servers (popen_launch_server with api_key / return_stdout_stderr, run_logprob_check,
run_and_check_memory_leak, kill_process_tree)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import psutil
import pytest
import requests


def test_every_name_sglang_tests_import_is_there():
    import sglang as sgl
    from sglang.lang.chat_template import get_chat_template_by_model_path
    from sglang.srt.hf_transformers_utils import get_tokenizer
    from sglang.srt.model_loader.resolve import resolve_model_path
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
    from sglang.srt.utils import kill_process_tree
    from sglang.test.runners import TEST_RERANK_QUERY_DOCS
    from sglang.test.test_utils import (
        DEFAULT_IMAGE_URL,
        DEFAULT_MODEL_NAME_FOR_TEST,
        DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST,
        DEFAULT_SMALL_EMBEDDING_MODEL_NAME_FOR_TEST,
        DEFAULT_SMALL_MODEL_NAME_FOR_TEST,
        DEFAULT_SMALL_VLM_MODEL_NAME_FOR_TEST,
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
        DEFAULT_URL_FOR_TEST,
        CustomTestCase,
        is_in_ci,
        popen_launch_server,
        run_and_check_memory_leak,
        run_logprob_check,
    )

    assert all(callable(f) for f in (sgl.function, sgl.gen, sgl.set_default_backend, sgl.RuntimeEndpoint,
                                     kill_process_tree, popen_launch_server, run_logprob_check,
                                     run_and_check_memory_leak, is_in_ci))
    assert issubclass(CustomTestCase, unittest.TestCase) and isinstance(CustomLogitProcessor, type)
    assert DEFAULT_URL_FOR_TEST.startswith("http://127.0.0.1:") and DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH > 0
    assert DEFAULT_IMAGE_URL.startswith("https://")
    # The chat and embedding defaults are installed: they resolve without a network.
    for model in (DEFAULT_MODEL_NAME_FOR_TEST, DEFAULT_SMALL_MODEL_NAME_FOR_TEST,
                  DEFAULT_SMALL_EMBEDDING_MODEL_NAME_FOR_TEST):
        assert os.path.exists(resolve_model_path(model))
    assert "/" in DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST and "VL" in DEFAULT_SMALL_VLM_MODEL_NAME_FOR_TEST
    tokenizer = get_tokenizer(DEFAULT_SMALL_MODEL_NAME_FOR_TEST)
    assert tokenizer.decode(tokenizer.encode("Hello world", add_special_tokens=False)) == "Hello world"
    assert get_chat_template_by_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST) is not None
    assert all(isinstance(d["query"], str) and d["documents"] for d in TEST_RERANK_QUERY_DOCS)


def test_custom_test_case_retries_as_configured(monkeypatch):
    from sglang.test.test_utils import CustomTestCase

    calls: list[int] = []

    class Flaky(CustomTestCase):
        def test_once_failing(self):
            calls.append(1)
            self.assertGreater(len(calls), 1)

    for retries, ok in (("0", False), ("1", True)):
        calls.clear()
        monkeypatch.setenv("SGLANG_TEST_MAX_RETRY", retries)
        result = unittest.TestResult()
        Flaky("test_once_failing").run(result)
        assert result.wasSuccessful() is ok and len(calls) == int(retries) + 1


def test_kill_process_tree_ends_a_tree_this_test_started():
    from sglang.srt.utils import kill_process_tree

    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']) for _ in range(2)]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        kids = [int(p) for p in parent.stdout.readline().split()]
        assert len(kids) == 2 and all(psutil.pid_exists(k) for k in kids)
        kill_process_tree(parent.pid, include_parent=False)
        assert not any(_alive(k) for k in kids) and parent.poll() is None  # the parent was spared
        kill_process_tree(parent.pid)
        assert parent.wait(timeout=10) is not None
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- popen_launch_server with an API key, output captured ----------------------------------------------------
API_KEY = "sk-compat-123"


@pytest.fixture(scope="module")
def keyed_server():
    from sglang.srt.utils import kill_process_tree
    from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST, find_free_port, popen_launch_server

    url = f"http://127.0.0.1:{find_free_port()}"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Non-string arguments are turned into strings, as SGLang's helper does.
        proc = popen_launch_server(DEFAULT_SMALL_MODEL_NAME_FOR_TEST, url, api_key=API_KEY,
                                   other_args=["--max-total-tokens", 4096, "--log-level", "info"],
                                   return_stdout_stderr=(out, err))
        try:
            yield url, proc, out, err
        finally:
            kill_process_tree(proc.pid)
            assert proc.wait(timeout=30) is not None


def test_the_api_key_is_passed_and_the_output_captured(keyed_server):
    url, proc, out, err = keyed_server
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(f"{url}/generate", json=body, timeout=60).status_code == 401
    ok = requests.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    err.seek(0)
    out.seek(0)
    logs = err.read() + out.read()
    assert "server_args=ServerArgs(" in logs and '"POST /generate HTTP/1.1" 401' in logs
    assert proc.poll() is None


# ---- run_logprob_check and run_and_check_memory_leak on one server -------------------------------------------
def test_logprob_checks_and_no_leak_after_an_aborted_request():
    from sglang.test.test_utils import CustomTestCase, run_and_check_memory_leak, run_logprob_check

    class Case(CustomTestCase):
        def runTest(self):  # noqa: N802 - unittest's name
            pass

    def workload(base_url: str, model: str) -> None:
        case = Case()
        case.base_url = base_url
        # (input_len, output_len, temperature, logprob_start_len, return_logprob, top_logprobs_num)
        for arg in [(12, 4, 0, 0, True, 3), (12, 4, 0, 5, True, 0), (10, 3, 1.0, 2, True, 2), (6, 3, 0, 0, False, 0)]:
            run_logprob_check(case, arg)
        with pytest.raises(AssertionError, match="logprob_start_len"):  # a refused request fails the check
            run_logprob_check(case, (12, 4, 0, 13, True, 0))

        long = threading.Thread(target=requests.post, args=(f"{base_url}/generate",), kwargs={"json": {
            "text": "Tell me a long story", "rid": "to-abort",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}, "timeout": 120})
        long.start()
        time.sleep(1.0)
        requests.post(f"{base_url}/abort_request", json={"rid": "to-abort"}, timeout=30).raise_for_status()
        long.join(timeout=60)

    run_and_check_memory_leak(workload, disable_radix_cache=False, enable_mixed_chunk=False, disable_overlap=False,
                              chunked_prefill_size=64, assert_has_abort=True)

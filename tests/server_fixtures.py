"""Start a real server on a free port for a test module; always stop it (whole process tree)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

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

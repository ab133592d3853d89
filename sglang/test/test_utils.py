"""Test helpers that SGLang's notebooks import."""

import os


def is_in_ci() -> bool:
    return os.environ.get("SGLANG_IS_IN_CI", "false").lower() in ("true", "1")


DEFAULT_SMALL_MODEL_NAME_FOR_TEST = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600


def find_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen_launch_server(model: str, base_url: str, timeout: float = DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
                        other_args: list[str] | tuple = (), env: dict | None = None, log_path: str | None = None):
    """Start `python -m sglang.launch_server` and wait until /health answers 200 (after the warm-up).

    Returns the Popen; stop it with sglang.utils.terminate_process (kills the whole process tree)."""
    import subprocess
    import sys
    from urllib.parse import urlsplit


    parts = urlsplit(base_url)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", parts.hostname,
           "--port", str(parts.port), *other_args]
    out = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                            env={**os.environ, **(env or {})})
    from sglang.utils import terminate_process, wait_until_healthy

    def exit_reason() -> str | None:
        if proc.poll() is None:
            return None
        return f"Server exited with code {proc.returncode} during startup: {' '.join(cmd)}"

    try:
        wait_until_healthy(base_url, timeout, exit_reason)
    except BaseException:
        terminate_process(proc)
        raise
    return proc

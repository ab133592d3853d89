"""sglang.utils / sglang.test helpers as the notebooks use them: launch, wait (also with an empty host), stop."""

import base64
import io
import subprocess
import sys

import pytest
import requests
from PIL import Image

from sglang.srt.utils import load_image
from sglang.test.test_utils import is_in_ci
from sglang.utils import (
    execute_shell_command,
    http_request,
    launch_server_cmd,
    normalize_base_url,
    print_highlight,
    terminate_process,
    wait_for_server,
)
from tests.conftest import SMOLLM2


def test_launch_wait_request_terminate(capsys):
    server_process, port = launch_server_cmd(
        f"python3 -m sglang.launch_server --model-path {SMOLLM2} --host 0.0.0.0 --log-level warning "
        "--max-total-tokens 4096"
    )
    try:
        assert 30000 <= port < 40000
        wait_for_server(f"https://:{port}", timeout=300)  # notebook 004's spelling of the URL
        assert "NOTE: Typically, the server runs in a separate terminal." in capsys.readouterr().out
        assert requests.get(f"http://localhost:{port}/health", timeout=5).status_code == 200  # warmed up
        out = http_request(f"http://localhost:{port}/generate",
                           json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
        assert out.status_code == 200 and "meta_info" in out.json()
        assert http_request(f"http://localhost:{port}/get_model_info").json()["model_path"] == SMOLLM2
        streamed = http_request(f"http://localhost:{port}/generate", stream=True,
                                json={"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 2}})
        assert b"[DONE]" in streamed.content
    finally:
        terminate_process(server_process)
    assert server_process.poll() is not None
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://localhost:{port}/health", timeout=5)


def test_wait_for_server_times_out():
    with pytest.raises(TimeoutError, match="Server did not become ready within timeout period"):
        wait_for_server("http://127.0.0.1:9", timeout=2)


def test_normalize_base_url():
    assert normalize_base_url("https://:30000") == "http://localhost:30000"
    assert normalize_base_url("https://:30000/generate") == "http://localhost:30000/generate"
    assert normalize_base_url("http://example:1/x") == "http://example:1/x"


def test_execute_shell_command_and_print_highlight(capsys, monkeypatch):
    proc = execute_shell_command("python3 -c \\\nprint(6*7)")
    assert proc.wait(timeout=60) == 0
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    assert not is_in_ci()
    print_highlight({"a": 1})
    assert "{'a': 1}" in capsys.readouterr().out
    monkeypatch.setenv("SGLANG_IS_IN_CI", "true")
    assert is_in_ci()


def test_load_image_forms(tmp_path):
    img = Image.new("RGB", (4, 3), "red")
    assert load_image(img) == (img, (4, 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    raw = buf.getvalue()
    path = tmp_path / "x.png"
    path.write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    for source in (raw, str(path), b64, "data:image/png;base64," + b64):
        loaded, size = load_image(source)
        assert loaded.size == (4, 3) and size is None
    with pytest.raises(ValueError):
        load_image("not an image at all")


def test_doc_patch_applies_defaults():
    code = ("import sglang.test.doc_patch; from sglang.srt.server_args import ServerArgs; "
            "a = ServerArgs(model_path='m'); print(a.max_running_requests, a.max_total_tokens, a.cuda_graph_max_bs)")
    out = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["128", "20480", "4"]

"""Helpers used by SGLang's documentation notebooks: launching, waiting for and stopping a server."""

from __future__ import annotations

import json as jsonlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

import requests

from sglang.test.test_utils import is_in_ci

# A socket kept bound (not listening) on each launched server's port, so no other launch picks it.
_port_locks: weakref.WeakKeyDictionary[subprocess.Popen, socket.socket] = weakref.WeakKeyDictionary()



# Printed once the server answers, as SGLang's own helper does.
SERVER_NOTE = (
    "\n\n"
    "                    NOTE: Typically, the server runs in a separate terminal.\n"
    "                    In this notebook, we run the server and notebook code together, so their outputs are "
    "combined.\n"
    "                    To improve clarity, the server logs are displayed in the original black color, while the "
    "notebook outputs are highlighted in blue.\n"
    "                    To reduce the log length, we set the log level to warning for the server, the default log "
    "level is info.\n"
    "                    We are running those notebooks in a CI environment, so the throughput is not representative "
    "of the actual performance.\n"
    "                    "
)


def normalize_base_url(url: str) -> str:
    """Accept URLs with an empty host ("https://:30000") as http://localhost:PORT."""
    parts = urlsplit(url)
    if parts.hostname in (None, ""):
        port = parts.port
        netloc = f"localhost:{port}" if port else "localhost"
        return urlunsplit(("http", netloc, parts.path, parts.query, parts.fragment))
    return url


def print_highlight(html_content: Any) -> None:
    if is_in_ci():
        from IPython.display import HTML, display

        text = str(html_content).replace("\n", "<br>")
        display(HTML(f"<strong style='color: #00008B;'>{text}</strong>"))
    else:
        print(html_content)


def execute_shell_command(command: str) -> subprocess.Popen:
    """Run a command line without a shell (backslash continuations allowed)."""
    command = command.replace("\\\n", " ").replace("\\", " ")
    parts = command.split()
    if parts and parts[0] in ("python", "python3"):
        parts[0] = sys.executable
    return subprocess.Popen(parts, text=True, stderr=subprocess.STDOUT)


def _reserve_port(host: str = "") -> tuple[int, socket.socket]:
    import random

    for _ in range(1000):
        port = random.randint(30000, 39999)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        return port, sock
    raise RuntimeError("No free port in [30000, 40000)")


def launch_server_cmd(command: str, host: str = "0.0.0.0", port: Optional[int] = None):
    """Start `command --port N` in a subprocess; returns (process, port)."""
    lock = None
    if port is None:
        port, lock = _reserve_port()
    full = f"{command} --port {port}"
    if "--host" not in command:
        full += f" --host {host}"
    process = execute_shell_command(full)
    if lock is not None:
        _port_locks[process] = lock
    return process, port


def terminate_process(process: subprocess.Popen, port: Optional[int] = None, grace_s: float = 10.0) -> None:
    """Stop the process and all its descendants; release its reserved port.

    SIGTERM first, so a server stops its worker processes and removes its socket folder itself; whatever of the
    tree is still alive after `grace_s` seconds is killed."""
    stop_process_tree(process.pid, grace_s)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    lock = _port_locks.pop(process, None)
    if lock is not None:
        lock.close()


def stop_process_tree(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM to `pid`, then wait up to `grace_s` seconds for it and all its descendants to end; kill the rest."""
    import psutil

    try:
        parent = psutil.Process(pid)
        tree = [parent, *parent.children(recursive=True)]
        parent.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        tree = []
    kill_survivors(tree, grace_s)


def kill_survivors(procs: list, grace_s: float) -> None:
    """Wait up to `grace_s` seconds for the psutil processes `procs` to end, then kill the rest and reap them."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def kill_process_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        try:
            child.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    try:
        parent.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def wait_for_server(base_url: str, timeout: Optional[float] = None) -> None:
    """Poll GET {base_url}/v1/models until it answers 200, then GET /health until the warm-up request is done."""
    base_url = normalize_base_url(base_url)
    start = time.perf_counter()
    route = "/v1/models"
    while True:
        try:
            response = requests.get(f"{base_url}{route}", headers={"Authorization": "Bearer None"}, timeout=5)
            if response.status_code == 200 and route == "/health":
                print_highlight(SERVER_NOTE)
                return
            if response.status_code == 200:
                route = "/health"
                continue
        except requests.exceptions.RequestException:
            pass
        if timeout is not None and time.perf_counter() - start > timeout:
            raise TimeoutError("Server did not become ready within timeout period")
        time.sleep(0.2)


class HttpResponse:
    def __init__(self, resp) -> None:
        self.resp = resp

    def json(self) -> Any:
        return jsonlib.loads(self.resp.read())

    @property
    def status_code(self) -> int:
        return self.resp.status


def wait_until_healthy(base_url: str, timeout: float, exit_reason: Optional[Callable[[], Optional[str]]] = None
                       ) -> None:
    """Poll GET {base_url}/health until it answers 200 (after the server's warm-up).

    `exit_reason` says why the server process is gone (None while it runs): polling stops with a RuntimeError
    carrying it. A TimeoutError is raised after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reason = exit_reason() if exit_reason is not None else None
        if reason is not None:
            raise RuntimeError(reason)
        try:
            if requests.get(base_url + "/health", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"The server at {base_url} did not become ready within {timeout:g} s")


def http_request(url: str, json: Any = None, stream: bool = False, api_key: Optional[str] = None,
                 verify: Any = None, method: Optional[str] = None):
    """POST (with json) or GET (without) used by the frontend's RuntimeEndpoint."""
    url = normalize_base_url(url)
    headers = {"Content-Type": "application/json; charset=utf-8"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if stream:
        return requests.post(url, json=json, stream=True, headers=headers, verify=verify)
    data = None if json is None else jsonlib.dumps(json).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers=headers, method=method or ("POST" if data else "GET"))
    try:
        return HttpResponse(urllib.request.urlopen(req))
    except urllib.error.HTTPError as e:
        return HttpResponse(e)


def convert_json_schema_to_str(json_schema: Any) -> str:
    if isinstance(json_schema, dict):
        return jsonlib.dumps(json_schema)
    if isinstance(json_schema, str):
        return json_schema
    if hasattr(json_schema, "model_json_schema"):
        return jsonlib.dumps(json_schema.model_json_schema())
    raise ValueError(f"Unsupported json_schema type: {type(json_schema)}")

"""A batch survives `kill -9` of the whole server: after a restart on the same storage path it resumes and
completes with every line exactly once, and no line whose result was written runs again.

Executions are counted two ways: the attempts the server records before submitting a line, and the engine's
own "Finish: rid=..." request log (--log-requests) of both server runs."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter

import openai
import pytest

from sglang.test.test_utils import find_free_port
from sglang.utils import stop_process_tree, wait_until_healthy
from tests.conftest import SMOLLM2

LINES = 200


class Server:
    """A server in its own session, so `kill -9` can take its whole process group and nothing else."""

    def __init__(self, storage: str, log_path: str, env: dict[str, str]) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", SMOLLM2, "--host", "127.0.0.1",
               "--port", str(self.port), "--file-storage-path", storage, "--batch-max-inflight", "8",
               "--log-requests", "--max-total-tokens", "8192"]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        self.pgid = self.proc.pid  # leader of the new session's process group
        try:
            wait_until_healthy(self.url, 300, lambda: None if self.proc.poll() is None
                               else open(log_path).read()[-3000:])
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        """SIGTERM (the server removes its socket folders itself), then whatever is left of the group is killed."""
        if self.proc.poll() is None:  # not already killed and reaped (its pid could be reused)
            stop_process_tree(self.proc.pid, grace_s=30)
        self.kill()

    def finished_rids(self, batch_id: str) -> Counter:
        text = open(self.log_path).read()
        return Counter(int(m) for m in re.findall(rf"Finish: rid={batch_id}-req_(\d+),", text))


def db_lines(storage: str, batch_id: str) -> dict[int, tuple[int, str]]:
    db = sqlite3.connect(f"file:{os.path.join(storage, 'metadata.db')}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT line_index, attempts, outcome FROM batch_lines WHERE batch_id = ?", (batch_id,))
        return {i: (a, o) for i, a, o in rows.fetchall()}
    finally:
        db.close()


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


def test_kill_9_mid_batch_then_resume(tmp_path, servers, killed_process_env):
    storage = str(tmp_path / "storage")
    first = Server(storage, str(tmp_path / "run1.log"), killed_process_env)
    servers.append(first)
    client = openai.Client(base_url=f"{first.url}/v1", api_key="None", max_retries=0)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": SMOLLM2, "messages": [{"role": "user", "content": f"Count to {i}."}],
                       "max_tokens": 16, "temperature": 0}} for i in range(LINES)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    f = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 40:
        time.sleep(0.05)
    first.kill()

    at_kill = db_lines(storage, batch.id)
    finished_before = {i for i, (_a, outcome) in at_kill.items() if outcome is not None}
    assert 40 <= len(finished_before) < LINES, "the kill must land mid-batch"

    second = Server(storage, str(tmp_path / "run2.log"), killed_process_env)
    servers.append(second)
    client = openai.Client(base_url=f"{second.url}/v1", api_key="None", max_retries=0)
    assert client.files.retrieve(f.id).bytes == len(data)  # the input file survived
    deadline = time.monotonic() + 300
    while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.5)
    assert b.status == "completed", b.errors
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (LINES, LINES, 0)

    results = [json.loads(x) for x in client.files.content(b.output_file_id).read().splitlines()]
    ids = Counter(r["custom_id"] for r in results)
    assert len(results) == LINES and set(ids) == {f"line-{i}" for i in range(LINES)}
    assert max(ids.values()) == 1
    assert all(r["response"]["status_code"] == 200 for r in results)

    # Executions recorded by the server: a line finished before the kill was submitted exactly once.
    final = db_lines(storage, batch.id)
    assert set(final) == set(range(LINES)) and all(o == "output" for _a, o in final.values())
    assert all(final[i][0] == 1 for i in finished_before)
    assert all(1 <= a <= 2 for a, _o in final.values())
    # Executions seen by the engine: nothing that had finished before the kill ran in the second server.
    run1, run2 = first.finished_rids(batch.id), second.finished_rids(batch.id)
    assert not finished_before & set(run2)
    assert max(run2.values()) == 1 and set(run1) | set(run2) == set(range(LINES))
    assert set(run2) >= set(range(LINES)) - set(run1)  # whatever the first engine never finished ran later

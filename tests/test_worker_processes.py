"""Worker processes start from a fork server with the environment of the moment they are created (spawned when a
load-time variable differs), and a server process ends without orphaned helpers or temporary files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from sglang.srt.managers import worker_processes
from sglang.srt.managers.worker_processes import WorkerContext

pytestmark = pytest.mark.skipif(not WorkerContext().uses_fork_server, reason="the platform has no fork server")


def _report(conn, names: list[str]) -> None:
    conn.send(({n: os.environ.get(n) for n in names}, os.getppid()))
    conn.close()


def _start(ctx: WorkerContext, names: list[str]) -> tuple[dict, int]:
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_report, args=(writer, names), daemon=True)
    proc.start()
    writer.close()
    try:
        assert reader.poll(120), "the worker did not report"
        return reader.recv()
    finally:
        proc.join(30)


def test_worker_sees_the_environment_of_its_creation_and_load_time_changes_are_spawned(monkeypatch):
    ctx = WorkerContext()
    monkeypatch.setenv("SGLANG_TEST_WORKER_VAR", "first")
    env, parent = _start(ctx, ["SGLANG_TEST_WORKER_VAR"])
    assert env == {"SGLANG_TEST_WORKER_VAR": "first"}
    assert parent != os.getpid(), "the worker was meant to come from the fork server"

    # A plain variable set after the fork server started still reaches the next worker, which is forked.
    monkeypatch.setenv("SGLANG_TEST_WORKER_VAR", "second")
    monkeypatch.delenv("SGLANG_TEST_WORKER_GONE", raising=False)
    env, parent = _start(ctx, ["SGLANG_TEST_WORKER_VAR", "SGLANG_TEST_WORKER_GONE"])
    assert env == {"SGLANG_TEST_WORKER_VAR": "second", "SGLANG_TEST_WORKER_GONE": None}
    assert parent != os.getpid()

    # OpenMP parses OMP_* when torch loads: the fork server's copy cannot follow, so this worker is spawned.
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE" if os.environ.get("OMP_WAIT_POLICY") != "ACTIVE" else "PASSIVE")
    env, parent = _start(ctx, ["OMP_WAIT_POLICY"])
    assert env == {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    assert parent == os.getpid()


def test_load_time_variables_are_told_apart():
    assert worker_processes._load_time_environ({"OMP_NUM_THREADS": "2", "HOME": "/x", "TORCH_LOGS": "y"}) == {
        "OMP_NUM_THREADS": "2", "TORCH_LOGS": "y"}


_EXITING_SERVER = textwrap.dedent("""
    import json, sys
    from multiprocessing import forkserver, resource_tracker, util
    from sglang.srt.managers.process_utils import exit_without_teardown
    from sglang.srt.managers.worker_processes import WorkerContext, start_fork_server

    def noop():
        pass

    if __name__ == "__main__":
        start_fork_server()
        ctx = WorkerContext()
        p = ctx.Process(target=noop, daemon=True)
        p.start()
        p.join()
        print(json.dumps({"helpers": [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid],
                          "tmp": util.get_temp_dir()}), flush=True)
        exit_without_teardown(sys.argv[1] if sys.argv[1] == "message" else int(sys.argv[1]))
""")


@pytest.mark.parametrize("code, status", [("3", 3), ("0", 0), ("message", 1)])
def test_exit_without_teardown_reaps_helpers_and_keeps_the_status(tmp_path, code, status):
    script = tmp_path / "server.py"
    script.write_text(_EXITING_SERVER)
    done = subprocess.run([sys.executable, str(script), code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == status, done.stderr
    if code == "message":
        assert done.stderr.strip().endswith("message")
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(isinstance(pid, int) for pid in report["helpers"])
    # Reaped before the process ended: no orphan is left for init to collect, and the temporary folder is gone.
    assert not [pid for pid in report["helpers"] if psutil.pid_exists(pid)]
    assert not os.path.exists(report["tmp"])


_CREATOR = textwrap.dedent("""
    import time
    from sglang.srt.managers.process_utils import watch_parent
    from sglang.srt.managers.worker_processes import WorkerContext

    def worker(conn):
        watch_parent(interval=0.2)
        conn.send("watching")
        time.sleep(120)

    if __name__ == "__main__":
        ctx = WorkerContext()
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(writer,), daemon=True)
        p.start()
        assert reader.recv() == "watching"
        print(p.pid, flush=True)
        time.sleep(120)
""")


def test_a_forked_worker_exits_when_its_creator_dies_even_unreaped(tmp_path, killed_process_env):
    """The worker's parent is the fork server, which lives on while any worker does: the worker watches the
    process that created it instead, and a killed creator counts as dead while it is still a zombie."""
    script = tmp_path / "creator.py"
    script.write_text(_CREATOR)
    creator = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=killed_process_env)
    try:
        worker = psutil.Process(int(creator.stdout.readline()))
        assert worker.ppid() != creator.pid  # forked by the fork server
        creator.kill()  # not waited for: it stays a zombie meanwhile
        psutil.wait_procs([worker], timeout=10)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    finally:
        from sglang.utils import terminate_process

        terminate_process(creator)


def test_workers_are_spawned_where_a_cuda_device_is_visible(monkeypatch):
    """CUDA cannot run in a child forked from a process that queried it (the fork server's imports do), so a
    machine that shows an NVIDIA device spawns its workers; hiding the devices brings the fork server back."""
    monkeypatch.setattr(worker_processes.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker_processes.cuda_visible()
    assert not WorkerContext().uses_fork_server
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not worker_processes.cuda_visible()
    assert WorkerContext().uses_fork_server

"""`Runtime(**server_args)` starts a server it owns, serves programs through `.endpoint`, and stops it."""

from __future__ import annotations

import json

import psutil

import sglang as sgl
from sglang import assistant, function, gen, user
from tests.conftest import SMOLLM2


def test_runtime_starts_serves_and_stops(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the server puts its socket folders
    runtime = sgl.Runtime(model_path=SMOLLM2)
    try:
        pid = runtime.pid
        assert psutil.pid_exists(pid)
        assert runtime.endpoint.chat_template.name == "smollm2"

        @function
        def qa(s):
            s += user("What is the capital of France?")
            s += assistant(gen("answer", max_tokens=8, temperature=0))

        state = qa.run(backend=runtime)  # a Runtime is accepted where a backend is expected
        assert state["answer"]
        out = json.loads(runtime.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0}))
        assert out["meta_info"]["completion_tokens"] == 4
        assert sgl.get_server_info(runtime)["model_path"] == SMOLLM2
    finally:
        runtime.shutdown()
    assert runtime.pid is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # Stopped with SIGTERM, not killed: the server removed its worker sockets and multiprocessing's folder itself.
    assert not list(tmp_path.iterdir())

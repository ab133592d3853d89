"""Load and disconnects: 1,000 mixed requests at 128 concurrency on a KV pool small enough to force retraction
give the unloaded greedy outputs, and 200 clients that hang up mid-stream are all aborted; afterwards no KV,
thread, file descriptor or process is left over. The server runs a tiny random Llama with SmolLM2's tokenizer:
what is under test is the scheduler's bookkeeping (retraction, aborts, grammars), not the model's arithmetic, and
on it the thousand requests take seconds instead of minutes (test_engine_greedy retracts SmolLM2 itself)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import psutil
import pytest
import requests

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process
from tests.conftest import save_tiny_llama

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jolly frogs".split()
REGEX = r"[a-z]+( [a-z]+){2,5}\."
_retractions: list[int] = []


def _prompts() -> list[dict]:
    """40 distinct requests: prompt lengths 3-60 words, 4-40 new tokens, a quarter regex-constrained."""
    out = []
    for i in range(40):
        words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + (i * 13) % 58)]
        params: dict = {"max_new_tokens": 4 + (i * 11) % 37, "temperature": 0}
        if i % 4 == 3:
            params["regex"] = REGEX
        else:  # full-length outputs, so that the scheduler's admission estimate runs short and it retracts
            params["ignore_eos"] = True
        out.append({"text": " ".join(words), "sampling_params": params})
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4k"), smollm2_tokenizer, max_position_embeddings=4096)
    url = f"http://127.0.0.1:{find_free_port()}"
    log = str(tmp_path_factory.mktemp("load") / "server.log")
    proc = popen_launch_server(model, url, log_path=log, other_args=[
        "--dtype", "float32", "--cpu-gemm", "float32", "--max-total-tokens", "1500", "--max-running-requests", "128",
        "--log-level", "warning"])
    try:
        yield url, proc, log
    finally:
        terminate_process(proc)


def _generate(url: str, body: dict, stream: bool) -> str:
    if not stream:
        r = requests.post(f"{url}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        _retractions.append(r.json()["meta_info"]["total_retractions"])
        return r.json()["text"]
    text = ""
    with requests.post(f"{url}/generate", json={**body, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = orjson.loads(line[6:])
                assert "error" not in event, event
                text = event["text"]
    return text


def _wait_idle(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while requests.get(f"{url}/get_load").json()["load"] != 0:
        assert time.monotonic() < deadline, "requests or KV left after the run"
        time.sleep(0.3)


def _resources(proc) -> tuple[int, int, int]:
    """(threads, open file descriptors, child processes) of the server process."""
    p = psutil.Process(proc.pid)
    return p.num_threads(), p.num_fds(), len(p.children(recursive=True))


def test_thousand_mixed_requests_under_retraction_equal_the_unloaded_outputs(server):
    url, proc, _ = server
    prompts = _prompts()
    reference = [_generate(url, body, stream=False) for body in prompts]
    _wait_idle(url)
    _retractions.clear()
    before = _resources(proc)
    jobs = [(i % len(prompts), i % 2 == 1) for i in range(1000)]
    with ThreadPoolExecutor(max_workers=128) as pool:
        outputs = list(pool.map(lambda job: _generate(url, prompts[job[0]], stream=job[1]), jobs))
    mismatches = [(i, outputs[n], reference[i]) for n, (i, _) in enumerate(jobs) if outputs[n] != reference[i]]
    assert not mismatches, mismatches[:3]
    _wait_idle(url)
    state = requests.get(f"{url}/get_server_info").json()["internal_states"][0]
    assert state["load"] == 0
    assert sum(_retractions) > 0, "the pool was meant to be small enough to force retractions"
    time.sleep(1)
    threads, fds, children = _resources(proc)
    assert children == before[2]
    assert threads <= before[0] + 2, (before, (threads, fds))
    assert fds <= before[1] + 8, (before, (threads, fds))


def test_two_hundred_clients_hanging_up_mid_stream_are_all_aborted(server):
    url, proc, _ = server
    _wait_idle(url)
    before = _resources(proc)

    def hang_up(i: int) -> int:
        body = {"text": f"Tell story number {i}", "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    return r.status_code  # leaving the block closes the connection mid-stream
        return r.status_code

    with ThreadPoolExecutor(max_workers=200) as pool:
        assert set(pool.map(hang_up, range(200))) == {200}
    _wait_idle(url, timeout=120)
    time.sleep(1)
    threads, fds, children = _resources(proc)
    assert children == before[2]
    assert threads <= before[0] + 2 and fds <= before[1] + 8, (before, (threads, fds))
    ok = requests.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200

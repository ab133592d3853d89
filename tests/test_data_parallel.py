"""--dp-size 2 against real SmolLM2 servers: the same greedy outputs as one replica, every control message on
both replicas, the cache-aware balancer's prefix hits, and a dead replica stopping the server.

Both servers run float32 end to end (`--dtype float32 --cpu-gemm float32`), so a request's greedy tokens do not
depend on which other requests share its batch, and hence not on the replica it lands on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process
from tests.conftest import SMOLLM2
from tests.weight_checkpoints import build_perturbed_smollm2, hf_greedy

FLOAT32 = ("--dtype", "float32", "--cpu-gemm", "float32", "--max-total-tokens", "8192", "--log-level", "warning")
WORDS = ("river stone lantern orchard copper meadow violin harbor thunder saffron glacier pepper falcon marble "
         "cinnamon compass velvet canyon ember willow quartz tide ribbon summit").split()


@contextlib.contextmanager
def _server(*args: str) -> Iterator[tuple[str, object, str]]:
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="sglang-dp-", suffix=".log", delete=False).name
    proc = popen_launch_server(SMOLLM2, url, other_args=[*FLOAT32, *args], log_path=log)
    try:
        yield url, proc, log
    finally:
        terminate_process(proc)
        os.unlink(log)


def _mixed_requests() -> list[dict]:
    """64 requests of different lengths, budgets and input forms."""
    reqs = []
    for i in range(64):
        words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 11))
        body: dict = {"sampling_params": {"temperature": 0, "max_new_tokens": 2 + i % 13}}
        if i % 4 == 3:
            body["input_ids"] = [1, 504, 2988, 314] + [100 + (i * 13 + k) % 900 for k in range(i % 9 + 1)]
        else:
            body["text"] = f"Story {i}: {words}. Then"
        if i % 5 == 0:
            body["sampling_params"]["stop"] = ["."]
        reqs.append(body)
    return reqs


def _run_concurrently(url: str, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: requests.post(f"{url}/generate", json=b, timeout=300), bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def _states(url: str) -> list[dict]:
    return requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    """The 64 requests' outputs on one replica (its server stops before the DP servers start)."""
    with _server() as (url, _, _):
        return _run_concurrently(url, _mixed_requests())


@pytest.fixture(scope="module")
def dp_server() -> Iterator[tuple[str, object, str]]:
    with _server("--dp-size", "2", "--load-balance-method", "round_robin") as server:
        yield server


def test_two_replicas_answer_as_one(reference, dp_server):
    url = dp_server[0]
    outs = _run_concurrently(url, _mixed_requests())
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in reference]
    assert [o.get("text") for o in outs] == [o.get("text") for o in reference]
    states = _states(url)
    assert [s["dp_rank"] for s in states] == [0, 1]  # one entry per replica, in replica order
    # Each replica's prefix cache holds the prompts it served: both received work.
    assert all(s["evictable_size"] > 0 for s in states), states
    assert requests.get(f"{url}/get_load", timeout=30).json() == {"load": sum(s["load"] for s in states)}


def test_flush_cache_empties_both_replicas(dp_server):
    url = dp_server[0]
    response = requests.post(f"{url}/flush_cache", timeout=30)
    assert response.status_code == 200, response.text
    assert [s["evictable_size"] for s in _states(url)] == [0, 0]


def test_data_parallel_rank_routes_to_that_replica(dp_server):
    url = dp_server[0]
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
    body = {"text": "Routed by hand: the second replica serves this.", "data_parallel_rank": 1,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    for _ in range(2):
        r = requests.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
    sizes = [s["evictable_size"] for s in _states(url)]
    assert sizes[0] == 0 and sizes[1] > 0, sizes
    assert r.json()["meta_info"]["cached_tokens"] > 0  # the repeat found its prompt on the same replica
    for bad in (2, -1, "0", True):
        r = requests.post(f"{url}/generate", json={**body, "data_parallel_rank": bad}, timeout=30)
        assert r.status_code == 400 and "data_parallel_rank" in r.text, (bad, r.text)


def test_abort_all_reaches_both_replicas(dp_server):
    url = dp_server[0]
    long = {"text": "Count forever:", "sampling_params": {"temperature": 0, "max_new_tokens": 4000,
                                                           "ignore_eos": True}}
    outs: list[dict] = []
    threads = [threading.Thread(target=lambda: outs.append(requests.post(f"{url}/generate", json=long,
                                                                          timeout=120).json())) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while [s["num_running_reqs"] for s in _states(url)] != [1, 1]:  # round robin: one on each replica
        assert time.monotonic() < deadline, _states(url)
        time.sleep(0.1)
    assert requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
    for t in threads:
        t.join(timeout=60)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert all(o["meta_info"]["completion_tokens"] < 4000 for o in outs)


def _shared_prefix_hit_rate(url: str) -> float:
    """cached / prompt tokens of two more requests in each of eight groups that share long prefixes, once each
    group's prefix was served once. Each batch is one request, so the router sees its items in a fixed order.
    Round robin sends one of each pair to the replica that has not seen the group yet."""
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200
    prefixes = [f"Archive {g}. " + " ".join(WORDS[(g * 5 + k * 3) % len(WORDS)] for k in range(90)) + "."
                for g in range(8)]
    params = {"temperature": 0, "max_new_tokens": 2}
    first = requests.post(f"{url}/generate", json={"text": [p + " Question 0?" for p in prefixes],
                                                   "sampling_params": params}, timeout=300)
    assert first.status_code == 200, first.text
    texts = [p + f" Question {q + 1}?" for p in prefixes for q in range(2)]
    outs = requests.post(f"{url}/generate", json={"text": texts, "sampling_params": params}, timeout=300).json()
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return cached / sum(o["meta_info"]["prompt_tokens"] for o in outs)


def test_cache_aware_hits_the_prefix_cache_more_than_round_robin(dp_server):
    round_robin = _shared_prefix_hit_rate(dp_server[0])
    with _server("--dp-size", "2", "--load-balance-method", "cache_aware") as (url, _, _):
        cache_aware = _shared_prefix_hit_rate(url)
        assert all(s["evictable_size"] > 0 for s in _states(url))  # the groups were spread over both replicas
    print(f"prefix hit rate: round_robin {round_robin:.3f}, cache_aware {cache_aware:.3f}")
    assert cache_aware > 0.8
    assert cache_aware > round_robin + 0.2


def test_weight_update_reaches_both_replicas(dp_server, smollm2_dir, smollm2_tokenizer, tmp_path):
    url = dp_server[0]
    ids = smollm2_tokenizer.encode("The capital of France is")
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}

    def twice() -> list[list[int]]:  # round robin: one request on each replica
        return [requests.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"] for _ in range(2)]

    before = twice()
    assert before[0] == before[1]
    model = build_perturbed_smollm2(smollm2_dir, tmp_path / "perturbed")
    expected = hf_greedy(model, [ids], 8)[0]
    assert expected != before[0]
    response = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "perturbed")},
                             timeout=300)
    assert response.status_code == 200 and response.json()["success"], response.text
    assert twice() == [expected, expected]
    # A failed update on the replicas is reported as a failure, not as success of some.
    bad = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")},
                        timeout=300)
    assert bad.status_code == 400 and not bad.json()["success"]
    assert bad.json()["message"] == f"Failed to get weights iterator: {tmp_path / 'missing'} (repository not found)."


def test_a_dead_replica_stops_the_server(dp_server):
    url, proc, log = dp_server
    children = psutil.Process(proc.pid).children(recursive=True)
    # The two schedulers hold the model: the two largest children.
    replica = sorted(children, key=lambda c: c.memory_info().rss)[-1]
    os.kill(replica.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) != 0
    assert "Child process sglang-scheduler-dp" in open(log).read()

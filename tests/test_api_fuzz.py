"""Property-based fuzz of every route from the server's own OpenAPI schema: no input gets a 5xx or hangs.

schemathesis generates requests (valid and invalid bodies, odd path and query values) for every operation the
schema lists; the bodies of routes that read JSON themselves are documented there from
`sglang/srt/entrypoints/body_schemas.py`. The server runs a tiny random Llama (with SmolLM2's tokenizer) with a
short context, so that generating is cheap however large the fuzzed lengths get.
"""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.server_fixtures import running_server

EXAMPLES_PER_OPERATION = 60
MIN_TOTAL_CASES = 1200
_cases: list[str] = []


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir, tmp_path_factory):
    storage = tmp_path_factory.mktemp("fuzz-storage")
    with running_server("--log-level", "error", "--max-total-tokens", "16384", "--dtype", "float32",
                        "--enable-metrics", "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3",
                        "--file-storage-path", str(storage), "--max-request-body-bytes", "1048576",
                        model=tiny_llama_dir) as url:
        yield url


def _operations(base_url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _strategy(operation):
    """Valid requests and, where the operation has inputs that can be made invalid, invalid ones."""
    positive = operation.as_strategy(GenerationMode.POSITIVE)
    try:
        return st.one_of(positive, operation.as_strategy(GenerationMode.NEGATIVE))
    except Exception:  # nothing to negate (no parameters and no body)
        return positive


def _fuzz(operation, base_url: str, failures: list[str]) -> None:
    @given(case=_strategy(operation))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate], derandomize=True, database=None)
    def run(case) -> None:
        _cases.append(operation.label)
        response = case.call(base_url=base_url, timeout=60)
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {response.text[:300]}\n{case.as_curl_command()}")

    run()


def test_no_request_gets_a_server_error_or_hangs(fuzz_server):
    """About EXAMPLES_PER_OPERATION generated requests per route: every answer is below 500."""
    failures: list[str] = []
    for operation in _operations(fuzz_server):
        _fuzz(operation, fuzz_server, failures)
    assert not failures, "\n\n".join(failures[:10])


def test_fuzz_covered_every_route_and_left_the_server_healthy(fuzz_server):
    assert len(_cases) >= MIN_TOTAL_CASES, f"only {len(_cases)} fuzz cases ran"
    routes = set(requests.get(f"{fuzz_server}/openapi.json").json()["paths"])
    fuzzed = {label.split(" ", 1)[1] for label in _cases}
    assert routes <= fuzzed, f"routes never fuzzed: {sorted(routes - fuzzed)}"
    deadline = time.monotonic() + 60
    while requests.get(f"{fuzz_server}/get_load").json()["load"] != 0:
        assert time.monotonic() < deadline, "KV or queued tokens left after the fuzz"
        time.sleep(0.5)
    ok = requests.post(f"{fuzz_server}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200
    assert requests.get(f"{fuzz_server}/health").status_code == 200

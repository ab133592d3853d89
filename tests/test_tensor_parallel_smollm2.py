"""SmolLM2-135M (9 attention heads, 3 K/V heads) at --tp-size 2 through the HTTP server: the uneven head split
(K/V heads 0-1 on rank 0, 2 on rank 1) gives the TP=1 server's greedy tokens, token for token.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.server_fixtures import running_server
from tests.tp_fixtures import FLOAT32_FLAGS, GREEDY, PROMPT_IDS

pytestmark = pytest.mark.tensor_parallel

# The dense float32 path at both sizes (no GGUF blocks), so that the same arithmetic runs sharded or not.
FLAGS = [*FLOAT32_FLAGS, "--gguf-kernel-max-rows", "0", "--log-level", "error"]


def _greedy_ids(tp_size: int) -> list[list[int]]:
    with running_server(*FLAGS, "--tp-size", str(tp_size)) as base_url:
        r = requests.post(f"{base_url}/generate", json={"input_ids": PROMPT_IDS, "sampling_params": GREEDY},
                          timeout=120)
        r.raise_for_status()
        return [out["output_ids"] for out in r.json()]


def test_smollm2_tp2_server_equals_tp1_token_for_token():
    # both servers at once: their start-up (model load, rendezvous) dominates the test's time
    with ThreadPoolExecutor(2) as pool:
        tp1, tp2 = pool.map(_greedy_ids, (1, 2))
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in tp1)
    assert tp2 == tp1

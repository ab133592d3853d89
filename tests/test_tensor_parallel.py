"""Tensor parallelism end to end: TP=2 greedy outputs equal TP=1 token for token (Engine and a server spread
over two loopback "nodes"), a dead node 1 stops node 0's server, and bad parallel flags are refused by name.
The slower checks (SmolLM2 over 3 ranks, a dead node 0) are in test_tensor_parallel_nodes.py.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

import time

import pytest
import torch

from sglang import Engine
from sglang.utils import terminate_process
from tests.tp_fixtures import (  # noqa: F401 - remove_logs is an autouse fixture
    DIST_TIMEOUT_S,
    FLOAT32,
    GREEDY,
    PROMPT_IDS,
    remove_logs,
    server_texts,
    start_two_nodes,
    tiny_model,
)

pytestmark = pytest.mark.tensor_parallel


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    return {family: tiny_model(tmp_path_factory.mktemp(f"tp-{family}"), smollm2_tokenizer, family)
            for family in ("llama", "qwen2", "qwen3")}


def _engine_outputs(model: str, tp_size: int) -> list[dict]:
    engine = Engine(model_path=model, tp_size=tp_size, **FLOAT32)
    try:
        return engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
    finally:
        engine.shutdown()


def _transformers_greedy(model_dir: str, prompt_ids: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def tp1_llama(tiny_models) -> list[dict]:
    return _engine_outputs(tiny_models["llama"], 1)


@pytest.fixture(scope="module")
def tp1_texts(tp1_llama) -> dict[str, list[str]]:
    return {"llama": [out["text"] for out in tp1_llama]}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_tp2_equals_unsharded_greedy(tiny_models, tp1_llama, family, tmp_path, smollm2_tokenizer):
    """TP=2 token ids equal the unsharded model's greedy ids: transformers' for every family (the TP=1 engine
    equals transformers on these families: tests/test_models.py), and the TP=1 engine's itself for Llama.
    For Llama a weight update then reaches both ranks: the outputs follow the new checkpoint."""
    engine = Engine(model_path=tiny_models[family], tp_size=2, **FLOAT32)
    try:
        outputs = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        _assert_transformers_greedy(tiny_models[family], outputs)
        if family != "llama":
            return
        assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in tp1_llama]
        other = tiny_model(tmp_path, smollm2_tokenizer, "llama", seed=1)
        assert engine.update_weights_from_disk(other) == (True, "Succeeded to update model weights.")
        updated = engine.generate(input_ids=PROMPT_IDS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in updated] != [o["output_ids"] for o in outputs]
        _assert_transformers_greedy(other, updated)
    finally:
        engine.shutdown()


def _assert_transformers_greedy(model_dir: str, outputs: list[dict]) -> None:
    for prompt_ids, out in zip(PROMPT_IDS, outputs):
        assert out["output_ids"] == _transformers_greedy(model_dir, prompt_ids, GREEDY["max_new_tokens"])


def test_two_node_server_equals_tp1_and_a_dead_node_1_stops_node_0(tiny_models, tp1_texts, killed_process_env):
    """TP=2 over two loopback "nodes" through the HTTP server: the TP=1 texts (TP=2 in one node gives them
    too, test above); then node 1 dies and node 0's server exits non-zero within --dist-timeout."""
    node0, node1, base_url = start_two_nodes(tiny_models["llama"], killed_process_env)
    try:
        assert server_texts(base_url) == tp1_texts["llama"]
        node1.kill()  # its ranks follow it (they watch their parent); node 0's rank 0 loses its group
        start = time.monotonic()
        code = node0.wait(timeout=DIST_TIMEOUT_S + 20)
        assert code != 0
        assert time.monotonic() - start < DIST_TIMEOUT_S + 20
    finally:
        terminate_process(node0)
        terminate_process(node1)


def test_bad_parallel_flags_are_refused_by_name():
    from sglang.srt.server_args import ServerArgs

    cases = [
        (dict(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1234"), "--tp-size 3 must be a multiple of --nnodes"),
        (dict(tp_size=2, nnodes=2), "--dist-init-addr"),
        (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234"), "--node-rank"),
        (dict(tp_size=2, dist_init_addr="nohost"), "--dist-init-addr must be HOST:PORT"),
        (dict(tp_size=2, dist_timeout=0), "--dist-timeout"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ServerArgs(model_path="m", **kwargs).validate()
    assert "tp_size" not in ServerArgs(model_path="m", tp_size=2).not_applicable_settings()

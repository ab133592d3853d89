"""Tensor parallelism, the slower checks: SmolLM2 split over 3 ranks equals 1 rank (4 cannot split its heads),
and a dead node 0 ends node 1 with a non-zero status.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

import tempfile

import pytest

from sglang import Engine
from sglang.srt.managers.worker_processes import start_fork_server
from sglang.utils import terminate_process
from tests.tp_fixtures import (  # noqa: F401 - remove_logs is an autouse fixture
    DIST_TIMEOUT_S,
    FLOAT32,
    GREEDY,
    PROMPT_IDS,
    remove_logs,
    start_two_nodes,
    tiny_model,
)

pytestmark = pytest.mark.tensor_parallel


def test_a_dead_node_0_stops_node_1(tmp_path, smollm2_tokenizer, killed_process_env):
    node0, node1, _ = start_two_nodes(tiny_model(tmp_path, smollm2_tokenizer, "llama"), killed_process_env)
    try:
        node0.kill()  # its rank 0 follows it (ranks watch their parent); node 1's rank waits for a step in vain
        assert node1.wait(timeout=DIST_TIMEOUT_S + 20) != 0
    finally:
        terminate_process(node0)
        terminate_process(node1)


def _smollm2_ids(model: str, tp_size: int) -> list[list[int]]:
    # The dense float32 path at every size (no GGUF blocks), so that the same arithmetic runs sharded or not.
    engine = Engine(model_path=model, tp_size=tp_size, gguf_kernel_max_rows=0, **FLOAT32)
    try:
        outputs = engine.generate(input_ids=PROMPT_IDS[:2], sampling_params={**GREEDY, "max_new_tokens": 8})
        return [out["output_ids"] for out in outputs]
    finally:
        engine.shutdown()


def test_smollm2_tp3_equals_tp1_and_tp4_is_refused(smollm2_dir, tmp_path, monkeypatch):
    # SmolLM2-135M has 9 attention heads and 3 K/V heads: 3 ranks split them (2 too, unevenly:
    # test_tensor_parallel_smollm2.py); 4 ranks can neither split nor replicate 3 K/V heads.
    start_fork_server()  # started with the system's temporary folder, as by any Engine
    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(tmp_path))
        with pytest.raises(ValueError, match=r"--tp-size 4 is larger than the model's 3 key/value heads"):
            Engine(model_path=smollm2_dir, tp_size=4, **FLOAT32)
    assert list(tmp_path.iterdir()) == []  # the refused start removed its socket folder
    assert _smollm2_ids(smollm2_dir, 3) == _smollm2_ids(smollm2_dir, 1)

"""Where a node's scheduler ranks run (distributed/placement.py): the CUDA device of each tensor-parallel rank and
data-parallel replica (--base-gpu-id, --gpu-id-step) and each rank's CPU threads under --dp-size x --tp-size.
No GPU is needed: the launchers are checked through the arguments they give each process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from transformers import LlamaConfig

from sglang.srt.distributed.placement import gpu_id, node_local_index, replica_base_gpu_id, threads_per_rank
from sglang.srt.entrypoints import replicas, tp_launch
from sglang.srt.server_args import ServerArgs, prepare_server_args

pytestmark = pytest.mark.tensor_parallel


def test_gpu_ids_follow_base_and_step_over_replicas_and_ranks():
    assert [gpu_id(0, 1, i) for i in range(4)] == [0, 1, 2, 3]
    assert [gpu_id(2, 2, i) for i in range(3)] == [2, 4, 6]
    # --dp-size 2 x --tp-size 2 from GPU 1 in steps of 2: replica 0 on GPUs 1, 3; replica 1 on GPUs 5, 7
    ids = [[gpu_id(1, 2, node_local_index(dp, 2, tp)) for tp in range(2)] for dp in range(2)]
    assert ids == [[1, 3], [5, 7]]
    assert [replica_base_gpu_id(1, 2, dp, 2) for dp in range(2)] == [1, 5]
    # a replica's ranks then count from its base: the same GPUs as above
    assert [gpu_id(replica_base_gpu_id(1, 2, 1, 2), 2, tp) for tp in range(2)] == [5, 7]


def test_every_rank_of_every_replica_gets_an_equal_share_of_the_cores():
    assert threads_per_rank(16, 1, 1) == 16
    assert threads_per_rank(16, 2, 1) == 8
    assert threads_per_rank(16, 2, 2) == 4  # not 8 per rank: 4 ranks together use the 16 cores
    assert threads_per_rank(16, 1, 4) == 4
    assert threads_per_rank(2, 2, 2) == 1  # at least one thread each
    assert threads_per_rank(16, 2, 2, num_threads=3) == 3  # --num-threads is per rank, as given


def test_a_replica_passes_its_per_rank_share_to_its_tensor_parallel_ranks(monkeypatch):
    monkeypatch.setattr(replicas, "usable_cpu_count", lambda: 16)
    args = ServerArgs(model_path="m", device="cpu", dp_size=2, tp_size=2)
    share = replicas.replica_server_args(args)
    assert share.num_threads == 4
    monkeypatch.setattr(tp_launch, "usable_cpu_count", lambda: 16)
    assert tp_launch.threads_per_rank(share, 2) == 4
    assert tp_launch.threads_per_rank(ServerArgs(model_path="m", tp_size=2), 2) == 8  # one replica: cores / 2
    assert replicas.replica_server_args(ServerArgs(model_path="m", device="cpu", dp_size=2, tp_size=2,
                                                   num_threads=3)).num_threads == 3


class _Ctx:
    """Records the processes a launcher would start instead of starting them."""

    def __init__(self) -> None:
        self.started: list[dict[str, Any]] = []

    def Pipe(self, duplex):  # noqa: N802 - the multiprocessing context's names
        return None, None

    def Process(self, target, args, name, daemon):  # noqa: N802
        record = {"target": target, "args": args, "name": name}
        self.started.append(record)
        return SimpleNamespace(start=lambda: None, record=record)


_MODEL_INFO = SimpleNamespace(hf_config=LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_attention_heads=4, num_key_value_heads=2,
                                                    num_hidden_layers=1))


def test_tensor_parallel_ranks_and_replicas_get_their_gpu_ids():
    ctx = _Ctx()
    args = ServerArgs(model_path="m", device="cuda", tp_size=2, dp_size=2, base_gpu_id=1, gpu_id_step=2)
    for dp_rank in range(2):
        replicas.start_scheduler_group(ctx, args, None, _MODEL_INFO, dp_rank)  # type: ignore[arg-type]
    # run_tp_scheduler_process(server_args, port_args, model_info, pipe, tp_rank, gpu_id, init_addr, threads)
    assert [(p["args"][4], p["args"][5]) for p in ctx.started] == [(0, 1), (1, 3), (0, 5), (1, 7)]
    assert [p["name"] for p in ctx.started] == ["sglang-scheduler-dp0-tp0", "sglang-scheduler-dp0-tp1",
                                                "sglang-scheduler-dp1-tp0", "sglang-scheduler-dp1-tp1"]


def test_a_single_scheduler_per_replica_gets_its_gpu_id():
    ctx = _Ctx()
    args = ServerArgs(model_path="m", device="cuda", dp_size=3, base_gpu_id=2)
    for dp_rank in range(3):
        replicas.start_scheduler_group(ctx, args, None, _MODEL_INFO, dp_rank)  # type: ignore[arg-type]
    assert all(p["target"] is tp_launch.run_single_scheduler for p in ctx.started)
    assert [p["args"][0] for p in ctx.started] == [2, 3, 4]


def test_gpu_flags_are_parsed_checked_and_no_longer_reported_as_ignored():
    args = prepare_server_args(["--model-path", "m", "--base-gpu-id", "2", "--gpu-id-step", "2"])
    assert (args.base_gpu_id, args.gpu_id_step) == (2, 2)
    assert not {"base_gpu_id", "gpu_id_step"} & set(args.not_applicable_settings())
    with pytest.raises(ValueError, match="--base-gpu-id must be at least 0, got -1"):
        ServerArgs(model_path="m", base_gpu_id=-1).validate()
    with pytest.raises(ValueError, match="--gpu-id-step must be at least 1, got 0"):
        ServerArgs(model_path="m", gpu_id_step=0).validate()

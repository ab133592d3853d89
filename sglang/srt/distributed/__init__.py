"""Tensor-parallel process groups on torch.distributed (gloo on CPU, NCCL on CUDA) and their collectives."""

from sglang.srt.distributed.parallel_state import (
    TPGroup,
    destroy_tp_group,
    get_tp_group,
    init_tp_group,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = ["TPGroup", "destroy_tp_group", "get_tp_group", "init_tp_group", "tp_all_gather", "tp_all_reduce"]

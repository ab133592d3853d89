"""Checks of the tensor-parallel and multi-node flags, and of a model's support for tensor parallelism."""

from __future__ import annotations

from typing import Any


def check_parallel_args(args: Any) -> None:
    """Flag checks that need no model (ServerArgs.validate). Raises ValueError naming the flag."""
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, {args.nnodes - 1}] for --nnodes {args.nnodes}, "
                         f"got {args.node_rank}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"--tp-size {args.tp_size} must be a multiple of --nnodes {args.nnodes} "
                         "(each node runs tp-size / nnodes ranks)")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("--dist-init-addr HOST:PORT (reachable from every node) is required with --nnodes > 1")
    if args.dist_init_addr is not None:
        host, sep, port = args.dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {args.dist_init_addr!r}")
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        raise ValueError(f"--dist-timeout must be a positive number of seconds, got {args.dist_timeout}")
    if getattr(args, "base_gpu_id", 0) < 0:
        raise ValueError(f"--base-gpu-id must be at least 0, got {args.base_gpu_id}")
    if getattr(args, "gpu_id_step", 1) < 1:
        raise ValueError(f"--gpu-id-step must be at least 1, got {args.gpu_id_step}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
    if getattr(args, "dp_size", 1) > 1 and args.nnodes > 1:
        raise ValueError("--dp-size > 1 runs on one node; use --nnodes > 1 with --dp-size 1")
    if getattr(args, "dp_size", 1) > 1 and args.tp_size > 1 and args.dist_init_addr:
        raise ValueError("--dist-init-addr names one rendezvous, for one replica: leave it unset with --dp-size > 1 "
                         "(each replica's ranks meet at their own loopback port)")
    if args.tp_size > 1 and args.is_embedding:
        raise ValueError("--tp-size > 1 serves generation models only; run embedding models with --tp-size 1")


def check_model_supports_tp(hf_config: Any, tp_size: int) -> None:
    """Refuse, before any process starts, a model that tensor parallelism cannot split (or not at all)."""
    if tp_size == 1:
        return
    from sglang.srt.distributed.partition import check_partition_fits, head_partition
    from sglang.srt.models.gemma2 import Gemma2ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.registry import architectures_of, get_model_class

    model_class = get_model_class(architectures_of(hf_config))
    if not issubclass(model_class, (LlamaForCausalLM, Gemma2ForCausalLM)):
        raise ValueError(f"--tp-size {tp_size}: {model_class.__name__} does not support tensor parallelism "
                         "(supported: Llama-family decoders such as Llama, Qwen2/3, Mistral and Phi-3, their "
                         "mixture-of-experts variants (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), and Gemma 2/3)")
    if not getattr(model_class, "tensor_parallel", True):
        raise ValueError(f"--tp-size {tp_size}: {model_class.__name__} does not support tensor parallelism "
                         "(--tp-size 1)")
    config = hf_config.get_text_config()
    model_check = getattr(model_class, "check_tensor_parallel", None)
    if model_check is not None:  # what a model's own layers need of the split
        model_check(config, tp_size)
    # Every rank's heads, so the first error is raised here rather than in a rank while it builds the model.
    for rank in range(tp_size):
        head_partition(config.num_attention_heads, getattr(config, "num_key_value_heads", None)
                       or config.num_attention_heads, tp_size, rank)
    check_partition_fits(config.intermediate_size, tp_size, "MLP intermediate size")

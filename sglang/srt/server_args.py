"""Server configuration: one dataclass and the one argparse builder whose defaults come from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.speculative.args import SPECULATIVE_HELP

logger = logging.getLogger(__name__)

# Flags that only matter on hardware or topologies this engine does not use. They are accepted so that
# upstream command lines run unchanged; a non-default value is reported once at startup.
NOT_APPLICABLE_FLAGS = (
    "pp_size",
    "cuda_graph_max_bs", "disable_cuda_graph", "disable_overlap_schedule", "enable_mixed_chunk",
    "cpu_offload_gb",
    "attention_backend", "sampling_backend",
)


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: str = ""
    tokenizer_path: Optional[str] = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    skip_server_warmup: bool = False
    load_format: str = "auto"
    trust_remote_code: bool = False
    dtype: str = "auto"
    # K/V storage: auto (layers/arithmetic.py: bf16 on x86 CPUs with AVX2 or better under the automatic plan,
    # else the model dtype), float32, bfloat16/bf16, fp8_e4m3, fp8_e5m2 (mem_cache/kv_dtype.py).
    kv_cache_dtype: str = "auto"
    # The checkpoint's quantization method, read from its quantization_config (gptq, awq, fp8, compressed-tensors;
    # gguf for a GGUF file); a value given checks it (model_loader/quant_config.py), and on a float checkpoint
    # w8a8_int8 / fp8 quantize it at load (model_loader/online_quant.py). Integer weights are served from blocks of
    # their exact values where the plan makes blocks (model_loader/checkpoint_blocks.py), dequantized otherwise.
    quantization: Optional[str] = None
    context_length: Optional[int] = None
    device: Optional[str] = None
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    completion_template: Optional[str] = None
    is_embedding: bool = False
    revision: Optional[str] = None
    json_model_override_args: str = "{}"
    preferred_sampling_params: Optional[str] = None
    weight_version: str = "default"
    sampling_defaults: str = "model"

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    file_storage_path: str = "sglang_storage"
    max_file_size: int = 512 * 1024 * 1024  # bytes, per uploaded file
    batch_max_inflight: int = 16  # batch lines in flight at once, over all batches
    enable_cache_report: bool = False
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    # Image inputs (sglang/srt/multimodal/image_loading.py): http(s) image URLs are fetched only from these
    # comma-separated domains (or SGLANG_ALLOWED_IMAGE_URL_DOMAINS); none by default. Size limits per image.
    allowed_image_url_domains: Optional[str] = None
    # Image inputs given as local paths / file:// URLs are read only under this folder; None: refused.
    allowed_local_media_path: Optional[str] = None
    image_url_timeout: float = 5.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096

    # Memory and scheduling
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    max_prefill_tokens: int = 16384
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0
    cpu_offload_gb: int = 0
    page_size: int = 1
    disable_radix_cache: bool = False
    # Sliding-window layers keep their K/V in a second, smaller pool of this many slots per full-pool slot
    # (mem_cache/swa_pool.py); --disable-hybrid-swa-memory keeps one pool for every layer.
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    allow_auto_truncate: bool = False
    stream_interval: int = 1
    stream_output: bool = False
    random_seed: Optional[int] = None
    watchdog_timeout: float = 300.0
    # Requests allowed to wait for a running slot; beyond it new requests get 503 with Retry-After. None: no cap.
    max_queued_requests: Optional[int] = None
    # Seconds a request may take before it is aborted with a 504; None: no limit.
    request_timeout: Optional[float] = None
    # Largest HTTP request body accepted, in bytes (a larger one gets 413); file uploads have --max-file-size.
    max_request_body_bytes: int = 64 * 1024 * 1024
    # Seconds in-flight requests get to finish after SIGTERM before their connections are closed.
    graceful_shutdown_timeout: int = 30
    num_threads: Optional[int] = None

    # Parallelism: dp_size scheduler replicas (managers/data_parallel), each of tp_size ranks spread over
    # nnodes nodes (entrypoints/tp_launch.py)
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    dist_timeout: Optional[int] = None
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    download_dir: Optional[str] = None

    # Logging and metrics
    log_level: str = "info"
    log_level_http: Optional[str] = None
    log_requests: bool = False
    log_requests_level: int = 0
    show_time_cost: bool = False
    enable_metrics: bool = False
    decode_log_interval: int = 40

    # Kernels and optimizations
    attention_backend: Optional[str] = None
    sampling_backend: Optional[str] = None
    grammar_backend: Optional[str] = "xgrammar"
    constrained_json_whitespace_pattern: Optional[str] = None
    grammar_compile_timeout: float = 60.0
    enable_jump_forward: bool = False
    disable_jump_forward: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None
    disable_overlap_schedule: bool = False
    enable_mixed_chunk: bool = False
    enable_torch_compile: bool = False
    # Matmuls of at most this many token rows read a GGUF model's quantized blocks (CPU), and decode batches of at
    # most this many sequences run the fused decode step; 0 disables. None: from the arithmetic plan (64, 32 on
    # AMX CPUs; sglang/srt/layers/arithmetic.py).
    gguf_kernel_max_rows: Optional[int] = None
    # CPU GEMM for prefill and batches above --gguf-kernel-max-rows rows with float32 weights: auto picks per CPU
    # class (bf16 where the CPU has native bf16, float32 otherwise); see sglang/srt/layers/arithmetic.py.
    cpu_gemm: str = "auto"
    # Activations of the GGUF block kernels: auto = int8 per 32-value block where the CPU has AVX512-VNNI (unless
    # --dtype or --cpu-gemm asks for float32), float32 otherwise; see sglang/srt/layers/arithmetic.py.
    gguf_activations: str = "auto"
    # Q8_0 blocks quantized at load for the small batches of a checkpoint without GGUF blocks (plain safetensors),
    # which gives it the fused CPU decode step: auto = where large batches run a bf16 GEMM; see layers/arithmetic.py.
    small_batch_quantization: str = "auto"
    # What large batches of such a checkpoint multiply: blocks = no float weights: the same Q8_0 blocks, converted a
    # slab at a time for the float32 or bf16 GEMM (one copy of the weights), or an int8 copy where the int8 GEMM was
    # measured fastest; dense = float32 weights plus the --cpu-gemm copy; auto = blocks where the blocks are made and
    # the CPU has native bf16; see layers/arithmetic.py.
    large_batch_weights: str = "auto"
    # Prefill / extend attention over bf16 K/V on CPU: auto = AVX512-BF16 dot products where the CPU has them and
    # the plan is not float32, float32 otherwise; see sglang/srt/layers/arithmetic.py.
    prefill_attention: str = "auto"
    enable_tokenizer_batch_encode: bool = False
    enable_custom_logit_processor: bool = False
    enable_return_hidden_states: bool = False
    expert_distribution_recorder_mode: Optional[str] = None
    # stat modes: sum over the last this many forward passes of a recording; <0 keeps all (upstream: 1000).
    expert_distribution_recorder_buffer_size: Optional[int] = None
    enable_multimodal: Optional[bool] = None
    # LoRA serving (sglang/srt/lora): adapters as NAME=PATH (or PATH), served per request by their name.
    enable_lora: bool = False
    lora_paths: Optional[list[str]] = None
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: Optional[list[str]] = None
    # At most this many adapters' weights in memory (None: all); beyond it one is evicted by the policy (lru, fifo),
    # never a pinned one nor one in use, and read again from its path when a request needs it (lora/pool.py).
    max_loaded_loras: Optional[int] = None
    lora_eviction_policy: str = "lru"
    # Speculative decoding (sglang/srt/speculative/): NGRAM, which drafts from the request's own tokens and a
    # bounded cache of recent requests' tokens (no draft model), STANDALONE, where a draft model proposes, or EAGLE /
    # EAGLE3, where a draft head reads the served model's hidden states. The draft is a chain: the BFS/PROB tree
    # knobs are accepted for compatibility and do not change it.
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_token_map: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: Optional[int] = None  # 1 on CPU, 10 (SGLang's) on GPUs: speculative/args.py
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 1_000_000

    def __post_init__(self) -> None:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.device is None:
            self.device = _default_device()
        if self.random_seed is None:
            self.random_seed = random.randint(0, 1 << 30)
        if self.chunked_prefill_size is None and self.device != "cpu":
            self.chunked_prefill_size = 8192  # on CPU the model's size decides (model_info)
        if self.grammar_backend is None:
            self.grammar_backend = "xgrammar"
        if self.expert_distribution_recorder_buffer_size is None and self.expert_distribution_recorder_mode:
            self.expert_distribution_recorder_buffer_size = 1000
        if self.mem_fraction_static is None:
            # On CPU the KV pool shares RAM with everything else on the host: keep it modest.
            self.mem_fraction_static = 0.3 if self.device == "cpu" else 0.85

    def validate(self) -> None:
        """Checks that need no model. Raises ValueError naming the flag."""
        if not self.model_path:
            raise ValueError("--model-path is required")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        from sglang.srt.mem_cache.kv_dtype import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        from sglang.srt.model_loader.quant_config import check_quantization_flag

        check_quantization_flag(self.quantization)
        if self.page_size != 1:
            raise ValueError("--page-size: only 1 is supported")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"--max-total-tokens must be at least 16, got {self.max_total_tokens}")
        from sglang.srt.managers.data_parallel.balancer import canonical_method

        canonical_method(self.load_balance_method)
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be at least 1, got {self.dp_size}")
        if self.max_total_tokens is not None and self.max_total_tokens // self.dp_size < 16:
            raise ValueError(f"--max-total-tokens ({self.max_total_tokens}) is split between {self.dp_size} "
                             "replicas (--dp-size): each needs at least 16 tokens")
        if self.max_file_size < 1:
            raise ValueError(f"--max-file-size must be a positive number of bytes, got {self.max_file_size}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be at least 0, got {self.max_queued_requests}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be at least 1024, got {self.max_request_body_bytes}")
        from sglang.srt.distributed.args import check_parallel_args

        check_parallel_args(self)
        if self.batch_max_inflight < 1:
            raise ValueError(f"--batch-max-inflight must be at least 1, got {self.batch_max_inflight}")
        if self.tool_call_parser is not None:
            from sglang.srt.function_call import check_tool_call_parser

            check_tool_call_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            from sglang.srt.reasoning_parser import check_reasoning_parser

            check_reasoning_parser(self.reasoning_parser)
        from sglang.srt.eplb.collectors import check_recorder_mode

        check_recorder_mode(self.expert_distribution_recorder_mode)
        if self.preferred_sampling_params:
            try:
                json.loads(self.preferred_sampling_params)
            except json.JSONDecodeError as e:
                raise ValueError(f"--preferred-sampling-params is not valid JSON: {e}") from None
        from sglang.srt.model_loader.config_overrides import parse_overrides

        parse_overrides(self.json_model_override_args)
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be at least 1, got {self.max_loras_per_batch}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras ({self.max_loaded_loras}) must be at least --max-loras-per-batch "
                             f"({self.max_loras_per_batch})")
        if (self.enable_lora or self.lora_paths) and self.speculative_algorithm:
            raise ValueError("--enable-lora / --lora-paths cannot be combined with --speculative-algorithm")
        from sglang.srt.speculative.args import check_speculative_args

        check_speculative_args(self)

    def use_jump_forward(self) -> bool:
        """Jump-forward decoding of constrained requests: off unless --enable-jump-forward. It speeds up a lone
        request but slows concurrent batches (benchmarks/RESULTS.md), so serving keeps it off by default."""
        return self.enable_jump_forward and not self.disable_jump_forward

    def not_applicable_settings(self) -> dict[str, Any]:
        """Flags set away from their default that have no effect on this engine."""
        defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
        return {k: getattr(self, k) for k in NOT_APPLICABLE_FLAGS if getattr(self, k) != defaults[k]}

    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_server_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


SCHEDULE_POLICIES = ("lpm", "fcfs", "random", "dfs-weight", "lof")

# Names that upstream accepts for the same flag.
_ALIASES = {
    "model_path": ["--model"],
    "tp_size": ["--tensor-parallel-size"],
    "dp_size": ["--data-parallel-size"],
    "pp_size": ["--pipeline-parallel-size"],
}
_CHOICES = {
    "dtype": ["auto", "half", "float16", "bfloat16", "bf16", "float", "float32"],
    "cpu_gemm": ["auto", "float32", "bfloat16", "int8"],
    "gguf_activations": ["auto", "float32", "int8"],
    "small_batch_quantization": ["auto", "none", "q8_0", "q4_1"],
    "large_batch_weights": ["auto", "blocks", "dense"],
    "prefill_attention": ["auto", "float32", "bfloat16"],
    "tokenizer_mode": ["auto", "slow"],
    "schedule_policy": list(SCHEDULE_POLICIES),
    "grammar_backend": ["xgrammar", "outlines", "llguidance", "none"],
    "log_level": ["debug", "info", "warning", "error", "critical"],
    "load_balance_method": ["round_robin", "shortest_queue", "cache_aware", "minimum_tokens"],
}
_CHOICES["speculative_ngram_match_type"] = ["BFS", "PROB"]
_CHOICES["lora_eviction_policy"] = ["lru", "fifo"]
_HELP = SPECULATIVE_HELP


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field; defaults come from the dataclass."""
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + _ALIASES.get(f.name, [])
        default = f.default if f.default is not dataclasses.MISSING else None
        type_str = str(f.type)
        if type_str == "bool":
            parser.add_argument(*names, dest=f.name, action="store_true", default=default)
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if "list" in type_str:
            kwargs["nargs"] = "*"
            kwargs["type"] = str
        elif "int" in type_str:
            kwargs["type"] = int
        elif "float" in type_str:
            kwargs["type"] = float
        elif "bool" in type_str:
            kwargs["type"] = lambda s: s.lower() in ("1", "true", "yes")
        else:
            kwargs["type"] = str
        if f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        if f.name in _HELP:
            kwargs["help"] = _HELP[f.name]
        parser.add_argument(*names, **kwargs)


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    add_server_args(parser)
    args = parser.parse_args(argv)
    return ServerArgs.from_cli_args(args)


@dataclass
class PortArgs:
    """ZMQ endpoints connecting the three processes."""

    tokenizer_ipc_name: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str
    # The private folder holding the sockets; removed when the server stops (Subprocesses.shutdown).
    ipc_dir: str = ""
    # Which data-parallel replica the scheduler on scheduler_input_ipc_name is (entrypoints/replicas.py).
    dp_rank: int = 0

    @staticmethod
    def init_new() -> PortArgs:
        import tempfile

        base = tempfile.mkdtemp(prefix="sglang-ipc-")
        return PortArgs(
            tokenizer_ipc_name=f"ipc://{os.path.join(base, 'tokenizer')}",
            scheduler_input_ipc_name=f"ipc://{os.path.join(base, 'scheduler')}",
            detokenizer_ipc_name=f"ipc://{os.path.join(base, 'detokenizer')}",
            ipc_dir=base,
        )

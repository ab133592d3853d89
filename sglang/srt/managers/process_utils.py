"""Helpers shared by the engine's child processes: logging, threads, parent-death watch, model facts."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def configure_logging(level: str, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{(' ' + prefix) if prefix else ''}] %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, datefmt="%Y-%m-%d %H:%M:%S", force=True)


def configure_child_process(server_args: ServerArgs, name: str) -> None:
    configure_logging(server_args.log_level, name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when children stop
    watch_parent()


def watch_parent(interval: float = 1.0) -> None:
    """Exit when the parent process dies, so no child outlives the server."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def load_tokenizer_for(server_args: ServerArgs):
    if server_args.skip_tokenizer_init:
        return None
    from sglang.srt.tokenizer_utils import get_tokenizer

    return get_tokenizer(server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code)


def load_model_info(server_args: ServerArgs) -> dict:
    """Facts every process needs about the model, computed once in the parent."""
    from transformers import AutoConfig, GenerationConfig

    from sglang.srt.model_loader.dtype import resolve_dtype
    from sglang.srt.model_loader.resolve import gguf_source_for, resolve_model_path

    model_dir = resolve_model_path(server_args.model_path)
    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=server_args.trust_remote_code)
    overrides = json.loads(server_args.json_model_override_args or "{}")
    for k, v in overrides.items():
        setattr(hf_config, k, v)
    context_len = server_args.context_length or _config_context_len(hf_config)
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = resolve_dtype(server_args.dtype, server_args.device, config_dtype)
    eos = _as_list(getattr(hf_config, "eos_token_id", None))
    generation_defaults: dict = {}
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
        eos += _as_list(gen.eos_token_id)
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            val = getattr(gen, key, None)
            if val is not None and key in (gen.to_diff_dict() or {}):
                generation_defaults[key] = val
    except (OSError, ValueError):
        pass
    return {
        "model_dir": model_dir,
        "gguf_path": gguf_source_for(server_args.model_path),
        "hf_config": hf_config,
        "dtype": dtype,
        "context_len": context_len,
        "eos_token_ids": sorted(set(eos)),
        "generation_defaults": generation_defaults,
    }


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, (list, tuple, set)) else [int(x)]


def _config_context_len(hf_config) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        val = getattr(hf_config, key, None)
        if val:
            return int(val)
    return 2048

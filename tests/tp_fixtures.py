"""Helpers of the tensor-parallel tests: tiny models, prompts, and two loopback "nodes" of one server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import requests
import torch

from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process

FLOAT32 = dict(dtype="float32", cpu_gemm="float32", max_total_tokens=2048, random_seed=0)
FLOAT32_FLAGS = ["--dtype", "float32", "--cpu-gemm", "float32", "--max-total-tokens", "2048"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
DIST_TIMEOUT_S = 10


def tiny_model(path, tokenizer, family: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": 32} if family == "qwen3" else {}
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
        rms_norm_eps=1e-6, tie_word_embeddings=family == "llama", eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if family == "qwen2":
        with torch.no_grad():  # random q/k/v biases prove each rank adds its own slice of them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def prompt_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.resolve import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


PROMPT_IDS = prompt_ids()


def server_texts(base_url: str) -> list[str]:
    texts = []
    for prompt_ids in PROMPT_IDS:
        r = requests.post(f"{base_url}/generate", json={"input_ids": prompt_ids, "sampling_params": GREEDY},
                          timeout=60)
        r.raise_for_status()
        texts.append(r.json()["text"])
    return texts


_LOG_DIR = tempfile.mkdtemp(prefix="sglang-tp-test-")


@pytest.fixture(scope="module", autouse=True)
def remove_logs():
    """Import into a test module that starts nodes: their logs go when the module is done."""
    yield
    shutil.rmtree(_LOG_DIR, ignore_errors=True)


def log_file() -> str:
    """A server log that survives the test only as long as the module (print it to debug a failure)."""
    os.makedirs(_LOG_DIR, exist_ok=True)
    return tempfile.NamedTemporaryFile(dir=_LOG_DIR, suffix=".log", delete=False).name


def start_node(model: str, node_rank: int, init_port: int, log: str, env: dict[str, str] | None = None
               ) -> subprocess.Popen:
    """A node other than 0: scheduler ranks only, no HTTP server."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--tp-size", "2", "--nnodes", "2",
           "--node-rank", str(node_rank), "--dist-init-addr", f"127.0.0.1:{init_port}",
           "--dist-timeout", str(DIST_TIMEOUT_S), *FLOAT32_FLAGS]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def start_two_nodes(model: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """Node 1, then node 0 with the HTTP server; `env` for both (killed_process_env where a test kills one)."""
    init_port, http_port = find_free_port(), find_free_port()
    node1 = start_node(model, 1, init_port, log_file(), env)
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        node0 = popen_launch_server(
            model, base_url, timeout=120, log_path=log_file(),
            other_args=["--tp-size", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
                        f"127.0.0.1:{init_port}", "--dist-timeout", str(DIST_TIMEOUT_S), *FLOAT32_FLAGS],
            env=env,
        )
    except BaseException:
        terminate_process(node1)
        raise
    return node0, node1, base_url



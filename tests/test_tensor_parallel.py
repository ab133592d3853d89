"""Tensor parallelism end to end: TP=2 greedy outputs equal TP=1 token for token (Engine and server), two
"nodes" on loopback equal one node, a dead node ends the other, and unsplittable models are refused.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import requests
import torch

from sglang import Engine
from sglang.test.test_utils import find_free_port, popen_launch_server
from sglang.utils import terminate_process

pytestmark = pytest.mark.tensor_parallel

FLOAT32 = dict(dtype="float32", cpu_gemm="float32", max_total_tokens=2048, random_seed=0)
FLOAT32_FLAGS = ["--dtype", "float32", "--cpu-gemm", "float32", "--max-total-tokens", "2048"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
DIST_TIMEOUT_S = 10


def _tiny_model(path, tokenizer, family: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": 32} if family == "qwen3" else {}
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
        rms_norm_eps=1e-6, tie_word_embeddings=family == "llama", eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if family == "qwen2":
        with torch.no_grad():  # random q/k/v biases prove each rank adds its own slice of them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    return {family: _tiny_model(tmp_path_factory.mktemp(f"tp-{family}"), smollm2_tokenizer, family)
            for family in ("llama", "qwen2", "qwen3")}


def _engine_texts(model: str, tp_size: int) -> list[str]:
    engine = Engine(model_path=model, tp_size=tp_size, **FLOAT32)
    try:
        return [out["text"] for out in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tp1_texts(tiny_models) -> dict[str, list[str]]:
    return {family: _engine_texts(path, 1) for family, path in tiny_models.items()}


def _server_texts(base_url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        r = requests.post(f"{base_url}/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
        r.raise_for_status()
        texts.append(r.json()["text"])
    return texts


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_tp2_equals_tp1(tiny_models, tp1_texts, family):
    texts = _engine_texts(tiny_models[family], 2)
    assert all(texts)
    assert texts == tp1_texts[family]


_LOG_DIR = tempfile.mkdtemp(prefix="sglang-tp-test-")


@pytest.fixture(scope="module", autouse=True)
def _remove_logs():
    yield
    shutil.rmtree(_LOG_DIR, ignore_errors=True)


def _log_file() -> str:
    """A server log that survives the test only as long as the module (print it to debug a failure)."""
    return tempfile.NamedTemporaryFile(dir=_LOG_DIR, suffix=".log", delete=False).name


def _start_node(model: str, node_rank: int, init_port: int, log: str) -> subprocess.Popen:
    """A node other than 0: scheduler ranks only, no HTTP server."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--tp-size", "2", "--nnodes", "2",
           "--node-rank", str(node_rank), "--dist-init-addr", f"127.0.0.1:{init_port}",
           "--dist-timeout", str(DIST_TIMEOUT_S), *FLOAT32_FLAGS]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _start_two_nodes(model: str) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    init_port, http_port = find_free_port(), find_free_port()
    node1 = _start_node(model, 1, init_port, _log_file())
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        node0 = popen_launch_server(
            model, base_url, timeout=120, log_path=_log_file(),
            other_args=["--tp-size", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
                        f"127.0.0.1:{init_port}", "--dist-timeout", str(DIST_TIMEOUT_S), *FLOAT32_FLAGS],
        )
    except BaseException:
        terminate_process(node1)
        raise
    return node0, node1, base_url


def test_server_tp2_and_two_nodes_equal_tp1_and_a_dead_node_1_stops_node_0(tiny_models, tp1_texts):
    model = tiny_models["llama"]
    port = find_free_port()
    one_node = popen_launch_server(model, f"http://127.0.0.1:{port}", timeout=120, log_path=_log_file(),
                                   other_args=["--tp-size", "2", *FLOAT32_FLAGS])
    try:
        assert _server_texts(f"http://127.0.0.1:{port}") == tp1_texts["llama"]
    finally:
        terminate_process(one_node)

    node0, node1, base_url = _start_two_nodes(model)
    try:
        assert _server_texts(base_url) == tp1_texts["llama"]
        node1.kill()  # its ranks follow it (they watch their parent); node 0's rank 0 loses its group
        start = time.monotonic()
        code = node0.wait(timeout=DIST_TIMEOUT_S + 20)
        assert code != 0
        assert time.monotonic() - start < DIST_TIMEOUT_S + 20
    finally:
        terminate_process(node0)
        terminate_process(node1)


def test_a_dead_node_0_stops_node_1(tiny_models):
    node0, node1, base_url = _start_two_nodes(tiny_models["llama"])
    try:
        node0.kill()
        code = node1.wait(timeout=DIST_TIMEOUT_S + 20)
        assert code != 0
    finally:
        terminate_process(node0)
        terminate_process(node1)


def test_smollm2_tp3_equals_tp1_and_tp2_is_refused(smollm2_dir):
    # SmolLM2-135M has 9 attention heads and 3 K/V heads: 3 ranks split them, 2 cannot.
    with pytest.raises(ValueError, match=r"--tp-size 2 does not divide the model's attention heads \(9\)"):
        Engine(model_path=smollm2_dir, tp_size=2, **FLOAT32)
    # The dense float32 path on both sides (no GGUF blocks) so that the same arithmetic runs sharded or not.
    expected = _smollm2_texts(smollm2_dir, 1)
    assert _smollm2_texts(smollm2_dir, 3) == expected


def _smollm2_texts(model: str, tp_size: int) -> list[str]:
    engine = Engine(model_path=model, tp_size=tp_size, gguf_kernel_max_rows=0, **FLOAT32)
    try:
        return [out["text"] for out in engine.generate(PROMPTS[:2], {**GREEDY, "max_new_tokens": 8})]
    finally:
        engine.shutdown()


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

"""The arithmetic plan end to end on SmolLM2: a float32 model whose prefills run the bf16 GEMM while its decode
steps run the GGUF blocks / the fused step, on one float32 KV cache, keeps transformers' float32 greedy tokens;
the plan is reported by get_server_info and over HTTP."""

from __future__ import annotations

import pytest
import requests
from server_fixtures import running_server
from test_engine_greedy import GREEDY, PROMPTS, generate_ids, many_prompts, reference  # noqa: F401

from sglang import Engine
from tests.conftest import SMOLLM2


@pytest.fixture(scope="module")
def bf16_engine():
    # --cpu-gemm bfloat16 forces the bf16 large-batch path on any CPU (emulated, slower, where it has no bf16).
    eng = Engine(model_path=SMOLLM2, cpu_gemm="bfloat16")
    yield eng
    eng.shutdown()


def test_bf16_prefill_then_quantized_decode_keeps_greedy_tokens(bf16_engine, reference):  # noqa: F811
    info = bf16_engine.get_server_info()
    assert info["arithmetic"]["weight_dtype"] == "float32"
    assert info["arithmetic"]["kv_cache_dtype"] == "float32"
    assert info["arithmetic"]["large_batch_gemm"] == "bfloat16"
    assert info["cpu_gemm"] == "bfloat16"
    # One batch of 16 prompts: a prefill of hundreds of rows (bf16 GEMM), then decode batches of 16 rows.
    prompts = many_prompts(16)
    assert generate_ids(bf16_engine, prompts) == reference(prompts)
    # One at a time: the long prompt exceeds the small-batch row limit, the short one does not.
    singles = [PROMPTS[0], PROMPTS[4]]
    for prompt, expected in zip(singles, reference(singles)):
        assert bf16_engine.generate(prompt=prompt, sampling_params=GREEDY)["output_ids"] == expected, prompt


def test_server_reports_plan():
    with running_server("--cpu-gemm", "float32") as url:
        info = requests.get(f"{url}/get_server_info", timeout=30).json()
    assert info["arithmetic"]["large_batch_gemm"] == "float32"
    assert info["arithmetic"]["reason"] == "--cpu-gemm float32"
    assert info["arithmetic"]["weight_dtype"] == "float32"

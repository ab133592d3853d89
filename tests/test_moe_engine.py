"""MoE checkpoints through the normal serving path: greedy generation through `sglang.Engine` and a test server
equals transformers' greedy `generate`, and /get_model_info names the architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from sglang import Engine
from sglang.srt.model_loader.resolve import resolve_model_path
from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST
from tests.server_fixtures import running_server
from tests.test_moe_models import tiny_moe_config

PROMPTS = ["The capital of France is", "Experts route tokens: one, two,"]
MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
ARCHITECTURES = {"qwen2_moe-mlp-only": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))


def save_tiny_moe(family: str, directory: Path, tokenizer):
    """A random MoE checkpoint with the SmolLM2 tokenizer; returns the transformers model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family, vocab_size=len(tokenizer))).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_engine_greedy_generation_equals_transformers(tmp_path, tokenizer, family):
    model = save_tiny_moe(family, tmp_path, tokenizer)
    expected = [hf_greedy(model, tokenizer, p) for p in PROMPTS]
    assert all(len(set(ids)) > 2 for ids in expected)  # not a degenerate repetition
    engine = Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=2048)
    try:
        # Both prompts in one call: their tokens share the prefill and decode batches, and so the experts.
        outputs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in outputs] == expected


def test_server_greedy_generation_and_model_info(tmp_path, tokenizer):
    family = "qwen2_moe-mlp-only"  # shared expert, and a dense layer among the sparse ones
    model = save_tiny_moe(family, tmp_path, tokenizer)
    expected = [hf_greedy(model, tokenizer, p) for p in PROMPTS]
    with running_server("--dtype", "float32", "--max-total-tokens", "2048", model=str(tmp_path)) as url:
        info = requests.get(f"{url}/get_model_info", timeout=10).json()
        assert info["model_type"] == "qwen2_moe"
        assert info["architectures"] == [ARCHITECTURES[family]]
        response = requests.post(f"{url}/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=60)
        assert response.status_code == 200, response.text
    assert [o["output_ids"] for o in response.json()] == expected

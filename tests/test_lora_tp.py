"""Multi-LoRA under tensor parallelism: with --tp-size 2 each rank keeps its slice of every adapter (lora_B's rows of
its q/k/v and gate/up rows, lora_A's columns of its o_proj and down_proj input), and a batch mixing two adapters
and the base model gives the TP=1 engine's greedy tokens and logprobs. An adapter loaded live reaches both ranks,
and with --max-loaded-loras below the adapters served, evicted adapters come back on both.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from sglang import Engine
from tests.test_lora import write_adapter
from tests.tp_fixtures import FLOAT32, GREEDY, PROMPT_IDS, tiny_model

pytestmark = pytest.mark.tensor_parallel

LOGPROB_TOL = 1e-4
MIXED = ["a", "b", None]  # one adapter per prompt of PROMPT_IDS, the last the base model
GEN = dict(sampling_params=GREEDY, return_logprob=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_adapters(request, tmp_path_factory, smollm2_tokenizer) -> tuple[str, dict[str, str]]:
    """A tiny random model (Qwen2: with q/k/v biases) and three adapters of different ranks and modules."""
    root = tmp_path_factory.mktemp(f"lora-tp-{request.param}")
    model = tiny_model(root / "model", smollm2_tokenizer, request.param)
    config = AutoConfig.from_pretrained(model)
    adapters = {
        "a": write_adapter(root / "a", config, modules=("q_proj", "v_proj", "o_proj", "down_proj"), rank=4, seed=1),
        "b": write_adapter(root / "b", config, modules=("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                           rank=8, alpha=16.0, seed=2),
        "c": write_adapter(root / "c", config, rank=8, seed=3, rslora=True),
    }
    return model, adapters


def tokens(outputs: list[dict]) -> list[list[tuple[int, float]]]:
    return [[(token, logprob) for logprob, token, _ in out["meta_info"]["output_token_logprobs"]]
            for out in outputs]


def assert_same(tp2: list[dict], tp1: list[dict]) -> None:
    got, expected = tokens(tp2), tokens(tp1)
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
    worst = max(abs(a - b) for g, e in zip(got, expected) for (_, a), (_, b) in zip(g, e))
    assert worst < LOGPROB_TOL, worst


@pytest.fixture(scope="module")
def tp1_outputs(model_and_adapters) -> dict[str, list[dict]]:
    model, adapters = model_and_adapters
    lora_paths = [f"{name}={path}" for name, path in adapters.items()]
    with Engine(model_path=model, enable_lora=True, lora_paths=lora_paths, **FLOAT32) as engine:
        return {"mixed": engine.generate(input_ids=PROMPT_IDS, lora_path=MIXED, **GEN),
                "c": engine.generate(input_ids=PROMPT_IDS[:2], lora_path=["c", "c"], **GEN)}


def test_tp2_mixed_adapters_and_live_load_equal_tp1(model_and_adapters, tp1_outputs):
    model, adapters = model_and_adapters
    mixed, only_c = tp1_outputs["mixed"], tp1_outputs["c"]
    # the adapters change the outputs, so equal outputs show each rank applied its slice of the right adapter
    assert len({tuple(row) for row in tokens(mixed)}) == 3
    assert tokens(only_c)[0] != tokens(mixed)[0] and tokens(only_c)[1] != tokens(mixed)[1]

    lora_paths = [f"a={adapters['a']}", f"b={adapters['b']}"]
    with Engine(model_path=model, tp_size=2, enable_lora=True, lora_paths=lora_paths, max_loras_per_batch=2,
                max_loaded_loras=2, **FLOAT32) as engine:
        assert_same(engine.generate(input_ids=PROMPT_IDS, lora_path=MIXED, **GEN), mixed)

        bad = engine.load_lora_adapter("bad", adapters["c"] + "-missing")
        assert not bad["success"] and "c-missing" in bad["error_message"]
        loaded = engine.load_lora_adapter("c", adapters["c"])
        assert loaded["success"] and set(loaded["loaded_adapters"]) == {"a", "b", "c"}
        # the pool holds two: "c" evicts "a" on both ranks, then "a" comes back evicting "c"
        assert_same(engine.generate(input_ids=PROMPT_IDS[:2], lora_path=["c", "c"], **GEN), only_c)
        assert_same(engine.generate(input_ids=PROMPT_IDS, lora_path=MIXED, **GEN), mixed)

        assert engine.unload_lora_adapter("c")["loaded_adapters"] == {"a": adapters["a"], "b": adapters["b"]}
        again = engine.load_lora_adapter("c", adapters["c"])  # the name is free again on every rank
        assert again["success"], again
        assert_same(engine.generate(input_ids=PROMPT_IDS[:2], lora_path=["c", "c"], **GEN), only_c)

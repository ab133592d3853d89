"""Weight updates inside the model runner: derived fast paths (GGUF blocks, bf16 copies, the fused decode step)
are rebuilt for the new weights or dropped, never left pointing at the old ones; failures leave the runner as it
was."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.arithmetic import ArithmeticPlan
from sglang.srt.layers.bf16_linear import BF16LinearMethod
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.mem_cache.memory_pools import build_memory_pools
from sglang.srt.model_executor.fused_cpu_decode import available as fused_available
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.weight_update import (
    WeightUpdateError,
    checkpoint_tensor,
    replace_weights,
    weights_by_name,
)
from sglang.srt.model_loader.resolve import gguf_source_for
from tests.conftest import SMOLLM2
from tests.weight_checkpoints import PERTURBED_PARAM, build_perturbed_smollm2, build_tiny_llama


@pytest.fixture(scope="module")
def checkpoints(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    build_perturbed_smollm2(smollm2_dir, root / "perturbed")
    build_tiny_llama(smollm2_dir, root / "tiny")
    return root


@pytest.fixture(scope="module")
def runner_and_pool(smollm2_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    # bf16 copies for large batches whatever the CPU, so their rebuild is checked on every machine.
    plan = ArithmeticPlan("cpu", "test", torch.float32, "bfloat16", "test")
    runner = ModelRunner(smollm2_dir, config, torch.float32, "cpu", gguf_path=gguf_source_for(SMOLLM2),
                         gguf_kernel_max_rows=64, arithmetic=plan)
    mem = build_memory_pools(runner.kv_cache_spec(), runner.device, 512, 512, 0.5, 4, False)
    runner.bind_kv_pool(mem.kv_pool)
    return runner, mem.kv_pool


def _methods(runner):
    from sglang.srt.layers.linear import Linear

    return [m.linear_method for m in runner.model.modules() if isinstance(m, Linear)]


def _assert_bf16_copies_match(runner) -> None:
    from sglang.srt.layers.linear import Linear

    for module in runner.model.modules():
        if isinstance(module, Linear):
            method = module.linear_method
            large = method.large if isinstance(method, GGUFLinearMethod) else method
            assert isinstance(large, BF16LinearMethod)
            assert torch.equal(large.dense_weight(), module.weight.to(torch.bfloat16))


def test_update_rebuilds_or_drops_every_fast_path(runner_and_pool, checkpoints, smollm2_dir):
    runner, kv_pool = runner_and_pool
    original_q = checkpoint_tensor(runner.model, PERTURBED_PARAM).clone()
    gguf_on = all(isinstance(m, GGUFLinearMethod) for m in _methods(runner))
    if gguf_on and fused_available():
        assert runner.decode_plan is not None and runner.decode_plan.fused is not None
    _assert_bf16_copies_match(runner)

    replace_weights(runner, kv_pool, str(checkpoints / "perturbed"), None)
    # A safetensors checkpoint has no GGUF blocks: every layer drops them, and so does the fused step.
    assert not any(isinstance(m, GGUFLinearMethod) for m in _methods(runner))
    assert runner.decode_plan is not None and runner.decode_plan.fused is None
    assert runner.decode_plan.description.startswith("Decode path: every batch layer by layer")
    _assert_bf16_copies_match(runner)
    from safetensors.torch import load_file

    saved = load_file(str(checkpoints / "perturbed" / "model.safetensors"))
    assert torch.equal(checkpoint_tensor(runner.model, PERTURBED_PARAM), saved[PERTURBED_PARAM])
    assert not torch.equal(saved[PERTURBED_PARAM], original_q)

    replace_weights(runner, kv_pool, SMOLLM2, "auto")
    assert torch.equal(checkpoint_tensor(runner.model, PERTURBED_PARAM), original_q)
    assert all(isinstance(m, GGUFLinearMethod) for m in _methods(runner)) == gguf_on
    if gguf_on and fused_available():
        assert runner.decode_plan.fused is not None
        assert runner.decode_plan.description.startswith("Decode path: batches of 1-64 sequences run the fused")
    _assert_bf16_copies_match(runner)


def test_update_moves_the_new_weights_to_huge_pages(runner_and_pool, checkpoints, monkeypatch):
    from sglang import huge_pages

    if huge_pages.why_not_huge() is not None:
        pytest.skip(huge_pages.why_not_huge())
    runner, kv_pool = runner_and_pool
    monkeypatch.setenv(huge_pages.ENV, "1")  # SmolLM2-135M is under the size moved by default
    replace_weights(runner, kv_pool, str(checkpoints / "perturbed"), None)
    try:
        large = [p for p in runner.model.parameters() if p.untyped_storage().nbytes() >= huge_pages.MIN_BYTES]
        assert large and len({p.untyped_storage().data_ptr() for p in large}) == 1  # all in the one mapping
        from safetensors.torch import load_file

        saved = load_file(str(checkpoints / "perturbed" / "model.safetensors"))
        assert torch.equal(checkpoint_tensor(runner.model, PERTURBED_PARAM), saved[PERTURBED_PARAM])
    finally:
        replace_weights(runner, kv_pool, SMOLLM2, "auto")


def test_failed_updates_leave_the_runner_untouched(runner_and_pool, checkpoints, tmp_path):
    runner, kv_pool = runner_and_pool
    model, plan = runner.model, runner.decode_plan
    before = checkpoint_tensor(model, PERTURBED_PARAM).clone()
    with pytest.raises(WeightUpdateError) as err:
        replace_weights(runner, kv_pool, "HuggingFaceTB/SmolLM2-135M-Instruct-wrong", None)
    assert str(err.value) == ("Failed to get weights iterator: HuggingFaceTB/SmolLM2-135M-Instruct-wrong "
                              "(repository not found).")
    with pytest.raises(WeightUpdateError, match="repository not found"):
        replace_weights(runner, kv_pool, str(tmp_path), None)  # a directory without weights
    with pytest.raises(WeightUpdateError) as err:
        replace_weights(runner, kv_pool, str(checkpoints / "tiny"), None)
    message = str(err.value)
    assert message.startswith("Failed to update weights: Checkpoint weight ")
    assert message.endswith(".\nRolling back to original weights.")
    with pytest.raises(WeightUpdateError, match="^Failed to get model loader: load format 'dummy'"):
        replace_weights(runner, kv_pool, str(checkpoints / "perturbed"), "dummy")
    with pytest.raises(WeightUpdateError, match="^Failed to get model loader: load format 'gguf' does not match"):
        replace_weights(runner, kv_pool, str(checkpoints / "perturbed"), "gguf")
    assert runner.model is model and runner.decode_plan is plan
    assert torch.equal(checkpoint_tensor(runner.model, PERTURBED_PARAM), before)


def test_weights_by_name_slices_fused_projections(runner_and_pool, smollm2_dir):
    runner, _ = runner_and_pool
    from safetensors import safe_open

    from sglang.srt.model_loader.weights import weight_files

    with safe_open(str(weight_files(smollm2_dir)[0]), framework="pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.v_proj.weight",
                     "model.layers.1.mlp.up_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
            stored = f.get_tensor(name)
            got = weights_by_name(runner.model, name, 5)
            assert torch.equal(torch.tensor(got), stored[:5].float()), name
    assert len(weights_by_name(runner.model, "lm_head.weight", 2)) == 2  # tied to the embeddings
    with pytest.raises(KeyError, match="not found"):
        checkpoint_tensor(runner.model, "model.layers.0.self_attn.nope.weight")

"""The arithmetic plan end to end on SmolLM2: a float32 model whose prefills run the bf16 GEMM while its decode
steps run the GGUF blocks / the fused step, on one float32 KV cache, keeps transformers' float32 greedy tokens;
the plan is reported by get_server_info and over HTTP."""

from __future__ import annotations

import pytest
import requests
import torch
from server_fixtures import running_server

from sglang import Engine
from sglang.srt.layers import cpu_ops
from sglang.srt.layers.arithmetic import choose_arithmetic
from sglang.srt.layers.cpu_classes import BF16_DOT_FLAGS, VNNI_FLAGS
from sglang.srt.model_loader.dtype import read_cpu_flags
from tests.conftest import SMOLLM2
from tests.greedy_cases import BF16_MARGIN, GREEDY, PROMPTS, assert_same_or_near_tie, generate_ids, many_prompts

# How far the int8 GEMM (the 64 largest input columns kept apart) may move a log-probability of SmolLM2's prefill:
# 0.11 measured against transformers on 22 prompts (0.08 against the float32 plan), 0.37 with per-token int8
# alone; bf16 GEMMs move logits by up to ~0.2.
INT8_PREFILL_TOL = 0.2


@pytest.fixture(scope="module")
def bf16_engine():
    # --cpu-gemm bfloat16 forces the bf16 large-batch path on any CPU (emulated, slower, where it has no bf16).
    eng = Engine(model_path=SMOLLM2, cpu_gemm="bfloat16")
    yield eng
    eng.shutdown()


def test_bf16_prefill_then_quantized_decode_keeps_greedy_tokens(bf16_engine, reference, smollm2_hf, smollm2_tokenizer):
    info = bf16_engine.get_server_info()
    assert info["arithmetic"]["weight_dtype"] == "float32"
    assert info["arithmetic"]["kv_cache_dtype"] == "float32"
    assert info["arithmetic"]["large_batch_gemm"] == "bfloat16"
    # The row limit above which the bf16 GEMM takes over depends on the CPU class (64 with AVX512-BF16 or on AVX2,
    # 32 with AMX): the server reports what the plan gives for this machine's flags.
    expected = choose_arithmetic("cpu", "auto", "bfloat16", read_cpu_flags())
    rows = expected.small_batch_max_rows
    assert info["arithmetic"]["small_batch_max_rows"] == rows
    assert info["arithmetic"]["cpu_class"] == expected.cpu_class
    assert info["cpu_gemm"] == "bfloat16"
    assert [s["dp_rank"] for s in info["internal_states"]] == [0]
    # Decode batches quantize their activations to int8 where the CPU has AVX512-VNNI (float32 elsewhere).
    vnni = VNNI_FLAGS <= read_cpu_flags()
    assert info["arithmetic"]["gguf_activations"] == ("int8" if vnni else "float32")
    # One batch of 16 prompts: a prefill of hundreds of rows (bf16 GEMM), then decode batches of 16 rows. Some of
    # these prompts are near-ties for float32 transformers (prompt 3: its top two first tokens 0.011 apart) that
    # bf16 rounding may resolve either way (alone it makes them an exact tie), so a divergence is accepted only
    # where the reference's own margin is within the bf16 tolerance.
    prompts = many_prompts(16)
    for prompt, ours, expected in zip(prompts, generate_ids(bf16_engine, prompts), reference(prompts)):
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected, BF16_MARGIN)
    # One at a time: a prompt of more rows than the small-batch limit is prefilled by the bf16 GEMM, a short one
    # by the quantized blocks; both then decode on the blocks.
    long_prompt = " ".join(PROMPTS[1:] * 2)
    short_prompt = next(p for p in PROMPTS if len(smollm2_tokenizer.encode(p)) < rows)
    assert len(smollm2_tokenizer.encode(long_prompt)) > rows
    singles = [short_prompt, long_prompt]
    for prompt, expected in zip(singles, reference(singles)):
        ours = bf16_engine.generate(prompt=prompt, sampling_params=GREEDY)["output_ids"]
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected, BF16_MARGIN)


def test_server_reports_plan():
    with running_server("--cpu-gemm", "float32", "--gguf-kernel-max-rows", "16", "--prefill-attention",
                        "float32") as url:
        info = requests.get(f"{url}/get_server_info", timeout=30).json()
    assert info["arithmetic"]["large_batch_gemm"] == "float32"
    assert info["arithmetic"]["small_batch_max_rows"] == 16  # the flag overrides the plan's 64
    assert info["arithmetic"]["reason"] == "--cpu-gemm float32"
    assert info["arithmetic"]["weight_dtype"] == "float32"
    assert info["arithmetic"]["gguf_activations"] == "float32"  # --cpu-gemm float32: float32 throughout
    assert info["arithmetic"]["gguf_activations_reason"] == "--cpu-gemm float32 asks for float32 arithmetic"
    assert info["arithmetic"]["prefill_attention"] == "float32"
    assert info["arithmetic"]["prefill_attention_reason"] == "--prefill-attention float32"


def test_bf16_prefill_attention_keeps_greedy_tokens(reference, smollm2_hf, smollm2_tokenizer):
    """bf16 K/V with bf16 GEMMs: where the CPU has AVX512-BF16, prefill attention multiplies with bf16 dot products
    (the plan reports it); greedy tokens stay transformers' float32 choices up to near-ties, and a prompt that extends
    a cached one (its new tokens attend over cached bf16 K/V) gives the same output each time."""
    native = BF16_DOT_FLAGS <= read_cpu_flags() and cpu_ops.has_extend_attention_bf16()
    with Engine(model_path=SMOLLM2, cpu_gemm="bfloat16", kv_cache_dtype="bfloat16") as eng:
        info = eng.get_server_info()
        assert info["arithmetic"]["prefill_attention"] == ("bfloat16" if native else "float32")
        prompts = many_prompts(8)
        for prompt, ours, expected in zip(prompts, generate_ids(eng, prompts), reference(prompts)):
            assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected, BF16_MARGIN)
        long_prompt = " ".join(PROMPTS[1:] * 3)
        first = eng.generate(prompt=long_prompt, sampling_params=GREEDY)
        again = eng.generate(prompt=long_prompt + " Then", sampling_params=GREEDY)
        fresh = eng.generate(prompt=long_prompt + " Then", sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] > 0 and fresh["output_ids"] == again["output_ids"]
        (expected,) = reference([long_prompt])
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, long_prompt, first["output_ids"], expected,
                                BF16_MARGIN)


def test_int8_prefill_within_bf16_tolerance(smollm2_hf, smollm2_tokenizer):
    """`--cpu-gemm int8`: prefills multiply per-token int8 activations (the 64 largest input columns kept apart) by
    per-channel int8 weights (decode steps run the GGUF blocks). A prefill's log-probabilities stay within the bf16
    tolerance of float32 transformers' (per-token int8 alone moved them by ~0.4). K/V are bf16, as in the plan a
    startup measurement makes when it picks int8 (--dtype auto: layers/arithmetic.py)."""
    with Engine(model_path=SMOLLM2, cpu_gemm="int8", kv_cache_dtype="bfloat16") as eng:
        info = eng.get_server_info()
        assert (info["arithmetic"]["large_batch_gemm"], info["arithmetic"]["kv_cache_dtype"]) == ("int8", "bfloat16")
        # The first token's log-probabilities come from the prefill alone (one batch of 22 prompts: int8 GEMMs;
        # emulated, slowly, on a CPU without VNNI).
        prompts = many_prompts(16) + PROMPTS
        firsts = eng.generate(prompt=prompts, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                              top_logprobs_num=5)
        worst = 0.0
        for prompt, first in zip(prompts, firsts):
            with torch.no_grad():
                expected = smollm2_hf(torch.tensor([smollm2_tokenizer.encode(prompt)])).logits[0, -1].log_softmax(-1)
            ours = {token: logprob for logprob, token, *_ in first["meta_info"]["output_top_logprobs"][0]}
            top = int(expected.argmax())
            assert top in ours, prompt
            worst = max(worst, abs(ours[top] - float(expected[top])))
        print(f"int8 prefill: largest change of transformers' first-token log-probability {worst:.3f}")
        assert worst < INT8_PREFILL_TOL, worst

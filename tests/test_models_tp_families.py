"""Tensor parallelism for the sliding-window families: Gemma 3 (text), Phi-3 (fused qkv_proj / gate_up_proj in the
checkpoint, each rank loading its heads' q/k/v rows and its slice of gate and up), Gemma 2 (soft-capping) and
Mistral, OLMo 2 (q/k norms over all heads, their sums of squares added up over the ranks), and for the
mixture-of-experts families, DeepSeek-V2 (multi-head latent attention split by heads, the
latent cached whole on each rank; routed experts split over their intermediate size, shared experts and the dense
layer as MLPs), Qwen2-MoE (gated shared expert), Mixtral and GPT-OSS (sinks split with the heads, biased
q/k/v/o, a replicated router, biased experts with interleaved gate/up columns split in pairs), at TP=2 give the
TP=1 greedy tokens and logprobs on tiny random checkpoints, with prompts several windows long split into chunks.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang import Engine
from tests.decoder_variant_checks import tiny_variant_config
from tests.test_models_gemma_mistral import tiny_config

pytestmark = pytest.mark.tensor_parallel

WINDOW = 6
PROMPTS = [
    "The capital of France is a city that many people visit every single year because",
    "Count: one, two, three, four, five, six, seven, eight,",
    "def fibonacci(n):",
]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
TOP_LOGPROBS = 5
LOGPROB_TOL = 1e-4
ENGINE_ARGS = dict(dtype="float32", cpu_gemm="float32", max_total_tokens=1024, random_seed=0,
                   chunked_prefill_size=8, max_prefill_tokens=8)
FAMILIES = ["gemma3", "phi3", "gemma2", "mistral", "olmo2", "deepseek_v2", "qwen2_moe", "mixtral", "gpt_oss"]


def _config(family: str, vocab_size: int) -> Any:
    if family == "gpt_oss":
        from tests.test_models_gpt_oss import tiny_gpt_oss_config

        # Alternating sliding and full layers; an odd expert width, so the ranks hold 32 and 31 gate/up pairs.
        return tiny_gpt_oss_config(vocab_size=vocab_size, sliding_window=WINDOW, intermediate_size=63)
    if family == "deepseek_v2":
        from tests.test_models_deepseek_v2 import tiny_deepseek_config

        # q_proj without the low-rank query, as DeepSeek-V2-Lite has; an odd expert width (17 + 16 columns)
        return tiny_deepseek_config(None, vocab_size=vocab_size, moe_intermediate_size=33)
    if family == "olmo2":
        # q/k norms over all heads: each rank normalises its heads with the sum of squares over both ranks
        return tiny_variant_config("olmo2", vocab_size=vocab_size)
    if family in ("qwen2_moe", "mixtral"):
        from tests.test_moe_models import tiny_moe_config

        # Qwen2-MoE's gated shared expert beside the routed ones; Mixtral's w1/w3/w2 experts
        name = "qwen2_moe-mlp-only" if family == "qwen2_moe" else family
        return tiny_moe_config(name, vocab_size=vocab_size, sliding_window=None)
    if family == "phi3":
        # Partial rotary, LongRoPE (prompts past the original length) and a window over every layer; an odd MLP
        # width, so the ranks' gate and up slices differ in size (64 + 63 rows of each).
        return tiny_variant_config("phi3", vocab_size=vocab_size, sliding_window=WINDOW, intermediate_size=127)
    # Alternating sliding and global layers (Gemma), soft-capping (Gemma 2), Gemma 3's q/k norms and two RoPE
    # bases. Gemma 3 with one K/V head, as Gemma 3 1B has: both ranks hold it, each with half the query heads.
    # Untied: a random tied Gemma head mostly predicts the input token again (the embeddings are scaled by
    # sqrt(hidden)); the TP=2 head is then its own vocabulary-parallel matrix.
    kv_heads = 1 if family == "gemma3" else 2
    return tiny_config(family, vocab_size=vocab_size, sliding_window=WINDOW, num_key_value_heads=kv_heads,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module", params=FAMILIES)
def family_outputs(request, tmp_path_factory, smollm2_tokenizer) -> tuple[str, dict[int, list[dict]]]:
    """The family, and its outputs at TP=1 and TP=2: one Engine per size, stopped before the next starts."""
    from transformers import AutoModelForCausalLM

    family = request.param
    directory = tmp_path_factory.mktemp(f"tp-windows-{family}")
    torch.manual_seed(7)
    config = _config(family, len(smollm2_tokenizer))
    config.eos_token_id = smollm2_tokenizer.eos_token_id
    if family == "gpt_oss":
        from tests.test_models_gpt_oss import random_reference

        random_reference(config, seed=7).save_pretrained(directory)  # every bias and sink non-zero
    else:
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    smollm2_tokenizer.save_pretrained(directory)
    outputs = {}
    for tp_size in (1, 2):
        with Engine(model_path=str(directory), tp_size=tp_size, **ENGINE_ARGS) as engine:
            outputs[tp_size] = engine.generate(prompt=PROMPTS, sampling_params=GREEDY, return_logprob=True,
                                               logprob_start_len=0, top_logprobs_num=TOP_LOGPROBS)
    return family, outputs


def test_prompts_are_longer_than_the_window(smollm2_tokenizer):
    assert sum(len(smollm2_tokenizer.encode(p)) > 2 * WINDOW for p in PROMPTS) >= 2


def test_tp2_greedy_tokens_equal_tp1(family_outputs):
    family, outputs = family_outputs
    tp1, tp2 = ([o["output_ids"] for o in outputs[tp]] for tp in (1, 2))
    assert all(len(set(ids)) > 2 for ids in tp1), (family, tp1)  # not a degenerate repetition
    assert tp2 == tp1, family


def _logprobs(out: dict) -> tuple[list[tuple[int, float]], list[list[tuple[int, float]]]]:
    """(token id, logprob) of every prompt and output token, and the top logprobs at every output position."""
    meta = out["meta_info"]
    tokens = [(entry[1], entry[0]) for entry in meta["input_token_logprobs"] + meta["output_token_logprobs"]
              if entry[0] is not None]
    top = [[(entry[1], entry[0]) for entry in position] for position in meta["output_top_logprobs"]]
    return tokens, top


def _assert_close(tp2: list[tuple[int, float]], tp1: list[tuple[int, float]], what: str) -> None:
    assert [token for token, _ in tp2] == [token for token, _ in tp1], what
    diff = max(abs(a - b) for (_, a), (_, b) in zip(tp2, tp1))
    assert diff < LOGPROB_TOL, (what, diff)


def test_tp2_logprobs_equal_tp1(family_outputs):
    """The log-softmax of the logits at every prompt and output position, and the top tokens of each step."""
    family, outputs = family_outputs
    for i, (out1, out2) in enumerate(zip(outputs[1], outputs[2])):
        tokens1, top1 = _logprobs(out1)
        tokens2, top2 = _logprobs(out2)
        assert len(tokens1) == len(out1["output_ids"]) + out1["meta_info"]["prompt_tokens"] - 1
        _assert_close(tokens2, tokens1, f"{family} prompt {i} token logprobs")
        assert len(top1) == GREEDY["max_new_tokens"]
        for step, (a, b) in enumerate(zip(top2, top1)):
            assert len(b) == TOP_LOGPROBS
            _assert_close(a, b, f"{family} prompt {i} step {step} top logprobs")


def test_tp_support_check_accepts_them_and_refuses_ranks_without_heads():
    from sglang.srt.distributed.args import check_model_supports_tp

    for family in FAMILIES:
        check_model_supports_tp(_config(family, 512), 2)
    with pytest.raises(ValueError, match="--tp-size 8 leaves ranks without attention heads"):
        check_model_supports_tp(_config("gemma3", 512), 8)
    # OLMo 2's k norm spans every K/V head: no replicated K/V heads
    with pytest.raises(ValueError, match="OLMo 2 splits its 2 key/value heads"):
        check_model_supports_tp(tiny_variant_config("olmo2"), 4)


def test_gpt_oss_splits_that_do_not_fit_are_refused():
    """More ranks than GPT-OSS's experts have intermediate columns, or than it has query heads (4)."""
    from sglang.srt.distributed.args import check_model_supports_tp
    from tests.test_models_gpt_oss import tiny_gpt_oss_config

    with pytest.raises(ValueError, match=r"--tp-size 4 is larger than the model's GPT-OSS expert intermediate size "
                                         r"\(3\)"):
        check_model_supports_tp(tiny_gpt_oss_config(intermediate_size=3), 4)
    with pytest.raises(ValueError, match="--tp-size 8 leaves ranks without attention heads"):
        check_model_supports_tp(tiny_gpt_oss_config(), 8)
    check_model_supports_tp(tiny_gpt_oss_config(intermediate_size=4), 4)  # one gate/up pair per rank fits

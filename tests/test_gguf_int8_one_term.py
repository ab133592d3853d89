"""The one-term form of the GGUF kernels' int8 activations (csrc/gguf_int8_input.h).

Per tile of up to 8 rows, the outlier_columns(K) input columns of largest max |x| over the tile (at most 64, and
K / 8) are taken out of the blocks and multiplied in float32 against the weight blocks' own values there; every
other value is one int8 term per 32-value block, scaled by the block's remaining values. The kernels must equal, up
to float32 rounding, the float64 product of the dequantized weights with x rounded that way (emulated below), on the
AVX512-VNNI kernels where the CPU has them and on the portable loop everywhere (a subprocess that turns VNNI off).
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.quantization import gguf_blocks as gb  # noqa: E402
from tests.test_gguf_int8 import check_case as int8_check_case  # noqa: E402
from tests.test_gguf_int8 import decode_terms, inputs, portable_errors, quantizer_inputs  # noqa: E402
from tests.test_gguf_kernels import random_raw, reference_dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not gb.kernels_available(),
                                reason=f"GGUF kernels unavailable: {gb.kernels_unavailable_reason()}")

TILE = 8


def outlier_columns(x: torch.Tensor) -> torch.Tensor:
    """A tile's outlier columns: the min(64, K / 8) of largest max |x| (the lower index first among equal maxima)."""
    k = min(64, x.shape[1] // 8)
    return torch.sort(-x.abs().amax(0), stable=True).indices[:k]


def round_one_term(x: torch.Tensor) -> torch.Tensor:
    """x as the one-term kernels see it, float64: per tile, the outlier columns exact and every other value rounded
    to int8 per 32-value block with scale max|rest| / 127 (round half to even)."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for m0 in range(0, x.shape[0], TILE):
        tile = x[m0 : m0 + TILE]
        cols = outlier_columns(tile)
        blocks = tile.index_fill(1, cols, 0.0).reshape(tile.shape[0], -1, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        rounded = (torch.round(blocks * inv) * d).reshape(tile.shape).double()
        rounded[:, cols] = tile[:, cols].double()
        out[m0 : m0 + TILE] = rounded
    return out


def check_case(qtype: str, n: int, k: int, m: int) -> tuple[float, float]:
    """(error against the emulated rounding, error against float x), each relative to the output's norm."""
    return int8_check_case(qtype, n, k, m, one_term=True, emulate=round_one_term)


# N not a multiple of 16; K = 96 (12 columns taken out), 576 and 2,048 (64): a tile's columns span several blocks
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(40, 96), (1536, 576), (100, 2048)])
def test_one_term_kernels_equal_the_emulated_rounding(qtype, n, k):
    for m in (1, 5, 8, 13, 16):  # one tile, a partial tile, two tiles
        vs_emulated, vs_float = check_case(qtype, n, k, m)
        assert vs_emulated < 2e-6, (m, vs_emulated)
        assert vs_float < 6e-3, (m, vs_float)  # one int8 term: a bf16 GEMM's order of error, not 3e-5


def test_portable_one_term_loop_equals_the_emulated_rounding():
    for vs_emulated, vs_float in portable_errors("tests.test_gguf_int8_one_term", "[(40, 96), (24, 576)]", "(1, 13)"):
        assert vs_emulated < 2e-6 and vs_float < 6e-3


@pytest.mark.parametrize("q4", [True, False])
def test_one_term_quantizer_zeroes_the_outlier_columns_and_the_second_term(q4):
    """Each row is a tile of its own in int8_quantize: its 12 largest columns (K = 96) are zero in the words, the
    second term is zero with the usual scale d1 / 256, and d1 is set by the remaining values."""
    x = quantizer_inputs()
    words, dx, sx = gb.kernel_module().int8_quantize(x, q4, False, True)
    q = decode_terms(words, q4).to(torch.float32)
    for row in range(x.shape[0]):
        cols = outlier_columns(x[row : row + 1])
        assert not q[row, :, 0].reshape(-1)[cols].any()
        rest = x[row].index_fill(0, cols, 0.0).reshape(-1, 32)
        assert torch.equal(dx[row, :, 0], rest.abs().amax(-1) / 127)
    assert not q[:, :, 1].any() and torch.equal(dx[..., 1], dx[..., 0] / 256)
    assert torch.equal(sx, dx[..., 0] * q[:, :, 0].sum(-1))
    if gb.kernel_module().has_vector_quantize():
        vector = gb.kernel_module().int8_quantize(x, q4, True, True)
        for a, b in zip(vector, (words, dx, sx)):
            assert torch.equal(a, b)


def test_one_term_needs_int8_activations():
    weight = gb.GGUFQuantWeight("Q8_0", random_raw("Q8_0", 40, 96), 40, 96)
    with pytest.raises(RuntimeError, match="one_term needs int8"):
        weight.linear(torch.randn(3, 96), int8=False, one_term=True)


# ---------------------------------------------------------------------------------------------------------------------
# Where the form is used: the plan, the GGUF-blocks linear method and the fused decode step.


def test_plan_takes_one_term_from_eight_rows_for_models_of_1b_parameters_with_int8_activations(monkeypatch):
    from sglang.srt.layers.arithmetic import choose_arithmetic
    from sglang.srt.layers.small_batch_rows import INT8_ONE_TERM_MIN_ROWS, ONE_TERM_ENV, SMALL_BATCH_ROWS
    from tests.test_cpu_arithmetic import AVX2_FLAGS, BF16_VNNI_FLAGS

    monkeypatch.delenv(ONE_TERM_ENV, raising=False)
    big, small = 4 << 30, 1 << 30
    plan = choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, linear_float_bytes=big)
    assert plan.gguf_activations == "int8" and plan.int8_one_term_rows == INT8_ONE_TERM_MIN_ROWS == 8
    assert plan.small_batch_max_rows == SMALL_BATCH_ROWS  # the fused step outruns the int8 GEMM up to 64 rows
    assert "one term per block" in plan.describe() and plan.to_dict()["int8_one_term_rows"] == 8
    gguf_file = choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, linear_float_bytes=big,
                                  gguf_checkpoint=True, gguf_blocks="Q4_1")
    assert (gguf_file.int8_one_term_rows, gguf_file.small_batch_max_rows) == (8, SMALL_BATCH_ROWS)
    seven_b = choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, linear_float_bytes=24 << 30)
    assert (seven_b.int8_one_term_rows, seven_b.small_batch_max_rows) == (8, SMALL_BATCH_ROWS)
    for kwargs in ({"linear_float_bytes": small}, {"linear_float_bytes": None},
                   {"linear_float_bytes": big, "gguf_activations": "float32"}):
        assert choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, **kwargs).int8_one_term_rows == 0, kwargs
    assert choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS, linear_float_bytes=big).int8_one_term_rows == 0
    monkeypatch.setenv(ONE_TERM_ENV, "3")  # any model, from 3 rows
    assert choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, linear_float_bytes=small).int8_one_term_rows == 3
    monkeypatch.setenv(ONE_TERM_ENV, "0")  # never: the int8 GEMM takes 1B+ batches above 20 rows again
    off = choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, linear_float_bytes=big)
    assert off.int8_one_term_rows == 0 and off.small_batch_max_rows == 20
    monkeypatch.setenv(ONE_TERM_ENV, "many")
    with pytest.raises(ValueError, match=ONE_TERM_ENV):
        choose_arithmetic("cpu", "auto", "int8", BF16_VNNI_FLAGS, linear_float_bytes=big)


def test_gguf_method_takes_one_term_from_its_row_count():
    from sglang.srt.layers.linear import Linear
    from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod, rows_alone, set_gguf_activations

    raw = random_raw("Q8_0", 40, 96)
    blocks = gb.GGUFQuantWeight("Q8_0", raw, 40, 96)
    layer = Linear(96, 40, bias=False)
    method = GGUFLinearMethod(blocks, max_rows=16)
    layer.set_linear_method(method)
    assert set_gguf_activations(layer, "int8", 4) == 1 and method.one_term_rows == 4
    assert "one term from 4 rows" in method.describe()
    weight = torch.from_numpy(reference_dequantize("Q8_0", raw, 40, 96))
    for rows, one_term in ((3, False), (4, True), (13, True)):
        x = inputs(rows, 96, seed=rows)
        assert torch.equal(method.apply(weight, x, None), blocks.linear(x, int8=True, one_term=one_term))
    x = inputs(6, 96, seed=6)
    with rows_alone():  # a verify step's rows: both terms, each row as it would be alone
        alone = method.apply(weight, x, None)
    assert torch.equal(alone, blocks.linear(x, int8=True, one_term=False))
    assert torch.equal(alone[2:3], method.apply(weight, x[2:3], None))
    with rows_alone(False):
        assert torch.equal(method.apply(weight, x, None), blocks.linear(x, int8=True, one_term=True))
    set_gguf_activations(layer, "float32", 4)  # float activations have no terms
    assert method.one_term_rows == 0


def test_fused_step_in_the_one_term_form_matches_layer_by_layer(tmp_path):
    """The fused step takes the one-term rows from the layers' methods (and ends with the head only where the head's
    method agrees): 19 sequences on 2 threads (three tiles, the last partial; the team builds each input once or
    every thread its own) give the layer-by-layer logits, and batches below the row count keep both terms."""
    from sglang.srt.layers.quantization.gguf_linear import set_gguf_activations
    from tests.test_fused_decode import assert_same_logits, decode_run, make_fused, quantize_head, quantize_linears
    from tests.test_models import PagedCache, build_models, prompt_of, tiny_config

    config = tiny_config("llama", num_hidden_layers=2)
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours, max_rows=32)
    quantize_head(ours, max_rows=32)
    set_gguf_activations(ours, "int8", 8)
    fused = make_fused(ours, PagedCache(config, torch.float32), 32)
    assert fused.stack.one_term_rows() == 8 and fused.with_head and "one term per block from 8 rows" in fused.name
    ours.logits_processor.head_method.one_term_rows = 4  # computed unlike the layers: the step stops before it
    assert not make_fused(ours, PagedCache(config, torch.float32), 32).with_head
    ours.logits_processor.head_method.one_term_rows = 8
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for count in (19, 5):
            prompts = [prompt_of(3 + i, 10 + i) for i in range(count)]
            expected, _ = decode_run(ours, config, False, prompts, steps=3, max_rows=32)
            runs = []
            for shared in (True, False):
                def configure(strategy, shared=shared):
                    strategy.stack.set_shared_input(shared)

                runs.append(decode_run(ours, config, True, prompts, steps=3, max_rows=32, configure=configure)[0])
                assert_same_logits(runs[-1], expected)
            for a, b in zip(*runs):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def test_one_term_form_keeps_smollm2_greedy_tokens_up_to_near_ties(monkeypatch, reference, smollm2_hf,
                                                                   smollm2_tokenizer):
    """SmolLM2 served with every int8 block matmul in the one-term form (from 1 row: the fused decode step, batched
    and alone, and the LM head) keeps transformers' float32 greedy tokens up to near-ties, as bf16 GEMMs do
    (teacher-forced, the form moved 2 of 510 choices, float32 margins 0.002 and 0.011:
    benchmarks/int8_block_terms_accuracy.py)."""
    from sglang import Engine
    from sglang.srt.layers.small_batch_rows import ONE_TERM_ENV
    from tests.conftest import SMOLLM2
    from tests.greedy_cases import BF16_MARGIN, PROMPTS, assert_same_or_near_tie, many_prompts

    monkeypatch.setenv(ONE_TERM_ENV, "1")
    fast = gb.kernel_module().has_int8_vnni_path()  # elsewhere the portable loop: fewer tokens
    prompts = many_prompts(12) + PROMPTS[:4] if fast else PROMPTS[:2]
    params = {"temperature": 0, "max_new_tokens": 32 if fast else 6, "ignore_eos": True}
    with Engine(model_path=SMOLLM2, gguf_activations="int8", cpu_gemm="float32") as engine:
        assert engine.get_server_info()["arithmetic"]["int8_one_term_rows"] == 1
        outputs = [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=params)]
        outputs.append(engine.generate(prompt=PROMPTS[0], sampling_params=params)["output_ids"])
    for prompt, ours, expected in zip(prompts + PROMPTS[:1], outputs, reference(prompts + PROMPTS[:1])):
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected[: len(ours)], BF16_MARGIN)


def test_a_speculative_server_plans_the_form_as_a_plain_one(tmp_path, cache_dir, monkeypatch):
    """A server of a 1B+ model takes the form from its plan, with --speculative-algorithm too: only its verify steps
    compute without it (test_a_verify_step_computes_each_row_as_alone), its plain decode steps (speculation paused
    above its batch limit) run as a plain server's."""
    import json

    from transformers import LlamaConfig

    from sglang.srt.layers.small_batch_rows import INT8_ONE_TERM_MIN_ROWS, ONE_TERM_ENV
    from sglang.srt.model_loader.model_info import load_model_info
    from sglang.srt.server_args import ServerArgs
    from tests.test_chunked_prefill_default import LARGE

    monkeypatch.delenv(ONE_TERM_ENV, raising=False)
    config = LlamaConfig(**LARGE).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    flags = dict(model_path=str(tmp_path), device="cpu", cpu_gemm="int8", gguf_activations="int8")
    assert load_model_info(ServerArgs(**flags)).arithmetic.int8_one_term_rows == INT8_ONE_TERM_MIN_ROWS
    spec = load_model_info(ServerArgs(**flags, speculative_algorithm="NGRAM"))
    assert spec.arithmetic.int8_one_term_rows == INT8_ONE_TERM_MIN_ROWS


def test_a_verify_step_computes_each_row_as_alone(tmp_path):
    """The fused step on rows that share sequences (a speculative verify step) keeps both activation terms even where
    its row count takes the one-term form: its logits are, bit for bit, those of the same step with the form off,
    and a step of the same rows from distinct sequences does take the form."""
    from sglang.srt.layers.quantization.gguf_linear import set_gguf_activations
    from tests.test_fused_decode import quantize_head, quantize_linears
    from tests.test_fused_shared_rows import FEED, prefilled, shared_rows_step
    from tests.test_models import build_models, prompt_of, tiny_config

    config = tiny_config("llama", max_position_embeddings=1024)
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    quantize_head(ours)
    set_gguf_activations(ours, "int8", 1)  # the form from one row: every step but a verify step's
    prompts = {0: prompt_of(9, 1), 1: prompt_of(5, 2)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runs = {}
        for rows in (1, 0):
            cache = prefilled(ours, config, prompts)
            assert cache.decode_strategy.with_head
            cache.decode_strategy.stack.set_one_term_rows(rows)
            runs[rows] = shared_rows_step(ours, cache, FEED)
        assert torch.equal(runs[1], runs[0])
        cache = prefilled(ours, config, prompts)  # one row per sequence: the form applies
        one_term = cache.forward(ours, [(row, [tokens[0]]) for row, tokens in FEED.items()])
        cache = prefilled(ours, config, prompts)
        cache.decode_strategy.stack.set_one_term_rows(0)
        assert not torch.equal(one_term, cache.forward(ours, [(row, [tokens[0]]) for row, tokens in FEED.items()]))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("verify", [True, False])
def test_the_runner_runs_verify_rows_alone(verify):
    """ModelRunner computes a verify forward (rows sharing sequences) under gguf_linear.rows_alone (here layer by
    layer; the fused step decides from the batch itself: test_a_verify_step_computes_each_row_as_alone), and any
    other forward without it."""
    from types import SimpleNamespace

    from sglang.srt.layers.quantization import gguf_linear
    from sglang.srt.model_executor.model_runner import ModelRunner

    seen = []

    def model(input_ids, positions, forward_batch):
        seen.append(gguf_linear._rows_alone)
        return torch.zeros(2, 4)

    runner = object.__new__(ModelRunner)
    runner.decode_plan, runner.hidden_sink, runner.lora_state = None, None, None
    runner.attn_backend = SimpleNamespace(init_forward_metadata=lambda forward_batch: None)
    runner.model = model
    batch = SimpleNamespace(rows_share_sequences=verify, input_ids=None, positions=None, lora_ids=None,
                            extend_seq_lens_cpu=[1, 1])
    assert runner._forward_logits(batch).shape == (2, 4)
    assert seen == [verify] and gguf_linear._rows_alone is False

"""Arithmetic per phase and per CPU class (sglang/srt/layers/arithmetic.py) and the reduced-precision linear
methods it selects (layers/bf16_linear.py, layers/int8_linear.py, model_loader/gemm_methods.py).

The dispatch tests give `choose_arithmetic` the flags of each CPU class, so they run on any machine. The model
tests run the bf16 (and int8) paths on whatever CPU runs them: natively where it has the instructions, emulated
(slowly) where it does not.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config

from sglang.srt.layers.arithmetic import choose_arithmetic
from sglang.srt.layers.bf16_linear import BF16LinearMethod
from sglang.srt.layers.cpu_classes import AMX, AVX2, AVX512_BF16, OTHER, cpu_class
from sglang.srt.layers.int8_linear import Int8LinearMethod
from sglang.srt.layers.linear import DENSE, Linear
from sglang.srt.layers.small_batch_rows import (
    INT8_LARGE_MODEL_Q4_ROWS,
    INT8_LARGE_MODEL_ROWS,
    ONE_TERM_ENV,
    head_small_batch_rows,
)
from sglang.srt.model_loader.dtype import parse_cpu_flags, read_cpu_flags
from sglang.srt.model_loader.gemm_methods import attach_large_batch_gemm

AVX2_FLAGS = "fpu sse sse2 avx fma avx2".split()
BF16_VNNI_FLAGS = AVX2_FLAGS + "avx512f avx512bw avx512vl avx512_vnni avx512_bf16".split()
AMX_FLAGS = BF16_VNNI_FLAGS + "amx_tile amx_bf16 amx_int8".split()

# Logits of the tiny random models spread over ~+-10 and SmolLM2's up to ~40. bf16 inputs and weights (float32
# accumulation, output rounded to bf16) move a logit by ~1-2% of that scale, int8 by ~4%. Measured on the tiny
# models: max abs diff 0.15-0.20 (bf16) and 0.40-0.44 (int8), argmax agreement 0.97 and 0.93 over every prompt
# position and decode step. A wrong weight or a missing bias moves logits by whole units.
TINY_BF16_TOL = 0.3
TINY_INT8_TOL = 1.0
SMOLLM2_BF16_TOL = 1.5
# The largest float32 logit gap a bf16 run may flip: SmolLM2's float32 logits have near-ties (0.08 apart on one
# of the test prompts) that bf16's rounding of the logits turns into exact ties.
SMOLLM2_TIE_MARGIN = 0.3
MIN_AGREEMENT = {"bfloat16": 0.95, "int8": 0.85}


# ---- dispatch ------------------------------------------------------------------------------------------------
def test_cpu_flags_and_classes():
    assert parse_cpu_flags("processor: 0\nflags\t\t: fpu avx2 avx512_bf16\n") == {"fpu", "avx2", "avx512_bf16"}
    assert parse_cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert cpu_class(AVX2_FLAGS) == AVX2
    assert cpu_class(BF16_VNNI_FLAGS) == AVX512_BF16
    assert cpu_class(AMX_FLAGS) == AMX
    assert cpu_class(["fpu", "sse2"]) == OTHER
    assert cpu_class(["fp", "asimd", "bf16"], machine="aarch64") == "arm-bf16"
    assert isinstance(read_cpu_flags(), frozenset)


def test_avx2_cpu_keeps_float32_arithmetic_with_bf16_kv():
    plan = choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS)
    assert (plan.cpu_class, plan.weight_dtype, plan.kv_dtype, plan.large_batch_gemm) == (
        AVX2, torch.float32, torch.bfloat16, "float32")
    assert (plan.gguf_activations, plan.prefill_attention) == ("float32", "float32")
    assert plan.describe().startswith("Arithmetic: CPU class avx2; weights float32, KV cache bfloat16 (AVX2 widens")


@pytest.mark.parametrize("flags, cls", [(BF16_VNNI_FLAGS, AVX512_BF16), (AMX_FLAGS, AMX)])
def test_bf16_cpus_keep_float32_weights_with_bf16_large_batches_and_kv(flags, cls):
    plan = choose_arithmetic("cpu", "auto", "auto", flags)
    assert (plan.cpu_class, plan.weight_dtype, plan.kv_dtype, plan.large_batch_gemm) == (
        cls, torch.float32, torch.bfloat16, "bfloat16")
    assert plan.to_dict()["large_batch_gemm"] == "bfloat16"
    assert plan.to_dict()["kv_cache_dtype"] == "bfloat16"
    assert "native bf16" in plan.to_dict()["kv_cache_dtype_reason"]
    assert "KV cache bfloat16" in plan.describe()


@pytest.mark.parametrize("flags", [AVX2_FLAGS, BF16_VNNI_FLAGS, AMX_FLAGS, ["fpu"]])
def test_kv_cache_dtype_per_cpu_class_and_flags(flags):
    bf16_kv = cpu_class(flags) in (AVX512_BF16, AMX, AVX2)  # x86 with at least AVX2; not flags of no known class
    auto = choose_arithmetic("cpu", "auto", "auto", flags)
    assert auto.kv_dtype == (torch.bfloat16 if bf16_kv else torch.float32)
    # an explicit --dtype or --cpu-gemm keeps K/V in the model dtype; an explicit --kv-cache-dtype wins everywhere
    assert choose_arithmetic("cpu", "float32", "auto", flags).kv_dtype == torch.float32
    assert choose_arithmetic("cpu", "bfloat16", "auto", flags).kv_dtype == torch.bfloat16
    assert choose_arithmetic("cpu", "auto", "float32", flags).kv_dtype == torch.float32
    assert choose_arithmetic("cpu", "auto", "bfloat16", flags).kv_dtype == torch.float32
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8_e5m2", torch.float8_e5m2)]:
        plan = choose_arithmetic("cpu", "auto", "auto", flags, kv_cache_dtype=name)
        assert plan.kv_dtype == dtype and plan.kv_cache_dtype_reason == f"--kv-cache-dtype {name}"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        choose_arithmetic("cpu", "auto", "auto", flags, kv_cache_dtype="int4")
    # accelerators keep the model dtype
    assert choose_arithmetic("cuda", "auto", "auto", flags, config_dtype="float16").kv_dtype == torch.float16


def test_prefill_attention_per_cpu_class_and_plan():
    """bf16 dot products where the CPU has AVX512-BF16 and K/V are bf16, unless float32 arithmetic was asked for."""
    for flags in (BF16_VNNI_FLAGS, AMX_FLAGS):
        for dtype, gemm, kv in [("auto", "auto", "auto"), ("bfloat16", "auto", "auto"), ("auto", "int8", "bfloat16"),
                                ("auto", "bfloat16", "bfloat16")]:
            plan = choose_arithmetic("cpu", dtype, gemm, flags, kv_cache_dtype=kv)
            assert plan.prefill_attention == "bfloat16", (flags, dtype, gemm, kv)
        for dtype, gemm, kv in [("float32", "auto", "auto"), ("auto", "float32", "auto"), ("auto", "auto", "float32"),
                                ("auto", "float32", "bfloat16"), ("auto", "bfloat16", "auto"),
                                ("auto", "auto", "fp8_e4m3")]:
            assert choose_arithmetic("cpu", dtype, gemm, flags, kv_cache_dtype=kv).prefill_attention == "float32"
    # AVX2-only CPUs, ARM and accelerators never take it, whatever the K/V dtype
    assert choose_arithmetic("cpu", "auto", "bfloat16", AVX2_FLAGS, kv_cache_dtype="bfloat16").prefill_attention == (
        "float32")
    assert choose_arithmetic("cpu", "bfloat16", "auto", ["bf16", "asimd"], "aarch64").prefill_attention == "float32"
    assert choose_arithmetic("cuda", "bfloat16", "auto", AMX_FLAGS).prefill_attention == "float32"
    plan = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS)
    assert plan.to_dict()["prefill_attention"] == "bfloat16" and "prefill attention bfloat16" in plan.describe()
    # --prefill-attention: float32 everywhere; bfloat16 wherever the dot products can run, float32 GEMMs included
    off = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS, prefill_attention="float32")
    assert (off.prefill_attention, off.prefill_attention_reason) == ("float32", "--prefill-attention float32")
    on = choose_arithmetic("cpu", "auto", "float32", BF16_VNNI_FLAGS, kv_cache_dtype="bfloat16",
                           prefill_attention="bfloat16")
    assert (on.prefill_attention, on.prefill_attention_reason) == ("bfloat16", "--prefill-attention bfloat16")
    for flags, kv in [(AVX2_FLAGS, "bfloat16"), (BF16_VNNI_FLAGS, "float32")]:
        plan = choose_arithmetic("cpu", "auto", "auto", flags, kv_cache_dtype=kv, prefill_attention="bfloat16")
        assert plan.prefill_attention == "float32"
    with pytest.raises(ValueError, match="--prefill-attention"):
        choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS, prefill_attention="int8")


@pytest.mark.parametrize("flags", [AVX2_FLAGS, BF16_VNNI_FLAGS, AMX_FLAGS])
def test_explicit_dtype_means_what_it_says(flags):
    bf16 = choose_arithmetic("cpu", "bfloat16", "auto", flags)
    assert (bf16.weight_dtype, bf16.large_batch_gemm) == (torch.bfloat16, "bfloat16")
    f32 = choose_arithmetic("cpu", "float32", "auto", flags)
    assert (f32.weight_dtype, f32.large_batch_gemm) == (torch.float32, "float32")


def test_cpu_gemm_override():
    for gemm in ("float32", "bfloat16", "int8"):
        for flags in (AVX2_FLAGS, BF16_VNNI_FLAGS):
            plan = choose_arithmetic("cpu", "auto", gemm, flags)
            assert (plan.weight_dtype, plan.large_batch_gemm) == (torch.float32, gemm)
            assert f"--cpu-gemm {gemm}" in plan.reason
    assert choose_arithmetic("cpu", "float32", "bfloat16", AVX2_FLAGS).large_batch_gemm == "bfloat16"
    with pytest.raises(ValueError, match="--cpu-gemm"):
        choose_arithmetic("cpu", "auto", "fp8", AVX2_FLAGS)
    with pytest.raises(ValueError, match="float32 weights"):
        choose_arithmetic("cpu", "bfloat16", "float32", BF16_VNNI_FLAGS)


def test_cuda_follows_dtype():
    plan = choose_arithmetic("cuda", "auto", "auto", AMX_FLAGS, config_dtype="float16")
    assert (plan.cpu_class, plan.weight_dtype, plan.large_batch_gemm) == ("", torch.float16, "float16")
    assert choose_arithmetic("cuda:0", "float32", "auto").weight_dtype == torch.float32
    assert choose_arithmetic("cuda", "auto", "auto", config_dtype=None).weight_dtype == torch.bfloat16


def test_unclassified_cpu_uses_measurements():
    assert choose_arithmetic("cpu", "auto", "auto", ["fpu"]).large_batch_gemm == "float32"
    faster_bf16 = choose_arithmetic("cpu", "auto", "auto", ["fpu"], measurements={"float32": 10, "bfloat16": 40})
    assert faster_bf16.large_batch_gemm == "bfloat16" and "measurement" in faster_bf16.reason
    # measurements never override what the flags settle
    assert choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS,
                             measurements={"float32": 1, "bfloat16": 99}).large_batch_gemm == "float32"


def test_gguf_activations_per_cpu_class():
    """int8 activations for the GGUF kernels only where the CPU has AVX512-VNNI and nothing asked for float32."""
    assert choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS).gguf_activations == "int8"
    assert choose_arithmetic("cpu", "auto", "auto", AMX_FLAGS).gguf_activations == "int8"
    assert choose_arithmetic("cpu", "auto", "bfloat16", BF16_VNNI_FLAGS).gguf_activations == "int8"
    no_vnni = [f for f in BF16_VNNI_FLAGS if f != "avx512_vnni"]
    for flags in (AVX2_FLAGS, no_vnni, ["fpu"]):
        plan = choose_arithmetic("cpu", "auto", "auto", flags)
        assert plan.gguf_activations == "float32" and "VNNI" in plan.gguf_activations_reason
    arm = choose_arithmetic("cpu", "auto", "auto", ["fp", "asimd", "bf16", *BF16_VNNI_FLAGS], machine="aarch64")
    assert arm.gguf_activations == "float32"
    # float32 asked for explicitly: float32 throughout
    assert choose_arithmetic("cpu", "float32", "auto", BF16_VNNI_FLAGS).gguf_activations == "float32"
    pinned = choose_arithmetic("cpu", "auto", "float32", BF16_VNNI_FLAGS)
    assert pinned.gguf_activations == "float32" and "--cpu-gemm float32" in pinned.gguf_activations_reason
    # the override wins on any CPU (the portable loop runs where VNNI is missing)
    forced = choose_arithmetic("cpu", "auto", "float32", AVX2_FLAGS, gguf_activations="int8")
    assert (forced.gguf_activations, forced.gguf_activations_reason) == ("int8", "--gguf-activations int8")
    assert choose_arithmetic("cpu", "auto", "auto", AMX_FLAGS, gguf_activations="float32").gguf_activations == \
        "float32"
    assert choose_arithmetic("cuda", "auto", "auto", AMX_FLAGS).gguf_activations == "float32"
    plan = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS)
    assert plan.to_dict()["gguf_activations"] == "int8"
    assert "GGUF blocks with int8 activations" in plan.describe()
    with pytest.raises(ValueError, match="--gguf-activations"):
        choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS, gguf_activations="int4")


def test_small_batch_quantization_per_plan():
    """Q8_0 blocks for checkpoints without GGUF blocks where large batches already run a reduced-precision GEMM."""
    assert choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS).small_batch_quantization == "q8_0"
    assert choose_arithmetic("cpu", "auto", "auto", AMX_FLAGS).small_batch_quantization == "q8_0"
    assert choose_arithmetic("cpu", "auto", "bfloat16", AVX2_FLAGS).small_batch_quantization == "q8_0"
    for args in (("cpu", "auto", "auto", AVX2_FLAGS), ("cpu", "float32", "auto", BF16_VNNI_FLAGS),
                 ("cpu", "auto", "float32", BF16_VNNI_FLAGS), ("cpu", "bfloat16", "auto", BF16_VNNI_FLAGS),
                 ("cuda", "auto", "auto", AMX_FLAGS)):
        assert choose_arithmetic(*args).small_batch_quantization == "none", args
    # AVX2: blocks for a model of 1 GiB of float32 linear weights or more, unless a float32 plan is asked for
    gib = 1 << 30
    assert choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS, linear_float_bytes=gib).small_batch_quantization \
        == "q8_0"
    for args, size in ((("cpu", "auto", "auto", AVX2_FLAGS), gib - 1), (("cpu", "auto", "float32", AVX2_FLAGS), gib),
                       (("cpu", "float32", "auto", AVX2_FLAGS), gib), (("cpu", "auto", "auto", ["fpu"]), gib)):
        assert choose_arithmetic(*args, linear_float_bytes=size).small_batch_quantization == "none", args
    forced = choose_arithmetic("cpu", "auto", "float32", AVX2_FLAGS, small_batch_quantization="q8_0")
    assert forced.small_batch_quantization == "q8_0" and forced.to_dict()["small_batch_quantization"] == "q8_0"
    assert "q8_0 blocks for small batches" in forced.describe()
    assert choose_arithmetic("cpu", "auto", "auto", AMX_FLAGS,
                             small_batch_quantization="none").small_batch_quantization == "none"
    with pytest.raises(ValueError, match="--small-batch-quantization"):
        choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS, small_batch_quantization="q4_0")
    with pytest.raises(ValueError, match="float32 weights on CPU"):
        choose_arithmetic("cpu", "bfloat16", "auto", AVX2_FLAGS, small_batch_quantization="q8_0")


def test_small_batch_rows_per_cpu_class(monkeypatch):
    """The quantized blocks (and the fused decode step) serve up to 64 rows whatever GEMM large batches run (the
    int8 fused step beats the AVX512 bf16 GEMM path up to there too), except on AMX CPUs, whose bf16 GEMM takes
    over above 32, and on CPUs whose widest FMAs are AVX2's, where the float32 blocks beat the float32 GEMM up to
    2,048 rows, and where the int8 GEMM takes over above 48 for models of 1B parameters or more; --gguf-kernel-max-rows
    overrides."""
    from sglang.srt.layers.small_batch_rows import resolve_small_batch_rows

    bf16 = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS)
    assert bf16.large_batch_gemm == "bfloat16"
    assert bf16.small_batch_max_rows == 64 and bf16.to_dict()["small_batch_max_rows"] == 64
    assert "up to 64 rows" in bf16.describe()
    amx = choose_arithmetic("cpu", "auto", "auto", AMX_FLAGS)
    assert amx.large_batch_gemm == "bfloat16" and amx.small_batch_max_rows == 32
    for args in (("cpu", "auto", "auto", AVX2_FLAGS), ("cpu", "float32", "auto", AVX2_FLAGS),
                 ("cpu", "auto", "float32", AVX2_FLAGS)):
        avx2 = choose_arithmetic(*args)
        assert avx2.large_batch_gemm == "float32" and avx2.small_batch_max_rows == 2048, args
    assert "up to 2048 rows" in avx2.describe()
    avx512f = AVX2_FLAGS + ["avx512f", "avx512bw", "avx512vl"]  # AVX512 FMAs but no bf16: the GEMM is twice as wide
    for args in (("cpu", "auto", "auto", avx512f), ("cpu", "auto", "float32", AMX_FLAGS),
                 ("cpu", "auto", "float32", BF16_VNNI_FLAGS), ("cpu", "float32", "auto", BF16_VNNI_FLAGS),
                 ("cuda", "auto", "auto", AMX_FLAGS)):
        assert choose_arithmetic(*args).small_batch_max_rows == 64, args
    # int8 activations asked for on AVX2 run the portable loop: no reason to widen their share
    assert choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS, gguf_activations="int8").small_batch_max_rows == 64
    # with both activation terms in every block (the one-term form off), the int8 GEMM on a VNNI CPU takes batches
    # above INT8_LARGE_MODEL_ROWS rows of a model of 1B parameters or more whose Q8_0 blocks were made at load or are
    # most of a GGUF file's, above INT8_LARGE_MODEL_Q4_ROWS where they are Q4_1; a smaller model, a GGUF file of
    # unknown blocks or a quantized checkpoint's blocks keep 64 (tests/test_gguf_int8_one_term.py: the form on)
    monkeypatch.setenv(ONE_TERM_ENV, "0")
    big, small = 4 << 30, 1 << 30
    for gemm, measured in (("int8", None), ("auto", {"bfloat16": 400, "int8": 600})):
        plan = choose_arithmetic("cpu", "auto", gemm, BF16_VNNI_FLAGS, measurements=measured, linear_float_bytes=big)
        assert (plan.large_batch_gemm, plan.small_batch_quantization, plan.small_batch_max_rows) == (
            "int8", "q8_0", INT8_LARGE_MODEL_ROWS), gemm
    int8 = functools.partial(choose_arithmetic, "cpu", "auto", "int8", BF16_VNNI_FLAGS)
    assert int8(linear_float_bytes=small).small_batch_max_rows == 64
    assert int8(linear_float_bytes=None).small_batch_max_rows == 64
    assert int8(linear_float_bytes=big, gguf_checkpoint=True).small_batch_max_rows == 64
    assert int8(linear_float_bytes=big, quantized_checkpoint=True).small_batch_max_rows == 64
    gguf_file = functools.partial(int8, gguf_checkpoint=True)
    assert gguf_file(linear_float_bytes=big, gguf_blocks="Q8_0").small_batch_max_rows == INT8_LARGE_MODEL_ROWS
    assert gguf_file(linear_float_bytes=big, gguf_blocks="Q4_1").small_batch_max_rows == INT8_LARGE_MODEL_Q4_ROWS
    assert gguf_file(linear_float_bytes=small, gguf_blocks="Q8_0").small_batch_max_rows == 64
    q4_1 = int8(linear_float_bytes=big, small_batch_quantization="q4_1")
    assert q4_1.small_batch_max_rows == INT8_LARGE_MODEL_Q4_ROWS
    assert int8(linear_float_bytes=big, small_batch_quantization="none").small_batch_max_rows == 64
    assert int8(linear_float_bytes=big, gguf_activations="float32").small_batch_max_rows == 64
    assert choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS, linear_float_bytes=big).small_batch_max_rows == 64
    assert resolve_small_batch_rows(None, bf16) == 64
    assert resolve_small_batch_rows(8, bf16) == 8 and resolve_small_batch_rows(0, bf16) == 0
    assert resolve_small_batch_rows(None, None) == 64


# ---- linear methods --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_bf16_and_int8_methods_match_dense(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64) / 8, torch.randn(96)
    x = torch.randn(rows, 64)
    expected = F.linear(x, weight, bias)
    for method, tol in ((BF16LinearMethod(weight), 0.02), (Int8LinearMethod(weight), 0.06)):
        out = method.apply(weight, x, bias)
        assert out.dtype == torch.float32 and out.shape == expected.shape
        assert max_diff(out, expected) < tol * expected.abs().max().item(), type(method).__name__
    # 3-D inputs keep their leading dims
    out3 = Int8LinearMethod(weight).apply(weight, x.view(1, rows, 64), None)
    assert out3.shape == (1, rows, 96)


def test_bf16_gemm_hands_bf16_through_the_mlp():
    """A float32 model's MLP on the bf16 GEMM: gate/up returns bf16 (apply_native), the activation reads and writes
    bf16, down_proj multiplies it as is and returns float32 -- the same numbers as converting in between."""
    from sglang.srt.models.llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(64, 96, "silu", False, torch.float32, "cpu")
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data.normal_(0, 0.1)
        layer.set_linear_method(BF16LinearMethod(layer.weight))
    x = torch.randn(40, 64)
    gate_up = mlp.gate_up_proj.forward_native(x)
    assert gate_up.dtype == torch.bfloat16 and mlp.gate_up_proj(x).dtype == torch.float32
    out = mlp(x)
    assert out.dtype == torch.float32
    g, u = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(g) * u).to(torch.bfloat16)
    expected = F.linear(act, mlp.down_proj.weight.to(torch.bfloat16)).float()
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    # every method takes a bf16 input of a float32 model and answers in float32
    xb = x.to(torch.bfloat16)
    weight = mlp.gate_up_proj.weight
    for method in (DENSE, BF16LinearMethod(weight), Int8LinearMethod(weight)):
        assert method.apply(weight, xb, None).dtype == torch.float32, type(method).__name__
    # the prepacked oneDNN weight (where torch has oneDNN) multiplies exactly as F.linear on the plain bf16 weight,
    # for any row count and for 3-D inputs
    method = BF16LinearMethod(weight)
    assert torch.equal(method.dense_weight(), weight.to(torch.bfloat16))
    from sglang.srt.layers.bf16_linear import _packing_works

    if _packing_works():
        assert method.packed is not None and method.weight is None and "prepacked" in method.describe()
    else:
        assert method.packed is None and torch.equal(method.weight, weight.to(torch.bfloat16))
    for rows in (1, 17, 130):
        xr = torch.randn(rows, 64)
        assert torch.equal(method.apply_native(weight, xr, None), F.linear(xr.bfloat16(), weight.bfloat16()))
    assert method.apply(weight, torch.randn(2, 5, 64), None).shape == (2, 5, weight.shape[0])
    assert method.nbytes == weight.numel() * 2
    # a bias keeps the float32 output (it is added in the model's dtype)
    bias = torch.randn(weight.shape[0])
    assert BF16LinearMethod(weight).apply_native(weight, x, bias).dtype == torch.float32


def test_bf16_method_without_onednn_packing_keeps_the_plain_weight(monkeypatch):
    """Where oneDNN cannot pack bf16 weights (probed once at startup) the method multiplies the plain bf16 copy."""
    from sglang.srt.layers import bf16_linear

    monkeypatch.setattr(bf16_linear, "_packing_works", lambda: False)
    weight = torch.randn(48, 64)
    method = BF16LinearMethod(weight)
    assert method.packed is None and method.describe() == "bf16 GEMM"
    x = torch.randn(5, 64)
    assert torch.equal(method.apply_native(weight, x, None), F.linear(x.bfloat16(), weight.bfloat16()))
    assert torch.equal(method.dense_weight(), weight.bfloat16())


def test_gguf_method_hands_large_batches_to_the_large_method():
    gguf = pytest.importorskip("gguf")
    from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight, kernels_available
    from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod

    if not kernels_available():
        pytest.skip("the compiled GGUF kernels are unavailable")
    torch.manual_seed(0)
    raw = gguf.quants.quantize(torch.randn(64, 64).numpy(), gguf.GGMLQuantizationType.Q8_0)
    quant = GGUFQuantWeight("Q8_0", raw, 64, 64)
    weight = quant.dequantize()
    large = BF16LinearMethod(weight)
    method = GGUFLinearMethod(quant, max_rows=4, large=large)
    small_x, large_x = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(method.apply(weight, small_x, None), quant.linear(small_x, None))
    assert torch.equal(method.apply(weight, large_x, None), large.apply(weight, large_x, None))
    assert method.describe() == f"GGUF Q8_0 blocks up to 4 rows, {large.describe()} beyond"


def test_attach_large_batch_gemm_replaces_dense_layers_and_head(tmp_path):
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    assert attach_large_batch_gemm(ours, "float32") == 0
    attached = attach_large_batch_gemm(ours, "bfloat16")
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.linear_method, BF16LinearMethod) for m in linears)
    assert isinstance(ours.logits_processor.head_method, BF16LinearMethod)
    expected = sum(m.weight.numel() * 2 for m in linears) + ours.lm_head.weight.numel() * 2
    assert attached == expected
    # the float32 parameters stay (embeddings, norms, and the small-batch paths read them)
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_head_small_batch_rows_per_large_batch_gemm():
    """The LM head runs its quantized blocks up to 16 rows where the large-batch GEMM is bf16 (faster above),
    up to the other matmuls' limit elsewhere."""
    assert head_small_batch_rows("bfloat16", 64) == 16
    assert head_small_batch_rows("bfloat16", 8) == 8 and head_small_batch_rows("bfloat16", 0) == 0
    assert head_small_batch_rows("float32", 64) == 64 and head_small_batch_rows("int8", 64) == 64


@pytest.mark.parametrize("gemm, head_rows", [("bfloat16", 16), ("int8", 64)])
def test_attach_large_batch_gemm_limits_the_quantized_head(tmp_path, gemm, head_rows):
    gguf = pytest.importorskip("gguf")
    from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight, kernels_available
    from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod

    if not kernels_available():
        pytest.skip("the compiled GGUF kernels are unavailable")
    _, ours = build_models(tmp_path, tiny_config("llama"))

    def blocks(weight: torch.Tensor) -> GGUFQuantWeight:
        n, k = weight.shape
        return GGUFQuantWeight("Q8_0", gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0), n, k)

    layer = ours.model.layers[0].mlp.gate_up_proj
    layer.set_linear_method(GGUFLinearMethod(blocks(layer.weight.detach()), max_rows=64))
    ours.logits_processor.set_head_method(GGUFLinearMethod(blocks(ours.lm_head.weight.detach()), max_rows=64))
    attach_large_batch_gemm(ours, gemm)
    head = ours.logits_processor.head_method
    assert isinstance(head, GGUFLinearMethod) and head.max_rows == head_rows
    assert f"up to {head_rows} rows" in head.describe()
    assert layer.linear_method.max_rows == 64  # the layers keep theirs


def _greedy_run(model, config, prompts: list[list[int]], steps: int,
                forced: list[list[int]] | None = None) -> tuple[torch.Tensor, list[list[int]], list[torch.Tensor]]:
    """Prefill logits of every prompt (one batch), then batched decode steps: (prefill logits, greedy tokens,
    each step's logits). With `forced`, the decode steps are fed those tokens instead of their own argmax."""
    cache = PagedCache(config, torch.float32, size=1024)
    logits = cache.forward(model, [(row, p) for row, p in enumerate(prompts)], all_logits=True)
    ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
    tokens = [[int(logits[int(end)].argmax())] for end in ends]
    step_logits = []
    for i in range(steps):
        feed = [(forced[row][i] if forced else tokens[row][-1]) for row in range(len(prompts))]
        step = cache.forward(model, [(row, [feed[row]]) for row in range(len(prompts))])
        step_logits.append(step)
        for row in range(len(prompts)):
            tokens[row].append(int(step[row].argmax()))
    return logits, tokens, step_logits


def _argmax_agreement(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("gemm, tol", [("bfloat16", TINY_BF16_TOL), ("int8", TINY_INT8_TOL)])
def test_reduced_precision_gemm_against_float32_tiny(tmp_path, family, gemm, tol):
    config = tiny_config(family)
    _, ours = build_models(tmp_path, config)
    prompts = [prompt_of(24, 1), prompt_of(40, 2), prompt_of(9, 3)]
    expected_logits, expected_tokens, expected_steps = _greedy_run(ours, config, prompts, steps=8)
    attach_large_batch_gemm(ours, gemm)
    logits, _, steps = _greedy_run(ours, config, prompts, steps=8, forced=expected_tokens)
    assert max_diff(logits, expected_logits) < tol, max_diff(logits, expected_logits)
    for step, (a, e) in enumerate(zip(steps, expected_steps)):
        assert max_diff(a, e) < tol, f"decode step {step}: {max_diff(a, e)}"
    # Random models have near-ties that any rounding may flip; the greedy choice of nearly every position (every
    # prompt token and every decode step) must stay.
    agreement = _argmax_agreement(torch.cat([logits, *steps]), torch.cat([expected_logits, *expected_steps]))
    print(f"{family} {gemm}: max diff {max_diff(logits, expected_logits):.3f}, argmax agreement {agreement:.3f}")
    assert agreement >= MIN_AGREEMENT[gemm], agreement


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_gemm_path_converts_nothing_between_kernels(tmp_path, monkeypatch, family):
    """On the bf16 GEMM path the norms write the GEMMs' bf16 inputs and the residual adds read o_proj's and
    down_proj's bf16 outputs; prefill and decode logits are bit for bit those of the same model converting to and
    from float32 around every GEMM (as the path did before these hand-offs)."""
    from sglang.srt.models.llama import LlamaMLP

    config = tiny_config(family)
    _, ours = build_models(tmp_path, config)
    attach_large_batch_gemm(ours, "bfloat16")
    first = ours.model.layers[0]
    seen: dict[str, torch.dtype] = {}  # the dtype each projection of the first layer is handed
    for name, module, entry in (("qkv", first.self_attn.qkv_proj, "forward"),
                                ("gate_up", first.mlp.gate_up_proj, "forward_native")):
        def recording(x, original=getattr(module, entry), name=name):
            seen[name] = x.dtype
            return original(x)

        monkeypatch.setattr(module, entry, recording)
    prompts = [prompt_of(24, 1), prompt_of(40, 2), prompt_of(9, 3)]
    logits, tokens, steps = _greedy_run(ours, config, prompts, steps=4)
    assert seen == {"qkv": torch.bfloat16, "gate_up": torch.bfloat16}
    o_proj = first.self_attn.o_proj
    assert o_proj.forward_native(torch.randn(2, o_proj.in_features)).dtype == torch.bfloat16

    monkeypatch.setattr(Linear, "input_dtype", lambda self, rows: None)
    monkeypatch.setattr(LlamaMLP, "forward_native", LlamaMLP.forward)
    for layer in ours.model.layers:
        monkeypatch.setattr(layer.self_attn.o_proj, "forward_native", layer.self_attn.o_proj.forward)
    converting_logits, _, converting_steps = _greedy_run(ours, config, prompts, steps=4, forced=tokens)
    assert seen == {"qkv": torch.float32, "gate_up": torch.float32}
    assert torch.equal(logits, converting_logits)
    assert all(torch.equal(a, b) for a, b in zip(steps, converting_steps))


def test_bf16_gemm_keeps_smollm2_greedy_tokens(smollm2_dir, smollm2_tokenizer):
    from sglang.srt.model_loader.loader import load_model

    model = load_model(smollm2_dir, torch.float32, "cpu")
    questions = ["Name three primary colors and say why the sky looks blue.", "What is the capital of France?"]
    prompts = []
    for q in questions:
        ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    expected_logits, expected_tokens, expected_steps = _greedy_run(model, model.config, prompts, steps=12)
    attach_large_batch_gemm(model, "bfloat16")
    # teacher-forced on the float32 tokens, so every position compares against float32 logits of the same prefix
    logits, _, steps = _greedy_run(model, model.config, prompts, steps=12, forced=expected_tokens)
    assert max_diff(logits, expected_logits) < SMOLLM2_BF16_TOL, max_diff(logits, expected_logits)
    ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
    for row in range(len(prompts)):
        positions = [(logits[int(ends[row])], expected_logits[int(ends[row])])]
        positions += [(a[row], e[row]) for a, e in zip(steps, expected_steps)]
        for i, (ours, ref) in enumerate(positions):
            # bf16 logits are rounded to 0.125-0.25 at SmolLM2's scale (25-40): a float32 near-tie may flip
            gap = float(ref.max() - ref[int(ours.argmax())])
            assert gap <= SMOLLM2_TIE_MARGIN, f"prompt {row}, token {i}: float32 prefers its token by {gap:.3f}"

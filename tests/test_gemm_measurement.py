"""The startup measurement that settles what the CPU flags leave open (layers/arithmetic.gemms_to_measure,
model_loader/gemm_measurement.py): which GEMMs are measured on each CPU class, how `choose_arithmetic` uses the
measured rates (int8 only where clearly faster), and the real linear methods timed on a small MLP on this machine."""

from __future__ import annotations

import json

import pytest
import torch
from test_cpu_arithmetic import AMX_FLAGS, AVX2_FLAGS, BF16_VNNI_FLAGS
from test_models import tiny_config

import sglang.srt.model_loader.gemm_measurement as gm
from sglang.srt.layers.arithmetic import INT8_MIN_GAIN, choose_arithmetic, gemms_to_measure
from sglang.srt.layers.cpu_classes import AMX, AVX2, AVX512_BF16

VNNI_NO_BF16_FLAGS = AVX2_FLAGS + "avx512f avx512bw avx512vl avx512_vnni".split()


@pytest.mark.parametrize("flags, cls", [(BF16_VNNI_FLAGS, AVX512_BF16), (AMX_FLAGS, AMX)])
def test_native_bf16_cpus_take_int8_only_where_measured_clearly_faster(flags, cls):
    faster = choose_arithmetic("cpu", "auto", "auto", flags, measurements={"bfloat16": 400, "int8": 600})
    assert (faster.cpu_class, faster.weight_dtype, faster.large_batch_gemm) == (cls, torch.float32, "int8")
    assert faster.reason == "the int8 GEMM ran 1.50x the bf16 GEMM's rate in a startup measurement"
    assert faster.to_dict()["large_batch_gemm"] == "int8" and "prefill and large batches int8 GEMM" in \
        faster.describe()
    # the rest of the automatic plan stays: bf16 K/V, bf16 prefill attention, Q8_0 blocks for small batches
    assert (faster.kv_dtype, faster.prefill_attention, faster.small_batch_quantization) == (
        torch.bfloat16, "bfloat16", "q8_0")
    # a tie, or a gain under INT8_MIN_GAIN, keeps bf16 and says what was measured
    for int8_rate in (300, 400, 400 * INT8_MIN_GAIN - 1):
        close = choose_arithmetic("cpu", "auto", "auto", flags, measurements={"bfloat16": 400, "int8": int8_rate})
        assert close.large_batch_gemm == "bfloat16" and "startup measurement" in close.reason
    assert choose_arithmetic("cpu", "auto", "auto", flags, measurements={"bfloat16": 400,
                                                                        "int8": 400 * INT8_MIN_GAIN}).large_batch_gemm \
        == "int8"
    unmeasured = choose_arithmetic("cpu", "auto", "auto", flags, measurements={"int8": 600})
    assert (unmeasured.large_batch_gemm, unmeasured.reason) == ("bfloat16", "the CPU has native bf16 dot products")
    # measurements never override an explicit --cpu-gemm or --dtype
    for dtype, gemm, expected in [("auto", "bfloat16", "bfloat16"), ("auto", "float32", "float32"),
                                  ("float32", "auto", "float32"), ("bfloat16", "auto", "bfloat16")]:
        plan = choose_arithmetic("cpu", dtype, gemm, flags, measurements={"bfloat16": 1, "int8": 99, "float32": 1})
        assert plan.large_batch_gemm == expected
    # nor the AVX2 class's float32
    assert choose_arithmetic("cpu", "auto", "auto", AVX2_FLAGS,
                             measurements={"float32": 1, "bfloat16": 1, "int8": 99}).large_batch_gemm == "float32"


def test_float32_measured_faster_than_bf16_serves_large_batches():
    """An AVX512-BF16 CPU whose bf16 dot products run slower than its float32 FMAs (an Intel server part that hides
    its AMX units): the measured float32 GEMM takes large batches, and the blocks of a plain checkpoint, which stay
    its only copy, feed the float32 GEMM; int8 still needs its 1.1x over the faster of the two."""
    plan = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS,
                             measurements={"float32": 300, "bfloat16": 160, "int8": 280})
    assert (plan.large_batch_gemm, plan.block_gemm) == ("float32", "float32")
    assert plan.reason.startswith("the float32 GEMM ran 1.88x the bf16 GEMM's rate in a startup measurement")
    assert (plan.small_batch_quantization, plan.large_batch_weights) == ("q8_0", "blocks")
    assert "the float32 GEMM over them" in plan.describe()
    assert plan.prefill_attention == "float32" and plan.kv_dtype == torch.bfloat16
    faster_int8 = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS,
                                    measurements={"float32": 300, "bfloat16": 160, "int8": 400})
    assert (faster_int8.large_batch_gemm, faster_int8.block_gemm) == ("int8", "float32")
    assert faster_int8.reason == "the int8 GEMM ran 1.33x the float32 GEMM's rate in a startup measurement"
    bf16 = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS,
                             measurements={"float32": 190, "bfloat16": 840, "int8": 900})
    assert (bf16.large_batch_gemm, bf16.block_gemm, bf16.reason) == (
        "bfloat16", "bfloat16", "the CPU has native bf16 dot products (the int8 GEMM ran 1.07x its rate in a startup "
                                "measurement)")


def test_gemms_to_measure_per_cpu_class():
    """Only what the flags leave open is measured: bf16 against int8 on native-bf16 CPUs with integer dot products
    (and float32 against both where the bf16 dot products are AVX512-BF16's, without AMX: some such CPUs multiply
    float32 faster), float32 against bf16 on CPUs of no known class; nothing with an explicit --dtype / --cpu-gemm or
    off CPU."""
    assert gemms_to_measure("cpu", "auto", "auto", BF16_VNNI_FLAGS) == ("float32", "bfloat16", "int8")
    assert gemms_to_measure("cpu", "auto", "auto", AMX_FLAGS) == ("bfloat16", "int8")
    no_vnni = [f for f in BF16_VNNI_FLAGS if f != "avx512_vnni"]
    assert gemms_to_measure("cpu", "auto", "auto", no_vnni) == ("float32", "bfloat16")
    assert gemms_to_measure("cpu", "auto", "auto", [*no_vnni, "avx_vnni"]) == ("float32", "bfloat16", "int8")
    # AVX512-VNNI without bf16 (Cascade Lake, Ice Lake): int8 against float32; an AVX2-only CPU measures nothing
    assert gemms_to_measure("cpu", "auto", "auto", VNNI_NO_BF16_FLAGS) == ("float32", "int8")
    assert gemms_to_measure("cpu", "auto", "auto", AVX2_FLAGS) == ()
    assert gemms_to_measure("cpu", "auto", "auto", [*AVX2_FLAGS, "avx_vnni"]) == ()
    assert gemms_to_measure("cpu", "auto", "auto", ["fpu"]) == ("float32", "bfloat16")
    assert gemms_to_measure("cpu", "auto", "auto", ["fp", "asimd", "bf16", "i8mm"], machine="aarch64") == ()
    for dtype, gemm in [("float32", "auto"), ("bfloat16", "auto"), ("auto", "bfloat16"), ("auto", "int8")]:
        assert gemms_to_measure("cpu", dtype, gemm, BF16_VNNI_FLAGS) == ()
        assert gemms_to_measure("cpu", dtype, gemm, VNNI_NO_BF16_FLAGS) == ()
    assert gemms_to_measure("cuda", "auto", "auto", AMX_FLAGS) == ()


def test_avx512_vnni_cpu_without_bf16_takes_int8_only_where_measured_clearly_faster():
    faster = choose_arithmetic("cpu", "auto", "auto", VNNI_NO_BF16_FLAGS, measurements={"float32": 100, "int8": 250})
    assert (faster.cpu_class, faster.large_batch_gemm) == (AVX2, "int8")
    assert faster.reason == "the int8 GEMM ran 2.50x the float32 GEMM's rate in a startup measurement"
    # bf16 K/V as on every AVX2-or-better CPU; float32 prefill attention (no bf16 dot products); int8 GGUF activations
    assert (faster.kv_dtype, faster.prefill_attention, faster.gguf_activations) == (torch.bfloat16, "float32", "int8")
    assert faster.small_batch_quantization == "q8_0" and faster.small_batch_max_rows == 64
    slower = choose_arithmetic("cpu", "auto", "auto", VNNI_NO_BF16_FLAGS, measurements={"float32": 100, "int8": 105})
    assert slower.large_batch_gemm == "float32"
    assert slower.reason == "no native bf16 on this CPU (the int8 GEMM ran 1.05x its rate in a startup measurement)"
    assert (slower.small_batch_quantization, slower.small_batch_max_rows) == ("none", 64)
    # a bf16 measurement is not a candidate there
    assert choose_arithmetic("cpu", "auto", "auto", VNNI_NO_BF16_FLAGS,
                             measurements={"float32": 1, "bfloat16": 99}).large_batch_gemm == "float32"


def test_large_batch_gemm_measurement_times_each_method():
    """The real methods on a small MLP: a positive rate for each (int8 runs its exact float32 form where the CPU has
    no integer dot products, bf16 is emulated where it has no native bf16)."""
    rates = gm.measure_large_batch_gemms(["float32", "bfloat16", "int8"], mlp=(64, 160), rows=(17, 40), rounds=2)
    assert set(rates) == {"float32", "bfloat16", "int8"}
    assert all(r > 0 for r in rates.values()), rates


def test_a_gemm_that_cannot_run_is_left_out(monkeypatch):
    """A torch build whose int8 (or bf16) matmul raises on this CPU: the measurement leaves that GEMM out and the
    plan decides as if it had not been measured, instead of failing the server's start."""
    real = gm.method_factory

    def unsupported(weight):
        raise RuntimeError("_int_mm is not supported on this CPU")

    def factory(gemm):
        return unsupported if gemm == "int8" else real(gemm)

    monkeypatch.setattr(gm, "method_factory", factory)
    rates = gm.measure_large_batch_gemms(["bfloat16", "int8"], mlp=(64, 160), rows=(17, 40), rounds=2)
    assert list(rates) == ["bfloat16"] and rates["bfloat16"] > 0
    plan = choose_arithmetic("cpu", "auto", "auto", BF16_VNNI_FLAGS, measurements=rates)
    assert (plan.large_batch_gemm, plan.reason) == ("bfloat16", "the CPU has native bf16 dot products")


def test_plan_for_this_machine_measures_on_the_model_shapes(monkeypatch, tmp_path):
    monkeypatch.setenv(gm.MEASUREMENT_DIR_ENV, str(tmp_path))
    calls = []

    def fake_measure(gemms, mlp):
        calls.append((tuple(gemms), mlp, torch.get_num_threads()))
        return {"bfloat16": 100.0, "int8": 180.0}

    threads = torch.get_num_threads()
    monkeypatch.setattr(gm, "measure_large_batch_gemms", fake_measure)
    monkeypatch.setattr(gm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gm, "read_cpu_flags", lambda: frozenset(BF16_VNNI_FLAGS))
    config = tiny_config("llama")
    plan = gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, threads=1)
    assert plan.large_batch_gemm == "int8" and "1.80x" in plan.reason
    assert calls == [(("float32", "bfloat16", "int8"), (config.hidden_size, config.intermediate_size), 1)]
    assert torch.get_num_threads() == threads
    # a node of a multi-node server decides from the flags alone
    unmeasured = gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, measure=False)
    assert (unmeasured.large_batch_gemm, unmeasured.reason) == ("bfloat16", "the CPU has native bf16 dot products")
    # flags that settle it, or an explicit choice: nothing measured
    assert gm.plan_for_this_machine("cpu", "auto", "bfloat16", hf_config=config).large_batch_gemm == "bfloat16"
    monkeypatch.setattr(gm, "read_cpu_flags", lambda: frozenset(AVX2_FLAGS))
    assert gm.plan_for_this_machine("cpu", "auto", "auto").large_batch_gemm == "float32"
    assert len(calls) == 1


@pytest.mark.parametrize("flags, gemm",
                         [(AVX2_FLAGS, "float32"), (BF16_VNNI_FLAGS, "float32"), (AMX_FLAGS, "bfloat16")])
def test_an_embedding_model_takes_the_gemm_its_cpu_flags_settle(monkeypatch, flags, gemm):
    """An embedding model's vectors go to the user as they are: its GEMM is settled by the CPU flags (never the
    int8 GEMM, never a startup timing that may flip between two starts), unless --dtype / --cpu-gemm say otherwise."""
    from sglang.srt.model_loader import gemm_measurement

    monkeypatch.setattr(gemm_measurement, "read_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(gemm_measurement, "measure_large_batch_gemms",
                        lambda *a, **k: pytest.fail("an embedding model's plan must not time GEMMs"))
    plan = gemm_measurement.plan_for_this_machine("cpu", "auto", "auto", embedding=True)
    assert plan.large_batch_gemm == gemm and "embedding model" in plan.reason
    assert gemm_measurement.plan_for_this_machine("cpu", "auto", "int8", embedding=True).large_batch_gemm == "int8"


def test_the_measurement_is_kept_so_two_starts_make_the_same_plan(monkeypatch, tmp_path):
    """The first start measures and keeps the rates; a later start on the same machine, threads and shapes reads
    them instead of timing again (so both take the same GEMM), a different thread count measures anew, a damaged
    file is measured again, and `none` keeps nothing."""
    rates = iter([{"bfloat16": 100.0, "int8": 180.0}, {"bfloat16": 100.0, "int8": 50.0},
                  {"bfloat16": 100.0, "int8": 50.0}, {"bfloat16": 100.0, "int8": 50.0}])
    calls = []

    def fake_measure(gemms, mlp):
        calls.append(mlp)
        return next(rates)

    monkeypatch.setenv(gm.MEASUREMENT_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(gm, "measure_large_batch_gemms", fake_measure)
    monkeypatch.setattr(gm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gm, "read_cpu_flags", lambda: frozenset(BF16_VNNI_FLAGS))
    config = tiny_config("llama")
    first = gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, threads=1)
    second = gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, threads=1)
    assert first.large_batch_gemm == second.large_batch_gemm == "int8" and len(calls) == 1
    kept = list(tmp_path.glob("*/rates.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["rates"] == {"bfloat16": 100.0, "int8": 180.0}
    # two threads: another key, measured (and now int8 is slower there)
    assert gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, threads=2).large_batch_gemm == "bfloat16"
    assert len(calls) == 2
    kept[0].write_text("{not json")
    assert gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, threads=1).large_batch_gemm == "bfloat16"
    monkeypatch.setenv(gm.MEASUREMENT_DIR_ENV, "none")
    gm.plan_for_this_machine("cpu", "auto", "auto", hf_config=config, threads=1)
    assert len(calls) == 4

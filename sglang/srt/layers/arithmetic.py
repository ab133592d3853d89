"""Which arithmetic each phase uses, chosen once at startup from the CPU's instruction set.

No single dtype is fastest everywhere. On a CPU with native bf16 dot products (AVX512-BF16, AMX) a bf16 GEMM
through oneDNN runs ~4x faster than float32 (benchmarks/RESULTS.md), while on an AVX2-only CPU bf16 and int8
matmuls are emulated and 8-60x slower than float32. Small decode batches are bound by reading the weights, not by
arithmetic, and run best on the GGUF blocks and the fused decode step, which compute in float32.

So on CPU `--dtype auto` keeps float32 weights and one KV cache layout that every path reads and writes, and
picks, per CPU class, the GEMM for prefill, extend and decode batches above `--gguf-kernel-max-rows` rows:
bf16 where the CPU has native bf16, float32 otherwise. Where the CPU also has integer dot products (VNNI, AMX-INT8;
for float32, on AVX512 CPUs), the int8 GEMM (layers/int8_linear.py) replaces that GEMM if a startup measurement on
the model's shapes finds it at least `INT8_MIN_GAIN` times as fast (`gemms_to_measure`,
model_loader/gemm_measurement.py). `--cpu-gemm` overrides that choice; `--dtype bfloat16` / `float32` still load
the model in that dtype.

The GGUF block kernels of small batches (and the fused decode step) multiply float32 activations by default. On a
CPU with AVX512-VNNI, `--gguf-activations auto` quantizes the activations to int8 per 32-value block instead
(layers/quantization/csrc/gguf_int8.h, llama.cpp's method): the dot products run as VNNI integer instructions, 1.5x
faster at batch 1 and ~3x at 16-64 rows (benchmarks/RESULTS.md), at a relative error of ~0.5% per dot product.
An explicit `--dtype float32` or `--cpu-gemm float32` keeps float32 activations too (float32 arithmetic
throughout, as the transformers reference computes).

A checkpoint without GGUF blocks (plain safetensors) gets Q8_0 blocks quantized at load for its small batches
(`--small-batch-quantization auto|none|q8_0|q4_1`, model_loader/q8_blocks.py), which brings it the fused decode step:
by default where large batches already run a reduced-precision GEMM (bf16 on CPUs with native bf16), so a
float32 plan stays float32 everywhere; `q8_0` asks for it on any CPU. `q4_1` (asked for only) reads 0.625 bytes per
weight instead of 1.0625, at an accuracy cost stated in benchmarks/RESULTS.md.

`--kv-cache-dtype auto` stores K/V in bf16 where the plan is automatic on a CPU with native bf16 (late in a long
generation K/V are most of the bytes a decode step reads), in the model dtype elsewhere (`choose_kv_cache_dtype`).

Prefill and extend attention over bf16 K/V multiplies with AVX512-BF16 dot products where the CPU has them and the
plan is not float32 (`prefill_attention`, layers/csrc/extend_attention_bf16.h; `--prefill-attention` overrides): the
scaled queries and the softmax weights are rounded to bf16 like a bf16 GEMM's inputs, 1.7-2x faster than the float32
kernel (benchmarks/RESULTS.md, 2026-11-25). Elsewhere the kernel computes in float32.

Where such a checkpoint's blocks are made and the CPU has native bf16, they are its only weights
(`--large-batch-weights auto|blocks|dense`, `choose_large_batch_weights`): large batches convert them a slab at a
time for the float32 or bf16 GEMM, whichever is faster (`block_gemm`; layers/quantization/block_gemm.py), instead of
keeping a float32 copy and a GEMM copy. On a CPU with AVX512-BF16 but no AMX the startup measurement also times the
float32 GEMM against the bf16 one: some such CPUs multiply float32 faster.

`choose_arithmetic` is a pure function of its inputs (CPU flags, measurements) so every CPU class can be tested on
any machine (the classes: layers/cpu_classes.py); `read_cpu_flags` (model_loader/dtype.py) is the one place that
reads /proc/cpuinfo, and
model_loader/gemm_measurement.py measures and makes this machine's plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional, Union

import torch

from sglang.srt.layers.cpu_classes import (
    AMX,
    AVX2,
    AVX512_BF16,
    BF16_DOT_FLAGS,
    NATIVE_BF16_CLASSES,
    OTHER,
    VNNI_FLAGS,
    cpu_class,
    int8_matmul_native,
    is_x86,
)
from sglang.srt.layers.small_batch_rows import one_term_rows, small_batch_rows
from sglang.srt.mem_cache.kv_dtype import resolve_kv_cache_dtype
from sglang.srt.model_loader.dtype import dtype_name, resolve_dtype

CPU_GEMMS = ("auto", "float32", "bfloat16", "int8")
GGUF_ACTIVATIONS = ("auto", "float32", "int8")
SMALL_BATCH_QUANTIZATIONS = ("auto", "none", "q8_0", "q4_1")
LARGE_BATCH_WEIGHTS = ("auto", "blocks", "dense")
PREFILL_ATTENTIONS = ("auto", "float32", "bfloat16")
@dataclass(frozen=True)
class ArithmeticPlan:
    device: str
    cpu_class: str  # "" on accelerators
    weight_dtype: torch.dtype  # what the model is loaded in
    # GEMM for prefill / extend / decode batches above the small-batch row limit: float32 | bfloat16 | int8
    large_batch_gemm: str
    reason: str
    # the float GEMM that large batches run over quantized blocks (layers/quantization/block_gemm.py): the faster of
    # float32 / bf16 (large_batch_gemm itself unless that is int8, which needs a copy of its own)
    block_gemm: str = "bfloat16"
    # --kv-cache-dtype resolved (choose_kv_cache_dtype); None: the KV cache uses the weight dtype
    kv_cache_dtype: Optional[torch.dtype] = None
    kv_cache_dtype_reason: str = ""
    # activations of the GGUF block kernels (small batches, fused decode step): float32 | int8
    gguf_activations: str = "float32"
    gguf_activations_reason: str = ""
    # blocks made at load for the small batches of a model without GGUF blocks: none | q8_0 | q4_1
    small_batch_quantization: str = "none"
    # what the large batches of such a checkpoint read: blocks (no float weights: the Q8_0 blocks through the
    # block_gemm GEMM, or an int8 copy where int8 is the large-batch GEMM) | dense (float32 weights and the
    # large-batch GEMM's own copy)
    large_batch_weights: str = "dense"
    large_batch_weights_reason: str = ""
    # the most rows a matmul (and a decode batch, in the fused step) takes on the quantized blocks; above it the
    # large-batch GEMM and the layer-by-layer path. --gguf-kernel-max-rows overrides it.
    small_batch_max_rows: int = 64
    # from how many rows int8 block matmuls take the one-term form of their input (0: never; small_batch_rows.py)
    int8_one_term_rows: int = 0
    # what prefill / extend attention multiplies over the K/V cache: bfloat16 (dot products) | float32
    prefill_attention: str = "float32"
    prefill_attention_reason: str = ""

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.weight_dtype

    def describe(self) -> str:
        dtype = dtype_name(self.weight_dtype)
        kv = dtype_name(self.kv_dtype)
        stored = (f"weights and KV cache {dtype}" if kv == dtype
                  else f"weights {dtype}, KV cache {kv} ({self.kv_cache_dtype_reason})")
        where = f"CPU class {self.cpu_class}" if self.cpu_class else self.device
        return (f"Arithmetic: {where}; {stored}; prefill and large batches "
                f"{self.large_batch_gemm} GEMM ({self.reason}); GGUF blocks with {self.gguf_activations} "
                f"activations ({self.gguf_activations_reason}{self._one_term()}) up to {self.small_batch_max_rows} "
                "rows; "
                f"checkpoints without GGUF blocks: {self._plain_checkpoints()}; "
                f"prefill attention {self.prefill_attention} ({self.prefill_attention_reason})")

    def _one_term(self) -> str:
        rows = self.int8_one_term_rows
        return f"; one term per block and each tile's largest columns in float32 from {rows} rows" if rows else ""

    def _plain_checkpoints(self) -> str:
        if self.large_batch_weights == "blocks":
            if self.large_batch_gemm == "int8":
                return (f"{self.small_batch_quantization} blocks for small batches and an int8 copy for large ones, "
                        f"no float weights ({self.large_batch_weights_reason})")
            name = "bf16" if self.block_gemm == "bfloat16" else self.block_gemm
            return (f"{self.small_batch_quantization} blocks for every batch, the {name} GEMM over them for large "
                    f"ones ({self.large_batch_weights_reason})")
        return f"{self.small_batch_quantization} blocks for small batches"

    def to_dict(self) -> dict[str, Union[str, int]]:
        return {
            "cpu_class": self.cpu_class,
            "weight_dtype": dtype_name(self.weight_dtype),
            "kv_cache_dtype": dtype_name(self.kv_dtype),
            "kv_cache_dtype_reason": self.kv_cache_dtype_reason,
            "large_batch_gemm": self.large_batch_gemm,
            "reason": self.reason,
            "gguf_activations": self.gguf_activations,
            "gguf_activations_reason": self.gguf_activations_reason,
            "small_batch_quantization": self.small_batch_quantization,
            "large_batch_weights": self.large_batch_weights,
            "large_batch_weights_reason": self.large_batch_weights_reason,
            "block_gemm": self.block_gemm,
            "small_batch_max_rows": self.small_batch_max_rows,
            "int8_one_term_rows": self.int8_one_term_rows,
            "prefill_attention": self.prefill_attention,
            "prefill_attention_reason": self.prefill_attention_reason,
        }


def automatic(dtype: str, cpu_gemm: str = "auto") -> bool:
    """Whether --dtype (and --cpu-gemm) leave the arithmetic to the plan."""
    return dtype.strip().lower() == "auto" and cpu_gemm == "auto"


def _fastest_measured(candidates: list[str], measurements: Mapping[str, float]) -> Optional[str]:
    measured = [(measurements[g], g) for g in candidates if g in measurements]
    return max(measured)[1] if measured else None


# How much faster than the bf16 GEMM the int8 GEMM must measure to be chosen: it moves a prefill's log-probabilities
# a little more than bf16 does (benchmarks/RESULTS.md, 2026-11-26 evening: up to 0.11 against 0.04), so a tie or
# the noise of a short measurement keeps bf16.
INT8_MIN_GAIN = 1.1


def _gain(measurements: Mapping[str, float], new: str, old: str) -> Optional[float]:
    """How many times `old`'s measured rate `new` ran, where both were measured."""
    if new in measurements and old in measurements and measurements[old] > 0:
        return measurements[new] / measurements[old]
    return None


def choose_gguf_activations(on_cpu: bool, device: str, dtype: str = "auto", cpu_gemm: str = "auto",
                            gguf_activations: str = "auto", cpu_flags: Iterable[str] = (),
                            machine: str = "x86_64") -> tuple[str, str]:
    """(activations, reason): the GGUF block kernels' activations, int8 or float32 (the plan's choice; also what a
    speculative verify row costs: int8 rows add little to a step, float32 rows nearly a step's arithmetic)."""
    if gguf_activations != "auto":
        return gguf_activations, f"--gguf-activations {gguf_activations}"
    if not on_cpu:
        return "float32", f"the GGUF kernels run on CPU only, not {device}"
    if not automatic(dtype):
        return "float32", f"--dtype {dtype}"
    if cpu_gemm == "float32":
        return "float32", "--cpu-gemm float32 asks for float32 arithmetic"
    if is_x86(machine) and VNNI_FLAGS <= frozenset(cpu_flags):
        return "int8", "the CPU has AVX512-VNNI integer dot products"
    return "float32", "no AVX512-VNNI on this CPU: float32 FMAs are the faster kernels"


def choose_arithmetic(
    device: str,
    dtype: str = "auto",
    cpu_gemm: str = "auto",
    cpu_flags: Iterable[str] = (),
    machine: str = "x86_64",
    measurements: Optional[Mapping[str, float]] = None,
    config_dtype: Union[str, torch.dtype, None] = None,
    gguf_activations: str = "auto",
    small_batch_quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    prefill_attention: str = "auto",
    large_batch_weights: str = "auto",
    linear_float_bytes: Optional[int] = None,
    quantized_checkpoint: bool = False,
    gguf_checkpoint: bool = False,
    gguf_blocks: Optional[str] = None,
) -> ArithmeticPlan:
    """The arithmetic for a server: model dtype, the large-batch GEMM, the GGUF kernels' activations, the blocks
    made for a checkpoint without GGUF blocks and the KV cache dtype.

    `measurements` maps GEMM names to measured throughput (any unit); it decides only where the CPU flags do not:
    between float32 and bfloat16 on a CPU this function does not classify, and between int8 and the GEMM the flags
    pick where the CPU has integer dot products (`gemms_to_measure`; int8 only at `INT8_MIN_GAIN` times that GEMM's
    rate or more).

    `quantized_checkpoint`: the checkpoint's linear weights are quantized (GPTQ / AWQ / compressed-tensors integers,
    FP8, or quantized at load by --quantization). Blocks made from them then serve small batches on every CPU class
    (AVX2 included, whose float32 plan otherwise keeps a float checkpoint of under DENSE_BELOW_FLOAT_BYTES of float32
    linear weights dense; `linear_float_bytes`). `gguf_checkpoint`: a GGUF file,
    whose own blocks serve small batches whatever `small_batch_quantization` says (that setting then only concerns a
    float checkpoint a weight update may bring). For either, large batches read the blocks too where the model is not
    small: the user chose the quantized format for its size, and a dense float32 copy would hold 4 bytes per weight.
    `gguf_blocks`: the block type most of the GGUF file's weights are served as ("Q4_1" / "Q8_0"; None: unknown).
    A speculative server plans as any other: its verify steps compute without the one-term form
    (gguf_linear.rows_alone, and the fused step on rows that share sequences).
    """
    if gguf_activations not in GGUF_ACTIVATIONS:
        raise ValueError(f"--gguf-activations must be one of {GGUF_ACTIVATIONS}, got {gguf_activations!r}")
    if prefill_attention not in PREFILL_ATTENTIONS:
        raise ValueError(f"--prefill-attention must be one of {PREFILL_ATTENTIONS}, got {prefill_attention!r}")
    if small_batch_quantization not in SMALL_BATCH_QUANTIZATIONS:
        raise ValueError(f"--small-batch-quantization must be one of {SMALL_BATCH_QUANTIZATIONS}, "
                         f"got {small_batch_quantization!r}")
    if large_batch_weights not in LARGE_BATCH_WEIGHTS:
        raise ValueError(f"--large-batch-weights must be one of {LARGE_BATCH_WEIGHTS}, got {large_batch_weights!r}")
    flags = frozenset(cpu_flags)
    plan = _choose_gemm(device, dtype, cpu_gemm, flags, machine, measurements, config_dtype)
    act, why = choose_gguf_activations(plan.cpu_class != "", device, dtype, cpu_gemm, gguf_activations, flags, machine)
    if small_batch_quantization == "auto":
        # where a reduced-precision GEMM already serves large batches, or the automatic plan of a CPU with native bf16
        # measured float32 faster, or an AVX2 CPU's automatic plan for a model that is not small (its blocks then serve
        # every batch: one copy of the weights); a float32 plan asked for stays float32
        native = automatic(dtype, cpu_gemm) and plan.cpu_class in NATIVE_BF16_CLASSES
        large = automatic(dtype, cpu_gemm) and avx2_large(plan, linear_float_bytes)
        on = plan.cpu_class != "" and plan.weight_dtype == torch.float32 and (
            plan.large_batch_gemm != "float32" or native or quantized_checkpoint or large)
        small_batch_quantization = "q8_0" if on else "none"
    elif small_batch_quantization != "none" and (plan.cpu_class == "" or plan.weight_dtype != torch.float32):
        raise ValueError(f"--small-batch-quantization {small_batch_quantization} needs float32 weights on CPU "
                         "(--dtype auto or float32)")
    if plan.large_batch_gemm in ("float32", "bfloat16"):
        plan = dataclasses.replace(plan, block_gemm=plan.large_batch_gemm)
    elif plan.cpu_class not in NATIVE_BF16_CLASSES:
        plan = dataclasses.replace(plan, block_gemm="float32")
    kv, kv_why = choose_kv_cache_dtype(kv_cache_dtype, plan, dtype, cpu_gemm)
    weights, weights_why = choose_large_batch_weights(large_batch_weights, plan, small_batch_quantization,
                                                      linear_float_bytes, quantized_checkpoint or gguf_checkpoint,
                                                      gguf_checkpoint)
    plan = dataclasses.replace(plan, gguf_activations=act, gguf_activations_reason=why,
                               small_batch_quantization=small_batch_quantization, large_batch_weights=weights,
                               large_batch_weights_reason=weights_why, kv_cache_dtype=kv, kv_cache_dtype_reason=kv_why)
    if gguf_checkpoint:
        blocks = gguf_blocks.lower() if gguf_blocks else None
    else:
        blocks = None if quantized_checkpoint or small_batch_quantization == "none" else small_batch_quantization
    one_term = one_term_rows(act, linear_float_bytes)
    plan = dataclasses.replace(plan, int8_one_term_rows=one_term)
    rows = small_batch_rows(plan, flags, act, linear_float_bytes, blocks)
    plan = dataclasses.replace(plan, small_batch_max_rows=rows)
    attention, attention_why = choose_prefill_attention(plan, flags, machine, prefill_attention)
    return dataclasses.replace(plan, prefill_attention=attention, prefill_attention_reason=attention_why)


# Below this many bytes of float32 linear weights (SmolLM2-135M: 0.54 GB) `auto` keeps them dense: converting blocks
# per large batch cost 11-14% of its prefill-heavy throughput (benchmarks/RESULTS.md, 2026-11-27); 360M up: blocks.
DENSE_BELOW_FLOAT_BYTES = 1 << 30


def not_small(linear_float_bytes: Optional[int]) -> bool:
    """Whether a model's float32 linear weights (None: unknown) reach DENSE_BELOW_FLOAT_BYTES."""
    return linear_float_bytes is not None and linear_float_bytes >= DENSE_BELOW_FLOAT_BYTES


def avx2_large(plan: ArithmeticPlan, linear_float_bytes: Optional[int]) -> bool:
    """An AVX2 plan for a model that is not small: its blocks serve every batch (one copy of the weights)."""
    return plan.cpu_class == AVX2 and not_small(linear_float_bytes)


def choose_large_batch_weights(requested: str, plan: ArithmeticPlan, small_batch_quantization: str,
                               linear_float_bytes: Optional[int] = None,
                               quantized_checkpoint: bool = False,
                               gguf_checkpoint: bool = False) -> tuple[str, str]:
    """Whether the large batches of a checkpoint without GGUF blocks multiply its Q8_0 blocks (converted a slab at a
    time for the `block_gemm` GEMM, float32 or bf16: layers/quantization/block_gemm.py) instead of a float32 copy of
    the weights and the large-batch GEMM's own copy. `auto`: blocks wherever the plan makes the blocks and the CPU
    has native bf16: the model then holds ~1.06 bytes per weight instead of 4 + 1.06 + the GEMM copy's 1-2, and runs
    large batches at 0.9-1.04x the rate of the faster dense copy (benchmarks/RESULTS.md, 2026-11-27). Where the int8
    GEMM was measured fastest its copy stays beside the blocks (2.1 bytes per weight in all: the int8 GEMM ran
    2.2x the float32 GEMM there), its outlier columns read from the blocks. A quantized checkpoint's blocks serve
    large batches on every CPU class (float32 slabs on AVX2, whose block kernels already convert each block once
    for all the rows of a batch of 10 rows or more), and so do the blocks of any checkpoint on AVX2 where its float32
    linear weights are not small: a float32 copy would hold 4 bytes per weight, and those kernels beat the float32
    GEMM up to 2,048 rows there."""
    if requested == "dense":
        return "dense", "--large-batch-weights dense"
    if small_batch_quantization == "none" and not gguf_checkpoint:  # a GGUF file brings its own blocks
        if requested == "blocks":
            raise ValueError("--large-batch-weights blocks needs blocks for small batches "
                             "(--small-batch-quantization q8_0 or q4_1, or auto on a CPU with native bf16)")
        return "dense", "no blocks are made for small batches"
    if requested == "blocks":
        return "blocks", "--large-batch-weights blocks"
    if plan.cpu_class not in NATIVE_BF16_CLASSES and not quantized_checkpoint and not avx2_large(
            plan, linear_float_bytes):
        return "dense", ("this CPU class keeps its float32 plan for a model this small" if plan.cpu_class == AVX2
                         else "this CPU class keeps its float32 plan")
    if linear_float_bytes is not None and linear_float_bytes < DENSE_BELOW_FLOAT_BYTES:
        return "dense", f"a float32 copy of {linear_float_bytes / 1e9:.2f} GB is small: the dense GEMM is faster"
    if plan.cpu_class not in NATIVE_BF16_CLASSES and quantized_checkpoint:
        return "blocks", "one copy of the quantized checkpoint's weights"
    return "blocks", "one copy of the weights"


def choose_prefill_attention(plan: ArithmeticPlan, flags: frozenset[str], machine: str,
                             requested: str = "auto") -> tuple[str, str]:
    """bfloat16 where the compiled CPU kernel can multiply bf16 K/V with AVX512-BF16 dot products and nothing asked
    for float32 arithmetic; float32 otherwise. `--prefill-attention float32` keeps float32; `bfloat16` asks for the
    dot products wherever they can run."""
    if requested == "float32":
        return "float32", "--prefill-attention float32"
    if plan.cpu_class == "":
        return "float32", "accelerators run SDPA in the model dtype"
    if plan.kv_dtype != torch.bfloat16:
        return "float32", f"K/V are {dtype_name(plan.kv_dtype)}"
    if plan.large_batch_gemm == "float32" and requested == "auto":
        return "float32", "float32 GEMMs: float32 arithmetic"
    if not is_x86(machine) or not BF16_DOT_FLAGS <= flags:
        return "float32", "no AVX512-BF16 dot products on this CPU"
    if requested == "bfloat16":
        return "bfloat16", "--prefill-attention bfloat16"
    return "bfloat16", "bf16 K/V and AVX512-BF16 dot products (queries and softmax weights rounded to bf16)"


def choose_kv_cache_dtype(requested: str, plan: ArithmeticPlan, dtype: str = "auto",
                          cpu_gemm: str = "auto") -> tuple[torch.dtype, str]:
    """The K/V element type and why. `--kv-cache-dtype auto` stores bf16 K/V where the whole plan is automatic on an
    x86 CPU with AVX2 or better: late in a long generation, and in every decode batch of many sequences, decode
    attention reads more K/V bytes than weights, and the compiled kernels read bf16 (widened to float32 in
    registers, which even AVX2 does with a shift) at about the same bytes per second as float32, so half the bytes
    is close to half the time (benchmarks/RESULTS.md, 2026-11-24 on AVX512-BF16, 2026-11-25 on AVX2: 1.4-1.6x per
    step at a 3,000-token context, 1.2-1.36x at 16 x 520, 1.07x at 64 x 130, a tie at 16 x 130). Elsewhere (other
    CPUs, accelerators), and with an explicit --dtype or --cpu-gemm, K/V keep the model dtype."""
    if requested != "auto":
        return resolve_kv_cache_dtype(requested, plan.weight_dtype), f"--kv-cache-dtype {requested}"
    bf16_kv_classes = (AMX, AVX512_BF16, AVX2)
    if automatic(dtype, cpu_gemm) and plan.cpu_class in bf16_kv_classes and plan.weight_dtype == torch.float32:
        why = "AVX2 widens bf16 K/V in registers" if plan.cpu_class == AVX2 else "the CPU has native bf16"
        return torch.bfloat16, f"{why}: bf16 K/V halve the bytes decode attention reads"
    return plan.weight_dtype, "the model dtype"


def _choose_gemm(
    device: str,
    dtype: str,
    cpu_gemm: str,
    cpu_flags: frozenset[str],
    machine: str,
    measurements: Optional[Mapping[str, float]],
    config_dtype: Union[str, torch.dtype, None],
) -> ArithmeticPlan:
    if cpu_gemm not in CPU_GEMMS:
        raise ValueError(f"--cpu-gemm must be one of {CPU_GEMMS}, got {cpu_gemm!r}")
    if torch.device(device).type != "cpu":
        weight_dtype = resolve_dtype(dtype, device, config_dtype)
        name = dtype_name(weight_dtype)
        return ArithmeticPlan(device, "", weight_dtype, name, f"--cpu-gemm does not apply on {device}")
    cls = cpu_class(cpu_flags, machine)
    explicit_dtype = not automatic(dtype)
    # --dtype auto on CPU keeps float32 weights: the quantized blocks and the fused decode step need them, and
    # the large-batch GEMM is chosen separately below.
    weight_dtype = resolve_dtype(dtype, device, config_dtype) if explicit_dtype else torch.float32
    if weight_dtype != torch.float32:
        name = dtype_name(weight_dtype)
        if cpu_gemm not in ("auto", name):
            raise ValueError(f"--cpu-gemm {cpu_gemm} needs float32 weights (--dtype auto or float32), "
                             f"got --dtype {dtype}")
        return ArithmeticPlan(device, cls, weight_dtype, name, f"--dtype {dtype}")
    if cpu_gemm != "auto":
        return ArithmeticPlan(device, cls, weight_dtype, cpu_gemm, f"--cpu-gemm {cpu_gemm}")
    if explicit_dtype:
        return ArithmeticPlan(device, cls, weight_dtype, "float32", f"--dtype {dtype}")
    if cls == OTHER:
        fastest = _fastest_measured(["float32", "bfloat16"], measurements or {})
        if fastest is not None:
            return ArithmeticPlan(device, cls, weight_dtype, fastest, "fastest in a startup measurement")
        return ArithmeticPlan(device, cls, weight_dtype, "float32", "unclassified CPU, nothing measured")
    int8_open = "int8" in gemms_to_measure(device, dtype, cpu_gemm, cpu_flags, machine)
    if cls in NATIVE_BF16_CLASSES:
        base, why = "bfloat16", "the CPU has native bf16 dot products"
        over = _gain(measurements or {}, "float32", "bfloat16")
        if over is not None and over > 1:
            base, why = "float32", f"the float32 GEMM ran {over:.2f}x the bf16 GEMM's rate in a startup measurement"
    elif int8_open:
        base, why = "float32", "no native bf16 on this CPU"
    else:
        base, why = "float32", "no native bf16 on this CPU: bf16 and int8 GEMMs are emulated and slower"
    gain = _gain(measurements or {}, "int8", base) if int8_open else None
    name = "bf16" if base == "bfloat16" else base
    if gain is not None and gain >= INT8_MIN_GAIN:
        return ArithmeticPlan(device, cls, weight_dtype, "int8",
                              f"the int8 GEMM ran {gain:.2f}x the {name} GEMM's rate in a startup measurement",
                              block_gemm=base)
    measured = "" if gain is None else f" (the int8 GEMM ran {gain:.2f}x its rate in a startup measurement)"
    return ArithmeticPlan(device, cls, weight_dtype, base, why + measured)


def embedding_gemm(device: str, dtype: str, cpu_gemm: str, flags: Iterable[str],
                   machine: str = "x86_64") -> Optional[tuple[str, str]]:
    """(GEMM, reason) for an embedding model where --dtype and --cpu-gemm leave it open on a CPU, else None.

    Its vectors are returned to the user as they are, not sampled: two starts of one server must give the same
    vectors, and a startup timing that flips between GEMMs under load would not (nor would the int8 GEMM's
    per-token rounding, ~1e-2 relative, suit them). So the CPU flags settle it: bf16 where the CPU has AMX tiles
    (several times float32 there), float32 everywhere else."""
    if torch.device(device).type != "cpu" or not automatic(dtype, cpu_gemm):
        return None
    if cpu_class(frozenset(flags), machine) == AMX:
        return "bfloat16", "embedding model: bf16 on AMX tiles, chosen by the CPU flags (the same vectors every start)"
    return "float32", "embedding model: float32, chosen by the CPU flags (the same vectors every start)"


def gemms_to_measure(device: str, dtype: str, cpu_gemm: str, flags: Iterable[str],
                     machine: str = "x86_64") -> tuple[str, ...]:
    """The large-batch GEMMs whose order the CPU flags leave open, which the plan measures at startup
    (model_loader/gemm_measurement.py); () where the flags settle it, or --dtype / --cpu-gemm do:
    - float32 against bf16 on a CPU of no known class, and on an x86 CPU with AVX512-BF16 but no AMX, whose bf16 dot
      products may be slower than its float32 FMAs (an Intel server part that hides its AMX units: 0.5x; AMD Zen 4:
      ~4x; benchmarks/RESULTS.md, 2026-11-27);
    - on an x86 CPU with integer dot products that torch._int_mm uses (AVX512-VNNI, AVX-VNNI, AMX-INT8), the int8
      GEMM against the GEMM the flags pick (or those two): bf16 where the CPU has native bf16, float32 on an
      AVX512 CPU without it (AVX512-VNNI without BF16: Cascade Lake, Ice Lake). A CPU whose widest FMAs are AVX2's
      keeps float32, whose blocks serve up to 2,048 rows there (`small_batch_rows`)."""
    flags = frozenset(flags)
    if torch.device(device).type != "cpu" or not automatic(dtype, cpu_gemm):
        return ()
    cls = cpu_class(flags, machine)
    if cls == OTHER:
        return ("float32", "bfloat16")
    x86_int8 = is_x86(machine) and int8_matmul_native(flags, machine)
    if cls == AVX512_BF16 and is_x86(machine):
        return ("float32", "bfloat16", "int8") if x86_int8 else ("float32", "bfloat16")
    if not x86_int8:
        return ()
    if cls in NATIVE_BF16_CLASSES:
        return ("bfloat16", "int8")
    if cls == AVX2 and "avx512f" in flags:
        return ("float32", "int8")
    return ()

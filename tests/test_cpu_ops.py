"""The compiled CPU decode kernels against their torch equivalents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_ops
from sglang.srt.layers.cpu_ops import paged_decode_attention
from sglang.srt.mem_cache.kv_dtype import KERNEL_KV_DTYPES
from sglang.srt.mem_cache.kv_pool import KVPool

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain for the CPU kernels")


def laid_out(t: torch.Tensor, head_major: bool) -> torch.Tensor:
    """The same [slots, kv_heads, D] values in head-major storage (as the engine's CPU pool) or contiguous."""
    return t.transpose(0, 1).contiguous().transpose(0, 1) if head_major else t.contiguous()


def reference(q, k, v, idx, lens, scale):
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        keys, values = k[idx[b, :n]].transpose(0, 1), v[idx[b, :n]].transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(
            q[b : b + 1].unsqueeze(2), keys.unsqueeze(0), values.unsqueeze(0), scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])[0, :, 0])
    return torch.stack(outs)


# dim % 8 == 0 takes the AVX2 path, 36 the scalar one. The AVX2 path tiles up to three query heads of a group
# (groups of 1, 2, 3, 4 = 3 + 1, 5 = 3 + 2, 7 = 3 + 3 + 1, 8 = 3 + 3 + 2) over column chunks of 4-8 vectors with a
# narrower last one (48, 80 and 128 channels), and scores four tokens at a time with a remainder (the lengths).
# magnitude 8 makes the scores span hundreds of units, so most softmax weights underflow.
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim,magnitude",
                         [(9, 3, 64, 1.0), (4, 4, 32, 1.0), (8, 1, 128, 1.0), (6, 2, 80, 1.0), (2, 1, 36, 1.0),
                          (9, 3, 64, 8.0), (8, 2, 64, 1.0), (5, 1, 48, 1.0), (14, 2, 64, 1.0), (4, 2, 128, 1.0)])
def test_matches_sdpa(heads, kv_heads, dim, magnitude, head_major):
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    slots, batch, width = 700, 7, 90
    k = magnitude * torch.randn(slots, kv_heads, dim, generator=gen)
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    q = torch.randn(batch, heads, dim, generator=gen)
    lens = torch.tensor([1, 90, 33, 2, 64, 17, 89])
    idx = torch.randint(0, slots, (batch, width), generator=gen)
    out = paged_decode_attention(q, laid_out(k, head_major), laid_out(v, head_major), idx, lens, dim**-0.5)
    torch.testing.assert_close(out, reference(q, k, v, idx, lens, dim**-0.5), atol=2e-5, rtol=1e-4)


# bf16 K/V with a head size that is a multiple of 32 (up to 128) takes the AVX512 path where the CPU has it: query
# heads tiled by three over the group, four tokens at a time with a remainder, 64-token blocks (the lengths);
# 80 and 256 channels stay on the AVX2 path. Both paths run on an AVX512 CPU, the AVX2 one alone elsewhere.
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 96), (14, 2, 64),
                                                (5, 1, 64), (2, 1, 80), (4, 1, 256)])
def test_bf16_paths_match_sdpa(avx512, heads, kv_heads, dim, head_major):
    if avx512 and not cpu_ops.has_decode_attention_avx512():
        pytest.skip("this CPU has no AVX512F/BW")
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    slots, width = 900, 260
    k = torch.randn(slots, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(slots, kv_heads, dim, generator=gen).bfloat16()
    lens = torch.tensor([1, 3, 4, 5, 64, 65, 130, 257])
    q = torch.randn(lens.numel(), heads, dim, generator=gen)
    idx = torch.randint(0, slots, (lens.numel(), width), generator=gen)
    previous = cpu_ops.set_decode_attention_avx512(avx512)
    try:
        out = paged_decode_attention(q, laid_out(k, head_major), laid_out(v, head_major), idx, lens, dim**-0.5)
    finally:
        cpu_ops.set_decode_attention_avx512(previous)
    expected = reference(q, k.float(), v.float(), idx, lens, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_rejects_bad_input():
    k = torch.zeros(10, 1, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError):
        paged_decode_attention(q, k, k, torch.tensor([[11]]), torch.tensor([1]), 1.0)  # slot out of range
    with pytest.raises(RuntimeError):
        paged_decode_attention(q, k, k, torch.tensor([[1]]), torch.tensor([2]), 1.0)  # longer than the index row
    with pytest.raises(RuntimeError):
        paged_decode_attention(q.double(), k, k, torch.tensor([[1]]), torch.tensor([1]), 1.0)


def test_rejects_kv_layouts_it_cannot_read_or_write():
    """Any layout with contiguous, non-overlapping rows is read; K and V must share one; rows that overlap (a
    broadcast head) or channels that are not contiguous are refused, by the stores too."""
    q, one = torch.randn(1, 4, 8), torch.tensor([1])
    k = torch.randn(10, 2, 8)
    idx = torch.tensor([[1, 2, 3]])
    expected = paged_decode_attention(q, k, k, idx, torch.tensor([3]), 1.0)
    torch.testing.assert_close(paged_decode_attention(q, laid_out(k, True), laid_out(k, True), idx,
                                                      torch.tensor([3]), 1.0), expected)
    bad = {
        "K and V in different layouts": (laid_out(k, True), k),
        "overlapping rows": (k[:, :1].expand(10, 2, 8), k[:, :1].expand(10, 2, 8)),
        "strided channels": (torch.randn(10, 2, 16)[..., ::2], torch.randn(10, 2, 16)[..., ::2]),
    }
    for kc, vc in bad.values():
        with pytest.raises(RuntimeError, match="K/V buffer|K and V buffers"):
            paged_decode_attention(q, kc, vc, idx, torch.tensor([3]), 1.0)
        with pytest.raises(RuntimeError, match="K/V buffer|K and V buffers"):
            cpu_ops.store_kv(kc, vc, one, torch.randn(1, 2, 8), torch.randn(1, 2, 8))


@pytest.mark.parametrize("rows", [1, 3, 130])
def test_rms_norm_kernels_match_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    residual = torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    expected = F.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), expected, atol=1e-5, rtol=1e-5)
    new_residual = residual + x
    out = cpu_ops.fused_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(residual, new_residual)  # updated in place
    torch.testing.assert_close(out, F.rms_norm(new_residual, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 64, 130])
def test_rms_norm_kernels_read_and_write_bf16(rows):
    """The norms write the bf16 input of a bf16 GEMM (rounded as `.to(torch.bfloat16)` rounds the float32 result)
    and add a bf16 GEMM output into the float32 residual exactly: the same bits as converting around them."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    out = cpu_ops.rms_norm(x, w, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, cpu_ops.rms_norm(x, w, 1e-5).to(torch.bfloat16))
    residual = torch.randn(rows, 576, generator=gen)
    xb = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        expected_residual = residual.clone()
        expected = cpu_ops.fused_add_rms_norm(xb.float(), expected_residual, w, 1e-5).to(out_dtype)
        actual_residual = residual.clone()
        actual = cpu_ops.fused_add_rms_norm(xb, actual_residual, w, 1e-5, out_dtype)
        assert actual.dtype == out_dtype and torch.equal(actual, expected)
        assert actual_residual.dtype == torch.float32 and torch.equal(actual_residual, expected_residual)
    with pytest.raises(RuntimeError):
        cpu_ops.rms_norm(xb, w, 1e-5)  # only the added x may be bf16
    with pytest.raises(RuntimeError):
        cpu_ops.fused_add_rms_norm(x, residual.to(torch.bfloat16), w, 1e-5)
    with pytest.raises(ValueError):
        cpu_ops.rms_norm(x, w, 1e-5, torch.float16)


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("kv_dtype", KERNEL_KV_DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_store_kv_writes_the_pool_bytes(kv_dtype, tokens, head_major):
    """The compiled store converts and scatters k/v (views into a fused qkv output, as the model passes them) to
    exactly the bytes KVPool.set_kv_buffer writes, for every KV dtype, values beyond fp8's range included, in either
    pool layout (the torch store writes a slot-major pool)."""
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim, slots = 9, 3, 64, 400
    qkv = 100 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    qkv[0, heads * dim] = 1e6  # clamped by fp8
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    loc = torch.randperm(slots, generator=gen)[:tokens] + 1
    expected = KVPool(slots, 1, kv_heads, dim, kv_dtype, head_major=False)
    expected.set_kv_buffer(0, loc, k, v)
    actual = KVPool(slots, 1, kv_heads, dim, kv_dtype, head_major=head_major)
    cpu_ops.store_kv(actual.k_buffer[0], actual.v_buffer[0], loc, k, v)
    for a, e in ((actual.k_buffer[0], expected.k_buffer[0]), (actual.v_buffer[0], expected.v_buffer[0])):
        assert torch.equal(a[loc].view(torch.uint8), e[loc].view(torch.uint8))
    with pytest.raises(RuntimeError):
        cpu_ops.store_kv(actual.k_buffer[0], actual.v_buffer[0], torch.full((tokens,), slots + 1), k, v)
    with pytest.raises(RuntimeError):
        cpu_ops.store_kv(actual.k_buffer[0], actual.v_buffer[0], loc, k.double(), v.double())


@pytest.mark.parametrize("rows,d", [(1, 1536), (7, 100), (130, 64)])
def test_silu_and_mul_matches_torch(rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    x = 4 * torch.randn(rows, 2 * d, generator=gen)
    expected = F.silu(x[:, :d]) * x[:, d:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), expected, atol=1e-5, rtol=1e-5)
    # bf16 in and out, computed in float32 from the bf16 values and rounded once
    xb = x.to(torch.bfloat16)
    expected_bf16 = (F.silu(xb[:, :d].float()) * xb[:, d:].float()).to(torch.bfloat16)
    out = cpu_ops.silu_and_mul(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected_bf16.float(), atol=0, rtol=1e-2)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_in_place_matches_torch(rotary_dim):
    """The fused q|k heads of a qkv output, rotated where they lie: equal to the torch rotation, the v heads and
    the channels past rotary_dim untouched."""
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_

    gen = torch.Generator().manual_seed(rotary_dim)
    rope = RotaryEmbedding(64, 512, {"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": rotary_dim / 64})
    positions = torch.randint(0, 512, (37,), generator=gen)
    cos, sin = rope.lookup(positions, torch.float32)
    qkv = torch.randn(37, 9 + 3 + 3, 64, generator=gen)
    before = qkv.clone()
    qk = qkv[:, :12]
    expected = apply_rotary_emb(qk, cos, sin, rotary_dim)
    out = apply_rotary_emb_(qk, cos, sin, rotary_dim)
    assert out.data_ptr() == qkv.data_ptr()  # rotated in place
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, 12:], before[:, 12:])
    # a bf16 input keeps the torch path (and its rounding)
    xb = before[:, :12].to(torch.bfloat16)
    assert torch.equal(apply_rotary_emb_(xb, cos.bfloat16(), sin.bfloat16(), rotary_dim),
                       apply_rotary_emb(xb, cos.bfloat16(), sin.bfloat16(), rotary_dim))


def argmax_cases() -> list[torch.Tensor]:
    """Rows that exercise the vector lanes, the scalar tail, ties, NaN and infinities (n below 16 runs scalar)."""
    gen = torch.Generator().manual_seed(5)
    cases = [torch.randn(rows, n, generator=gen) for rows, n in [(1, 49152), (64, 49152), (3, 1), (2, 7), (2, 15),
                                                                   (2, 16), (3, 17), (4, 100), (2, 1001)]]
    ties = torch.zeros(6, 203)
    ties[0, [5, 77, 200]] = 3.0  # first of equal maxima: lane 5 before others
    ties[1, [13, 9]] = 2.0  # lane 1 wins over lane 5 at a later index
    ties[2, [202, 201]] = 1.0  # only in the scalar tail
    ties[3, [10, 18, 26]] = 1.0  # one lane, three times
    ties[4] = float("-inf")  # all -inf: 0
    ties[5, 150] = float("inf")
    nans = torch.randn(5, 203, generator=gen)
    nans[0, 100] = float("nan")  # in the vector part
    nans[1, 201] = float("nan")  # in the tail
    nans[2, [40, 3]] = float("nan")  # two: the first counts
    nans[3, 0] = float("nan")
    nans[4, [7, 190]] = float("nan")
    small_nan = torch.tensor([[1.0, float("nan"), 5.0], [float("nan"), 2.0, float("nan")]])
    return cases + [ties, nans, small_nan, torch.randn(8, 64, generator=gen)[:, ::2]]  # last: non-contiguous


def test_argmax_rows_equals_torch_argmax():
    for x in argmax_cases():
        assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1)), x.shape
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="at least one column"):
        cpu_ops.argmax_rows(torch.zeros(2, 0))


def test_greedy_sampling_uses_the_compiled_argmax(monkeypatch):
    from sglang.srt.layers import sampler

    calls = []
    monkeypatch.setattr(cpu_ops, "argmax_rows", lambda x: calls.append(x.shape) or x.argmax(-1))
    logits = torch.randn(3, 50)
    assert torch.equal(sampler.greedy_ids(logits), logits.argmax(-1)) and calls == [(3, 50)]

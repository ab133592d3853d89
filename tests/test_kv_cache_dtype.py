"""--kv-cache-dtype: K/V stored in bf16 or fp8, read directly by the compiled decode kernels.

Kernel level: the paged decode attention kernel and the fused decode step given bf16 / fp8 K/V compute what the
float32 kernel computes on the same rounded values (float32 tolerance). Model level: SmolLM2 with a bf16 KV cache
keeps transformers' float32 logits within a stated tolerance and its greedy text, including on a prefix-cache hit.
"""

from __future__ import annotations

import pytest
import torch

from sglang import Engine
from sglang.srt.layers import cpu_ops
from sglang.srt.mem_cache.kv_dtype import resolve_kv_cache_dtype, to_kv_dtype
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_executor import fused_cpu_decode as fused_decode
from sglang.srt.model_executor.decode_strategy import plan_decode
from sglang.srt.server_args import ServerArgs
from tests.conftest import SMOLLM2
from tests.greedy_cases import GREEDY, PROMPTS

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain for the CPU kernels")
STORED = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


# ---- dtype resolution and stores ----------------------------------------------------------------------------
def test_resolve_and_validate():
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ServerArgs(model_path=SMOLLM2, kv_cache_dtype="int4").validate()
    assert "kv_cache_dtype" not in ServerArgs(model_path=SMOLLM2, kv_cache_dtype="bf16").not_applicable_settings()


@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("dtype", STORED)
def test_pool_stores_converted_values(dtype, head_major):
    pool = KVPool(8, 1, 2, 16, dtype, head_major=head_major)
    # head-major: [slots, heads, D] views of [heads, slots, D] storage, the dummy slot zeroed in both
    assert pool.k_buffer[0].transpose(0, 1).is_contiguous() == head_major != pool.k_buffer[0].is_contiguous()
    assert pool.k_buffer[0].shape == pool.v_buffer[0].shape == (9, 2, 16)
    assert not pool.k_buffer[0][0].float().any() and not pool.v_buffer[0][0].float().any()
    k = 3 * torch.randn(2, 2, 16)
    k[0, 0, 0] = 1e6  # beyond every format's range: clamped, never inf / NaN
    pool.set_kv_buffer(0, torch.tensor([1, 5]), k, -k)
    stored = pool.k_buffer[0][torch.tensor([1, 5])]
    assert stored.dtype == dtype
    assert torch.isfinite(stored.float()).all()
    assert stored.float()[0, 0, 0] == min(torch.finfo(dtype).max, 999424.0)  # 1e6 in bf16 is 999424
    assert torch.equal(stored.float(), to_kv_dtype(k, dtype).float())
    if dtype == torch.bfloat16:  # round to nearest even, like torch's own conversion
        assert torch.equal(stored, k.to(torch.bfloat16))
    assert pool.bytes_per_token(1, 2, 16, dtype) == 2 * 2 * 16 * dtype.itemsize


# ---- the paged decode attention kernel ---------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("dtype", STORED)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (6, 2, 80), (2, 1, 36)])
def test_decode_kernel_reads_stored_dtype(dtype, heads, kv_heads, dim):
    """dim % 8 == 0 takes the AVX2 path (80: a partial column block), 36 the scalar one."""
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    slots, batch, width = 500, 5, 90
    k = to_kv_dtype(torch.randn(slots, kv_heads, dim, generator=gen), dtype)
    v = to_kv_dtype(torch.randn(slots, kv_heads, dim, generator=gen), dtype)
    q = torch.randn(batch, heads, dim, generator=gen)
    lens = torch.tensor([1, 90, 33, 9, 64])
    idx = torch.randint(0, slots, (batch, width), generator=gen)
    out = cpu_ops.paged_decode_attention(q, k, v, idx, lens, dim**-0.5)
    expected = cpu_ops.paged_decode_attention(q, k.float(), v.float(), idx, lens, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dim", [8, 4])
def test_decode_kernel_decodes_every_fp8_code(dtype, dim):
    """One key per sequence: the output is its value row, so every finite fp8 code must decode exactly (dim 8: the
    vector conversion, dim 4: the scalar one)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[torch.isfinite(codes.float())]
    rows = codes[: len(codes) // dim * dim].view(-1, 1, dim)
    q = torch.randn(rows.shape[0], 1, dim)
    idx = torch.arange(rows.shape[0])[:, None]
    out = cpu_ops.paged_decode_attention(q, rows, rows, idx, torch.ones(rows.shape[0], dtype=torch.int64), 1.0)
    assert torch.equal(out, rows.float())


@needs_kernels
@pytest.mark.parametrize("dim", [8, 16, 4])
def test_decode_kernel_keeps_e4m3_nan(dim):
    """A NaN code (0x7F / 0xFF) in a stored value row stays NaN in the output, in its column only."""
    codes = torch.zeros(2, 1, dim, dtype=torch.uint8)
    codes[0, 0, 1] = 0x7F
    codes[1, 0, dim - 1] = 0xFF
    rows = codes.view(torch.float8_e4m3fn)
    keys = torch.zeros_like(rows)
    out = cpu_ops.paged_decode_attention(torch.randn(2, 1, dim), keys, rows, torch.arange(2)[:, None],
                                         torch.ones(2, dtype=torch.int64), 1.0)
    assert torch.equal(torch.isnan(out), torch.isnan(rows.float()))
    assert torch.isnan(out).sum() == 2


@needs_kernels
def test_decode_kernel_rejects_mixed_dtypes():
    k = torch.zeros(10, 1, 8, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        cpu_ops.paged_decode_attention(q, k, k.float(), torch.tensor([[1]]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="KV buffers must be"):
        cpu_ops.paged_decode_attention(q, k.half(), k.half(), torch.tensor([[1]]), torch.tensor([1]), 1.0)


# ---- the fused decode step ---------------------------------------------------------------------------------
def decode_run(model, config, dtype: torch.dtype, fused: bool, prompts: list[list[int]], steps: int):
    """Prefill `prompts`, then `steps` greedy decode steps, with a `dtype` KV cache (fused step or layer by layer)."""
    from tests.test_fused_decode import make_fused
    from tests.test_models import PagedCache

    cache = PagedCache(config, dtype)
    cache.decode_strategy = make_fused(model, cache) if fused else None
    cache.forward(model, [(row, prompt) for row, prompt in enumerate(prompts)])
    next_tokens = {row: prompt[-1] for row, prompt in enumerate(prompts)}
    outputs = []
    for _ in range(steps):
        logits = cache.forward(model, [(row, [next_tokens[row]]) for row in next_tokens])
        outputs.append(logits)
        next_tokens = {row: int(logits[i].argmax()) for i, row in enumerate(next_tokens)}
    return outputs, cache


@pytest.fixture
def attention_path(request):
    """Sets the AVX512 path of bf16 attention on (True) or off (False) in both the standalone kernels and the fused
    step for one test (None: leaves the default)."""
    on = request.param
    if on is None:
        yield
        return
    if on and not cpu_ops.has_decode_attention_avx512():
        pytest.skip("this CPU has no AVX512F/BW")
    previous = cpu_ops.set_decode_attention_avx512(on), fused_decode.set_decode_attention_avx512(on)
    yield
    cpu_ops.set_decode_attention_avx512(previous[0])
    fused_decode.set_decode_attention_avx512(previous[1])


@needs_kernels
@pytest.mark.parametrize("dtype,attention_path", [(torch.bfloat16, True), (torch.bfloat16, False),
                                                  (torch.float8_e4m3fn, None)], indirect=["attention_path"])
def test_fused_step_with_stored_kv_matches_layer_by_layer(tmp_path, dtype, attention_path):
    pytest.importorskip("gguf")
    if not fused_decode.available():
        pytest.skip("the fused decode step is unavailable")
    from tests.test_fused_decode import quantize_linears
    from tests.test_models import build_models, max_diff, prompt_of, tiny_config

    config = tiny_config("qwen3", num_hidden_layers=3)  # per-head q/k norms: the fused step's longest path
    _, model = build_models(tmp_path, config)
    quantize_linears(model)
    prompts = [prompt_of(5, 1), prompt_of(17, 2), prompt_of(33, 3)]
    expected, plain = decode_run(model, config, dtype, False, prompts, steps=6)
    actual, fused = decode_run(model, config, dtype, True, prompts, steps=6)
    # The two paths sum in different orders, so now and then a K/V value lands on the other side of a rounding
    # boundary of the stored type (the check below allows 1% of them); one such element moves later logits by
    # ~1e-4, against ~1e-5 otherwise.
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert max_diff(a, e) < 5e-4, f"step {step}: {max_diff(a, e)}"
        assert torch.equal(a.argmax(-1), e.argmax(-1))
    # Both paths stored the same K/V: float32 values that differ only in summation order, rounded alike.
    used = plain.req_to_token_pool.req_to_token[:3, :40].flatten()
    used = used[used > 0]
    for layer in range(config.num_hidden_layers):
        for a, e in ((fused.pool.k_buffer[layer], plain.pool.k_buffer[layer]),
                     (fused.pool.v_buffer[layer], plain.pool.v_buffer[layer])):
            assert a.dtype == dtype
            same = (a[used].float() == e[used].float()).float().mean().item()
            assert same > 0.99, f"layer {layer}: only {same:.3f} of the stored K/V elements agree"
    decode_plan = plan_decode(model, fused.pool, fused.backend, 8, torch.device("cpu"))
    assert decode_plan.fused is not None
    assert f"KV cache {str(dtype).removeprefix('torch.')}" in decode_plan.description


# ---- SmolLM2 with a bf16 KV cache ---------------------------------------------------------------------------
# bf16 keeps 8 mantissa bits of every K/V element; over 30 layers that moves SmolLM2's log-probabilities by a few
# hundredths on these prompts (measured: at most 0.024 over prompt and generated tokens).
LOGPROB_TOL = 0.15


@pytest.fixture(scope="module")
def bf16_kv_engine():
    eng = Engine(model_path=SMOLLM2, dtype="float32", kv_cache_dtype="bfloat16")
    yield eng
    eng.shutdown()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities [len(ids) - 1, vocab] of each next token given the ids before it."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)


def test_bf16_kv_reported(bf16_kv_engine):
    info = bf16_kv_engine.get_server_info()
    assert info["kv_cache_dtype"] == "bfloat16"
    assert info["arithmetic"]["kv_cache_dtype"] == "bfloat16"
    assert info["arithmetic"]["weight_dtype"] == "float32"


def test_bf16_kv_logits_and_greedy_text_match_float32(bf16_kv_engine, smollm2_hf):
    outs = bf16_kv_engine.generate(prompt=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for prompt, out in zip(PROMPTS, outs):
        meta = out["meta_info"]
        prompt_ids = [t for _, t, _ in meta["input_token_logprobs"]]
        ours = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]])
        # Prefill (prompt tokens) and decode (generated tokens) log-probabilities against float32 transformers
        # fed the same tokens.
        theirs = hf_logprobs(smollm2_hf, prompt_ids + out["output_ids"])
        targets = torch.tensor(prompt_ids[1:] + out["output_ids"])
        diff = (ours - theirs.gather(1, targets[:, None])[:, 0]).abs().max().item()
        assert diff < LOGPROB_TOL, f"{prompt!r}: log-probabilities differ by {diff}"
        # Greedy text: every generated token is float32 transformers' own greedy choice after the same prefix.
        generated = theirs[len(prompt_ids) - 1 :]
        assert generated.argmax(-1).tolist() == out["output_ids"], prompt


def test_bf16_kv_prefix_cache_hit_gives_same_output(bf16_kv_engine):
    prompt = PROMPTS[4]
    first = bf16_kv_engine.generate(prompt=prompt + " repaired", sampling_params=GREEDY)
    again = bf16_kv_engine.generate(prompt=prompt + " repaired", sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"]
    # A prompt that shares only the cached prefix reads bf16 K/V written by another request.
    other = bf16_kv_engine.generate(prompt=prompt + " built", sampling_params=GREEDY)
    fresh_prompt = bf16_kv_engine.generate(prompt=prompt + " built", sampling_params=GREEDY)
    assert other["meta_info"]["cached_tokens"] > 0
    assert other["output_ids"] == fresh_prompt["output_ids"]

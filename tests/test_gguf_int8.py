"""Int8 activations for the GGUF block kernels (csrc/gguf_int8.h).

Each 32-value block of x is written as two int8 terms (x ~ dx1 * q1 + dx2 * q2), and the kernels form exact integer
dot products of those terms with the weight blocks. So the result must equal, up to float32 rounding, the float64
product of the dequantized weights with x rounded that way (an emulation in torch below), and stay within ~1e-4 of
the product with the float x. Both the AVX512-VNNI kernels and the portable loop are checked on any machine: the
VNNI ones where the CPU has the instructions, the portable one in a subprocess that turns VNNI off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.cpu_classes import VNNI_FLAGS  # noqa: E402
from sglang.srt.layers.quantization import gguf_blocks as gb  # noqa: E402
from sglang.srt.model_loader.dtype import read_cpu_flags  # noqa: E402
from tests.test_gguf_kernels import random_raw, reference_dequantize  # noqa: E402

pytestmark = pytest.mark.skipif(not gb.kernels_available(),
                                reason=f"GGUF kernels unavailable: {gb.kernels_unavailable_reason()}")

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(40, 96), (1536, 576)]  # N not a multiple of 16; a SmolLM2 shape
BATCHES = [1, 2, 5, 8, 13]  # one tile, a partial tile, two tiles


def round_terms(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: per 32-value block, int8 rounding with scale d = max|x| / 127, plus the remainder
    rounded in steps of d / 256 (saturated to int8)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    first = torch.round(blocks * inv) * d
    second = torch.clamp(torch.round((blocks - first) * (inv * 256)), -128, 127) * (d / 256)
    return (first.double() + second.double()).reshape(x.shape)


def inputs(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 3] = 60.0  # a large activation in one channel, as real hidden states have
    if m > 1:
        x[1, :32] = 0.0  # an all-zero block
    return x


def check_case(qtype: str, n: int, k: int, m: int, one_term: bool = False,
               emulate=round_terms) -> tuple[float, float]:
    """(error against the rounding `emulate` emulates, error against float x), each relative to the output's norm;
    `one_term`: the kernels' one-term form."""
    raw = random_raw(qtype, n, k, seed=n + k)
    weight = gb.GGUFQuantWeight(qtype, raw, n, k)
    w = torch.from_numpy(reference_dequantize(qtype, raw, n, k)).double()
    x = inputs(m, k, seed=m)
    y = weight.linear(x, int8=True, one_term=one_term).double()
    exact = x.double() @ w.T
    emulated = emulate(x) @ w.T
    return float((y - emulated).norm() / exact.norm()), float((y - exact).norm() / exact.norm())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_kernels_equal_the_emulated_rounding(qtype, n, k):
    for m in BATCHES:
        vs_emulated, vs_float = check_case(qtype, n, k, m)
        assert vs_emulated < 2e-6, (m, vs_emulated)
        assert vs_float < 2e-4, (m, vs_float)


def portable_errors(module: str, shapes: str, batches: str) -> list[tuple[float, float]]:
    """`module`.check_case for Q4_1 and Q8_0 at `shapes` and `batches` (Python literals) on the loop CPUs without
    AVX512-VNNI run (forced with SGLANG_GGUF_INT8_PORTABLE=1 in a fresh process)."""
    code = (
        "import json\n"
        "from sglang.srt.layers.quantization import gguf_blocks as gb\n"
        f"from {module} import check_case\n"
        f"errors = [check_case(q, n, k, m) for q in ('Q4_1', 'Q8_0') for n, k in {shapes} for m in {batches}]\n"
        "print(json.dumps({'vnni': gb.kernel_module().has_int8_vnni_path(), 'errors': errors}))\n"
    )
    env = {**os.environ, "SGLANG_GGUF_INT8_PORTABLE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vnni"] is False
    return result["errors"]


def test_portable_int8_loop_equals_the_emulated_rounding():
    for vs_emulated, vs_float in portable_errors("tests.test_gguf_int8", "[(40, 96)]", "(1, 5, 13)"):
        assert vs_emulated < 2e-6 and vs_float < 2e-4


def test_int8_flag_defaults_off_and_float_path_is_unchanged():
    raw = random_raw("Q8_0", 40, 96)
    weight = gb.GGUFQuantWeight("Q8_0", raw, 40, 96)
    x = inputs(3, 96, seed=0)
    w = torch.from_numpy(reference_dequantize("Q8_0", raw, 40, 96)).double()
    exact = x.double() @ w.T
    assert float((weight.linear(x).double() - exact).norm() / exact.norm()) < 1e-6
    int8 = weight.linear(x, int8=True).double()
    assert 0 < float((int8 - exact).norm() / exact.norm()) < 2e-4  # rounded, so not bit-equal to float


def test_vnni_path_reported():
    has_vnni = VNNI_FLAGS <= read_cpu_flags()
    assert gb.kernel_module().has_int8_vnni_path() == (has_vnni and "SGLANG_GGUF_INT8_PORTABLE" not in os.environ)


def quantizer_inputs() -> torch.Tensor:
    x = inputs(11, 96, seed=7)
    x[2, 32:64] = torch.arange(32, dtype=torch.float32) - 15.5  # max |x| 15.5 ...
    x[2, 63] = 127.0  # ... then 127: scale 1, so the halves are exact ties (rounded to even)
    x[4, 64:96] = -x[4, 64:96].abs()  # a block of negatives
    return x


def decode_terms(words: torch.Tensor, q4: bool) -> torch.Tensor:
    """The int8 values of each term in x's order, from the words the kernels read ([M, nb, 2, 32])."""
    raw = words.contiguous().view(torch.uint8).reshape(*words.shape[:3], 32).to(torch.int32)
    if not q4:
        return raw - 128
    # byte t of word w holds q[8 * (w // 2) + 2 * t + w % 2]
    order = torch.tensor([8 * (w // 2) + 2 * t + w % 2 for w in range(8) for t in range(4)])
    q = torch.empty_like(raw)
    q[..., order] = raw
    return torch.where(q > 127, q - 256, q)


@pytest.mark.parametrize("q4", [True, False])
def test_int8_quantizer_rounds_and_lays_out_the_terms(q4):
    """The words, scales and sums the kernels read: the first term is round-half-even(x / d1) with d1 = max|x| / 127,
    the second term's scale is d1 / 256, both terms together give x back to ~1e-4 of a block's max, the sums are
    d1 * sum(q1) + d2 * sum(q2)."""
    x = quantizer_inputs()
    words, dx, sx = gb.kernel_module().int8_quantize(x, q4, False)
    q = decode_terms(words, q4).to(torch.float32)
    blocks = x.reshape(x.shape[0], -1, 32)
    d1 = blocks.abs().amax(-1) / 127
    assert torch.equal(dx[..., 0], d1) and torch.equal(dx[..., 1], d1 / 256)
    inv = torch.where(d1 > 0, 1 / d1, torch.zeros_like(d1))
    assert torch.equal(q[:, :, 0], torch.round(blocks * inv[..., None]))
    assert torch.equal(q[2, 1, 0, :8], torch.tensor([-16.0, -14, -14, -12, -12, -10, -10, -8]))  # ties to even
    back = q[:, :, 0] * dx[..., 0:1] + q[:, :, 1] * dx[..., 1:2]
    assert float(((back - blocks).abs().amax(-1) / blocks.abs().amax(-1).clamp_min(1e-30)).max()) < 1e-4
    assert torch.equal(back[1, 0], torch.zeros(32))  # the all-zero block: zero scales, zero words
    sums = dx[..., 0] * q[:, :, 0].sum(-1) + dx[..., 1] * q[:, :, 1].sum(-1)
    assert torch.allclose(sx, sums, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not (gb.kernels_available() and gb.kernel_module().has_vector_quantize()),
                    reason="no AVX512 on this CPU")
@pytest.mark.parametrize("q4", [True, False])
def test_avx512_quantizer_equals_the_portable_one_bit_for_bit(q4):
    gen = torch.Generator().manual_seed(3)
    for x in (quantizer_inputs(), torch.randn(9, 1536, generator=gen) * torch.rand(9, 1, generator=gen) * 50):
        vector = gb.kernel_module().int8_quantize(x, q4, True)
        portable = gb.kernel_module().int8_quantize(x, q4, False)
        for a, b in zip(vector, portable):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2 end to end: int8 activations in every small-batch matmul and the fused decode step keep transformers'
# float32 greedy tokens (teacher-forced, the largest log-probability change on the prompts below was 0.002).


@pytest.fixture(scope="module")
def int8_engine():
    from sglang import Engine
    from tests.conftest import SMOLLM2

    # Forced, so that the portable loop runs where the CPU has no VNNI (slowly: fewer tokens there).
    eng = Engine(model_path=SMOLLM2, gguf_activations="int8", cpu_gemm="float32")
    yield eng
    eng.shutdown()


def test_int8_activations_keep_smollm2_greedy_tokens(int8_engine, reference):
    from tests.greedy_cases import PROMPTS

    info = int8_engine.get_server_info()
    assert info["arithmetic"]["gguf_activations"] == "int8"
    assert info["arithmetic"]["gguf_activations_reason"] == "--gguf-activations int8"
    fast = gb.kernel_module().has_int8_vnni_path()
    prompts = PROMPTS[:3] if fast else PROMPTS[:1]
    tokens = 32 if fast else 6
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    got = [o["output_ids"] for o in int8_engine.generate(prompt=prompts, sampling_params=params)]
    assert got == [ids[:tokens] for ids in reference(prompts)]
    # One at a time too: batch-1 decode steps run the fused step with int8 activations.
    single = int8_engine.generate(prompt=prompts[0], sampling_params=params)["output_ids"]
    assert single == reference(prompts[:1])[0][:tokens]

"""GGUF files in the types people download (K-quant "M" mixes, Q6_K, Q5_0, Q5_1, Q2_K, Q3_K) served from Q4_1 /
Q8_0 blocks converted at load from the file's own values (model_loader/gguf_block_convert.py).

Files are written from a tiny random Llama, each tensor quantized by the `gguf` package's quantizer (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0) or by tests/kquant_writer.py (the K-quants, in ggml's block layouts). Where llama.cpp's libggml
is built (`SGLANG_TEST_GGML_LIB`, else the llama-cpp-python sdist's build dir), the conversion is also checked on
blocks written by its own quantizer (`ggml_quantize_chunk`). The served blocks are checked against
`gguf.quants.dequantize` (the reference) within the bounds the converter states, the model must hold those blocks
and no float copy of its linear weights, and greedy tokens through `Engine` must equal transformers' on the
reference weights up to a near tie."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.arithmetic import choose_arithmetic  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import BLOCK_BYTES, QK, dequantize_raw, kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from sglang.srt.model_loader.gguf_block_convert import SERVED_AS, convert_blocks  # noqa: E402
from sglang.srt.model_loader.weight_report import describe_weights, weight_bytes_by_format  # noqa: E402
from tests.kquant_writer import PACKERS, quantize_k  # noqa: E402
from tests.page_drops import recording_page_drops  # noqa: E402
from tests.test_cpu_arithmetic import BF16_VNNI_FLAGS  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")

T = gguf.GGMLQuantizationType
GGUF_QUANTIZERS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the types `gguf.quants.quantize` writes
GGML_LIB = Path(os.environ.get("SGLANG_TEST_GGML_LIB", "/tmp/llamasdist/llama_cpp_python-0.3.36/vendor/llama.cpp/"
                                                        "build/bin/libggml-base.so"))


def _ggml() -> Any:
    if not GGML_LIB.is_file():
        return None
    lib = ctypes.CDLL(str(GGML_LIB))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


GGML = _ggml()
needs_ggml = pytest.mark.skipif(GGML is None, reason=f"llama.cpp's libggml is not built ({GGML_LIB})")


def quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """Raw blocks [n, row_bytes] of float32 `values` [n, k]: gguf's quantizer, else tests/kquant_writer.py."""
    if qtype in GGUF_QUANTIZERS:
        return gguf.quants.quantize(values, T[qtype])
    return quantize_k(values, qtype)


def ggml_quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """Raw blocks [n, row_bytes] of float32 `values` [n, k], as llama.cpp's quantizer writes them."""
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[T[qtype]]
    n, k = values.shape
    src = np.ascontiguousarray(values, dtype=np.float32)
    out = np.zeros((n, k // per_block * block_bytes), dtype=np.uint8)
    assert GGML.ggml_quantize_chunk(int(T[qtype]), src.ctypes.data, out.ctypes.data, 0, n, k, None) == out.nbytes
    return out


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, T[qtype]).astype(np.float32)


def fields(raw: torch.Tensor, qtype: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) of served blocks, each repeated over its 32 weights: float32 [n, k] (m zero for Q8_0)."""
    blocks = raw.reshape(n, -1, BLOCK_BYTES[qtype])

    def half(at: int) -> torch.Tensor:
        return blocks[..., at : at + 2].contiguous().view(torch.float16).float().squeeze(-1).repeat_interleave(QK, 1)

    return half(0), (half(2) if qtype == "Q4_1" else torch.zeros_like(half(0)))


def assert_within_bound(served: torch.Tensor, qtype: str, n: int, k: int, stored: str, expected: np.ndarray) -> None:
    """The served blocks of one stored matrix against its reference values: exact where the converter says so,
    else within its bound (Q8_0: half its scale, the scale at most max|w| / 127 * (1 + 2^-10) of the block)."""
    ours = dequantize_raw(qtype, served, n, k)
    ref = torch.from_numpy(expected.reshape(n, k))
    err = (ours - ref).abs()
    if stored in ("Q4_0", "Q5_0", "Q8_0") or stored == qtype:
        assert torch.equal(ours, ref), stored
        return
    d, m = fields(served, qtype, n)
    if qtype == "Q4_1":  # from Q4_K: d' and m' are within 2^-11 of d*sc and dmin*m
        bound = 2.0**-10 * (15 * d.abs() + m.abs()) + 2.0**-24
    else:
        bound = d.abs() / 2 * (1 + 2.0**-20)
        amax = ref.reshape(n, -1, QK).abs().amax(-1).repeat_interleave(QK, 1)
        assert bool(((err.reshape(n, -1, QK).amax(-1).repeat_interleave(QK, 1) == 0)
                     | (d.abs() <= amax / 127 * (1 + 2.0**-10))).all()), stored  # rounded blocks: the least scale
    assert bool((err <= bound).all()), (stored, float((err - bound).max()))


def random_weights(n: int, k: int, seed: int) -> np.ndarray:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.02).astype(np.float32)
    w[1] = 0.0  # all-zero blocks (a zero scale)
    w[2] *= 50  # a row of large weights
    return w


def assert_converted_within_bound(stored: str, raw: np.ndarray, n: int, k: int) -> None:
    expected = reference(raw, stored)
    targets = {SERVED_AS[stored], "Q8_0"}  # a Q4_1-served type may be stacked with a Q8_0 part in one layer
    for target in targets:
        served = convert_blocks(stored, raw, n, k, target)
        assert served.shape == (n, k // QK * BLOCK_BYTES[target])
        assert_within_bound(served, target, n, k, stored, expected)
    if stored == "Q3_K":  # integers (sc - 32) * q of one scale: exact but for blocks holding a +-128
        ours = dequantize_raw("Q8_0", convert_blocks(stored, raw, n, k, "Q8_0"), n, k)
        assert (ours == torch.from_numpy(expected)).float().mean() > 0.5


@pytest.mark.parametrize("stored", list(SERVED_AS))
def test_converted_blocks_equal_the_reference_within_the_bound(stored):
    n, k = 24, 512
    assert_converted_within_bound(stored, quantize(random_weights(n, k, seed=len(stored)), stored), n, k)


@needs_ggml
@pytest.mark.parametrize("stored", list(PACKERS))
def test_llama_cpp_blocks_converted_within_the_bound(stored):
    n, k = 24, 512
    assert_converted_within_bound(stored, ggml_quantize(random_weights(n, k, seed=len(stored)), stored), n, k)


@pytest.mark.parametrize("stored", list(PACKERS))
def test_compiled_k_quant_conversion_is_the_rules_bit_for_bit(stored, monkeypatch):
    """The compiled conversion of K-quant rows (and their values) equals the numpy rules of
    model_loader/gguf_block_convert.py bit for bit, on written blocks and on llama.cpp's where it is built; a scale
    beyond fp16's range (every super-block's d the largest fp16) fails the same way in both."""
    from sglang.srt.model_loader import gguf_block_convert

    n, k = 24, 512
    raws = [quantize(random_weights(n, k, seed=11), stored)]
    if GGML is not None:
        raws.append(ggml_quantize(random_weights(n, k, seed=12), stored))
    huge = raws[0].copy()  # every super-block's d (and dmin) the largest fp16: products beyond its range
    block_bytes = gguf.GGML_QUANT_SIZES[T[stored]][1]
    at = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[stored]
    for offset in at:
        for j in range(k // 256):
            huge[:, j * block_bytes + offset : j * block_bytes + offset + 2] = np.frombuffer(
                np.float16(65504).tobytes(), dtype=np.uint8)
    targets = sorted({SERVED_AS[stored], "Q8_0"})

    def convert_all() -> list:
        out: list = []
        for raw in raws:
            out.append(gguf_block_convert.file_values(stored, raw, n, k))
            out += [convert_blocks(stored, raw, n, k, target) for target in targets]
        for target in targets:  # Q2_K's largest values (d * 15 * 3) fit Q8_0's scales
            try:
                out.append(convert_blocks(stored, huge, n, k, target))
            except ValueError as err:
                assert stored != "Q2_K" and "exceed" in str(err)
                out.append(str(err))
        return out

    compiled = convert_all()
    monkeypatch.setattr(gguf_block_convert, "kernel_module", lambda: None)
    for ours, rules in zip(compiled, convert_all(), strict=True):
        assert ours == rules if isinstance(ours, str) else torch.equal(ours, rules)


def test_compiled_k_quant_bindings_reject_a_matrix_that_is_not_one():
    """The compiled K-quant readers check what they are handed: a non-K-quant type, a width that is not a multiple
    of 256, rows of the wrong byte count or dtype, an empty matrix, and a row id outside the table."""
    from sglang.srt.model_loader.gguf_block_convert import file_values, kernel_module

    ext = kernel_module()
    if ext is None:
        pytest.skip("the compiled GGUF kernels are not available")
    raw = torch.from_numpy(quantize(random_weights(4, 256, seed=3), "Q4_K"))
    ids = torch.arange(4)
    assert torch.equal(ext.gather_kquant_rows(raw, 12, 256, ids), file_values("Q4_K", raw.numpy(), 4, 256))
    bad = [((raw, 8, 256), "is not a K-quant"), ((raw, 12, 128), "multiple of 256"),
           ((raw[:, :100], 12, 256), "uint8 CPU matrix"), ((raw.to(torch.int16), 12, 256), "uint8 CPU matrix"),
           ((raw[:0], 12, 256), "uint8 CPU matrix")]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            ext.gather_kquant_rows(*args, ids[:0])
        with pytest.raises(RuntimeError, match=message):
            ext.convert_kquant_rows(*args, False)
    with pytest.raises(RuntimeError, match="outside"):
        ext.gather_kquant_rows(raw, 12, 256, torch.tensor([4]))
    with pytest.raises(RuntimeError, match="only Q4_K"):
        ext.convert_kquant_rows(raw, 14, 256, True)


@pytest.mark.parametrize("types", [("Q4_0", "Q4_K"), ("Q8_0", "Q6_K", "Q5_0"), ("Q6_K",)])
def test_converted_parts_packed_a_slice_at_a_time_equal_the_whole(types, monkeypatch):
    """Parts stacked along N (row counts not multiples of 16) converted and packed a slice of row groups at a time
    equal the whole stack converted, then packed."""
    from sglang.srt.layers.quantization.gguf_blocks import pack_stored
    from sglang.srt.model_loader import gguf_block_convert

    k = 512
    rows = [40, 23, 57][: len(types)]
    parts = [(qtype, torch.from_numpy(quantize(random_weights(r, k, seed=i), qtype)), r, k)
             for i, (qtype, r) in enumerate(zip(types, rows))]
    target = gguf_block_convert.served_type(types)
    whole = pack_stored(target, [(target, convert_blocks(t, raw, r, k, target)) for t, raw, r, _ in parts], k)
    monkeypatch.setattr(gguf_block_convert, "PACK_SLICE_VALUES", 32 * k)  # slices of 32 rows
    sliced = gguf_block_convert.converted_packed(parts, target, k)
    assert sliced is not None and whole is not None and torch.equal(sliced, whole)


@pytest.mark.parametrize("parts,served", [((("Q4_K", 96), ("Q6_K", 32), ("F32", 512)), "Q4_1"),
                                          ((("Q4_0", 32), ("Q6_K", 48), ("Q5_0", 32)), "Q8_0"),
                                          ((("F32", 64),), None)])
def test_file_served_type_counts_the_weights_of_each_served_block_type(tmp_path, parts, served):
    """The block type most of a file's matrix weights are served as (the server's small-batch rows follow it), read
    from the header: each stored type counted as SERVED_AS serves it, float and 1-D tensors not at all."""
    from sglang.srt.model_loader.gguf_block_convert import file_served_type

    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, (qtype, rows) in enumerate(parts):
        w = random_weights(rows, 256, seed=i)
        if qtype == "F32":
            writer.add_tensor(f"blk.{i}.w", w)
        else:
            writer.add_tensor(f"blk.{i}.w", quantize(w, qtype), raw_dtype=T[qtype])
    writer.add_tensor("norm", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert file_served_type(path) == served


# Relative RMS error of each K-quant on Gaussian weights (llama.cpp's quantizer: 0.30, 0.14, 0.072, 0.036, 0.018).
WRITER_ERROR = {"Q2_K": 0.33, "Q3_K": 0.15, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}


@pytest.mark.parametrize("qtype", list(PACKERS))
def test_written_k_quant_blocks_hold_the_weights(qtype):
    """The K-quant blocks the tests write, read back by gguf's reference dequantizer, are the weights within the
    type's usual error (and within 10% of llama.cpp's quantizer where it is built); an all-zero row stays zero."""
    w = random_weights(24, 512, seed=3)
    raw = quantize(w, qtype)
    assert raw.shape == (24, 512 // 256 * gguf.GGML_QUANT_SIZES[T[qtype]][1])
    back = reference(raw, qtype)
    assert not back[1].any()

    def error(values: np.ndarray) -> float:
        return float(np.sqrt(((values - w) ** 2).mean() / (w**2).mean()))

    assert error(back) < WRITER_ERROR[qtype], error(back)
    if GGML is not None:
        assert error(back) < 1.1 * error(reference(ggml_quantize(w, qtype), qtype))


def test_q4_k_as_q4_1_within_the_stated_fp16_rounding():
    """Per 32-weight sub-block |w' - w| <= 2^-11 * (15*|d*sc| + |dmin*m|) (+ float32 rounding), with d, sc, dmin, m
    read by gguf's own Q4_K parser."""
    n, k = 16, 1024
    raw = quantize(random_weights(n, k, seed=7), "Q4_K")
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    span = np.abs(d * sc) * 15 + np.abs(dmin * mins)  # [blocks, 8]
    bound = torch.from_numpy(np.repeat(span * (2.0**-11 + 2.0**-23), QK, axis=1).reshape(n, k) + 2.0**-25)
    ours = dequantize_raw("Q4_1", convert_blocks("Q4_K", raw, n, k, "Q4_1"), n, k)
    err = (ours - torch.from_numpy(reference(raw, "Q4_K"))).abs()
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # the products do round (the test can tell a bound from equality)


# ---- whole files ------------------------------------------------------------------------------------------------
TINY_KQ = dict(vocab=260, hidden=256, heads=4, kv_heads=2, inter=512, layers=2)  # K-quants need K % 256 == 0
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
# name -> the stored type of each role, as llama.cpp's mixes store them (Q4_K_M / Q5_K_M keep attn_v, ffn_down and
# the output in Q6_K; Q3_K / Q2_K files mix in higher K-quants); the last one needs only gguf's quantizers.
MIXES = {
    "Q4_K_M": dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K", ffn_gate="Q4_K", ffn_up="Q4_K",
                   ffn_down="Q6_K", output="Q6_K"),
    "Q5_K_M": dict(attn_q="Q5_K", attn_k="Q5_K", attn_v="Q6_K", attn_output="Q5_K", ffn_gate="Q5_K", ffn_up="Q5_K",
                   ffn_down="Q6_K", output="Q6_K"),
    "Q2_K_Q3_K": dict(attn_q="Q2_K", attn_k="Q2_K", attn_v="Q3_K", attn_output="Q3_K", ffn_gate="Q3_K",
                      ffn_up="Q3_K", ffn_down="Q4_K", output="Q3_K"),
    "Q5_0_Q5_1": dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q5_1", attn_output="Q8_0", ffn_gate="Q4_0",
                      ffn_up="Q4_0", ffn_down="Q5_1", output="Q5_0"),
}
# Each decoder linear layer and the GGUF roles it stacks.
LAYER_ROLES = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
               "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def write_mix(monkeypatch, path: Path, mix: dict[str, str]) -> None:
    """The tiny Llama of tests/test_model_loader.py (weights scaled to 0.1, unit norms) written with each role in
    its type of `mix` (the embeddings float32)."""
    from tests.test_model_loader import _tiny_llama_tensors, _write_tiny_gguf

    class MixWriter(gguf.GGUFWriter):
        def add_tensor(self, name: str, tensor: np.ndarray, *args: Any, **kwargs: Any) -> None:
            role = name.split(".")[-2]
            if role in mix and tensor.ndim == 2:
                qtype = mix[role]
                return super().add_tensor(name, quantize(tensor, qtype), raw_dtype=T[qtype])
            return super().add_tensor(name, tensor, *args, **kwargs)

    tensors = {name: (np.ones_like(v) if v.ndim == 1 else v * 0.1)
               for name, v in _tiny_llama_tensors(seed=5, t=TINY_KQ).items()}
    monkeypatch.setattr(gguf, "GGUFWriter", MixWriter)
    _write_tiny_gguf(path, tensors, TINY_KQ)
    monkeypatch.undo()


def served_as(mix: dict[str, str], roles: tuple[str, ...]) -> tuple[str, str]:
    """(block type, by_format name) of a layer stacking `roles`: blocks as stored keep their plain name."""
    types = sorted({mix[r] for r in roles})
    target = "Q4_1" if all(SERVED_AS[t] == "Q4_1" for t in types) else "Q8_0"
    return target, f"{target} blocks" + ("" if types == [target] else f" from GGUF {'+'.join(types)}")


def expected_formats(mix: dict[str, str], config: Any) -> dict[str, int]:
    """by_format of the served model: each layer's blocks (16-row groups, as the kernels pack them) and the float32
    embeddings and norms."""
    out: dict[str, int] = {}
    shapes = {"qkv_proj": ((config.num_attention_heads + 2 * config.num_key_value_heads) * 64, config.hidden_size),
              "o_proj": (config.hidden_size, config.hidden_size),
              "gate_up_proj": (2 * config.intermediate_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.intermediate_size)}
    entries = [(LAYER_ROLES[name], shape) for name, shape in shapes.items()] * config.num_hidden_layers
    entries.append((("output",), (config.vocab_size, config.hidden_size)))
    for roles, (n, k) in entries:
        target, name = served_as(mix, roles)
        out[name] = out.get(name, 0) + -(-n // 16) * 16 * k // QK * BLOCK_BYTES[target]
    out["float32"] = (config.vocab_size + 2 * config.num_hidden_layers + 1) * config.hidden_size * 4
    return out


def blocks_plan():
    return choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="q8_0",
                             large_batch_weights="blocks")


@pytest.mark.parametrize("name", list(MIXES))
def test_file_served_from_blocks_of_its_own_values(monkeypatch, tmp_path, cache_dir, name, caplog):
    import logging

    from transformers import AutoConfig

    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.resolve import resolve_model_path
    from sglang.srt.model_loader.weights import iterate_weights

    mix = MIXES[name]
    gguf_path = tmp_path / f"tiny-{name}.gguf"
    write_mix(monkeypatch, gguf_path, mix)
    model_dir = resolve_model_path(str(gguf_path))  # its float32 weights: gguf's reference dequantization
    config = AutoConfig.from_pretrained(model_dir)
    plan = blocks_plan()
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), 8, plan)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.gguf_quant"):
        assert attach_fast_paths(ours, str(gguf_path), config, 8, plan) > 0
    assert any("converted at load" in r.getMessage() for r in caplog.records)
    references = dict(iterate_weights(model_dir))
    for i, layer in enumerate(ours.model.layers):
        for module_name, roles in LAYER_ROLES.items():
            owner = layer.self_attn if module_name in ("qkv_proj", "o_proj") else layer.mlp
            module = getattr(owner, module_name)
            method = module.linear_method
            target, _ = served_as(mix, roles)
            assert isinstance(method, GGUFLinearMethod) and method.quant_weight.qtype == target, (i, module_name)
            assert module.weight.device.type == "meta"  # no float copy kept
            raw, row = method.quant_weight.raw(), 0
            for role in roles:
                expected = references[f"model.layers.{i}.{HF_NAMES[role]}.weight"].numpy()
                n, k = expected.shape
                assert_within_bound(raw[row : row + n], target, n, k, mix[role], expected)
                row += n
    head = ours.logits_processor.head_method.quant_weight
    assert_within_bound(head.raw(), head.qtype, head.n, head.k, mix["output"], references["lm_head.weight"].numpy())
    by_format = weight_bytes_by_format(ours)
    by_format.pop("int8 GEMM copies", None)
    assert by_format == expected_formats(mix, config)
    line = describe_weights(ours)
    assert all(f"{fmt} " in line for fmt in by_format), line


def test_the_files_pages_of_every_served_tensor_leave_the_process(monkeypatch, tmp_path, cache_dir):
    """Every block tensor the linear layers and the head are served from has its range of the mapped file handed to
    the page dropper once read (Q and K too, whose rows are copied into transformers' order first), so the load does
    not hold the file's pages beside the served blocks."""
    from transformers import AutoConfig

    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.resolve import resolve_model_path

    gguf_path = tmp_path / "tiny-pages.gguf"
    write_mix(monkeypatch, gguf_path, MIXES["Q4_K_M"])
    ranges, dropped = recording_page_drops(monkeypatch)
    model_dir = resolve_model_path(str(gguf_path))
    plan = blocks_plan()
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), 8, plan)
    assert attach_fast_paths(ours, str(gguf_path), AutoConfig.from_pretrained(model_dir), 8, plan) > 0
    served = {name: span for name, span in ranges.items() if name.split(".")[-2] in ROLES}
    assert len(served) == 7 * TINY_KQ["layers"] + 1
    assert {name for name, span in served.items() if span not in dropped} == set()


def test_dense_large_batch_weights_are_the_converted_blocks_values(monkeypatch, tmp_path, cache_dir):
    """Where float weights stay for large batches (--large-batch-weights dense), a converted layer's float weight is
    set to its blocks' values, so that every batch size computes with the same weights; blocks kept as stored
    (Q4_1 / Q8_0) already equal it."""
    from transformers import AutoConfig

    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.resolve import resolve_model_path

    gguf_path = tmp_path / "tiny-dense.gguf"
    write_mix(monkeypatch, gguf_path, MIXES["Q4_K_M"])
    model_dir = resolve_model_path(str(gguf_path))
    plan = choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="q8_0",
                             large_batch_weights="dense")
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), 8, plan)
    assert attach_fast_paths(ours, str(gguf_path), AutoConfig.from_pretrained(model_dir), 8, plan) > 0
    modules = [m for layer in ours.model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)]
    for module in modules:
        method = module.linear_method
        assert isinstance(method, GGUFLinearMethod) and module.weight.dtype == torch.float32
        assert torch.equal(module.weight, method.quant_weight.dequantize())


# ---- through Engine -------------------------------------------------------------------------------------------
# Short prompts: the tiny file's context is 64 tokens of one byte each.
PROMPTS = ["The capital of", "Once upon a time", "def f(x):", "Q: 12 * 12?"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def hf_greedy(hf_model: Any, tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=GREEDY["max_new_tokens"], do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["Q4_K_M", "Q5_0_Q5_1"])
def test_engine_greedy_equals_transformers_on_the_reference_weights(monkeypatch, tmp_path, cache_dir, name):
    """Greedy tokens through Engine (every batch from the converted blocks) equal transformers' on the blocks'
    values (up to float32 summation order: a near tie of 1e-3), and transformers' on the file's reference values up
    to a near tie: where they differ, transformers' top token leads ours by at most twice the largest logit change
    the conversion makes on the prompts (the blocks' values vs the reference), which is what its rounding can flip
    in a random model's close logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang import Engine
    from sglang.srt.model_loader.resolve import resolve_model_path
    from tests.greedy_cases import assert_same_or_near_tie

    gguf_path = tmp_path / f"tiny-{name}.gguf"
    write_mix(monkeypatch, gguf_path, MIXES[name])
    model_dir = resolve_model_path(str(gguf_path))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = [hf_greedy(hf_model, tokenizer, p) for p in PROMPTS]
    assert all(len(set(ids)) > 2 for ids in expected)
    with Engine(model_path=str(gguf_path), dtype="float32", cpu_gemm="float32", max_total_tokens=2048,
                small_batch_quantization="q8_0", large_batch_weights="blocks") as engine:
        ours = [o["output_ids"] for o in engine.generate(prompt=PROMPTS, sampling_params=GREEDY)]
        info = engine.get_server_info()
    by_format = dict(info["weights"]["by_format"])
    by_format.pop("int8 GEMM copies", None)
    assert by_format == expected_formats(MIXES[name], hf_model.config)
    assert info["weights"]["bytes"] == sum(info["weights"]["by_format"].values())

    ids = [tokenizer.encode(p) for p in PROMPTS]
    with torch.no_grad():
        reference_logits = [hf_model(torch.tensor([x])).logits[0] for x in ids]
    reference_weights = set_weights(hf_model, served_weights(hf_model.config, gguf_path))
    with torch.no_grad():
        change = max(float((hf_model(torch.tensor([x])).logits[0] - r).abs().max())
                     for x, r in zip(ids, reference_logits))
    on_blocks = [hf_greedy(hf_model, tokenizer, p) for p in PROMPTS]
    for prompt, mine, theirs in zip(PROMPTS, ours, on_blocks):
        assert_same_or_near_tie(hf_model, tokenizer, prompt, mine, theirs, 1e-3)
    set_weights(hf_model, reference_weights)
    assert 0 < change < 0.5, change
    for prompt, mine, theirs in zip(PROMPTS, ours, expected):
        assert_same_or_near_tie(hf_model, tokenizer, prompt, mine, theirs, 2 * change)


def served_weights(config: Any, gguf_path: Path) -> dict[str, torch.Tensor]:
    """The values of the blocks the file is served from (loaded with the blocks plan), by transformers' names."""
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.resolve import resolve_model_path

    model_dir = resolve_model_path(str(gguf_path))
    plan = blocks_plan()
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), 8, plan)
    attach_fast_paths(ours, str(gguf_path), config, 8, plan)
    served = {"lm_head.weight": ours.logits_processor.head_method.quant_weight.dequantize()}
    for i, layer in enumerate(ours.model.layers):
        for module_name, roles in LAYER_ROLES.items():
            owner = layer.self_attn if module_name in ("qkv_proj", "o_proj") else layer.mlp
            values = getattr(owner, module_name).linear_method.quant_weight.dequantize()
            names = [f"model.layers.{i}.{HF_NAMES[r]}.weight" for r in roles]
            sizes = [config.hidden_size] * len(names)
            if module_name == "qkv_proj":
                head_dim = config.hidden_size // config.num_attention_heads
                sizes = [config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2
            elif module_name == "gate_up_proj":
                sizes = [config.intermediate_size] * 2
            served.update(zip(names, values.split(sizes)))
    return served


def set_weights(hf_model: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy `weights` into `hf_model`; returns the values they replaced."""
    params = dict(hf_model.named_parameters())
    old = {name: params[name].detach().clone() for name in weights}
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return old

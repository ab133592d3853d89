"""GGUF K-quant blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) of float32 weights, packed by the layouts of ggml's
`block_q*_K` structs (the ones `gguf.quants.dequantize` reads), written out here so that the tests need no
compiled quantizer.

Each 256-weight super-block holds one fp16 scale `d` (and an fp16 `dmin` for the types with minimums) and a small
integer scale (and minimum) per sub-block. The codes are chosen as llama.cpp's reference quantizer chooses them,
without its iterative search for the best scale:
- symmetric types (Q3_K, Q6_K): the sub-block's scale maps its weight of largest magnitude onto the most negative
  code; the super-block scale maps the sub-block scale of largest magnitude onto the most negative scale code;
- types with a minimum (Q2_K, Q4_K, Q5_K): each sub-block spans [min(w, 0), max(w)]; its scale and minimum are
  rounded to multiples of the super-block's `d` and `dmin` (the largest of each over the top code).
Every code is then rounded against the fp16 scales the block stores, as ggml's quantizer rounds them.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _div(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    """x / by, zero where `by` is zero."""
    safe = np.where(by == 0, 1.0, by)
    return np.where(by == 0, 0.0, x / safe)


def _symmetric(x: np.ndarray, sub: int, nmax: int, smax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fp16 d [nb], signed scale codes [nb, 256/sub] in [-smax, smax-1], signed codes [nb, 256] in [-nmax,
    nmax-1]) of super-blocks x [nb, 256]."""
    groups = x.reshape(len(x), -1, sub)
    pick = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)[..., 0]
    scales = pick / -nmax
    top = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)[:, 0]
    d = _fp16(top / -smax)
    codes = np.clip(np.round(_div(scales, d.astype(np.float32)[:, None])), -smax, smax - 1)
    step = d.astype(np.float32)[:, None] * codes
    q = np.clip(np.round(_div(groups, step[..., None])), -nmax, nmax - 1)
    return d, codes.astype(np.int32), q.reshape(len(x), QK_K).astype(np.int32)


def _with_min(x: np.ndarray, sub: int, nmax: int, smax: int) -> tuple[np.ndarray, ...]:
    """(fp16 d, fp16 dmin [nb], scale codes, minimum codes [nb, 256/sub] in [0, smax], codes [nb, 256] in
    [0, nmax]) of super-blocks x [nb, 256]; a weight is d * scale * q - dmin * minimum."""
    groups = x.reshape(len(x), -1, sub)
    low = np.minimum(groups.min(-1), 0.0)
    scales = (groups.max(-1) - low) / nmax
    d = _fp16(scales.max(-1) / smax)
    dmin = _fp16((-low).max(-1) / smax)
    sc = np.clip(np.round(_div(scales, d.astype(np.float32)[:, None])), 0, smax)
    mn = np.clip(np.round(_div(-low, dmin.astype(np.float32)[:, None])), 0, smax)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round(_div(groups + offset[..., None], step[..., None])), 0, nmax)
    return d, dmin, sc.astype(np.int32), mn.astype(np.int32), q.reshape(len(x), QK_K).astype(np.int32)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return v.reshape(-1, 1).view(np.uint8)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """qs [nb, 64] of 2-bit codes q [nb, 256]: weight 128h + 32j + l in bits 2j of byte 32h + l."""
    planes = q.reshape(len(q), 2, 4, 32)
    out = sum(planes[:, :, j] << (2 * j) for j in range(4))
    return out.reshape(len(q), 64).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """qs [nb, 128] of 4-bit codes q [nb, 256]: in each 64-weight chunk, weight l low and weight 32 + l high."""
    chunks = q.reshape(len(q), 4, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(len(q), 128).astype(np.uint8)


def _k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes holding 8 six-bit scales and minimums (ggml's get_scale_min_k4 layout)."""
    out = np.zeros((len(sc), 12), dtype=np.int32)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out.astype(np.uint8)


def _q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _with_min(x, 16, 3, 15)
    return np.concatenate([(sc | (mn << 4)).astype(np.uint8), _two_bit_planes(q), _half_bytes(d),
                           _half_bytes(dmin)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    d, codes, q = _symmetric(x, 16, 4, 32)
    u = q + 4  # 0..7: two low bits in qs, the third in hmask
    high = (u >> 2).reshape(len(x), 2, 4, 32)
    hmask = sum(high[:, h, j] << (4 * h + j) for h in range(2) for j in range(4)).astype(np.uint8)
    s = codes + 32
    scales = np.zeros((len(x), 12), dtype=np.int32)
    scales[:, 0:8] = (s[:, 0:8] & 15) | ((s[:, 8:16] & 15) << 4)
    scales[:, 8:12] = sum((s[:, 4 * g : 4 * g + 4] >> 4) << (2 * g) for g in range(4))
    return np.concatenate([hmask, _two_bit_planes(u & 3), scales.astype(np.uint8), _half_bytes(d)], axis=1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _with_min(x, 32, 15, 63)
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), _k4_scales(sc, mn), _nibble_pairs(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _with_min(x, 32, 31, 63)
    high = (q >> 4).reshape(len(x), 4, 2, 32)
    qh = sum(high[:, c, half] << (2 * c + half) for c in range(4) for half in range(2)).astype(np.uint8)
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), _k4_scales(sc, mn), qh, _nibble_pairs(q & 15)],
                          axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    d, codes, q = _symmetric(x, 16, 32, 128)
    u = (q + 32).reshape(len(x), 2, 4, 32)  # [half, t, l]: weight 128h + 32t + l
    low = u & 15
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = sum((u[:, :, t] >> 4) << (2 * t) for t in range(4))
    return np.concatenate([ql.reshape(len(x), 128).astype(np.uint8), qh.reshape(len(x), 64).astype(np.uint8),
                           codes.astype(np.int8).view(np.uint8), _half_bytes(d)], axis=1)


PACKERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_k(values: np.ndarray, qtype: str) -> np.ndarray:
    """Raw blocks [n, k / 256 * block bytes] (uint8) of float32 `values` [n, k], k a multiple of 256."""
    n, k = values.shape
    assert k % QK_K == 0, f"{qtype} needs rows of a multiple of {QK_K} weights, got {k}"
    blocks = PACKERS[qtype](np.ascontiguousarray(values, dtype=np.float32).reshape(-1, QK_K))
    return np.ascontiguousarray(blocks).reshape(n, -1)


def writing_k_quants(monkeypatch) -> None:
    """`gguf.quants.quantize` (which writes no K-quant) writing the K-quants with `quantize_k`, for arrays of any
    leading dimensions (a MoE layer's experts)."""
    import gguf

    plain = gguf.quants.quantize

    def either(array: np.ndarray, qtype) -> np.ndarray:
        if qtype.name not in PACKERS:
            return plain(array, qtype)
        raw = quantize_k(array.reshape(-1, array.shape[-1]), qtype.name)
        return raw.reshape(*array.shape[:-1], raw.shape[-1])

    monkeypatch.setattr(gguf.quants, "quantize", either)

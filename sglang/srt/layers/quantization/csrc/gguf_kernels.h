// Weight-only quantized linear layers over GGUF Q4_1 / Q8_0 blocks, for CPU decode.
//
// The raw GGUF blocks are repacked once (in Python, see gguf_blocks.py) into "row groups" of 16 consecutive output
// rows, made of two halves of 8 rows. Within a half, one 256-bit register holds one 32-bit lane per output row, so
// a pass of FMAs produces 8 outputs at a time without horizontal reductions; for one or two rows of x both halves
// are computed in the same pass (each broadcast of x feeds two FMAs). The packed stream has exactly the size of the
// raw blocks and each row group is read strictly sequentially.
//
// Q4_1 packed layout, per row group g (rows 16g..16g+15, zero-padded past N) and per block b (32 inputs):
//   32 bytes   d[16]  (fp16, one per row)
//   32 bytes   m[16]  (fp16)
//   256 bytes  for j = 0..3, for half h = 0..1: a vector whose lane r (row 8h + r) is a uint32 holding the
//              8 nibbles q[32b + 8j + i] at bits 4i (i = 0..7)
//   = 320 bytes = 16 raw blocks of 20 bytes.
// Q8_0 packed layout, per row group and block:
//   32 bytes   d[16]  (fp16)
//   512 bytes  for j = 0..7, for half h = 0..1: a vector whose lane r holds the 4 int8 q[32b + 4j + i] in byte i
//   = 544 bytes = 16 raw blocks of 34 bytes.
//
// Arithmetic (fp32 with FMA):
//   Q4_1: sum_k (d q_k + m) x_k = d * sum_k q_k x_k + m * sum_k x_k, with the per-block sums of x computed once
//         per call. A nibble is isolated with a single AND (value q * 16^i) and the matching x is pre-scaled by
//         16^-i (exact: a power of two), so each product q * x is formed exactly as with the plain nibble.
//   Q8_0: the byte is moved to the top of its lane (value q * 2^24, sign included) and 2^-24 is folded into d.
// Rows of x are processed in tiles of up to 8: each block's weights are converted once per tile (or per sub-tile
// of 2 rows) and used for every row of it, so a small batch costs about the same memory traffic as a single row.
// x is copied once per call into "panels" (one per tile, element [k][m]) so that every broadcast uses a fixed
// offset. Every row of a tile goes through the one-row kernel's operations in the one-row kernel's order, so up to
// 9 rows a row's outputs are the same bits whatever else shares the call.
// From 10 rows of x on (g_dequant_min_rows), each row group is instead converted once into floats for all the rows
// and x is read as it is (gguf_dequant_gemm.h): 1.1-1.4x faster at 10-64 rows with AVX2 (its sums are ordered
// differently: within float32 rounding of the tiles', not equal to them).

//
// This header holds the portable kernel and the raw-pointer API (prepare_input + matmul_groups) shared by the
// Python bindings (gguf_linear.cpp) and the fused decode stack (../../csrc/decode_stack.cpp); the AVX2 kernels are
// in gguf_avx2_kernels.h, the int8-activation ones in gguf_int8.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "gguf_avx2_kernels.h"
#include "gguf_dequant_gemm.h"
#include "gguf_int8.h"
#include "gguf_layout.h"

namespace gguf_kernels {

// Scale applied to x for nibble position i (the AND leaves q * 16^i; position 7 is shifted down instead).
inline float nibble_x_scale(int64_t i) {
  return i == 7 ? 1.0f : std::ldexp(1.0f, static_cast<int>(-4 * i));
}

// Copy rows [0, mt) of x (row stride K) into a panel xt[k * mt + m], times scale[k % 8] (or 1 when scale is null),
// and, when sxt is not null, the per-block sums of the unscaled rows: sxt[b * mt + m].
inline void make_panel(const float* x, int64_t K, int64_t mt, const float* scale, float* xt, float* sxt) {
  const int64_t nb = K / kQK;
  for (int64_t m = 0; m < mt; ++m) {
    const float* row = x + m * K;
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = row + b * kQK;
      float* dst = xt + b * kQK * mt + m;
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t k = 0; k < kQK; ++k) {
        part[k & 3] += src[k];
        dst[k * mt] = scale ? src[k] * scale[k & 7] : src[k];
      }
      if (sxt) sxt[b * mt + m] = (part[0] + part[1]) + (part[2] + part[3]);
    }
  }
}

#ifndef GGUF_LINEAR_AVX2  // portable scalar path over the same packed layout (x unscaled, row-major)

// Dequantizes one packed block of a row group into w[k * 16 + row] (exactly d * q + m, as the reference).
inline void q4_1_block_scalar(const uint8_t* bp, float* w) {
  using L = Q41Layout;
  for (int64_t row = 0; row < kRows; ++row) {
    const int64_t h = row / kHalf, r = row % kHalf;
    const float d = fp16_to_fp32(bp + L::d(h) + 2 * r);
    const float mn = fp16_to_fp32(bp + L::m(h) + 2 * r);
    for (int64_t j = 0; j < 4; ++j) {
      const uint8_t* lane = bp + L::vec(j, h) + 4 * r;
      for (int64_t t = 0; t < 4; ++t) {
        w[(8 * j + 2 * t) * kRows + row] = d * static_cast<float>(lane[t] & 0x0F) + mn;
        w[(8 * j + 2 * t + 1) * kRows + row] = d * static_cast<float>(lane[t] >> 4) + mn;
      }
    }
  }
}

inline void q8_0_block_scalar(const uint8_t* bp, float* w) {
  using L = Q80Layout;
  for (int64_t row = 0; row < kRows; ++row) {
    const int64_t h = row / kHalf, r = row % kHalf;
    const float d = fp16_to_fp32(bp + L::d(h) + 2 * r);
    for (int64_t j = 0; j < 8; ++j) {
      const int8_t* q = reinterpret_cast<const int8_t*>(bp + L::vec(j, h) + 4 * r);
      for (int64_t i = 0; i < 4; ++i) w[(4 * j + i) * kRows + row] = static_cast<float>(q[i]) * d;
    }
  }
}

// One row group against all M rows of x (row-major, stride K); acc is scratch of M * 16 floats. The inner loop
// over the 16 rows vectorises with any SIMD width.
inline void group_scalar(bool q4, const uint8_t* gp, int64_t nb, const float* x, int64_t K, int64_t M, float* acc,
                         float* y, int64_t ldy, int64_t nvalid) {
  float w[kQK * kRows];
  std::fill(acc, acc + M * kRows, 0.0f);
  const int64_t block_bytes = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  for (int64_t b = 0; b < nb; ++b) {
    if (q4) {
      q4_1_block_scalar(gp + b * block_bytes, w);
    } else {
      q8_0_block_scalar(gp + b * block_bytes, w);
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* xb = x + m * K + b * kQK;
      float* am = acc + m * kRows;
      for (int64_t k = 0; k < kQK; ++k) {
        const float xv = xb[k];
        for (int64_t r = 0; r < kRows; ++r) am[r] += w[k * kRows + r] * xv;
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < nvalid; ++r) y[m * ldy + r] = acc[m * kRows + r];
}

#endif  // GGUF_LINEAR_AVX2

constexpr int64_t group_block_bytes(bool q4) {
  return q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
}

// Scratch floats prepare_input needs for M rows of K inputs: panels, then block sums.
inline int64_t panel_floats(int64_t M, int64_t K) {
  return std::max(M * K, int8::scratch_floats(M, K));  // the float panels or the int8 layout
}
inline int64_t sum_floats(int64_t M, int64_t K) {
  return M * (K / kQK);
}

// Whether int8 activations run on the AVX512-VNNI kernels here (otherwise on the portable loop).
inline bool int8_vnni_available() {
  return int8::vnni_supported();
}

// x as the kernels read it.
struct PreparedInput {
  const float* xt;   // panels (AVX2) or x itself
  const float* sxt;  // per-block sums of x (Q4_1 with AVX2), else null
  bool quantized = false;  // x quantized to int8 per 32-value block (gguf_int8.h), held in q
  int8::QuantizedInput q{nullptr, nullptr, nullptr};
  bool dequantized_groups = false;  // xt is x itself, and each row group is converted once (gguf_dequant_gemm.h)
};

// Rows of x per tile of prepared input (int8::kTile and kMaxTile: the same 8): prepare_tile builds one.
constexpr int64_t kPrepareTile = kMaxTile;
static_assert(kPrepareTile == int8::kTile, "both input layouts are tiled alike");

// Whether the float kernels read x as it is, without panels: a single row of Q8_0.
inline bool reads_x_as_is(bool q4, int64_t M) {
  return !q4 && M == 1;
}

// Lays out the rows [m0, m0 + min(kPrepareTile, M - m0)) of x[M, K] (m0 a multiple of kPrepareTile) for
// matmul_groups, into their place in `panels` (panel_floats) and `sums` (sum_floats); with int8_activations
// quantized to int8 per 32-value block (into `panels`; `one_term`: in the one-term form, gguf_int8_input.h). Tiles
// write disjoint parts: threads can build one each.
inline void prepare_tile(bool q4, const float* x, int64_t M, int64_t K, int64_t m0, float* panels, float* sums,
                         bool int8_activations = false, bool one_term = false) {
  if (int8_activations) {
    int8::quantize_tile(q4, x, M, K, m0, panels, int8::avx512_supported(), one_term);
    return;
  }
#ifdef GGUF_LINEAR_AVX2
  if (reads_x_as_is(q4, M)) return;
  float scale[8];
  for (int64_t i = 0; i < 8; ++i) scale[i] = nibble_x_scale(i);
  const int64_t mt = std::min(kPrepareTile, M - m0);
  make_panel(x + m0 * K, K, mt, q4 ? scale : nullptr, panels + m0 * K, q4 ? sums + m0 * (K / kQK) : nullptr);
#else
  (void)q4, (void)x, (void)M, (void)K, (void)m0, (void)panels, (void)sums;
#endif
}

// The prepared input of x[M, K] once every tile is built (prepare_tile), as matmul_groups reads it.
inline PreparedInput prepared_view(bool q4, const float* x, int64_t M, int64_t K, float* panels, float* sums,
                                   bool int8_activations = false, bool one_term = false) {
  if (int8_activations) {
    PreparedInput in{panels, nullptr};
    in.quantized = true;
    in.q = int8::quantized_view(M, K, panels, one_term);
    return in;
  }
#ifdef GGUF_LINEAR_AVX2
  if (reads_x_as_is(q4, M)) return {x, nullptr};
  return {panels, q4 ? sums : nullptr};
#else
  (void)q4, (void)M, (void)K, (void)panels, (void)sums;
  return {x, nullptr};
#endif
}

// Lays out rows x[M, K] for matmul_groups, using `panels` (panel_floats) and `sums` (sum_floats) as scratch.
// With int8_activations x is quantized to int8 per 32-value block instead (into `panels`); with convert_groups
// (converts_groups) x is read as it is and the scratch is not used.
inline PreparedInput prepare_input(bool q4, const float* x, int64_t M, int64_t K, float* panels, float* sums,
                                   bool int8_activations = false, bool convert_groups = false,
                                   bool one_term = false) {
  if (convert_groups) {
    PreparedInput in{x, nullptr};
    in.dequantized_groups = true;
    return in;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPrepareTile) {
    prepare_tile(q4, x, M, K, m0, panels, sums, int8_activations, one_term);
  }
  return prepared_view(q4, x, M, K, panels, sums, int8_activations, one_term);
}

// y[:, 16 g0 .. 16 g1) (row stride ldy) = x @ W.T for the row groups [g0, g1) of packed weights W [N, K].
inline void matmul_groups(bool q4, const uint8_t* packed, int64_t N, int64_t K, int64_t M, const float* x,
                          PreparedInput in, float* y, int64_t ldy, int64_t g0, int64_t g1) {
  const int64_t nb = K / kQK;
  const int64_t group_bytes = nb * group_block_bytes(q4);
  if (in.quantized) {
    for (int64_t g = g0; g < g1; ++g) {
      int8::group(q4, packed + g * group_bytes, nb, M, in.q, y + g * kRows, ldy, std::min(kRows, N - g * kRows));
    }
    return;
  }
#ifdef GGUF_LINEAR_AVX2
  if (in.dequantized_groups) {
    for (int64_t g = g0; g < g1; ++g) {
      dequant_group_rows(q4, packed + g * group_bytes, nb, K, M, in.xt, y + g * kRows, ldy,
                         std::min(kRows, N - g * kRows));
    }
    return;
  }
  (void)x;
  for (int64_t g = g0; g < g1; ++g) {
    group_avx2(q4, packed + g * group_bytes, nb, K, M, in.xt, in.sxt, y + g * kRows, ldy,
               std::min(kRows, N - g * kRows));
  }
#else
  (void)in;
  std::vector<float> acc(static_cast<size_t>(M * kRows));
  for (int64_t g = g0; g < g1; ++g) {
    group_scalar(q4, packed + g * group_bytes, nb, x, K, M, acc.data(), y + g * kRows, ldy,
                 std::min(kRows, N - g * kRows));
  }
#endif
}

inline int64_t row_groups(int64_t N) {
  return (N + kRows - 1) / kRows;
}

}  // namespace gguf_kernels

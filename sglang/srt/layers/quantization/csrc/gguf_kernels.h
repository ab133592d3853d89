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
// This header holds the kernels themselves, with a raw-pointer API (prepare_input + matmul_groups) shared by
// the Python bindings (gguf_linear.cpp) and the fused decode stack (../../csrc/decode_stack.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "gguf_dequant_gemm.h"
#include "gguf_int8.h"
#include "gguf_layout.h"

namespace gguf_kernels {

constexpr int64_t kMaxTile = 8;  // rows of x processed per pass over a row group

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

#ifdef GGUF_LINEAR_AVX2

inline __m256 bcast(const float* p) {
  return _mm256_broadcast_ss(p);
}

// Nibble i of every lane, as an exact float q * 16^i (q for i == 7).
template <int I>
inline __m256 q4_extract(__m256i v) {
  if constexpr (I == 7) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * I))));
  }
}

// Byte i of every lane, as an exact float q * 2^24 (signed).
template <int I>
inline __m256 q8_extract(__m256i v) {
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFF000000u));
  if constexpr (I == 0) {
    return _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 24));
  } else if constexpr (I == 3) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, top));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_slli_epi32(v, 24 - 8 * I), top));
  }
}

template <int N>
inline __m256 sum_vectors(const __m256* t) {
  if constexpr (N == 1) {
    return t[0];
  } else {
    return _mm256_add_ps(sum_vectors<N / 2>(t), sum_vectors<N - N / 2>(t + N / 2));
  }
}

// Calls f(std::integral_constant<int, S>) for S = 0 .. N-1 (fully unrolled).
template <int S, int N, typename F>
__attribute__((always_inline)) inline void unroll(F&& f) {
  if constexpr (S < N) {
    f(std::integral_constant<int, S>{});
    unroll<S + 1, N>(f);
  }
}

// ---- one row of x against a whole row group: both halves share each broadcast of x ----
// Per block, the 32 products of a lane are summed in kChains chains (chain c holds k = c, c + 4, ..., in that order),
// the chains are added pairwise, ((c0 + c1) + (c2 + c3)), and the block's sum enters the accumulator times d (plus m
// times the block's sum of x for Q4_1). Larger tiles (below) perform exactly these operations for each of their rows,
// so a row's outputs do not depend on how many rows share its call: a speculative verify step of several rows of one
// sequence gives each row the values plain decoding gives it, bit for bit.

constexpr int kChains = 4;

// xt: pre-scaled panel [K][1] (x itself); sxt: block sums [nb]; y: the 16 outputs (nvalid of them stored).
inline void q4_1_group_one(const uint8_t* gp, int64_t nb, const float* xt, const float* sxt, float* y,
                           int64_t nvalid) {
  using L = Q41Layout;
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    const float* xb = xt + b * kQK;
    prefetch_ahead<L::kBlockBytes>(bp);
    __m256 p[2][kChains];
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < kChains; ++c) p[h][c] = _mm256_setzero_ps();
    unroll<0, 4>([&](auto jc) {
      constexpr int J = decltype(jc)::value;
      const __m256i v0 = load_vec(bp + L::vec(J, 0));
      const __m256i v1 = load_vec(bp + L::vec(J, 1));
      unroll<0, 8>([&](auto ic) {
        constexpr int I = decltype(ic)::value;
        constexpr int c = (J * 8 + I) % kChains;
        const __m256 xv = bcast(xb + J * 8 + I);
        p[0][c] = _mm256_fmadd_ps(q4_extract<I>(v0), xv, p[0][c]);
        p[1][c] = _mm256_fmadd_ps(q4_extract<I>(v1), xv, p[1][c]);
      });
    });
    for (int h = 0; h < 2; ++h) {
      acc[h] = _mm256_fmadd_ps(load_half8(bp + L::d(h)), sum_vectors<kChains>(p[h]), acc[h]);
      acc[h] = _mm256_fmadd_ps(load_half8(bp + L::m(h)), bcast(sxt + b), acc[h]);
    }
  }
  store_rows<1>(&acc[0], y, 0, nvalid);
  store_rows<1>(&acc[1], y + kHalf, 0, nvalid - kHalf);
}

// xt: x itself (unscaled); 2^-24 is folded into d.
inline void q8_0_group_one(const uint8_t* gp, int64_t nb, const float* xt, const float* /*unused*/, float* y,
                           int64_t nvalid) {
  using L = Q80Layout;
  const __m256 unscale = _mm256_set1_ps(1.0f / 16777216.0f);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    const float* xb = xt + b * kQK;
    prefetch_ahead<L::kBlockBytes>(bp);
    __m256 p[2][kChains];
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < kChains; ++c) p[h][c] = _mm256_setzero_ps();
    unroll<0, 8>([&](auto jc) {
      constexpr int J = decltype(jc)::value;
      const __m256i v0 = load_vec(bp + L::vec(J, 0));
      const __m256i v1 = load_vec(bp + L::vec(J, 1));
      unroll<0, 4>([&](auto ic) {
        constexpr int I = decltype(ic)::value;
        constexpr int c = (J * 4 + I) % kChains;
        const __m256 xv = bcast(xb + J * 4 + I);
        p[0][c] = _mm256_fmadd_ps(q8_extract<I>(v0), xv, p[0][c]);
        p[1][c] = _mm256_fmadd_ps(q8_extract<I>(v1), xv, p[1][c]);
      });
    });
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_mul_ps(load_half8(bp + L::d(h)), unscale);
      acc[h] = _mm256_fmadd_ps(dv, sum_vectors<kChains>(p[h]), acc[h]);
    }
  }
  store_rows<1>(&acc[0], y, 0, nvalid);
  store_rows<1>(&acc[1], y + kHalf, 0, nvalid - kHalf);
}

// ---- several rows of x (2 .. kMaxTile) against a row group ----
// The one-row kernels' operations for each row, both halves of the row group in one pass (each broadcast of x feeds
// both), sub-tiles of up to kSubRows rows: chains 0 and 1 of a block first (2 x kSubRows x 2 accumulators), added,
// then chains 2 and 3, added, then the two sums; the accumulators across blocks live in memory (a load and a store
// per block). A tile of up to kSubRows rows converts each weight vector in registers where it is used; a larger one
// converts the block's 64 vectors once into a buffer that stays in L1 and runs its sub-tiles from there.

constexpr int kSubRows = 2;

// Weight vector k of half h of a block, as the one-row kernels convert it (exact q * 16^i for Q4_1, q * 2^24 for
// Q8_0).
template <bool Q4, int k>
__attribute__((always_inline)) inline __m256 weight_vector(const uint8_t* bp, int64_t h) {
  if constexpr (Q4) {
    return q4_extract<k % 8>(load_vec(bp + Q41Layout::vec(k / 8, h)));
  } else {
    return q8_extract<k % 4>(load_vec(bp + Q80Layout::vec(k / 4, h)));
  }
}

// Chains C0 and C0 + 1 of one block for MS rows of x and both halves, added: s[h][m] = c0 + c1 (chain c holds
// k = c, c + 4, ..., in that order). weight(h, k) gives the weight vectors (std::integral_constant arguments); xb: the
// panel at the block's first input and the sub-tile's first row (k stride PS, a constant: offsets from one pointer).
template <int C0, int MS, int PS, typename Weight>
__attribute__((always_inline)) inline void chain_pair(Weight&& weight, const float* xb, __m256 (&s)[2][MS]) {
  __m256 p[2][MS][2];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MS; ++m) p[h][m][0] = p[h][m][1] = _mm256_setzero_ps();
  unroll<0, kQK / kChains>([&](auto jc) __attribute__((always_inline)) {
    unroll<0, 2>([&](auto cc) __attribute__((always_inline)) {
      constexpr int c = decltype(cc)::value;
      constexpr int k = decltype(jc)::value * kChains + C0 + c;
      const __m256 w0 = weight(std::integral_constant<int, 0>{}, std::integral_constant<int, k>{});
      const __m256 w1 = weight(std::integral_constant<int, 1>{}, std::integral_constant<int, k>{});
      for (int m = 0; m < MS; ++m) {
        const __m256 xv = bcast(xb + k * PS + m);
        p[0][m][c] = _mm256_fmadd_ps(w0, xv, p[0][m][c]);
        p[1][m][c] = _mm256_fmadd_ps(w1, xv, p[1][m][c]);
      }
    });
  });
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MS; ++m) s[h][m] = _mm256_add_ps(p[h][m][0], p[h][m][1]);
}

// MS rows of x against one block (both halves): acc[h][m] += d * ((c0 + c1) + (c2 + c3)) (+ m * the block's sum of
// x for Q4_1, sx[m]).
template <bool Q4, int MS, int PS, typename Weight>
__attribute__((always_inline)) inline void rows_block(Weight&& weight, const float* xb, const __m256* dv,
                                                      const __m256* mv, const float* sx, __m256* acc0,
                                                      __m256* acc1) {
  static_assert(kChains == 4, "the chains are added as ((c0 + c1) + (c2 + c3))");
  __m256 s[2][MS], t[2][MS];
  chain_pair<0, MS, PS>(weight, xb, s);
  chain_pair<2, MS, PS>(weight, xb, t);
  __m256* acc[2] = {acc0, acc1};
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < MS; ++m) {
      __m256 a = _mm256_fmadd_ps(dv[h], _mm256_add_ps(s[h][m], t[h][m]), acc[h][m]);
      if constexpr (Q4) a = _mm256_fmadd_ps(mv[h], bcast(sx + m), a);
      acc[h][m] = a;
    }
  }
}

// A tile of MT rows of x (2 .. kMaxTile) against one row group. xt: the tile's panel [K][MT] (pre-scaled for Q4_1,
// whose block sums sxt are [nb][MT]); y: the tile's first row of outputs (row stride ldy), nvalid of 16 stored.
template <bool Q4, int MT>
void group_rows(const uint8_t* gp, int64_t nb, const float* xt, const float* sxt, float* y, int64_t ldy,
                int64_t nvalid) {
  using L = std::conditional_t<Q4, Q41Layout, Q80Layout>;
  const __m256 unscale = _mm256_set1_ps(1.0f / 16777216.0f);
  __m256 acc[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  alignas(32) __m256 w[2][kQK];  // a block's weight vectors, for tiles of more than kSubRows rows
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    const float* xb = xt + b * kQK * MT;
    // opaque to the loop optimiser: every read of x is then xb plus a constant, rather than one pointer per address
    // advanced block by block (GCC makes those, and spills them)
    asm("" : "+r"(xb));
    const float* sx = Q4 ? sxt + b * MT : nullptr;
    prefetch_ahead<L::kBlockBytes>(bp);
    __m256 dv[2], mv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < 2; ++h) {
      if constexpr (Q4) {
        dv[h] = load_half8(bp + L::d(h));
        mv[h] = load_half8(bp + Q41Layout::m(h));
      } else {
        dv[h] = _mm256_mul_ps(load_half8(bp + L::d(h)), unscale);
      }
    }
    if constexpr (MT <= kSubRows) {
      const auto convert = [&](auto hc, auto kc) __attribute__((always_inline)) {
        return weight_vector<Q4, decltype(kc)::value>(bp, hc);
      };
      rows_block<Q4, MT, MT>(convert, xb, dv, mv, sx, acc[0], acc[1]);
    } else {
      unroll<0, kQK>([&](auto kc) __attribute__((always_inline)) {
        w[0][decltype(kc)::value] = weight_vector<Q4, decltype(kc)::value>(bp, 0);
        w[1][decltype(kc)::value] = weight_vector<Q4, decltype(kc)::value>(bp, 1);
      });
      unroll<0, (MT + kSubRows - 1) / kSubRows>([&](auto tc) __attribute__((always_inline)) {
        constexpr int s0 = decltype(tc)::value * kSubRows;
        constexpr int ms = MT - s0 < kSubRows ? MT - s0 : kSubRows;
        // each sub-tile reads the buffer anew: the vectors kept in registers from the sub-tile before would not
        // fit, and GCC would spill its accumulators instead
        asm volatile("" ::: "memory");
        const auto from_buffer = [&](auto hc, auto kc) __attribute__((always_inline)) {
          return w[decltype(hc)::value][decltype(kc)::value];
        };
        rows_block<Q4, ms, MT>(from_buffer, xb + s0, dv, mv, Q4 ? sx + s0 : nullptr, acc[0] + s0, acc[1] + s0);
      });
    }
  }
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t nh = std::min(kHalf, nvalid - h * kHalf);
    for (int m = 0; m < MT && nh > 0; ++m) {
      const __m256 out = acc[h][m];
      store_rows<1>(&out, y + m * ldy + h * kHalf, 0, nh);
    }
  }
}

using GroupRowsFn = void (*)(const uint8_t*, int64_t, const float*, const float*, float*, int64_t, int64_t);

template <bool Q4>
constexpr GroupRowsFn kGroupRows[kMaxTile + 1] = {
    nullptr,           nullptr,           group_rows<Q4, 2>, group_rows<Q4, 3>, group_rows<Q4, 4>,
    group_rows<Q4, 5>, group_rows<Q4, 6>, group_rows<Q4, 7>, group_rows<Q4, 8>,
};

// One row group (16 rows, nvalid of them real) against all M rows of x, given the panels of x (see make_panel:
// tile t of up to kMaxTile rows starts at row t * kMaxTile, its panel at that row times K, its block sums at that
// row times nb). For Q8_0 with M == 1 the "panel" is x itself.
inline void group_avx2(bool q4, const uint8_t* gp, int64_t nb, int64_t K, int64_t M, const float* xt,
                       const float* sxt, float* y, int64_t ldy, int64_t nvalid) {
  if (M == 1) {
    (q4 ? q4_1_group_one : q8_0_group_one)(gp, nb, xt, sxt, y, nvalid);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
    const int64_t mt = std::min(kMaxTile, M - m0);
    const float* panel = xt + m0 * K;
    float* ym = y + m0 * ldy;
    if (mt == 1) {
      (q4 ? q4_1_group_one : q8_0_group_one)(gp, nb, panel, sxt ? sxt + m0 * nb : nullptr, ym, nvalid);
    } else {
      (q4 ? kGroupRows<true> : kGroupRows<false>)[mt](gp, nb, panel, sxt ? sxt + m0 * nb : nullptr, ym, ldy, nvalid);
    }
  }
}

#else  // portable scalar path over the same packed layout (x unscaled, row-major)

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
  return M * K;  // also covers the int8 layout (int8::scratch_floats: 19/32 of it)
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
// quantized to int8 per 32-value block (into `panels`). Tiles write disjoint parts: threads can build one each.
inline void prepare_tile(bool q4, const float* x, int64_t M, int64_t K, int64_t m0, float* panels, float* sums,
                         bool int8_activations = false) {
  if (int8_activations) {
    int8::quantize_tile(q4, x, M, K, m0, panels);
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
                                   bool int8_activations = false) {
  if (int8_activations) {
    PreparedInput in{panels, nullptr};
    in.quantized = true;
    in.q = int8::quantized_view(M, K, panels);
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
                                   bool int8_activations = false, bool convert_groups = false) {
  if (convert_groups) {
    PreparedInput in{x, nullptr};
    in.dequantized_groups = true;
    return in;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPrepareTile) prepare_tile(q4, x, M, K, m0, panels, sums, int8_activations);
  return prepared_view(q4, x, M, K, panels, sums, int8_activations);
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

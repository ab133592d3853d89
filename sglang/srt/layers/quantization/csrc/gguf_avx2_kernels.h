// The AVX2 / FMA / F16C float32 kernels over GGUF Q4_1 / Q8_0 row groups (layout and arithmetic: gguf_kernels.h):
// one row of x against a row group, and tiles of 2 .. kMaxTile rows that give each row the one-row kernel's
// operations in its order (a row's outputs are the same bits whatever else shares the call). group_avx2 is what
// gguf_kernels.h's matmul_groups calls for tiles of panels; the portable build has its own loop there instead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "gguf_layout.h"

#ifdef GGUF_LINEAR_AVX2

namespace gguf_kernels {


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

// One row of x against a row group. Q4_1: xt is the pre-scaled panel [K][1] (x itself), sxt the block sums [nb];
// Q8_0: xt is x itself (unscaled: 2^-24 is folded into d) and sxt is unused. y: the 16 outputs (nvalid of them
// stored). Input k of a block feeds chain k % kChains of both halves, k = 0 .. 31 in order (the loads of a weight
// vector shared by several k are one load once inlined).
template <bool Q4>
inline void group_one(const uint8_t* gp, int64_t nb, const float* xt, const float* sxt, float* y, int64_t nvalid) {
  using L = std::conditional_t<Q4, Q41Layout, Q80Layout>;
  const __m256 unscale = _mm256_set1_ps(1.0f / 16777216.0f);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    const float* xb = xt + b * kQK;
    prefetch_ahead<L::kBlockBytes>(bp);
    __m256 p[2][kChains];
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < kChains; ++c) p[h][c] = _mm256_setzero_ps();
    unroll<0, kQK>([&](auto kc) __attribute__((always_inline)) {
      constexpr int k = decltype(kc)::value;
      const __m256 xv = bcast(xb + k);
      p[0][k % kChains] = _mm256_fmadd_ps(weight_vector<Q4, k>(bp, 0), xv, p[0][k % kChains]);
      p[1][k % kChains] = _mm256_fmadd_ps(weight_vector<Q4, k>(bp, 1), xv, p[1][k % kChains]);
    });
    for (int h = 0; h < 2; ++h) {
      if constexpr (Q4) {
        acc[h] = _mm256_fmadd_ps(load_half8(bp + L::d(h)), sum_vectors<kChains>(p[h]), acc[h]);
        acc[h] = _mm256_fmadd_ps(load_half8(bp + Q41Layout::m(h)), bcast(sxt + b), acc[h]);
      } else {
        const __m256 dv = _mm256_mul_ps(load_half8(bp + L::d(h)), unscale);
        acc[h] = _mm256_fmadd_ps(dv, sum_vectors<kChains>(p[h]), acc[h]);
      }
    }
  }
  store_rows<1>(&acc[0], y, 0, nvalid);
  store_rows<1>(&acc[1], y + kHalf, 0, nvalid - kHalf);
}

// ---- several rows of x (2 .. kMaxTile) against a row group ----
// The one-row kernels' operations for each row: chains 0 and 1 of a block first, added, then chains 2 and 3, added,
// then the two sums; the accumulators across blocks live in memory (a load and a store per block). Three shapes:
// - up to kSubRows rows: both halves of the row group in one pass (each broadcast of x feeds both; 2 x kSubRows x 2
//   accumulators), each weight vector converted in registers where it is used;
// - up to kByHalfRows rows: one half after the other (2 x kByHalfRows accumulators), converted in registers too
//   (measured 12-16% faster at 3 and 4 rows than the buffer below, on an AVX2-only Zen 3);
// - more: the block's 64 vectors converted once into a buffer that stays in L1, sub-tiles of kSubRows rows from it.

constexpr int kSubRows = 2;
constexpr int kByHalfRows = 4;

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

// Chains C0 and C0 + 1 of half H of one block for MS rows of x, added: s[m] = c0 + c1 (one half at a time: 2 x MS
// accumulators, so kByHalfRows rows fit the 16 vector registers with the weight vector and the broadcast of x).
template <int H, int C0, int MS, int PS, typename Weight>
__attribute__((always_inline)) inline void half_chain_pair(Weight&& weight, const float* xb, __m256 (&s)[MS]) {
  __m256 p[MS][2];
  for (int m = 0; m < MS; ++m) p[m][0] = p[m][1] = _mm256_setzero_ps();
  unroll<0, kQK / kChains>([&](auto jc) __attribute__((always_inline)) {
    unroll<0, 2>([&](auto cc) __attribute__((always_inline)) {
      constexpr int c = decltype(cc)::value;
      constexpr int k = decltype(jc)::value * kChains + C0 + c;
      const __m256 w = weight(std::integral_constant<int, H>{}, std::integral_constant<int, k>{});
      for (int m = 0; m < MS; ++m) p[m][c] = _mm256_fmadd_ps(w, bcast(xb + k * PS + m), p[m][c]);
    });
  });
  for (int m = 0; m < MS; ++m) s[m] = _mm256_add_ps(p[m][0], p[m][1]);
}

// MS rows of x against one block, one half after the other: the same operations per row as rows_block.
template <bool Q4, int MS, int PS, typename Weight>
__attribute__((always_inline)) inline void rows_block_by_half(Weight&& weight, const float* xb, const __m256* dv,
                                                              const __m256* mv, const float* sx, __m256* acc0,
                                                              __m256* acc1) {
  __m256* acc[2] = {acc0, acc1};
  unroll<0, 2>([&](auto hc) __attribute__((always_inline)) {
    constexpr int H = decltype(hc)::value;
    __m256 s[MS], t[MS];
    half_chain_pair<H, 0, MS, PS>(weight, xb, s);
    half_chain_pair<H, 2, MS, PS>(weight, xb, t);
    for (int m = 0; m < MS; ++m) {
      __m256 a = _mm256_fmadd_ps(dv[H], _mm256_add_ps(s[m], t[m]), acc[H][m]);
      if constexpr (Q4) a = _mm256_fmadd_ps(mv[H], bcast(sx + m), a);
      acc[H][m] = a;
    }
  });
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
  alignas(32) __m256 w[2][kQK];  // a block's weight vectors, for tiles of more than kByHalfRows rows
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
    if constexpr (MT > kSubRows && MT <= kByHalfRows) {
      const auto convert = [&](auto hc, auto kc) __attribute__((always_inline)) {
        return weight_vector<Q4, decltype(kc)::value>(bp, decltype(hc)::value);
      };
      rows_block_by_half<Q4, MT, MT>(convert, xb, dv, mv, sx, acc[0], acc[1]);
      continue;
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
    (q4 ? group_one<true> : group_one<false>)(gp, nb, xt, sxt, y, nvalid);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
    const int64_t mt = std::min(kMaxTile, M - m0);
    const float* panel = xt + m0 * K;
    float* ym = y + m0 * ldy;
    if (mt == 1) {
      (q4 ? group_one<true> : group_one<false>)(gp, nb, panel, sxt ? sxt + m0 * nb : nullptr, ym, nvalid);
    } else {
      (q4 ? kGroupRows<true> : kGroupRows<false>)[mt](gp, nb, panel, sxt ? sxt + m0 * nb : nullptr, ym, ldy, nvalid);
    }
  }
}

}  // namespace gguf_kernels

#endif  // GGUF_LINEAR_AVX2

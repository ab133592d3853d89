// Decode attention over the paged KV cache: the query heads of one KV head (a GQA group) against a range of one
// sequence's tokens, K/V read by slot in their stored type (kv_types) and accumulated in float32. Shared by the
// standalone kernel (cpu_ops.cpp) and the fused decode step (decode_stack.cpp).
//
// Late in a long generation this is most of a batch-1 step, and it is bound by the K/V bytes. A bf16 or fp8
// element is converted to float32 in registers once and then used by every query head of a tile of up to three
// (kHeadTile): scores run 4 tokens x 3 heads of accumulators, values 3 heads x 4 column vectors, so a group of
// three converts each stored element once instead of once per head.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_kernels.h"
#include "kv_types.h"

namespace cpu_kernels {

// Attention of `group` query heads q [group, D] against one KV head over L tokens of a sequence: the keys/values
// are the rows kbase + slots[t] * slot_stride (likewise vbase). The result is left unnormalized so that the
// results of several token ranges of one sequence can be merged (merge_partials): per query head h, mx[h] is the
// largest score, sum[h] = sum_t exp(score_t - mx[h]) and out[h] = sum_t exp(score_t - mx[h]) * v_t.
// scores is scratch of group * L floats; out [group, D].
template <typename KV>
inline void attend_partial_scalar(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                                  int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                                  float* out, float* mx, float* sum) {
  for (int64_t t = 0; t < L; ++t) {
    const KV* kr = kbase + slots[t] * slot_stride;
    for (int64_t h = 0; h < group; ++h) scores[h * L + t] = dot(q + h * D, kr, D) * scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * L;
    mx[h] = *std::max_element(s, s + L);
    float total = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      s[t] = std::exp(s[t] - mx[h]);
      total += s[t];
    }
    sum[h] = total;
  }
  std::fill(out, out + group * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const KV* vr = vbase + slots[t] * slot_stride;
    for (int64_t h = 0; h < group; ++h) axpy(out + h * D, vr, scores[h * L + t], D);
  }
}

#ifdef CPU_KERNELS_AVX2

// Query heads per register tile: 4 tokens x 3 heads of score accumulators (or 3 heads x 4 column vectors of
// value accumulators) plus the converted K/V vector and the weights fit the 16 AVX2 registers.
constexpr int kHeadTile = 3;
constexpr int kScoreTokens = 4;
constexpr int kValueVectors = 12;  // accumulators per value tile: heads x column vectors

// Tokens of attention go in blocks of kTokenBlock: a block's K (then V) rows stay in L1 while every tile of the
// group uses them, and the rows of the next block are prefetched during the first tile's pass over this one.
// The slots of a long-running server are scattered, so the hardware prefetcher cannot guess the next row.
constexpr int64_t kTokenBlock = 64;

// Asks for the cache lines of one stored K or V row of D elements, into L2: a block of float32 rows prefetched
// into L1 would evict the block that the other tiles are still reading.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t D) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(row);
  const uintptr_t end = begin + static_cast<uintptr_t>(D) * sizeof(KV);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
}

// Asks for the rows of the first kTokenBlock of L tokens (the in-loop prefetch runs kTokenBlock tokens ahead).
template <typename KV>
inline void prefetch_first_rows(const KV* base, int64_t slot_stride, const int64_t* slots, int64_t L, int64_t D) {
  for (int64_t t = 0; t < std::min(L, kTokenBlock); ++t) prefetch_row(base + slots[t] * slot_stride, D);
}

// [sum(a[0]), sum(a[1]), sum(a[2]), sum(a[3])]
inline __m128 sum_each4(const __m256* a) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// The K rows of tokens [t, t + kScoreTokens) into rows; with prefetch_end > 0 also prefetches the rows kTokenBlock
// tokens ahead (up to prefetch_end).
template <typename KV>
inline void tile_rows(const KV* kbase, int64_t slot_stride, const int64_t* slots, int64_t t, int64_t D,
                      int64_t prefetch_end, const KV** rows) {
  for (int j = 0; j < kScoreTokens; ++j) {
    rows[j] = kbase + slots[t + j] * slot_stride;
    if (t + j + kTokenBlock < prefetch_end) prefetch_row(kbase + slots[t + j + kTokenBlock] * slot_stride, D);
  }
}

// scores[h * L + t] = scale * q_h . k_t for the HT heads at q and tokens [t0, t1) in steps of kScoreTokens (the
// caller does the remainder); with prefetch_end > 0 also prefetches the K rows kTokenBlock tokens ahead.
template <int HT, typename KV>
inline int64_t score_tile(const float* q, int64_t D, const KV* kbase, int64_t slot_stride, const int64_t* slots,
                          int64_t t0, int64_t t1, float scale, float* scores, int64_t L, int64_t prefetch_end) {
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t t = t0;
  for (; t + kScoreTokens <= t1; t += kScoreTokens) {
    const KV* kr[kScoreTokens];
    tile_rows(kbase, slot_stride, slots, t, D, prefetch_end, kr);
    // One flat array indexed by constants (a 2-D one is kept on the stack by GCC, a store per update).
    __m256 acc[HT * kScoreTokens];
#pragma GCC unroll 16
    for (int i = 0; i < HT * kScoreTokens; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
#pragma GCC unroll 4
      for (int j = 0; j < kScoreTokens; ++j) {
        const __m256 k = kv_types::load8(kr[j] + c);
#pragma GCC unroll 4
        for (int h = 0; h < HT; ++h)
          acc[h * kScoreTokens + j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + c), k, acc[h * kScoreTokens + j]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h)
      _mm_storeu_ps(scores + h * L + t, _mm_mul_ps(sum_each4(acc + h * kScoreTokens), vscale));
  }
  return t;
}

// out[h][col + c] += sum_t p_h[t] * v_t[col + c] for the HT heads at p (rows of L weights) and out (rows of D),
// NC vectors of 8 columns, tokens [t0, t1); with prefetch_end > 0 also prefetches the V rows kTokenBlock ahead.
template <int HT, int NC, typename KV>
inline void value_tile(const float* p, int64_t L, const KV* vbase, int64_t slot_stride, const int64_t* slots,
                       int64_t t0, int64_t t1, int64_t col, float* out, int64_t D, int64_t prefetch_end) {
  __m256 acc[HT * NC];  // flat, as in score_tile
#pragma GCC unroll 16
  for (int i = 0; i < HT * NC; ++i) acc[i] = _mm256_loadu_ps(out + (i / NC) * D + col + 8 * (i % NC));
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kTokenBlock < prefetch_end) prefetch_row(vbase + slots[t + kTokenBlock] * slot_stride, D);
    __m256 w[HT];
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h) w[h] = _mm256_broadcast_ss(p + h * L + t);
    const KV* vr = vbase + slots[t] * slot_stride + col;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m256 v = kv_types::load8(vr + 8 * c);
#pragma GCC unroll 4
      for (int h = 0; h < HT; ++h) acc[h * NC + c] = _mm256_fmadd_ps(w[h], v, acc[h * NC + c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < HT * NC; ++i) _mm256_storeu_ps(out + (i / NC) * D + col + 8 * (i % NC), acc[i]);
}

// The value tiles of HT heads over one token block: column chunks of up to kValueVectors / HT vectors (at most 8).
template <int HT, typename KV>
inline void value_tiles(const float* p, int64_t L, const KV* vbase, int64_t slot_stride, const int64_t* slots,
                        int64_t t0, int64_t t1, float* out, int64_t D, int64_t prefetch_end) {
  constexpr int64_t kChunk = std::min(kValueVectors / HT, 8);
  const int64_t nv = D / 8;
  for (int64_t c0 = 0; c0 < nv; c0 += kChunk, prefetch_end = 0) {
    with_constant<8>(std::min(kChunk, nv - c0), [&](auto NC) {
      value_tile<HT, NC, KV>(p, L, vbase, slot_stride, slots, t0, t1, 8 * c0, out, D, prefetch_end);
    });
  }
}

// Calls f(b0, b1, h0, HT, prefetch_end) for each block [b0, b1) of kTokenBlock tokens and each tile of HT (an
// integral constant, up to kHeadTile) query heads from h0; prefetch_end is L for a block's first tile, which
// prefetches the rows ahead, and 0 for the others.
template <typename F>
inline void for_each_block_tile(int64_t L, int64_t group, F&& f) {
  for (int64_t b0 = 0; b0 < L; b0 += kTokenBlock) {
    const int64_t b1 = std::min(L, b0 + kTokenBlock);
    for (int64_t h0 = 0; h0 < group; h0 += kHeadTile) {
      with_constant<kHeadTile>(group - h0, [&](auto HT) { f(b0, b1, h0, HT, h0 == 0 ? L : 0); });
    }
  }
}

// Per row h of scores [group, L]: mx_out[h] = max_t s[t], s[t] = exp(s[t] - mx_out[h]) in place, and sum_out[h] =
// sum_t s[t].
inline void softmax_rows(float* scores, int64_t group, int64_t L, float* mx_out, float* sum_out) {
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * L;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    float mx = max8(vmax);
    for (; t < L; ++t) mx = std::max(mx, s[t]);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= L; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
      _mm256_storeu_ps(s + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vsum);
    float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; t < L; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    mx_out[h] = mx;
    sum_out[h] = sum;
  }
}

// attend_partial for D % 8 == 0.
template <typename KV>
inline void attend_partial_avx2(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                                int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                                float* out, float* mx_out, float* sum_out) {
  prefetch_first_rows(kbase, slot_stride, slots, L, D);
  for_each_block_tile(L, group, [&](int64_t b0, int64_t b1, int64_t h0, auto HT, int64_t prefetch_end) {
    int64_t t = score_tile<HT, KV>(q + h0 * D, D, kbase, slot_stride, slots, b0, b1, scale, scores + h0 * L, L,
                                   prefetch_end);
    for (; t < b1; ++t) {
      if (t + kTokenBlock < prefetch_end) prefetch_row(kbase + slots[t + kTokenBlock] * slot_stride, D);
      const KV* kr = kbase + slots[t] * slot_stride;
      for (int64_t h = h0; h < h0 + HT; ++h) scores[h * L + t] = dot(q + h * D, kr, D) * scale;
    }
  });
  prefetch_first_rows(vbase, slot_stride, slots, L, D);
  softmax_rows(scores, group, L, mx_out, sum_out);
  std::fill(out, out + group * D, 0.f);
  for_each_block_tile(L, group, [&](int64_t b0, int64_t b1, int64_t h0, auto HT, int64_t prefetch_end) {
    value_tiles<HT, KV>(scores + h0 * L, L, vbase, slot_stride, slots, b0, b1, out + h0 * D, D, prefetch_end);
  });
}

#endif  // CPU_KERNELS_AVX2

}  // namespace cpu_kernels

// The AVX512 bf16 path uses the tiles, prefetch and softmax above.
#include "decode_attention_avx512.h"

namespace cpu_kernels {

// Whether bf16 attention can take the AVX512 path in this build on this CPU; turning it on (where it can) or off,
// returning whether it was on. The setting is per extension module (each one compiles this header).
inline bool has_decode_attention_avx512() {
#ifdef CPU_KERNELS_AVX2
  return avx512_attention_available();
#else
  return false;
#endif
}

inline bool set_decode_attention_avx512(bool on) {
#ifdef CPU_KERNELS_AVX2
  return avx512_attention_flag().exchange(on && avx512_attention_available());
#else
  (void)on;
  return false;
#endif
}

template <typename KV>
inline void attend_partial(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                           int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                           float* out, float* mx, float* sum) {
#ifdef CPU_KERNELS_AVX2
  if constexpr (std::is_same_v<KV, kv_types::bf16>) {
    if (attend_partial_paired(q, group, D, kbase, vbase, slot_stride, slots, L, scale, scores, out, mx, sum)) return;
  }
  if (D % 8 == 0) {
    attend_partial_avx2(q, group, D, kbase, vbase, slot_stride, slots, L, scale, scores, out, mx, sum);
    return;
  }
#endif
  attend_partial_scalar(q, group, D, kbase, vbase, slot_stride, slots, L, scale, scores, out, mx, sum);
}
// Attention of `group` query heads q [group, D] against one KV head of one sequence (all of its L tokens), as
// attend_partial but normalized: out [group, D]. scores is scratch of group * (L + 2) floats.
template <typename KV>
inline void attend_kv_head(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                           int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                           float* out) {
  float* mx = scores + group * L;
  float* sum = mx + group;
  attend_partial(q, group, D, kbase, vbase, slot_stride, slots, L, scale, scores, out, mx, sum);
  for (int64_t h = 0; h < group; ++h) {
    const float inv = 1.f / sum[h];
    float* oh = out + h * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
  }
}


}  // namespace cpu_kernels

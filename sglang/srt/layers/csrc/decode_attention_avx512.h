// Decode attention over bf16 K/V with AVX512 (decode_attention.h dispatches here when the CPU has AVX512F/BW and
// the head size is a multiple of 32). Same contract and float32 arithmetic as attend_partial_avx2, cheaper per
// element: a 512-bit load holds 32 bf16 values as 16 pairs, and each pair splits into two float32 vectors with one
// instruction each (the high half is a float32 once the low 16 bits are masked off; the low half once shifted up),
// instead of a widening shuffle and a shift per 8 values. The query heads are laid out the same way once per call
// (even channels, then odd channels, per 32), so the score dot products pair up without any shuffle; the value
// accumulators stay in that layout and are put back in channel order once at the end.
//
// Compiled into the AVX2 build with function-level targets and chosen at run time (avx512_attention_enabled()).
// Included by decode_attention.h after the AVX2 tiles, whose constants, loops, prefetch and softmax it shares.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "cpu_kernels.h"
#include "kv_types.h"

#ifdef CPU_KERNELS_AVX2

namespace cpu_kernels {

#define CPU_KERNELS_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// Whether this CPU can run the AVX512 path.
inline bool avx512_attention_available() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

// Whether attention takes the AVX512 path: where available, unless SGLANG_DECODE_ATTENTION_AVX2=1 (or
// set_decode_attention_avx512(false), decode_attention.h) keeps the AVX2 one.
inline std::atomic<bool>& avx512_attention_flag() {
  static std::atomic<bool> on{avx512_attention_available() && std::getenv("SGLANG_DECODE_ATTENTION_AVX2") == nullptr};
  return on;
}

inline bool avx512_attention_enabled() { return avx512_attention_flag().load(std::memory_order_relaxed); }

// The largest group * D the path handles (the paired query heads live in a stack buffer).
constexpr int64_t kPairedMaxFloats = 4096;

// Channel order <-> paired order: within each 32 channels, the 16 even ones, then the 16 odd ones.
inline void to_paired(const float* x, int64_t D, float* out) {
  for (int64_t c = 0; c < D; c += 32)
    for (int64_t i = 0; i < 16; ++i) {
      out[c + i] = x[c + 2 * i];
      out[c + 16 + i] = x[c + 2 * i + 1];
    }
}

inline void from_paired(const float* x, int64_t D, float* out) {
  for (int64_t c = 0; c < D; c += 32)
    for (int64_t i = 0; i < 16; ++i) {
      out[c + 2 * i] = x[c + i];
      out[c + 2 * i + 1] = x[c + 16 + i];
    }
}

// The even (low half of each pair) and odd (high half) bf16 values of 32 stored elements, as float32.
CPU_KERNELS_AVX512_TARGET inline void load_pairs(const kv_types::bf16* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// [sum(a[0]), sum(a[1]), sum(a[2]), sum(a[3])] of four 16-lane vectors.
CPU_KERNELS_AVX512_TARGET inline __m128 sum_each4_512(const __m512* a) {
  __m256 half[4];
  for (int j = 0; j < 4; ++j)
    half[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
  return sum_each4(half);
}

// scores[h * L + t] = scale * q_h . k_t for the HT paired heads at q (NCH chunks of 32 channels) and tokens
// [t0, t1); with prefetch_end > 0 also prefetches the K rows kTokenBlock tokens ahead.
template <int HT, int NCH>
CPU_KERNELS_AVX512_TARGET inline void score_tile_512(const float* q, const kv_types::bf16* kbase, int64_t slot_stride,
                                                     const int64_t* slots, int64_t t0, int64_t t1, float scale,
                                                     float* scores, int64_t L, int64_t prefetch_end) {
  constexpr int64_t D = 32 * NCH;
  __m512 qv[HT * NCH * 2];
#pragma GCC unroll 32
  for (int i = 0; i < HT * NCH * 2; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t t = t0;
  for (; t + kScoreTokens <= t1; t += kScoreTokens) {
    const kv_types::bf16* kr[kScoreTokens];
    tile_rows(kbase, slot_stride, slots, t, D, prefetch_end, kr);
    __m512 acc[HT * kScoreTokens];
#pragma GCC unroll 16
    for (int i = 0; i < HT * kScoreTokens; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < NCH; ++c) {
#pragma GCC unroll 4
      for (int j = 0; j < kScoreTokens; ++j) {
        __m512 even, odd;
        load_pairs(kr[j] + 32 * c, even, odd);
#pragma GCC unroll 4
        for (int h = 0; h < HT; ++h) {
          __m512& a = acc[h * kScoreTokens + j];
          a = _mm512_fmadd_ps(qv[(h * NCH + c) * 2], even, a);
          a = _mm512_fmadd_ps(qv[(h * NCH + c) * 2 + 1], odd, a);
        }
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h)
      _mm_storeu_ps(scores + h * L + t, _mm_mul_ps(sum_each4_512(acc + h * kScoreTokens), vscale));
  }
  for (; t < t1; ++t) {
    if (t + kTokenBlock < prefetch_end) prefetch_row(kbase + slots[t + kTokenBlock] * slot_stride, D);
    const kv_types::bf16* kr = kbase + slots[t] * slot_stride;
    __m512 acc[HT];
    for (int h = 0; h < HT; ++h) acc[h] = _mm512_setzero_ps();
    for (int c = 0; c < NCH; ++c) {
      __m512 even, odd;
      load_pairs(kr + 32 * c, even, odd);
      for (int h = 0; h < HT; ++h) {
        acc[h] = _mm512_fmadd_ps(qv[(h * NCH + c) * 2], even, acc[h]);
        acc[h] = _mm512_fmadd_ps(qv[(h * NCH + c) * 2 + 1], odd, acc[h]);
      }
    }
    for (int h = 0; h < HT; ++h) scores[h * L + t] = _mm512_reduce_add_ps(acc[h]) * scale;
  }
}

// out_h += sum_t p_h[t] * v_t for the HT heads at p (rows of L weights) and out (paired rows of D), tokens
// [t0, t1); with prefetch_end > 0 also prefetches the V rows kTokenBlock tokens ahead.
template <int HT, int NCH>
CPU_KERNELS_AVX512_TARGET inline void value_tile_512(const float* p, int64_t L, const kv_types::bf16* vbase,
                                                     int64_t slot_stride, const int64_t* slots, int64_t t0, int64_t t1,
                                                     float* out, int64_t prefetch_end) {
  constexpr int64_t D = 32 * NCH;
  __m512 acc[HT * NCH * 2];
#pragma GCC unroll 32
  for (int i = 0; i < HT * NCH * 2; ++i) acc[i] = _mm512_loadu_ps(out + 16 * i);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kTokenBlock < prefetch_end) prefetch_row(vbase + slots[t + kTokenBlock] * slot_stride, D);
    __m512 w[HT];
#pragma GCC unroll 4
    for (int h = 0; h < HT; ++h) w[h] = _mm512_set1_ps(p[h * L + t]);
    const kv_types::bf16* vr = vbase + slots[t] * slot_stride;
#pragma GCC unroll 8
    for (int c = 0; c < NCH; ++c) {
      __m512 even, odd;
      load_pairs(vr + 32 * c, even, odd);
#pragma GCC unroll 4
      for (int h = 0; h < HT; ++h) {
        acc[(h * NCH + c) * 2] = _mm512_fmadd_ps(w[h], even, acc[(h * NCH + c) * 2]);
        acc[(h * NCH + c) * 2 + 1] = _mm512_fmadd_ps(w[h], odd, acc[(h * NCH + c) * 2 + 1]);
      }
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < HT * NCH * 2; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

// attend_partial (decode_attention.h) for bf16 K/V with D = 32 * NCH.
template <int NCH>
CPU_KERNELS_AVX512_TARGET inline void attend_partial_avx512(const float* q, int64_t group, const kv_types::bf16* kbase,
                                                            const kv_types::bf16* vbase, int64_t slot_stride,
                                                            const int64_t* slots, int64_t L, float scale,
                                                            float* scores, float* out, float* mx, float* sum) {
  constexpr int64_t D = 32 * NCH;
  alignas(64) float paired[kPairedMaxFloats];
  for (int64_t h = 0; h < group; ++h) to_paired(q + h * D, D, paired + h * D);
  prefetch_first_rows(kbase, slot_stride, slots, L, D);
  for_each_block_tile(L, group, [&](int64_t b0, int64_t b1, int64_t h0, auto HT, int64_t prefetch_end) {
    score_tile_512<HT, NCH>(paired + h0 * D, kbase, slot_stride, slots, b0, b1, scale, scores + h0 * L, L,
                            prefetch_end);
  });
  prefetch_first_rows(vbase, slot_stride, slots, L, D);
  softmax_rows(scores, group, L, mx, sum);
  std::fill(paired, paired + group * D, 0.f);
  for_each_block_tile(L, group, [&](int64_t b0, int64_t b1, int64_t h0, auto HT, int64_t prefetch_end) {
    value_tile_512<HT, NCH>(scores + h0 * L, L, vbase, slot_stride, slots, b0, b1, paired + h0 * D, prefetch_end);
  });
  for (int64_t h = 0; h < group; ++h) from_paired(paired + h * D, D, out + h * D);
}

// Runs attend_partial_avx512 when it handles (D, group); false otherwise.
inline bool attend_partial_paired(const float* q, int64_t group, int64_t D, const kv_types::bf16* kbase,
                                  const kv_types::bf16* vbase, int64_t slot_stride, const int64_t* slots, int64_t L,
                                  float scale, float* scores, float* out, float* mx, float* sum) {
  if (D % 32 != 0 || D > 128 || group * D > kPairedMaxFloats || !avx512_attention_enabled()) return false;
  with_constant<4>(D / 32, [&](auto NCH) {
    attend_partial_avx512<NCH>(q, group, kbase, vbase, slot_stride, slots, L, scale, scores, out, mx, sum);
  });
  return true;
}

}  // namespace cpu_kernels

#endif  // CPU_KERNELS_AVX2

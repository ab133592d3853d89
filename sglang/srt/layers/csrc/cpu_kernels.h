// Float32 building blocks of the CPU decode step, on raw pointers: shared by the standalone kernels (cpu_ops.cpp)
// and the fused decode step (decode_stack.cpp). Attention reads K/V of any kv_types element type (KV) and
// accumulates in float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kv_types.h"

#if defined(__AVX2__) && defined(__FMA__)
#define CPU_KERNELS_AVX2 1
#include <immintrin.h>
#endif

namespace cpu_kernels {

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * kv_types::to_f32(b[i]);
  return acc;
}

template <typename KV>
inline void axpy(float* y, const KV* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * kv_types::to_f32(x[i]);
}

// out[r] = x[r] / rms(x[r]) * w for `rows` rows of n floats (out may alias x).
inline void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* orow = out + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) orow[i] = xr[i] * inv * w[i];
  }
}

// Rotates the first `rd` channels of one head in place (rotate-half layout). cos/sin are the rows of
// RotaryEmbedding.lookup: full rotary width, the sign of rotate-half folded into sin. tmp holds rd floats.
inline void rope_head(float* x, const float* cos, const float* sin, int64_t rd, float* tmp) {
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < rd; ++i) tmp[i] = x[i];
  for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
  for (int64_t i = half; i < rd; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

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

// Merges n partial results of one (sequence, KV head), each laid out as partial_floats(group, D) floats
// ([group, D] unnormalized output, then mx [group], then sum [group]), into the normalized out [group, D]:
// the log-sum-exp combination, in chunk order (so the result does not depend on which thread merges).
inline int64_t partial_floats(int64_t group, int64_t D) { return group * (D + 2); }

inline void merge_partials(const float* parts, int64_t n, int64_t group, int64_t D, float* out) {
  const int64_t stride = partial_floats(group, D);
  for (int64_t h = 0; h < group; ++h) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, parts[i * stride + group * D + h]);
    float* oh = out + h * D;
    std::fill(oh, oh + D, 0.f);
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const float* part = parts + i * stride;
      const float w = std::exp(part[group * D + h] - m);
      total += w * part[group * D + group + h];
      const float* ph = part + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) oh[d] += w * ph[d];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
  }
}

#ifdef CPU_KERNELS_AVX2

// exp(x) for 8 floats (Cephes polynomial, about 1 ulp); inputs below -87.3 give ~1e-38 instead of 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// [sum(a[0]), ..., sum(a[7])]
inline __m256 sum_each8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Tokens of attention go in blocks of kTokenBlock: a block's K (then V) rows stay in L1 while every query head of
// the group uses them, and the rows of the next block are prefetched during the first head's pass over this one.
// The slots of a long-running server are scattered, so the hardware prefetcher cannot guess the next row.
constexpr int64_t kTokenBlock = 64;

// Asks for the cache lines of one stored K or V row of D elements, into L2: a block of float32 rows prefetched
// into L1 would evict the block that the other query heads of the group are still reading.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t D) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(row);
  const uintptr_t end = begin + static_cast<uintptr_t>(D) * sizeof(KV);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
}

// out[c] += sum_t p[t] * v_t[c] for NC vectors of 8 columns starting at column col, tokens [t0, t1); with
// prefetch_end > 0 also prefetches the V rows kTokenBlock tokens ahead (below prefetch_end).
template <int NC, typename KV>
inline void accumulate_values(const float* p, const KV* vbase, int64_t slot_stride, const int64_t* slots,
                              int64_t t0, int64_t t1, int64_t col, float* out, int64_t prefetch_end, int64_t D) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(out + col + 8 * c);
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kTokenBlock < prefetch_end) prefetch_row(vbase + slots[t + kTokenBlock] * slot_stride, D);
    const __m256 w = _mm256_broadcast_ss(p + t);
    const KV* vr = vbase + slots[t] * slot_stride + col;
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(w, kv_types::load8(vr + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + col + 8 * c, acc[c]);
}

inline float max8(__m256 v) {
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
}

// attend_partial for D % 8 == 0. Scores of 8 tokens are formed at once (8 independent FMA chains, one horizontal
// reduction).
template <typename KV>
inline void attend_partial_avx2(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                                int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                                float* out, float* mx_out, float* sum_out) {
  const int64_t nv = D / 8;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t = 0; t < std::min(L, kTokenBlock); ++t) prefetch_row(kbase + slots[t] * slot_stride, D);
  for (int64_t b0 = 0; b0 < L; b0 += kTokenBlock) {
    const int64_t b1 = std::min(L, b0 + kTokenBlock);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * D;
      float* sh = scores + h * L;
      const int64_t prefetch_end = h == 0 ? L : 0;
      int64_t t = b0;
      for (; t + 8 <= b1; t += 8) {
        const KV* kr[8];
        for (int j = 0; j < 8; ++j) {
          kr[j] = kbase + slots[t + j] * slot_stride;
          if (t + j + kTokenBlock < prefetch_end) prefetch_row(kbase + slots[t + j + kTokenBlock] * slot_stride, D);
        }
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nv; ++c) {
          const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, kv_types::load8(kr[j] + 8 * c), acc[j]);
        }
        _mm256_storeu_ps(sh + t, _mm256_mul_ps(sum_each8(acc), vscale));
      }
      for (; t < b1; ++t) {
        if (t + kTokenBlock < prefetch_end) prefetch_row(kbase + slots[t + kTokenBlock] * slot_stride, D);
        sh[t] = dot(qh, kbase + slots[t] * slot_stride, D) * scale;
      }
    }
  }
  for (int64_t t = 0; t < std::min(L, kTokenBlock); ++t) prefetch_row(vbase + slots[t] * slot_stride, D);
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
  std::fill(out, out + group * D, 0.f);
  for (int64_t b0 = 0; b0 < L; b0 += kTokenBlock) {
    const int64_t b1 = std::min(L, b0 + kTokenBlock);
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t c0 = 0; c0 < nv; c0 += 8) {
        const float* p = scores + h * L;
        float* oh = out + h * D;
        const int64_t pe = h == 0 && c0 == 0 ? L : 0;
        switch (std::min<int64_t>(8, nv - c0)) {
          case 8: accumulate_values<8, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          case 7: accumulate_values<7, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          case 6: accumulate_values<6, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          case 5: accumulate_values<5, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          case 4: accumulate_values<4, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          case 3: accumulate_values<3, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          case 2: accumulate_values<2, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
          default: accumulate_values<1, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh, pe, D); break;
        }
      }
    }
  }
}

#endif  // CPU_KERNELS_AVX2

// out[j] = silu(gate[j]) * up[j] for n values of T (float32 or bf16), computed in float32 and rounded once to T.
template <typename T>
inline void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  int64_t j = 0;
#ifdef CPU_KERNELS_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = kv_types::load8(gate + j);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    kv_types::store8(out + j, _mm256_mul_ps(_mm256_mul_ps(g, sig), kv_types::load8(up + j)));
  }
#endif
  for (; j < n; ++j) {
    const float g = kv_types::to_f32(gate[j]);
    out[j] = kv_types::from_f32<T>(g / (1.f + std::exp(-g)) * kv_types::to_f32(up[j]));
  }
}

template <typename KV>
inline void attend_partial(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                           int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                           float* out, float* mx, float* sum) {
#ifdef CPU_KERNELS_AVX2
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

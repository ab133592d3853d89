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

// Attention of `group` query heads q [group, D] against one KV head of one sequence: its L keys/values are the rows
// kbase + slots[t] * slot_stride (likewise vbase). scores is scratch of group * L floats; out [group, D].
template <typename KV>
inline void attend_kv_head_scalar(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                                  int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                                  float* out) {
  for (int64_t t = 0; t < L; ++t) {
    const KV* kr = kbase + slots[t] * slot_stride;
    for (int64_t h = 0; h < group; ++h) scores[h * L + t] = dot(q + h * D, kr, D) * scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * L;
    const float mx = *std::max_element(s, s + L);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  std::fill(out, out + group * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const KV* vr = vbase + slots[t] * slot_stride;
    for (int64_t h = 0; h < group; ++h) axpy(out + h * D, vr, scores[h * L + t], D);
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

// out[c] += sum_t p[t] * v_t[c] for NC vectors of 8 columns starting at column col, tokens [t0, t1).
template <int NC, typename KV>
inline void accumulate_values(const float* p, const KV* vbase, int64_t slot_stride, const int64_t* slots,
                              int64_t t0, int64_t t1, int64_t col, float* out) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(out + col + 8 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 w = _mm256_broadcast_ss(p + t);
    const KV* vr = vbase + slots[t] * slot_stride + col;
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(w, kv_types::load8(vr + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + col + 8 * c, acc[c]);
}

// attend_kv_head for D % 8 == 0. Tokens go in blocks of kTokenBlock so that a block's K (then V) rows stay in L1
// while every query head of the group uses them; scores of 8 tokens are formed at once (8 independent FMA chains,
// one horizontal reduction).
template <typename KV>
inline void attend_kv_head_avx2(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                                int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                                float* out) {
  constexpr int64_t kTokenBlock = 64;
  const int64_t nv = D / 8;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t b0 = 0; b0 < L; b0 += kTokenBlock) {
    const int64_t b1 = std::min(L, b0 + kTokenBlock);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * D;
      float* sh = scores + h * L;
      int64_t t = b0;
      for (; t + 8 <= b1; t += 8) {
        const KV* kr[8];
        for (int j = 0; j < 8; ++j) kr[j] = kbase + slots[t + j] * slot_stride;
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nv; ++c) {
          const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, kv_types::load8(kr[j] + 8 * c), acc[j]);
        }
        _mm256_storeu_ps(sh + t, _mm256_mul_ps(sum_each8(acc), vscale));
      }
      for (; t < b1; ++t) sh[t] = dot(qh, kbase + slots[t] * slot_stride, D) * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * L;
    const float mx = *std::max_element(s, s + L);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {
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
    const float inv = 1.f / sum;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (t = 0; t + 8 <= L; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), vinv));
    for (; t < L; ++t) s[t] *= inv;
  }
  std::fill(out, out + group * D, 0.f);
  for (int64_t b0 = 0; b0 < L; b0 += kTokenBlock) {
    const int64_t b1 = std::min(L, b0 + kTokenBlock);
    for (int64_t h = 0; h < group; ++h) {
      for (int64_t c0 = 0; c0 < nv; c0 += 8) {
        const float* p = scores + h * L;
        float* oh = out + h * D;
        switch (std::min<int64_t>(8, nv - c0)) {
          case 8: accumulate_values<8, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          case 7: accumulate_values<7, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          case 6: accumulate_values<6, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          case 5: accumulate_values<5, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          case 4: accumulate_values<4, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          case 3: accumulate_values<3, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          case 2: accumulate_values<2, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
          default: accumulate_values<1, KV>(p, vbase, slot_stride, slots, b0, b1, 8 * c0, oh); break;
        }
      }
    }
  }
}

#endif  // CPU_KERNELS_AVX2

// out[j] = silu(gate[j]) * up[j] for n values.
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
#ifdef CPU_KERNELS_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + j)));
  }
#endif
  for (; j < n; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

template <typename KV>
inline void attend_kv_head(const float* q, int64_t group, int64_t D, const KV* kbase, const KV* vbase,
                           int64_t slot_stride, const int64_t* slots, int64_t L, float scale, float* scores,
                           float* out) {
#ifdef CPU_KERNELS_AVX2
  if (D % 8 == 0) {
    attend_kv_head_avx2(q, group, D, kbase, vbase, slot_stride, slots, L, scale, scores, out);
    return;
  }
#endif
  attend_kv_head_scalar(q, group, D, kbase, vbase, slot_stride, slots, L, scale, scores, out);
}

}  // namespace cpu_kernels

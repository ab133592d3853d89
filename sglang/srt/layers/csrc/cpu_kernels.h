// Float32 building blocks of the CPU decode step, on raw pointers: shared by the standalone kernels (cpu_ops.cpp)
// and the fused decode step (decode_stack.cpp). Attention reads K/V of any kv_types element type (KV) and
// accumulates in float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kv_types.h"

#if defined(__AVX2__) && defined(__FMA__)
#define CPU_KERNELS_AVX2 1
#include <immintrin.h>
#endif

namespace cpu_kernels {

// Calls f(std::integral_constant<int, n>) for n in 1..Max (below 1 as 1, above Max as Max): one compiled copy of a
// register-tiled kernel per tile size.
template <int Max, typename F>
inline void with_constant(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) {
      with_constant<Max - 1>(n, f);
      return;
    }
  }
  f(std::integral_constant<int, Max>{});
}

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

// out[r] = x[r] / rms(x[r]) * w for `rows` rows of n floats, written as Out: float32 (out may alias x) or bf16,
// rounded to nearest even as `.to(torch.bfloat16)` rounds the float32 result.
template <typename Out>
inline void rms_norm_rows(const float* x, const float* w, Out* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    Out* orow = out + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    if constexpr (std::is_same_v<Out, float>) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = xr[i] * inv * w[i];
    } else {
      for (int64_t i = 0; i < n; ++i) orow[i] = kv_types::from_f32<Out>(xr[i] * inv * w[i]);
    }
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

// The constants of exp's Cephes polynomial (about 1 ulp), shared by exp8 and the AVX512 exp16: inputs are clamped
// to [kMin, kMax], n = round(x * log2(e)), r = x - n * ln 2 (ln 2 in two parts), exp(x) = 2^n * (1 + r + r^2 p(r))
// with p's coefficients highest first.
namespace exp_poly {
constexpr float kMin = -87.3f, kMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

// exp(x) for 8 floats; inputs below kMin give ~1e-38 instead of 0.
inline __m256 exp8(__m256 x) {
  using namespace exp_poly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kMin)), _mm256_set1_ps(kMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float max8(__m256 v) {
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
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

// Index of the largest of n floats, as torch.argmax: the first of equal maxima, and the first NaN if there is one
// (NaN counts as the largest). One pass of 8-wide compares where AVX2 is compiled in; about ten times faster than
// aten's argmax over a vocabulary row, which a greedy decode step runs for every sequence.
inline int64_t argmax(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_v = n > 0 ? x[0] : 0.f;
#ifdef CPU_KERNELS_AVX2
  if (n >= 16) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    const __m256i eight = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, eight);
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 greater = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
      vmax = _mm256_blendv_ps(vmax, v, greater);
      vidx = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), greater));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan) != 0) {
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(32) float vals[8];
    alignas(32) int32_t idxs[8];
    _mm256_store_ps(vals, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idxs), vidx);
    best_v = vals[0];
    best = idxs[0];
    for (int l = 1; l < 8; ++l) {
      if (vals[l] > best_v || (vals[l] == best_v && idxs[l] < best)) {
        best_v = vals[l];
        best = idxs[l];
      }
    }
  }
#endif
  for (; i < n; ++i) {  // the tail (or every value): the first NaN here is the first of the row
    if (std::isnan(x[i])) return i;
    if (x[i] > best_v) {
      best_v = x[i];
      best = i;
    }
  }
  return best;
}

}  // namespace cpu_kernels

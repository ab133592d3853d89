// Float32 activations against GGUF Q4_1 / Q8_0 row groups (gguf_kernels.h) for many rows of x, with AVX2 and FMA.
//
// The tile kernels of gguf_kernels.h convert each weight vector in registers once per tile of up to 8 rows of x:
// every FMA there carries a share of that conversion (an AND, a conversion and a scale per 8 FMAs) and a broadcast
// of x. With many rows it is cheaper to convert a row group once into floats, d * q + m (the reference's values,
// exactly: d * q is exact in float32), in a per-thread buffer [K][16] that stays in L2, and to run the rows of x
// through a register-blocked kernel of up to 6 rows x 16 outputs: 12 accumulators, two weight loads per k shared by
// the rows, one broadcast per row feeding two FMAs. x is read as it is (row-major), without panels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "gguf_layout.h"

namespace gguf_kernels {

// From how many rows of x a float32 matmul converts each row group once (converts_groups) instead of once per
// tile; 0 never. Settable for tests and benchmarks (each compiled extension holds its own).
inline std::atomic<int64_t> g_dequant_min_rows{10};

// Sets g_dequant_min_rows (rows >= 0, checked by the callers); returns the previous value.
inline int64_t set_dequant_min_rows(int64_t rows) {
  return g_dequant_min_rows.exchange(rows);
}

// Whether a matmul of M rows of float32 x converts each row group once for all rows (dequant_group_rows), reading x
// as it is. The caller reads it once per call and passes it to prepare_input.
inline bool converts_groups(int64_t M, bool int8_activations) {
#ifdef GGUF_LINEAR_AVX2
  const int64_t min_rows = g_dequant_min_rows.load(std::memory_order_relaxed);
  return !int8_activations && min_rows > 0 && M >= min_rows;
#else
  (void)M, (void)int8_activations;
  return false;
#endif
}

#ifdef GGUF_LINEAR_AVX2

namespace dequant {

constexpr int64_t kMaxRows = 6;  // rows of x per register block

// w[k * 16 + row] = d * q + m for the nb blocks of a Q4_1 row group (rows past the matrix's end are zero padding).
inline void q4_1_group(const uint8_t* gp, int64_t nb, float* w) {
  using L = Q41Layout;
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    float* wb = w + b * kQK * kRows;
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 d = load_half8(bp + L::d(h));
      const __m256 m = load_half8(bp + L::m(h));
      for (int64_t j = 0; j < 4; ++j) {
        const __m256i v = load_vec(bp + L::vec(j, h));
        for (int i = 0; i < 8; ++i) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * i), low));
          _mm256_storeu_ps(wb + (8 * j + i) * kRows + h * kHalf, _mm256_fmadd_ps(q, d, m));
        }
      }
    }
  }
}

// The same for Q8_0: w = d * q.
inline void q8_0_group(const uint8_t* gp, int64_t nb, float* w) {
  using L = Q80Layout;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    float* wb = w + b * kQK * kRows;
    for (int64_t h = 0; h < 2; ++h) {
      const __m256 d = load_half8(bp + L::d(h));
      for (int64_t j = 0; j < 8; ++j) {
        const __m256i v = load_vec(bp + L::vec(j, h));
        const __m256i bytes[4] = {_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24),
                                  _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24),
                                  _mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24), _mm256_srai_epi32(v, 24)};
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(wb + (4 * j + i) * kRows + h * kHalf, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes[i]), d));
        }
      }
    }
  }
}

// y[r][0, nvalid) = sum_k x[r][k] w[k][.] for MR rows of x (row stride ldx) against a converted row group.
template <int MR>
inline void rows_x16(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                     int64_t nvalid) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kRows);
    const __m256 w1 = _mm256_loadu_ps(w + k * kRows + kHalf);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(w0, xv, lo[r]);
      hi[r] = _mm256_fmadd_ps(w1, xv, hi[r]);
    }
  }
  // Stored from copies: handing the accumulators' own addresses to store_rows makes GCC keep them in memory,
  // storing all 12 on every k.
  __m256 out[2][MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) out[0][r] = lo[r], out[1][r] = hi[r];
  store_rows<MR>(out[0], y, ldy, nvalid);
  store_rows<MR>(out[1], y + kHalf, ldy, nvalid - kHalf);
}

using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
constexpr RowsFn kRowsFns[kMaxRows + 1] = {nullptr,     rows_x16<1>, rows_x16<2>, rows_x16<3>,
                                           rows_x16<4>, rows_x16<5>, rows_x16<6>};

}  // namespace dequant

// One row group (16 rows, nvalid of them real) against all M rows of x (row-major, stride K): converted once into
// this thread's buffer, then 6 rows of x at a time.
inline void dequant_group_rows(bool q4, const uint8_t* gp, int64_t nb, int64_t K, int64_t M, const float* x,
                               float* y, int64_t ldy, int64_t nvalid) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(K * kRows));
  float* w = buffer.data();
  if (q4) {
    dequant::q4_1_group(gp, nb, w);
  } else {
    dequant::q8_0_group(gp, nb, w);
  }
  for (int64_t m0 = 0; m0 < M; m0 += dequant::kMaxRows) {
    const int64_t mr = std::min(dequant::kMaxRows, M - m0);
    dequant::kRowsFns[mr](x + m0 * K, K, w, K, y + m0 * ldy, ldy, nvalid);
  }
}

#endif

}  // namespace gguf_kernels

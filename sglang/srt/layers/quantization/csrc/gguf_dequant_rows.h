// Packed GGUF Q4_1 / Q8_0 row groups (gguf_layout.h) back to plain bf16 or float32 rows, for a GEMM that consumes
// the blocks a slab of output rows at a time (layers/quantization/block_gemm.py): a batch too large for the block
// kernels multiplies with the same blocks that small batches read, through the CPU's float32 or bf16 GEMM, without a
// second copy of the weights. Each value is d * q (+ m for Q4_1) in float32, as is or rounded to the nearest bf16
// (ties to even). `gather_columns` reads a few whole columns the same way (the int8 GEMM's outlier columns), and
// `gather_row` one whole row (an embedding lookup).
//
// The packed block holds, per half of 8 rows, one 32-byte vector per 4 (Q8_0) or 8 (Q4_1) inputs whose 4-byte lane
// r belongs to row r: an 8 x 8 (Q8_0) or 8 x 4 (Q4_1) transpose of 32-bit lanes gives each row its 32 inputs in
// order. The AVX2 path transposes in registers; the portable path reads the lanes one by one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_layout.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GGUF_COLUMNS_AVX512 1
#include <immintrin.h>
#endif

namespace gguf_kernels {
namespace rows {

inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// A converted value as stored: bf16 bits (uint16_t) or float32.
inline void put(uint16_t* o, float v) { *o = bf16_bits(v); }
inline void put(float* o, float v) { *o = v; }

// The 32 values of row `row` (0-15 in its row group) in one packed block bp, at o.
template <typename Out>
inline void block_row(bool q4, const uint8_t* bp, int64_t row, Out* o) {
  float d, m;
  block_scales(q4, bp, row, &d, &m);
  for (int64_t i = 0; i < kQK; ++i) put(o + i, block_weight(q4, d, m, block_quant(q4, bp, row, i)));
}

// Portable: rows [0, nvalid) of one row group, nb blocks, into out (row stride ldo, in elements of Out).
template <typename Out>
inline void group_portable(bool q4, const uint8_t* gp, int64_t nb, int64_t nvalid, Out* out, int64_t ldo) {
  const int64_t bb = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t row = 0; row < nvalid; ++row) block_row(q4, gp + b * bb, row, out + row * ldo + b * kQK);
  }
}

#ifdef GGUF_LINEAR_AVX2

// 8 float32 -> 8 bf16 (round to nearest even), in the low 128 bits.
inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane: 4 words, repeated
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// Transposes 8 vectors of 8 32-bit lanes in place: afterwards v[r] lane j = before v[j] lane r.
inline void transpose8x8(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[0..3]: rows 0,1,2,3 (low 128) and 4,5,6,7 (high 128) of lanes j = 0..3; u[4..7] the same for j = 4..7
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    v[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}

// 8 converted values stored at o: as bf16 or as float32.
inline void store8(uint16_t* o, __m256 f) { _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16x8(f)); }
inline void store8(float* o, __m256 f) { _mm256_storeu_ps(o, f); }

// 32 int8 (in input order) times d, as 32 values at o.
template <typename Out>
inline void store_q8_row(__m256i q, __m256 d, Out* o) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int p = 0; p < 4; ++p) {
    store8(o + 8 * p, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p])), d));
  }
}

template <typename Out>
inline void group_avx2(bool q4, const uint8_t* gp, int64_t nb, int64_t nvalid, Out* out, int64_t ldo) {
  alignas(32) float d[kRows], m[kRows];
  for (int64_t b = 0; b < nb; ++b) {
    if (q4) {
      const uint8_t* bp = gp + b * Q41Layout::kBlockBytes;
      for (int64_t h = 0; h < 2; ++h) {
        _mm256_store_ps(d + h * kHalf, load_half8(bp + Q41Layout::d(h)));
        _mm256_store_ps(m + h * kHalf, load_half8(bp + Q41Layout::m(h)));
        // lanes j = 0..3 (8 inputs each) of the 8 rows, transposed with 4 zero vectors: v[r] lanes 0..3 = row r
        __m256i v[8];
        for (int64_t j = 0; j < 4; ++j) v[j] = load_vec(bp + Q41Layout::vec(j, h));
        for (int64_t j = 4; j < 8; ++j) v[j] = _mm256_setzero_si256();
        transpose8x8(v);
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int64_t r = 0; r < kHalf && h * kHalf + r < nvalid; ++r) {
          const __m128i bytes = _mm256_castsi256_si128(v[r]);  // 16 bytes: inputs (2t, 2t + 1) in byte t
          const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
          const __m128i q0 = _mm_unpacklo_epi8(lo, hi), q1 = _mm_unpackhi_epi8(lo, hi);  // inputs 0-15, 16-31
          const __m256 dv = _mm256_set1_ps(d[h * kHalf + r]), mv = _mm256_set1_ps(m[h * kHalf + r]);
          Out* o = out + (h * kHalf + r) * ldo + b * kQK;
          const __m128i parts[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
          for (int p = 0; p < 4; ++p) {
            store8(o + 8 * p, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p])), dv, mv));
          }
        }
      }
    } else {
      const uint8_t* bp = gp + b * Q80Layout::kBlockBytes;
      for (int64_t h = 0; h < 2; ++h) {
        _mm256_store_ps(d + h * kHalf, load_half8(bp + Q80Layout::d(h)));
        __m256i v[8];
        for (int64_t j = 0; j < 8; ++j) v[j] = load_vec(bp + Q80Layout::vec(j, h));
        transpose8x8(v);
        for (int64_t r = 0; r < kHalf && h * kHalf + r < nvalid; ++r) {
          store_q8_row(v[r], _mm256_set1_ps(d[h * kHalf + r]), out + (h * kHalf + r) * ldo + b * kQK);
        }
      }
    }
  }
}

#endif

// Rows [16 * g0, min(N, 16 * g1)) of the weight as bf16 (Out = uint16_t) or float32, written from out (the slab's
// first row), row stride K.
template <typename Out>
inline void dequant_groups(bool q4, const uint8_t* packed, int64_t N, int64_t K, int64_t g0, int64_t g1, Out* out,
                           bool vector) {
  const int64_t nb = K / kQK;
  const int64_t group_bytes = nb * (q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t nvalid = std::min<int64_t>(kRows, N - g * kRows);
    Out* o = out + (g - g0) * kRows * K;
#ifdef GGUF_LINEAR_AVX2
    if (vector) {
      group_avx2(q4, packed + g * group_bytes, nb, nvalid, o, K);
      continue;
    }
#endif
    (void)vector;
    group_portable(q4, packed + g * group_bytes, nb, nvalid, o, K);
  }
}

// Weight columns cols[0, ncols) of rows [16 * g0, min(N, 16 * g1)) as float32, out[row][j] = W[row][cols[j]] (row
// stride ncols, from the slab's first row): the few input columns that a large batch multiplies apart from its
// int8 product (layers/int8_linear.py), read from the blocks instead of a float copy of the weight.
inline void gather_columns(bool q4, const uint8_t* packed, int64_t N, int64_t K, const int64_t* cols, int64_t ncols,
                           int64_t g0, int64_t g1, float* out) {
  const int64_t nb = K / kQK;
  const int64_t bb = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = packed + g * nb * bb;
    const int64_t nvalid = std::min<int64_t>(kRows, N - g * kRows);
    for (int64_t row = 0; row < nvalid; ++row) {
      float* o = out + ((g - g0) * kRows + row) * ncols;
      for (int64_t j = 0; j < ncols; ++j) {
        const uint8_t* bp = gp + cols[j] / kQK * bb;
        float d, m;
        block_scales(q4, bp, row, &d, &m);
        o[j] = block_weight(q4, d, m, block_quant(q4, bp, row, cols[j] % kQK));
      }
    }
  }
}

#ifdef GGUF_COLUMNS_AVX512
constexpr int64_t kGatherAhead = 8;  // row groups fetched ahead in gather_columns_t (prefetches never fault)

// gather_columns with AVX512 (where int8::avx512_supported()), written transposed: out [ncols, N] (column j of the
// weight at out + j * N), row groups [g0, g1). A row group's values of one column are one line of its block
// (column_weights: the same values as the scalar loop). Column by column, so that the lines read follow one stride (a
// row group's bytes) and the stores are contiguous.
template <bool Q4>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline void gather_columns_t(
    const uint8_t* packed, int64_t N, int64_t K, const int64_t* cols, int64_t ncols, int64_t g0, int64_t g1,
    float* out) {
  const int64_t block_bytes = Q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  const int64_t nb = K / kQK, group_bytes = nb * block_bytes;
  for (int64_t j = 0; j < ncols; ++j) {
    const int64_t i = cols[j] % kQK;
    const uint8_t* bp = packed + cols[j] / kQK * block_bytes;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* b = bp + g * group_bytes;
      _mm_prefetch(reinterpret_cast<const char*>(b + kGatherAhead * group_bytes + column_line<Q4>(i)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + kGatherAhead * group_bytes), _MM_HINT_T0);
      const int64_t nvalid = std::min<int64_t>(kRows, N - g * kRows);
      const __mmask16 mask = nvalid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nvalid) - 1);
      _mm512_mask_storeu_ps(out + j * N + g * kRows, mask, column_weights<Q4>(b, i));
    }
  }
}
#endif

// Row `row` of the packed weight [N, K] as float32 at out: the values dequant_groups writes. Each product d * q is
// exact in float32 (an fp16 scale times at most 8 bits), so Q4_1's d * q + m rounds once with or without FMA and
// the row equals the dequantized weight's bit for bit. An input embedding read from the LM head's blocks.
inline void gather_row(bool q4, const uint8_t* packed, int64_t K, int64_t row, float* out) {
  const int64_t nb = K / kQK, bb = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  const uint8_t* gp = packed + row / kRows * nb * bb;
  for (int64_t b = 0; b < nb; ++b) block_row(q4, gp + b * bb, row % kRows, out + b * kQK);
}

}  // namespace rows
}  // namespace gguf_kernels

// The packed layout of GGUF Q4_1 / Q8_0 row groups (see gguf_kernels.h) and small helpers shared by the float32
// kernels (gguf_kernels.h, gguf_dequant_gemm.h) and the int8-activation kernels (gguf_int8.h).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_LINEAR_AVX2 1
#include <immintrin.h>
#endif

namespace gguf_kernels {

constexpr int64_t kQK = 32;    // weights per GGUF block
constexpr int64_t kHalf = 8;   // output rows per half (one 32-bit lane each)
constexpr int64_t kRows = 16;  // output rows interleaved in one row group
constexpr int64_t kMaxTile = 8;  // rows of x processed per pass over a row group (float32 tiles of panels)

// Byte offsets inside one packed block of a row group.
struct Q41Layout {
  static constexpr int64_t kBlockBytes = 320;
  static constexpr int64_t d(int64_t h) { return 16 * h; }
  static constexpr int64_t m(int64_t h) { return 32 + 16 * h; }
  static constexpr int64_t vec(int64_t j, int64_t h) { return 64 + 64 * j + 32 * h; }
};
struct Q80Layout {
  static constexpr int64_t kBlockBytes = 544;
  static constexpr int64_t d(int64_t h) { return 16 * h; }
  static constexpr int64_t vec(int64_t j, int64_t h) { return 32 + 64 * j + 32 * h; }
};

#if defined(__x86_64__) || defined(__i386__)
// Software prefetch of the weight stream, kPrefetchBytes ahead of the block being read (the row groups of one
// thread are contiguous, so this runs into the next group as well). Covers one block's worth of cache lines.
constexpr int64_t kPrefetchBytes = 2048;

template <int64_t BlockBytes>
inline void prefetch_ahead(const uint8_t* bp) {
  for (int64_t off = 0; off < BlockBytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(bp + kPrefetchBytes + off), _MM_HINT_T0);
  }
}

#endif

#ifdef GGUF_LINEAR_AVX2
// Eight fp16 values at p, as float32.
inline __m256 load_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load_vec(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Stores MT vectors of 8 outputs (rows of x m = 0..MT-1, row stride ldy), only the first nvalid of each.
template <int MT>
inline void store_rows(const __m256* acc, float* y, int64_t ldy, int64_t nvalid) {
  if (nvalid >= kHalf) {
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(y + m * ldy, acc[m]);
  } else if (nvalid > 0) {
    alignas(32) float tmp[kHalf];
    for (int m = 0; m < MT; ++m) {
      _mm256_store_ps(tmp, acc[m]);
      for (int64_t r = 0; r < nvalid; ++r) y[m * ldy + r] = tmp[r];
    }
  }
}
#endif

// An fp16 value stored little-endian at p, as float32 (exact; no F16C needed).
inline float fp16_to_fp32(const uint8_t* p) {
  const uint16_t h = static_cast<uint16_t>(p[0] | (p[1] << 8));
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      exp = 113;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else {
    bits = sign | (exp == 0x1F ? 0x7F800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Where row `row` (0-15 in its row group) of one packed block bp keeps its values: its scale d and, for Q4_1, its
// minimum m (Q8_0: none), and the quantized value of its input i (0-31). The weight is `block_weight`.
inline void block_scales(bool q4, const uint8_t* bp, int64_t row, float* d, float* m) {
  const int64_t h = row / kHalf, r = row % kHalf;
  *d = fp16_to_fp32(bp + (q4 ? Q41Layout::d(h) : Q80Layout::d(h)) + 2 * r);
  *m = q4 ? fp16_to_fp32(bp + Q41Layout::m(h) + 2 * r) : 0.0f;
}

inline int block_quant(bool q4, const uint8_t* bp, int64_t row, int64_t i) {
  const int64_t h = row / kHalf, r = row % kHalf;
  if (q4) return (bp[Q41Layout::vec(i / 8, h) + 4 * r + (i % 8) / 2] >> (4 * (i % 2))) & 0xF;
  return static_cast<int8_t>(bp[Q80Layout::vec(i / 4, h) + 4 * r + i % 4]);
}

// d * q (+ m): each product d * q is exact in float32 (an fp16 scale times at most 8 bits), so Q4_1's sum rounds once
// with or without FMA.
inline float block_weight(bool q4, float d, float m, int q) {
  return q4 ? d * static_cast<float>(q) + m : d * static_cast<float>(q);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// One column of a packed block with AVX512: the 16 rows' weights of input i (0-31) in row order, the values
// block_weight gives. A block keeps them in one 64-byte line, a 4-byte lane per row (Q8_0: byte i % 4 of the lane at
// vec(i / 4, 0); Q4_1: nibble i % 2 of byte (i % 8) / 2 at vec(i / 8, 0)), and their fp16 scales (and Q4_1's minima)
// in the 32 bytes at d(0) (m(0)). Callers check the CPU for AVX512 F/BW/VL, F16C and FMA.
template <bool Q4>
constexpr int64_t column_line(int64_t i) {
  return Q4 ? Q41Layout::vec(i / 8, 0) : Q80Layout::vec(i / 4, 0);
}

template <bool Q4>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline __m512 column_weights(const uint8_t* bp,
                                                                                          int64_t i) {
  const __m512i line = _mm512_loadu_si512(bp + column_line<Q4>(i));
  const int64_t d_at = Q4 ? Q41Layout::d(0) : Q80Layout::d(0);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + d_at)));
  if constexpr (Q4) {  // the nibble, unsigned; d * q + m
    const auto shift = static_cast<unsigned>(8 * ((i % 8) / 2) + 4 * (i % 2));
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(line, shift), _mm512_set1_epi32(0xF));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + Q41Layout::m(0))));
    return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), m);
  } else {  // the byte, sign-extended; d * q
    const auto shift = static_cast<unsigned>(8 * (3 - i % 4));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(line, shift), 24)));
  }
}
#endif

}  // namespace gguf_kernels

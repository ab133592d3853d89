// The packed layout of GGUF Q4_1 / Q8_0 row groups (see gguf_kernels.h) and small helpers shared by the float32
// kernels (gguf_kernels.h, gguf_dequant_gemm.h) and the int8-activation kernels (gguf_int8.h).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
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

}  // namespace gguf_kernels

// The packed layout of GGUF Q4_1 / Q8_0 row groups (see gguf_kernels.h) and small helpers shared by the float32
// kernels (gguf_kernels.h) and the int8-activation kernels (gguf_int8.h).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace gguf_kernels {

constexpr int64_t kQK = 32;    // weights per GGUF block
constexpr int64_t kHalf = 8;   // output rows per half (one 32-bit lane each)
constexpr int64_t kRows = 16;  // output rows interleaved in one row group

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

// GGUF K-quant rows (Q2_K-Q6_K) converted to the Q4_1 / Q8_0 blocks the kernels read, one stored row at a time:
// the rules of model_loader/gguf_block_convert.py (its docstring states them and their bounds), bit for bit.
//
// - Q4_K as Q4_1: per 32-weight sub-block d' = fp16(d * sc), m' = fp16(-(dmin * m)) (both products exact in
//   float32, one rounding to nearest even), and the same 4-bit codes, laid out as a Q4_1 block (value j in the low
//   nibble of byte j, value j + 16 in its high nibble).
// - any K-quant as Q8_0: each 32-weight block of the row's values (gguf_kquant_rows.h) is (s, w / s) where those
//   are integers of at most 127 times the super-block's fp16 scale s (checked by multiplying back), else rounded
//   with the smallest fp16 d >= max|w| / 127, q = round(w / d) (half to even, as torch.round).
// A scale that overflows fp16 makes the conversion fail (returns false), as the Python rules raise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gguf_kquant_rows.h"
#include "gguf_pack.h"

namespace gguf_kernels {
namespace kquant {

constexpr int64_t kQ41Bytes = 20, kQ80Bytes = 34;

inline bool fp16_finite(uint16_t h) { return (h & 0x7C00u) != 0x7C00u; }

inline float fp16_bits_to_fp32(uint16_t h) {
  uint8_t b[2] = {static_cast<uint8_t>(h & 0xFF), static_cast<uint8_t>(h >> 8)};
  return fp16_to_fp32(b);
}

// Byte offset of the fp16 super-block scale d tried as a Q8_0 block's exact scale.
inline int64_t scale_offset(int type) {
  switch (type) {
    case kQ2_K: return 80;
    case kQ3_K: return 108;
    case kQ6_K: return 208;
    default: return 0;  // Q4_K, Q5_K
  }
}

// One stored Q4_K row of K weights as K / 32 Q4_1 blocks at out.
inline bool q4_k_row_as_q4_1(const uint8_t* row, int64_t K, uint8_t* out) {
  for (int64_t sb = 0; sb < K / kSuper; ++sb) {
    const uint8_t* b = row + sb * 144;
    const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
    const uint8_t* qs = b + 16;
    for (int64_t s = 0; s < 8; ++s) {
      int sc, m;
      scale_min_k4(b + 4, s, &sc, &m);
      const uint16_t scale = pack::fp32_to_fp16(d * static_cast<float>(sc));
      const uint16_t offset = pack::fp32_to_fp16(-(dmin * static_cast<float>(m)));
      if (!fp16_finite(scale) || !fp16_finite(offset)) return false;
      uint8_t* o = out + (sb * 8 + s) * kQ41Bytes;
      pack::put_u16(o, scale);
      pack::put_u16(o + 2, offset);
      const int64_t c = s / 2, shift = 4 * (s % 2);
      for (int64_t j = 0; j < 16; ++j) {
        const int lo = (qs[32 * c + j] >> shift) & 0xF, hi = (qs[32 * c + 16 + j] >> shift) & 0xF;
        o[4 + j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
  return true;
}

// One stored K-quant row of K weights as K / 32 Q8_0 blocks at out; `values`: scratch of K floats.
inline bool row_as_q8_0(int type, const uint8_t* row, int64_t K, float* values, uint8_t* out) {
  dequant_row(type, row, K, values);
  const int64_t bytes = super_block_bytes(type), at = scale_offset(type);
  for (int64_t blk = 0; blk < K / 32; ++blk) {
    const float* w = values + blk * 32;
    const float s = fp16_to_fp32(row + blk / 8 * bytes + at);
    // max |w| from the bits: non-negative floats order as their bit patterns (above infinity's: a NaN)
    uint32_t bits[32], top = 0;
    std::memcpy(bits, w, sizeof(bits));
    for (int64_t j = 0; j < 32; ++j) {
      const uint32_t x = bits[j] & 0x7FFFFFFFu;
      top = x > top ? x : top;
    }
    if (top > 0x7F800000u) return false;  // a NaN, as a NaN scale would be
    float amax;
    std::memcpy(&amax, &top, 4);
    const float need = amax / 127.0f;
    uint16_t d16 = pack::fp32_to_fp16(need);
    if (fp16_bits_to_fp32(d16) < need) d16 = static_cast<uint16_t>(d16 + 1);  // the next fp16 up
    if (!fp16_finite(d16)) return false;
    const float d = fp16_bits_to_fp32(d16);
    // exact: every value an integer of at most 127 times s; the loops run over all 32 values so they vectorize
    float a[32];
    for (int64_t j = 0; j < 32; ++j) a[j] = s != 0.0f ? std::nearbyint(w[j] / s) : 0.0f;
    int misses = 0;
    for (int64_t j = 0; j < 32; ++j) misses |= static_cast<int>(std::fabs(a[j]) > 127.0f) | static_cast<int>(a[j] * s != w[j]);
    const bool exact = misses == 0;
    uint8_t* o = out + blk * kQ80Bytes;
    pack::put_u16(o, exact ? pack::fp32_to_fp16(s) : d16);
    if (!exact) {
      for (int64_t j = 0; j < 32; ++j) a[j] = d > 0.0f ? std::nearbyint(w[j] / d) : 0.0f;
    }
    for (int64_t j = 0; j < 32; ++j) {
      const float q = a[j] < -127.0f ? -127.0f : a[j] > 127.0f ? 127.0f : a[j];
      o[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
    }
  }
  return true;
}

}  // namespace kquant
}  // namespace gguf_kernels

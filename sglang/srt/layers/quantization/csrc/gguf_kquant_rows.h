// Rows of a GGUF K-quant matrix (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), as the file stores them, dequantized to float32: an
// embedding table looked up in the file's own blocks instead of a float32 copy (4.9x-12x the bytes).
//
// Each 256-weight super-block holds an fp16 scale d (and an fp16 dmin where the type has minimums) and a small
// integer scale (and minimum) per sub-block of 16 or 32 weights; a weight is (d * scale) * q, or
// (d * scale) * q - dmin * minimum. Those products are exact in float32 (11-bit fp16 mantissas times at most 8-bit
// integers, times at most 6-bit codes), but for Q6_K's (d * scale) * q, which rounds once, so every value is the one
// rounding of the formula whether or not the compiler fuses the multiply and the subtraction: each row equals the
// reference dequantization (gguf.quants.dequantize) bit for bit.
#pragma once

#include <cstdint>

#include "gguf_layout.h"

namespace gguf_kernels {
namespace kquant {

constexpr int64_t kSuper = 256;
enum Type : int { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// Bytes of one super-block of GGML type `type`, 0 for a type that is not a K-quant.
inline int64_t super_block_bytes(int type) {
  switch (type) {
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// The 6-bit scale and minimum of sub-block s (0-7) of Q4_K / Q5_K, from their 12 packed bytes.
inline void scale_min_k4(const uint8_t* q, int64_t s, int* sc, int* m) {
  if (s < 4) {
    *sc = q[s] & 63;
    *m = q[s + 4] & 63;
  } else {
    *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
    *m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

// Weight 128h + 32j + l of a super-block (h: its half, j: its 32-weight group, l: 0-31): byte 32h + l of the 2-bit
// planes (Q2_K / Q3_K qs, Q6_K qh) holds it in bits 2j; sub-blocks of 16 weights are consecutive. Each loop runs
// over the 16 weights of one sub-block, with its scale fixed, so that it vectorizes.
inline void q2_k(const uint8_t* b, float* out) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
  for (int64_t s = 0; s < 16; ++s) {
    const int64_t h = s / 8, j = s % 8 / 2, first = 16 * (s % 2);
    const float dl = d * static_cast<float>(scales[s] & 0xF), ml = dmin * static_cast<float>(scales[s] >> 4);
    const uint8_t* q = qs + 32 * h + first;
    float* o = out + 16 * s;
    for (int64_t l = 0; l < 16; ++l) o[l] = dl * static_cast<float>((q[l] >> (2 * j)) & 3) - ml;
  }
}

inline void q3_k(const uint8_t* b, float* out) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* scales = b + 96;
  const float d = fp16_to_fp32(b + 108);
  for (int64_t s = 0; s < 16; ++s) {
    const int64_t h = s / 8, j = s % 8 / 2, first = 16 * (s % 2);
    const int low = (scales[s % 8] >> (4 * (s / 8))) & 0xF, high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    const float dl = d * static_cast<float>((low | (high << 4)) - 32);
    const uint8_t* q = qs + 32 * h + first;
    const uint8_t* hm = hmask + first;
    float* o = out + 16 * s;
    for (int64_t l = 0; l < 16; ++l) {
      const int v = ((q[l] >> (2 * j)) & 3) - (((hm[l] >> (4 * h + j)) & 1) ? 0 : 4);
      o[l] = dl * static_cast<float>(v);
    }
  }
}

// Q4_K (FiveBits false) and Q5_K: in each chunk c of 64 weights, byte l of the chunk's 32 qs bytes holds weight l of
// sub-block 2c (low nibble) and of sub-block 2c + 1 (high); Q5_K's fifth bit of sub-block s's weight l is bit s of
// qh[l].
template <bool FiveBits>
inline void q45_k(const uint8_t* b, float* out) {
  const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = FiveBits ? b + 48 : b + 16;
  for (int64_t c = 0; c < 4; ++c) {
    int sc0, m0, sc1, m1;
    scale_min_k4(scales, 2 * c, &sc0, &m0);
    scale_min_k4(scales, 2 * c + 1, &sc1, &m1);
    const float dl0 = d * static_cast<float>(sc0), ml0 = dmin * static_cast<float>(m0);
    const float dl1 = d * static_cast<float>(sc1), ml1 = dmin * static_cast<float>(m1);
    const uint8_t* q = qs + 32 * c;
    float* o = out + 64 * c;
    for (int64_t l = 0; l < 32; ++l) {
      int v0 = q[l] & 0xF, v1 = q[l] >> 4;
      if (FiveBits) {
        v0 |= ((qh[l] >> (2 * c)) & 1) << 4;
        v1 |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      o[l] = dl0 * static_cast<float>(v0) - ml0;
      o[32 + l] = dl1 * static_cast<float>(v1) - ml1;
    }
  }
}

// Q6_K: weight 128h + 32t + l has its low 4 bits in nibble t / 2 of ql[64h + 32(t % 2) + l] and its high 2 bits in
// bits 2t of qh[32h + l].
inline void q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16_to_fp32(b + 208);
  for (int64_t s = 0; s < 16; ++s) {
    const int64_t h = s / 8, t = s % 8 / 2, first = 16 * (s % 2);
    const float dl = d * static_cast<float>(scales[s]);
    const uint8_t* lo = ql + 64 * h + 32 * (t % 2) + first;
    const uint8_t* hi = qh + 32 * h + first;
    const int lo_shift = 4 * static_cast<int>(t / 2), hi_shift = 2 * static_cast<int>(t);
    float* o = out + 16 * s;
    for (int64_t l = 0; l < 16; ++l) {
      const int v = (((lo[l] >> lo_shift) & 0xF) | (((hi[l] >> hi_shift) & 3) << 4)) - 32;
      o[l] = dl * static_cast<float>(v);
    }
  }
}

// One stored row of K weights (K / 256 super-blocks of type `type`) as float32 at out.
inline void dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  const int64_t bytes = super_block_bytes(type);
  for (int64_t sb = 0; sb < K / kSuper; ++sb) {
    const uint8_t* b = row + sb * bytes;
    float* o = out + sb * kSuper;
    switch (type) {
      case kQ2_K: q2_k(b, o); break;
      case kQ3_K: q3_k(b, o); break;
      case kQ4_K: q45_k<false>(b, o); break;
      case kQ5_K: q45_k<true>(b, o); break;
      default: q6_k(b, o); break;
    }
  }
}

}  // namespace kquant
}  // namespace gguf_kernels

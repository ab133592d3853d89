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

// Weight i of a super-block: within each half of 128 weights, 32 consecutive weights share a 2-bit plane (Q2_K /
// Q3_K qs, Q6_K qh) or a nibble (Q6_K ql), byte l of the half's bytes holding weight l of each.
inline void q2_k(const uint8_t* b, float* out) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = fp16_to_fp32(b + 80), dmin = fp16_to_fp32(b + 82);
  for (int64_t i = 0; i < kSuper; ++i) {
    const int64_t h = i / 128, j = i % 128 / 32, l = i % 32, s = i / 16;
    const int q = (qs[32 * h + l] >> (2 * j)) & 3;
    const float dl = d * static_cast<float>(scales[s] & 0xF), ml = dmin * static_cast<float>(scales[s] >> 4);
    out[i] = dl * static_cast<float>(q) - ml;
  }
}

inline void q3_k(const uint8_t* b, float* out) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* scales = b + 96;
  const float d = fp16_to_fp32(b + 108);
  for (int64_t i = 0; i < kSuper; ++i) {
    const int64_t h = i / 128, j = i % 128 / 32, l = i % 32, s = i / 16;
    const int low = (scales[s % 8] >> (4 * (s / 8))) & 0xF, high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
    const int q = ((qs[32 * h + l] >> (2 * j)) & 3) - (((hmask[l] >> (4 * h + j)) & 1) ? 0 : 4);
    out[i] = (d * static_cast<float>((low | (high << 4)) - 32)) * static_cast<float>(q);
  }
}

// Q4_K (five_bits false) and Q5_K: in each chunk of 64 weights, byte l of the chunk's 32 qs bytes holds weight l
// (low nibble) and weight 32 + l (high); Q5_K's fifth bit of weight 32c + 32half + l is bit 2c + half of qh[l].
inline void q45_k(const uint8_t* b, bool five_bits, float* out) {
  const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = five_bits ? b + 48 : b + 16;
  for (int64_t s = 0; s < 8; ++s) {
    int sc, m;
    scale_min_k4(scales, s, &sc, &m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const int64_t c = s / 2, half = s % 2;
    for (int64_t l = 0; l < 32; ++l) {
      int q = (qs[32 * c + l] >> (4 * half)) & 0xF;
      if (five_bits) q |= ((qh[l] >> s) & 1) << 4;
      out[32 * s + l] = dl * static_cast<float>(q) - ml;
    }
  }
}

inline void q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16_to_fp32(b + 208);
  for (int64_t i = 0; i < kSuper; ++i) {
    const int64_t h = i / 128, t = i % 128 / 32, l = i % 32, s = i / 16;
    const int low = (ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 0xF, high = (qh[32 * h + l] >> (2 * t)) & 3;
    out[i] = (d * static_cast<float>(scales[s])) * static_cast<float>((low | (high << 4)) - 32);
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
      case kQ4_K: q45_k(b, false, o); break;
      case kQ5_K: q45_k(b, true, o); break;
      default: q6_k(b, o); break;
    }
  }
}

}  // namespace kquant
}  // namespace gguf_kernels

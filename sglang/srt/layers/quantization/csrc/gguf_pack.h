// GGUF blocks as stored in a file (Q4_0, Q4_1, Q8_0 rows) written straight into the packed row groups the kernels
// read (gguf_layout.h), one output row group at a time: no converted or concatenated copy of the raw blocks and no
// re-layout temporaries. Bit for bit what layers/quantization/gguf_blocks.pack_raw makes of the same rows, after
// model_loader/gguf_reader.q4_0_as_q4_1 for Q4_0 (d kept, m = fp16(-8 d)).
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_layout.h"

namespace gguf_kernels {
namespace pack {

// Stored block types by their GGML type ids, and their bytes per 32 weights.
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

inline int64_t stored_block_bytes(int type) {
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0;
}

// float32 -> fp16 bits, rounded to nearest even; overflow to infinity; a NaN keeps its top mantissa bits (as numpy's
// float16 conversion does, so the packed blocks equal those made by gguf_reader.q4_0_as_q4_1).
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {  // infinity or NaN
    if (x == 0x7F800000u) return sign | 0x7C00u;
    const uint16_t payload = static_cast<uint16_t>((x & 0x007FFFFFu) >> 13);
    return sign | 0x7C00u | (payload ? payload : 1u);
  }
  if (x >= 0x47800000u) return sign | 0x7C00u;  // >= 2^16: beyond the largest fp16 after rounding
  if (x < 0x38800000u) {  // below 2^-14: an fp16 subnormal; adding 0.5 rounds to its 2^-24 steps in the FPU
    float v, half = 0.5f;
    std::memcpy(&v, &x, 4);
    v += half;
    uint32_t r;
    std::memcpy(&r, &v, 4);
    return sign | static_cast<uint16_t>(r - 0x3F000000u);
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
  return sign | static_cast<uint16_t>(x >> 13);
}

inline void put_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xFF);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// Row `row` (0-15 of its group) of one packed Q4_1 block dst, from a stored Q4_0 or Q4_1 block src (nullptr: a
// padding row, all zero).
inline void q4_row(const uint8_t* src, int type, int64_t row, uint8_t* dst) {
  const int64_t h = row / kHalf, r = row % kHalf;
  uint8_t* d = dst + Q41Layout::d(h) + 2 * r;
  uint8_t* m = dst + Q41Layout::m(h) + 2 * r;
  if (src == nullptr) {
    std::memset(d, 0, 2);
    std::memset(m, 0, 2);
    for (int64_t j = 0; j < 4; ++j) std::memset(dst + Q41Layout::vec(j, h) + 4 * r, 0, 4);
    return;
  }
  std::memcpy(d, src, 2);
  const uint8_t* qs;
  if (type == kQ4_0) {  // w = d (q - 8) = d q + (-8 d): -8 d is exact in float32, rounded once to fp16
    const uint16_t bits = static_cast<uint16_t>(src[0] | (src[1] << 8));
    const uint16_t exponent = (bits >> 10) & 0x1F;
    // A normal d whose -8 d stays normal: the sign flips and the exponent grows by 3, exactly.
    put_u16(m, exponent >= 1 && exponent <= 27 ? static_cast<uint16_t>((bits ^ 0x8000u) + (3u << 10))
                                               : fp32_to_fp16(-8.0f * fp16_to_fp32(src)));
    qs = src + 2;
  } else {
    std::memcpy(m, src + 2, 2);
    qs = src + 4;
  }
  // Input i is the low nibble of qs[i] (i < 16) or the high nibble of qs[i - 16]; lane byte t of inputs 8j..8j+7
  // holds inputs 8j + 2t (low nibble) and 8j + 2t + 1 (high nibble). Per 8 bytes of qs (little-endian word x):
  // the nibbles of bytes 2t and 2t + 1 meet in 16-bit field t, then the four fields close up into 4 bytes.
  for (int64_t half = 0; half < 2; ++half) {
    uint64_t x;
    std::memcpy(&x, qs + 8 * half, 8);
    const uint64_t even = x & 0x00FF00FF00FF00FFull, odd = (x >> 8) & 0x00FF00FF00FF00FFull;
    const uint64_t lo = (even & 0x000F000F000F000Full) | ((odd & 0x000F000F000F000Full) << 4);
    const uint64_t hi = ((even >> 4) & 0x000F000F000F000Full) | (odd & 0x00F000F000F000F0ull);
    for (int64_t which = 0; which < 2; ++which) {  // low nibbles: inputs 8 half + ..., high: 16 + 8 half + ...
      uint64_t w = which ? hi : lo;
      w = (w | (w >> 8)) & 0x0000FFFF0000FFFFull;
      w = (w | (w >> 16)) & 0x00000000FFFFFFFFull;
      const uint32_t lane = static_cast<uint32_t>(w);
      std::memcpy(dst + Q41Layout::vec(2 * which + half, h) + 4 * r, &lane, 4);
    }
  }
}

// Row `row` of one packed Q8_0 block dst from a stored Q8_0 block src (nullptr: a padding row).
inline void q8_row(const uint8_t* src, int64_t row, uint8_t* dst) {
  const int64_t h = row / kHalf, r = row % kHalf;
  uint8_t* d = dst + Q80Layout::d(h) + 2 * r;
  if (src == nullptr) {
    std::memset(d, 0, 2);
    for (int64_t j = 0; j < 8; ++j) std::memset(dst + Q80Layout::vec(j, h) + 4 * r, 0, 4);
    return;
  }
  std::memcpy(d, src, 2);
  for (int64_t j = 0; j < 8; ++j) std::memcpy(dst + Q80Layout::vec(j, h) + 4 * r, src + 2 + 4 * j, 4);
}

// One stored matrix stacked into the packed weight: its rows' blocks, its type and its number of rows.
struct Part {
  const uint8_t* data;
  int64_t row_stride;  // bytes
  int type;
  int64_t rows;
};

// Row groups [g0, g1) of the packed weight (K / 32 blocks per row) from the parts stacked along N (rows beyond the
// last part are padding). q4: Q4_1 row groups (parts Q4_0 / Q4_1), else Q8_0 (parts Q8_0).
inline void groups(const Part* parts, int64_t nparts, bool q4, int64_t K, int64_t g0, int64_t g1, uint8_t* out) {
  const int64_t nb = K / kQK;
  const int64_t bb = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  for (int64_t g = g0; g < g1; ++g) {
    uint8_t* gp = out + g * nb * bb;
    for (int64_t row = 0; row < kRows; ++row) {
      int64_t local = g * kRows + row, p = 0;
      while (p < nparts && local >= parts[p].rows) local -= parts[p++].rows;
      const Part* part = p < nparts ? &parts[p] : nullptr;
      const uint8_t* src = part ? part->data + local * part->row_stride : nullptr;
      const int64_t sb = part ? stored_block_bytes(part->type) : 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = src ? src + b * sb : nullptr;
        if (q4) {
          q4_row(block, part ? part->type : kQ4_1, row, gp + b * bb);
        } else {
          q8_row(block, row, gp + b * bb);
        }
      }
    }
  }
}

}  // namespace pack
}  // namespace gguf_kernels

// Int8-activation variants of the GGUF Q4_1 / Q8_0 kernels, over the same packed layout as gguf_kernels.h (included
// from there). The fast path needs AVX512-VNNI; it is compiled into the same build with function-level target
// attributes and chosen at run time, so one binary still runs on any CPU, where a portable loop computes the same
// integer sums (slowly: on CPUs without VNNI the float32 kernels are the fast choice).
//
// Each 32-value block of a row of x is written as two int8 terms, x ~ dx1 * q1 + dx2 * q2: q1 = round(x / dx1)
// with dx1 = max|x| / 127 (llama.cpp's Q8 activations), and q2 = round((x - dx1 * q1) / dx2) with dx2 = dx1 / 256
// (saturated to int8: the remainder is at most dx1 / 2, 128 steps of dx2, so only a remainder within a rounding of
// dx1 / 2 saturates, and then by one step). With dx2 a power-of-two fraction of dx1 the two terms' integer sums
// combine into one exactly, 256 * sum1 + sum2, so a block costs one conversion and one scale per row of x, not two.
// One int8 term alone leaves ~1% relative error in a layer's output on SmolLM2 (blocks that
// hold one of its large activations quantize the rest coarsely), enough to move greedy tokens; with the second
// term the error is ~3e-5, below that of a bf16 GEMM (~4e-3). The dot products of both terms with the 16 rows of a
// row group are formed by VPDPBUSD, which multiplies 4 unsigned by 4 signed bytes and adds them into a 32-bit lane:
// one instruction does 64 multiply-adds, where the float32 kernels do 8 per FMA and need an integer-to-float
// conversion per weight vector. One 512-bit register holds a whole row group (both halves of 8 rows are adjacent in
// the packed stream).
//   Q4_1: the nibbles are the unsigned operand: lane bytes & 0x0F hold q[8j + 2t], (lane >> 4) & 0x0F hold
//         q[8j + 2t + 1], so each term of x is packed into matching "low" and "high" words. A block is
//         d * dx2 * (256 * sum(q * q1) + sum(q * q2)) + m * (dx1 * sum(q1) + dx2 * sum(q2)): every sum over the
//         same rounded x, so the result is the exact dot product of the dequantized weights with that x (with sum(x)
//         from the float x instead, the rounding error of x would meet d * q, whose mean is far from zero). The
//         combined sum stays below 2^24, so its conversion to float32 is exact.
//   Q8_0: the weights are signed, so each term is shifted to unsigned (q + 128) and 128 * sum(weights) is
//         subtracted, with that sum formed by one more VPDPBUSD against a vector of ones (shared by every row of x).
// Integer sums are exact (|sum| < 2^28); the only error against the float kernels is the rounding of x.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "../../csrc/vpdpbusd.h"
#include "gguf_layout.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GGUF_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace gguf_kernels {

namespace int8 {

// Whether the AVX512 code of this file can run on this CPU: AVX512 F/BW/VL and FMA (the block quantizer), plus
// VNNI for the kernels. SGLANG_GGUF_INT8_PORTABLE=1 forces the portable loops (to test them on such a machine).
inline bool avx512_supported() {
#ifdef GGUF_INT8_VNNI
  static const bool ok = std::getenv("SGLANG_GGUF_INT8_PORTABLE") == nullptr && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// Whether the AVX512-VNNI kernels can run on this CPU.
inline bool vnni_supported() {
#ifdef GGUF_INT8_VNNI
  static const bool ok = avx512_supported() && vnni::cpu_avx512_vnni();
  return ok;
#else
  return false;
#endif
}

constexpr int64_t kTermWords = 8;                    // 32 int8 values of one term, as 8 words of 4 bytes
constexpr int64_t kWordsPerBlock = 2 * kTermWords;  // both terms
constexpr int64_t kTile = 8;                        // rows of x per pass over a row group

// Scratch floats quantize_rows needs for M rows of K inputs (words, then scales, then sums).
inline int64_t scratch_floats(int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  return M * nb * kWordsPerBlock + 3 * M * nb;
}

// x as the int8 kernels read it. Per tile of up to kTile rows starting at row m0 (mt rows), for block b, term s
// (0 or 1), word w and row m of the tile:
//   words[m0 * nb * 16 + (b * 16 + s * 8 + w) * mt + m], dx[m0 * nb * 2 + (b * 2 + s) * mt + m],
//   sx[m0 * nb + b * mt + m] (the block's sum of the rounded x, for the Q4_1 minimum).
struct QuantizedInput {
  const int32_t* words;
  const float* dx;
  const float* sx;
};

// Rounds 32 values to int8 with scale max|v| / 127; returns the scale (0 for an all-zero block).
inline float round_block(const float* v, int8_t* q) {
  float amax = 0.0f;
  for (int64_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[k]));
  const float d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int64_t k = 0; k < 32; ++k) q[k] = static_cast<int8_t>(std::nearbyint(v[k] * id));
  return d;
}

// One 32-value block as the kernels read it: the two terms' words (QuantizedInput), their scales and the block's
// sum of the rounded x. For Q4_1 (q4) word 2j of a term holds q[8j + 2t] in byte t and word 2j + 1 holds
// q[8j + 2t + 1]; for Q8_0 word j holds q[4j + t] + 128.
struct QuantizedBlock {
  int32_t words[2][kTermWords];
  float d[2];
  int32_t qsum[2];  // each term's sum of its int8 values

  // The block's sum of the rounded x, computed one way for both quantizers (no contraction left to the compiler).
  float sum() const { return std::fma(d[0], static_cast<float>(qsum[0]), d[1] * static_cast<float>(qsum[1])); }
};

// The scale of the second term: dx1 / 256, so the terms' integer sums combine exactly (256 * sum1 + sum2, a shift).
constexpr int kSecondTermShift = 8;
constexpr float kSecondTermSteps = 1 << kSecondTermShift;

inline void quantize_block_portable(bool q4, const float* v, QuantizedBlock& out) {
  int8_t q[2][32];
  float rest[32];
  out.d[0] = round_block(v, q[0]);
  // The remainder rounded once (fma), as the vector path computes it, then in steps of dx1 / 256, saturated.
  for (int64_t k = 0; k < 32; ++k) rest[k] = std::fma(-out.d[0], static_cast<float>(q[0][k]), v[k]);
  const float id2 = (out.d[0] > 0.0f ? 1.0f / out.d[0] : 0.0f) * kSecondTermSteps;
  for (int64_t k = 0; k < 32; ++k)
    q[1][k] = static_cast<int8_t>(std::clamp(std::nearbyint(rest[k] * id2), -128.0f, 127.0f));
  out.d[1] = out.d[0] / kSecondTermSteps;
  out.qsum[0] = out.qsum[1] = 0;
  for (int64_t k = 0; k < 32; ++k) {
    out.qsum[0] += q[0][k];
    out.qsum[1] += q[1][k];
  }
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t w = 0; w < kTermWords; ++w) {
      uint32_t word = 0;
      for (int64_t t = 0; t < 4; ++t) {
        const uint8_t byte = q4 ? static_cast<uint8_t>(q[s][8 * (w / 2) + 2 * t + (w % 2)])
                                : static_cast<uint8_t>(q[s][4 * w + t] + 128);
        word |= static_cast<uint32_t>(byte) << (8 * t);
      }
      out.words[s][w] = static_cast<int32_t>(word);
    }
  }
}

#ifdef GGUF_INT8_VNNI
// The same block with AVX512 (bit for bit: the same products, the same round-to-nearest-even conversion, the
// remainder as one fma). About ten times faster than the scalar loop, which a decode step runs for every input
// block of every matmul (each thread builds the input it multiplies).
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) inline void quantize_block_avx512(bool q4, const float* v,
                                                                                          QuantizedBlock& out) {
  // Q4_1: within each 8-byte group, the even bytes then the odd ones (the words of the low and high nibbles).
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,  //
                                         0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float d1 = amax / 127.0f, id1 = d1 > 0.0f ? 1.0f / d1 : 0.0f;
  for (int s = 0; s < 2; ++s) {  // the second term: the remainder in steps of d1 / 256, saturated
    const float d = s == 0 ? d1 : d1 / kSecondTermSteps;
    const __m512 id = _mm512_set1_ps(s == 0 ? id1 : id1 * kSecondTermSteps);
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    const __m512i i0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), lo), hi);
    const __m512i i1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, id)), lo), hi);
    __m256i bytes = _mm256_set_m128i(_mm512_cvtsepi32_epi8(i1), _mm512_cvtsepi32_epi8(i0));
    bytes = q4 ? _mm256_shuffle_epi8(bytes, order) : _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.words[s]), bytes);
    out.d[s] = d;
    out.qsum[s] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    const __m512 nd = _mm512_set1_ps(-d);
    x0 = _mm512_fmadd_ps(nd, _mm512_cvtepi32_ps(i0), x0);
    x1 = _mm512_fmadd_ps(nd, _mm512_cvtepi32_ps(i1), x1);
  }
}
#endif

// Where the quantized rows of x[M, K] live in `scratch` (scratch_floats(M, K)): words, then scales, then sums.
struct QuantizedParts {
  int32_t* words;
  float* dx;
  float* sx;
};

inline QuantizedParts quantized_parts(int64_t M, int64_t K, float* scratch) {
  const int64_t nb = K / 32;
  float* dx = scratch + M * nb * kWordsPerBlock;
  return {reinterpret_cast<int32_t*>(scratch), dx, dx + 2 * M * nb};
}

inline QuantizedInput quantized_view(int64_t M, int64_t K, float* scratch) {
  const QuantizedParts parts = quantized_parts(M, K, scratch);
  return {parts.words, parts.dx, parts.sx};
}

// Quantizes the rows [m0, m0 + mt) of x[M, K] (one tile: m0 a multiple of kTile, mt = min(kTile, M - m0)) into
// their place in `scratch` (quantized_view). Tiles write disjoint parts, so threads can build one each. `vector`
// picks the AVX512 block quantizer (only where avx512_supported()), which gives the same bits as the portable one.
inline void quantize_tile(bool q4, const float* x, int64_t M, int64_t K, int64_t m0, float* scratch,
                          bool vector = avx512_supported()) {
  const int64_t nb = K / 32;
  const int64_t mt = std::min(kTile, M - m0);
  const QuantizedParts parts = quantized_parts(M, K, scratch);
  int32_t* tw = parts.words + m0 * nb * kWordsPerBlock;
  float* tdx = parts.dx + 2 * m0 * nb;
  float* tsx = parts.sx + m0 * nb;
  for (int64_t m = 0; m < mt; ++m) {
    const float* row = x + (m0 + m) * K;
    for (int64_t b = 0; b < nb; ++b) {
      QuantizedBlock qb;
#ifdef GGUF_INT8_VNNI
      if (vector) {
        quantize_block_avx512(q4, row + b * 32, qb);
      } else {
        quantize_block_portable(q4, row + b * 32, qb);
      }
#else
      (void)vector;
      quantize_block_portable(q4, row + b * 32, qb);
#endif
      tdx[(b * 2) * mt + m] = qb.d[0];
      tdx[(b * 2 + 1) * mt + m] = qb.d[1];
      tsx[b * mt + m] = qb.sum();
      for (int64_t s = 0; s < 2; ++s)
        for (int64_t w = 0; w < kTermWords; ++w) tw[(b * kWordsPerBlock + s * kTermWords + w) * mt + m] = qb.words[s][w];
    }
  }
}

// Quantizes rows x[M, K] (see QuantizedInput) into `scratch` (scratch_floats), tile by tile.
inline QuantizedInput quantize_rows(bool q4, const float* x, int64_t M, int64_t K, float* scratch,
                                    bool vector = avx512_supported()) {
  for (int64_t m0 = 0; m0 < M; m0 += kTile) quantize_tile(q4, x, M, K, m0, scratch, vector);
  return quantized_view(M, K, scratch);
}

// ---- portable path: the same integer sums, one row at a time ----

// One row group against mt rows of quantized x (words of one tile), any CPU.
inline void group_portable(bool q4, const uint8_t* gp, int64_t nb, int64_t mt, const int32_t* words,
                           const float* dx, const float* sx, float* y, int64_t ldy, int64_t nvalid) {
  const int64_t block_bytes = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  for (int64_t m = 0; m < mt; ++m) {
    float acc[16] = {0.0f};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bp = gp + b * block_bytes;
      for (int64_t row = 0; row < nvalid; ++row) {
        const int64_t h = row / 8, r = row % 8;
        int32_t dot[2] = {0, 0};
        for (int64_t s = 0; s < 2; ++s) {
          const int32_t* wb = words + (b * kWordsPerBlock + s * kTermWords) * mt;
          for (int64_t w = 0; w < kTermWords; ++w) {
            const uint32_t xw = static_cast<uint32_t>(wb[w * mt + m]);
            // Q4_1: word 2j (low nibbles) / 2j + 1 (high nibbles) against vector j; Q8_0: word j against vector j.
            const uint8_t* lane = bp + (q4 ? Q41Layout::vec(w / 2, h) : Q80Layout::vec(w, h)) + 4 * r;
            for (int64_t t = 0; t < 4; ++t) {
              const int32_t xb = static_cast<int32_t>((xw >> (8 * t)) & 0xFFu);
              if (q4) {
                const int32_t q = (w % 2 == 0) ? (lane[t] & 0x0F) : (lane[t] >> 4);
                dot[s] += q * static_cast<int32_t>(static_cast<int8_t>(xb));
              } else {
                dot[s] += static_cast<int32_t>(static_cast<int8_t>(lane[t])) * (xb - 128);
              }
            }
          }
        }
        const float d = fp16_to_fp32(bp + (q4 ? Q41Layout::d(h) : Q80Layout::d(h)) + 2 * r);
        const float* bdx = dx + b * 2 * mt;
        const int32_t dot_both = dot[0] * (1 << kSecondTermShift) + dot[1];  // dx2 = dx1 / 256
        acc[row] = std::fma(static_cast<float>(dot_both), d * bdx[mt + m], acc[row]);
        if (q4) acc[row] += fp16_to_fp32(bp + Q41Layout::m(h) + 2 * r) * sx[b * mt + m];
      }
    }
    for (int64_t row = 0; row < nvalid; ++row) y[m * ldy + row] = acc[row];
  }
}

#ifdef GGUF_INT8_VNNI

#define GGUF_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

GGUF_VNNI_TARGET inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

GGUF_VNNI_TARGET inline void store_rows16(const __m512* acc, int mt, float* y, int64_t ldy, int64_t nvalid) {
  const __mmask16 mask = nvalid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nvalid) - 1);
  for (int m = 0; m < mt; ++m) _mm512_mask_storeu_ps(y + m * ldy, mask, acc[m]);
}

GGUF_VNNI_TARGET inline __m512i bcast_word(const int32_t* p) {
  return _mm512_set1_epi32(*p);
}

using vnni::dpbusd;  // in place, accumulators kept in registers (layers/csrc/vpdpbusd.h)
using vnni::dpbusd_word;

// acc[m] += (256 * i1[m] + i2[m]) * dx2[m] * d for the block's two terms (bdx: the block's scales; dx2 = dx1 / 256).
template <int MT>
GGUF_VNNI_TARGET inline void add_terms(__m512* acc, const __m512i* i1, const __m512i* i2, __m512 d,
                                       const float* bdx) {
  for (int m = 0; m < MT; ++m) {
    const __m512i i = _mm512_add_epi32(_mm512_slli_epi32(i1[m], kSecondTermShift), i2[m]);
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(d, _mm512_set1_ps(bdx[MT + m])), acc[m]);
  }
}

// One Q4_1 row group (Q41Layout, 320 bytes per block) against MT rows of quantized x.
template <int MT>
GGUF_VNNI_TARGET void q4_1_group(const uint8_t* gp, int64_t nb, const int32_t* words, const float* dx,
                                 const float* sx, float* y, int64_t ldy, int64_t nvalid) {
  using L = Q41Layout;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    prefetch_ahead<L::kBlockBytes>(bp);
    const int32_t* w1 = words + b * kWordsPerBlock * MT;
    const int32_t* w2 = w1 + kTermWords * MT;
    __m512i i1[MT], i2[MT];
    for (int m = 0; m < MT; ++m) i1[m] = i2[m] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(bp + L::vec(j, 0));  // both halves: 16 rows
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
      for (int m = 0; m < MT; ++m) {
        dpbusd_word(i1[m], lo, w1 + (2 * j) * MT + m);
        dpbusd_word(i2[m], lo, w2 + (2 * j) * MT + m);
        dpbusd_word(i1[m], hi, w1 + (2 * j + 1) * MT + m);
        dpbusd_word(i2[m], hi, w2 + (2 * j + 1) * MT + m);
      }
    }
    add_terms<MT>(acc, i1, i2, load_half16(bp + L::d(0)), dx + b * 2 * MT);
    const __m512 mn = load_half16(bp + L::m(0));
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[b * MT + m]), acc[m]);
  }
  store_rows16(acc, MT, y, ldy, nvalid);
}

// One Q8_0 row group (Q80Layout, 544 bytes per block) against MT rows of quantized x (shifted to unsigned).
template <int MT>
GGUF_VNNI_TARGET void q8_0_group(const uint8_t* gp, int64_t nb, const int32_t* words, const float* dx,
                                 const float* /*unused*/, float* y, int64_t ldy, int64_t nvalid) {
  using L = Q80Layout;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * L::kBlockBytes;
    prefetch_ahead<L::kBlockBytes>(bp);
    const int32_t* w1 = words + b * kWordsPerBlock * MT;
    const int32_t* w2 = w1 + kTermWords * MT;
    __m512i qsum = _mm512_setzero_si512();
    __m512i i1[MT], i2[MT];
    for (int m = 0; m < MT; ++m) i1[m] = i2[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_loadu_si512(bp + L::vec(j, 0));  // both halves: 16 rows
      dpbusd(qsum, ones, v);
      for (int m = 0; m < MT; ++m) {
        dpbusd(i1[m], bcast_word(w1 + j * MT + m), v);
        dpbusd(i2[m], bcast_word(w2 + j * MT + m), v);
      }
    }
    const __m512i shift = _mm512_slli_epi32(qsum, 7);  // each term was shifted by +128
    for (int m = 0; m < MT; ++m) {
      i1[m] = _mm512_sub_epi32(i1[m], shift);
      i2[m] = _mm512_sub_epi32(i2[m], shift);
    }
    add_terms<MT>(acc, i1, i2, load_half16(bp + L::d(0)), dx + b * 2 * MT);
  }
  store_rows16(acc, MT, y, ldy, nvalid);
}

using GroupFn = void (*)(const uint8_t*, int64_t, const int32_t*, const float*, const float*, float*, int64_t,
                         int64_t);
constexpr GroupFn kQ41[kTile + 1] = {nullptr,       q4_1_group<1>, q4_1_group<2>, q4_1_group<3>, q4_1_group<4>,
                                     q4_1_group<5>, q4_1_group<6>, q4_1_group<7>, q4_1_group<8>};
constexpr GroupFn kQ80[kTile + 1] = {nullptr,       q8_0_group<1>, q8_0_group<2>, q8_0_group<3>, q8_0_group<4>,
                                     q8_0_group<5>, q8_0_group<6>, q8_0_group<7>, q8_0_group<8>};

#undef GGUF_VNNI_TARGET
#endif  // GGUF_INT8_VNNI

// One row group (16 rows, nvalid of them real) against all M rows of quantized x.
inline void group(bool q4, const uint8_t* gp, int64_t nb, int64_t M, QuantizedInput in, float* y, int64_t ldy,
                  int64_t nvalid) {
  for (int64_t m0 = 0; m0 < M; m0 += kTile) {
    const int64_t mt = std::min(kTile, M - m0);
    const int32_t* words = in.words + m0 * nb * kWordsPerBlock;
    const float* dx = in.dx + 2 * m0 * nb;
    const float* sx = in.sx + m0 * nb;
#ifdef GGUF_INT8_VNNI
    if (vnni_supported()) {
      (q4 ? kQ41 : kQ80)[mt](gp, nb, words, dx, sx, y + m0 * ldy, ldy, nvalid);
      continue;
    }
#endif
    group_portable(q4, gp, nb, mt, words, dx, sx, y + m0 * ldy, ldy, nvalid);
  }
}

}  // namespace int8
}  // namespace gguf_kernels

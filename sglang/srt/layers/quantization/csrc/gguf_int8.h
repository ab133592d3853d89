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
// In the one-term form (gguf_int8_input.h) the second term's dot products are skipped and each tile's outlier
// columns are added in float32 after the blocks (add_outliers), from the weights the row group holds there.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gguf_int8_input.h"

namespace gguf_kernels {

namespace int8 {

// ---- portable path: the same integer sums, one row at a time ----

// acc[row] += row m's values of the tile's outlier columns (the record at `rec`) times the row group's weights in
// those columns, in column order (block_weight, the values the vector path reads).
inline void add_outliers_portable(bool q4, const uint8_t* gp, const float* rec, int64_t mt, int64_t m, float* acc,
                                  int64_t nvalid) {
  const int64_t block_bytes = q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  const OutlierColumns out(rec);
  for (int64_t j = 0; j < out.count; ++j) {
    const int64_t c = out.cols[j];
    const uint8_t* bp = gp + c / kQK * block_bytes;
    const float xv = out.values[j * mt + m];
    for (int64_t row = 0; row < nvalid; ++row) {
      float d, mn;
      block_scales(q4, bp, row, &d, &mn);
      acc[row] = std::fma(xv, block_weight(q4, d, mn, block_quant(q4, bp, row, c % kQK)), acc[row]);
    }
  }
}

// One row group against mt rows of quantized x (words of one tile; `rec`: its outlier record in the one-term form,
// else null), any CPU.
inline void group_portable(bool q4, const uint8_t* gp, int64_t nb, int64_t mt, const int32_t* words,
                           const float* dx, const float* sx, const float* rec, float* y, int64_t ldy,
                           int64_t nvalid) {
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
    if (rec != nullptr) add_outliers_portable(q4, gp, rec, mt, m, acc, nvalid);
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

// acc[m] += the MT rows' values of the tile's outlier columns (the record at `rec`) times the row group's weights in
// those columns: each column's 16 weights read from the block's line (column_weights).
template <int MT, bool Q4>
GGUF_VNNI_TARGET inline void add_outliers(const uint8_t* gp, const float* rec, __m512* acc) {
  const int64_t block_bytes = Q4 ? Q41Layout::kBlockBytes : Q80Layout::kBlockBytes;
  const OutlierColumns out(rec);
  for (int64_t j = 0; j < out.count; ++j) {
    const int64_t c = out.cols[j];
    const __m512 w = column_weights<Q4>(gp + c / kQK * block_bytes, c % kQK);
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(out.values[j * MT + m]), w, acc[m]);
  }
}

// One Q4_1 row group (Q41Layout, 320 bytes per block) against MT rows of quantized x; TWO: both terms, otherwise the
// one-term form with the tile's outlier record at `rec`.
template <int MT, bool TWO>
GGUF_VNNI_TARGET void q4_1_group(const uint8_t* gp, int64_t nb, const int32_t* words, const float* dx,
                                 const float* sx, const float* rec, float* y, int64_t ldy, int64_t nvalid) {
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
        if constexpr (TWO) dpbusd_word(i2[m], lo, w2 + (2 * j) * MT + m);
        dpbusd_word(i1[m], hi, w1 + (2 * j + 1) * MT + m);
        if constexpr (TWO) dpbusd_word(i2[m], hi, w2 + (2 * j + 1) * MT + m);
      }
    }
    add_terms<MT>(acc, i1, i2, load_half16(bp + L::d(0)), dx + b * 2 * MT);
    const __m512 mn = load_half16(bp + L::m(0));
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[b * MT + m]), acc[m]);
  }
  if constexpr (!TWO) add_outliers<MT, true>(gp, rec, acc);
  store_rows16(acc, MT, y, ldy, nvalid);
}

// One Q8_0 row group (Q80Layout, 544 bytes per block) against MT rows of quantized x (shifted to unsigned); TWO as
// for q4_1_group.
template <int MT, bool TWO>
GGUF_VNNI_TARGET void q8_0_group(const uint8_t* gp, int64_t nb, const int32_t* words, const float* dx,
                                 const float* /*unused*/, const float* rec, float* y, int64_t ldy, int64_t nvalid) {
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
        if constexpr (TWO) dpbusd(i2[m], bcast_word(w2 + j * MT + m), v);
      }
    }
    const __m512i shift = _mm512_slli_epi32(qsum, 7);  // each term was shifted by +128
    for (int m = 0; m < MT; ++m) {
      i1[m] = _mm512_sub_epi32(i1[m], shift);
      if constexpr (TWO) i2[m] = _mm512_sub_epi32(i2[m], shift);  // one term: the zero second term's sum is 0
    }
    add_terms<MT>(acc, i1, i2, load_half16(bp + L::d(0)), dx + b * 2 * MT);
  }
  if constexpr (!TWO) add_outliers<MT, false>(gp, rec, acc);
  store_rows16(acc, MT, y, ldy, nvalid);
}

using GroupFn = void (*)(const uint8_t*, int64_t, const int32_t*, const float*, const float*, const float*, float*,
                         int64_t, int64_t);
// [one term][rows of the tile]
constexpr GroupFn kQ41[2][kTile + 1] = {
    {nullptr, q4_1_group<1, true>, q4_1_group<2, true>, q4_1_group<3, true>, q4_1_group<4, true>,
     q4_1_group<5, true>, q4_1_group<6, true>, q4_1_group<7, true>, q4_1_group<8, true>},
    {nullptr, q4_1_group<1, false>, q4_1_group<2, false>, q4_1_group<3, false>, q4_1_group<4, false>,
     q4_1_group<5, false>, q4_1_group<6, false>, q4_1_group<7, false>, q4_1_group<8, false>}};
constexpr GroupFn kQ80[2][kTile + 1] = {
    {nullptr, q8_0_group<1, true>, q8_0_group<2, true>, q8_0_group<3, true>, q8_0_group<4, true>,
     q8_0_group<5, true>, q8_0_group<6, true>, q8_0_group<7, true>, q8_0_group<8, true>},
    {nullptr, q8_0_group<1, false>, q8_0_group<2, false>, q8_0_group<3, false>, q8_0_group<4, false>,
     q8_0_group<5, false>, q8_0_group<6, false>, q8_0_group<7, false>, q8_0_group<8, false>}};

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
    const float* rec = tile_outliers(in, m0);
#ifdef GGUF_INT8_VNNI
    if (vnni_supported()) {
      (q4 ? kQ41 : kQ80)[rec != nullptr][mt](gp, nb, words, dx, sx, rec, y + m0 * ldy, ldy, nvalid);
      continue;
    }
#endif
    group_portable(q4, gp, nb, mt, words, dx, sx, rec, y + m0 * ldy, ldy, nvalid);
  }
}

}  // namespace int8
}  // namespace gguf_kernels

// The input side of the GGUF int8 kernels (gguf_int8.h): x quantized per 32-value block into int8 terms, laid out as
// the kernels read it, and the CPU checks of both files.
//
// Two forms. Two terms per block (x ~ dx1 * q1 + dx2 * q2, see gguf_int8.h) keep a matmul within ~3e-5 of float32.
// The one-term form halves the integer work of a step that is bound by it (decode batches of several rows): per tile
// of up to kTile rows the outlier_columns(K) input columns of largest max |x| over the tile are taken out of the
// blocks and multiplied in float32 against the same columns of the weight blocks (the kernels read them while they
// stream the row group), and every other value is one int8 term, with the block's scale set by its remaining values.
// A decoder's large activations sit in a few channels and would otherwise set their blocks' scales (one term
// everywhere changed 15 of 510 teacher-forced greedy choices of SmolLM2-135M); with 64 columns per tile of 8 rows
// taken out, 2 (float32 margins 0.002 and 0.011), as many as bf16 GEMMs move (benchmarks/int8_block_terms_accuracy.py;
// benchmarks/RESULTS.md, "One activation term").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

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

// The one-term form: per tile, the input columns of largest max |x| over the tile's rows kept out of the blocks
// (at most kMaxOutliers, and 1/8 of K: as the int8 GEMM's outlier columns, layers/int8_linear.py), and their record:
// the count, the columns in ascending order, then their values (column j's at j * mt + m for row m of the tile).
constexpr int64_t kMaxOutliers = 64;
constexpr int64_t kOutlierRecord = 1 + kMaxOutliers + kMaxOutliers * kTile;  // floats (the first 1 + 64 int32)

inline int64_t outlier_columns(int64_t K) {
  return std::min<int64_t>(kMaxOutliers, K / 8);
}

// Scratch floats quantize_rows needs for M rows of K inputs (words, then scales, then sums, then the tiles'
// outlier records).
inline int64_t scratch_floats(int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  return M * nb * kWordsPerBlock + 3 * M * nb + (M + kTile - 1) / kTile * kOutlierRecord;
}

// x as the int8 kernels read it. Per tile of up to kTile rows starting at row m0 (mt rows), for block b, term s
// (0 or 1), word w and row m of the tile:
//   words[m0 * nb * 16 + (b * 16 + s * 8 + w) * mt + m], dx[m0 * nb * 2 + (b * 2 + s) * mt + m],
//   sx[m0 * nb + b * mt + m] (the block's sum of the rounded x, for the Q4_1 minimum).
// In the one-term form (`outliers` set) the second term is zero (its words encode 0) and the tile starting at row m0
// has its outlier columns' record at outliers + m0 / kTile * kOutlierRecord.
struct QuantizedInput {
  const int32_t* words;
  const float* dx;
  const float* sx;
  const float* outliers = nullptr;
};

// A tile's outlier record, or null.
inline const float* tile_outliers(const QuantizedInput& in, int64_t m0) {
  return in.outliers == nullptr ? nullptr : in.outliers + m0 / kTile * kOutlierRecord;
}

// An outlier record read: column j is cols[j], its value in row m of the tile (mt rows) values[j * mt + m].
struct OutlierColumns {
  int64_t count;
  const int32_t* cols;
  const float* values;

  explicit OutlierColumns(const float* rec)
      : count(reinterpret_cast<const int32_t*>(rec)[0]),
        cols(reinterpret_cast<const int32_t*>(rec) + 1),
        values(rec + 1 + kMaxOutliers) {}
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

// `two`: both terms; otherwise the second is zero.
inline void quantize_block_portable(bool q4, const float* v, QuantizedBlock& out, bool two = true) {
  int8_t q[2][32];
  float rest[32];
  out.d[0] = round_block(v, q[0]);
  // The remainder rounded once (fma), as the vector path computes it, then in steps of dx1 / 256, saturated.
  for (int64_t k = 0; k < 32; ++k) rest[k] = std::fma(-out.d[0], static_cast<float>(q[0][k]), v[k]);
  const float id2 = (out.d[0] > 0.0f ? 1.0f / out.d[0] : 0.0f) * kSecondTermSteps;
  for (int64_t k = 0; k < 32; ++k)
    q[1][k] = two ? static_cast<int8_t>(std::clamp(std::nearbyint(rest[k] * id2), -128.0f, 127.0f)) : 0;
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
                                                                                          QuantizedBlock& out,
                                                                                          bool two = true) {
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
    const __m512i zero = _mm512_setzero_si512();  // the one-term form's second term
    const bool on = s == 0 || two;
    const __m512i i0 =
        on ? _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), lo), hi) : zero;
    const __m512i i1 =
        on ? _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, id)), lo), hi) : zero;
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
  float* outliers;
};

inline QuantizedParts quantized_parts(int64_t M, int64_t K, float* scratch) {
  const int64_t nb = K / 32;
  float* dx = scratch + M * nb * kWordsPerBlock;
  return {reinterpret_cast<int32_t*>(scratch), dx, dx + 2 * M * nb, dx + 3 * M * nb};
}

// `one_term`: the tiles were quantized in the one-term form.
inline QuantizedInput quantized_view(int64_t M, int64_t K, float* scratch, bool one_term = false) {
  const QuantizedParts parts = quantized_parts(M, K, scratch);
  return {parts.words, parts.dx, parts.sx, one_term ? parts.outliers : nullptr};
}

// The tile's outlier columns (the record at `rec`, see kOutlierRecord): the outlier_columns(K) columns of largest
// max |x| over the tile's mt rows (the lower index first among equal maxima), ascending, and their values; `out`
// (K entries) marks them.
inline void choose_outliers(const float* x, int64_t K, int64_t m0, int64_t mt, float* rec, std::vector<float>& amax,
                            std::vector<int32_t>& order, std::vector<uint8_t>& out) {
  const int64_t k = outlier_columns(K);
  amax.assign(static_cast<size_t>(K), 0.0f);
  for (int64_t m = 0; m < mt; ++m) {
    const float* row = x + (m0 + m) * K;
    for (int64_t c = 0; c < K; ++c) amax[c] = std::max(amax[c], std::fabs(row[c]));
  }
  order.resize(static_cast<size_t>(K));
  for (int64_t c = 0; c < K; ++c) order[c] = static_cast<int32_t>(c);
  const auto larger = [&](int32_t a, int32_t b) { return amax[a] > amax[b] || (amax[a] == amax[b] && a < b); };
  if (k < K) std::nth_element(order.begin(), order.begin() + k, order.end(), larger);  // a strict order: one set
  std::sort(order.begin(), order.begin() + k);
  int32_t* head = reinterpret_cast<int32_t*>(rec);
  float* values = rec + 1 + kMaxOutliers;
  head[0] = static_cast<int32_t>(k);
  out.assign(static_cast<size_t>(K), 0);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t c = order[j];
    head[1 + j] = c;
    out[c] = 1;
    for (int64_t m = 0; m < mt; ++m) values[j * mt + m] = x[(m0 + m) * K + c];
  }
}

// Quantizes the rows [m0, m0 + mt) of x[M, K] (one tile: m0 a multiple of kTile, mt = min(kTile, M - m0)) into
// their place in `scratch` (quantized_view). Tiles write disjoint parts, so threads can build one each. `vector`
// picks the AVX512 block quantizer (only where avx512_supported()), which gives the same bits as the portable one.
// `one_term`: the tile's outlier columns are taken out (zero in the blocks, their values in the tile's record) and
// each block is one term.
inline void quantize_tile(bool q4, const float* x, int64_t M, int64_t K, int64_t m0, float* scratch,
                          bool vector = avx512_supported(), bool one_term = false) {
  const int64_t nb = K / 32;
  const int64_t mt = std::min(kTile, M - m0);
  const QuantizedParts parts = quantized_parts(M, K, scratch);
  int32_t* tw = parts.words + m0 * nb * kWordsPerBlock;
  float* tdx = parts.dx + 2 * m0 * nb;
  float* tsx = parts.sx + m0 * nb;
  thread_local std::vector<float> amax;
  thread_local std::vector<int32_t> order;
  thread_local std::vector<uint8_t> out;
  if (one_term) choose_outliers(x, K, m0, mt, parts.outliers + m0 / kTile * kOutlierRecord, amax, order, out);
  for (int64_t m = 0; m < mt; ++m) {
    const float* row = x + (m0 + m) * K;
    for (int64_t b = 0; b < nb; ++b) {
      QuantizedBlock qb;
      const float* v = row + b * 32;
      float kept[32];
      if (one_term) {  // the block without its outlier columns
        for (int64_t k = 0; k < 32; ++k) kept[k] = out[b * 32 + k] ? 0.0f : v[k];
        v = kept;
      }
#ifdef GGUF_INT8_VNNI
      if (vector) {
        quantize_block_avx512(q4, v, qb, !one_term);
      } else {
        quantize_block_portable(q4, v, qb, !one_term);
      }
#else
      (void)vector;
      quantize_block_portable(q4, v, qb, !one_term);
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
                                    bool vector = avx512_supported(), bool one_term = false) {
  for (int64_t m0 = 0; m0 < M; m0 += kTile) quantize_tile(q4, x, M, K, m0, scratch, vector, one_term);
  return quantized_view(M, K, scratch, one_term);
}

}  // namespace int8
}  // namespace gguf_kernels

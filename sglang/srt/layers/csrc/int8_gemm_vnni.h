// The int8 GEMM of few rows (layers/int8_linear.py): C [M, N] int32 = A [M, K] int8 @ B [K, N] int8, B row-major as
// torch._int_mm takes it, exactly (the same int32 sums). oneDNN's s8 x s8 path behind torch._int_mm reaches the
// VNNI peak for hundreds of rows but 280-560 GOP/s for 17-64 rows (it reorders B on every call); this kernel reads B
// once per call in panels of 64 columns.
//
// VPDPBUSD multiplies 4 unsigned bytes by 4 signed bytes and adds the four products into a 32-bit lane. B is made
// unsigned as it is packed (b + 128, one XOR per byte), A's 4 bytes stay signed and are broadcast from memory by the
// instruction itself (no broadcast instruction beside it), and 128 * sum_k A[m, k] is taken off each row at the end:
// sum_k a * (b + 128) - 128 * sum_k a = sum_k a * b, exactly (|partial sums| < 2^31 for K <= 65536). Each panel of
// B is interleaved once so that lane n holds B[k..k+3, n]: 4 rows of 64 bytes become 4 registers whose 128-bit lane
// L, dword j holds column 16 L + 4 i + j (register i) after two rounds of unpacks; the accumulators are put back in
// column order once per row and panel. Compiled with function-level target attributes
// and chosen at run time (`supported()`), so one binary runs on any CPU; callers use torch._int_mm elsewhere.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "torch_binding.h"
#include "vpdpbusd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define INT8_GEMM_VNNI 1
#include <immintrin.h>
#endif

namespace int8_gemm {

constexpr int64_t kPanel = 64;    // columns of B per panel
constexpr int64_t kMaxTile = 6;   // rows of A per pass over a panel: 6 x 4 accumulators + 4 panel registers
constexpr int64_t kMaxK = 65536;  // |sum of K / 4 steps of 4 products of at most 255 * 128| < 2^31
constexpr int64_t kGroup = 16;    // panels a thread packs together (rows of B read in segments of 1 KB)
constexpr int64_t kAhead = 16;    // rows of B fetched ahead of their packing
constexpr int64_t kChunk = 128;   // rows of B packed at a time (128 KB for 16 panels)

// Whether this CPU runs the kernel (AVX512 F/BW/VL and VNNI). SGLANG_INT8_GEMM_VNNI=0 turns it off.
inline bool supported() {
#ifdef INT8_GEMM_VNNI
  static const bool ok = [] {
    const char* env = std::getenv("SGLANG_INT8_GEMM_VNNI");
    if (env != nullptr && env[0] == '0') return false;
    return vnni::cpu_avx512_vnni();
  }();
  return ok;
#else
  return false;
#endif
}

// Whether the kernel takes these shapes (otherwise the caller multiplies with torch._int_mm).
inline bool takes(int64_t K, int64_t N) { return K > 0 && K % 4 == 0 && K <= kMaxK && N > 0 && N % kPanel == 0; }

#ifdef INT8_GEMM_VNNI

#define INT8_GEMM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// Rows [k0, k0 + kn) of B[:, n0 : n0 + np * 64] as np packed panels of kn / 4 groups of 4 registers (see the top of
// the file), panel j at panels + j * kn. The rows are read as contiguous segments of np * 64 bytes.
INT8_GEMM_TARGET inline void pack_chunk(const int8_t* B, int64_t K, int64_t N, int64_t k0, int64_t kn, int64_t n0,
                                        int64_t np, __m512i* panels) {
  for (int64_t k = 0; k < kn; k += 4) {
    const int8_t* row = B + (k0 + k) * N + n0;
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));  // b + 128 as an unsigned byte
    for (int64_t j = 0; j < np; ++j) {
      const int8_t* r = row + j * kPanel;
      if (k0 + k + kAhead + 4 <= K) {  // the same lines kAhead rows on (into the next chunk near the end of this one)
        for (int64_t i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(r + (kAhead + i) * N), _MM_HINT_T0);
      }
      const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + N);
      const __m512i r2 = _mm512_loadu_si512(r + 2 * N), r3 = _mm512_loadu_si512(r + 3 * N);
      const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
      const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
      __m512i* p = panels + j * kn + k;  // 4 registers per 4 rows
      _mm512_store_si512(p, _mm512_xor_si512(_mm512_unpacklo_epi16(a, c), sign));
      _mm512_store_si512(p + 1, _mm512_xor_si512(_mm512_unpackhi_epi16(a, c), sign));
      _mm512_store_si512(p + 2, _mm512_xor_si512(_mm512_unpacklo_epi16(b, d), sign));
      _mm512_store_si512(p + 3, _mm512_xor_si512(_mm512_unpackhi_epi16(b, d), sign));
    }
  }
}

// MT rows of A (kn bytes each, `lda` apart) against one packed panel of kn rows, added to the rows' 4
// partial-sum registers each (`sums`, 4 per row, in the panel's column order).
template <int MT>
INT8_GEMM_TARGET void panel_rows(const int8_t* A, int64_t lda, const __m512i* panel, int64_t kn, __m512i* sums) {
  // One array per panel register (a two-dimensional array of accumulators is kept on the stack by GCC).
  __m512i c0[MT], c1[MT], c2[MT], c3[MT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    c0[m] = _mm512_load_si512(sums + 4 * m);
    c1[m] = _mm512_load_si512(sums + 4 * m + 1);
    c2[m] = _mm512_load_si512(sums + 4 * m + 2);
    c3[m] = _mm512_load_si512(sums + 4 * m + 3);
  }
  for (int64_t k = 0; k < kn; k += 4) {
    const __m512i* p = panel + k;
    const __m512i p0 = _mm512_load_si512(p), p1 = _mm512_load_si512(p + 1);
    const __m512i p2 = _mm512_load_si512(p + 2), p3 = _mm512_load_si512(p + 3);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const int8_t* a = A + m * lda + k;
      vnni::dpbusd_word(c0[m], p0, a);
      vnni::dpbusd_word(c1[m], p1, a);
      vnni::dpbusd_word(c2[m], p2, a);
      vnni::dpbusd_word(c3[m], p3, a);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    _mm512_store_si512(sums + 4 * m, c0[m]);
    _mm512_store_si512(sums + 4 * m + 1, c1[m]);
    _mm512_store_si512(sums + 4 * m + 2, c2[m]);
    _mm512_store_si512(sums + 4 * m + 3, c3[m]);
  }
}

using PanelRowsFn = void (*)(const int8_t*, int64_t, const __m512i*, int64_t, __m512i*);
constexpr PanelRowsFn kPanelRows[kMaxTile + 1] = {nullptr,       panel_rows<1>, panel_rows<2>, panel_rows<3>,
                                                  panel_rows<4>, panel_rows<5>, panel_rows<6>};

// One row's 4 partial-sum registers of the panel at column n0, in column order, less 128 * the row's sum, into c.
INT8_GEMM_TARGET inline void finish_row(const __m512i* sums, int32_t rowsum, int64_t n0, int32_t* c) {
  // 128-bit lane t of register i holds columns 16 t + 4 i .. + 3: a 4 x 4 transpose of lanes puts them in order.
  const __m512i lo01 = _mm512_shuffle_i32x4(sums[0], sums[1], 0x44);
  const __m512i lo23 = _mm512_shuffle_i32x4(sums[2], sums[3], 0x44);
  const __m512i hi01 = _mm512_shuffle_i32x4(sums[0], sums[1], 0xEE);
  const __m512i hi23 = _mm512_shuffle_i32x4(sums[2], sums[3], 0xEE);
  const __m512i out[4] = {_mm512_shuffle_i32x4(lo01, lo23, 0x88), _mm512_shuffle_i32x4(lo01, lo23, 0xDD),
                          _mm512_shuffle_i32x4(hi01, hi23, 0x88), _mm512_shuffle_i32x4(hi01, hi23, 0xDD)};
  const __m512i shift = _mm512_set1_epi32(rowsum * 128);
  for (int t = 0; t < 4; ++t) _mm512_storeu_si512(c + n0 + 16 * t, _mm512_sub_epi32(out[t], shift));
}

// A [M, K] @ B [K, N] -> C [M, N] (rowsum: each row's sum of A). Each thread takes runs of up to kGroup panels;
// a run is packed kChunk rows of B at a time (row segments read contiguously) and multiplied by every tile of A's
// rows, the partial sums kept per row and panel until the last chunk.
inline void gemm(const int8_t* A, const int8_t* B, const int32_t* rowsum, int32_t* C, int64_t M, int64_t K,
                 int64_t N) {
  const int64_t panels = N / kPanel;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t group = std::max<int64_t>(1, std::min(kGroup, (panels + threads - 1) / threads));
  const int64_t chunk = std::min(kChunk, K);
  at::parallel_for(0, (panels + group - 1) / group, 1, [&](int64_t g0, int64_t g1) {
    std::unique_ptr<void, decltype(&std::free)> packed(std::aligned_alloc(64, group * chunk * kPanel), &std::free);
    std::unique_ptr<void, decltype(&std::free)> partial(std::aligned_alloc(64, M * group * 4 * 64), &std::free);
    auto* buf = static_cast<__m512i*>(packed.get());
    // per tile of rows (from m0, mt rows): [panel][row of the tile][4 registers], at (m0 * group + j * mt + m) * 4
    auto* sums = static_cast<__m512i*>(partial.get());
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * group, np = std::min(group, panels - p0);
      std::memset(sums, 0, M * group * 4 * 64);
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kn = std::min(chunk, K - k0);
        pack_chunk(B, K, N, k0, kn, p0 * kPanel, np, buf);
        for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
          const int64_t mt = std::min(kMaxTile, M - m0);
          for (int64_t j = 0; j < np; ++j) {
            kPanelRows[mt](A + m0 * K + k0, K, buf + j * kn, kn, sums + (m0 * group + j * mt) * 4);
          }
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int64_t mt = std::min(kMaxTile, M - m0);
        for (int64_t j = 0; j < np; ++j) {
          for (int64_t m = 0; m < mt; ++m) {
            finish_row(sums + (m0 * group + j * mt + m) * 4, rowsum[m0 + m], (p0 + j) * kPanel, C + (m0 + m) * N);
          }
        }
      }
    }
  });
}

#undef INT8_GEMM_TARGET
#endif  // INT8_GEMM_VNNI

}  // namespace int8_gemm

// a [M, K] int8 @ b [K, N] int8 (row-major) -> int32 [M, N], the values of torch._int_mm. Only where
// int8_gemm::supported() and int8_gemm::takes(K, N) (int8_gemm_vnni_takes).
inline torch::Tensor int8_gemm_vnni(torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(int8_gemm::supported(), "the VNNI int8 GEMM needs AVX512-VNNI");
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kChar && a.dim() == 2, "a must be an int8 matrix");
  TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kChar && b.dim() == 2 && b.size(0) == a.size(1),
              "b must be an int8 matrix [K, N] with K = a's columns");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK(int8_gemm::takes(K, N), "K must be a multiple of 4 up to ", int8_gemm::kMaxK, " and N of ",
              int8_gemm::kPanel);
  a = a.contiguous();
  b = b.contiguous();
  const int8_t* ap = a.data_ptr<int8_t>();
  std::vector<int32_t> rowsum(M, 0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) rowsum[m] += ap[m * K + k];
  }
  auto out = torch::empty({M, N}, a.options().dtype(at::kInt));
#ifdef INT8_GEMM_VNNI
  int8_gemm::gemm(ap, b.data_ptr<int8_t>(), rowsum.data(), out.data_ptr<int32_t>(), M, K, N);
#endif
  return out;
}

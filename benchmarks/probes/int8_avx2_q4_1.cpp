// Probe: Q4_1 row groups against two-term int8 activations with AVX2's VPMADDUBSW, timed against the float32
// kernels the engine uses on AVX2 CPUs (gguf_kernels.h), one thread. Not part of the engine: it answers whether
// int8 activations would speed up CPUs without VNNI. Built and run by benchmarks/probe_int8_avx2.py.
//
// The activations are the engine's int8 input (gguf_int8.h quantize_rows: two terms per 32-value block, the second
// in steps of the first's scale / 256). Without VNNI a byte dot product is VPMADDUBSW (32 multiplies of unsigned by
// signed bytes, adjacent pairs added into 16 int16 lanes). The Q4_1 nibbles are the unsigned operand, so a block's
// 8 products per lane and term sum exactly in int16 (16 x 15 x 128 < 2^15); VPMADDWD against ones widens them once
// per block, and the terms combine as 256 * sum1 + sum2, as in the VNNI kernels. Two layouts are timed: one half
// (8 output rows) against 2 rows of x per pass, and both halves against 1 row (one broadcast of x feeds both).
// `stream` times the second against the float32 kernels with weights streamed from memory, on OpenMP threads.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gguf_kernels.h"

using namespace gguf_kernels;

namespace {

// Adds, for the MR rows of x starting at words / dx / sx (a tile's arrays, row stride mt), one block's products with
// the halves H0 .. H0 + NH - 1 of a row group into acc[h][m].
template <int MR, int H0, int NH>
inline void block_i8(const uint8_t* bp, const int32_t* w1, const int32_t* w2, const float* bdx, const float* bsx,
                     int64_t mt, __m256 (&acc)[2][MR]) {
  using L = Q41Layout;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i i1[NH][MR], i2[NH][MR];
  for (int h = 0; h < NH; ++h)
    for (int m = 0; m < MR; ++m) i1[h][m] = i2[h][m] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int w = 0; w < 8; ++w) {  // word w: the low (even w) or high nibbles of vector w / 2
    __m256i v[NH];
    for (int h = 0; h < NH; ++h) {
      v[h] = load_vec(bp + L::vec(w / 2, H0 + h));
      v[h] = _mm256_and_si256(w % 2 ? _mm256_srli_epi16(v[h], 4) : v[h], low);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256i a = _mm256_set1_epi32(w1[w * mt + m]), c = _mm256_set1_epi32(w2[w * mt + m]);
      for (int h = 0; h < NH; ++h) {
        i1[h][m] = _mm256_add_epi16(i1[h][m], _mm256_maddubs_epi16(v[h], a));
        i2[h][m] = _mm256_add_epi16(i2[h][m], _mm256_maddubs_epi16(v[h], c));
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m256 d = load_half8(bp + L::d(H0 + h)), mn = load_half8(bp + L::m(H0 + h));
    for (int m = 0; m < MR; ++m) {
      const __m256i s1 = _mm256_madd_epi16(i1[h][m], ones), s2 = _mm256_madd_epi16(i2[h][m], ones);
      const __m256i i = _mm256_add_epi32(_mm256_slli_epi32(s1, 8), s2);
      acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_set1_ps(bdx[mt + m])), acc[h][m]);
      acc[h][m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(bsx[m]), acc[h][m]);
    }
  }
}

// One row group's halves [H0, H0 + NH) against MR rows of a tile of quantized x.
template <int MR, int H0, int NH>
__attribute__((noinline)) void rows_i8(const uint8_t* gp, int64_t nb, const int32_t* words, const float* dx,
                                       const float* sx, int64_t mt, float* y, int64_t ldy) {
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * Q41Layout::kBlockBytes;
    prefetch_ahead<Q41Layout::kBlockBytes>(bp);
    const int32_t* w1 = words + b * int8::kWordsPerBlock * mt;
    block_i8<MR, H0, NH>(bp, w1, w1 + int8::kTermWords * mt, dx + b * 2 * mt, sx + b * mt, mt, acc);
  }
  __m256 out[2][MR];
  for (int h = 0; h < NH; ++h)
    for (int m = 0; m < MR; ++m) out[h][m] = acc[h][m];
  for (int h = 0; h < NH; ++h) store_rows<MR>(out[h], y + (H0 + h) * kHalf, ldy, kHalf);
}

// y[M, 16 G] = x @ W.T with the int8 kernels: both halves against 1 row of x per pass (both_halves), or one half
// against 2 rows.
void matmul_i8(const std::vector<uint8_t>& packed, int64_t G, int64_t nb, int64_t M, int8::QuantizedInput in,
               float* y, int64_t ldy, bool both_halves) {
  const int64_t group_bytes = nb * Q41Layout::kBlockBytes;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = packed.data() + g * group_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += int8::kTile) {
      const int64_t mt = std::min(int8::kTile, M - m0);
      const int32_t* words = in.words + m0 * nb * int8::kWordsPerBlock;
      const float* dx = in.dx + 2 * m0 * nb;
      const float* sx = in.sx + m0 * nb;
      for (int64_t m = 0; m < mt;) {
        float* ym = y + (m0 + m) * ldy + g * kRows;
        if (both_halves) {
          rows_i8<1, 0, 2>(gp, nb, words + m, dx + m, sx + m, mt, ym, ldy);
          m += 1;
        } else if (mt - m >= 2) {
          rows_i8<2, 0, 1>(gp, nb, words + m, dx + m, sx + m, mt, ym, ldy);
          rows_i8<2, 1, 1>(gp, nb, words + m, dx + m, sx + m, mt, ym, ldy);
          m += 2;
        } else {
          rows_i8<1, 0, 1>(gp, nb, words + m, dx + m, sx + m, mt, ym, ldy);
          rows_i8<1, 1, 1>(gp, nb, words + m, dx + m, sx + m, mt, ym, ldy);
          m += 1;
        }
      }
    }
  }
}

template <typename F>
double best_us(F&& f, int rounds) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / 5);
  }
  return best * 1e6;
}

// Random Q4_1 row groups for N x K weights: random nibbles, fp16 scales near 0.01 and minima near -0.08.
std::vector<uint8_t> random_q4_1(int64_t N, int64_t K, std::mt19937& rng) {
  const int64_t blocks = N / kRows * (K / kQK);
  std::vector<uint8_t> packed(blocks * Q41Layout::kBlockBytes);
  for (auto& byte : packed) byte = static_cast<uint8_t>(rng());
  for (int64_t blk = 0; blk < blocks; ++blk) {
    uint8_t* bp = packed.data() + blk * Q41Layout::kBlockBytes;
    for (int r = 0; r < 16; ++r) {
      const uint16_t d = 0x211F + (rng() & 0x3F), mn = 0xA91F + (rng() & 0x3F);
      std::memcpy(bp + Q41Layout::d(0) + 2 * r, &d, 2);
      std::memcpy(bp + Q41Layout::m(0) + 2 * r, &mn, 2);
    }
  }
  return packed;
}

// Streaming: L distinct N x K weights (more than the caches hold, as in a decode step), M rows of x, T OpenMP
// threads splitting each matmul's row groups; the float32 kernels against int8 (both halves, one row per pass).
int stream_main(int64_t N, int64_t K, int64_t M, int64_t L, int T) {
  const int64_t nb = K / kQK, G = N / kRows, group_bytes = nb * Q41Layout::kBlockBytes;
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> weights;
  for (int64_t l = 0; l < L; ++l) weights.push_back(random_q4_1(N, K, rng));
  std::normal_distribution<float> normal;
  std::vector<float> x(M * K), y(M * N);
  for (auto& v : x) v = normal(rng);
  std::vector<float> panels(panel_floats(M, K)), sums(sum_floats(M, K)), scratch(int8::scratch_floats(M, K));
  auto run_float = [&] {
    for (const auto& w : weights) {
      const PreparedInput in =
          prepare_input(true, x.data(), M, K, panels.data(), sums.data(), false, converts_groups(M, false));
#pragma omp parallel for num_threads(T) schedule(static)
      for (int t = 0; t < T; ++t) {
        matmul_groups(true, w.data(), N, K, M, x.data(), in, y.data(), N, G * t / T, G * (t + 1) / T);
      }
    }
  };
  auto run_int8 = [&] {
    for (const auto& w : weights) {
      const int8::QuantizedInput q = int8::quantize_rows(true, x.data(), M, K, scratch.data(), false);
#pragma omp parallel for num_threads(T) schedule(static)
      for (int t = 0; t < T; ++t) {
        for (int64_t g = G * t / T; g < G * (t + 1) / T; ++g) {
          for (int64_t m = 0; m < M; ++m) {  // M <= 8: one tile
            rows_i8<1, 0, 2>(w.data() + g * group_bytes, nb, q.words + m, q.dx + m, q.sx + m, M,
                             y.data() + m * N + g * kRows, N);
          }
        }
      }
    }
  };
  double t_float = 1e30, t_int8 = 1e30;
  for (int round = 0; round < 6; ++round) {
    t_float = std::min(t_float, best_us(run_float, 3));
    t_int8 = std::min(t_int8, best_us(run_int8, 3));
  }
  const double mb = static_cast<double>(L * G * group_bytes) / 1e6;
  std::printf("stream %lld x (%lld x %lld) Q4_1 = %.0f MB, M=%lld, %d threads | float32 %.0f us (%.1f GB/s) | "
              "int8 %.0f us (%.1f GB/s) | int8 %.2fx\n",
              static_cast<long long>(L), static_cast<long long>(N), static_cast<long long>(K), mb,
              static_cast<long long>(M), T, t_float, mb / t_float * 1e3, t_int8, mb / t_int8 * 1e3,
              t_float / t_int8);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && std::string(argv[1]) == "stream" && std::atoll(argv[4]) <= int8::kTile) {
    return stream_main(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]),
                       std::atoi(argv[6]));
  }
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s N K M | stream N K M(<= 8) LAYERS THREADS\n", argv[0]);
    return 2;
  }
  const int64_t N = std::atoll(argv[1]), K = std::atoll(argv[2]), M = std::atoll(argv[3]);
  const int64_t nb = K / kQK, G = N / kRows;
  std::mt19937 rng(1);
  const std::vector<uint8_t> packed = random_q4_1(N, K, rng);
  std::normal_distribution<float> normal;
  std::vector<float> x(M * K), y_float(M * N), y_ref(M * N), y_half(M * N), y_both(M * N);
  for (auto& v : x) v = normal(rng);
  std::vector<float> panels(panel_floats(M, K)), sums(sum_floats(M, K)), scratch(int8::scratch_floats(M, K));
  const int8::QuantizedInput q = int8::quantize_rows(true, x.data(), M, K, scratch.data(), false);
  for (int64_t g = 0; g < G; ++g)  // the engine's portable int8 loop: the exact sums to compare against
    int8::group(true, packed.data() + g * nb * Q41Layout::kBlockBytes, nb, M, q, y_ref.data() + g * kRows, N, kRows);
  auto run_float = [&] {
    const PreparedInput in = prepare_input(true, x.data(), M, K, panels.data(), sums.data(), false,
                                           converts_groups(M, false));
    matmul_groups(true, packed.data(), N, K, M, x.data(), in, y_float.data(), N, 0, G);
  };
  auto run_quantize = [&] { int8::quantize_rows(true, x.data(), M, K, scratch.data(), false); };
  auto run_half = [&] { matmul_i8(packed, G, nb, M, q, y_half.data(), N, false); };
  auto run_both = [&] { matmul_i8(packed, G, nb, M, q, y_both.data(), N, true); };
  double t_float = 1e30, t_half = 1e30, t_both = 1e30;
  for (int round = 0; round < 4; ++round) {  // alternated, best of all rounds
    t_float = std::min(t_float, best_us(run_float, 3));
    t_half = std::min(t_half, best_us(run_half, 3));
    t_both = std::min(t_both, best_us(run_both, 3));
  }
  const double t_quantize = best_us(run_quantize, 5);
  double diff_half = 0, diff_both = 0, diff_float = 0;
  for (int64_t i = 0; i < M * N; ++i) {
    diff_half = std::max<double>(diff_half, std::fabs(y_half[i] - y_ref[i]));
    diff_both = std::max<double>(diff_both, std::fabs(y_both[i] - y_ref[i]));
    diff_float = std::max<double>(diff_float, std::fabs(y_float[i] - y_ref[i]));
  }
  const double mflop = 2.0 * M * N * K / 1e3;
  std::printf("N=%lld K=%lld M=%lld | float32 kernels %.0f us (%.0f GFLOP/s) | int8 per half, 2 rows %.0f us (%.0f) | "
              "int8 both halves, 1 row %.0f us (%.0f) | int8 quantizer (portable) %.0f us | max |int8 - exact int8 "
              "sums| %.2g, %.2g; |float32 - int8| %.2g\n",
              static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(M), t_float,
              mflop / t_float, t_half, mflop / t_half, t_both, mflop / t_both, t_quantize, diff_half, diff_both,
              diff_float);
  return diff_half == 0 && diff_both == 0 ? 0 : 1;
}

// The int8 GEMM's activations (layers/int8_linear.py): per-token int8 with the largest input columns kept apart,
// and the rescaling of the int32 product. Each matches the torch code of int8_linear.py bit for bit (the same
// float32 operations in the same order; no multiply-add is contracted into an FMA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <vector>

#include "kv_types.h"
#include "torch_binding.h"

namespace int8_rows {

// The k columns of x [M, K] with the largest absolute value anywhere in x (the lower index first among equal
// values), in ascending order.
inline std::vector<int64_t> largest_columns(const float* x, int64_t M, int64_t K, int64_t k) {
  // Each thread takes a run of whole rows (read in order) into its own maxima; then the runs' maxima are merged.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M / 8));
  std::vector<float> partial(parts * K, 0.0f);
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      float* __restrict__ mx = partial.data() + p * K;
      for (int64_t m = p * M / parts; m < (p + 1) * M / parts; ++m) {
        const float* __restrict__ row = x + m * K;
        for (int64_t c = 0; c < K; ++c) mx[c] = std::max(mx[c], std::fabs(row[c]));
      }
    }
  });
  std::vector<float> colmax(partial.begin(), partial.begin() + K);
  for (int64_t p = 1; p < parts; ++p) {
    for (int64_t c = 0; c < K; ++c) colmax[c] = std::max(colmax[c], partial[p * K + c]);
  }
  std::vector<int64_t> order(K);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return colmax[a] > colmax[b] || (colmax[a] == colmax[b] && a < b);
  });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

// One row: the outlier columns' values into xo, the rest quantized to int8 with one scale (written to *scale).
// `buf` (K floats) takes a copy of the row with the outliers zeroed, so that the two passes over it are branch-free
// loops the compiler vectorizes; the maximum keeps 8 running lanes for the same reason (a float max reduction is
// not vectorized without -ffast-math). Both give torch's values exactly: max is exact in any order.
__attribute__((optimize("fp-contract=off"))) inline void quantize_row(const float* x, const int64_t* cols, int64_t K,
                                                                      int64_t k, float* buf, int8_t* q, float* scale,
                                                                      float* xo) {
  std::copy(x, x + K, buf);
  for (int64_t j = 0; j < k; ++j) {
    xo[j] = x[cols[j]];
    buf[cols[j]] = 0.0f;
  }
  float lanes[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t c = 0;
  for (; c + 8 <= K; c += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] = std::max(lanes[l], std::fabs(buf[c + l]));
  }
  float amax = 0.0f;
  for (; c < K; ++c) amax = std::max(amax, std::fabs(buf[c]));
  for (float l : lanes) amax = std::max(amax, l);
  const float s = std::max(amax, 1e-8f) / 127.0f;
  *scale = s;
  // Round half to even as torch.round: adding and subtracting 1.5 * 2^23 rounds any |v| < 2^22 to an integer in
  // the default rounding mode, and vectorizes (std::nearbyint does not); |buf / s| <= 127.
  constexpr float kRound = 12582912.0f;
  for (c = 0; c < K; ++c) {
    const float v = (buf[c] / s + kRound) - kRound;
    q[c] = static_cast<int8_t>(static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v))));
  }
}

// out rows [b, e) = acc * xs[m] * ws[n] (+ add), the multiplications in that order as torch does them.
template <typename T>
__attribute__((optimize("fp-contract=off"))) inline void rescale_rows(const int32_t* acc, const float* xs,
                                                                      const float* ws, const T* add, float* out,
                                                                      int64_t b, int64_t e, int64_t N) {
  for (int64_t m = b; m < e; ++m) {
    const int32_t* a = acc + m * N;
    float* o = out + m * N;
    const float s = xs[m];
    if (add == nullptr) {
      for (int64_t n = 0; n < N; ++n) o[n] = static_cast<float>(a[n]) * s * ws[n];
    } else {
      const T* p = add + m * N;
      for (int64_t n = 0; n < N; ++n) o[n] = static_cast<float>(a[n]) * s * ws[n] + kv_types::to_f32(p[n]);
    }
  }
}

}  // namespace int8_rows

// x [M, K] float32 -> (xq [M, K] int8 with the outlier columns zero, scale [M] float32, the k outlier columns [k]
// int64 ascending, x's values there [M, k] float32).
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> int8_split_quantize(torch::Tensor x,
                                                                                                  int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "x must be a float32 matrix");
  TORCH_CHECK(k >= 0 && k <= x.size(1), "k must be between 0 and x's columns");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  const std::vector<int64_t> chosen = int8_rows::largest_columns(xp, M, K, k);
  auto cols = torch::empty({k}, x.options().dtype(at::kLong));
  std::copy(chosen.begin(), chosen.end(), cols.data_ptr<int64_t>());
  auto xq = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto scale = torch::empty({M}, x.options());
  auto xo = torch::empty({M, k}, x.options());
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  float* op = xo.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    std::vector<float> buf(K);
    for (int64_t m = b; m < e; ++m) {
      int8_rows::quantize_row(xp + m * K, chosen.data(), K, k, buf.data(), qp + m * K, sp + m, op + m * k);
    }
  });
  return {xq, scale, cols, xo};
}

// acc [M, N] int32 * x_scale [M] * w_scale [N] (+ add [M, N] float32 or bf16) -> float32 [M, N].
inline torch::Tensor int8_rescale_add(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                                      c10::optional<torch::Tensor> add) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kInt && acc.dim() == 2, "acc must be int32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.numel() == M, "x_scale must be float32 [M]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N, "w_scale must be float32 [N]");
  acc = acc.contiguous();
  x_scale = x_scale.contiguous();
  w_scale = w_scale.contiguous();
  auto out = torch::empty({M, N}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  if (!add.has_value()) {
    at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) {
      int8_rows::rescale_rows<float>(ap, xs, ws, nullptr, op, b, e, N);
    });
    return out;
  }
  torch::Tensor a = add->contiguous();
  TORCH_CHECK(a.dim() == 2 && a.size(0) == M && a.size(1) == N, "add must be [M, N]");
  if (a.scalar_type() == at::kFloat) {
    const float* p = a.data_ptr<float>();
    at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) { int8_rows::rescale_rows(ap, xs, ws, p, op, b, e, N); });
  } else {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16, "add must be float32 or bfloat16");
    const auto* p = static_cast<const kv_types::bf16*>(a.data_ptr());
    at::parallel_for(0, M, grain, [&](int64_t b, int64_t e) { int8_rows::rescale_rows(ap, xs, ws, p, op, b, e, N); });
  }
  return out;
}

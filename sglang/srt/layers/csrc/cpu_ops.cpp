// Small CPU kernels for the decode step, where per-op overhead and memory traffic dominate:
//  - decode attention over the paged KV cache without gathering it: each (sequence, KV head) task reads the
//    sequence's K/V rows straight from the pool by slot index, once for all the query heads that share them;
//  - RMSNorm, optionally fused with the residual add before it (one pass instead of six aten ops).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

using cpu_kernels::rms_norm_rows;

namespace {

// The attention tasks of decode_attention for K/V stored as KV (converted to float32 inside the kernel).
template <typename KV>
void decode_attention_tasks(const float* qp, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const int64_t* ip, const int64_t* lens, float* op, int64_t B, int64_t H, int64_t Hkv,
                            int64_t D, int64_t stride_idx, float fscale) {
  const int64_t group = H / Hkv;
  const int64_t slot_stride = Hkv * D;
  const KV* kp = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vp = static_cast<const KV*>(v_cache.data_ptr());
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      const int64_t L = lens[b];
      scores.resize(static_cast<size_t>(group * (L + 2)));  // + the per-head max and sum
      const int64_t head = b * H + g * group;
      cpu_kernels::attend_kv_head(qp + head * D, group, D, kp + g * D, vp + g * D, slot_stride, ip + b * stride_idx, L,
                                  fscale, scores.data(), op + head * D);
    }
  });
}

}  // namespace

// q [B, H, D] float32; k_cache, v_cache [S, Hkv, D] float32, bfloat16, float8_e4m3fn or float8_e5m2 (both the
// same); kv_indices [B, >= max(seq_lens)] int64; seq_lens [B] int64. Returns [B, H, D] float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor kv_indices, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q, k_cache, v_cache must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv_type, "k_cache and v_cache must have the same dtype");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kFloat8_e4m3fn ||
                  kv_type == at::kFloat8_e5m2, "KV buffers must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV buffers must be contiguous");
  kv_indices = kv_indices.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.size(1) == Hkv && H % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(kv_indices.size(0) == B && seq_lens.size(0) == B, "batch sizes do not match");
  const int64_t stride_idx = kv_indices.size(1);
  const int64_t num_slots = k_cache.size(0);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= stride_idx, "bad sequence length");
    const int64_t* slots = kv_indices.data_ptr<int64_t>() + b * stride_idx;
    for (int64_t t = 0; t < lens[b]; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "KV slot out of range");
  }

  auto out = torch::empty({B, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* ip = kv_indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  switch (kv_type) {
    case at::kBFloat16:
      decode_attention_tasks<kv_types::bf16>(qp, k_cache, v_cache, ip, lens, op, B, H, Hkv, D, stride_idx, fscale);
      break;
    case at::kFloat8_e4m3fn:
      decode_attention_tasks<kv_types::e4m3>(qp, k_cache, v_cache, ip, lens, op, B, H, Hkv, D, stride_idx, fscale);
      break;
    case at::kFloat8_e5m2:
      decode_attention_tasks<kv_types::e5m2>(qp, k_cache, v_cache, ip, lens, op, B, H, Hkv, D, stride_idx, fscale);
      break;
    default:
      decode_attention_tasks<float>(qp, k_cache, v_cache, ip, lens, op, B, H, Hkv, D, stride_idx, fscale);
  }
  return out;
}

namespace {

void check_norm_args(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 2-D");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1),
              "weight must be contiguous float32 [hidden]");
}

}  // namespace

// x [T, n] float32 -> x / rms(x) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_norm_args(x, w);
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    rms_norm_rows(xp + b * n, wp, op + b * n, e - b, n, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual) * w
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_norm_args(x, w);
  check_norm_args(residual, w);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  auto out = torch::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rp[r * n + i] += xp[r * n + i];
    }
    rms_norm_rows(rp + b * n, wp, op + b * n, e - b, n, static_cast<float>(eps));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Decode attention over a paged KV cache (float32, bf16 or fp8 K/V)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x, then RMSNorm of residual (float32)");
}

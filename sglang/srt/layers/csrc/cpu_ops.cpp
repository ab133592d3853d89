// Small CPU kernels for the decode step, where per-op overhead and memory traffic dominate:
//  - decode attention over the paged KV cache without gathering it: each (sequence, KV head) task reads the
//    sequence's K/V rows straight from the pool by slot index, once for all the query heads that share them;
//  - causal attention of the new tokens of a prefill / extend batch, likewise read from the pool (extend_attention.h);
//    both take an optional sliding window (each query sees only the last `window` positions up to its own);
//  - the rotary embedding of the query and key heads, in place in the projection's output;
//  - the SiLU-and-multiply of a fused gate/up output, from float32 or bf16 in one pass;
//  - RMSNorm, optionally fused with the residual add before it (one pass instead of six aten ops).
#include "torch_binding.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "buffer_cache.h"
#include "cpu_kernels.h"
#include "decode_attention.h"
#include "extend_attention.h"
#include "extend_attention_bf16.h"
#include "int8_gemm_vnni.h"
#include "int8_rows.h"
#include "kv_layout.h"

using cpu_kernels::rms_norm_rows;

namespace {

// Calls f with a null pointer of the KV buffers' element type (float32, bf16, fp8 e4m3 or e5m2), after checking
// that both buffers have that type (their layout is checked by kv_layout::strides_of).
template <typename F>
void with_kv_type(const torch::Tensor& k_cache, const torch::Tensor& v_cache, F&& f) {
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv_type, "k_cache and v_cache must have the same dtype");
  switch (kv_type) {
    case at::kFloat: f(static_cast<const float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<const kv_types::bf16*>(nullptr)); break;
    case at::kFloat8_e4m3fn: f(static_cast<const kv_types::e4m3*>(nullptr)); break;
    case at::kFloat8_e5m2: f(static_cast<const kv_types::e5m2*>(nullptr)); break;
    default: TORCH_CHECK(false, "KV buffers must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
}

// The element type behind with_kv_type's pointer.
template <typename P>
using kv_of = std::remove_const_t<std::remove_pointer_t<P>>;

void check_slots(const int64_t* slots, int64_t count, int64_t num_slots) {
  for (int64_t t = 0; t < count; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "KV slot out of range");
}

// The attention tasks of decode_attention for K/V stored as KV (converted to float32 inside the kernel).
template <typename KV>
void decode_attention_tasks(const float* qp, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const int64_t* ip, const int64_t* lens, float* op, int64_t B, int64_t H, int64_t Hkv,
                            int64_t D, int64_t stride_idx, float fscale, int64_t window) {
  const int64_t group = H / Hkv;
  const kv_layout::Strides kv = kv_layout::strides_of(k_cache, v_cache);
  const KV* kp = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vp = static_cast<const KV*>(v_cache.data_ptr());
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, g = task % Hkv;
      // a sliding window keeps the last `window` tokens of the sequence
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      const int64_t L = lens[b] - first;
      scores.resize(static_cast<size_t>(group * (L + 2)));  // + the per-head max and sum
      const int64_t head = b * H + g * group;
      cpu_kernels::attend_kv_head(qp + head * D, group, D, kp + g * kv.head, vp + g * kv.head, kv.slot,
                                  ip + b * stride_idx + first, L, fscale, scores.data(), op + head * D);
    }
  });
}

}  // namespace

// q [B, H, D] float32; k_cache, v_cache [S, Hkv, D] float32, bfloat16, float8_e4m3fn or float8_e5m2 (both the
// same type and layout, slot- or head-major: kv_layout.h); kv_indices [B, >= max(seq_lens)] int64; seq_lens [B]
// int64; window > 0: attend to the last `window` tokens of each sequence only (0: all). Returns [B, H, D] float32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor kv_indices, torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q, k_cache, v_cache must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 indices");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  q = q.contiguous();
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
    check_slots(kv_indices.data_ptr<int64_t>() + b * stride_idx, lens[b], num_slots);
  }

  auto out = torch::empty({B, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* ip = kv_indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  with_kv_type(k_cache, v_cache, [&](auto type) {
    decode_attention_tasks<kv_of<decltype(type)>>(qp, k_cache, v_cache, ip, lens, op, B, H, Hkv, D, stride_idx,
                                                  fscale, window);
  });
  return out;
}

namespace {

template <typename KV>
void extend_attention_tasks(const float* qp, int64_t q_stride, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const int64_t* ip, int64_t stride_idx, const int64_t* starts,
                            const int64_t* ext_lens, const int64_t* prefix_lens, int64_t N, float* op, int64_t H,
                            int64_t Hkv, int64_t D, float scale, int64_t window) {
  const int64_t group = H / Hkv;
  // One task per (sequence, KV head, block of query rows), in that order. A causal task's work grows with the keys
  // its rows see, so the tasks of a long prompt differ several-fold: each thread takes a contiguous run of tasks of
  // equal estimated work (an equal count gave one thread the later, longer rows of a long prompt), and contiguous
  // runs keep a sequence's heads, whose K/V rows share cache lines, on one core.
  struct Task {
    int64_t b, g, r0;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> work_before{0};  // estimated work of the tasks before each one
  for (int64_t b = 0; b < N; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t r = 0; r < ext_lens[b]; r += cpu_kernels::kExtendRows) {
        const int64_t rows = std::min(ext_lens[b] - r, cpu_kernels::kExtendRows);
        // keys gathered (prefix + r + rows) and query-key pairs scored
        const int64_t keys = window > 0 ? std::min(prefix_lens[b] + r, window) + rows : prefix_lens[b] + r + rows;
        tasks.push_back({b, g, r});
        work_before.push_back(work_before.back() + keys * (8 + group * rows) - group * rows * rows / 2);
      }
  const KV* kp = static_cast<const KV*>(k_cache.data_ptr());
  const KV* vp = static_cast<const KV*>(v_cache.data_ptr());
  const kv_layout::Strides kv = kv_layout::strides_of(k_cache, v_cache);
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  // Thread k runs tasks run_start[k] .. run_start[k + 1] - 1: those whose midpoint of work falls in its share.
  std::vector<int64_t> run_start(threads + 1, count);
  for (int64_t k = 0, t = 0; k < threads; ++k) {
    while (t < count && 2 * threads * (work_before[t] + work_before[t + 1]) < 4 * k * work_before.back()) ++t;
    run_start[k] = t;
  }
  constexpr bool bf16_kv = std::is_same_v<KV, kv_types::bf16>;
  // the bf16 dot products have no sliding window: windowed layers convert to float32 like the other K/V types
  const bool bf16_dots = bf16_kv && window == 0 && cpu_kernels::extend_attention_bf16_enabled(D);
  at::parallel_for(0, threads, 1, [&](int64_t k_begin, int64_t k_end) {
    cpu_kernels::ExtendScratch scratch;
    cpu_kernels::ExtendBf16Scratch bf16_scratch;
    if (bf16_dots) {
      bf16_scratch.size_for(group, D);
    } else {
      scratch.size_for(group, D);
    }
    for (int64_t t = run_start[k_begin]; t < run_start[k_end]; ++t) {
      const Task& task = tasks[t];
      const int64_t r1 = std::min(ext_lens[task.b], task.r0 + cpu_kernels::kExtendRows);
      const KV* kg = kp + task.g * kv.head;  // KV head g's rows
      const KV* vg = vp + task.g * kv.head;
#ifdef CPU_KERNELS_AVX2
      if constexpr (bf16_kv) {
        if (bf16_dots) {
          cpu_kernels::extend_attention_task_bf16(qp, q_stride, kg, vg, kv.slot, ip + task.b * stride_idx,
                                                  starts[task.b], prefix_lens[task.b], task.r0, r1, task.g, group, H,
                                                  D, scale, op, bf16_scratch);
          continue;
        }
      }
#endif
      cpu_kernels::extend_attention_task(qp, q_stride, kg, vg, kv.slot, ip + task.b * stride_idx, starts[task.b],
                                         prefix_lens[task.b], task.r0, r1, task.g, group, H, D, scale, op, scratch,
                                         window);
    }
  });
}

}  // namespace

// q [T, H, D] float32 (rows may be strided, heads and channels contiguous); k_cache, v_cache [S, Hkv, D] of a KV
// type as in decode_attention; kv_indices [N, >= max(prefix + extend)] int64 slots per sequence; token_starts,
// extend_lens, prefix_lens [N] int64: sequence b's new tokens are q rows token_starts[b] .. + extend_lens[b], at
// positions prefix_lens[b] .. ; window > 0: each query sees only the last `window` positions up to its own (0: all).
// Returns [T, H, D] float32 (rows of no sequence are left unset).
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor kv_indices, torch::Tensor token_starts, torch::Tensor extend_lens,
                               torch::Tensor prefix_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q, k_cache, v_cache must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  for (const auto* t : {&kv_indices, &token_starts, &extend_lens, &prefix_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "indices and lengths must be int64");
  kv_indices = kv_indices.contiguous();
  token_starts = token_starts.contiguous();
  extend_lens = extend_lens.contiguous();
  prefix_lens = prefix_lens.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), N = token_starts.size(0);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes() && H % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.size(0) == N && extend_lens.size(0) == N && prefix_lens.size(0) == N,
              "one row of KV slots and one start, extend and prefix length per sequence");
  const int64_t stride_idx = kv_indices.size(1), num_slots = k_cache.size(0);
  const int64_t* starts = token_starts.data_ptr<int64_t>();
  const int64_t* ext = extend_lens.data_ptr<int64_t>();
  const int64_t* pre = prefix_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < N; ++b) {
    TORCH_CHECK(ext[b] >= 0 && pre[b] >= 0 && starts[b] >= 0 && starts[b] + ext[b] <= T, "bad sequence extent");
    TORCH_CHECK(pre[b] + ext[b] <= stride_idx, "a sequence is longer than its row of KV slots");
    check_slots(kv_indices.data_ptr<int64_t>() + b * stride_idx, pre[b] + ext[b], num_slots);
  }
  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t* ip = kv_indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t qs = q.stride(0);
  with_kv_type(k_cache, v_cache, [&](auto type) {
    extend_attention_tasks<kv_of<decltype(type)>>(qp, qs, k_cache, v_cache, ip, stride_idx, starts, ext, pre, N, op, H,
                                                  Hkv, D, fscale, window);
  });
  return out;
}

namespace {

void check_norm_args(const torch::Tensor& x, const torch::Tensor& w, bool bf16_allowed = false) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || (bf16_allowed && x.scalar_type() == at::kBFloat16)),
              bf16_allowed ? "x must be contiguous float32 or bfloat16 2-D" : "x must be contiguous float32 2-D");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1),
              "weight must be contiguous float32 [hidden]");
}

// The normalized rows as float32 or (bf16_out) bf16: what the next projection multiplies, so a bf16 GEMM takes
// them without a separate conversion.
torch::Tensor norm_output(const torch::Tensor& like, bool bf16_out) {
  return torch::empty(like.sizes(), like.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
}

// Calls f with a null pointer of t's element type: float for float32, kv_types::bf16 for bfloat16 (the caller has
// checked that t is one of the two).
template <typename F>
void with_float_or_bf16(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<kv_types::bf16*>(nullptr));
  }
}

// The element type behind with_float_or_bf16's pointer.
template <typename P>
using elem_of = std::remove_pointer_t<P>;

}  // namespace

// x [T, n] float32 -> x / rms(x) * w, float32 or (bf16_out) bf16
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, bool bf16_out) {
  check_norm_args(x, w);
  auto out = norm_output(x, bf16_out);
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  with_float_or_bf16(out, [&](auto* type) {
    auto* op = static_cast<elem_of<decltype(type)>*>(out.data_ptr());
    at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
      rms_norm_rows(xp + b * n, wp, op + b * n, e - b, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual (float32) += x (float32 or bf16, e.g. a bf16 GEMM's output) in place; returns rms_norm(residual) * w,
// float32 or (bf16_out) bf16
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps,
                                 bool bf16_out) {
  check_norm_args(x, w, /*bf16_allowed=*/true);
  check_norm_args(residual, w);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  auto out = norm_output(residual, bf16_out);
  const int64_t rows = x.size(0), n = x.size(1);
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  with_float_or_bf16(x, [&](auto* x_type) {
    const auto* xp = static_cast<const elem_of<decltype(x_type)>*>(x.data_ptr());
    with_float_or_bf16(out, [&](auto* out_type) {
      auto* op = static_cast<elem_of<decltype(out_type)>*>(out.data_ptr());
      at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) rp[r * n + i] += kv_types::to_f32(xp[r * n + i]);
        }
        rms_norm_rows(rp + b * n, wp, op + b * n, e - b, n, static_cast<float>(eps));
      });
    });
  });
  return out;
}

// Stores k and v [T, Hkv, D] float32 (each row's heads and channels contiguous, rows may be strided: views into a
// fused qkv projection) at KV slots loc [T] of k_cache / v_cache [slots, Hkv, D] (slot- or head-major), converted
// to the caches' dtype exactly as KVPool.set_kv_buffer converts (kv_types.h): one pass instead of a conversion and a
// scatter per tensor.
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor loc, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [T, Hkv, D] of one shape");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k and v must be float32");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "k and v rows must hold their heads and channels contiguously");
  }
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == Hkv && k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(),
              "caches must be [slots, Hkv, D] matching k and v");
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == T && loc.scalar_type() == at::kLong && loc.is_contiguous(),
              "loc must be contiguous int64 [T]");
  const int64_t* lp = loc.data_ptr<int64_t>();
  check_slots(lp, T, k_cache.size(0));
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const kv_layout::Strides kv = kv_layout::strides_of(k_cache, v_cache);
  with_kv_type(k_cache, v_cache, [&](auto* type) {
    using KV = kv_of<decltype(type)>;
    KV* kc = static_cast<KV*>(k_cache.data_ptr());
    KV* vc = static_cast<KV*>(v_cache.data_ptr());
    // a decode batch's rows are a few microseconds of work: one thread, no team wake-up
    at::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        for (int64_t g = 0; g < Hkv; ++g) {
          const int64_t at = lp[t] * kv.slot + g * kv.head;
          kv_types::store_row(kp + t * ks + g * D, kc + at, D);
          kv_types::store_row(vp + t * vs + g * D, vc + at, D);
        }
      }
    });
  });
}

// Rotates the first rd channels of every head of x [T, heads, D] float32 in place (rows and heads may be strided,
// channels contiguous), position t with cos[t], sin[t] ([T, rd] contiguous rows of RotaryEmbedding.lookup: the
// sign of rotate-half folded into sin).
void rope_in_place(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x must be float32 [T, heads, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos and sin must be float32");
  cos = cos.reshape({cos.size(0), -1}).contiguous();
  sin = sin.reshape({sin.size(0), -1}).contiguous();
  const int64_t T = x.size(0), heads = x.size(1), rd = cos.size(1);
  TORCH_CHECK(cos.size(0) == T && sin.sizes() == cos.sizes() && rd % 2 == 0 && rd <= x.size(2),
              "cos and sin must be [T, rotary_dim] with an even rotary_dim <= head_dim");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(rd);
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < heads; ++h)
        cpu_kernels::rope_head(xp + t * st + h * sh, cp + t * rd, sp + t * rd, rd, tmp.data());
  });
}

// x [T, 2d] float32 or bfloat16 (gate | up) -> silu(gate) * up [T, d] in x's dtype, computed in float32.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be 2-D [tokens, 2 * d]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  x = x.contiguous();
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  auto out = torch::empty({rows, d}, x.options());
  auto run = [&](auto* xp, auto* op) {
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) cpu_kernels::silu_mul(xp + r * 2 * d, xp + r * 2 * d + d, op + r * d, d);
    });
  };
  with_float_or_bf16(x, [&](auto* type) {
    using T = elem_of<decltype(type)>;
    run(static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()));
  });
  return out;
}

// x [M, V] float32 -> the argmax of each row [M] int64, as torch.argmax(x, -1).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0,
              "x must be a float32 CPU matrix with at least one column");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Rows of a vocabulary-sized row each are worth a thread; one row alone is not worth waking one.
  at::parallel_for(0, rows, std::max<int64_t>(1, 262144 / n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = cpu_kernels::argmax(xp + r * n, n);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Decode attention over a paged KV cache (float32, bf16 or fp8 K/V)");
  m.def("extend_attention", &extend_attention, "Causal prefill / extend attention over a paged KV cache");
  m.def("rope_in_place", &rope_in_place, "Rotary embedding of float32 heads in place (rotate-half layout)");
  m.def("argmax_rows", &argmax_rows, "argmax of each row of a float32 matrix, as torch.argmax(x, -1)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up projection (float32 or bf16)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, written as float32 or bf16");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x (float32 or bf16), then RMSNorm of residual, written as float32 or bf16");
  m.def("int8_split_quantize", &int8_split_quantize,
        "Per-token int8 of a float32 matrix, its k largest columns kept apart in float32");
  m.def("int8_rescale_add", &int8_rescale_add, "An int32 product scaled per row and column, plus a matrix");
  m.def("int8_gemm_vnni", &int8_gemm_vnni, "int8 [M, K] @ int8 [K, N] -> int32 with AVX512-VNNI (torch._int_mm's values)");
  m.def("int8_gemm_vnni_takes", [](int64_t K, int64_t N) { return int8_gemm::supported() && int8_gemm::takes(K, N); },
        "whether this CPU and build run int8_gemm_vnni for these K and N");
  m.def("store_kv", &store_kv, "Store float32 k/v rows at KV slots, converted to the cache dtype");
  m.def("set_decode_attention_avx512", &cpu_kernels::set_decode_attention_avx512,
        "turn the AVX512 path of bf16 decode attention on (where the CPU has it) or off; returns whether it was on",
        py::arg("on"));
  m.def("has_decode_attention_avx512", &cpu_kernels::has_decode_attention_avx512,
        "whether bf16 decode attention can take the AVX512 path on this CPU in this build");
  m.def("set_extend_attention_bf16", &cpu_kernels::set_extend_attention_bf16,
        "turn bf16 dot products in extend attention over bf16 K/V on (where the CPU has AVX512-BF16) or off; "
        "returns whether they were on",
        py::arg("on"));
  m.def("has_extend_attention_bf16", &cpu_kernels::has_extend_attention_bf16,
        "whether extend attention over bf16 K/V can use AVX512-BF16 dot products on this CPU in this build");
  m.def("configure_buffer_cache", &buffer_cache::configure,
        "install the CPU allocator that keeps large freed buffers for reuse, with the bytes it keeps at most",
        py::arg("cap_bytes"), py::arg("min_bytes"));
  m.def("buffer_cache_stats", &buffer_cache::stats,
        "(bytes kept, blocks kept, allocations served from kept blocks, large allocations made fresh, cap)");
}

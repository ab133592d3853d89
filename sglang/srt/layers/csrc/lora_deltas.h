// LoRA deltas inside the fused decode step (decode_stack.cpp): for each row whose adapter slot is >= 0, every
// adapted linear adds  out_row += B @ (A @ x_row),  with B already scaled by the adapter's lora_alpha / r.
//
// An adapter is registered once per slot (set_lora_adapter) as four sites per layer, in the order of the step's
// fused linears: qkv_proj (shards q, k, v), o_proj, gate_up_proj (shards gate, up), down_proj. A site holds
//   a  float32 [shards * rank, in]: shard s's lora_A in rows [s * rank, (s + 1) * rank)
//   b  float32 [rank, out]: the scaled lora_B of each shard, transposed, in that shard's output columns
// and a bit mask of the shards the adapter has (the rows of the others are zero and skipped). A step groups its rows
// by adapter; each matmul phase of an adapted linear then has work items of two kinds:
//   h items (ahead of the matmul items): h[row, s * rank + t] = A_s[t] . x_row for a chunk of kRankChunk ranks of
//     one shard of one adapter, over every row of that adapter (the chunk of A is read once for all of them);
//   the matmul items, which after their base row groups wait until every h item is done, then add the deltas of
//     the same output range: out[row, j] += sum_t h[row, shard(j) * rank + t] * b[t, j], one contiguous
//     (vectorized) pass over the range per rank.
// Every output element is still computed by one thread in one order, so the result does not depend on the thread
// count or schedule. Rows of different adapters and ranks mix in one step; base-model rows (slot -1) are untouched.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_kernels.h"
#include "torch_binding.h"

namespace lora_deltas {

constexpr int64_t kSites = 4;      // qkv_proj, o_proj, gate_up_proj, down_proj
constexpr int64_t kMaxShards = 3;  // q, k, v
constexpr int64_t kRankChunk = 4;  // ranks per h item

struct Site {
  torch::Tensor a, b;  // undefined when the adapter leaves this linear alone
  int64_t mask = 0;    // bit s: the adapter has shard s
};

struct Adapter {
  int64_t rank = 0;
  std::vector<Site> sites;  // kSites per layer
};

// The output rows of each shard of a site: bounds[s] .. bounds[s + 1].
using ShardBounds = std::vector<int64_t>;

// Checks and stores one adapter's sites (`a`, `b`, `masks`: kSites per layer, None where the adapter has no part).
// `in` / `bounds`: the input width and shard bounds of each site kind.
inline std::shared_ptr<const Adapter> make_adapter(int64_t rank, const std::vector<c10::optional<torch::Tensor>>& a,
                                                   const std::vector<c10::optional<torch::Tensor>>& b,
                                                   const std::vector<int64_t>& masks, int64_t num_layers,
                                                   const int64_t (&in)[kSites], const ShardBounds (&bounds)[kSites]) {
  TORCH_CHECK(rank >= 1, "LoRA rank must be >= 1");
  const size_t n = static_cast<size_t>(num_layers * kSites);
  TORCH_CHECK(a.size() == n && b.size() == n && masks.size() == n,
              "a LoRA adapter needs a, b and mask for 4 linears per layer");
  auto adapter = std::make_shared<Adapter>();
  adapter->rank = rank;
  adapter->sites.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t kind = static_cast<int64_t>(i) % kSites;
    const int64_t shards = static_cast<int64_t>(bounds[kind].size()) - 1;
    TORCH_CHECK(a[i].has_value() == b[i].has_value(), "LoRA a and b go together");
    if (!a[i].has_value()) continue;
    const torch::Tensor& at = *a[i];
    const torch::Tensor& bt = *b[i];
    for (const auto* t : {&at, &bt}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 2,
                  "LoRA weights must be contiguous float32 CPU matrices");
    }
    TORCH_CHECK(at.size(0) == shards * rank && at.size(1) == in[kind], "LoRA a of linear ", kind,
                " must be [shards * rank, in]");
    TORCH_CHECK(bt.size(0) == rank && bt.size(1) == bounds[kind].back(), "LoRA b of linear ", kind,
                " must be [rank, out]");
    TORCH_CHECK(masks[i] > 0 && masks[i] < (int64_t{1} << shards), "bad LoRA shard mask");
    adapter->sites[i] = Site{at, bt, masks[i]};
  }
  return adapter;
}

// The adapters of one step's rows, and the scratch of their low-rank products.
class StepLora {
 public:
  // slots[b]: row b's index into `adapters` (-1: the base model).
  StepLora(const int64_t* slots, int64_t B, const std::vector<std::shared_ptr<const Adapter>>& adapters) {
    int64_t max_rank = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = slots[b];
      if (slot < 0) continue;
      TORCH_CHECK(slot < static_cast<int64_t>(adapters.size()) && adapters[slot] != nullptr,
                  "LoRA slot ", slot, " holds no adapter");
      const Adapter* adapter = adapters[slot].get();
      Group* group = nullptr;
      for (Group& g : groups_)
        if (g.adapter == adapter) group = &g;
      if (group == nullptr) {
        groups_.push_back(Group{adapter, {}});
        group = &groups_.back();
      }
      group->rows.push_back(b);
      max_rank = std::max(max_rank, adapter->rank);
    }
    stride_ = kMaxShards * max_rank;
    h_.resize(static_cast<size_t>(B * stride_));
  }

  bool empty() const { return groups_.empty(); }

  // How many h items the linear `site` (layer * kSites + kind) has in this step.
  int64_t h_items(int64_t site) const {
    int64_t n = 0;
    for (const Group& g : groups_) n += items_of(g, site);
    return n;
  }

  // h item `item` of `site`, from the linear's input x [B, K].
  void h_item(int64_t site, int64_t item, const float* x, int64_t K) {
    for (const Group& g : groups_) {
      const int64_t n = items_of(g, site);
      if (item >= n) {
        item -= n;
        continue;
      }
      const Site& st = g.adapter->sites[site];
      const int64_t r = g.adapter->rank, chunks = (r + kRankChunk - 1) / kRankChunk;
      int64_t shard = -1;
      for (int64_t i = item / chunks; i >= 0; --i) {  // the (item / chunks)-th shard present
        do ++shard;
        while (!(st.mask >> shard & 1));
      }
      const int64_t t0 = (item % chunks) * kRankChunk, t1 = std::min(r, t0 + kRankChunk);
      const float* a = st.a.data_ptr<float>() + (shard * r + t0) * K;
      for (const int64_t b : g.rows) {
        const float* xb = x + b * K;
        float* hb = h_.data() + b * stride_ + shard * r + t0;
        if (t1 - t0 == 4) {  // four rows of A against one input: four independent sums, x read once
          const float *a0 = a, *a1 = a + K, *a2 = a + 2 * K, *a3 = a + 3 * K;
          float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
          for (int64_t k = 0; k < K; ++k) {
            const float xv = xb[k];
            s0 += a0[k] * xv;
            s1 += a1[k] * xv;
            s2 += a2[k] * xv;
            s3 += a3[k] * xv;
          }
          hb[0] = s0, hb[1] = s1, hb[2] = s2, hb[3] = s3;
        } else {
          for (int64_t t = 0; t < t1 - t0; ++t) hb[t] = cpu_kernels::dot(a + t * K, xb, K);
        }
      }
      return;
    }
  }

  // The deltas of the output columns [n0, n1) of `site` (bounds: its shards' columns) added to y (row stride ldy).
  void add_deltas(int64_t site, const ShardBounds& bounds, int64_t n0, int64_t n1, float* y, int64_t ldy) const {
    const int64_t out = bounds.back();
    for (const Group& g : groups_) {
      const Site& st = g.adapter->sites[site];
      if (!st.a.defined()) continue;
      const int64_t r = g.adapter->rank;
      const float* bw = st.b.data_ptr<float>();
      for (int64_t s = 0; s + 1 < static_cast<int64_t>(bounds.size()); ++s) {
        if (!(st.mask >> s & 1)) continue;
        const int64_t lo = std::max(n0, bounds[s]), hi = std::min(n1, bounds[s + 1]);
        if (lo >= hi) continue;
        const int64_t n = hi - lo;
        for (const int64_t b : g.rows) {
          const float* h = h_.data() + b * stride_ + s * r;
          float* yb = y + b * ldy + lo;
          int64_t t = 0;
          for (; t + 4 <= r; t += 4) {  // four ranks per pass over the output range
            const float* b0 = bw + t * out + lo;
            const float *b1 = b0 + out, *b2 = b1 + out, *b3 = b2 + out;
            const float h0 = h[t], h1 = h[t + 1], h2 = h[t + 2], h3 = h[t + 3];
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) yb[j] += h0 * b0[j] + h1 * b1[j] + h2 * b2[j] + h3 * b3[j];
          }
          for (; t < r; ++t) cpu_kernels::axpy(yb, bw + t * out + lo, h[t], n);
        }
      }
    }
  }

 private:
  struct Group {
    const Adapter* adapter;
    std::vector<int64_t> rows;
  };

  static int64_t items_of(const Group& g, int64_t site) {
    const Site& st = g.adapter->sites[site];
    if (!st.a.defined()) return 0;
    const int64_t chunks = (g.adapter->rank + kRankChunk - 1) / kRankChunk;
    return __builtin_popcountll(static_cast<unsigned long long>(st.mask)) * chunks;
  }

  std::vector<Group> groups_;
  std::vector<float> h_;
  int64_t stride_ = 0;
};

}  // namespace lora_deltas

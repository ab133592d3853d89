// The work items of the fused decode step's attention phase, with long sequences split over their token range.
//
// One item per (sequence, KV head) leaves threads idle when a batch has fewer such pairs than a multiple of the
// thread count (batch 1 of a model with 3 KV heads on 2 threads: one thread does two items, the other one) and,
// late in a long generation, attention is most of the step. So a sequence longer than kChunkTokens has each of its
// KV heads split into chunks of the token range; a chunk item leaves a partial result (cpu_kernels::attend_partial)
// in a per-step buffer, and whichever thread finishes the last chunk of a (sequence, KV head) merges them
// (cpu_kernels::merge_partials) into the attention output. The chunking depends on the sequence length only, never
// on the thread count, so the result is the same with any number of threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_kernels.h"

namespace attention_split {

// Sequences up to this many tokens run as one item per KV head; longer ones are split into equal chunks of the
// token range (multiples of 64 tokens), as few as keep each at most this long: each chunk's fixed costs (q norm and
// RoPE, its partial result and the merge) stay small next to its reads. Measured on the fused step at batch 1, 2
// threads: 512 beats 256 at every length from 700 to 3,000 tokens (by up to 10% at 3,000); 768 is faster still at
// 3,000 but leaves two threads one item apart at ~700 tokens (three items).
constexpr int64_t kChunkTokens = 512;
// Very long sequences get longer chunks rather than more of them (bounds the partial-result buffer).
constexpr int64_t kMaxChunks = 64;

inline int64_t chunk_tokens(int64_t len) {
  const int64_t n = std::min(kMaxChunks, (len + kChunkTokens - 1) / kChunkTokens);
  return ((len + n - 1) / n + 63) / 64 * 64;
}

inline int64_t num_chunks(int64_t len) {
  return len > kChunkTokens ? (len + chunk_tokens(len) - 1) / chunk_tokens(len) : 1;
}

// One attention item: KV head g of sequence b over tokens [t0, t1), chunk `chunk` of `chunks`.
struct Item {
  int64_t b, g, chunk, chunks, t0, t1;
};

class Plan {
 public:
  // lens [B]: the sequence lengths; `layers` counters per split (sequence, KV head) track finished chunks.
  Plan(const int64_t* lens, int64_t B, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t layers)
      : B_(B), kv_heads_(kv_heads), lens_(lens) {
    const int64_t part = cpu_kernels::partial_floats(group, head_dim);
    item_start_.resize(static_cast<size_t>(B + 1));
    chunks_.resize(static_cast<size_t>(B));
    part_start_.resize(static_cast<size_t>(B));
    int64_t items = 0, floats = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = num_chunks(lens[b]);
      item_start_[b] = items;
      chunks_[b] = n;
      part_start_[b] = floats;
      items += kv_heads * n;
      if (n > 1) floats += kv_heads * n * part;
    }
    item_start_[B] = items;
    partials_.resize(static_cast<size_t>(floats));
    part_floats_ = part;
    if (floats > 0) finished_ = std::make_unique<std::atomic<int64_t>[]>(static_cast<size_t>(layers * B * kv_heads));
  }

  int64_t items() const { return item_start_[B_]; }

  Item item(int64_t i) const {
    const int64_t b = std::upper_bound(item_start_.begin(), item_start_.end(), i) - item_start_.begin() - 1;
    const int64_t n = chunks_[b], local = i - item_start_[b];
    const int64_t c = local % n, size = chunk_tokens(lens_[b]);
    return {b, local / n, c, n, n == 1 ? 0 : c * size, n == 1 ? lens_[b] : std::min(lens_[b], (c + 1) * size)};
  }

  // Where chunk it.chunk of (it.b, it.g) leaves its partial result; the chunks of one pair are consecutive.
  float* partial(const Item& it) {
    return partials_.data() + part_start_[it.b] + (it.g * it.chunks + it.chunk) * part_floats_;
  }

  // Records that `it` (a chunk of a split pair, in layer `layer`) is done; true for the last chunk to finish, whose
  // thread then merges. acq_rel: the merging thread sees every other chunk's partial result.
  bool finish_chunk(const Item& it, int64_t layer) {
    auto& done = finished_[(layer * B_ + it.b) * kv_heads_ + it.g];
    return done.fetch_add(1, std::memory_order_acq_rel) == it.chunks - 1;
  }

  // Merges the partial results of (it.b, it.g) into out [group, D].
  void merge(const Item& it, int64_t group, int64_t head_dim, float* out) const {
    const float* first = partials_.data() + part_start_[it.b] + it.g * it.chunks * part_floats_;
    cpu_kernels::merge_partials(first, it.chunks, group, head_dim, out);
  }

 private:
  int64_t B_, kv_heads_;
  const int64_t* lens_;
  std::vector<int64_t> item_start_, chunks_, part_start_;
  std::vector<float> partials_;
  int64_t part_floats_ = 0;
  std::unique_ptr<std::atomic<int64_t>[]> finished_;
};

}  // namespace attention_split

// Where a K/V row lives in a paged buffer [slots, kv_heads, head_dim]: the row of slot s and KV head g starts
// s * slot + g * head elements in. The engine's pool on CPU is head-major ([kv head][slot][channel], slot = head_dim,
// head = slots * head_dim): one head's rows of a sequence lie together, so decode attention, which reads one KV head
// at a time, streams whole cache lines instead of one head's share of each slot's. Slot-major buffers (contiguous
// tensors) work the same way.
#pragma once

#include <cstdint>
#include <utility>

#include "torch_binding.h"

namespace kv_layout {

struct Strides {
  int64_t slot, head;
};

// The strides of K and V buffers of one shape and layout, checked: channels contiguous and no two rows overlapping
// (so that stores to distinct (slot, head) pairs never touch the same element).
inline Strides strides_of(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.strides() == v.strides(),
              "K and V buffers must be [slots, kv_heads, head_dim] tensors of one shape and layout");
  const int64_t slots = k.size(0), heads = k.size(1), dim = k.size(2);
  TORCH_CHECK(k.stride(2) == 1 || dim == 1, "K/V buffers must hold each row's channels contiguously");
  int64_t inner = k.stride(0), outer = k.stride(1), inner_n = slots, outer_n = heads;
  if (inner > outer) {
    std::swap(inner, outer);
    std::swap(inner_n, outer_n);
  }
  const bool rows_apart = inner_n == 1 || inner >= dim;
  const bool blocks_apart = outer_n == 1 || outer >= (inner_n == 1 ? dim : inner * inner_n);
  TORCH_CHECK(rows_apart && blocks_apart, "K/V buffer rows must not overlap");
  return {k.stride(0), k.stride(1)};
}

}  // namespace kv_layout

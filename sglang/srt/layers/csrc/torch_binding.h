// What every CPU extension takes from torch: tensors, at::parallel_for, the pybind11 casters of tensors and a CPU
// empty(), under the torch:: names the sources use. <torch/extension.h> would bring in the whole C++ frontend
// (modules, optimizers, autograd API): ~30 s of parsing per build against ~7 s for these headers, paid by every
// first start on a new machine and by CI.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;  // NOLINT(google-build-using-namespace): as <torch/types.h> does
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat32 = at::kFloat;

// A new uninitialized tensor; every tensor these extensions allocate is on the CPU.
inline at::Tensor empty(c10::IntArrayRef size, const c10::TensorOptions& options) {
  TORCH_CHECK(options.device().is_cpu(), "the CPU extensions allocate CPU tensors only");
  return at::Tensor(at::detail::empty_cpu(size, options));
}
}  // namespace torch

// The argument checks shared by every binding that reads a GGUF K-quant matrix as the file stores it.
#pragma once

#include "../../csrc/torch_binding.h"
#include "gguf_kquant_rows.h"

namespace gguf_kernels {
namespace kquant {

// The bytes of one stored row of a K-quant matrix [N, K] of GGML type `type` (Q2_K-Q6_K), after checking that
// `raw` holds one: a uint8 CPU matrix [N, K / 256 * super-block bytes] whose rows are contiguous (and the whole
// matrix, where `contiguous`), K a positive multiple of 256. `what` names the argument in the error.
inline int64_t checked_matrix(const torch::Tensor& raw, int64_t type, int64_t K, bool contiguous, const char* what) {
  const int64_t bytes = super_block_bytes(static_cast<int>(type));
  TORCH_CHECK(bytes > 0, "GGML type ", type, " is not a K-quant (Q2_K-Q6_K)");
  TORCH_CHECK(K > 0 && K % kSuper == 0, what, ": K-quant rows need a positive multiple of 256 columns, got ", K);
  const int64_t row_bytes = K / kSuper * bytes;
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.size(0) > 0 &&
                  raw.size(1) == row_bytes && raw.stride(1) == 1 && (!contiguous || raw.is_contiguous()),
              what, " must be a uint8 CPU matrix [N > 0, ", row_bytes, "] with contiguous rows",
              contiguous ? ", itself contiguous" : "");
  return row_bytes;
}

}  // namespace kquant
}  // namespace gguf_kernels

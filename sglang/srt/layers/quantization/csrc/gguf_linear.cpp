// Python bindings of the weight-only GGUF Q4_1 / Q8_0 linear kernels (gguf_kernels.h): y = x @ W.T for CPU decode.
#include "../../csrc/torch_binding.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "gguf_dequant_rows.h"
#include "gguf_kernels.h"
#include "gguf_kquant_convert.h"
#include "gguf_kquant_checks.h"
#include "gguf_pack.h"

namespace {

using namespace gguf_kernels;

// Work distribution. A call is split between threads only when each thread gets at least g_min_thread_bytes of
// weight data (counted once per row of x in a tile, up to 8): waking a sleeping OpenMP worker
// (OMP_WAIT_POLICY=PASSIVE) costs roughly 5-25 microseconds, as much as streaming 100-200 KB of Q4_1 weights.
// The row groups are then handed out in chunks of about kChunkBytes from a shared counter rather than split
// statically, so a thread that starts late (woken slowly, or preempted on a busy machine) simply takes fewer
// chunks instead of delaying the whole call by its share.
std::atomic<int64_t> g_min_thread_bytes{128 * 1024};
constexpr int64_t kChunkBytes = 32 * 1024;

// Runs fn(g0, g1) over [0, groups), on one thread or dynamically shared by the torch intra-op threads.
template <typename F>
void for_each_group_range(int64_t groups, int64_t group_bytes, int64_t M, const F& fn) {
  const int64_t work_per_group = std::max<int64_t>(1, group_bytes * std::min<int64_t>(M, kMaxTile));
  const int64_t threads = std::min<int64_t>(
      at::get_num_threads(), groups * work_per_group / std::max<int64_t>(1, g_min_thread_bytes.load()));
  if (threads <= 1 || at::in_parallel_region()) {
    fn(int64_t{0}, groups);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, std::min(kChunkBytes / work_per_group, groups / (4 * threads)));
  const int64_t chunks = (groups + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c * chunk, std::min(groups, (c + 1) * chunk));
    }
  });
}

void check_args(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t K, int64_t block_bytes,
                const char* name) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, ": x must be float32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, name, ": x must have shape [M, K] with K = ", K);
  TORCH_CHECK(x.is_contiguous(), name, ": x must be contiguous");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), name,
              ": packed weights must be a contiguous uint8 tensor");
  TORCH_CHECK(K > 0 && K % kQK == 0, name, ": K must be a positive multiple of 32");
  TORCH_CHECK(N > 0, name, ": N must be positive");
  const int64_t groups = (N + kRows - 1) / kRows;
  TORCH_CHECK(packed.numel() == groups * (K / kQK) * block_bytes, name,
              ": packed weights have the wrong size for N = ", N, ", K = ", K);
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t K, bool q4,
                           bool int8_activations, bool one_term) {
  TORCH_CHECK(int8_activations || !one_term, "one_term needs int8 activations");
  check_args(x, packed, N, K, group_block_bytes(q4), q4 ? "q4_1_linear" : "q8_0_linear");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Scratch for the prepared input, unless each row group is converted once and x read as it is (AVX2, 10+ rows).
  const bool convert = converts_groups(M, int8_activations);
  std::vector<float> panels(convert ? 0 : static_cast<size_t>(panel_floats(M, K)));
  std::vector<float> sums(convert ? 0 : static_cast<size_t>(sum_floats(M, K)));
  const PreparedInput in =
      prepare_input(q4, xp, M, K, panels.data(), sums.data(), int8_activations, convert, one_term);
  const int64_t group_bytes = K / kQK * group_block_bytes(q4);
  for_each_group_range(row_groups(N), group_bytes, M, [&](int64_t g0, int64_t g1) {
    matmul_groups(q4, wp, N, K, M, xp, in, yp, N, g0, g1);
  });
  return y;
}

}  // namespace

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t K, bool int8,
                          bool one_term) {
  return quant_linear(x, packed, N, K, /*q4=*/true, int8, one_term);
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t K, bool int8,
                          bool one_term) {
  return quant_linear(x, packed, N, K, /*q4=*/false, int8, one_term);
}

// Minimum weight bytes per thread before a call is split between threads (see for_each_group_range); returns the
// previous value.
int64_t set_min_thread_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "the minimum bytes per thread must be >= 0");
  return g_min_thread_bytes.exchange(bytes);
}

int64_t get_min_thread_bytes() {
  return g_min_thread_bytes.load();
}

bool has_avx2_path() {
#ifdef GGUF_LINEAR_AVX2
  return true;
#else
  return false;
#endif
}

bool has_int8_vnni_path() {
  return int8_vnni_available();
}

// x[M, K] quantized the way the int8 kernels read it (gguf_int8.h quantize_rows): the words [M, K/32, 2, 8]
// (int32, four int8 values each), the scales [M, K/32, 2] and the sums of the rounded x [M, K/32], in row order.
// `vector` asks for the AVX512 quantizer (an error where it cannot run), otherwise the portable one; `one_term`: the
// one-term form, each row a tile of its own (its outlier columns zero in the blocks).
std::vector<torch::Tensor> int8_quantize(const torch::Tensor& x, bool q4, bool vector, bool one_term) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 CPU matrix");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kQK;
  TORCH_CHECK(K > 0 && K % kQK == 0, "K must be a positive multiple of 32");
  TORCH_CHECK(!vector || int8::avx512_supported(), "the AVX512 quantizer cannot run on this CPU");
  auto words = torch::empty({M, nb, 2, int8::kTermWords}, x.options().dtype(torch::kInt));
  auto dx = torch::empty({M, nb, 2}, x.options());
  auto sx = torch::empty({M, nb}, x.options());
  // One row at a time: a single-row tile is laid out in row order (words, then scales, then sums).
  std::vector<float> scratch(static_cast<size_t>(int8::scratch_floats(1, K)));
  for (int64_t m = 0; m < M; ++m) {
    const int8::QuantizedInput in =
        int8::quantize_rows(q4, x.data_ptr<float>() + m * K, 1, K, scratch.data(), vector, one_term);
    const int64_t row_words = nb * int8::kWordsPerBlock;
    std::copy(in.words, in.words + row_words, words.data_ptr<int32_t>() + m * row_words);
    std::copy(in.dx, in.dx + 2 * nb, dx.data_ptr<float>() + m * 2 * nb);
    std::copy(in.sx, in.sx + nb, sx.data_ptr<float>() + m * nb);
  }
  return {words, dx, sx};
}

bool has_vector_quantize() {
  return int8::avx512_supported();
}

// Rows [row0, row0 + out.size(0)) of the packed weight [N, K] into out, a bf16 or float32 matrix (row0 a multiple of
// 16, the rows within N), split between torch's intra-op threads by row group. `vector`: the AVX2 path where it was
// compiled in.
void dequant_rows(const torch::Tensor& packed, bool q4, int64_t N, int64_t K, int64_t row0, torch::Tensor& out,
                  bool vector) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == torch::kFloat32) && out.is_contiguous() && out.dim() == 2 &&
                  out.size(1) == K,
              "out must be a contiguous bf16 or float32 matrix [rows, K]");
  TORCH_CHECK(K > 0 && K % kQK == 0, "K must be a positive multiple of 32");
  const int64_t rows = out.size(0);
  TORCH_CHECK(row0 >= 0 && row0 % kRows == 0 && row0 + rows <= N, "rows must start at a multiple of 16 within N");
  TORCH_CHECK(packed.numel() == row_groups(N) * (K / kQK) * group_block_bytes(q4), "packed has the wrong size");
  if (rows == 0) return;
  const int64_t g0 = row0 / kRows, g1 = (row0 + rows + kRows - 1) / kRows;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t end = row0 + rows;  // the last group may stop short of 16 rows
  at::parallel_for(g0, g1, 1, [&](int64_t a, int64_t b) {
    const int64_t offset = (a - g0) * kRows * K;
    if (bf16) {
      rows::dequant_groups(q4, wp, end, K, a, b, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + offset,
                           vector);
    } else {
      rows::dequant_groups(q4, wp, end, K, a, b, out.data_ptr<float>() + offset, vector);
    }
  });
}

// The checks of gather_columns and gather_rows: packed weights [N, K] and `index`, a vector of `what` (columns or
// rows) whose entries lie in [0, bound). Returns its entries.
const int64_t* checked_index(const torch::Tensor& packed, bool q4, int64_t N, int64_t K, const torch::Tensor& index,
                             int64_t bound, const char* what) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.dim() == 1 && index.is_contiguous(), what,
              " must be a contiguous int64 vector");
  TORCH_CHECK(K > 0 && K % kQK == 0 && N > 0, "K must be a positive multiple of 32 and N positive");
  TORCH_CHECK(packed.numel() == row_groups(N) * (K / kQK) * group_block_bytes(q4), "packed has the wrong size");
  const int64_t* entries = index.data_ptr<int64_t>();
  for (int64_t j = 0; j < index.size(0); ++j) {
    TORCH_CHECK(entries[j] >= 0 && entries[j] < bound, what, " ", entries[j], " is outside [0, ", bound, ")");
  }
  return entries;
}

// Columns `cols` (int64, each in [0, K)) of the packed weight [N, K] as float32 [N, cols.size(0)] (a transposed view of
// [cols.size(0), N] where the AVX512 path writes it).
torch::Tensor gather_columns(const torch::Tensor& packed, bool q4, int64_t N, int64_t K, const torch::Tensor& cols) {
  const int64_t* cp = checked_index(packed, q4, N, K, cols, K, "column");
  const int64_t ncols = cols.size(0);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
#ifdef GGUF_COLUMNS_AVX512
  if (ncols > 0 && int8::avx512_supported()) {  // written as [ncols, N]: the same values, a transposed view
    auto out_t = torch::empty({ncols, N}, packed.options().dtype(torch::kFloat32));
    float* op = out_t.data_ptr<float>();
    at::parallel_for(0, row_groups(N), 16, [&](int64_t a, int64_t b) {
      (q4 ? rows::gather_columns_t<true> : rows::gather_columns_t<false>)(wp, N, K, cp, ncols, a, b, op);
    });
    return out_t.t();
  }
#endif
  auto out = torch::empty({N, ncols}, packed.options().dtype(torch::kFloat32));
  if (ncols == 0) return out;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, row_groups(N), 1, [&](int64_t a, int64_t b) {
    rows::gather_columns(q4, wp, N, K, cp, ncols, a, b, op + a * kRows * ncols);
  });
  return out;
}

// Rows `ids` (int64, each in [0, N)) of the packed weight [N, K] as float32 [ids.size(0), K]: embedding lookups in a
// table held as blocks.
torch::Tensor gather_rows(const torch::Tensor& packed, bool q4, int64_t N, int64_t K, const torch::Tensor& ids) {
  const int64_t* ip = checked_index(packed, q4, N, K, ids, N, "row");
  const int64_t count = ids.size(0);
  auto out = torch::empty({count, K}, packed.options().dtype(torch::kFloat32));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) rows::gather_row(q4, wp, K, ip[j], op + j * K);
  });
  return out;
}

// Rows `ids` (int64, each in [0, N)) of a stored K-quant matrix (raw: uint8 [N, K / 256 * super-block bytes] as the
// file stores it, GGML type `type`: Q2_K-Q6_K) as float32 [ids.size(0), K]: embedding lookups in the file's table.
torch::Tensor gather_kquant_rows(const torch::Tensor& raw, int64_t type, int64_t K, const torch::Tensor& ids) {
  const int64_t row_bytes = kquant::checked_matrix(raw, type, K, true, "raw");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "row must be a contiguous int64 vector");
  const int64_t N = raw.size(0), count = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < count; ++j) {
    TORCH_CHECK(ip[j] >= 0 && ip[j] < N, "row ", ip[j], " is outside [0, ", N, ")");
  }
  auto out = torch::empty({count, K}, raw.options().dtype(torch::kFloat32));
  const uint8_t* wp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) kquant::dequant_row(static_cast<int>(type), wp + ip[j] * row_bytes, K, op + j * K);
  });
  return out;
}

// A stored K-quant matrix (raw: uint8 [N, K / 256 * super-block bytes], GGML type `type`) as stored Q4_1 blocks
// (q4; Q4_K only) or Q8_0 blocks, uint8 [N, K / 32 * block bytes], by gguf_kquant_convert.h's rules.
torch::Tensor convert_kquant_rows(const torch::Tensor& raw, int64_t type, int64_t K, bool q4) {
  TORCH_CHECK(!q4 || type == kquant::kQ4_K, "only Q4_K converts to Q4_1 blocks");
  kquant::checked_matrix(raw, type, K, false, "raw");
  const int64_t N = raw.size(0), in_stride = raw.stride(0);
  const int64_t out_bytes = K / kQK * (q4 ? kquant::kQ41Bytes : kquant::kQ80Bytes);
  auto out = torch::empty({N, out_bytes}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, N, 16, [&](int64_t a, int64_t b) {
    std::vector<float> values(static_cast<size_t>(K));
    for (int64_t r = a; r < b && ok.load(std::memory_order_relaxed); ++r) {
      const bool done = q4 ? kquant::q4_k_row_as_q4_1(rp + r * in_stride, K, op + r * out_bytes)
                           : kquant::row_as_q8_0(static_cast<int>(type), rp + r * in_stride, K, values.data(),
                                                 op + r * out_bytes);
      if (!done) ok.store(false);
    }
  });
  TORCH_CHECK(ok.load(), q4 ? "a Q4_K scale product exceeds fp16's range"
                            : "a block's values exceed the range of a Q8_0 scale");
  return out;
}

// Stored GGUF matrices (uint8 [rows, K / 32 * stored block bytes] each, GGML type ids `types`: Q4_0 / Q4_1 for
// q4, Q8_0 otherwise) stacked along N, as one packed weight [N, K] (gguf_pack.h).
torch::Tensor pack_blocks(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types, bool q4,
                          int64_t K) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one type per part, at least one part");
  TORCH_CHECK(K > 0 && K % kQK == 0, "K must be a positive multiple of 32");
  std::vector<pack::Part> stored;
  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const torch::Tensor& t = parts[i];
    const int type = static_cast<int>(types[i]);
    TORCH_CHECK(q4 ? (type == pack::kQ4_0 || type == pack::kQ4_1) : type == pack::kQ8_0,
                "part ", i, " has GGML type ", type, ", which is not packed as ", q4 ? "Q4_1" : "Q8_0");
    const int64_t row_bytes = K / kQK * pack::stored_block_bytes(type);
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kUInt8 && t.dim() == 2 && t.size(1) == row_bytes &&
                    t.stride(1) == 1,
                "part ", i, " must be a uint8 CPU matrix [rows, ", row_bytes, "] with contiguous rows");
    TORCH_CHECK(t.size(0) > 0, "part ", i, " has no rows");
    stored.push_back({t.data_ptr<uint8_t>(), t.stride(0), type, t.size(0)});
    N += t.size(0);
  }
  auto out = torch::empty({row_groups(N), K / kQK, kRows * (q4 ? 20 : 34)}, parts[0].options());
  uint8_t* op = out.data_ptr<uint8_t>();
  const pack::Part* sp = stored.data();
  const int64_t np = static_cast<int64_t>(stored.size());
  at::parallel_for(0, row_groups(N), 16, [&](int64_t a, int64_t b) { pack::groups(sp, np, q4, K, a, b, op); });
  return out;
}

bool has_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear,
        "y[M, N] = x[M, K] @ W.T for Q4_1 weights packed in row groups; int8: x quantized to int8 per 32 values "
        "(one_term: in the one-term form)",
        py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("K"), py::arg("int8") = false,
        py::arg("one_term") = false, py::call_guard<py::gil_scoped_release>());
  m.def("q8_0_linear", &q8_0_linear,
        "y[M, N] = x[M, K] @ W.T for Q8_0 weights packed in row groups; int8: x quantized to int8 per 32 values "
        "(one_term: in the one-term form)",
        py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("K"), py::arg("int8") = false,
        py::arg("one_term") = false, py::call_guard<py::gil_scoped_release>());
  m.def("set_min_thread_bytes", &set_min_thread_bytes,
        "minimum weight bytes per thread before a call is split between threads; returns the previous value",
        py::arg("bytes"));
  m.def("get_min_thread_bytes", &get_min_thread_bytes, "current minimum weight bytes per thread");
  m.def("set_dequant_min_rows", &gguf_kernels::set_dequant_min_rows,
        "from how many rows of x a float32 matmul converts each row group once (AVX2; 0: never); returns the "
        "previous value",
        py::arg("rows"));
  m.def("has_avx2_path", &has_avx2_path, "whether the AVX2/FMA/F16C kernels were compiled in");
  m.def("has_int8_vnni_path", &has_int8_vnni_path,
        "whether int8 activations run on the AVX512-VNNI kernels (otherwise on a portable loop)");
  m.def("int8_quantize", &int8_quantize,
        "x[M, K] quantized as the int8 kernels read it: (words [M, K/32, 2, 8] int32, scales [M, K/32, 2], sums "
        "[M, K/32]); vector: the AVX512 quantizer instead of the portable one",
        py::arg("x"), py::arg("q4"), py::arg("vector"), py::arg("one_term") = false);
  m.def("has_vector_quantize", &has_vector_quantize, "whether the AVX512 int8 quantizer can run on this CPU");
  m.def("dequant_rows", &dequant_rows,
        "rows [row0, row0 + out.size(0)) of packed Q4_1 / Q8_0 weights [N, K] into out (bf16 or float32); vector: "
        "the AVX2 path where compiled in",
        py::arg("packed"), py::arg("q4"), py::arg("N"), py::arg("K"), py::arg("row0"), py::arg("out"),
        py::arg("vector") = true, py::call_guard<py::gil_scoped_release>());
  m.def("gather_columns", &gather_columns,
        "columns cols of packed Q4_1 / Q8_0 weights [N, K] as float32 [N, len(cols)]", py::arg("packed"),
        py::arg("q4"), py::arg("N"), py::arg("K"), py::arg("cols"), py::call_guard<py::gil_scoped_release>());
  m.def("gather_rows", &gather_rows, "rows ids of packed Q4_1 / Q8_0 weights [N, K] as float32 [len(ids), K]",
        py::arg("packed"), py::arg("q4"), py::arg("N"), py::arg("K"), py::arg("ids"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gather_kquant_rows", &gather_kquant_rows,
        "rows ids of a stored K-quant matrix (uint8 [N, row bytes], GGML type Q2_K-Q6_K) as float32 [len(ids), K]",
        py::arg("raw"), py::arg("type"), py::arg("K"), py::arg("ids"), py::call_guard<py::gil_scoped_release>());
  m.def("convert_kquant_rows", &convert_kquant_rows,
        "a stored K-quant matrix (uint8 [N, row bytes], GGML type Q2_K-Q6_K) as stored Q4_1 (q4, Q4_K only) or Q8_0 "
        "blocks uint8 [N, K / 32 * block bytes]",
        py::arg("raw"), py::arg("type"), py::arg("K"), py::arg("q4"), py::call_guard<py::gil_scoped_release>());
  m.def("pack_blocks", &pack_blocks,
        "stored GGUF matrices (Q4_0 / Q4_1 packed as Q4_1, Q8_0 as Q8_0; GGML type ids) stacked along N, as packed "
        "row groups uint8 [ceil(N / 16), K / 32, 16 * block bytes]",
        py::arg("parts"), py::arg("types"), py::arg("q4"), py::arg("K"), py::call_guard<py::gil_scoped_release>());
  m.def("has_openmp", &has_openmp, "whether the kernels were compiled with OpenMP (multi-threaded)");
}

// The whole decode step of a Llama-family decoder (pre-norm, RoPE, GQA, SwiGLU; optional QKV bias and per-head
// q/k RMSNorm) in one call, for float32 activations and GGUF Q4_1 / Q8_0 weights on CPU. The paged KV cache may hold
// float32, bf16 or fp8 (kv_types.h): new K/V rows are converted on store, attention converts as it reads.
//
// A decode step of a small model is a few hundred tiny operations: run one by one from Python, dispatch and
// thread wake-ups cost more than the arithmetic. Here one OpenMP team runs every layer, as five phases per layer:
//   A  h = residual (+ previous MLP output); x = RMSNorm(h);  qkv = x @ Wqkv (+ bias)
//   B  per (sequence, KV head): q/k norm, RoPE, store k/v in the paged cache, attention over the sequence (a long
//      sequence as several chunks of its token range, merged by the thread that finishes the last one:
//      attention_split.h). When rows share sequences (`rows_share_sequences`: a speculative verify step, where row
//      i + 1 of a request is the position after row i and attends to the K/V row i stores), B is two phases: first
//      every row's new K/V is normed, rotated and stored (per row and KV head), then the attention items only read,
//      so no row can read a K/V row before it is stored, whatever the thread schedule.
//   C  o = attn @ Wo
//   D  h = residual + o; x = RMSNorm(h);  gate_up = x @ Wgu
//   E  down = (silu(gate) * up) @ Wdown
// A phase is a list of work items (runs of matmul row groups, attention tasks, the residual update) that the
// threads claim from a shared counter; a thread moves on to the next phase once every item of this one is done.
// So there is no barrier that needs every thread: when the OS preempts one thread (the tokenizer and detokenizer
// processes share the cores) before it claims its items, the others take them instead of waiting for it.
// With int8 activations and a tile of 8 rows for every thread, the input of a matmul phase (norms, residual adds,
// SiLU, the int8 quantization) is built once by the team, one work item per tile. Otherwise each thread builds it
// itself, after claiming its first item of that phase (so the input cannot change underneath it). The residual
// stream is double-buffered.
// Rows of LoRA adapters (set_lora_adapter, the `lora_slots` of a step) get their low-rank deltas in the matmul
// phases of the layers' linears: work items of their own ahead of the matmul items (lora_deltas.h).
//
// `forward_tokens` also builds the first layer's input (embedding rows, RoPE rows) from the token ids and
// positions, and, when the stack holds the LM head as GGUF blocks (set_head), ends with the head's matmul as one
// more phase of the same team: a batch-1 step is then one call from token ids to logits, with no Python and no
// second thread team between the layers and the head.
//
// `forward_capture` / `forward_tokens_capture` also hand back what EAGLE drafting reads of the served model: the
// final normed hidden states (the head's input, computed anyway) and the inputs of chosen layers (the residual
// stream entering them), copied into one [B, layers * hidden] tensor where phase A updates the residual. The plain
// calls make no capture tensor and copy nothing.
#include "torch_binding.h"

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "../quantization/csrc/gguf_dequant_rows.h"
#include "../quantization/csrc/gguf_kernels.h"
#include "../quantization/csrc/gguf_kquant_checks.h"
#include "attention_split.h"
#include "cpu_kernels.h"
#include "decode_attention.h"
#include "kv_layout.h"
#include "lora_deltas.h"

namespace {

using gguf_kernels::kQK;
using gguf_kernels::kRows;

// The work items of one phase: `next` hands them out, `done` counts the finished ones.
struct Phase {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // The next item for this thread, or -1 when all n are handed out.
  int64_t claim(int64_t n) {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  }

  void finish() { done.fetch_add(1, std::memory_order_release); }

  // Waits until all n items are finished: spins about as long as a phase lasts, then yields the core.
  void wait(int64_t n) const {
    for (int spins = 0; done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4000) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
};

struct QuantLinear {
  torch::Tensor packed;  // uint8, gguf_kernels layout
  torch::Tensor bias;    // float32 [n], or undefined
  int64_t n = 0;
  int64_t k = 0;
  bool q4 = true;
};

QuantLinear make_linear(const torch::Tensor& packed, int64_t n, int64_t k, const std::string& qtype,
                        const c10::optional<torch::Tensor>& bias, const char* name) {
  TORCH_CHECK(qtype == "Q4_1" || qtype == "Q8_0", name, ": unsupported quantization type ", qtype);
  QuantLinear lin;
  lin.q4 = qtype == "Q4_1";
  lin.n = n;
  lin.k = k;
  TORCH_CHECK(k > 0 && k % kQK == 0 && n > 0, name, ": bad shape");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), name,
              ": packed weights must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(packed.numel() == gguf_kernels::row_groups(n) * (k / kQK) * gguf_kernels::group_block_bytes(lin.q4),
              name, ": packed weights have the wrong size");
  lin.packed = packed;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == n, name,
                ": bias must be contiguous float32 [n]");
    lin.bias = *bias;
  }
  return lin;
}

void check_vector(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 1 &&
                  t.size(0) == n, name, " must be a contiguous float32 CPU tensor of ", n, " elements");
}

// What a step returns: `output` (the logits when it ends with the LM head, else `hidden`), the final normed hidden
// states, and the captured layer inputs (undefined without a capture).
struct StepResult {
  torch::Tensor output, hidden, aux;
};

struct Layer {
  QuantLinear qkv, o, gate_up, down;
  torch::Tensor input_norm, post_norm;
  torch::Tensor q_norm, k_norm;  // per-head norms, or undefined
  torch::Tensor k_cache, v_cache;
  kv_layout::Strides kv{0, 0};
};

// Per-thread scratch for building the input of a matmul and for attention.
struct Scratch {
  std::vector<float> x, panels, sums, scores, tmp, q, k;
};

class DecodeStack {
 public:
  DecodeStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
              int64_t intermediate, double eps, double scale, torch::Tensor final_norm)
      : hidden_(hidden),
        heads_(num_heads),
        kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        rotary_dim_(rotary_dim),
        inter_(intermediate),
        eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    TORCH_CHECK(hidden > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && intermediate > 0, "bad shape");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, "bad rotary_dim");
    check_vector(final_norm, hidden, "final_norm");
    final_norm_ = final_norm;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    lora_bounds_[0] = {0, q_size, q_size + kv_size, q_size + 2 * kv_size};
    lora_bounds_[1] = {0, hidden};
    lora_bounds_[2] = {0, intermediate, 2 * intermediate};
    lora_bounds_[3] = {0, hidden};
    const int64_t in[lora_deltas::kSites] = {hidden, q_size, hidden, intermediate};
    std::copy(in, in + lora_deltas::kSites, lora_in_);
  }

  // A LoRA adapter in `slot` (lora_deltas.h): a, b and masks for the 4 linears of every layer, None where the
  // adapter has no part. The stack keeps the tensors (no copy); a step's rows name slots through lora_slots.
  void set_lora_adapter(int64_t slot, int64_t rank, const std::vector<c10::optional<torch::Tensor>>& a,
                        const std::vector<c10::optional<torch::Tensor>>& b, const std::vector<int64_t>& masks) {
    TORCH_CHECK(slot >= 0 && slot < 4096, "LoRA slot out of range");
    auto adapter = lora_deltas::make_adapter(rank, a, b, masks, num_layers(), lora_in_, lora_bounds_);
    if (static_cast<int64_t>(lora_.size()) <= slot) lora_.resize(static_cast<size_t>(slot + 1));
    lora_[slot] = std::move(adapter);
  }
  void clear_lora_adapter(int64_t slot) {
    if (slot >= 0 && slot < static_cast<int64_t>(lora_.size())) lora_[slot].reset();
  }
  int64_t lora_adapters() const {
    int64_t n = 0;
    for (const auto& a : lora_) n += a != nullptr;
    return n;
  }

  void add_layer(const torch::Tensor& qkv, const std::string& qkv_type, const c10::optional<torch::Tensor>& qkv_bias,
                 const torch::Tensor& o, const std::string& o_type, const c10::optional<torch::Tensor>& o_bias,
                 const torch::Tensor& gate_up, const std::string& gate_up_type,
                 const c10::optional<torch::Tensor>& gate_up_bias, const torch::Tensor& down,
                 const std::string& down_type, const c10::optional<torch::Tensor>& down_bias,
                 const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                 const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm) {
    Layer layer;
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    layer.qkv = make_linear(qkv, q_size + 2 * kv_size, hidden_, qkv_type, qkv_bias, "qkv_proj");
    layer.o = make_linear(o, hidden_, q_size, o_type, o_bias, "o_proj");
    layer.gate_up = make_linear(gate_up, 2 * inter_, hidden_, gate_up_type, gate_up_bias, "gate_up_proj");
    layer.down = make_linear(down, hidden_, inter_, down_type, down_bias, "down_proj");
    check_vector(input_norm, hidden_, "input_layernorm");
    check_vector(post_norm, hidden_, "post_attention_layernorm");
    layer.input_norm = input_norm;
    layer.post_norm = post_norm;
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm go together");
    if (q_norm.has_value()) {
      check_vector(*q_norm, head_dim_, "q_norm");
      check_vector(*k_norm, head_dim_, "k_norm");
      layer.q_norm = *q_norm;
      layer.k_norm = *k_norm;
    }
    layers_.push_back(std::move(layer));
  }

  // The paged K/V buffers of every layer: [slots, num_kv_heads, head_dim] each, all of one dtype (float32,
  // bfloat16, float8_e4m3fn or float8_e5m2) and one layout (slot- or head-major, kv_layout.h).
  void set_kv_cache(const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one K and one V buffer per layer");
    TORCH_CHECK(!k.empty(), "no KV buffers");
    const auto kv_type = k[0].scalar_type();
    TORCH_CHECK(kv_type == torch::kFloat || kv_type == torch::kBFloat16 || kv_type == torch::kFloat8_e4m3fn ||
                    kv_type == torch::kFloat8_e5m2, "KV buffers must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
    for (size_t i = 0; i < layers_.size(); ++i) {
      for (const auto* t : {&k[i], &v[i]}) {
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == kv_type && t->dim() == 3 &&
                        t->size(1) == kv_heads_ && t->size(2) == head_dim_,
                    "KV buffers must be [slots, num_kv_heads, head_dim] tensors of one dtype");
      }
      layers_[i].kv = kv_layout::strides_of(k[i], v[i]);
      layers_[i].k_cache = k[i];
      layers_[i].v_cache = v[i];
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Whether the matmuls quantize their input to int8 per 32-value block (gguf_int8.h) instead of float32.
  void set_int8_activations(bool on) { int8_ = on; }
  bool int8_activations() const { return int8_; }

  // From how many rows the int8 matmuls take their input in the one-term form (gguf_int8_input.h; 0: never). Never
  // in a step whose rows share sequences (a speculative verify step): a tile's rows share its outlier columns, and a
  // verified position must be computed as plain decoding computes it, alone.
  void set_one_term_rows(int64_t rows) {
    TORCH_CHECK(rows >= 0, "one_term_rows must be >= 0");
    one_term_rows_ = rows;
  }
  int64_t one_term_rows() const { return one_term_rows_; }

  // The tables forward_tokens builds the first layer's input from: the embedding table [vocab, hidden] and the
  // half-width RoPE tables [positions, rotary_dim / 2] (RotaryEmbedding.cos_cache / sin_cache), float32. The
  // embedding table may be bf16 (a bf16 checkpoint's table kept as stored): its rows widen to float32 exactly.
  void set_token_tables(const torch::Tensor& embed, const torch::Tensor& cos_half, const torch::Tensor& sin_half) {
    TORCH_CHECK(embed.device().is_cpu() &&
                    (embed.scalar_type() == torch::kFloat || embed.scalar_type() == torch::kBFloat16) &&
                    embed.is_contiguous() && embed.dim() == 2 && embed.size(0) > 0 && embed.size(1) == hidden_,
                "embed must be a contiguous float32 or bf16 CPU table [vocab, hidden]");
    set_rope_tables(cos_half, sin_half);
    embed_ = embed;
    embed_blocks_ = QuantLinear();
    embed_kquant_ = torch::Tensor();
  }

  // As set_token_tables, with the embedding table [vocab, hidden] held as GGUF Q4_1 / Q8_0 blocks (the LM head's of a
  // tied model, or the file's own): each row is read as gguf_dequant_rows.h's gather_row, the dequantized table's row
  // bit for bit.
  void set_token_blocks(const torch::Tensor& packed, int64_t vocab, const std::string& qtype,
                        const torch::Tensor& cos_half, const torch::Tensor& sin_half) {
    QuantLinear blocks = make_linear(packed, vocab, hidden_, qtype, c10::nullopt, "embed");
    set_rope_tables(cos_half, sin_half);
    embed_blocks_ = blocks;
    embed_ = embed_kquant_ = torch::Tensor();
  }

  // As set_token_tables, with the embedding table [vocab, hidden] as a GGUF file stores it in a K-quant type (raw:
  // uint8 [vocab, hidden / 256 * super-block bytes], GGML type Q2_K-Q6_K): each row is read as gguf_kquant_rows.h's
  // dequant_row, the reference dequantization's row bit for bit.
  void set_token_kquant_rows(const torch::Tensor& raw, int64_t type, const torch::Tensor& cos_half,
                             const torch::Tensor& sin_half) {
    gguf_kernels::kquant::checked_matrix(raw, type, hidden_, true, "the K-quant embedding table");
    set_rope_tables(cos_half, sin_half);
    embed_kquant_ = raw;
    embed_kquant_type_ = static_cast<int>(type);
    embed_ = torch::Tensor();
    embed_blocks_ = QuantLinear();
  }
  bool has_token_tables() const {
    return embed_.defined() || embed_blocks_.packed.defined() || embed_kquant_.defined();
  }

  // The LM head [vocab, hidden] as GGUF Q4_1 / Q8_0 blocks; it computes like the layers' linears (int8 activations
  // when they have them).
  void set_head(const torch::Tensor& packed, int64_t vocab, const std::string& qtype) {
    head_ = make_linear(packed, vocab, hidden_, qtype, c10::nullopt, "lm_head");
  }
  bool has_head() const { return head_.packed.defined(); }

  // How many items each matmul phase has per thread. One contiguous run of row groups per thread measured fastest
  // at every batch size (2-9% over four smaller ones at 1-64 rows, also served next to the HTTP and detokenizer
  // processes): each item's start waits on DRAM before the prefetches run ahead, and a long run keeps the hardware
  // prefetcher on one stream. More items let a thread take over work of a preempted one. Any value gives the same
  // bits (every output element is computed by one thread in one order).
  void set_matmul_items_per_thread(int64_t n) {
    TORCH_CHECK(n >= 1, "items per thread must be >= 1");
    items_per_thread_ = n;
  }
  int64_t matmul_items_per_thread() const { return items_per_thread_; }
  // The same for the LM head's phase, 4 by default: the head is a third of a small model's weight bytes, and at 64
  // rows one run per thread measured ~5% slower than the standalone kernel's dynamically shared chunks, 4 items
  // per thread as fast (no difference at 1-32 rows).
  void set_head_items_per_thread(int64_t n) {
    TORCH_CHECK(n >= 1, "items per thread must be >= 1");
    head_items_per_thread_ = n;
  }
  int64_t head_items_per_thread() const { return head_items_per_thread_; }

  // Whether the team builds each int8 matmul input once (where there are enough rows; see shares_input_for) or
  // every thread builds it whole. Both give the same bits; the switch is for tests and benchmarks.
  void set_shared_input(bool on) { share_input_ = on; }
  bool shared_input_enabled() const { return share_input_; }
  // Only the int8 input is worth sharing: quantizing it is most of building it, while the float panels are a
  // copy, which measured no faster built once (the wait for the other tiles costs as much as the copy).
  bool shares_input_for(int64_t batch, int64_t threads) const {
    return share_input_ && int8_ && threads > 1 && tiles(batch) >= threads;
  }

  // x [B, hidden]: the embeddings of the new tokens; cos/sin [B, rotary_dim] (RotaryEmbedding.lookup rows);
  // out_loc [B]: the KV slot of each new token; req_to_token [R, C] with the slots of each sequence in row
  // req_pool_indices[b]; seq_lens [B] including the new token. rows_share_sequences: some rows are later positions
  // of another row's sequence and attend to the K/V it stores in this step (all K/V is stored before any attention
  // then). Returns the final normed hidden states [B, hidden].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& out_loc, const torch::Tensor& req_to_token,
                        const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens,
                        bool rows_share_sequences, const c10::optional<torch::Tensor>& lora_slots) {
    check_inputs(x, cos, sin);
    return step(x, cos, sin, out_loc, req_to_token, req_pool_indices, seq_lens, false, rows_share_sequences,
                lora_slots, nullptr).output;
  }

  // As forward, and copies out the input of each layer in `capture_layers` (ascending indices): the residual stream
  // entering it (layer 0: x), as the layer-by-layer path records it for EAGLE3. Returns (output, hidden, aux): the
  // final normed hidden states twice (there is no head here) and aux [B, len(capture_layers) * hidden], the
  // layers' inputs side by side in layer order.
  StepResult forward_capture(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& out_loc, const torch::Tensor& req_to_token,
                             const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens,
                             bool rows_share_sequences, const c10::optional<torch::Tensor>& lora_slots,
                             const std::vector<int64_t>& capture_layers) {
    check_inputs(x, cos, sin);
    return step(x, cos, sin, out_loc, req_to_token, req_pool_indices, seq_lens, false, rows_share_sequences,
                lora_slots, &capture_layers);
  }

  // As forward, from input_ids [B] and positions [B] (int64) through the tables of set_token_tables: the embedding
  // rows and the full-width RoPE rows ([cos, cos] and [-sin, sin], as RotaryEmbedding.lookup builds them). Returns
  // the logits [B, vocab] when the stack has the LM head, otherwise the final normed hidden states.
  torch::Tensor forward_tokens(const torch::Tensor& input_ids, const torch::Tensor& positions,
                               const torch::Tensor& out_loc, const torch::Tensor& req_to_token,
                               const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens,
                               bool rows_share_sequences, const c10::optional<torch::Tensor>& lora_slots) {
    const auto in = token_inputs(input_ids, positions);
    return step(in[0], in[1], in[2], out_loc, req_to_token, req_pool_indices, seq_lens, has_head(),
                rows_share_sequences, lora_slots, nullptr).output;
  }

  // As forward_tokens, with the capture of forward_capture: (output, hidden, aux), where output is the logits when
  // the stack has the LM head (hidden: the head's input, which the step computes anyway), else the hidden states.
  StepResult forward_tokens_capture(const torch::Tensor& input_ids, const torch::Tensor& positions,
                                    const torch::Tensor& out_loc, const torch::Tensor& req_to_token,
                                    const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens,
                                    bool rows_share_sequences, const c10::optional<torch::Tensor>& lora_slots,
                                    const std::vector<int64_t>& capture_layers) {
    const auto in = token_inputs(input_ids, positions);
    return step(in[0], in[1], in[2], out_loc, req_to_token, req_pool_indices, seq_lens, has_head(),
                rows_share_sequences, lora_slots, &capture_layers);
  }

 private:
  void check_inputs(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) const {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 &&
                    x.size(1) == hidden_, "x must be contiguous float32 [B, hidden]");
    const int64_t B = x.size(0);
    for (const auto* t : {&cos, &sin}) {
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == B &&
                      t->size(1) == rotary_dim_, "cos/sin must be contiguous float32 [B, rotary_dim]");
    }
  }

  void set_rope_tables(const torch::Tensor& cos_half, const torch::Tensor& sin_half) {
    for (const auto* t : {&cos_half, &sin_half}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) > 0 && t->size(1) == rotary_dim_ / 2,
                  "cos_half/sin_half must be contiguous float32 CPU tables [positions, rotary_dim / 2]");
    }
    TORCH_CHECK(cos_half.size(0) == sin_half.size(0), "cos_half and sin_half differ in length");
    cos_half_ = cos_half;
    sin_half_ = sin_half;
  }

  // The first layer's input (x, cos, sin) of forward_tokens, from the token ids and positions.
  std::array<torch::Tensor, 3> token_inputs(const torch::Tensor& input_ids, const torch::Tensor& positions) const {
    TORCH_CHECK(has_token_tables(), "the decode stack has no token tables (set_token_tables)");
    for (const auto* t : {&input_ids, &positions}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kLong && t->is_contiguous() && t->dim() == 1,
                  "input_ids and positions must be contiguous int64 CPU vectors");
    }
    const int64_t B = input_ids.size(0), half = rotary_dim_ / 2;
    TORCH_CHECK(positions.size(0) == B, "input_ids and positions differ in length");
    const bool blocks = embed_blocks_.packed.defined(), kquant = embed_kquant_.defined();
    const int64_t vocab = blocks ? embed_blocks_.n : kquant ? embed_kquant_.size(0) : embed_.size(0);
    const int64_t table_len = cos_half_.size(0);
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const auto options = cos_half_.options();
    auto x = torch::empty({B, hidden_}, options);
    auto cos = torch::empty({B, rotary_dim_}, options);
    auto sin = torch::empty({B, rotary_dim_}, options);
    const bool bf16_table = !blocks && !kquant && embed_.scalar_type() == torch::kBFloat16;
    const float* embed = blocks || kquant || bf16_table ? nullptr : embed_.data_ptr<float>();
    const uint16_t* embed_bf16 = bf16_table ? reinterpret_cast<const uint16_t*>(embed_.data_ptr()) : nullptr;
    const uint8_t* embed_packed = blocks ? embed_blocks_.packed.data_ptr<uint8_t>() : nullptr;
    const float* ch = cos_half_.data_ptr<float>();
    const float* sh = sin_half_.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    float* cp = cos.data_ptr<float>();
    float* sp = sin.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ids[b] >= 0 && ids[b] < vocab, "token id out of range");
      TORCH_CHECK(pos[b] >= 0 && pos[b] < table_len, "position out of range of the RoPE table");
      if (blocks) {
        gguf_kernels::rows::gather_row(embed_blocks_.q4, embed_packed, hidden_, ids[b], xp + b * hidden_);
      } else if (kquant) {
        gguf_kernels::kquant::dequant_row(embed_kquant_type_, embed_kquant_.data_ptr<uint8_t>() + ids[b] *
                                          embed_kquant_.size(1), hidden_, xp + b * hidden_);
      } else if (bf16_table) {
        const uint16_t* row = embed_bf16 + ids[b] * hidden_;
        float* out = xp + b * hidden_;
        for (int64_t j = 0; j < hidden_; ++j) {
          const uint32_t bits = static_cast<uint32_t>(row[j]) << 16;
          std::memcpy(out + j, &bits, sizeof(float));
        }
      } else {
        std::copy(embed + ids[b] * hidden_, embed + (ids[b] + 1) * hidden_, xp + b * hidden_);
      }
      const float* c = ch + pos[b] * half;
      const float* sn = sh + pos[b] * half;
      for (int64_t j = 0; j < half; ++j) {
        cp[b * rotary_dim_ + j] = cp[b * rotary_dim_ + half + j] = c[j];
        sp[b * rotary_dim_ + j] = -sn[j];
        sp[b * rotary_dim_ + half + j] = sn[j];
      }
    }
    return {x, cos, sin};
  }

  // The capture's column block of each layer (-1: not captured), from ascending layer indices.
  std::vector<int64_t> capture_blocks(const std::vector<int64_t>& layers) const {
    std::vector<int64_t> block(layers_.size(), -1);
    for (size_t j = 0; j < layers.size(); ++j) {
      TORCH_CHECK(layers[j] >= 0 && layers[j] < num_layers(), "capture layer ", layers[j], " out of range");
      TORCH_CHECK(j == 0 || layers[j] > layers[j - 1], "capture layers must be ascending and distinct");
      block[static_cast<size_t>(layers[j])] = static_cast<int64_t>(j);
    }
    return block;
  }

  // `capture`: the layers whose inputs are copied out (null: no capture, and no aux tensor is made).
  StepResult step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                  const torch::Tensor& out_loc, const torch::Tensor& req_to_token,
                  const torch::Tensor& req_pool_indices, const torch::Tensor& seq_lens, bool with_head,
                  bool rows_share_sequences, const c10::optional<torch::Tensor>& lora_slots,
                  const std::vector<int64_t>* capture) {
    TORCH_CHECK(!layers_.empty() && layers_[0].k_cache.defined(), "the decode stack has no layers or KV buffers");
    const std::vector<int64_t> aux_block = capture != nullptr ? capture_blocks(*capture) : std::vector<int64_t>();
    const int64_t B = x.size(0);
    for (const auto* t : {&out_loc, &req_pool_indices, &seq_lens}) {
      TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == B,
                  "out_loc, req_pool_indices and seq_lens must be contiguous int64 [B]");
    }
    TORCH_CHECK(req_to_token.scalar_type() == torch::kLong && req_to_token.is_contiguous() && req_to_token.dim() == 2,
                "req_to_token must be a contiguous int64 table");
    auto out = torch::empty({B, hidden_}, x.options());
    auto logits = with_head ? torch::empty({B, head_.n}, x.options()) : out;
    const int64_t aux_cols = capture != nullptr ? static_cast<int64_t>(capture->size()) * hidden_ : 0;
    const StepResult result{logits, out,
                            capture != nullptr ? torch::empty({B, aux_cols}, x.options()) : torch::Tensor()};
    if (B == 0) return result;

    const int64_t num_slots = layers_[0].k_cache.size(0);
    const int64_t table_rows = req_to_token.size(0), table_cols = req_to_token.size(1);
    const int64_t* loc = out_loc.data_ptr<int64_t>();
    const int64_t* rpi = req_pool_indices.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* table = req_to_token.data_ptr<int64_t>();
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(rpi[b] >= 0 && rpi[b] < table_rows, "request pool index out of range");
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= table_cols, "bad sequence length");
      TORCH_CHECK(loc[b] >= 0 && loc[b] < num_slots, "KV slot out of range");
      const int64_t* slots = table + rpi[b] * table_cols;
      for (int64_t t = 0; t < lens[b]; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "KV slot out of range");
      max_len = std::max(max_len, lens[b]);
    }

    Step s;
    s.B = B;
    s.x = x.data_ptr<float>();
    s.cos = cos.data_ptr<float>();
    s.sin = sin.data_ptr<float>();
    s.loc = loc;
    s.rpi = rpi;
    s.lens = lens;
    s.table = table;
    s.table_cols = table_cols;
    s.max_len = max_len;
    const int64_t qkv_n = layers_[0].qkv.n;
    s.res[0] = torch::empty({B, hidden_}, x.options());
    s.res[1] = torch::empty({B, hidden_}, x.options());
    s.qkv = torch::empty({B, qkv_n}, x.options());
    s.attn = torch::empty({B, heads_ * head_dim_}, x.options());
    s.o = torch::empty({B, hidden_}, x.options());
    s.gate_up = torch::empty({B, 2 * inter_}, x.options());
    s.down = torch::empty({B, hidden_}, x.options());
    s.out = out.data_ptr<float>();
    s.logits = with_head ? logits.data_ptr<float>() : nullptr;
    if (aux_cols > 0) {
      s.aux = result.aux.data_ptr<float>();
      s.aux_cols = aux_cols;
      s.aux_block = aux_block.data();
    }
    s.phases = std::make_unique<Phase[]>(kPhasesPerLayer * layers_.size() + 2);
    s.split = std::make_unique<attention_split::Plan>(lens, B, kv_heads_, heads_ / kv_heads_, head_dim_, num_layers());
    if (rows_share_sequences) s.store_phases = std::make_unique<Phase[]>(layers_.size());
    s.one_term = int8_ && one_term_rows_ > 0 && B >= one_term_rows_ && !rows_share_sequences;
    std::unique_ptr<lora_deltas::StepLora> lora;
    if (lora_slots.has_value() && lora_slots->defined()) {
      TORCH_CHECK(lora_slots->device().is_cpu() && lora_slots->scalar_type() == torch::kLong &&
                      lora_slots->is_contiguous() && lora_slots->dim() == 1 && lora_slots->size(0) == B,
                  "lora_slots must be a contiguous int64 CPU vector [B]");
      lora = std::make_unique<lora_deltas::StepLora>(lora_slots->data_ptr<int64_t>(), B, lora_);
      if (!lora->empty()) s.lora = lora.get();
    }

#ifdef _OPENMP
    if (!omp_in_parallel()) s.threads = std::max(1, at::get_num_threads());
#endif
    if (shared_input(s)) {
      const int64_t max_k = std::max({hidden_, inter_, heads_ * head_dim_});
      s.xin.resize(static_cast<size_t>(B * max_k));
      s.panels.resize(static_cast<size_t>(gguf_kernels::panel_floats(B, max_k)));
      s.sums.resize(static_cast<size_t>(gguf_kernels::sum_floats(B, max_k)));
    }
#ifdef _OPENMP
    if (s.threads > 1) {
#pragma omp parallel num_threads(s.threads)
      run(s);
      return result;
    }
#endif
    run(s);
    return result;
  }

  static constexpr size_t kPhasesPerLayer = 5;

  struct Step {
    int64_t B = 0;
    const float* x = nullptr;
    const float* cos = nullptr;
    const float* sin = nullptr;
    const int64_t* loc = nullptr;
    const int64_t* rpi = nullptr;
    const int64_t* lens = nullptr;
    const int64_t* table = nullptr;
    int64_t table_cols = 0;
    int64_t max_len = 1;
    torch::Tensor res[2], qkv, attn, o, gate_up, down;
    float* out = nullptr;
    float* logits = nullptr;  // the LM head's output, when the step ends with it
    // Captured layer inputs (forward_capture): [B, aux_cols]; layer i's at column block aux_block[i] (-1: none).
    // Null when nothing is captured.
    float* aux = nullptr;
    int64_t aux_cols = 0;
    const int64_t* aux_block = nullptr;
    int threads = 1;  // the team size asked for: sizes the matmul chunks identically in every thread
    std::unique_ptr<Phase[]> phases;
    std::unique_ptr<attention_split::Plan> split;
    // One K/V store phase per layer, ahead of its attention items, when rows share sequences (null otherwise).
    std::unique_ptr<Phase[]> store_phases;
    bool one_term = false;  // the int8 matmuls' input in the one-term form (set_one_term_rows)
    // The input of the current matmul phase and its prepared form, when the team builds it once (shared_input).
    std::vector<float> xin, panels, sums;
    lora_deltas::StepLora* lora = nullptr;  // the rows' LoRA adapters; null when no row has one
  };

  // Row groups per matmul item: items_per_thread_ items per thread (head_items_per_thread_ for the LM head).
  int64_t matmul_chunk(const Step& s, const QuantLinear& lin) const {
    const int64_t items = &lin == &head_ ? head_items_per_thread_ : items_per_thread_;
    return std::max<int64_t>(1, gguf_kernels::row_groups(lin.n) / (items * s.threads));
  }

  int64_t matmul_items(const Step& s, const QuantLinear& lin) const {
    const int64_t chunk = matmul_chunk(s, lin);
    return (gguf_kernels::row_groups(lin.n) + chunk - 1) / chunk;
  }

  // How many LoRA h items (lora_deltas.h) the matmul phase of linear `site` has: 0 without adapter rows.
  static int64_t lora_items(const Step& s, int64_t site) {
    return s.lora != nullptr && site >= 0 ? s.lora->h_items(site) : 0;
  }

  // y = input @ W.T (+ bias) for the chunks of row groups this thread claims, starting with `item` (-1: none).
  // Items from `first` are first the `site`'s LoRA h items (lora_items), then the matmul items (the caller handles
  // the items below `first` before calling this); `prepare` gives the input as the kernels read it, called once,
  // after the first successful claim. With LoRA h items, a matmul item adds the deltas of its output rows once they
  // are all done: no matmul item finishes before that, so `done` reaching first + h items says so.
  template <typename Prepare>
  void matmul_items_loop(const Step& s, Phase& ph, int64_t n_items, int64_t first, const QuantLinear& lin,
                         Prepare&& prepare, float* y, int64_t item, int64_t site) const {
    const int64_t M = s.B;
    const int64_t lora_h = lora_items(s, site);
    first += lora_h;
    const int64_t groups = gguf_kernels::row_groups(lin.n);
    const int64_t chunk = matmul_chunk(s, lin);
    const uint8_t* w = lin.packed.data_ptr<uint8_t>();
    const float* bias = lin.bias.defined() ? lin.bias.data_ptr<float>() : nullptr;
    gguf_kernels::PreparedInput in{nullptr, nullptr};
    const float* input = nullptr;  // never null once prepared
    for (; item >= 0; item = ph.claim(n_items)) {
      if (input == nullptr) input = prepare(in);
      if (item < first) {
        s.lora->h_item(site, item - (first - lora_h), input, lin.k);
        ph.finish();
        continue;
      }
      const int64_t g0 = (item - first) * chunk, g1 = std::min(groups, g0 + chunk);
      const int64_t n0 = g0 * kRows, n1 = std::min(lin.n, g1 * kRows);
      gguf_kernels::matmul_groups(lin.q4, w, lin.n, lin.k, M, input, in, y, lin.n, g0, g1);
      if (bias != nullptr) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = n0; j < n1; ++j) y[m * lin.n + j] += bias[j];
      }
      if (lora_h > 0) {
        ph.wait(first);
        s.lora->add_deltas(site, lora_bounds_[site % lora_deltas::kSites], n0, n1, y, lin.n);
      }
      ph.finish();
    }
  }

  // Whether a matmul phase builds its input once, shared by the team (one item per tile of rows), instead of in
  // every thread.
  bool shared_input(const Step& s) const { return shares_input_for(s.B, s.threads); }

  static int64_t tiles(int64_t B) { return (B + gguf_kernels::kPrepareTile - 1) / gguf_kernels::kPrepareTile; }

  // A matmul phase y = input @ W.T, where `build_rows(m0, mt, xin)` writes rows [m0, m0 + mt) of the input into
  // xin (row stride lin.k) and returns the full input (xin, or a matrix it leaves as it is).
  //  - shared (shared_input): items [0, tiles) each build a tile of rows and lay it out for the kernels in the
  //    step's buffers; a thread that claims a matmul item waits until every tile is done (no matmul item can finish
  //    before that, so `done` reaching the tile count says so). Quantizing a 64-row input in every thread was 7%
  //    of the step.
  //  - otherwise every thread builds the whole input into its own scratch once it has claimed a matmul item, and
  //    `item0` (when given) is one more item, first, that the phase runs (the residual update).
  // `site` (layer * 4 + linear, -1 for the LM head) names the linear's LoRA parts.
  template <typename BuildRows, typename Item0>
  void input_matmul_phase(Step& s, Phase& ph, const QuantLinear& lin, BuildRows&& build_rows, Item0&& item0,
                          bool has_item0, Scratch& sc, float* y, int64_t site) const {
    const int64_t B = s.B, K = lin.k;
    if (shared_input(s)) {
      const int64_t T = tiles(B), n = T + lora_items(s, site) + matmul_items(s, lin);
      float* xin = s.xin.data();
      float* panels = s.panels.data();
      float* sums = s.sums.data();
      int64_t item = ph.claim(n);
      const float* input = nullptr;
      for (; item >= 0 && item < T; item = ph.claim(n)) {
        const int64_t m0 = item * gguf_kernels::kPrepareTile;
        input = build_rows(m0, std::min(gguf_kernels::kPrepareTile, B - m0), xin);
        gguf_kernels::prepare_tile(lin.q4, input, B, K, m0, panels, sums, int8_, s.one_term);
        ph.finish();
      }
      auto prepare = [&](gguf_kernels::PreparedInput& in) -> const float* {
        ph.wait(T);
        if (input == nullptr) input = build_rows(0, 0, xin);  // no rows: just where the input lives
        in = gguf_kernels::prepared_view(lin.q4, input, B, K, panels, sums, int8_, s.one_term);
        return input;
      };
      matmul_items_loop(s, ph, n, T, lin, prepare, y, item, site);
      ph.wait(n);
      return;
    }
    const int64_t first = has_item0 ? 1 : 0;
    const int64_t n = first + lora_items(s, site) + matmul_items(s, lin);
    int64_t item = ph.claim(n);
    if (item == 0 && has_item0) {
      item0();
      ph.finish();
      item = ph.claim(n);
    }
    auto prepare = [&](gguf_kernels::PreparedInput& in) -> const float* {
      sc.x.resize(static_cast<size_t>(B * K));
      const float* input = build_rows(0, B, sc.x.data());
      const bool convert = gguf_kernels::converts_groups(B, int8_);
      if (!convert) {
        sc.panels.resize(static_cast<size_t>(gguf_kernels::panel_floats(B, K)));
        sc.sums.resize(static_cast<size_t>(gguf_kernels::sum_floats(B, K)));
      }
      in = gguf_kernels::prepare_input(lin.q4, input, B, K, sc.panels.data(), sc.sums.data(), int8_, convert,
                                       s.one_term);
      return input;
    };
    matmul_items_loop(s, ph, n, first, lin, prepare, y, item, site);
    ph.wait(n);
  }

  // A matmul phase on an input that is there already (or built per row by `build_rows`, see input_matmul_phase).
  template <typename BuildRows>
  void matmul_phase(Step& s, Phase& ph, const QuantLinear& lin, BuildRows&& build_rows, Scratch& sc, float* y,
                    int64_t site) const {
    input_matmul_phase(s, ph, lin, build_rows, [] {}, false, sc, y, site);
  }

  // A phase on RMSNorm(res + add) with the residual updated on the way (res_out = res + add); with add == nullptr
  // there is no update and the input is RMSNorm(res). The shared form updates the residual tile by tile, the
  // per-thread form as one item of its own. `cap` (row stride s.aux_cols; null: off) receives the residual stream
  // before the norm (res + add, or res): the layer's input, as the layer-by-layer path captures it for EAGLE3. It is
  // written where the residual update is, by the tile's item or by the update item, so each row once.
  void norm_matmul_phase(Step& s, Phase& ph, const float* res, const float* add, float* res_out,
                         const torch::Tensor& norm, const QuantLinear& lin, Scratch& sc, float* y, int64_t site,
                         float* cap) const {
    const bool shared = shared_input(s);
    auto capture_rows = [&](const float* from, int64_t m0, int64_t mt) {
      for (int64_t m = m0; m < m0 + mt; ++m)
        std::copy(from + m * hidden_, from + (m + 1) * hidden_, cap + m * s.aux_cols);
    };
    auto build_rows = [&](int64_t m0, int64_t mt, float* xin) -> const float* {
      const int64_t i0 = m0 * hidden_, i1 = (m0 + mt) * hidden_;
      float* x = xin + i0;
      if (add != nullptr) {
        for (int64_t i = i0; i < i1; ++i) xin[i] = res[i] + add[i];
        if (shared) std::copy(xin + i0, xin + i1, res_out + i0);
      } else {
        std::copy(res + i0, res + i1, x);
      }
      if (shared && cap != nullptr) capture_rows(xin, m0, mt);
      cpu_kernels::rms_norm_rows(x, norm.data_ptr<float>(), x, mt, hidden_, eps_);
      return xin;
    };
    auto update = [&] {
      if (add != nullptr) {
        const int64_t rows = s.B * hidden_;
        for (int64_t i = 0; i < rows; ++i) res_out[i] = res[i] + add[i];
      }
      if (cap != nullptr) capture_rows(add != nullptr ? res_out : res, 0, s.B);
    };
    input_matmul_phase(s, ph, lin, build_rows, update, add != nullptr || cap != nullptr, sc, y, site);
  }

  // Where layer `index`'s captured input goes (its column block of s.aux), or null when it is not captured.
  float* capture_of(const Step& s, int64_t index) const {
    if (s.aux == nullptr || s.aux_block[index] < 0) return nullptr;
    return s.aux + s.aux_block[index] * hidden_;
  }

  void attention_phase(const Step& s, Phase& ph, const Layer& layer, Scratch& sc) const {
    switch (layer.k_cache.scalar_type()) {
      case torch::kBFloat16: attention_items<kv_types::bf16>(s, ph, layer, sc); break;
      case torch::kFloat8_e4m3fn: attention_items<kv_types::e4m3>(s, ph, layer, sc); break;
      case torch::kFloat8_e5m2: attention_items<kv_types::e5m2>(s, ph, layer, sc); break;
      default: attention_items<float>(s, ph, layer, sc);
    }
  }

  // Norms, rotates and stores row b's new K/V for KV head g (k: D floats of scratch).
  template <typename KV>
  void store_kv(const Step& s, const Layer& layer, int64_t b, int64_t g, float* k, float* tmp) const {
    const int64_t D = head_dim_, q_size = heads_ * D, kv_size = kv_heads_ * D;
    const kv_layout::Strides kv = layer.kv;
    const float* row = s.qkv.data_ptr<float>() + b * layer.qkv.n;
    const float* cs = s.cos + b * rotary_dim_;
    const float* sn = s.sin + b * rotary_dim_;
    KV* kg = static_cast<KV*>(layer.k_cache.data_ptr()) + g * kv.head;
    KV* vg = static_cast<KV*>(layer.v_cache.data_ptr()) + g * kv.head;
    std::copy(row + q_size + g * D, row + q_size + (g + 1) * D, k);
    if (layer.k_norm.defined()) cpu_kernels::rms_norm_rows(k, layer.k_norm.data_ptr<float>(), k, 1, D, eps_);
    if (rotary_dim_ > 0) cpu_kernels::rope_head(k, cs, sn, rotary_dim_, tmp);
    const int64_t slot = s.loc[b];
    kv_types::store_row(k, kg + slot * kv.slot, D);
    kv_types::store_row(row + q_size + kv_size + g * D, vg + slot * kv.slot, D);
  }

  // Phase B with the layer's K/V stored as KV. The query and new key are normed and rotated in thread scratch:
  // the chunks of a split sequence read the same qkv row at the same time. Without store phases each row's K/V is
  // stored by the item over its last tokens; with them (rows sharing sequences) every row's K/V is stored first,
  // one item per (row, KV head), and the attention items only read the cache.
  template <typename KV>
  void attention_items(const Step& s, Phase& ph, const Layer& layer, Scratch& sc) const {
    const int64_t D = head_dim_, group = heads_ / kv_heads_;
    const int64_t q_size = heads_ * D, qkv_n = layer.qkv.n;
    const kv_layout::Strides kv = layer.kv;
    const int64_t layer_index = &layer - layers_.data();
    const float* qkv = s.qkv.data_ptr<float>();
    float* attn = s.attn.data_ptr<float>();
    KV* kc = static_cast<KV*>(layer.k_cache.data_ptr());
    KV* vc = static_cast<KV*>(layer.v_cache.data_ptr());
    const float* qn = layer.q_norm.defined() ? layer.q_norm.data_ptr<float>() : nullptr;
    attention_split::Plan& plan = *s.split;
    sc.scores.resize(static_cast<size_t>(group * (s.max_len + 2)));
    sc.tmp.resize(static_cast<size_t>(std::max<int64_t>(rotary_dim_, 1)));
    sc.q.resize(static_cast<size_t>(group * D));
    sc.k.resize(static_cast<size_t>(D));
    float* q = sc.q.data();
    const bool stored_first = s.store_phases != nullptr;
    if (stored_first) {
      Phase& store = s.store_phases[layer_index];
      const int64_t n = s.B * kv_heads_;
      for (int64_t i = store.claim(n); i >= 0; i = store.claim(n)) {
        store_kv<KV>(s, layer, i / kv_heads_, i % kv_heads_, sc.k.data(), sc.tmp.data());
        store.finish();
      }
      store.wait(n);
    }
    const int64_t tasks = plan.items();
    for (int64_t task = ph.claim(tasks); task >= 0; task = ph.claim(tasks)) {
      const attention_split::Item it = plan.item(task);
      const int64_t b = it.b, g = it.g;
      KV* kg = kc + g * kv.head;  // KV head g's rows
      KV* vg = vc + g * kv.head;
      const float* row = qkv + b * qkv_n;
      const float* cs = s.cos + b * rotary_dim_;
      const float* sn = s.sin + b * rotary_dim_;
      std::copy(row + g * group * D, row + (g + 1) * group * D, q);
      if (qn != nullptr) cpu_kernels::rms_norm_rows(q, qn, q, group, D, eps_);
      for (int64_t h = 0; h < group && rotary_dim_ > 0; ++h)
        cpu_kernels::rope_head(q + h * D, cs, sn, rotary_dim_, sc.tmp.data());
      if (!stored_first && it.chunk == it.chunks - 1) {
        // The new token is the last of its sequence: only the item over the last tokens reads its K/V row.
        store_kv<KV>(s, layer, b, g, sc.k.data(), sc.tmp.data());
      }
      const int64_t* slots = s.table + s.rpi[b] * s.table_cols + it.t0;
      float* out = attn + b * q_size + g * group * D;
      if (it.chunks == 1) {
        cpu_kernels::attend_kv_head(q, group, D, kg, vg, kv.slot, slots, it.t1 - it.t0, scale_, sc.scores.data(), out);
      } else {
        float* part = plan.partial(it);
        cpu_kernels::attend_partial(q, group, D, kg, vg, kv.slot, slots, it.t1 - it.t0, scale_, sc.scores.data(), part,
                                    part + group * D, part + group * D + group);
        if (plan.finish_chunk(it, layer_index)) plan.merge(it, group, D, out);
      }
      ph.finish();
    }
    ph.wait(tasks);
  }

  void run(Step& s) const {
    Scratch sc;
    const int64_t B = s.B;
    const float* res = s.x;  // the residual stream; layer 0 starts from the embeddings
    int next = 0;            // which of s.res receives the next residual
    const float* mlp_out = nullptr;
    size_t phase = 0;
    float* qkv = s.qkv.data_ptr<float>();
    float* attn = s.attn.data_ptr<float>();
    float* o = s.o.data_ptr<float>();
    float* gate_up = s.gate_up.data_ptr<float>();
    float* down = s.down.data_ptr<float>();
    for (const Layer& layer : layers_) {
      const int64_t site = (&layer - layers_.data()) * lora_deltas::kSites;  // its qkv_proj's LoRA site
      // A: residual update, norm, QKV projection
      float* res_out = s.res[next].data_ptr<float>();
      norm_matmul_phase(s, s.phases[phase++], res, mlp_out, res_out, layer.input_norm, layer.qkv, sc, qkv, site,
                        capture_of(s, &layer - layers_.data()));
      if (mlp_out != nullptr) {
        res = res_out;
        next ^= 1;
      }
      // B: attention
      attention_phase(s, s.phases[phase++], layer, sc);
      // C: output projection
      matmul_phase(s, s.phases[phase++], layer.o, [&](int64_t, int64_t, float*) -> const float* { return attn; },
                   sc, o, site + 1);
      // D: residual update, norm, gate/up projection
      res_out = s.res[next].data_ptr<float>();
      norm_matmul_phase(s, s.phases[phase++], res, o, res_out, layer.post_norm, layer.gate_up, sc, gate_up,
                        site + 2, nullptr);
      res = res_out;
      next ^= 1;
      // E: SwiGLU, down projection
      auto activation = [&](int64_t m0, int64_t mt, float* act) -> const float* {
        for (int64_t m = m0; m < m0 + mt; ++m) {
          const float* gu = gate_up + m * 2 * inter_;
          cpu_kernels::silu_mul(gu, gu + inter_, act + m * inter_, inter_);
        }
        return act;
      };
      matmul_phase(s, s.phases[phase++], layer.down, activation, sc, down, site + 3);
      mlp_out = down;
    }
    // Final residual add and norm, one row per item.
    Phase& ph = s.phases[phase];
    const float* w = final_norm_.data_ptr<float>();
    for (int64_t m = ph.claim(B); m >= 0; m = ph.claim(B)) {
      float* orow = s.out + m * hidden_;
      for (int64_t i = 0; i < hidden_; ++i) orow[i] = res[m * hidden_ + i] + mlp_out[m * hidden_ + i];
      cpu_kernels::rms_norm_rows(orow, w, orow, 1, hidden_, eps_);
      ph.finish();
    }
    ph.wait(B);
    if (s.logits != nullptr) {
      matmul_phase(s, s.phases[phase + 1], head_, [&](int64_t, int64_t, float*) -> const float* { return s.out; },
                   sc, s.logits, -1);
    }
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, rotary_dim_, inter_;
  float eps_, scale_;
  bool int8_ = false;
  int64_t one_term_rows_ = 0;
  bool share_input_ = true;
  int64_t items_per_thread_ = 1;
  int64_t head_items_per_thread_ = 4;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
  torch::Tensor embed_, cos_half_, sin_half_;  // forward_tokens' tables (undefined until set_token_tables)
  QuantLinear embed_blocks_;                   // or the embedding table as blocks (set_token_blocks)
  torch::Tensor embed_kquant_;                 // or as a file's K-quant rows (set_token_kquant_rows) ...
  int embed_kquant_type_ = 0;                  // ... of this GGML type
  QuantLinear head_;                           // the LM head (packed undefined until set_head)
  // LoRA: the adapters by slot (null: free), and each site kind's input width and shard output bounds.
  std::vector<std::shared_ptr<const lora_deltas::Adapter>> lora_;
  int64_t lora_in_[lora_deltas::kSites] = {};
  lora_deltas::ShardBounds lora_bounds_[lora_deltas::kSites];
};

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> as_tuple(const StepResult& r) {
  return {r.output, r.hidden, r.aux};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, torch::Tensor>(),
           py::arg("hidden_size"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("rotary_dim"), py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"),
           py::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("qkv"), py::arg("qkv_type"), py::arg("qkv_bias"),
           py::arg("o"), py::arg("o_type"), py::arg("o_bias"), py::arg("gate_up"), py::arg("gate_up_type"),
           py::arg("gate_up_bias"), py::arg("down"), py::arg("down_type"), py::arg("down_bias"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"))
      .def("set_kv_cache", &DecodeStack::set_kv_cache, py::arg("k"), py::arg("v"))
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_int8_activations", &DecodeStack::set_int8_activations, py::arg("on"))
      .def("int8_activations", &DecodeStack::int8_activations)
      .def("set_one_term_rows", &DecodeStack::set_one_term_rows, py::arg("rows"))
      .def("one_term_rows", &DecodeStack::one_term_rows)
      .def("set_matmul_items_per_thread", &DecodeStack::set_matmul_items_per_thread, py::arg("n"))
      .def("matmul_items_per_thread", &DecodeStack::matmul_items_per_thread)
      .def("set_head_items_per_thread", &DecodeStack::set_head_items_per_thread, py::arg("n"))
      .def("head_items_per_thread", &DecodeStack::head_items_per_thread)
      .def("set_shared_input", &DecodeStack::set_shared_input, py::arg("on"))
      .def("shared_input", &DecodeStack::shared_input_enabled)
      .def("shares_input_for", &DecodeStack::shares_input_for, py::arg("batch"), py::arg("threads"),
           "whether a step of `batch` sequences on `threads` threads builds each (int8) matmul input once for the team")
      .def("forward", &DecodeStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out_loc"),
           py::arg("req_to_token"), py::arg("req_pool_indices"), py::arg("seq_lens"),
           py::arg("rows_share_sequences") = false, py::arg("lora_slots") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_lora_adapter", &DecodeStack::set_lora_adapter, py::arg("slot"), py::arg("rank"), py::arg("a"),
           py::arg("b"), py::arg("masks"))
      .def("clear_lora_adapter", &DecodeStack::clear_lora_adapter, py::arg("slot"))
      .def("lora_adapters", &DecodeStack::lora_adapters)
      .def("set_token_tables", &DecodeStack::set_token_tables, py::arg("embed"), py::arg("cos_half"),
           py::arg("sin_half"))
      .def("set_token_blocks", &DecodeStack::set_token_blocks, py::arg("packed"), py::arg("vocab"), py::arg("qtype"),
           py::arg("cos_half"), py::arg("sin_half"))
      .def("set_token_kquant_rows", &DecodeStack::set_token_kquant_rows, py::arg("raw"), py::arg("type"),
           py::arg("cos_half"), py::arg("sin_half"))
      .def("has_token_tables", &DecodeStack::has_token_tables)
      .def("set_head", &DecodeStack::set_head, py::arg("packed"), py::arg("vocab"), py::arg("qtype"))
      .def("has_head", &DecodeStack::has_head)
      .def("forward_tokens", &DecodeStack::forward_tokens, py::arg("input_ids"), py::arg("positions"),
           py::arg("out_loc"), py::arg("req_to_token"), py::arg("req_pool_indices"), py::arg("seq_lens"),
           py::arg("rows_share_sequences") = false, py::arg("lora_slots") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("forward_capture",
           [](DecodeStack& self, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
              const torch::Tensor& out_loc, const torch::Tensor& req_to_token, const torch::Tensor& req_pool_indices,
              const torch::Tensor& seq_lens, bool rows_share_sequences,
              const c10::optional<torch::Tensor>& lora_slots, const std::vector<int64_t>& capture_layers) {
             return as_tuple(self.forward_capture(x, cos, sin, out_loc, req_to_token, req_pool_indices, seq_lens,
                                                  rows_share_sequences, lora_slots, capture_layers));
           },
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out_loc"), py::arg("req_to_token"),
           py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("rows_share_sequences"), py::arg("lora_slots"),
           py::arg("capture_layers"), py::call_guard<py::gil_scoped_release>(),
           "forward, also returning (output, final normed hidden states, the inputs of capture_layers side by side)")
      .def("forward_tokens_capture",
           [](DecodeStack& self, const torch::Tensor& input_ids, const torch::Tensor& positions,
              const torch::Tensor& out_loc, const torch::Tensor& req_to_token, const torch::Tensor& req_pool_indices,
              const torch::Tensor& seq_lens, bool rows_share_sequences,
              const c10::optional<torch::Tensor>& lora_slots, const std::vector<int64_t>& capture_layers) {
             return as_tuple(self.forward_tokens_capture(input_ids, positions, out_loc, req_to_token,
                                                         req_pool_indices, seq_lens, rows_share_sequences, lora_slots,
                                                         capture_layers));
           },
           py::arg("input_ids"), py::arg("positions"), py::arg("out_loc"), py::arg("req_to_token"),
           py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("rows_share_sequences"), py::arg("lora_slots"),
           py::arg("capture_layers"), py::call_guard<py::gil_scoped_release>(),
           "forward_tokens, also returning (logits or hidden states, final normed hidden states, the inputs of "
           "capture_layers side by side)");
  m.def("set_dequant_min_rows", &gguf_kernels::set_dequant_min_rows,
        "from how many rows the step's float32 matmuls convert each row group once (AVX2; 0: never); returns the "
        "previous value",
        py::arg("rows"));
  m.def("set_decode_attention_avx512", &cpu_kernels::set_decode_attention_avx512,
        "turn the AVX512 path of bf16 attention in the step on (where the CPU has it) or off; returns whether it was on",
        py::arg("on"));
}

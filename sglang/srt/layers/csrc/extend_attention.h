// Causal attention of the new tokens of a prefill or extend batch over the paged KV cache, in float32.
//
// One task is (sequence, KV head, block of up to kExtendRows query rows): the query heads of the KV head's group
// for those rows share every K/V block the task reads. Keys go in blocks of kKeyBlock: a block's K rows are
// gathered from the pool by slot index into a transposed float32 tile (and V into a row-major one), so the scores
// of a query against all the block's keys are 8 independent FMA chains of 8 lanes, and the values are summed with
// the softmax weights in registers (online softmax: running max, running sum, rescaled output). Query row i of a
// sequence with a cached prefix of P tokens sits at position P + i and sees keys 0 .. P + i; with a sliding window
// of W tokens only the last W of them, keys P + i - W + 1 .. P + i (blocks wholly before a task's window are not
// read at all).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "kv_types.h"

namespace cpu_kernels {

constexpr int64_t kExtendRows = 32;
constexpr int64_t kKeyBlock = 64;
// Queries go through a block in tiles of kTile: the scores of a tile against the block's keys and the tile's
// weighted sum of the values are register tiles of kTile queries x 16 lanes (12 accumulators), so each K or V
// vector loaded from the block's tile feeds kTile FMAs.
constexpr int kTile = 6;


// Scratch of one thread for tasks of `group` query heads of D channels.
struct ExtendScratch {
  std::vector<float> q, kt, v, s, o, m, l;
  void size_for(int64_t group, int64_t D) {
    const int64_t nq = kExtendRows * group;
    q.resize(nq * D);
    kt.resize(D * kKeyBlock);
    v.resize(kKeyBlock * D);
    s.resize(kTile * kKeyBlock);
    o.resize(nq * D);
    m.resize(nq);
    l.resize(nq);
  }
};

#ifdef CPU_KERNELS_AVX2
// s[i * kKeyBlock + j] = sum_d q[i * D + d] * kt[d * kKeyBlock + j] for the QT queries of a tile and the first n
// keys of the block, rounded up to 16 (kt is zero past the block's last key).
template <int QT>
inline void tile_scores_avx2(const float* q, const float* kt, int64_t D, int64_t n, float* s) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    __m256 acc[QT][2];
    for (int i = 0; i < QT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyBlock + j0);
      const __m256 k1 = _mm256_loadu_ps(kt + d * kKeyBlock + j0 + 8);
      for (int i = 0; i < QT; ++i) {
        const __m256 qd = _mm256_broadcast_ss(q + i * D + d);
        acc[i][0] = _mm256_fmadd_ps(qd, k0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(qd, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < QT; ++i) {
      _mm256_storeu_ps(s + i * kKeyBlock + j0, acc[i][0]);
      _mm256_storeu_ps(s + i * kKeyBlock + j0 + 8, acc[i][1]);
    }
  }
}

// o[i * D + c] += sum_{j < n} p[i * kKeyBlock + j] * v[j * D + c] for the QT queries of a tile (D % 8 == 0).
template <int QT>
inline void tile_values_avx2(const float* p, const float* v, int64_t n, int64_t D, float* o) {
  int64_t c0 = 0;
  for (; c0 + 16 <= D; c0 += 16) {
    __m256 acc[QT][2];
    for (int i = 0; i < QT; ++i) {
      acc[i][0] = _mm256_loadu_ps(o + i * D + c0);
      acc[i][1] = _mm256_loadu_ps(o + i * D + c0 + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * D + c0);
      const __m256 v1 = _mm256_loadu_ps(v + j * D + c0 + 8);
      for (int i = 0; i < QT; ++i) {
        const __m256 w = _mm256_broadcast_ss(p + i * kKeyBlock + j);
        acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < QT; ++i) {
      _mm256_storeu_ps(o + i * D + c0, acc[i][0]);
      _mm256_storeu_ps(o + i * D + c0 + 8, acc[i][1]);
    }
  }
  if (c0 < D) {  // one vector of 8 channels left
    __m256 acc[QT];
    for (int i = 0; i < QT; ++i) acc[i] = _mm256_loadu_ps(o + i * D + c0);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * D + c0);
      for (int i = 0; i < QT; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * kKeyBlock + j), v0, acc[i]);
    }
    for (int i = 0; i < QT; ++i) _mm256_storeu_ps(o + i * D + c0, acc[i]);
  }
}

#endif

// Scores of a tile of qt queries against the block: s [qt, kKeyBlock], valid for the first n keys.
inline void tile_scores(const float* q, const float* kt, int64_t D, int64_t n, int qt, float* s) {
#ifdef CPU_KERNELS_AVX2
  with_constant<kTile>(qt, [&](auto size) { tile_scores_avx2<decltype(size)::value>(q, kt, D, n, s); });
#else
  for (int i = 0; i < qt; ++i) {
    float* si = s + i * kKeyBlock;
    std::fill(si, si + n, 0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float qd = q[i * D + d];
      const float* row = kt + d * kKeyBlock;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) si[j] += qd * row[j];
    }
  }
#endif
}

// o [qt, D] += p [qt, kKeyBlock] (zero past each query's visible keys) times the block's first n value rows.
inline void tile_values(const float* p, const float* v, int64_t n, int64_t D, int qt, float* o) {
#ifdef CPU_KERNELS_AVX2
  if (D % 8 == 0) {
    with_constant<kTile>(qt, [&](auto size) { tile_values_avx2<decltype(size)::value>(p, v, n, D, o); });
    return;
  }
#endif
  for (int i = 0; i < qt; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[i * kKeyBlock + j];
      const float* vr = v + j * D;
      float* oi = o + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) oi[d] += w * vr[d];
    }
  }
}

// The online-softmax update of one query over n scores s (scaled): they become the weights exp(s - max). m and l are
// the query's running max and sum; returns the factor its unnormalized output must be multiplied by before the
// values of these keys are added.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  float mx = m;
  int64_t j = 0;
#ifdef CPU_KERNELS_AVX2
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    mx = std::max(mx, max8(vmax));
  }
#endif
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  const float alpha = m == -INFINITY ? 0.f : std::exp(m - mx);
  float sum = 0.f;
  j = 0;
#ifdef CPU_KERNELS_AVX2
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

// The online-softmax update of one query for a block: s holds its scores of the block's keys, of which keys
// [hidden, visible) count (keys before `hidden` are outside the query's sliding window); the weights of the others
// are zero. Returns softmax_update's factor, 1 when no key of the block counts.
inline float softmax_weights(float* s, int64_t visible, float& m, float& l, int64_t hidden = 0) {
  const int64_t begin = std::min(hidden, visible);
  const float alpha = begin < visible ? softmax_update(s + begin, visible - begin, m, l) : 1.f;
  std::fill(s, s + begin, 0.f);
  std::fill(s + visible, s + kKeyBlock, 0.f);
  return alpha;
}

// One task: rows [r0, r1) of a sequence whose new tokens start at query row `tok0` of q, after `prefix` cached
// tokens; KV head g with query heads g * group .. (g + 1) * group - 1, whose K (V) row of slot s is at
// kcache (vcache) + s * slot_stride. q rows are q_stride floats apart, heads D apart; out is [tokens, H, D]
// contiguous. window > 0: each query sees only the last `window` positions up to its own (0: all of them).
template <typename KV>
inline void extend_attention_task(const float* q, int64_t q_stride, const KV* kcache, const KV* vcache,
                                  int64_t slot_stride, const int64_t* slots, int64_t tok0, int64_t prefix, int64_t r0,
                                  int64_t r1, int64_t g, int64_t group, int64_t H, int64_t D, float scale, float* out,
                                  ExtendScratch& w, int64_t window = 0) {
  const int64_t rows = r1 - r0;
  const int64_t nq = rows * group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < group; ++h) {
      const float* src = q + (tok0 + r0 + r) * q_stride + (g * group + h) * D;
      float* dst = w.q.data() + (r * group + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  }
  std::fill(w.o.begin(), w.o.begin() + nq * D, 0.f);
  std::fill(w.m.begin(), w.m.begin() + nq, -INFINITY);
  std::fill(w.l.begin(), w.l.begin() + nq, 0.f);
  const int64_t key_end = prefix + r1;  // the last row sees keys up to its own position
  // the first key a row at `pos` sees
  const auto window_start = [window](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
  // blocks before the first row's window are seen by no row of the task
  for (int64_t k0 = window_start(prefix + r0) / kKeyBlock * kKeyBlock; k0 < key_end; k0 += kKeyBlock) {
    const int64_t kn = std::min(kKeyBlock, key_end - k0);
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      float* vrow = w.v.data() + j * D;
      if (j < kn) {
        const KV* krow = kcache + slots[k0 + j] * slot_stride;
        const KV* vsrc = vcache + slots[k0 + j] * slot_stride;
        for (int64_t d = 0; d < D; ++d) {
          w.kt[d * kKeyBlock + j] = kv_types::to_f32(krow[d]);
          vrow[d] = kv_types::to_f32(vsrc[d]);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) w.kt[d * kKeyBlock + j] = 0.f;
      }
    }
    // the first row of this task that sees any key of the block
    const int64_t first = std::max<int64_t>(0, k0 - prefix - r0);
    for (int64_t i0 = first * group; i0 < nq; i0 += kTile) {
      const int qt = static_cast<int>(std::min<int64_t>(kTile, nq - i0));
      float* s = w.s.data();
      // keys the tile's last query (the one at the latest position) sees: every query of the tile sees fewer
      const int64_t n = std::min(kn, prefix + r0 + (i0 + qt - 1) / group - k0 + 1);
      tile_scores(w.q.data() + i0 * D, w.kt.data(), D, n, qt, s);
      for (int i = 0; i < qt; ++i) {
        const int64_t r = (i0 + i) / group;
        const int64_t visible = std::min(kn, prefix + r0 + r - k0 + 1);
        const int64_t hidden = std::max<int64_t>(0, window_start(prefix + r0 + r) - k0);
        const float alpha = softmax_weights(s + i * kKeyBlock, visible, w.m[i0 + i], w.l[i0 + i], hidden);
        if (alpha != 1.f) {
          float* o = w.o.data() + (i0 + i) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
        }
      }
      tile_values(s, w.v.data(), n, D, qt, w.o.data() + i0 * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < group; ++h) {
      const int64_t i = r * group + h;
      const float inv = 1.f / w.l[i];
      const float* o = w.o.data() + i * D;
      float* dst = out + ((tok0 + r0 + r) * H + g * group + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
    }
  }
}

}  // namespace cpu_kernels

// Prefill / extend attention over bf16 K/V with AVX512-BF16 dot products (extend_attention_tasks dispatches here
// when the CPU has them, the cache is bf16 and the head size is a multiple of 32 up to 256). The same tasks and the
// same online softmax as extend_attention.h, laid out for VDPBF16PS, which multiplies 16 pairs of bf16 values and
// adds them into 16 float32 lanes: 32 multiply-adds per instruction where a float32 FMA does 16 (on 512-bit
// registers), and the K/V rows of the cache are read as stored, with no conversion.
//
// The 16 lanes of a register are 16 queries of the task (query i = row * group + head). Scores of a lane tile
// against 16 keys are 16 accumulators; each takes the tile's query pair (q[2p], q[2p + 1]) against a broadcast pair
// of the key's channels, so K rows are read in their stored order. The softmax weights of two keys are paired per
// lane and multiply a broadcast pair (v[j][c], v[j + 1][c]) into the output accumulator of channel c; the value
// pairs of a key block are interleaved once per task-block with two unpacks per 32 channels, which permutes the
// channels inside each 32 (position 4L + k holds channel 8L + k, position 16 + 4L + k channel 8L + 4 + k, L < 4,
// k < 4); the output goes back to rows and channel order through two 16 x 16 transposes and a permute per 16.
//
// The queries (scaled) and the softmax weights are rounded to bf16 (the K/V operands already are): scores and
// outputs differ from the float32 kernel by about 2^-9 relative, the rounding a bf16 GEMM applies to its inputs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "decode_attention.h"
#include "extend_attention.h"
#include "kv_types.h"

namespace cpu_kernels {

// Whether this CPU (and this build) can take the path: the AVX512 decode attention's F/BW/VL, plus BF16.
inline bool has_extend_attention_bf16() {
#ifdef CPU_KERNELS_AVX2
  static const bool ok = avx512_attention_available() && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// On where available until set_extend_attention_bf16 says otherwise (the model runner sets it from the arithmetic
// plan's prefill_attention). The setting is per extension module.
inline std::atomic<bool>& extend_attention_bf16_flag() {
  static std::atomic<bool> on{has_extend_attention_bf16()};
  return on;
}

// Turns the path on (only where available) or off; returns whether it was on.
inline bool set_extend_attention_bf16(bool on) {
  return extend_attention_bf16_flag().exchange(on && has_extend_attention_bf16());
}

inline bool extend_attention_bf16_enabled(int64_t D) {
  return D % 32 == 0 && D <= 256 && extend_attention_bf16_flag().load(std::memory_order_relaxed);
}

constexpr int64_t kLanes = 16;

// Scratch of one thread for tasks of `group` query heads of D channels.
struct ExtendBf16Scratch {
  std::vector<uint32_t> qw, kblk, vpair, pw;
  std::vector<float> o, m, l, s;
  std::vector<int32_t> pos;
  void size_for(int64_t group, int64_t D) {
    const int64_t tiles = (kExtendRows * group + kLanes - 1) / kLanes;
    qw.resize(tiles * (D / 2) * kLanes);
    o.resize(tiles * D * kLanes);
    m.resize(tiles * kLanes);
    l.resize(tiles * kLanes);
    pos.resize(tiles * kLanes);
    kblk.resize(kKeyBlock * D / 2);
    vpair.resize(kKeyBlock / 2 * D);
    s.resize(kKeyBlock * kLanes);
    pw.resize(kKeyBlock / 2 * kLanes);
  }
};

}  // namespace cpu_kernels

#ifdef CPU_KERNELS_AVX2

namespace cpu_kernels {

#define CPU_KERNELS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

CPU_KERNELS_BF16_TARGET inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// r[0..15] (16 rows of 16 floats) transposed in place.
CPU_KERNELS_BF16_TARGET inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
    const __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit blocks: rows i, 4 + i, 8 + i, 12 + i hold block b of rows 4b .. 4b + 3
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

// exp(x) for 16 floats (exp8's polynomial, cpu_kernels.h); 0 below kMin (masked scores are -inf).
CPU_KERNELS_BF16_TARGET inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMin), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kMin)), _mm512_set1_ps(kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e));
}

// s[j * 16 + lane] = q_lane . k_j for the 16 keys from j0 (NP = D / 2 pairs; kblk rows of NP words).
template <int NP>
CPU_KERNELS_BF16_TARGET inline void scores16(const uint32_t* qw, const uint32_t* kblk, int64_t j0, float* s) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const uint32_t* k = kblk + j0 * NP;
  for (int p = 0; p < NP; ++p) {
    const __m512bh qv = as_bh(_mm512_loadu_si512(qw + p * kLanes));
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, as_bh(_mm512_set1_epi32(static_cast<int>(k[j * NP + p]))));
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(s + (j0 + j) * kLanes, acc[j]);
}

// o[c] += sum over key pairs jp < npairs of pw[jp] . vpair[jp][c] for the 16 channel positions from c0.
template <int D>
CPU_KERNELS_BF16_TARGET inline void values16(const uint32_t* pw, const uint32_t* vpair, int64_t npairs, int64_t c0,
                                             float* o) {
  __m512 acc[16];
  for (int c = 0; c < 16; ++c) acc[c] = _mm512_loadu_ps(o + (c0 + c) * kLanes);
  for (int64_t jp = 0; jp < npairs; ++jp) {
    const __m512bh pp = as_bh(_mm512_loadu_si512(pw + jp * kLanes));
    const uint32_t* v = vpair + jp * D + c0;
    for (int c = 0; c < 16; ++c)
      acc[c] = _mm512_dpbf16_ps(acc[c], pp, as_bh(_mm512_set1_epi32(static_cast<int>(v[c]))));
  }
  for (int c = 0; c < 16; ++c) _mm512_storeu_ps(o + (c0 + c) * kLanes, acc[c]);
}

// The arguments and result of extend_attention_task, for bf16 K/V and D = 32 * (1 .. 8).
template <int D>
CPU_KERNELS_BF16_TARGET void extend_attention_task_bf16(const float* q, int64_t q_stride, const kv_types::bf16* kcache,
                                                       const kv_types::bf16* vcache, int64_t slot_stride,
                                                       const int64_t* slots, int64_t tok0, int64_t prefix, int64_t r0,
                                                       int64_t r1, int64_t g, int64_t group, int64_t H, float scale,
                                                       float* out, ExtendBf16Scratch& w) {
  constexpr int NP = D / 2;
  const int64_t nq = (r1 - r0) * group;
  const int64_t tiles = (nq + kLanes - 1) / kLanes;
  // Queries, scaled and rounded to bf16, as [tile][pair][lane]; padding lanes repeat the last query.
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t c = 0; c < D; c += 32) {
      __m512 r[16];  // per lane: the 16 pairs of channels c .. c + 31
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const int64_t qi = std::min(t * kLanes + lane, nq - 1);
        const float* src = q + (tok0 + r0 + qi / group) * q_stride + (g * group + qi % group) * D + c;
        const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + 16), sv),
                                               _mm512_mul_ps(_mm512_loadu_ps(src), sv));
        r[lane] = reinterpret_cast<const __m512&>(x);
      }
      transpose16(r);
      for (int64_t u = 0; u < 16; ++u) _mm512_storeu_ps(reinterpret_cast<float*>(w.qw.data()) + (t * NP + c / 2 + u) * kLanes, r[u]);
    }
    for (int64_t lane = 0; lane < kLanes; ++lane)
      w.pos[t * kLanes + lane] = static_cast<int32_t>(prefix + r0 + std::min(t * kLanes + lane, nq - 1) / group);
  }
  std::fill(w.o.begin(), w.o.begin() + tiles * D * kLanes, 0.f);
  std::fill(w.m.begin(), w.m.begin() + tiles * kLanes, -INFINITY);
  std::fill(w.l.begin(), w.l.begin() + tiles * kLanes, 0.f);
  // Pairs the softmax weights of keys 2jp, 2jp + 1 per lane.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,  //
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t key_end = prefix + r1;
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
    const int64_t kn = std::min(kKeyBlock, key_end - k0);
    // The block's K rows as stored (zero past kn), and its value pairs.
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      uint32_t* dst = w.kblk.data() + j * NP;
      if (j < kn) {
        std::memcpy(dst, kcache + slots[k0 + j] * slot_stride, D * sizeof(kv_types::bf16));
      } else {
        std::memset(dst, 0, D * sizeof(kv_types::bf16));
      }
    }
    for (int64_t jp = 0; jp < (kn + 1) / 2; ++jp) {
      const int64_t j = k0 + 2 * jp;
      const kv_types::bf16* a = vcache + slots[j] * slot_stride;
      const kv_types::bf16* b = 2 * jp + 1 < kn ? vcache + slots[j + 1] * slot_stride : nullptr;
      for (int64_t c = 0; c < D; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c);
        const __m512i vb = b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(w.vpair.data() + jp * D + c, _mm512_unpacklo_epi16(va, vb));
        _mm512_storeu_si512(w.vpair.data() + jp * D + c + 16, _mm512_unpackhi_epi16(va, vb));
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int32_t* pos = w.pos.data() + t * kLanes;
      const int64_t lo = pos[0], hi = pos[kLanes - 1];  // positions grow with the lane
      if (hi < k0) continue;  // no query of the tile sees this block yet
      const int64_t n = std::min(kn, hi - k0 + 1);
      const int64_t keys = (n + 15) / 16 * 16;
      float* s = w.s.data();
      for (int64_t j0 = 0; j0 < keys; j0 += 16) scores16<NP>(w.qw.data() + t * NP * kLanes, w.kblk.data(), j0, s);
      const __m512i posv = _mm512_loadu_si512(pos);
      const __m512 m_old = _mm512_loadu_ps(w.m.data() + t * kLanes);
      __m512 mx = m_old;
      for (int64_t j = 0; j < keys; ++j) {
        __m512 sj = _mm512_loadu_ps(s + j * kLanes);
        if (k0 + j > lo) {  // some lane does not see key k0 + j
          const __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(k0 + j)), posv);
          sj = _mm512_mask_mov_ps(sj, hidden, _mm512_set1_ps(-INFINITY));
          _mm512_storeu_ps(s + j * kLanes, sj);
        }
        mx = _mm512_max_ps(mx, sj);
      }
      const __m512 alpha = exp16(_mm512_sub_ps(m_old, mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < keys; j += 2) {
        const __m512 p0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j * kLanes), mx));
        const __m512 p1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (j + 1) * kLanes), mx));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512bh pair = _mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(w.pw.data() + (j / 2) * kLanes,
                            _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(pair)));
      }
      float* l = w.l.data() + t * kLanes;
      _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
      _mm512_storeu_ps(w.m.data() + t * kLanes, mx);
      float* o = w.o.data() + t * D * kLanes;
      if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0) {  // some lane's max moved
        for (int64_t c = 0; c < D; ++c)
          _mm512_storeu_ps(o + c * kLanes, _mm512_mul_ps(_mm512_loadu_ps(o + c * kLanes), alpha));
      }
      for (int64_t c0 = 0; c0 < D; c0 += 16) values16<D>(w.pw.data(), w.vpair.data(), (n + 1) / 2, c0, o);
    }
  }
  // out = o / l, lanes back to rows and channels back in order (inv_perm: the position of each channel).
  const __m512i to_channels_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i to_channels_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t lanes = std::min(kLanes, nq - t * kLanes);
    const float* o = w.o.data() + t * D * kLanes;
    alignas(64) float inv[kLanes];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(w.l.data() + t * kLanes)));
    for (int64_t c0 = 0; c0 < D; c0 += 32) {
      __m512 a[16], b[16];  // positions c0 .. c0 + 15 and c0 + 16 .. c0 + 31, per lane after the transposes
      for (int u = 0; u < 16; ++u) {
        a[u] = _mm512_loadu_ps(o + (c0 + u) * kLanes);
        b[u] = _mm512_loadu_ps(o + (c0 + 16 + u) * kLanes);
      }
      transpose16(a);
      transpose16(b);
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const int64_t i = t * kLanes + lane;
        float* dst = out + ((tok0 + r0 + i / group) * H + g * group + i % group) * D + c0;
        const __m512 scale_l = _mm512_set1_ps(inv[lane]);
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_permutex2var_ps(a[lane], to_channels_lo, b[lane]), scale_l));
        _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a[lane], to_channels_hi, b[lane]), scale_l));
      }
    }
  }
}

// extend_attention_task_bf16 for a runtime head size (extend_attention_bf16_enabled(D) must hold).
inline void extend_attention_task_bf16(const float* q, int64_t q_stride, const kv_types::bf16* kcache,
                                       const kv_types::bf16* vcache, int64_t slot_stride, const int64_t* slots,
                                       int64_t tok0, int64_t prefix, int64_t r0, int64_t r1, int64_t g, int64_t group,
                                       int64_t H, int64_t D, float scale, float* out, ExtendBf16Scratch& w) {
  with_constant<8>(D / 32, [&](auto chunks) {
    extend_attention_task_bf16<32 * decltype(chunks)::value>(q, q_stride, kcache, vcache, slot_stride, slots, tok0,
                                                             prefix, r0, r1, g, group, H, scale, out, w);
  });
}

#undef CPU_KERNELS_BF16_TARGET

}  // namespace cpu_kernels

#endif  // CPU_KERNELS_AVX2

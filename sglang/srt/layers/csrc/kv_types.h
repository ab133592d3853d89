// Element types of the paged KV cache (--kv-cache-dtype) and their conversions to and from float32.
//
// Attention reads K/V in the stored type and converts per element (scalar code) or per 8 elements (AVX2) into
// float32 registers, so a bf16 cache moves half the bytes of a float32 one and an fp8 cache a quarter; nothing
// converts a whole buffer. Stores round like torch's `.to(dtype)` (bf16: round to nearest even; fp8: per-tensor
// scale 1.0, values clamped to the format's finite range first, as the Python pool does), so the compiled and the
// Python paths write identical bytes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kv_types {

using bf16 = c10::BFloat16;
using e4m3 = c10::Float8_e4m3fn;
using e5m2 = c10::Float8_e5m2;

// Every fp8 value decoded once: a table lookup (or an 8-lane gather) per element.
template <typename T>
std::array<float, 256> fp8_table() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(T(static_cast<uint8_t>(i), T::from_bits()));
  return t;
}
inline const std::array<float, 256> kE4M3 = fp8_table<e4m3>();
inline const std::array<float, 256> kE5M2 = fp8_table<e5m2>();

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the high half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_f32(e4m3 x) { return kE4M3[x.x]; }
inline float to_f32(e5m2 x) { return kE5M2[x.x]; }

template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline bf16 from_f32<bf16>(float x) { return bf16(x); }  // c10: round to nearest even, NaN stays NaN
template <>
inline e4m3 from_f32<e4m3>(float x) { return e4m3(std::clamp(x, -448.f, 448.f)); }
template <>
inline e5m2 from_f32<e5m2>(float x) { return e5m2(std::clamp(x, -57344.f, 57344.f)); }

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<T>(src[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 consecutive stored elements as 8 float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// 8 float32 lanes rounded to bf16 (nearest even, as torch rounds; a signalling NaN may come out as infinity).
inline void store8(bf16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i high = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#if defined(__F16C__)
// fp8 through the F16C half -> float conversion (a table gather costs several times more per element).
// e5m2 is the high byte of an IEEE half.
inline __m256 load8(const e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes));
}
// e4m3 (bias 7) read as a half (bias 15) with its exponent and mantissa bits in place, times 2^8: exact for
// every finite value, subnormals included; the NaN codes 0x7F / 0xFF are patched in, on a branch that a cache
// without NaNs never takes (the blend on every vector cost about a tenth of the attention time).
inline __m256 load8(const e4m3* p) {
  const __m128i x = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(_mm_srli_epi16(x, 1), _mm_set1_epi16(0x3F80));
  const __m128i half = _mm_or_si128(mag, _mm_and_si128(x, _mm_set1_epi16(static_cast<short>(0x8000))));
  const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
  const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x3F80));
  if (_mm_testz_si128(nan, nan)) return value;
  return _mm256_blendv_ps(value, _mm256_set1_ps(kE4M3[0x7F]), _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}
#else
inline __m256 load8(const e4m3* p) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(kE4M3.data(), idx, 4);
}
inline __m256 load8(const e5m2* p) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(kE5M2.data(), idx, 4);
}
#endif
#endif

}  // namespace kv_types

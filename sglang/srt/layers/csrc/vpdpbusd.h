// VPDPBUSD (AVX512-VNNI: 4 unsigned bytes times 4 signed bytes, the four products added into a 32-bit lane), in place,
// for the int8 kernels of both extensions (int8_gemm_vnni.h; quantization/csrc/gguf_int8.h). The intrinsic
// _mm512_dpbusd_epi32 makes GCC copy each accumulator before every use and keep a tile's accumulators on the stack
// (measured: 45% of the VNNI peak in the int8 GEMM, a 13% slower decode step in the block kernels); the instruction
// written out keeps them in registers. It is the same instruction, so the same sums.
// The target is a subset of every caller's, so the wrappers inline into them; callers check `cpu_avx512_vnni()` first.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SGLANG_VPDPBUSD 1
#include <immintrin.h>

#include <cstdint>

namespace vnni {

// Whether this CPU has AVX512 F/BW/VL and VNNI.
inline bool cpu_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

#define VPDPBUSD_TARGET __attribute__((target("avx512f,avx512vnni")))

// acc += VPDPBUSD(u, s): u unsigned bytes, s signed bytes.
VPDPBUSD_TARGET inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
}

// acc += VPDPBUSD(u, the 4 signed bytes at s broadcast to every lane), the broadcast inside the instruction.
VPDPBUSD_TARGET inline void dpbusd_word(__m512i& acc, __m512i u, const void* s) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const int32_t*>(s)));
}

#undef VPDPBUSD_TARGET

}  // namespace vnni

#endif

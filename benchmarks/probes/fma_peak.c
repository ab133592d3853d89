// Peak FMA throughput of this CPU: each thread runs 10 independent chains of vector FMAs (enough to cover the
// FMA latency on the CPUs seen so far), kept in registers by an empty asm barrier so that the compiler can neither
// drop nor fold them. Built and run by benchmarks/fma_peak.py. WIDTH is 256 (AVX2 / FMA) or 512 (AVX512F).
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#if WIDTH == 512
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define FIRST(v) _mm512_cvtss_f32(v)
#define BARRIER(r) __asm__ volatile("" : "+v"(r))
#else
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define FIRST(v) _mm256_cvtss_f32(v)
#define BARRIER(r) __asm__ volatile("" : "+x"(r))
#endif

static float sink[256];

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const long iters = argc > 2 ? atol(argv[2]) : 20000000;  // loop trips per thread, 10 FMAs each
  const int lanes = WIDTH / 32;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
      vec a0 = SET1(1.0f), a1 = SET1(1.1f), a2 = SET1(1.2f), a3 = SET1(1.3f), a4 = SET1(1.4f);
      vec a5 = SET1(1.5f), a6 = SET1(1.6f), a7 = SET1(1.7f), a8 = SET1(1.8f), a9 = SET1(1.9f);
      const vec b = SET1(0.999999f), c = SET1(1e-7f);
      for (long i = 0; i < iters; ++i) {
        a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c); a4 = FMA(a4, b, c);
        a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c); a8 = FMA(a8, b, c); a9 = FMA(a9, b, c);
        BARRIER(a0); BARRIER(a1); BARRIER(a2); BARRIER(a3); BARRIER(a4);
        BARRIER(a5); BARRIER(a6); BARRIER(a7); BARRIER(a8); BARRIER(a9);
      }
      const vec s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(ADD(a4, a5), ADD(a6, a7)), ADD(a8, a9)));
      sink[omp_get_thread_num() % 256] = FIRST(s);
    }
    const double seconds = omp_get_wtime() - t0;
    const double gflops = 2.0 * lanes * 10 * iters * threads / seconds / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("%d-bit FMA, %d thread(s): %.1f GFLOP/s (float32, best of 5)\n", WIDTH, threads, best);
  return 0;
}

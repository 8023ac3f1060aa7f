// BF16-weight linear layer for decode steps on CPUs without BF16 arithmetic: y = x W^T + b with
// x [M, K] fp32 (a few rows: one per sequence of a decode batch), W [N, K] bf16 (nn.Linear's
// layout, read in place), b [N] fp32 or null, y [M, N] fp32. Plain C ABI, loaded with ctypes by
// pask/native_gemv.py. Every weight is widened to fp32 exactly (bf16 -> fp32 is a shift) and
// products are accumulated in fp32, as PyTorch's fp32 GEMM over the upcast weight does; only the
// summation order differs. A decode step reads each weight once per step instead of 2x its bytes
// (an fp32 copy) or converting it in a general GEMM: at a few rows the layer is bound by reading
// W, so half the bytes is the speed-up.
//
// Work split: chunks of output columns over OpenMP threads; per column up to 8 rows at a time,
// each with its own accumulator chain (fewer rows get more partial sums per row, so that 8
// independent FMA chains hide the FMA latency), over slices of the reduction that keep x in L1.
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int MAXM = 8;  // rows per pass over a weight row

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline float hadd8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// y[m * ldy] (+)= x_m . w over k in [0, K) for MT rows of x (row stride ldx); U partial sums per
// row; K % 8 == 0. `add`: accumulate into y instead of writing x_m . w + b.
template <int MT, int U>
inline void dot_rows(const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy, float b,
                     bool add) {
  __m256 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U)
    for (int u = 0; u < U; ++u) {
      const __m256 wv = bf16x8(w + k + 8 * u);
      for (int m = 0; m < MT; ++m) acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k + 8 * u), acc[m][u]);
    }
  for (; k < K; k += 8) {
    const __m256 wv = bf16x8(w + k);
    for (int m = 0; m < MT; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), acc[m][0]);
  }
  for (int m = 0; m < MT; ++m) {
    __m256 s = acc[m][0];
    for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[m][u]);
    y[m * ldy] = add ? y[m * ldy] + hadd8(s) : hadd8(s) + b;
  }
}

void rows(int mt, const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy, float b, bool add) {
  switch (mt) {
    case 1: dot_rows<1, 8>(x, ldx, K, w, y, ldy, b, add); break;
    case 2: dot_rows<2, 4>(x, ldx, K, w, y, ldy, b, add); break;
    case 3: dot_rows<3, 2>(x, ldx, K, w, y, ldy, b, add); break;
    case 4: dot_rows<4, 2>(x, ldx, K, w, y, ldy, b, add); break;
    case 5: dot_rows<5, 1>(x, ldx, K, w, y, ldy, b, add); break;
    case 6: dot_rows<6, 1>(x, ldx, K, w, y, ldy, b, add); break;
    case 7: dot_rows<7, 1>(x, ldx, K, w, y, ldy, b, add); break;
    default: dot_rows<8, 1>(x, ldx, K, w, y, ldy, b, add); break;
  }
}
#else
inline float bf2f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void rows(int mt, const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy, float b, bool add) {
  for (int m = 0; m < mt; ++m) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += x[m * ldx + k] * bf2f(w[k]);
    y[m * ldy] = add ? y[m * ldy] + s : s + b;
  }
}
#endif

}  // namespace

extern "C" {

// The instruction set the kernel was compiled for.
const char* pask_gemv_isa() {
#if defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

// Returns 0, or -1 for an unsupported shape (K not a multiple of 8, or a non-positive size).
int pask_linear_bf16(int64_t M, int64_t K, int64_t N, const float* x, const uint16_t* w, const float* bias, float* y,
                     int nthreads) {
  if (M <= 0 || K <= 0 || N <= 0 || K % 8 != 0) return -1;
  // Columns in chunks of NC. Where x is much larger than L1 (e.g. 8 rows of a 4864-wide MLP
  // input), the reduction runs in slices of 512 so that a slice of x (16 KB for 8 rows) stays in
  // L1 while the chunk's weight rows stream past it; otherwise slicing only breaks the weight
  // stream (measured on a 2-core AMD EPYC: 1.5x faster at 8 rows x 4864, 2x slower at 1 row).
  const int64_t NC = 64, KB = M * K * 4 > 65536 ? 512 : K;
  const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n1 = std::min(N, (c + 1) * NC);
    for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
      const int mt = static_cast<int>(std::min<int64_t>(MAXM, M - m0));
      for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t kn = std::min(KB, K - k0);
        for (int64_t n = c * NC; n < n1; ++n)
          rows(mt, x + m0 * K + k0, K, kn, w + n * K + k0, y + m0 * N + n, N, bias ? bias[n] : 0.0f, k0 > 0);
      }
    }
  }
  return 0;
}

}  // extern "C"

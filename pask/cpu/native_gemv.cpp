// BF16-weight linear layers for decode steps. pask_linear_bf16 (CPUs without BF16 arithmetic): y = x W^T + b with
// x [M, K] fp32 (a few rows: one per sequence of a decode batch), W [N, K] bf16 (nn.Linear's
// layout, read in place), b [N] fp32 or null, y [M, N] fp32. Plain C ABI, loaded with ctypes by
// pask/native_gemv.py. Every weight is widened to fp32 exactly (bf16 -> fp32 is a shift) and
// products are accumulated in fp32, as PyTorch's fp32 GEMM over the upcast weight does; only the
// summation order differs. A decode step reads each weight once per step instead of 2x its bytes
// (an fp32 copy) or converting it in a general GEMM: at a few rows the layer is bound by reading
// W, so half the bytes is the speed-up.
//
// Work split: chunks of output columns over OpenMP threads; per column up to 6 rows at a time,
// each with 2 accumulator chains (the same for every row count: a row's sum never depends on its
// batch-mates), over slices of the reduction that keep x in L1 and carry their accumulators.
// pask_linear_bf16_io (CPUs with AVX512-BF16; PASK_BF16_MATMUL=gemv, the server's default): bf16 in and out, on
// AMX tiles where the OS grants them, else bf16 dot products.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace {

using pask_native::bf2f;

constexpr int MAXM = 8;  // rows per pass over a weight row (bf16-io path: one accumulator per row and weight row)

inline uint16_t f2bf(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>((u >> 16) | ((u & 0xFFFF) ? 0x40 : 0));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX2__) && defined(__FMA__)
// f2bf on 8 lanes for non-NaN inputs (what fma(code, scale, zero) of finite operands gives; an
// overflow to +-inf rounds as f2bf does): each lane's bf16 bits in its low 16 bits (the high 16 are 0)
inline __m256i f2bf8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline float hadd8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// Batch invariance: a row's sum is formed the same way whatever the other rows of the call are
// (how many, which): U partial sums per row for every tile size, and a reduction split into
// slices keeps its accumulators between slices (`keep`), so that slicing changes nothing. A
// decode step then gives every sequence the same logits alone or in any batch.
constexpr int U = 2;     // partial sums (FMA chains) per row
constexpr int MAXR = 6;  // rows per pass over a weight row: MAXR x U accumulators in registers

// y[m * ldy] = x_m . w + b over k in [0, K) for MT rows of x (row stride ldx), as one slice of a
// longer reduction: accumulators start at zero (`first`) or from `keep` [MT * U], and are left in
// `keep` unless `last`. Slices other than the last are multiples of 8 * U values; K % 8 == 0.
template <int MT>
inline void dot_rows(const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy, float b,
                     __m256* keep, bool first, bool last) {
  __m256 acc[MT][U];
  for (int m = 0; m < MT; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = first ? _mm256_setzero_ps() : keep[m * U + u];
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U)
    for (int u = 0; u < U; ++u) {
      const __m256 wv = bf16x8(w + k + 8 * u);
      for (int m = 0; m < MT; ++m) acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k + 8 * u), acc[m][u]);
    }
  for (; k < K; k += 8) {  // the reduction's tail (last slice only)
    const __m256 wv = bf16x8(w + k);
    for (int m = 0; m < MT; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), acc[m][0]);
  }
  if (!last) {
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) keep[m * U + u] = acc[m][u];
    return;
  }
  for (int m = 0; m < MT; ++m) {
    __m256 s = acc[m][0];
    for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[m][u]);
    y[m * ldy] = hadd8(s) + b;
  }
}

void rows(int mt, const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy, float b,
          __m256* keep, bool first, bool last) {
  switch (mt) {
    case 1: dot_rows<1>(x, ldx, K, w, y, ldy, b, keep, first, last); break;
    case 2: dot_rows<2>(x, ldx, K, w, y, ldy, b, keep, first, last); break;
    case 3: dot_rows<3>(x, ldx, K, w, y, ldy, b, keep, first, last); break;
    case 4: dot_rows<4>(x, ldx, K, w, y, ldy, b, keep, first, last); break;
    case 5: dot_rows<5>(x, ldx, K, w, y, ldy, b, keep, first, last); break;
    default: dot_rows<6>(x, ldx, K, w, y, ldy, b, keep, first, last); break;
  }
}
#define PASK_GEMV_SLICES 1
#else
constexpr int MAXR = 8;
// Portable: one sum per row over the whole reduction (never sliced), the same for any batch.
void rows(int mt, const float* x, int64_t ldx, int64_t K, const uint16_t* w, float* y, int64_t ldy, float b) {
  for (int m = 0; m < mt; ++m) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += x[m * ldx + k] * bf2f(w[k]);
    y[m * ldy] = s + b;
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PASK_GEMV_BF16 1
// ---- CPUs with AVX512-BF16: bf16 x bf16 dot products (exact products, fp32 sums), bf16 in and out --
// Two weight rows x up to 8 input rows per pass over the reduction: 16 accumulators, summed
// across lanes together at the end (pask_native::hsum16).
// y[m][n], y[m][n + 1] for MT rows of x: accumulators 0..7 = (row n, x row m), 8..15 = (n + 1, m)
template <int MT>
inline void pair_dot(const uint16_t* x, int64_t K, const uint16_t* w0, const uint16_t* w1, float* sums) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + k), b = (__m512bh)_mm512_loadu_si512(w1 + k);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      acc[m] = _mm512_dpbf16_ps(acc[m], xv, a);
      acc[8 + m] = _mm512_dpbf16_ps(acc[8 + m], xv, b);
    }
  }
  if (k < K) {  // K % 8 == 0: a masked tail of 8, 16 or 24 values
    const __mmask32 t = static_cast<__mmask32>((1ull << (K - k)) - 1);
    const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(t, w0 + k), b = (__m512bh)_mm512_maskz_loadu_epi16(t, w1 + k);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(t, x + m * K + k);
      acc[m] = _mm512_dpbf16_ps(acc[m], xv, a);
      acc[8 + m] = _mm512_dpbf16_ps(acc[8 + m], xv, b);
    }
  }
  _mm512_storeu_ps(sums, pask_native::hsum16(acc));
}

// Rows [n0, n1) of y by pairs of weight rows (the path without tiles, and the tail of the tile path;
// w points at row n0).
void pair_rows_range(int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, const uint16_t* x, const uint16_t* w,
                     const uint16_t* bias, uint16_t* y) {
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two = n + 1 < n1;
    const uint16_t* w0 = w + (n - n0) * K;
    const uint16_t* w1 = two ? w0 + K : w0;
    const float b0 = bias ? bf2f(bias[n]) : 0.0f, b1 = bias && two ? bf2f(bias[n + 1]) : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
      const int mt = static_cast<int>(std::min<int64_t>(MAXM, M - m0));
      alignas(64) float sums[16];
      const uint16_t* xm = x + m0 * K;
      switch (mt) {
        case 1: pair_dot<1>(xm, K, w0, w1, sums); break;
        case 2: pair_dot<2>(xm, K, w0, w1, sums); break;
        case 3: pair_dot<3>(xm, K, w0, w1, sums); break;
        case 4: pair_dot<4>(xm, K, w0, w1, sums); break;
        case 5: pair_dot<5>(xm, K, w0, w1, sums); break;
        case 6: pair_dot<6>(xm, K, w0, w1, sums); break;
        case 7: pair_dot<7>(xm, K, w0, w1, sums); break;
        default: pair_dot<8>(xm, K, w0, w1, sums); break;
      }
      for (int m = 0; m < mt; ++m) {
        y[(m0 + m) * N + n] = f2bf(sums[m] + b0);
        if (two) y[(m0 + m) * N + n + 1] = f2bf(sums[8 + m] + b1);
      }
    }
  }
}
#endif

#if defined(PASK_GEMV_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PASK_GEMV_AMX 1
// ---- AMX tiles (Sapphire Rapids and later): y^T = W x^T, 16 weight rows per tile -------------
// A = 16 weight rows x 32 values, read in place (row stride K); B = x^T for the same 32 values as
// VNNI pairs (16 rows of M pairs, packed once per call); C = 16 weight rows x M fp32.
using pask_native::amx_granted;
using pask_native::TileConfig;

// Tiles: 0 = B (16 rows of M pairs), 1..3 = A (16 weight rows x 32 values), 4..7 = C (16 x M fp32).
void tile_config(int64_t M) {
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = static_cast<uint16_t>(M * 4);
  for (int i = 1; i < 4; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  for (int i = 4; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = static_cast<uint16_t>(M * 4);
  _tile_loadconfig(&cfg);
}

// y[m][col .. col + 16) = bf16(c[r][m] + bias[col + r]) for the M rows of x: one tile's 16 weight rows,
// read down c's columns (a gather from L1), rounded as f2bf does (to nearest even; NaN stays NaN).
inline void store_tile(int64_t M, int64_t N, int64_t col, const float (*c)[16], const uint16_t* bias, uint16_t* y) {
  const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
  const __m512 bv = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + col))), 16))
                         : _mm512_setzero_ps();
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), expo = _mm512_set1_epi32(0x7F800000);
  for (int64_t m = 0; m < M; ++m) {
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(_mm512_i32gather_ps(down, &c[0][m], 4), bv));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
    const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, expo), expo);  // inf or NaN: truncate, keep NaN
    if (special) {
      const __m512i t = _mm512_srli_epi32(u, 16);
      const __mmask16 nan = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0xFFFF));
      r = _mm512_mask_mov_epi32(r, special, _mm512_mask_or_epi32(t, special & nan, t, _mm512_set1_epi32(0x40)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + col), _mm512_cvtepi32_epi16(r));
  }
}

// Weight rows [n0, n1) (n1 - n0 a multiple of 16; w points at row n0), tile config loaded.
void tile_rows(int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, const uint32_t* xt, const uint16_t* w,
               const uint16_t* bias, uint16_t* y) {
  const int64_t ldw = K * 2, ldx = M * 4;
  alignas(64) float c[4][16][16];
  for (int64_t n = n0; n < n1; n += 64) {
    const int nb = static_cast<int>(std::min<int64_t>(4, (n1 - n) / 16));
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const uint16_t* wn = w + (n - n0) * K;
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(0, xt + (k / 2) * M, ldx);
      _tile_loadd(1, wn + k, ldw);
      _tile_dpbf16ps(4, 1, 0);
      if (nb > 1) {
        _tile_loadd(2, wn + 16 * K + k, ldw);
        _tile_dpbf16ps(5, 2, 0);
      }
      if (nb > 2) {
        _tile_loadd(3, wn + 32 * K + k, ldw);
        _tile_dpbf16ps(6, 3, 0);
      }
      if (nb > 3) {
        _tile_loadd(1, wn + 48 * K + k, ldw);
        _tile_dpbf16ps(7, 1, 0);
      }
    }
    _tile_stored(4, c[0], 64);
    if (nb > 1) _tile_stored(5, c[1], 64);
    if (nb > 2) _tile_stored(6, c[2], 64);
    if (nb > 3) _tile_stored(7, c[3], 64);
    for (int b = 0; b < nb; ++b) store_tile(M, N, n + 16 * b, c[b], bias, y);
  }
}
#endif

#if defined(PASK_GEMV_AMX)
// x^T as VNNI pairs: xt[p][m] = (x[m][2p], x[m][2p + 1]) for every pair p of the K values (the
// calling thread's buffer, kept across calls: no allocation per layer; the team reads it by pointer)
const uint32_t* pack_pairs(int64_t M, int64_t K, const uint16_t* x) {
  thread_local std::vector<uint32_t> buf;
  buf.resize(static_cast<size_t>(K / 2) * M);
  uint32_t* xt = buf.data();
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < K / 2; ++p) xt[p * M + m] = x32[m * (K / 2) + p];
  return xt;
}
#endif

// A per-thread buffer of rows x K bf16 values, kept across calls (64-byte aligned).
uint16_t* row_buffer(int64_t rows, int64_t K) {
  thread_local std::vector<uint16_t> buf;
  buf.resize(static_cast<size_t>(rows * K) + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

#if defined(__AVX512F__)
inline __m512 bf16x16(__m256i v) {  // 16 bf16 -> fp32 (exact: a shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

// ---- INT4 / INT8 weights: the tiled layout (pask/cpu/weights.py writes it) --------------------
// Output rows in blocks of 16 (N padded to Np, a multiple of 16, with zero rows), inputs in groups of
// 32 (K % 32 == 0, G = K / 32); per (block b, group g), the eight rows of an AMX-INT8 B tile (row r:
// 16 outputs x 4 consecutive inputs 32 g + 4 r .. + 3, byte 4 n + i):
//   INT8 codes [Np/16, G, 8, 64] u8: the tile itself;
//   INT4 codes [Np/16, G, 4, 64] u8: row r's byte holds the code of tile row r (low nibble) and of
//        tile row r + 4 (high nibble);
//   sz [Np/16, G, 2, 16] bf16: the 16 outputs' scales, then their zeros.
// A weight is fma(code, scale, zero) (rounded to bf16 where a kernel needs it in bf16).
inline const uint8_t* tile_codes(const uint8_t* codes, int64_t G, int64_t b, int64_t g, int bits) {
  return codes + (b * G + g) * (bits == 4 ? 256 : 512);
}
inline const uint16_t* tile_sz(const uint16_t* sz, int64_t G, int64_t b, int64_t g) { return sz + (b * G + g) * 32; }

// code of output n (0..15) at input 4 r + i of a block-group's codes (r 0..7, i 0..3)
inline int tile_code(const uint8_t* c, int bits, int n, int r, int i) {
  if (bits == 8) return c[64 * r + 4 * n + i];
  const uint8_t byte = c[64 * (r & 3) + 4 * n + i];
  return r < 4 ? byte & 15 : byte >> 4;
}

// bf16 rows [n0, n1) (n0 % 16 == 0) of a tiled INT4 / INT8 weight into out [n1 - n0, K].
void dequant_tiled(int64_t K, int64_t n0, int64_t n1, const uint8_t* codes, const uint16_t* sz, uint16_t* out, int bits) {
  const int64_t G = K / 32;
  for (int64_t b = n0 / 16; b * 16 < n1; ++b) {
    const int nn = static_cast<int>(std::min<int64_t>(16, n1 - b * 16));
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* c = tile_codes(codes, G, b, g, bits);
      const uint16_t* s = tile_sz(sz, G, b, g);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      // the block-group's eight tile rows (16 outputs x 4 codes each, as dwords) transposed to 16
      // outputs x 8 dwords: output n's 32 codes in input order, then fma and one bf16 rounding
      __m512i R[8];
      if (bits == 8) {
        for (int r = 0; r < 8; ++r) R[r] = _mm512_loadu_si512(c + 64 * r);
      } else {
        const __m512i m15 = _mm512_set1_epi8(15);
        for (int r = 0; r < 4; ++r) {
          const __m512i v = _mm512_loadu_si512(c + 64 * r);
          R[r] = _mm512_and_si512(v, m15);
          R[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
        }
      }
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        lo[j] = _mm512_unpacklo_epi32(R[2 * j], R[2 * j + 1]);
        hi[j] = _mm512_unpackhi_epi32(R[2 * j], R[2 * j + 1]);
      }
      const __m512i A[4] = {_mm512_unpacklo_epi64(lo[0], lo[1]), _mm512_unpackhi_epi64(lo[0], lo[1]),
                            _mm512_unpacklo_epi64(hi[0], hi[1]), _mm512_unpackhi_epi64(hi[0], hi[1])};
      const __m512i B[4] = {_mm512_unpacklo_epi64(lo[2], lo[3]), _mm512_unpackhi_epi64(lo[2], lo[3]),
                            _mm512_unpacklo_epi64(hi[2], hi[3]), _mm512_unpackhi_epi64(hi[2], hi[3])};
      alignas(64) __m128i a4[4][4], b4[4][4];  // [t][lane]: rows 0-3 / 4-7 of output 4 lane + t
      for (int t = 0; t < 4; ++t) {
        _mm512_store_si512(a4[t], A[t]);
        _mm512_store_si512(b4[t], B[t]);
      }
      for (int n = 0; n < nn; ++n) {
        const int t = n & 3, lane = n >> 2;
        const __m512 sc = _mm512_set1_ps(bf2f(s[n])), ze = _mm512_set1_ps(bf2f(s[16 + n]));
        const __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a4[t][lane])), sc, ze);
        const __m512 v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b4[t][lane])), sc, ze);
        _mm512_storeu_si512(out + (b * 16 + n - n0) * K + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      // per half of the block (8 outputs): the eight tile rows' dwords transposed 8 x 8, so output
      // n's 32 codes come in input order; then fma and f2bf's rounding, vectorised (bit for bit)
      for (int half = 0; half < 2 && 8 * half < nn; ++half) {
        __m256i R[8];
        if (bits == 8) {
          for (int r = 0; r < 8; ++r) R[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r + 32 * half));
        } else {
          const __m256i m15 = _mm256_set1_epi8(15);
          for (int r = 0; r < 4; ++r) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r + 32 * half));
            R[r] = _mm256_and_si256(v, m15);
            R[r + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
          }
        }
        __m256i t[8], u[8], col[8];
        for (int j = 0; j < 4; ++j) {
          t[2 * j] = _mm256_unpacklo_epi32(R[2 * j], R[2 * j + 1]);
          t[2 * j + 1] = _mm256_unpackhi_epi32(R[2 * j], R[2 * j + 1]);
        }
        for (int j = 0; j < 2; ++j) {  // rows 4 j .. 4 j + 3: columns (0 | 4), (1 | 5), (2 | 6), (3 | 7)
          u[4 * j + 0] = _mm256_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
          u[4 * j + 1] = _mm256_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
          u[4 * j + 2] = _mm256_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
          u[4 * j + 3] = _mm256_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
        }
        for (int j = 0; j < 4; ++j) {
          col[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
          col[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
        }
        for (int i = 0; i < 8 && 8 * half + i < nn; ++i) {
          const int n = 8 * half + i;
          const __m256 sc = _mm256_set1_ps(bf2f(s[n])), ze = _mm256_set1_ps(bf2f(s[16 + n]));
          const __m128i lo = _mm256_castsi256_si128(col[i]), hi = _mm256_extracti128_si256(col[i], 1);
          const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
          __m256i bw[4];
          for (int j = 0; j < 4; ++j)
            bw[j] = f2bf8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[j])), sc, ze));
          uint16_t* o = out + (b * 16 + n - n0) * K + 32 * g;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute4x64_epi64(_mm256_packus_epi32(bw[0], bw[1]), 0xD8));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                              _mm256_permute4x64_epi64(_mm256_packus_epi32(bw[2], bw[3]), 0xD8));
        }
      }
#else
      alignas(64) float w[16][32];  // [output][input in the group]
      for (int n = 0; n < 16; ++n) {
        const float scale = bf2f(s[n]), zero = bf2f(s[16 + n]);
        for (int r = 0; r < 8; ++r)
          for (int i = 0; i < 4; ++i) w[n][4 * r + i] = std::fma(static_cast<float>(tile_code(c, bits, n, r, i)), scale, zero);
      }
      for (int n = 0; n < nn; ++n) {
        uint16_t* o = out + (b * 16 + n - n0) * K + 32 * g;
        for (int k = 0; k < 32; ++k) o[k] = f2bf(w[n][k]);
      }
#endif
    }
  }
}

// The int8-activation kernels' per-thread scratch (kept across calls): x8 [M, K] s8, a [M, G] and
// xs [M, G] fp32 (G = K / 32), filled by quantize_rows / quantize_rows_avx2.
struct QuantScratch {
  int8_t* x8;
  float* a;
  float* xs;
};
inline QuantScratch quant_scratch(int64_t M, int64_t K) {
  thread_local std::vector<int8_t> x8;
  thread_local std::vector<float> av, xsv;
  x8.resize(static_cast<size_t>(M * K));
  av.resize(static_cast<size_t>(M * (K / 32)));
  xsv.resize(static_cast<size_t>(M * (K / 32)));
  return {x8.data(), av.data(), xsv.data()};
}

#if defined(PASK_GEMV_AMX) && defined(__AMX_INT8__)
#define PASK_QUANT_AMX 1
// Decode rows over a tiled INT4 / INT8 weight on AMX-INT8 tiles. x is quantised per row and group of 32
// inputs (x8 = rne(x * 127 / absmax), a = absmax / 127; xs = the group's fp32 sum), then per output
// block and group: C = x8 (A: M rows x 32 s8) . codes (B: 8 rows of 16 outputs x 4 u8), and
// y += a s C + z xs in fp32, group after group (the order never depends on M: batch-invariant).
// Tiles: A 0 / 3, B 1 / 4, C 2 / 5 (two sets, alternating groups, so that one group's tile work
// overlaps the previous group's fp32 epilogue).
void quant_tile_config(int64_t M) {
  TileConfig cfg;
  for (int set = 0; set < 2; ++set) {
    cfg.rows[3 * set] = static_cast<uint8_t>(M), cfg.colsb[3 * set] = 32;
    cfg.rows[3 * set + 1] = 8, cfg.colsb[3 * set + 1] = 64;
    cfg.rows[3 * set + 2] = static_cast<uint8_t>(M), cfg.colsb[3 * set + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] bf16 -> x8 [M, K] s8, a [M, G], xs [M, G] (see above).
void quantize_rows(int64_t M, int64_t K, const uint16_t* x, int8_t* x8, float* a, float* xs) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* xp = x + m * K + 32 * g;
      const __m512 v0 = bf16x16(_mm256_loadu_si256((const __m256i*)xp));
      const __m512 v1 = bf16x16(_mm256_loadu_si256((const __m256i*)(xp + 16)));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      a[m * G + g] = amax / 127.0f;
      xs[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      const __m512 iv = _mm512_set1_ps(inv);
      _mm_storeu_si128((__m128i*)(x8 + m * K + 32 * g), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, iv))));
      _mm_storeu_si128((__m128i*)(x8 + m * K + 32 * g + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, iv))));
    }
}

// A per-thread buffer for the B tiles of G groups (64-byte aligned, kept across calls).
uint8_t* b_buffer(int64_t G) {
  thread_local std::vector<uint8_t> buf;
  buf.resize(static_cast<size_t>(G * 512) + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

template <int MT>
void quant_block(int64_t K, int64_t N, int64_t b, const int8_t* x8, const float* a, const float* xs, const uint8_t* codes,
                 const uint16_t* sz, const uint16_t* bias, uint16_t* y, int bits) {
  const int64_t G = K / 32;
  // B tiles of every group, unpacked before any tile reads them (a tile load right after the
  // stores that wrote its data waits for them)
  // INT8: the B tiles are the codes, read in place; INT4: unpacked here (see b_buffer)
  const uint8_t* bt = codes + b * G * 512;
  if (bits == 4) {
    uint8_t* buf = b_buffer(G);
    const __m512i m15 = _mm512_set1_epi8(15);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* c = tile_codes(codes, G, b, g, 4);
      for (int r = 0; r < 4; ++r) {
        const __m512i v = _mm512_loadu_si512(c + 64 * r);
        _mm512_store_si512(buf + g * 512 + 64 * r, _mm512_and_si512(v, m15));
        _mm512_store_si512(buf + g * 512 + 64 * (r + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
      }
    }
    bt = buf;
  }
  alignas(64) int32_t cb[2][16][16];  // C tiles, read one group behind
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  auto issue = [&](int64_t g) {
    if (g & 1) {
      _tile_loadd(3, x8 + 32 * g, K);
      _tile_loadd(4, bt + g * 512, 64);
      _tile_zero(5);
      _tile_dpbsud(5, 3, 4);
      _tile_stored(5, cb[1], 64);
    } else {
      _tile_loadd(0, x8 + 32 * g, K);
      _tile_loadd(1, bt + g * 512, 64);
      _tile_zero(2);
      _tile_dpbsud(2, 0, 1);
      _tile_stored(2, cb[0], 64);
    }
  };
  // group g + 1's tile work is issued before group g's products (stored a group earlier) are scaled
  issue(0);
  for (int64_t g = 0; g < G; ++g) {
    if (g + 1 < G) issue(g + 1);
    const uint16_t* s = tile_sz(sz, G, b, g);
    const __m512 sv = bf16x16(_mm256_loadu_si256((const __m256i*)s));
    const __m512 zv = bf16x16(_mm256_loadu_si256((const __m256i*)(s + 16)));
    for (int m = 0; m < MT; ++m) {
      const __m512 c = _mm512_cvtepi32_ps(_mm512_load_si512(cb[g & 1][m]));
      acc[m] = _mm512_fmadd_ps(c, _mm512_mul_ps(sv, _mm512_set1_ps(a[m * G + g])), acc[m]);
      acc[m] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xs[m * G + g]), acc[m]);
    }
  }
  const int nn = static_cast<int>(std::min<int64_t>(16, N - 16 * b));
  const __mmask16 keep = static_cast<__mmask16>(nn >= 16 ? 0xFFFF : (1u << nn) - 1);
  const __m512 bv = bias ? bf16x16(_mm256_maskz_loadu_epi16(keep, bias + 16 * b))
                         : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m], bv));
    _mm256_mask_storeu_epi16(y + m * N + 16 * b, keep, r);
  }
}

void quant_rows(int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1, const int8_t* x8, const float* a,
                const float* xs, const uint8_t* codes, const uint16_t* sz, const uint16_t* bias, uint16_t* y, int bits) {
  for (int64_t b = b0; b < b1; ++b) switch (M) {
#define PASK_Q_CASE(k) \
  case k: quant_block<k>(K, N, b, x8, a, xs, codes, sz, bias, y, bits); break;
      PASK_Q_CASE(1) PASK_Q_CASE(2) PASK_Q_CASE(3) PASK_Q_CASE(4) PASK_Q_CASE(5) PASK_Q_CASE(6)
      PASK_Q_CASE(7) PASK_Q_CASE(8) PASK_Q_CASE(9) PASK_Q_CASE(10) PASK_Q_CASE(11)
      PASK_Q_CASE(12) PASK_Q_CASE(13) PASK_Q_CASE(14) PASK_Q_CASE(15)
      default: quant_block<16>(K, N, b, x8, a, xs, codes, sz, bias, y, bits); break;
#undef PASK_Q_CASE
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(PASK_GEMV_BF16)
#define PASK_QUANT_AVX2 1
// ---- Decode rows over a tiled INT4 / INT8 weight on AVX2 integer dot products ----------------
// The AMX-INT8 kernel's arithmetic (above), on 8 lanes: x quantised per row and group of 32
// (x8 = rne(x * 127 / absmax), a = absmax / 127, xs = the group's fp32 sum, summed in
// _mm512_reduce_add_ps's order), C = x8 . codes exact in integers, y += a s C + z xs in fp32 group
// after group with the same fused operations, then + bias: bit for bit what the AMX kernel computes
// from the same bf16 input (x arrives as fp32 holding bf16 values). Lanes are 8 outputs (half a
// 16-output block): a tile row's 32 bytes hold each output's 4 codes for inputs 4 r .. 4 r + 3, so
// x's 4 bytes for those inputs, broadcast, meet them in pmaddubsw (u8 codes x s8 inputs, pairs
// summed in int16). Codes of 4 bits need nothing more: |pair| <= 2 * 15 * 127 and 8 tile rows sum
// to <= 30480, inside int16. Codes of 8 bits are split into nibbles, each summed that way, and joined
// in int32 as lo + 16 hi (pmaddwd). An INT8 weight thus costs two pmaddubsw per 32 products and
// no dequantisation; a row's sums never depend on its batch-mates.
std::atomic<int> int8_linear_wanted{[] {
  const char* e = std::getenv("PASK_INT8_LINEAR");
  return e != nullptr && e[0] == '0' ? 0 : 1;
}()};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return bf16x8(p); }

// x [M, K] fp32 or bf16 -> x8 [M, K] s8, a [M, G], xs [M, G] (quantize_rows's arithmetic).
template <typename In>
void quantize_rows_avx2(int64_t M, int64_t K, const In* x, int8_t* x8, float* a, float* xs) {
  const int64_t G = K / 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const In* xp = x + m * K + 32 * g;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load8(xp + 8 * j);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                      _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1)));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      a[m * G + g] = amax / 127.0f;
      // _mm512_reduce_add_ps(x[0:16] + x[16:32]): halves of 8, then 4, then lanes (0 + 2) + (1 + 3)
      const __m256 t3 = _mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[0], v[2]));
      const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
      const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
      xs[m * G + g] = _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));
      // saturating packs (as cvtsepi32_epi8), then the dwords back in input order
      const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8 + m * K + 32 * g), _mm256_permutevar8x32_epi32(b8, order));
    }
}

inline __m256i bcast4(const int8_t* p) {  // 4 bytes to every dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// s + p in int16, kept in a register as a running sum: without the empty asm, GCC re-associates the
// integer sums (all products first, spilled, then a tree), which runs 2x slower
inline __m256i add16(__m256i s, __m256i p) {
  s = _mm256_add_epi16(s, p);
  __asm__("" : "+x"(s));
  return s;
}

// Outputs 16 b + 8 h .. + 7 (those below N) of MT rows (x8 row stride K; y row stride N), BITS 4 or 8.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {  // rounded to bf16 as f2bf does (a NaN stays a quiet NaN)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(f2bf8(v), q, nan);
  const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(p16));
}

template <int MT, int BITS, typename Out>
void quant_half_avx2(int64_t K, int64_t N, int64_t b, int h, const int8_t* x8, const float* a, const float* xs,
                     const uint8_t* codes, const uint16_t* sz, const float* bias, Out* y) {
  const int64_t G = K / 32;
  const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = tile_codes(codes, G, b, g, BITS) + 32 * h;
    const int8_t* xg = x8 + 32 * g;
    __m256i C[MT];
    if constexpr (BITS == 4) {
      __m256i S[MT];
      for (int m = 0; m < MT; ++m) S[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {  // byte of row r: tile row r (low nibble), r + 4 (high)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r));
        const __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        for (int m = 0; m < MT; ++m) {
          S[m] = add16(S[m], _mm256_maddubs_epi16(lo, bcast4(xg + m * K + 4 * r)));
          S[m] = add16(S[m], _mm256_maddubs_epi16(hi, bcast4(xg + m * K + 4 * r + 16)));
        }
      }
      for (int m = 0; m < MT; ++m) C[m] = _mm256_madd_epi16(S[m], ones);
    } else {  // both nibbles' sums in registers, each broadcast of x serving two products
      __m256i L[MT], H[MT];
      for (int m = 0; m < MT; ++m) L[m] = H[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r));
        const __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
        for (int m = 0; m < MT; ++m) {
          const __m256i xb = bcast4(xg + m * K + 4 * r);
          L[m] = add16(L[m], _mm256_maddubs_epi16(lo, xb));
          H[m] = add16(H[m], _mm256_maddubs_epi16(hi, xb));
        }
      }
      for (int m = 0; m < MT; ++m)
        C[m] = _mm256_add_epi32(_mm256_madd_epi16(L[m], ones), _mm256_slli_epi32(_mm256_madd_epi16(H[m], ones), 4));
    }
    const uint16_t* s = tile_sz(sz, G, b, g) + 8 * h;
    const __m256 sv = bf16x8(s), zv = bf16x8(s + 16);
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(C[m]), _mm256_mul_ps(sv, _mm256_set1_ps(a[m * G + g])), acc[m]);
      acc[m] = _mm256_fmadd_ps(zv, _mm256_set1_ps(xs[m * G + g]), acc[m]);
    }
  }
  const int64_t n0 = 16 * b + 8 * h;
  if (n0 + 8 <= N) {
    const __m256 bv = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) store8(y + m * N + n0, _mm256_add_ps(acc[m], bv));
    return;
  }
  const int nn = static_cast<int>(N - n0);  // the last outputs: fewer than 8
  alignas(32) Out out[8];
  alignas(32) float bv[8] = {};
  if (bias)
    for (int i = 0; i < nn; ++i) bv[i] = bias[n0 + i];
  for (int m = 0; m < MT; ++m) {
    store8(out, _mm256_add_ps(acc[m], _mm256_load_ps(bv)));
    for (int i = 0; i < nn; ++i) y[m * N + n0 + i] = out[i];
  }
}

// Output blocks [b0, b1), both halves, M rows 4 at a time (two int16 sums per row in registers).
template <int BITS, typename Out>
void quant_rows_bits(int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1, const int8_t* x8, const float* a,
                     const float* xs, const uint8_t* codes, const uint16_t* sz, const float* bias, Out* y) {
  const int64_t G = K / 32;
  for (int64_t b = b0; b < b1; ++b)
    for (int h = 0; h < 2 && 16 * b + 8 * h < N; ++h)
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int8_t* xq = x8 + m0 * K;
        const float *ap = a + m0 * G, *xp = xs + m0 * G;
        Out* yp = y + m0 * N;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: quant_half_avx2<1, BITS, Out>(K, N, b, h, xq, ap, xp, codes, sz, bias, yp); break;
          case 2: quant_half_avx2<2, BITS, Out>(K, N, b, h, xq, ap, xp, codes, sz, bias, yp); break;
          case 3: quant_half_avx2<3, BITS, Out>(K, N, b, h, xq, ap, xp, codes, sz, bias, yp); break;
          default: quant_half_avx2<4, BITS, Out>(K, N, b, h, xq, ap, xp, codes, sz, bias, yp); break;
        }
      }
}

// y = x W^T + b for M <= 16 decode rows (fp32 or bf16 in and out): x quantised once, then the
// 16-output blocks in chunks of 4 over the threads.
template <typename In, typename Out>
void quant_linear_avx2(int64_t M, int64_t K, int64_t N, const In* x, const uint8_t* codes, const uint16_t* sz,
                       const float* bias, Out* y, int bits, int nthreads) {
  const QuantScratch q = quant_scratch(M, K);
  quantize_rows_avx2(M, K, x, q.x8, q.a, q.xs);
  const int8_t* xq = q.x8;
  const float *ap = q.a, *xp = q.xs;
  const int64_t blocks = (N + 15) / 16, chunks = (blocks + 3) / 4;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads > 0 ? nthreads : 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b0 = 4 * c, b1 = std::min(blocks, 4 * (c + 1));
    if (bits == 4)
      quant_rows_bits<4, Out>(M, K, N, b0, b1, xq, ap, xp, codes, sz, bias, y);
    else
      quant_rows_bits<8, Out>(M, K, N, b0, b1, xq, ap, xp, codes, sz, bias, y);
  }
}
#endif

// Columns in chunks of NC for the fp32 path. Where x is much larger than L1 (e.g. 8 rows of a
// 4864-wide MLP input), the reduction runs in slices of 512 so that a slice of x stays in L1 while
// the chunk's weight rows stream past it; otherwise slicing only breaks the weight stream (measured
// on a 2-core AMD EPYC: 1.5x faster at 8 rows x 4864, 2x slower at 1 row). The slices keep their
// accumulators, so the sums do not depend on whether (or how) the reduction was sliced.
constexpr int64_t NC = 64;

// Columns [n0, n1) of the fp32 path (w points at row n0's weights).
void fp32_columns(int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, const float* x, const uint16_t* w,
                  const float* bias, float* y) {
#if defined(PASK_GEMV_SLICES)
  const int64_t KB = M * K * 4 > 65536 ? 512 : K;
  alignas(32) __m256 keep[NC * MAXR * U];  // accumulators of the chunk's columns between slices
#endif
  for (int64_t m0 = 0; m0 < M; m0 += MAXR) {
    const int mt = static_cast<int>(std::min<int64_t>(MAXR, M - m0));
#if defined(PASK_GEMV_SLICES)
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t kn = std::min(KB, K - k0);
      for (int64_t n = n0; n < n1; ++n)
        rows(mt, x + m0 * K + k0, K, kn, w + (n - n0) * K + k0, y + m0 * N + n, N, bias ? bias[n] : 0.0f,
             keep + (n - n0) * MAXR * U, k0 == 0, k0 + kn >= K);
    }
#else
    for (int64_t n = n0; n < n1; ++n) rows(mt, x + m0 * K, K, K, w + (n - n0) * K, y + m0 * N + n, N, bias ? bias[n] : 0.0f);
#endif
  }
}

}  // namespace

#if defined(PASK_GEMV_AMX)
std::atomic<int> amx_wanted{[] {
  const char* e = std::getenv("PASK_AMX");
  return e != nullptr && e[0] == '0' ? 0 : 1;
}()};
bool gemv_amx_wanted() { return amx_wanted.load(std::memory_order_relaxed) != 0; }
#endif

extern "C" {

// Turns the AMX path of pask_linear_bf16_io on or off; returns whether it is on now.
int pask_gemv_use_amx(int want) {
#if defined(PASK_GEMV_AMX)
  amx_wanted.store(want != 0 ? 1 : 0);
  return want != 0 && amx_granted() ? 1 : 0;
#else
  (void)want;
  return 0;
#endif
}

// Whether pask_linear_bf16_io runs (CPUs with AVX512-BF16): 1, else 0.
int pask_gemv_has_bf16_io() {
#if defined(PASK_GEMV_BF16)
  return 1;
#else
  return 0;
#endif
}

// y = x W^T + b, all bf16 (x [M, K], W [N, K], b [N] or null, y [M, N]); products exact in fp32,
// sums in fp32, y rounded to nearest even once. Returns 0, or -1 (unsupported shape, or no
// AVX512-BF16 build: nothing written).
int pask_linear_bf16_io(int64_t M, int64_t K, int64_t N, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                        uint16_t* y, int nthreads) {
#if defined(PASK_GEMV_BF16)
  if (M <= 0 || K <= 0 || N <= 0 || K % 8 != 0) return -1;
  const int nt = nthreads > 0 ? nthreads : 1;
#if defined(PASK_GEMV_AMX)
  if (M <= 16 && K % 32 == 0 && N >= 16 && gemv_amx_wanted() && amx_granted()) {
    const uint32_t* xt = pack_pairs(M, K, x);
    // chunks of 64 weight rows, handed out dynamically: a thread that loses its core for a while
    // (the server's own threads share it) does not hold the whole layer back
    const int64_t blocks = N / 16, tail = blocks * 16, chunks = (blocks + 3) / 4;
#pragma omp parallel num_threads(nt)
    {
      tile_config(M);
#pragma omp for schedule(dynamic, 4)
      for (int64_t c = 0; c < chunks; ++c)
        tile_rows(M, K, N, 64 * c, std::min(tail, 64 * (c + 1)), xt, w + 64 * c * K, bias, y);
      _tile_release();
    }
    if (tail < N) pair_rows_range(M, K, N, tail, N, x, w + tail * K, bias, y);
    return 0;
  }
#endif
  const int64_t chunks = (N + 63) / 64;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t c = 0; c < chunks; ++c) pair_rows_range(M, K, N, 64 * c, std::min(N, 64 * (c + 1)), x, w + 64 * c * K, bias, y);
  return 0;
#else
  (void)M, (void)K, (void)N, (void)x, (void)w, (void)bias, (void)y, (void)nthreads;
  return -1;
#endif
}

// The instruction set the kernel was compiled for.
const char* pask_gemv_isa() {
#if defined(PASK_GEMV_AMX)
  return amx_granted() && gemv_amx_wanted() ? "avx512bf16+amx" : "avx512bf16";
#elif defined(PASK_GEMV_BF16)
  return "avx512bf16";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

// Returns 0, or -1 for an unsupported shape (K not a multiple of 8, or a non-positive size).
int pask_linear_bf16(int64_t M, int64_t K, int64_t N, const float* x, const uint16_t* w, const float* bias, float* y,
                     int nthreads) {
  if (M <= 0 || K <= 0 || N <= 0 || K % 8 != 0) return -1;
  const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
  for (int64_t c = 0; c < chunks; ++c) fp32_columns(M, K, N, c * NC, std::min(N, (c + 1) * NC), x, w + c * NC * K, bias, y);
  return 0;
}

// ---- INT4 / INT8 weights (weight-only quantisation, one (scale, zero) per 32 inputs of an output) --
// The tiled layout above; bits 4 or 8. A weight is bf16(fma(code, scale, zero)) where the bf16
// kernels run over 64 dequantised rows at a time (a per-thread buffer, L2-resident): bit for bit
// the bf16 kernel's product over pask_dequant_q's weight, and as batch-invariant.

// bf16 rows [n0, n1) of a tiled weight (n0 % 16 == 0) into out [n1 - n0, K].
int pask_dequant_q(int64_t K, int64_t n0, int64_t n1, const uint8_t* codes, const uint16_t* sz, uint16_t* out, int bits,
                   int nthreads) {
  if (K <= 0 || K % 32 != 0 || n0 < 0 || n0 % 16 != 0 || n1 < n0 || (bits != 4 && bits != 8)) return -1;
  const int64_t chunks = (n1 - n0 + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t a = n0 + 64 * c;
    dequant_tiled(K, a, std::min(n1, a + 64), codes, sz, out + (a - n0) * K, bits);
  }
  return 0;
}

// y = x W^T + b, fp32 x / b / y (pask_linear_bf16's arithmetic) over a tiled weight of N outputs; K % 32 == 0.
int pask_linear_q(int64_t M, int64_t K, int64_t N, const float* x, const uint8_t* codes, const uint16_t* sz,
                  const float* bias, float* y, int bits, int nthreads) {
  if (M <= 0 || K <= 0 || N <= 0 || K % 32 != 0 || (bits != 4 && bits != 8)) return -1;
#if defined(PASK_QUANT_AVX2)
  if (M <= 16 && int8_linear_wanted.load(std::memory_order_relaxed) != 0) {
    quant_linear_avx2(M, K, N, x, codes, sz, bias, y, bits, nthreads);
    return 0;
  }
#endif
  const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * NC, n1 = std::min(N, n0 + NC);
    uint16_t* wb = row_buffer(NC, K);
    dequant_tiled(K, n0, n1, codes, sz, wb, bits);
    fp32_columns(M, K, N, n0, n1, x, wb, bias, y);
  }
  return 0;
}

// y = x W^T + b, all bf16, over a tiled weight of N outputs; K % 32 == 0. With AMX-INT8 tiles and
// M <= 16: the tile kernel above (x quantised to int8 per group of 32); otherwise the bf16 kernels
// over 64 dequantised rows at a time (pask_linear_bf16_io's arithmetic). On AVX2 builds: the
// int8-activation kernel for M <= 16 (when on), else -1 (nothing written: pask_linear_q's turn);
// -1 on other builds.
int pask_linear_q_io(int64_t M, int64_t K, int64_t N, const uint16_t* x, const uint8_t* codes, const uint16_t* sz,
                     const uint16_t* bias, uint16_t* y, int bits, int nthreads) {
#if defined(PASK_GEMV_BF16)
  if (M <= 0 || K <= 0 || N <= 0 || K % 32 != 0 || (bits != 4 && bits != 8)) return -1;
  const int nt = nthreads > 0 ? nthreads : 1;
#if defined(PASK_QUANT_AMX)
  if (M <= 16 && gemv_amx_wanted() && amx_granted()) {
    const QuantScratch q = quant_scratch(M, K);
    quantize_rows(M, K, x, q.x8, q.a, q.xs);
    const int8_t* xq = q.x8;
    const float *ap = q.a, *xp = q.xs;
    const int64_t blocks = (N + 15) / 16, chunks = (blocks + 3) / 4;
#pragma omp parallel num_threads(nt)
    {
      quant_tile_config(M);
#pragma omp for schedule(dynamic, 4)
      for (int64_t c = 0; c < chunks; ++c)
        quant_rows(M, K, N, 4 * c, std::min(blocks, 4 * (c + 1)), xq, ap, xp, codes, sz, bias, y, bits);
      _tile_release();
    }
    return 0;
  }
#endif
  const int64_t chunks = (N + 63) / 64;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = 64 * c, n1 = std::min(N, 64 * (c + 1));
    uint16_t* wb = row_buffer(64, K);
    dequant_tiled(K, n0, n1, codes, sz, wb, bits);
    pair_rows_range(M, K, N, n0, n1, x, wb, bias, y);
  }
  return 0;
#elif defined(PASK_QUANT_AVX2)
  // AVX2: decode rows on the int8-activation kernel, bf16 in and out (no fp32 copies of x and y);
  // anything else is left to pask_linear_q (-1, nothing written)
  if (M <= 0 || M > 16 || K <= 0 || N <= 0 || K % 32 != 0 || (bits != 4 && bits != 8) ||
      int8_linear_wanted.load(std::memory_order_relaxed) == 0)
    return -1;
  thread_local std::vector<float> bf;
  if (bias) {
    bf.resize(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) bf[n] = bf2f(bias[n]);
  }
  quant_linear_avx2(M, K, N, x, codes, sz, bias ? bf.data() : nullptr, y, bits, nthreads);
  return 0;
#else
  (void)M, (void)K, (void)N, (void)x, (void)codes, (void)sz, (void)bias, (void)y, (void)bits, (void)nthreads;
  return -1;
#endif
}

// The kernel for decode rows over a tiled weight: "amx-int8", "avx2-int8" (both int8 activations per
// group of 32) or "dequant" (the bf16 / fp32 kernels over dequantised rows).
const char* pask_q_kernel() {
#if defined(PASK_QUANT_AMX)
  if (gemv_amx_wanted() && amx_granted()) return "amx-int8";
#endif
#if defined(PASK_QUANT_AVX2)
  if (int8_linear_wanted.load(std::memory_order_relaxed) != 0) return "avx2-int8";
#endif
  return "dequant";
}

// Turns the AVX2 integer path of pask_linear_q on or off (want >= 0) and returns whether it is on
// (0 where the build has none); want < 0 only reads.
int pask_q_use_int8(int want) {
#if defined(PASK_QUANT_AVX2)
  if (want >= 0) int8_linear_wanted.store(want != 0 ? 1 : 0);
  return int8_linear_wanted.load(std::memory_order_relaxed);
#else
  (void)want;
  return 0;
#endif
}

}  // extern "C"

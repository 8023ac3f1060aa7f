// Tiered decode attention on the CPU: one query token per sequence over its BF16 (H), packed INT4
// (L) and packed INT2 (L2) tiers, the three streams merged in one FP32 online softmax. Plain C ABI (loaded with ctypes
// by pask/kv/native_attention.py), one call per layer for the whole batch, parallel over
// (sequence, kv head) with OpenMP. Layouts are the TieredCache's (pask/kv/storage.py):
//
//   H tier   k, v   [Hkv, hcap, D] bf16, hn live slots
//   L tier   kq     [Hkv, lcap/64, D, 32] u8: 64-slot blocks, d-major; byte j of row d holds
//                   slot j (low nibble) and slot j + 32 (high nibble); k' = (c - 8) * scale + zero
//            ksz    [Hkv, D/32, lcap, 2] bf16 (scale, zero) per key group
//            vq     [Hkv, D/32, lcap, 16] u8: a group's 32 value codes as adjacent pairs
//            vs, vz [Hkv, D/32, lcap] bf16: v = c * scale + zero
//            kbal   [Hkv, 2, D] f32 (mid, bal): k = k' * bal + mid
//   L2 tier (INT2): kq [Hkv, lcap, D/4] u8, token-major, byte j holds codes
//            4j..4j+3 at bit offsets 0, 2, 4, 6; k' = (c - 2) * scale + zero; ksz as above;
//            K4V2 (kbits2 = 4): kq as the L tier's (blocked, d-major INT4), k' = (c - 8) * scale + zero;
//            vq [Hkv, D/32, lcap, 8] u8 (a group's 32 codes, four per byte); vs, vz as above
//
// Scores of INT4 keys never dequantise a key: with qs = q * bal * scaling,
//   q.k * scaling = sum_g [scale_g * (qs_g . c_g) + (zero_g - 8 scale_g) * sum(qs_g)] + q.mid * scaling,
// so a 64-slot block costs one pass over its codes for all the query rows of its kv head (GQA).
// Values: sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t per group.
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PASK_AVX2 1  // 8-lane kernels for CPUs without AVX-512 (e.g. AMD Zen 2/3)
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
#define PASK_AMX 1  // both tiers on AMX tiles (Sapphire Rapids and later), if the OS grants tile state
#include <cstdlib>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace {

using pask_native::bf2f;
#if defined(__AVX512F__)
using pask_native::hsum16;
#endif
#if defined(PASK_AMX)
using pask_native::amx_granted;
using pask_native::TileConfig;
#endif

constexpr int BT = 64;    // tokens per block (the INT4 key code block)
constexpr int QG = 32;    // quantisation group along head_dim
constexpr int MAXD = 128; // largest head_dim served
constexpr int MAXR = 16;  // largest number of query rows per kv head

// The AVX2 build's integer path for the INT4 tier (scores with int8 query rows, values with u8
// weights; pmaddubsw): on unless PASK_INT8_ATTENTION=0 at load or pask_attention_use_int8(0).
// Its numerics are not FP32-level (bounded in tests/test_int8_attention.py; on BFCL-600 against
// the exact path: benchmarks/results/kernel-int8-bfcl/); the exact path is one switch away.
#if defined(PASK_AVX2)
std::atomic<int> int8_wanted{[] {
  const char* e = std::getenv("PASK_INT8_ATTENTION");
  return e != nullptr && e[0] == '0' ? 0 : 1;
}()};
#endif

// exp for x <= 88 (Cephes expf polynomial, ~1 ulp); vectorises (no libm call).
inline float fexp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return p * s;
}

#if defined(__AVX512F__)
// exp on 16 lanes for x <= 88 (inputs below -87 give exp(-87)): 2^y, y = x log2(e), as 2^n p(y - n)
// with n = round(y) and p a degree-5 fit of 2^f on [-0.5, 0.5] (relative error < 2e-7, against
// fexp's ~1 ulp; the rounding of y adds ~|y| 6e-8), scaled by vscalefps. Ten operations against
// the Cody-Waite / Cephes form's sixteen: the softmax's exp is a fixed cost per (query row, slot)
// that the INT4 tier's bytes do not shrink.
inline __m512 fexp16(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3264620210975409e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671480394899845e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733581185341e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242426872253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470036506653e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#elif defined(PASK_AVX2)
inline __m256 fexp8(__m256 x) {  // fexp on 8 lanes
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// e^x to ~9e-5 relative for the integer INT4 path, whose u8 weights keep 1/255 of the largest
// (2^(x log2 e): floor, a cubic for 2^f on [0, 1), the exponent bits); x clamped at -87.
inline __m256 fexp8_fast(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.07706861f), f, _mm256_set1_ps(0.22765176f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69511112f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
}

inline float hadd8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}
#endif

struct Seq {
  const uint16_t *kh, *vh;
  int64_t hcap, hn;
  const uint8_t *kq, *vq;
  const uint16_t *ksz, *vs, *vz;
  int64_t lcap, ln;
  const float *kbal;
};

// Running state of one kv head's query rows: max, sum, outputs (H part and the L part's
// even/odd code accumulators and per-group zero sums).
struct State {
  int grp, D, G;
  alignas(64) float m[MAXR];
  alignas(64) float l[MAXR];
  alignas(64) float acc[MAXR][MAXD];
  alignas(64) float even[MAXR][MAXD / 2];
  alignas(64) float odd[MAXR][MAXD / 2];
  alignas(64) float zs[MAXR][MAXD / QG];
  alignas(64) float sc[MAXR][BT];  // scores of the current block, then its probabilities
  float* trace = nullptr;  // if set: every block's scores, row r at trace + r * tstride (stream order)
  bool amx = false;        // INT4 tier on AMX tiles (tile config loaded for this task)
  int64_t tstride = 0, toff = 0;

  void init(int g_, int d_) {
    grp = g_;
    D = d_;
    G = d_ / QG;
    toff = 0;
    for (int r = 0; r < grp; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
      std::fill(acc[r], acc[r] + D, 0.0f);
      std::fill(even[r], even[r] + D / 2, 0.0f);
      std::fill(odd[r], odd[r] + D / 2, 0.0f);
      std::fill(zs[r], zs[r] + G, 0.0f);
    }
  }

  // Online-softmax step over sc[r][0..nt): rescale the running state, turn scores into weights
  // (weights of slots nt..BT-1 are set to 0).
  void absorb(int nt, [[maybe_unused]] bool fast = false) {
    if (trace != nullptr) {
      for (int r = 0; r < grp; ++r) std::copy(sc[r], sc[r] + nt, trace + r * tstride + toff);
      toff += nt;
    }
    for (int r = 0; r < grp; ++r) {
      float* s = sc[r];
      const float mn = std::max(m[r], block_max(s, nt));
      if (mn == -INFINITY) {  // every score -inf so far: nothing to weigh
        std::fill(s, s + BT, 0.0f);
        continue;
      }
      rescale(r, mn);
#if defined(PASK_AVX2)
      if (fast) {
        l[r] += exp_block_fast(s, nt, mn);
        continue;
      }
#endif
      l[r] += exp_block(s, nt, mn);
    }
  }

  // Row r's running state (sum, outputs) rescaled to a new maximum mn >= m[r] (no-op if equal).
  void rescale(int r, float mn) {
    if (!(mn > m[r])) return;
    const float a = m[r] == -INFINITY ? 0.0f : fexp(m[r] - mn);
    l[r] *= a;
    for (int d = 0; d < D; ++d) acc[r][d] *= a;
    for (int d = 0; d < D / 2; ++d) even[r][d] *= a;
    for (int d = 0; d < D / 2; ++d) odd[r][d] *= a;
    for (int g = 0; g < G; ++g) zs[r][g] *= a;
    m[r] = mn;
  }

#if defined(__AVX512F__)
  static __mmask16 tail(int nt, int c) {
    const int k = nt - 16 * c;
    return k >= 16 ? 0xFFFF : k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1);
  }
  static float block_max(const float* s, int nt) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c * 16 < nt; ++c) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail(nt, c), s + 16 * c));
    return _mm512_reduce_max_ps(mv);
  }
  static float exp_block(float* s, int nt, float mn) {
    __m512 sum = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mn);
    for (int c = 0; c < BT / 16; ++c) {
      const __m512 p = _mm512_maskz_mov_ps(tail(nt, c), fexp16(_mm512_sub_ps(_mm512_load_ps(s + 16 * c), m)));
      _mm512_store_ps(s + 16 * c, p);
      sum = _mm512_add_ps(sum, p);
    }
    return _mm512_reduce_add_ps(sum);
  }
#elif defined(PASK_AVX2)
  static float block_max(const float* s, int nt) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 8 <= nt; t += 8) mv = _mm256_max_ps(mv, _mm256_load_ps(s + t));
    float mb = hmax8(mv);
    for (; t < nt; ++t) mb = s[t] > mb ? s[t] : mb;
    return mb;
  }
  static float exp_block(float* s, int nt, float mn) {
    __m256 sum = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(mn);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int t = 0; t < BT; t += 8) {  // slots >= nt get weight 0
      const __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(t))),
                                        _mm256_set1_ps(static_cast<float>(nt)), _CMP_LT_OQ);
      const __m256 p = _mm256_and_ps(live, fexp8(_mm256_sub_ps(_mm256_load_ps(s + t), m)));
      _mm256_store_ps(s + t, p);
      sum = _mm256_add_ps(sum, p);
    }
    return hadd8(sum);
  }
  // exp_block with fexp8_fast (the integer INT4 path), the live-slot mask only on a partial block
  static float exp_block_fast(float* s, int nt, float mn) {
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 m = _mm256_set1_ps(mn);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int t = 0; t < BT; t += 8) {
      __m256 p = fexp8_fast(_mm256_sub_ps(_mm256_load_ps(s + t), m));
      if (nt < BT)
        p = _mm256_and_ps(_mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(t))),
                                        _mm256_set1_ps(static_cast<float>(nt)), _CMP_LT_OQ), p);
      _mm256_store_ps(s + t, p);
      sum[(t / 8) & 1] = _mm256_add_ps(sum[(t / 8) & 1], p);
    }
    return hadd8(_mm256_add_ps(sum[0], sum[1]));
  }
#else
  static float block_max(const float* s, int nt) {
    float mb = -INFINITY;
    for (int t = 0; t < nt; ++t) mb = s[t] > mb ? s[t] : mb;
    return mb;
  }
  static float exp_block(float* s, int nt, float mn) {
    float sum = 0.0f;
    for (int t = 0; t < BT; ++t) {
      const float p = t < nt ? fexp(s[t] - mn) : 0.0f;
      s[t] = p;
      sum += p;
    }
    return sum;
  }
#endif

  // The final softmax weights of the traced scores, averaged over the query rows: p[0..tstride).
  void weights(float* p) const {
    for (int64_t t = 0; t < tstride; ++t) p[t] = 0.0f;
    for (int r = 0; r < grp; ++r) {
      if (!(l[r] > 0.0f)) continue;
      const float inv = 1.0f / (l[r] * static_cast<float>(grp));
      const float* s = trace + r * tstride;
      for (int64_t t = 0; t < tstride; ++t) p[t] += fexp(s[t] - m[r]) * inv;
    }
  }

  void write(float* out) const {
    for (int r = 0; r < grp; ++r) {
      float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      float* o = out + static_cast<int64_t>(r) * D;
      for (int g = 0; g < G; ++g) {
        for (int j = 0; j < QG / 2; ++j) {
          int d = g * QG + 2 * j;
          o[d] = (acc[r][d] + even[r][g * (QG / 2) + j] + zs[r][g]) * inv;
          o[d + 1] = (acc[r][d + 1] + odd[r][g * (QG / 2) + j] + zs[r][g]) * inv;
        }
      }
    }
  }
};

#if defined(__AVX512F__)
// ---- AVX-512 kernels (D = 64 or 128) --------------------------------------------------------

inline __m512 bf16x16(const uint16_t* p) {  // 16 bf16 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// scores sc[r][0..nt) = scaling * q_r . k_t over BF16 keys K (token-major, D values each)
template <int D>
void h_scores(State& st, const uint16_t* qb, float scaling, const uint16_t* K, int nt) {
  for (int r = 0; r < st.grp; ++r) {
    const uint16_t* qr = qb + r * D;
#if defined(__AVX512BF16__)
    __m512bh qv[D / 32];
    for (int c = 0; c < D / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
#else
    __m512 qv[D / 16];
    for (int c = 0; c < D / 16; ++c) qv[c] = bf16x16(qr + 16 * c);
#endif
    for (int t0 = 0; t0 < nt; t0 += 16) {
      __m512 part[16];
      for (int i = 0; i < 16; ++i) {
        __m512 acc = _mm512_setzero_ps();
        if (t0 + i < nt) {
          const uint16_t* k = K + static_cast<int64_t>(t0 + i) * D;
#if defined(__AVX512BF16__)
          for (int c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
#else
          for (int c = 0; c < D / 16; ++c) acc = _mm512_fmadd_ps(qv[c], bf16x16(k + 16 * c), acc);
#endif
        }
        part[i] = acc;
      }
      _mm512_store_ps(st.sc[r] + t0, _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scaling)));
    }
  }
}

// acc[r] += sum_t p[r][t] v_t over BF16 values V (token-major)
template <int D>
void h_values(State& st, const uint16_t* V, int nt) {
  constexpr int C = D / 16, RC = D == 64 ? 4 : 2;
  for (int r0 = 0; r0 < st.grp; r0 += RC) {
    const int rn = std::min(RC, st.grp - r0);
    __m512 acc[RC][C];
    for (int r = 0; r < rn; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_load_ps(st.acc[r0 + r] + 16 * c);
    for (int t = 0; t < nt; ++t) {
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = bf16x16(V + static_cast<int64_t>(t) * D + 16 * c);
      for (int r = 0; r < rn; ++r) {
        const __m512 p = _mm512_set1_ps(st.sc[r0 + r][t]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rn; ++r)
      for (int c = 0; c < C; ++c) _mm512_store_ps(st.acc[r0 + r] + 16 * c, acc[r][c]);
  }
}

// sc[r][t] += scale_t * (qs_r . c_t) + off_t * qsum_r for the 64 slots of block `blk`, group g
template <int D>
void l_scores_group(State& st, const float (*qs)[MAXD], const float* qsum_g, const uint8_t* KQ, int64_t blk,
                    int g, const float* scl, const float* off) {
  alignas(64) float cb[QG][BT];
  const __m512i m15 = _mm512_set1_epi32(15);
  for (int d = 0; d < QG; ++d) {
    const uint8_t* row = KQ + (blk * D + g * QG + d) * (BT / 2);
    for (int h = 0; h < 2; ++h) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * h)));
      _mm512_store_ps(cb[d] + 16 * h, _mm512_cvtepi32_ps(_mm512_and_si512(b, m15)));
      _mm512_store_ps(cb[d] + 32 + 16 * h, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
    }
  }
  constexpr int RC = 4;
  for (int r0 = 0; r0 < st.grp; r0 += RC) {
    const int rn = std::min(RC, st.grp - r0);
    __m512 acc[RC][4];
    for (int r = 0; r < RC; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int d = 0; d < QG; ++d) {
      const __m512 c0 = _mm512_load_ps(cb[d]), c1 = _mm512_load_ps(cb[d] + 16), c2 = _mm512_load_ps(cb[d] + 32),
                   c3 = _mm512_load_ps(cb[d] + 48);
      for (int r = 0; r < rn; ++r) {
        const __m512 q = _mm512_set1_ps(qs[r0 + r][g * QG + d]);
        acc[r][0] = _mm512_fmadd_ps(q, c0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(q, c1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(q, c2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(q, c3, acc[r][3]);
      }
    }
    for (int r = 0; r < rn; ++r) {
      const __m512 qg = _mm512_set1_ps(qsum_g[r0 + r]);
      float* s = st.sc[r0 + r];
      for (int c = 0; c < 4; ++c) {
        __m512 x = _mm512_fmadd_ps(_mm512_load_ps(off + 16 * c), qg, _mm512_load_ps(s + 16 * c));
        _mm512_store_ps(s + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(scl + 16 * c), acc[r][c], x));
      }
    }
  }
}

// even/odd[r] += sum_t p[r][t] * vs_t * codes_t for group g of the block; zs[r][g] += sum_t p[r][t] vz_t
void l_values_group(State& st, const uint8_t* vq, const float* vs, const float* vz, int nt, int g) {
  alignas(64) float w[MAXR][BT];
  for (int r = 0; r < st.grp; ++r) {  // weights past nt are 0 (absorb)
    __m512 z = _mm512_setzero_ps();
    for (int c = 0; c < BT / 16; ++c) {
      const __m512 p = _mm512_load_ps(st.sc[r] + 16 * c);
      _mm512_store_ps(w[r] + 16 * c, _mm512_mul_ps(p, _mm512_load_ps(vs + 16 * c)));
      z = _mm512_fmadd_ps(p, _mm512_load_ps(vz + 16 * c), z);
    }
    st.zs[r][g] += _mm512_reduce_add_ps(z);
  }
  const __m512i m15 = _mm512_set1_epi32(15);
  constexpr int RC = 8;
  for (int r0 = 0; r0 < st.grp; r0 += RC) {
    const int rn = std::min(RC, st.grp - r0);
    __m512 ev[RC], od[RC];
    for (int r = 0; r < rn; ++r) {
      ev[r] = _mm512_load_ps(st.even[r0 + r] + g * (QG / 2));
      od[r] = _mm512_load_ps(st.odd[r0 + r] + g * (QG / 2));
    }
    for (int t = 0; t < nt; ++t) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(vq + static_cast<int64_t>(t) * (QG / 2))));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, m15));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      for (int r = 0; r < rn; ++r) {
        const __m512 p = _mm512_set1_ps(w[r0 + r][t]);
        ev[r] = _mm512_fmadd_ps(p, lo, ev[r]);
        od[r] = _mm512_fmadd_ps(p, hi, od[r]);
      }
    }
    for (int r = 0; r < rn; ++r) {
      _mm512_store_ps(st.even[r0 + r] + g * (QG / 2), ev[r]);
      _mm512_store_ps(st.odd[r0 + r] + g * (QG / 2), od[r]);
    }
  }
}

#if defined(PASK_AMX)
// ---- AMX tile helpers (the tier kernels h_stream_amx / l_stream_amx follow balanced_query) ------
// Every tile is 64 bytes wide; B tiles hold bf16 in the VNNI pair layout (row = a pair along the
// reduced axis, 16 columns of two bf16). FP32 operands are split into hi + lo bf16 rows (~2^-17).

// Whether the AMX path runs: compiled in, tile state granted by the OS, and not turned off
// (PASK_AMX=0 at load, or pask_attention_use_amx(0)).
std::atomic<int> amx_wanted{[] {
  const char* e = std::getenv("PASK_AMX");
  return e != nullptr && e[0] == '0' ? 0 : 1;
}()};

bool amx_enabled() { return amx_wanted.load(std::memory_order_relaxed) != 0 && amx_granted(); }

// Every tile 64 bytes wide; A (0, 1) and C (4..7) tiles of `rows` rows, B (2, 3) tiles of 16.
void amx_config(int rows) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = static_cast<uint8_t>(i == 2 || i == 3 ? 16 : rows);
  }
  _tile_loadconfig(&cfg);
}

void amx_begin(int grp) { amx_config(2 * grp); }  // A and C: hi parts over lo parts

// word i -> bf16(i & 15): vpermw reads bits 0..4 of each index word, so a byte whose low nibble is
// the code indexes it directly (bit 4, the next nibble's, is ignored by the table's repeat).
alignas(64) constexpr uint16_t kCodeBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
    0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// byte permutation: output word 2i <- src byte a + i, word 2i + 1 <- src byte b + i (i < 16)
struct PairIndex {
  alignas(64) uint8_t x[64] = {};
  constexpr PairIndex(int a, int b) {
    for (int i = 0; i < 16; ++i) {
      x[4 * i] = static_cast<uint8_t>(a + i);
      x[4 * i + 2] = static_cast<uint8_t>(b + i);
    }
  }
  __m512i load() const { return _mm512_load_si512(x); }
};
constexpr PairIndex kRows0(0, 32), kRows1(16, 48);  // key codes: slots 0..15 / 16..31 of rows d, d + 1
constexpr PairIndex kSlots0(0, 16), kSlots1(32, 48);  // value codes: slot pairs (0, 1) / (2, 3)

inline __m512i code_table() { return _mm512_load_si512(kCodeBf16); }

inline __m512i codes_bf16(__m512i idx, __m512i src, __m512i table) {
  return _mm512_permutexvar_epi16(_mm512_permutexvar_epi8(idx, src), table);
}

// x[0..32) fp32 -> hi, lo bf16 rows with x ~= hi + lo
inline void split_bf16(const float* x, uint16_t* hi, uint16_t* lo) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
  const __m512i hi16 = (__m512i)h;
  const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi16)), 16));
  const __m512 hb =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi16, 1)), 16));
  _mm512_storeu_si512(hi, hi16);
  _mm512_storeu_si512(lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
}

// x[0..32) fp32 -> hi, lo bf16 rows with x ~= hi + lo, hi truncated (x's upper halves, one word
// permute) and lo = bf16(x - hi) (error <= 2^-16 |x|; split_bf16's rounded hi: 2^-17, in more shuffles)
inline void split_bf16_trunc(const float* x, uint16_t* hi, uint16_t* lo) {
  alignas(64) static constexpr uint16_t kUpper[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                      23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                      45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 ta = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), upper));
  const __m512 tb = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), upper));
  _mm512_storeu_si512(hi, _mm512_permutex2var_epi16(_mm512_castps_si512(a), _mm512_load_si512(kUpper),
                                                   _mm512_castps_si512(b)));
  _mm512_storeu_si512(lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, tb), _mm512_sub_ps(a, ta)));
}

#endif
#elif defined(PASK_AVX2)
// ---- AVX2 + FMA kernels (D = 64 or 128): the AVX-512 kernels' structure on 8 lanes, with the
// block's BF16 keys / values and INT4 codes widened to fp32 once per block (the 16 ymm registers
// cannot hold a query row and its partial sums the way 32 zmm registers do) ----------------------

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline __m256 u8x8(const uint8_t* p) {  // 8 bytes -> 8 int32 lanes (as raw integer bits)
  return _mm256_castsi256_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

inline __m256 nibbles(__m256 b, int shift) {  // (b >> shift) & 15 as fp32
  const __m256i x = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(b), shift), _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(x);
}

// Lane i of the result = sum of the 8 lanes of v[i].
inline __m256 hsum8(const __m256* v) {
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// rows [nt, D] of bf16 -> fp32; rows nt.. up to the next multiple of 8 are zeroed. Prefetches the
// next block's rows (the streams are read block by block with compute in between, which the
// hardware prefetcher alone does not cover).
template <int D>
void widen(float (*dst)[MAXD], const uint16_t* src, int nt, bool more) {
  for (int t = 0; t < nt; ++t) {
    const uint16_t* row = src + static_cast<int64_t>(t) * D;
    if (more)
      for (int b = 0; b < D * 2; b += 64) prefetch(reinterpret_cast<const char*>(row + BT * D) + b);
    for (int c = 0; c < D / 8; ++c) _mm256_store_ps(dst[t] + 8 * c, bf16x8(row + 8 * c));
  }
  for (int t = nt; t % 8 != 0; ++t) std::fill(dst[t], dst[t] + D, 0.0f);
}

// scores sc[r][0..nt) = qh_r . k_t (qh: the query rows already scaled) over widened keys kf
template <int D>
void h_scores(State& st, const float (*qh)[MAXD], const float (*kf)[MAXD], int nt) {
  for (int r = 0; r < st.grp; ++r) {
    __m256 qv[D / 8];
    for (int c = 0; c < D / 8; ++c) qv[c] = _mm256_load_ps(qh[r] + 8 * c);
    for (int t0 = 0; t0 < nt; t0 += 8) {  // eight independent FMA chains (rows past nt are zero)
      __m256 part[8];
      for (int i = 0; i < 8; ++i) part[i] = _mm256_setzero_ps();
      for (int c = 0; c < D / 8; ++c)
        for (int i = 0; i < 8; ++i) part[i] = _mm256_fmadd_ps(qv[c], _mm256_load_ps(kf[t0 + i] + 8 * c), part[i]);
      _mm256_store_ps(st.sc[r] + t0, hsum8(part));
    }
  }
}

// Runs f.template operator()<RN>(r0) for row blocks of RC rows (the last one shorter): row counts
// are compile-time so the accumulators stay in registers.
template <int RC, class F>
inline void row_blocks(int grp, F&& f) {
  int r0 = 0;
  for (; r0 + RC <= grp; r0 += RC) f.template operator()<RC>(r0);
  switch (grp - r0) {
    case 1: f.template operator()<1>(r0); break;
    case 2: if constexpr (RC > 2) f.template operator()<2>(r0); break;
    case 3: if constexpr (RC > 3) f.template operator()<3>(r0); break;
    default: break;
  }
}

// acc[r] += sum_t p[r][t] v_t over widened values vf
template <int D>
void h_values(State& st, const float (*vf)[MAXD], int nt) {
  for (int c0 = 0; c0 < D / 8; c0 += 2) {  // 16 dims per pass, up to 4 rows: 8 accumulators
    row_blocks<4>(st.grp, [&]<int RN>(int r0) {
      __m256 acc[RN][2];
      for (int r = 0; r < RN; ++r)
        for (int c = 0; c < 2; ++c) acc[r][c] = _mm256_load_ps(st.acc[r0 + r] + 8 * (c0 + c));
      for (int t = 0; t < nt; ++t) {
        const __m256 v0 = _mm256_load_ps(vf[t] + 8 * c0), v1 = _mm256_load_ps(vf[t] + 8 * c0 + 8);
        for (int r = 0; r < RN; ++r) {
          const __m256 p = _mm256_broadcast_ss(st.sc[r0 + r] + t);
          acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < RN; ++r)
        for (int c = 0; c < 2; ++c) _mm256_store_ps(st.acc[r0 + r] + 8 * (c0 + c), acc[r][c]);
    });
  }
}

// sc[r][t] += scale_t * (qs_r . c_t) + off_t * qsum_r for the 64 slots of block `blk`, group g
template <int D>
void l_scores_group(State& st, const float (*qs)[MAXD], const float* qsum_g, const uint8_t* KQ, int64_t blk,
                    int g, const float* scl, const float* off) {
  alignas(64) float cb[QG][BT];
  for (int d = 0; d < QG; ++d) {
    const uint8_t* row = KQ + (blk * D + g * QG + d) * (BT / 2);
    if (d % 2 == 0) prefetch(row + D * (BT / 2));  // the next block's rows (two per cache line)
    for (int h = 0; h < 4; ++h) {
      const __m256 b = u8x8(row + 8 * h);
      _mm256_store_ps(cb[d] + 8 * h, nibbles(b, 0));
      _mm256_store_ps(cb[d] + 32 + 8 * h, nibbles(b, 4));
    }
  }
  for (int s0 = 0; s0 < BT; s0 += 32) {  // 32 slots per pass, up to 2 rows: 8 accumulators
    row_blocks<2>(st.grp, [&]<int RN>(int r0) {
      __m256 acc[RN][4];
      for (int r = 0; r < RN; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
      for (int d = 0; d < QG; ++d) {
        const float* cd = cb[d] + s0;
        const __m256 c0 = _mm256_load_ps(cd), c1 = _mm256_load_ps(cd + 8), c2 = _mm256_load_ps(cd + 16),
                     c3 = _mm256_load_ps(cd + 24);
        for (int r = 0; r < RN; ++r) {
          const __m256 q = _mm256_broadcast_ss(qs[r0 + r] + g * QG + d);
          acc[r][0] = _mm256_fmadd_ps(q, c0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(q, c1, acc[r][1]);
          acc[r][2] = _mm256_fmadd_ps(q, c2, acc[r][2]);
          acc[r][3] = _mm256_fmadd_ps(q, c3, acc[r][3]);
        }
      }
      for (int r = 0; r < RN; ++r) {
        const __m256 qg = _mm256_set1_ps(qsum_g[r0 + r]);
        float* s = st.sc[r0 + r] + s0;
        for (int c = 0; c < 4; ++c) {
          const __m256 x = _mm256_fmadd_ps(_mm256_load_ps(off + s0 + 8 * c), qg, _mm256_load_ps(s + 8 * c));
          _mm256_store_ps(s + 8 * c, _mm256_fmadd_ps(_mm256_load_ps(scl + s0 + 8 * c), acc[r][c], x));
        }
      }
    });
  }
}

// even/odd[r] += sum_t p[r][t] * vs_t * codes_t for group g of the block; zs[r][g] += sum_t p[r][t] vz_t
void l_values_group(State& st, const uint8_t* vq, const float* vs, const float* vz, int nt, int g) {
  alignas(64) float w[MAXR][BT];
  for (int r = 0; r < st.grp; ++r) {  // weights past nt are 0 (absorb)
    __m256 z = _mm256_setzero_ps();
    for (int c = 0; c < BT / 8; ++c) {
      const __m256 p = _mm256_load_ps(st.sc[r] + 8 * c);
      _mm256_store_ps(w[r] + 8 * c, _mm256_mul_ps(p, _mm256_load_ps(vs + 8 * c)));
      z = _mm256_fmadd_ps(p, _mm256_load_ps(vz + 8 * c), z);
    }
    st.zs[r][g] += hadd8(z);
  }
  alignas(64) float cf[BT][QG];  // per slot: the 16 even-dim codes, then the 16 odd-dim codes
  for (int t = 0; t < nt; ++t) {
    const uint8_t* b = vq + static_cast<int64_t>(t) * (QG / 2);
    if (t % 4 == 0) prefetch(b + BT * (QG / 2));  // the next block's codes (four slots per line)
    const __m256 b0 = u8x8(b), b1 = u8x8(b + 8);
    _mm256_store_ps(cf[t], nibbles(b0, 0));
    _mm256_store_ps(cf[t] + 8, nibbles(b1, 0));
    _mm256_store_ps(cf[t] + 16, nibbles(b0, 4));
    _mm256_store_ps(cf[t] + 24, nibbles(b1, 4));
  }
  row_blocks<2>(st.grp, [&]<int RN>(int r0) {  // up to 2 rows x (16 even + 16 odd dims): 8 accumulators
    __m256 acc[RN][4];
    for (int r = 0; r < RN; ++r) {
      const float* e = st.even[r0 + r] + g * (QG / 2);
      const float* o = st.odd[r0 + r] + g * (QG / 2);
      acc[r][0] = _mm256_load_ps(e);
      acc[r][1] = _mm256_load_ps(e + 8);
      acc[r][2] = _mm256_load_ps(o);
      acc[r][3] = _mm256_load_ps(o + 8);
    }
    for (int t = 0; t < nt; ++t) {
      const __m256 c0 = _mm256_load_ps(cf[t]), c1 = _mm256_load_ps(cf[t] + 8), c2 = _mm256_load_ps(cf[t] + 16),
                   c3 = _mm256_load_ps(cf[t] + 24);
      for (int r = 0; r < RN; ++r) {
        const __m256 p = _mm256_broadcast_ss(w[r0 + r] + t);
        acc[r][0] = _mm256_fmadd_ps(p, c0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(p, c1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(p, c2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(p, c3, acc[r][3]);
      }
    }
    for (int r = 0; r < RN; ++r) {
      float* e = st.even[r0 + r] + g * (QG / 2);
      float* o = st.odd[r0 + r] + g * (QG / 2);
      _mm256_store_ps(e, acc[r][0]);
      _mm256_store_ps(e + 8, acc[r][1]);
      _mm256_store_ps(o, acc[r][2]);
      _mm256_store_ps(o + 8, acc[r][3]);
    }
  });
}
#endif

void h_stream(State& st, [[maybe_unused]] const uint16_t* qb, const float (*qh)[MAXD], [[maybe_unused]] float scaling,
              const Seq& s, int h) {
  const int D = st.D, grp = st.grp;
  const uint16_t* K = s.kh + static_cast<int64_t>(h) * s.hcap * D;
  const uint16_t* V = s.vh + static_cast<int64_t>(h) * s.hcap * D;
  alignas(64) float kf[BT][MAXD];
  alignas(64) float vf[MAXD];
  for (int64_t t0 = 0; t0 < s.hn; t0 += BT) {
    const int nt = static_cast<int>(std::min<int64_t>(BT, s.hn - t0));
    const uint16_t* Kb = K + t0 * D;
    const uint16_t* Vb = V + t0 * D;
#if defined(__AVX512F__)
    if (D == 64 || D == 128) {
      if (D == 64) h_scores<64>(st, qb, scaling, Kb, nt); else h_scores<128>(st, qb, scaling, Kb, nt);
      st.absorb(nt);
      if (D == 64) h_values<64>(st, Vb, nt); else h_values<128>(st, Vb, nt);
      continue;
    }
#elif defined(PASK_AVX2)
    if (D == 64 || D == 128) {
      alignas(64) float vw[BT][MAXD];
      const bool more = t0 + BT < s.hn;
      if (D == 64) {
        widen<64>(kf, Kb, nt, more);
        widen<64>(vw, Vb, nt, more);
        h_scores<64>(st, qh, kf, nt);
      } else {
        widen<128>(kf, Kb, nt, more);
        widen<128>(vw, Vb, nt, more);
        h_scores<128>(st, qh, kf, nt);
      }
      st.absorb(nt);
      if (D == 64) h_values<64>(st, vw, nt); else h_values<128>(st, vw, nt);
      continue;
    }
#endif
    for (int t = 0; t < nt; ++t)
      for (int d = 0; d < D; ++d) kf[t][d] = bf2f(Kb[t * D + d]);
    for (int r = 0; r < grp; ++r) {
      for (int t = 0; t < nt; ++t) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qh[r][d] * kf[t][d];
        st.sc[r][t] = dot;
      }
    }
    st.absorb(nt);
    for (int t = 0; t < nt; ++t) {
      for (int d = 0; d < D; ++d) vf[d] = bf2f(Vb[t * D + d]);
      for (int r = 0; r < grp; ++r) {
        const float p = st.sc[r][t];
        float* a = st.acc[r];
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] += p * vf[d];
      }
    }
  }
}

// The query rows of one kv head against balanced L-tier keys (k = k' * bal + mid): qs = q * bal *
// scaling, qsum[g] = sum of qs over group g, cst = scaling * q . mid (shared by the INT4 and INT2 streams).
void balanced_query(const State& st, const float (*qf)[MAXD], float scaling, const float* kbal, float (*qs)[MAXD],
                    float (*qsum)[MAXR], float* cst) {
  const int D = st.D, G = st.G;
  const float* mid = kbal;
  const float* bal = kbal + D;
  for (int r = 0; r < st.grp; ++r) {
    float c = 0.0f;
    for (int d = 0; d < D; ++d) {
      qs[r][d] = qf[r][d] * bal[d] * scaling;
      c += qf[r][d] * mid[d];
    }
    cst[r] = c * scaling;
    for (int g = 0; g < G; ++g) {
      float t = 0.0f;
      for (int d = g * QG; d < (g + 1) * QG; ++d) t += qs[r][d];
      qsum[g][r] = t;
    }
  }
}

// One kv head's view of the L tier (bits 4: blocked key codes; 2: token-major, four codes a byte)
// and its balanced query rows (balanced_query).
struct LHead {
  const uint8_t *KQ, *VQ;
  const uint16_t *KSZ, *VS, *VZ;
  alignas(64) float qs[MAXR][MAXD];
  alignas(64) float qsum[MAXD / QG][MAXR];
  alignas(64) float cst[MAXR];
  bool int8 = false;  // the AVX2 build's integer path (int8_wanted) runs this head's INT4 tier
#if defined(PASK_AVX2)
  // qs ~ qi * qstep per (row, group), |qi| <= 127; qc = 8 * sum(qi)
  alignas(32) int8_t qi[MAXR][MAXD];
  float qstep[MAXR][MAXD / QG];
  int32_t qc[MAXR][MAXD / QG];
#endif

  LHead(const State& st, const float (*qf)[MAXD], float scaling, const Seq& s, int h, int kbits, int vbits) {
    const int64_t D = st.D, G = st.G, cap = s.lcap, hh = h;
    KQ = s.kq + hh * cap * D * kbits / 8;
    KSZ = s.ksz + hh * G * cap * 2;
    VQ = s.vq + hh * G * cap * (QG * vbits / 8);
    VS = s.vs + hh * G * cap;
    VZ = s.vz + hh * G * cap;
    balanced_query(st, qf, scaling, s.kbal + hh * 2 * D, qs, qsum, cst);
#if defined(PASK_AVX2)
    int8 = (D == 64 || D == 128) && int8_wanted.load(std::memory_order_relaxed) != 0;
    if (int8)
      for (int r = 0; r < st.grp; ++r)
        for (int g = 0; g < G; ++g) {
          float mx = 0.0f;
          for (int d = g * QG; d < (g + 1) * QG; ++d) mx = std::max(mx, std::fabs(qs[r][d]));
          const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
          int32_t sum = 0;
          for (int d = g * QG; d < (g + 1) * QG; ++d) {
            const int v = static_cast<int>(std::nearbyint(qs[r][d] * inv));
            qi[r][d] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
            sum += qi[r][d];
          }
          qstep[r][g] = mx / 127.0f;
          qc[r][g] = 8 * sum;
        }
#endif
  }
};

#if defined(PASK_AVX2)
// ---- the AVX2 integer path for the INT4 tier (int8_wanted) ------------------------------------
// An fp32 FMA does 8 multiply-adds; pmaddubsw (u8 x int8 pairs summed into int16) does 32, which
// is what lets an INT4 slot cost less than a BF16 one on CPUs without AVX-512 / AMX. The codes are
// transposed per block into 4-byte groups (4 channels of a slot for the keys, 4 slots of a channel
// for the values) so the pair sums land in the right lanes.

// st.sc[r][0..64) += scl_t * qstep * sum_d qi_d (c_td - 8) + zero_t * qsum_g: the scores of group g
// of block blk. int16 sums over the group's 32 channels: |sum| <= 32 * 15 * 127 < 2^15.
void l_scores_group_i8(State& st, const LHead& L, int64_t blk, int g, const float* scl, const float* zero) {
  const int D = st.D;
  __m256i T[8][8];  // [4-channel chunk k][slot register x]
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int k = 0; k < 8; ++k) {
    const uint8_t* row = L.KQ + (blk * D + g * QG + 4 * k) * (BT / 2);
    prefetch(row + D * (BT / 2));  // the next block's rows (two per cache line)
    prefetch(row + D * (BT / 2) + 64);
    __m256i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i * (BT / 2)));
      lo[i] = _mm256_and_si256(x, m4);                         // slots 0..31
      hi[i] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);  // slots 32..63
    }
    for (int half = 0; half < 2; ++half) {
      const __m256i* X = half == 0 ? lo : hi;
      const __m256i a = _mm256_unpacklo_epi8(X[0], X[1]), b = _mm256_unpacklo_epi8(X[2], X[3]);
      const __m256i c = _mm256_unpackhi_epi8(X[0], X[1]), d = _mm256_unpackhi_epi8(X[2], X[3]);
      T[k][4 * half + 0] = _mm256_unpacklo_epi16(a, b);  // slots 0-3 | 16-19 (+ 32 for the high nibbles)
      T[k][4 * half + 1] = _mm256_unpackhi_epi16(a, b);  // 4-7 | 20-23
      T[k][4 * half + 2] = _mm256_unpacklo_epi16(c, d);  // 8-11 | 24-27
      T[k][4 * half + 3] = _mm256_unpackhi_epi16(c, d);  // 12-15 | 28-31
    }
  }
  static constexpr int first[8] = {0, 4, 8, 12, 32, 36, 40, 44};  // slot register x: first.. +3, +16.. +19
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float a[BT];
  for (int r = 0; r < st.grp; ++r) {
    __m256i Q[8];
    for (int k = 0; k < 8; ++k) {
      int32_t w;
      std::memcpy(&w, &L.qi[r][g * QG + 4 * k], 4);
      Q[k] = _mm256_set1_epi32(w);
    }
    const __m256i c8 = _mm256_set1_epi32(L.qc[r][g]);
    const __m256 step = _mm256_set1_ps(L.qstep[r][g]);
    for (int x = 0; x < 8; ++x) {
      __m256i acc = _mm256_maddubs_epi16(T[0][x], Q[0]);
      for (int k = 1; k < 8; ++k) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(T[k][x], Q[k]));
      const __m256i s32 = _mm256_sub_epi32(_mm256_madd_epi16(acc, ones), c8);
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s32), step);
      _mm_store_ps(a + first[x], _mm256_castps256_ps128(f));
      _mm_store_ps(a + first[x] + 16, _mm256_extractf128_ps(f, 1));
    }
    const __m256 qg = _mm256_set1_ps(L.qsum[g][r]);
    float* s = st.sc[r];
    for (int c = 0; c < BT / 8; ++c) {
      const __m256 x = _mm256_fmadd_ps(_mm256_load_ps(zero + 8 * c), qg, _mm256_load_ps(s + 8 * c));
      _mm256_store_ps(s + 8 * c, _mm256_fmadd_ps(_mm256_load_ps(scl + 8 * c), _mm256_load_ps(a + 8 * c), x));
    }
  }
}

// even/odd[r] += sum_t w_t (c_t - 8) + (8 sum_t w_t, via zs) with w_t = p_t vs_t quantised to u8
// against the block's largest w of row r; zs[r][g] += sum_t p_t vz_t + 8 sum_t w_t (fp32).
// int16 sums over 32 slots: |sum| <= 32 * 255 * 8 < 2^15.
void l_values_group_i8(State& st, const uint8_t* vq, const float* vs, const float* vz, int g) {
  __m256i C[BT / 4][4];  // slots 4m..4m+3: even dims j 0..7, even j 8..15, odd j 0..7, odd j 8..15
  const __m256i m4 = _mm256_set1_epi8(15), e8 = _mm256_set1_epi8(8);
  for (int m = 0; m < BT / 4; ++m) {
    const uint8_t* b = vq + 4 * m * (QG / 2);
    prefetch(b + BT * (QG / 2));  // the next block's codes (four slots per cache line)
    const __m128i t0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i t1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16));
    const __m128i t2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32));
    const __m128i t3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 48));
    const __m128i u = _mm_unpacklo_epi8(t0, t1), u2 = _mm_unpackhi_epi8(t0, t1);
    const __m128i w = _mm_unpacklo_epi8(t2, t3), w2 = _mm_unpackhi_epi8(t2, t3);
    const __m256i z0 = _mm256_set_m128i(_mm_unpackhi_epi16(u, w), _mm_unpacklo_epi16(u, w));    // bytes 0..7
    const __m256i z1 = _mm256_set_m128i(_mm_unpackhi_epi16(u2, w2), _mm_unpacklo_epi16(u2, w2));  // bytes 8..15
    C[m][0] = _mm256_sub_epi8(_mm256_and_si256(z0, m4), e8);
    C[m][1] = _mm256_sub_epi8(_mm256_and_si256(z1, m4), e8);
    C[m][2] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(z0, 4), m4), e8);
    C[m][3] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(z1, 4), m4), e8);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) float wf[BT];
  alignas(32) uint8_t wq[BT];
  for (int r = 0; r < st.grp; ++r) {
    __m256 w[BT / 8], z[BT / 8];  // weights past nt are 0 (absorb)
    for (int c = 0; c < BT / 8; ++c) {
      const __m256 p = _mm256_load_ps(st.sc[r] + 8 * c);
      w[c] = _mm256_mul_ps(p, _mm256_load_ps(vs + 8 * c));
      z[c] = _mm256_mul_ps(p, _mm256_load_ps(vz + 8 * c));
      _mm256_store_ps(wf + 8 * c, w[c]);
    }
    __m256 mx[4], ws[4], zv[4];  // pairwise trees, not 8-long dependency chains
    for (int c = 0; c < 4; ++c) {
      mx[c] = _mm256_max_ps(w[c], w[c + 4]);
      ws[c] = _mm256_add_ps(w[c], w[c + 4]);
      zv[c] = _mm256_add_ps(z[c], z[c + 4]);
    }
    const __m256 mx2 = _mm256_max_ps(_mm256_max_ps(mx[0], mx[1]), _mm256_max_ps(mx[2], mx[3]));
    const __m256 ws2 = _mm256_add_ps(_mm256_add_ps(ws[0], ws[1]), _mm256_add_ps(ws[2], ws[3]));
    const __m256 zv2 = _mm256_add_ps(_mm256_add_ps(zv[0], zv[1]), _mm256_add_ps(zv[2], zv[3]));
    st.zs[r][g] += hadd8(_mm256_fmadd_ps(ws2, _mm256_set1_ps(8.0f), zv2));
    const float wmax = hmax8(mx2);
    if (!(wmax > 0.0f)) continue;
    const __m256 inv = _mm256_set1_ps(255.0f / wmax);
    for (int c = 0; c < BT / 32; ++c) {
      __m256i i[4];
      for (int j = 0; j < 4; ++j)
        i[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_load_ps(wf + 32 * c + 8 * j), inv),
                                                _mm256_set1_ps(255.0f)));
      const __m256i p16 = _mm256_packus_epi16(_mm256_packus_epi32(i[0], i[1]), _mm256_packus_epi32(i[2], i[3]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(wq + 32 * c), _mm256_permutevar8x32_epi32(p16, order));
    }
    __m256i s32[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int h = 0; h < 2; ++h) {  // 32 slots per int16 run
      __m256i s16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int m = 8 * h; m < 8 * h + 8; ++m) {
        int32_t w4;
        std::memcpy(&w4, wq + 4 * m, 4);
        const __m256i wv = _mm256_set1_epi32(w4);
        for (int j = 0; j < 4; ++j) s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(wv, C[m][j]));
      }
      for (int j = 0; j < 4; ++j) s32[j] = _mm256_add_epi32(s32[j], _mm256_madd_epi16(s16[j], ones));
    }
    const __m256 step = _mm256_set1_ps(wmax / 255.0f);
    float* e = st.even[r] + g * (QG / 2);
    float* o = st.odd[r] + g * (QG / 2);
    _mm256_store_ps(e, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[0]), step, _mm256_load_ps(e)));
    _mm256_store_ps(e + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[1]), step, _mm256_load_ps(e + 8)));
    _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[2]), step, _mm256_load_ps(o)));
    _mm256_store_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[3]), step, _mm256_load_ps(o + 8)));
  }
}
#endif

// a[r][t] += qs[r][d] * codes[t] for every query row r (portable code-score accumulation, INT4 and INT2)
inline void accumulate_codes(int grp, const float (*qs)[MAXD], int d, const float* codes, float (*a)[BT]) {
  for (int r = 0; r < grp; ++r) {
    const float q = qs[r][d];
    float* ar = a[r];
#pragma omp simd
    for (int t = 0; t < BT; ++t) ar[t] += q * codes[t];
  }
}

// sc[r][t] += scl[t] * a[r][t] + off[t] * qsum_g[r]: a group's dequantised scores from its code sums
inline void add_group_scores(State& st, const float (*a)[BT], const float* scl, const float* off, const float* qsum_g) {
  for (int r = 0; r < st.grp; ++r) {
    const float qg = qsum_g[r];
#pragma omp simd
    for (int t = 0; t < BT; ++t) st.sc[r][t] += scl[t] * a[r][t] + off[t] * qg;
  }
}

// st.sc = the scores of the 64 slots of the block at t0 against blocked INT4 key codes (the L
// tier's layout, also K4V2's keys): one pass over the codes for all query rows.
void blocked_key_scores(State& st, const LHead& L, int64_t cap, int64_t t0) {
  const int D = st.D, grp = st.grp, G = st.G;
  const int64_t blk = t0 / BT;
  alignas(64) float a[MAXR][BT];
  alignas(64) float codes[BT];
  alignas(64) float scl[BT], off[BT];
  for (int r = 0; r < grp; ++r)
    for (int t = 0; t < BT; ++t) st.sc[r][t] = L.cst[r];
  for (int g = 0; g < G; ++g) {
    const uint16_t* sz = L.KSZ + (static_cast<int64_t>(g) * cap + t0) * 2;
#if defined(PASK_AVX2)
    if (L.int8) {  // (scale, zero) bf16 pairs as dwords: scale = the low half << 16, zero = the high half
      alignas(64) float zero[BT];
      for (int t = 0; t < BT; t += 8) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 2 * t));
        _mm256_store_ps(scl + t, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        _mm256_store_ps(zero + t, _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536))));
      }
      l_scores_group_i8(st, L, blk, g, scl, zero);
      continue;
    }
#endif
    for (int t = 0; t < BT; ++t) {  // whole block: slots past nt hold finite stale / zero data
      scl[t] = bf2f(sz[2 * t]);
      off[t] = bf2f(sz[2 * t + 1]) - 8.0f * scl[t];
    }
#if defined(__AVX512F__) || defined(PASK_AVX2)
    if (D == 64 || D == 128) {
      if (D == 64) l_scores_group<64>(st, L.qs, L.qsum[g], L.KQ, blk, g, scl, off);
      else l_scores_group<128>(st, L.qs, L.qsum[g], L.KQ, blk, g, scl, off);
      continue;
    }
#endif
    for (int r = 0; r < grp; ++r) std::fill(a[r], a[r] + BT, 0.0f);
    for (int d = g * QG; d < (g + 1) * QG; ++d) {
      const uint8_t* row = L.KQ + (blk * D + d) * (BT / 2);
      for (int j = 0; j < BT / 2; ++j) {
        codes[j] = static_cast<float>(row[j] & 15);
        codes[j + BT / 2] = static_cast<float>(row[j] >> 4);
      }
      accumulate_codes(grp, L.qs, d, codes, a);
    }
    add_group_scores(st, a, scl, off, L.qsum[g]);
  }
}

void l_stream(State& st, const float (*qf)[MAXD], float scaling, const Seq& s, int h) {
  const int grp = st.grp, G = st.G;
  const int64_t cap = s.lcap;
  const LHead L(st, qf, scaling, s, h, 4, 4);
  const uint8_t* VQ = L.VQ;
  const uint16_t *VS = L.VS, *VZ = L.VZ;
  alignas(64) float vsf[BT], vzf[BT];
  alignas(64) float lo[QG / 2], hi[QG / 2];
  for (int64_t t0 = 0; t0 < s.ln; t0 += BT) {
    const int nt = static_cast<int>(std::min<int64_t>(BT, s.ln - t0));
    blocked_key_scores(st, L, cap, t0);
    st.absorb(nt, L.int8);
    for (int g = 0; g < G; ++g) {
      const int64_t base = static_cast<int64_t>(g) * cap + t0;
      for (int t = 0; t < BT; ++t) {  // whole block (finite stale / zero data past nt, weight 0)
        vsf[t] = bf2f(VS[base + t]);
        vzf[t] = bf2f(VZ[base + t]);
      }
#if defined(PASK_AVX2)
      if (L.int8) {
        l_values_group_i8(st, VQ + base * (QG / 2), vsf, vzf, g);
        continue;
      }
#endif
#if defined(__AVX512F__) || defined(PASK_AVX2)
      l_values_group(st, VQ + base * (QG / 2), vsf, vzf, nt, g);
      continue;
#endif
      for (int t = 0; t < nt; ++t) {
        const uint8_t* b = VQ + (base + t) * (QG / 2);
        for (int j = 0; j < QG / 2; ++j) {
          lo[j] = static_cast<float>(b[j] & 15);
          hi[j] = static_cast<float>(b[j] >> 4);
        }
        for (int r = 0; r < grp; ++r) {
          const float p = st.sc[r][t];
          const float w = p * vsf[t];
          float* e = st.even[r] + g * (QG / 2);
          float* o = st.odd[r] + g * (QG / 2);
#pragma omp simd
          for (int j = 0; j < QG / 2; ++j) {
            e[j] += w * lo[j];
            o[j] += w * hi[j];
          }
          st.zs[r][g] += p * vzf[t];
        }
      }
    }
  }
}

#if defined(PASK_AMX)
// One online-softmax step for a whole stream of n slots: S holds grp rows of lp (>= n, a multiple
// of 16) scores, 64-byte aligned; the running state is rescaled at most once; S becomes the
// weights (0 from n on); the scores go to the trace first where one is kept.
// The largest of s[0..n).
inline float stream_max(const float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = 0; t0 < n; t0 += 16)
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, State::tail(static_cast<int>(std::min<int64_t>(16, n - t0)), 0), s + t0));
  return _mm512_reduce_max_ps(mv);
}

// rowmax (may be null): each row's largest score over its n slots, where the caller has it.
void absorb_rows(State& st, float* S, int64_t lp, int64_t n, const float* rowmax = nullptr) {
  if (st.trace != nullptr) {
    for (int r = 0; r < st.grp; ++r) std::copy(S + r * lp, S + r * lp + n, st.trace + r * st.tstride + st.toff);
    st.toff += n;
  }
  for (int r = 0; r < st.grp; ++r) {
    float* sr = S + r * lp;
    const float mn = std::max(st.m[r], rowmax != nullptr ? rowmax[r] : stream_max(sr, n));
    if (mn == -INFINITY) {
      std::fill(sr, sr + lp, 0.0f);
      continue;
    }
    st.rescale(r, mn);
    const __m512 m = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < lp; t0 += 16) {  // weights past n are 0
      const __m512 x = _mm512_maskz_mov_ps(State::tail(static_cast<int>(std::min<int64_t>(16, n - t0)), 0),
                                           fexp16(_mm512_sub_ps(_mm512_load_ps(sr + t0), m)));
      _mm512_store_ps(sr + t0, x);
      sum = _mm512_add_ps(sum, x);
    }
    st.l[r] += _mm512_reduce_add_ps(sum);
  }
}

// A per-task scratch of grp rows x lp floats, 64-byte aligned (kept across calls by the thread).
float* scratch_rows(int grp, int64_t lp, int which) {
  thread_local std::vector<float> buf[2];
  buf[which].resize(static_cast<size_t>(grp * lp) + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf[which].data()) + 63) & ~uintptr_t{63});
}

// The BF16 tier on AMX tiles, two passes like l_stream_amx: scores C = K (16 slots x 32 dims, read
// in place) . q^T (bf16 pairs, exact), transposed into grp rows; one softmax step; then the values
// with A = the weights as hi / lo bf16 rows (2 grp <= MAXR) and B = two slots' values interleaved,
// accumulated in tiles across the tier. Tiles: 0 / 1 A, 2 / 3 B (or the query's pairs), 4..7 C.
void h_stream_amx(State& st, const uint16_t* qb, float scaling, const Seq& s, int h) {
  const int D = st.D, grp = st.grp;
  const uint16_t* K = s.kh + static_cast<int64_t>(h) * s.hcap * D;
  const uint16_t* V = s.vh + static_cast<int64_t>(h) * s.hcap * D;
  const int64_t n = s.hn, nb = (n + 63) / 64, lp = nb * 64;
  // q^T as pairs: qt[c][p][r] = (q[r][32c + 2p], q[r][32c + 2p + 1]) (32-bit words), r < 16
  alignas(64) uint32_t qt[MAXD / 32][16][16] = {};
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
  for (int r = 0; r < grp; ++r)
    for (int c = 0; c < D / 32; ++c)
      for (int p = 0; p < 16; ++p) qt[c][p][r] = q32[r * (D / 2) + c * 16 + p];
  float* S = scratch_rows(grp, lp, 1);
  // the last, partial block: its live rows copied into zeroed buffers (no reads past the tier)
  const int64_t full = (n / 64) * 64;
  alignas(64) uint16_t kpad[64 * MAXD], vpad[64 * MAXD];
  if (full < n) {
    std::fill(kpad, kpad + 64 * D, uint16_t{0});
    std::fill(vpad, vpad + 64 * D, uint16_t{0});
    std::copy(K + full * D, K + n * D, kpad);
    std::copy(V + full * D, V + n * D, vpad);
  }
  auto vrow = [&](int64_t t) { return t < full ? V + t * D : vpad + (t - full) * D; };
  alignas(64) float cs[64][16];  // C: 64 slots x 16 query rows (grp used)
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
  const __m512 scl = _mm512_set1_ps(scaling);
  amx_config(16);  // scores: A = 16 slots, C = 16 slots x 16 query rows
  for (int64_t blk = 0; blk < nb; ++blk) {  // 64 slots at a time (stale / zero slots past n: finite)
    const uint16_t* kb = blk * 64 < full ? K + blk * 64 * D : kpad;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(2, qt[c], 64);
      _tile_loadd(0, kb + 32 * c, D * 2);
      _tile_loadd(1, kb + 16 * D + 32 * c, D * 2);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_loadd(0, kb + 32 * D + 32 * c, D * 2);
      _tile_loadd(1, kb + 48 * D + 32 * c, D * 2);
      _tile_dpbf16ps(6, 0, 2);
      _tile_dpbf16ps(7, 1, 2);
    }
    _tile_stored(4, cs[0], 64);
    _tile_stored(5, cs[16], 64);
    _tile_stored(6, cs[32], 64);
    _tile_stored(7, cs[48], 64);
    for (int r = 0; r < grp; ++r)  // transpose: row r of 64 slots
      for (int c = 0; c < 4; ++c) {
        const __m512 x = _mm512_i32gather_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(256 * c + r)), &cs[0][0], 4);
        _mm512_store_ps(S + r * lp + blk * 64 + 16 * c, _mm512_mul_ps(x, scl));
      }
  }
  absorb_rows(st, S, lp, n);
  amx_config(2 * grp);  // values: A and C = hi rows over lo rows
  // values: acc[r][j] += sum_t p[r][t] v[t][j], 16 dims per C tile, 32 slots per A / B tile
  alignas(64) uint16_t a[MAXR][32];
  alignas(64) uint16_t b[16][32];
  alignas(64) float co[MAXR][16];
  alignas(64) uint16_t il[32];
  for (int i = 0; i < 16; ++i) il[2 * i] = static_cast<uint16_t>(i), il[2 * i + 1] = static_cast<uint16_t>(32 + i);
  const __m512i inter = _mm512_load_si512(il);  // words: slot t dim i, slot t + 1 dim i, ...
  for (int j0 = 0; j0 < D; j0 += 64) {  // up to four 16-dim C tiles at a time
    const int nj = std::min(4, (D - j0) / 16);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t t0 = 0; t0 < lp; t0 += 32) {
      for (int r = 0; r < grp; ++r) split_bf16(S + r * lp + t0, a[r], a[grp + r]);
      _tile_loadd(0, a, 64);
      for (int jt = 0; jt < nj; ++jt) {
        const int j = j0 + 16 * jt;
        for (int p = 0; p < 16; ++p) {  // slots t0 + 2p, t0 + 2p + 1 (past n: zeros, weight 0)
          const __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(vrow(t0 + 2 * p) + j)));
          const __m512i hi = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(vrow(t0 + 2 * p + 1) + j)));
          _mm512_store_si512(b[p], _mm512_permutex2var_epi16(lo, inter, hi));
        }
        _tile_loadd(2, b, 64);
        switch (jt) {
          case 0: _tile_dpbf16ps(4, 0, 2); break;
          case 1: _tile_dpbf16ps(5, 0, 2); break;
          case 2: _tile_dpbf16ps(6, 0, 2); break;
          default: _tile_dpbf16ps(7, 0, 2); break;
        }
      }
    }
    for (int jt = 0; jt < nj; ++jt) {
      switch (jt) {
        case 0: _tile_stored(4, co, 64); break;
        case 1: _tile_stored(5, co, 64); break;
        case 2: _tile_stored(6, co, 64); break;
        default: _tile_stored(7, co, 64); break;
      }
      for (int r = 0; r < grp; ++r) {
        float* o = st.acc[r] + j0 + 16 * jt;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_add_ps(_mm512_load_ps(co[r]), _mm512_load_ps(co[grp + r]))));
      }
    }
  }
}
#endif

#if defined(PASK_AMX)
// The INT4 tier on AMX tiles, in two passes: (1) every slot's score, group by group (the query's A
// tile loaded once per group), into a per-task buffer, with each row's max over the tier; (2) one
// softmax step for the whole tier (the running state rescaled at most once), then the values group
// by group with the accumulators kept in tiles across blocks and stored once. Needs 2 grp <= MAXR
// (hi / lo rows stacked). The code products stay on
// AMX-BF16 with the query and the weights as hi / lo bf16 pairs. An AMX-INT8 path (query as hi / lo
// bytes: 1 / 65024 of its largest value, against bf16 pairs' 2^-17 of each value; codes as bytes,
// one byte permute per four dims x 32 slots) was tried and not kept: a few per cent faster, an order
// of magnitude less exact (docs/kernels.md).
// B tiles of one block and group of blocked INT4 key codes: b[k][p] = slots 16k .. 16k + 15 of
// dims 2p, 2p + 1 (bf16 pairs)
inline void key_code_tiles(const uint8_t* rows, uint16_t (*b)[QG / 2][32], __m512i table, __m512i lo16,
                           __m512i hi16) {
  for (int p = 0; p < QG / 2; ++p) {
    const __m512i x = _mm512_loadu_si512(rows + p * BT);
    const __m512i hx = _mm512_srli_epi16(x, 4);  // high nibbles (slots 32..63) into the low ones
    _mm512_store_si512(b[0][p], codes_bf16(lo16, x, table));
    _mm512_store_si512(b[1][p], codes_bf16(hi16, x, table));
    _mm512_store_si512(b[2][p], codes_bf16(lo16, hx, table));
    _mm512_store_si512(b[3][p], codes_bf16(hi16, hx, table));
  }
}

// C tiles 4..7 += A (tile 0) x the four B tiles b (B tile k into C tile 4 + k): with a0 / a1
// non-null, A is loaded from a0 for tiles 4, 5 and from a1 for tiles 6, 7 (two K chunks).
inline void four_tile_products(const uint16_t (*b)[QG / 2][32], const void* a0 = nullptr, const void* a1 = nullptr) {
  if (a0 != nullptr) _tile_loadd(0, a0, 64);
  _tile_loadd(2, b[0], 64);
  _tile_loadd(3, b[1], 64);
  _tile_dpbf16ps(4, 0, 2);
  _tile_dpbf16ps(5, 0, 3);
  if (a1 != nullptr) _tile_loadd(0, a1, 64);
  _tile_loadd(2, b[2], 64);
  _tile_loadd(3, b[3], 64);
  _tile_dpbf16ps(6, 0, 2);
  _tile_dpbf16ps(7, 0, 3);
}

void l_stream_amx(State& st, const float (*qf)[MAXD], float scaling, const Seq& s, int h) {
  const int D = st.D, grp = st.grp, G = st.G;
  const int64_t cap = s.lcap, nb = (s.ln + BT - 1) / BT, lp = nb * BT;
  const LHead L(st, qf, scaling, s, h, 4, 4);
  const uint8_t *KQ = L.KQ, *VQ = L.VQ;
  const uint16_t *KSZ = L.KSZ, *VS = L.VS, *VZ = L.VZ;
  const auto& qs = L.qs;
  const auto& qsum = L.qsum;
  const auto& cst = L.cst;
  float* S = scratch_rows(grp, lp, 0);
  const __m512i table = code_table();
  const __m512i p0 = kSlots0.load(), p1 = kSlots1.load();
  alignas(64) uint16_t aw[2][MAXR][32];   // A (values): [K chunk][hi rows, lo rows][32]
  alignas(64) uint16_t b[4][QG / 2][32];  // B: four 16-row tiles
  alignas(64) float scl[BT], off[BT], vsf[BT], vzf[BT];
  __m512 mx[MAXR];
  alignas(64) float top[MAXR];
  // (1) scores: S[r][t] = cst_r + sum_g scale_gt (qs_rg . c_gt) + off_gt qsum_gr; the last group
  // also keeps each row's running max (absorb_rows' first pass)
  {
    const __m512i lo16 = kRows0.load(), hi16 = kRows1.load();
    alignas(64) uint16_t a[MAXD / QG][2 * MAXR][32];  // A per group: the query's group, hi rows over lo rows
    alignas(64) uint16_t kb[2][4][QG / 2][32];           // B tiles of two (block, group) items
    alignas(64) float cs[2][MAXR][BT];                   // C: scores of two (block, group) items
    for (int r = 0; r < grp; ++r) mx[r] = _mm512_set1_ps(-INFINITY);
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < grp; ++r) split_bf16(qs[r] + g * QG, a[g][r], a[g][grp + r]);
    // items k = blk * G + g in address order, software-pipelined in three stages so that no stage
    // waits on the stores of the one before: widen item k's codes into B tiles, multiply item k - 1
    // (its tiles stored one iteration ago), scale item k - 2 (its C tile stored one iteration ago)
    const int64_t K = nb * G;
    for (int64_t i = 0; i < K + 2; ++i) {
      if (i < K) {
        const int64_t blk = i / G;
        const int g = static_cast<int>(i % G);
        key_code_tiles(KQ + (blk * D + g * QG) * (BT / 2), kb[i & 1], table, lo16, hi16);  // rows d, d + 1
      }
      if (i >= 1 && i <= K) {
        const int64_t k = i - 1;
        _tile_loadd(0, a[k % G], 64);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        four_tile_products(kb[k & 1]);
        _tile_stored(4, &cs[k & 1][0][0], BT * 4);
        _tile_stored(5, &cs[k & 1][0][16], BT * 4);
        _tile_stored(6, &cs[k & 1][0][32], BT * 4);
        _tile_stored(7, &cs[k & 1][0][48], BT * 4);
      }
      if (i >= 2) {
        const int64_t k = i - 2, blk = k / G;
        const int g = static_cast<int>(k % G);
        const float (*c2)[BT] = cs[k & 1];
        // (scale, zero) bf16 pairs -> scale, zero - 8 scale; whole block: slots past ln hold finite data
        const uint16_t* sz = KSZ + (static_cast<int64_t>(g) * cap + blk * BT) * 2;
        for (int c = 0; c < 4; ++c) {
          const __m512i w = _mm512_loadu_si512(sz + 32 * c);
          const __m512 sc16 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
          const __m512 z16 =
              _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
          _mm512_store_ps(scl + 16 * c, sc16);
          _mm512_store_ps(off + 16 * c, _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sc16, z16));
        }
        const int live = static_cast<int>(std::min<int64_t>(BT, s.ln - blk * BT));
        for (int r = 0; r < grp; ++r) {
          const __m512 qg = _mm512_set1_ps(qsum[g][r]);
          float* sr = S + r * lp + blk * BT;
          for (int c = 0; c < 4; ++c) {
            const __m512 dot = _mm512_add_ps(_mm512_load_ps(c2[r] + 16 * c), _mm512_load_ps(c2[grp + r] + 16 * c));
            const __m512 prev = g == 0 ? _mm512_set1_ps(cst[r]) : _mm512_load_ps(sr + 16 * c);
            const __m512 x = _mm512_fmadd_ps(_mm512_load_ps(off + 16 * c), qg, prev);
            const __m512 y = _mm512_fmadd_ps(_mm512_load_ps(scl + 16 * c), dot, x);
            _mm512_store_ps(sr + 16 * c, y);
            if (g == G - 1) mx[r] = _mm512_mask_max_ps(mx[r], State::tail(live, c), mx[r], y);
          }
        }
      }
    }
  }
  // (2) one softmax step for the tier: S becomes the weights (0 past ln)
  for (int r = 0; r < grp; ++r) top[r] = _mm512_reduce_max_ps(mx[r]);
  absorb_rows(st, S, lp, s.ln, top);
  // (3) values: even / odd[r] += sum_t w_t codes_t with w = p vs (A, hi / lo), zs[r] += sum_t p vz
  for (int g = 0; g < G; ++g) {
    __m512 zv[MAXR / 2];
    for (int r = 0; r < grp; ++r) zv[r] = _mm512_setzero_ps();
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t base = static_cast<int64_t>(g) * cap + blk * BT;
      for (int c = 0; c < BT / 16; ++c) {
        _mm512_store_ps(vsf + 16 * c, bf16x16(VS + base + 16 * c));
        _mm512_store_ps(vzf + 16 * c, bf16x16(VZ + base + 16 * c));
      }
      for (int r = 0; r < grp; ++r) {
        alignas(64) float w[BT];
        const float* pr = S + r * lp + blk * BT;
        for (int c = 0; c < BT / 16; ++c) {
          const __m512 p = _mm512_load_ps(pr + 16 * c);
          _mm512_store_ps(w + 16 * c, _mm512_mul_ps(p, _mm512_load_ps(vsf + 16 * c)));
          zv[r] = _mm512_fmadd_ps(p, _mm512_load_ps(vzf + 16 * c), zv[r]);
        }
        split_bf16_trunc(w, aw[0][r], aw[0][grp + r]);
        split_bf16_trunc(w + 32, aw[1][r], aw[1][grp + r]);
      }
      const uint8_t* vq = VQ + base * (QG / 2);
      for (int k = 0; k < 2; ++k)
        for (int t4 = 0; t4 < 8; ++t4) {  // slots 32k + 4 t4 .. + 3: 64 adjacent bytes
          // one byte permute per slot pair serves both nibbles: the word's low byte is the code
          // byte; vpermw reads its bits 0..4 (bit 4 ignored by the table's repeat)
          const __m512i x = _mm512_loadu_si512(vq + (32 * k + 4 * t4) * (QG / 2));
          const __m512i y0 = _mm512_permutexvar_epi8(p0, x), y1 = _mm512_permutexvar_epi8(p1, x);
          _mm512_store_si512(b[2 * k][2 * t4], _mm512_permutexvar_epi16(y0, table));  // even dims
          _mm512_store_si512(b[2 * k][2 * t4 + 1], _mm512_permutexvar_epi16(y1, table));
          _mm512_store_si512(b[2 * k + 1][2 * t4], _mm512_permutexvar_epi16(_mm512_srli_epi16(y0, 4), table));
          _mm512_store_si512(b[2 * k + 1][2 * t4 + 1], _mm512_permutexvar_epi16(_mm512_srli_epi16(y1, 4), table));
        }
      four_tile_products(b, aw[0], aw[1]);
    }
    alignas(64) float ce[2][MAXR][16], co[2][MAXR][16];
    _tile_stored(4, ce[0], 64);
    _tile_stored(5, co[0], 64);
    _tile_stored(6, ce[1], 64);
    _tile_stored(7, co[1], 64);
    for (int r = 0; r < grp; ++r) {
      st.zs[r][g] += _mm512_reduce_add_ps(zv[r]);
      float* e = st.even[r] + g * (QG / 2);
      float* o = st.odd[r] + g * (QG / 2);
      const __m512 se = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(ce[0][r]), _mm512_load_ps(ce[0][grp + r])),
                                      _mm512_add_ps(_mm512_load_ps(ce[1][r]), _mm512_load_ps(ce[1][grp + r])));
      const __m512 so = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(co[0][r]), _mm512_load_ps(co[0][grp + r])),
                                      _mm512_add_ps(_mm512_load_ps(co[1][r]), _mm512_load_ps(co[1][grp + r])));
      _mm512_store_ps(e, _mm512_add_ps(_mm512_load_ps(e), se));
      _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), so));
    }
  }
}
#endif

// Four 2-bit codes of one byte as floats (code i at bits 2i): the INT2 value unpack is one 16-byte copy
// per byte.
struct Quads {
  alignas(64) float f[256][4];
  Quads() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 4; ++i) f[b][i] = static_cast<float>((b >> (2 * i)) & 3);
  }
};
const Quads kQuads;

// The INT2 tier's key scores of the block at t0: token-major codes, four a byte; the block's code
// bytes are transposed (byte j of every token in one row), so each channel's codes unpack and
// score BT tokens at a time without horizontal sums.
void quad_key_scores(State& st, const LHead& L, int64_t cap, int64_t t0, int nt) {
  const int D = st.D, grp = st.grp, G = st.G;
  alignas(64) uint8_t bt[MAXD / 4][BT];
  alignas(64) float a[MAXR][BT];
  alignas(64) float codes[BT];
  alignas(64) float scl[BT], off[BT];
  for (int t = 0; t < nt; ++t) {
    const uint8_t* row = L.KQ + (t0 + t) * (D / 4);
    for (int j = 0; j < D / 4; ++j) bt[j][t] = row[j];
  }
  for (int j = 0; j < D / 4; ++j) std::fill(bt[j] + nt, bt[j] + BT, uint8_t{0});
  for (int r = 0; r < grp; ++r)
    for (int t = 0; t < BT; ++t) st.sc[r][t] = L.cst[r];
  for (int g = 0; g < G; ++g) {
    const uint16_t* sz = L.KSZ + (static_cast<int64_t>(g) * cap + t0) * 2;
    for (int t = 0; t < nt; ++t) {
      scl[t] = bf2f(sz[2 * t]);
      off[t] = bf2f(sz[2 * t + 1]) - 2.0f * scl[t];
    }
    std::fill(scl + nt, scl + BT, 0.0f);  // past nt: finite scores, weight 0 after absorb
    std::fill(off + nt, off + BT, 0.0f);
    for (int r = 0; r < grp; ++r) std::fill(a[r], a[r] + BT, 0.0f);
    for (int d = g * QG; d < (g + 1) * QG; ++d) {
      const uint8_t* row = bt[d >> 2];
      const int sh = 2 * (d & 3);
#pragma omp simd
      for (int t = 0; t < BT; ++t) codes[t] = static_cast<float>((row[t] >> sh) & 3);
      accumulate_codes(grp, L.qs, d, codes, a);
    }
    add_group_scores(st, a, scl, off, L.qsum[g]);
  }
}

#if defined(__AVX512F__)
// acc[r][g * QG + j] += sum_t p[r][t] vs_t c_j(t) and zs[r][g] += sum_t p[r][t] vz_t for the INT2 values of
// group g of the block (8 bytes a token; code 4k + i at bits 2i of byte k). A token's 8 bytes widen
// to both 256-bit halves of one register; per-lane shifts (0 / 2, then 4 / 6) give two vectors of
// 16 codes, accumulated per row in registers and put back in code order at the end of the block.
void l2_values_group(State& st, const uint8_t* vq, const uint16_t* VS, const uint16_t* VZ, int64_t base, int nt,
                     int g) {
  alignas(64) float w[MAXR][BT];
  for (int t = 0; t < nt; ++t) {
    const float vsf = bf2f(VS[base + t]), vzf = bf2f(VZ[base + t]);
    for (int r = 0; r < st.grp; ++r) {
      const float p = st.sc[r][t];
      w[r][t] = p * vsf;
      st.zs[r][g] += p * vzf;
    }
  }
  const __m512i sh01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i sh23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m512i m3 = _mm512_set1_epi32(3);
  constexpr int RC = 8;
  for (int r0 = 0; r0 < st.grp; r0 += RC) {
    const int rn = std::min(RC, st.grp - r0);
    __m512 a01[RC], a23[RC];
    for (int r = 0; r < rn; ++r) a01[r] = a23[r] = _mm512_setzero_ps();
    for (int t = 0; t < nt; ++t) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(vq + static_cast<int64_t>(t) * (QG / 4)));
      const __m512i bb = _mm512_broadcast_i64x4(_mm256_cvtepu8_epi32(b8));
      const __m512 c01 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bb, sh01), m3));
      const __m512 c23 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bb, sh23), m3));
      for (int r = 0; r < rn; ++r) {
        const __m512 p = _mm512_set1_ps(w[r0 + r][t]);
        a01[r] = _mm512_fmadd_ps(p, c01, a01[r]);
        a23[r] = _mm512_fmadd_ps(p, c23, a23[r]);
      }
    }
    for (int r = 0; r < rn; ++r) {
      alignas(64) float x01[16], x23[16];
      _mm512_store_ps(x01, a01[r]);
      _mm512_store_ps(x23, a23[r]);
      float* acc = st.acc[r0 + r] + g * QG;
      for (int k = 0; k < QG / 4; ++k) {
        acc[4 * k] += x01[k];
        acc[4 * k + 1] += x01[8 + k];
        acc[4 * k + 2] += x23[k];
        acc[4 * k + 3] += x23[8 + k];
      }
    }
  }
}
#endif

// The INT2 tier: keys token-major INT2 (quad_key_scores), or for K4V2 (kbits 4) INT4 in the L
// tier's blocked layout (blocked_key_scores, the INT4 stream's path); values (always INT2):
// l2_values_group on AVX-512, else each byte unpacks through kQuads into the accumulator.
void l2_stream(State& st, const float (*qf)[MAXD], float scaling, const Seq& s, int h, int kbits) {
  const int grp = st.grp, G = st.G;
  const int64_t cap = s.lcap;
  const LHead L(st, qf, scaling, s, h, kbits, 2);
  const uint8_t* VQ = L.VQ;
  const uint16_t *VS = L.VS, *VZ = L.VZ;
  alignas(64) float vc[QG];
  for (int64_t t0 = 0; t0 < s.ln; t0 += BT) {
    const int nt = static_cast<int>(std::min<int64_t>(BT, s.ln - t0));
    if (kbits == 4) blocked_key_scores(st, L, cap, t0);
    else quad_key_scores(st, L, cap, t0, nt);
    st.absorb(nt);
    for (int g = 0; g < G; ++g) {
      const int64_t base = static_cast<int64_t>(g) * cap + t0;
#if defined(__AVX512F__)
      l2_values_group(st, VQ + base * (QG / 4), VS, VZ, base, nt, g);
      continue;
#endif
      for (int t = 0; t < nt; ++t) {
        const uint8_t* b = VQ + (base + t) * (QG / 4);
        for (int j = 0; j < QG / 4; ++j) std::memcpy(vc + 4 * j, kQuads.f[b[j]], sizeof(kQuads.f[0]));
        const float vsf = bf2f(VS[base + t]), vzf = bf2f(VZ[base + t]);
        for (int r = 0; r < grp; ++r) {
          const float p = st.sc[r][t];
          const float w = p * vsf;
          float* acc = st.acc[r] + g * QG;
#pragma omp simd
          for (int j = 0; j < QG; ++j) acc[j] += w * vc[j];
          st.zs[r][g] += p * vzf;
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// The instruction set the decode kernels were compiled for ("+amx" / "+int8": the INT4 tier's
// AMX or integer path is on).
const char* pask_attention_isa() {
#if defined(PASK_AMX)
  return amx_enabled() ? "avx512+amx" : "avx512";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(PASK_AVX2)
  return int8_wanted.load(std::memory_order_relaxed) != 0 ? "avx2+int8" : "avx2";
#else
  return "portable";
#endif
}

// Turns the AMX path for the INT4 tier on (want != 0, if the CPU and OS allow) or off; returns
// whether it is on now. Without an AMX build: always 0.
int pask_attention_use_amx(int want) {
#if defined(PASK_AMX)
  amx_wanted.store(want != 0 ? 1 : 0);
  return amx_enabled() ? 1 : 0;
#else
  (void)want;
  return 0;
#endif
}

// Turns the AVX2 build's integer INT4 path on (want > 0) or off (want == 0), or leaves it (want <
// 0); returns whether it is on now. Other builds: always 0.
int pask_attention_use_int8(int want) {
#if defined(PASK_AVX2)
  if (want >= 0) int8_wanted.store(want != 0 ? 1 : 0);
  return int8_wanted.load();
#else
  (void)want;
  return 0;
#endif
}

// Returns 0, or -1 for an unsupported shape (nothing written).
// q, out: [nseq, hkv * grp, D] (q bf16, out f32); per-sequence arrays of pointers (null = no tier /
// finished sequence) and slot counts: the H tier, the INT4 tier (kq .. ln), the INT2 tier
// (kq2 .. ln2; kbits2: its key width, 2 or 4 for K4V2); kbal is shared by both low tiers. A
// sequence with no tier gets zeros.
// probs (may be null; so may each entry): per sequence fp32 [hkv, hn + ln + ln2], the softmax
// weights of its H slots, then its INT4 slots, then its INT2 slots, averaged over each kv head's
// query rows (the step attention).
int pask_decode_layer(int nseq, int hkv, int grp, int D, float scaling, const uint16_t* q,
                      const void* const* kh, const void* const* vh, const int64_t* hcap, const int64_t* hn,
                      const void* const* kq, const void* const* ksz, const void* const* vq,
                      const void* const* vs, const void* const* vz, const int64_t* lcap, const int64_t* ln,
                      const void* const* kq2, const void* const* ksz2, const void* const* vq2,
                      const void* const* vs2, const void* const* vz2, const int64_t* lcap2, const int64_t* ln2,
                      int kbits2, const void* const* kbal, float* out, int nthreads, void* const* probs) {
  if (D % QG != 0 || D > MAXD || D <= 0 || grp < 1 || grp > MAXR || hkv < 1 || nseq < 0) return -1;
  if (kbits2 != 2 && kbits2 != 4) return -1;
  const int ntask = nseq * hkv;
  const int64_t rows = static_cast<int64_t>(hkv) * grp;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? nthreads : 1)
  for (int i = 0; i < ntask; ++i) {
    const int b = i / hkv, h = i % hkv;
    float* o = out + (b * rows + static_cast<int64_t>(h) * grp) * D;
    Seq s{static_cast<const uint16_t*>(kh[b]), static_cast<const uint16_t*>(vh[b]), hcap[b], kh[b] ? hn[b] : 0,
          static_cast<const uint8_t*>(kq[b]), static_cast<const uint8_t*>(vq[b]),
          static_cast<const uint16_t*>(ksz[b]), static_cast<const uint16_t*>(vs[b]),
          static_cast<const uint16_t*>(vz[b]), lcap[b], kq[b] ? ln[b] : 0, static_cast<const float*>(kbal[b])};
    // the INT2 tier seen through the same fields (l2_stream reads kq .. ln)
    Seq s2{nullptr, nullptr, 0, 0, static_cast<const uint8_t*>(kq2[b]), static_cast<const uint8_t*>(vq2[b]),
           static_cast<const uint16_t*>(ksz2[b]), static_cast<const uint16_t*>(vs2[b]),
           static_cast<const uint16_t*>(vz2[b]), lcap2[b], kq2[b] ? ln2[b] : 0, static_cast<const float*>(kbal[b])};
    if (s.hn <= 0 && s.ln <= 0 && s2.ln <= 0) {
      std::fill(o, o + grp * D, 0.0f);
      continue;
    }
    alignas(64) float qf[MAXR][MAXD];
    alignas(64) float qh[MAXR][MAXD];
    const uint16_t* qb = q + (b * rows + static_cast<int64_t>(h) * grp) * D;
    for (int r = 0; r < grp; ++r)
      for (int d = 0; d < D; ++d) {
        qf[r][d] = bf2f(qb[r * D + d]);
        qh[r][d] = qf[r][d] * scaling;
      }
    State st;
    st.init(grp, D);
#if defined(PASK_AMX)
    st.amx = (D == 64 || D == 128) && 2 * grp <= MAXR && amx_enabled();
    if (st.amx) amx_begin(grp);
#endif
    float* pw = probs != nullptr && probs[b] != nullptr ? static_cast<float*>(probs[b]) : nullptr;
    std::vector<float> trace;
    if (pw != nullptr) {
      st.tstride = s.hn + s.ln + s2.ln;
      trace.resize(static_cast<size_t>(grp) * st.tstride);
      st.trace = trace.data();
    }
#if defined(PASK_AMX)
    if (s.hn > 0 && st.amx) h_stream_amx(st, qb, scaling, s, h);
    else
#endif
    if (s.hn > 0) h_stream(st, qb, qh, scaling, s, h);
    if (s.ln > 0) {
#if defined(PASK_AMX)
      if (st.amx) l_stream_amx(st, qf, scaling, s, h);
      else
#endif
        l_stream(st, qf, scaling, s, h);
    }
    if (s2.ln > 0) l2_stream(st, qf, scaling, s2, h, kbits2);
#if defined(PASK_AMX)
    if (st.amx) _tile_release();
#endif
    st.write(o);
    if (pw != nullptr) st.weights(pw + static_cast<int64_t>(h) * st.tstride);
  }
  return 0;
}

}  // extern "C"

// ---- moving one token from the H tier to the INT4 tier ----------------------------------------
// Bit-exact with pask.kv.quant.quantize_codes (fp32 arithmetic, bf16 scale rounded up, zero rounded
// down, widened until the top code covers the max, round-half-even codes): built without FP
// contraction (-ffp-contract=off) so every product and sum rounds as PyTorch's separate ops do.
namespace {

inline uint16_t f2bf_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t bf_next_up(uint16_t b) {  // nextafter(b, +inf) on bf16 bit patterns
  if ((b & 0x7FFF) == 0) return 0x0001;     // +-0 -> smallest positive subnormal
  return (b & 0x8000) ? static_cast<uint16_t>(b - 1) : static_cast<uint16_t>(b + 1);
}

inline uint16_t bf_next_down(uint16_t b) {  // nextafter(b, -inf)
  if ((b & 0x7FFF) == 0) return 0x8001;
  return (b & 0x8000) ? static_cast<uint16_t>(b + 1) : static_cast<uint16_t>(b - 1);
}

inline uint16_t round_up_bf(float x) {
  uint16_t h = f2bf_rne(x);
  return bf2f(h) < x ? bf_next_up(h) : h;
}

inline uint16_t round_down_bf(float x) {
  uint16_t h = f2bf_rne(x);
  return bf2f(h) > x ? bf_next_down(h) : h;
}

// codes[0..QG) of x[0..QG) with zero point zp; scale and zero as bf16 bits
// Four 2-bit codes in one byte, code i at bits 2i (pask.kv.quant.pack_quads).
inline uint8_t pack_quad(const uint8_t* c) {
  return static_cast<uint8_t>(c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6));
}

// The scale and zero of a group with range [mn, mx] (bf16 bits), and the low end of its grid.
inline float group_grid(float mn, float mx, int zp, float top, uint16_t* scale_out, uint16_t* zero_out) {
  uint16_t scale = round_up_bf((mx - mn) / top);
  if (!(bf2f(scale) > 0.0f)) scale = 0x3380;  // 2^-24
  uint16_t zero;
  float low;
  for (;;) {
    const float s = bf2f(scale);
    zero = round_down_bf(mn + static_cast<float>(zp) * s);
    low = bf2f(zero) - static_cast<float>(zp) * s;
    if (!(low + top * s < mx)) break;
    scale = bf_next_up(scale);
  }
  *scale_out = scale;
  *zero_out = zero;
  return low;
}

#if !defined(__AVX512F__) && !defined(PASK_AVX2)
inline void scalar_range(const float* x, float* mn_out, float* mx_out) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < QG; ++i) {
    mn = x[i] < mn ? x[i] : mn;
    mx = x[i] > mx ? x[i] : mx;
  }
  *mn_out = mn;
  *mx_out = mx;
}
#endif

#if defined(__AVX512F__)
// quantize_group on 16-lane vectors, bit-exact with the scalar one: the same float operations per
// element (subtract, divide, round to nearest even, clamp), min / max exact. The sign of a zero
// range end may differ from the scalar scan's, which changes nothing: group_grid only forms
// mx - mn and mn + zp * s (for zp = 0, -0 + 0 = +0).
void quantize_group(const float* x, int zp, int qmax, uint8_t* codes, uint16_t* scale_out, uint16_t* zero_out) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  float mn = _mm512_reduce_min_ps(_mm512_min_ps(a, b)), mx = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  const float top = static_cast<float>(qmax);
  const float low = group_grid(mn, mx, zp, top, scale_out, zero_out);
  const __m512 lo = _mm512_set1_ps(low), s = _mm512_set1_ps(bf2f(*scale_out)), t = _mm512_set1_ps(top);
  const __m512 z = _mm512_setzero_ps();
  for (int half = 0; half < 2; ++half) {
    __m512 c = _mm512_div_ps(_mm512_sub_ps(half ? b : a, lo), s);
    c = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, z), t);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * half), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
}
#elif defined(PASK_AVX2)
// quantize_group on 8-lane vectors (see the AVX-512 one).
void quantize_group(const float* x, int zp, int qmax, uint8_t* codes, uint16_t* scale_out, uint16_t* zero_out) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 lo8 = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
  __m256 hi8 = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
  alignas(32) float l8[8], h8[8];
  _mm256_store_ps(l8, lo8);
  _mm256_store_ps(h8, hi8);
  float mn = l8[0], mx = h8[0];
  for (int i = 1; i < 8; ++i) {
    mn = l8[i] < mn ? l8[i] : mn;
    mx = h8[i] > mx ? h8[i] : mx;
  }
  const float top = static_cast<float>(qmax);
  const float low = group_grid(mn, mx, zp, top, scale_out, zero_out);
  const __m256 lo = _mm256_set1_ps(low), s = _mm256_set1_ps(bf2f(*scale_out)), t = _mm256_set1_ps(top);
  const __m256 z = _mm256_setzero_ps();
  alignas(32) int32_t ci[QG];
  for (int i = 0; i < 4; ++i) {
    __m256 c = _mm256_div_ps(_mm256_sub_ps(v[i], lo), s);
    c = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm256_min_ps(_mm256_max_ps(c, z), t);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ci + 8 * i), _mm256_cvtps_epi32(c));
  }
  for (int i = 0; i < QG; ++i) codes[i] = static_cast<uint8_t>(ci[i]);
}
#else
void quantize_group(const float* x, int zp, int qmax, uint8_t* codes, uint16_t* scale_out, uint16_t* zero_out) {
  float mn, mx;
  scalar_range(x, &mn, &mx);
  const float top = static_cast<float>(qmax);
  const float low = group_grid(mn, mx, zp, top, scale_out, zero_out);
  const float s = bf2f(*scale_out);
  for (int i = 0; i < QG; ++i) {
    float c = std::nearbyint((x[i] - low) / s);
    c = c < 0.0f ? 0.0f : (c > top ? top : c);
    codes[i] = static_cast<uint8_t>(c);
  }
}
#endif

}  // namespace

// One token of one kv head into L slot `lslot`: keys balanced (k - mid) / bal, both quantised per
// group of QG (pask.kv.quant.quantize_codes, bit-exact), written in the L tier's layouts.
// bits: the value width (4: the L tier; 2: the L2 tier); kbits: the key width (4: blocked, d-major,
// the L tier's and K4V2's; 2: token-major, four codes a byte).
void quantize_token(const uint16_t* k, const uint16_t* v, const float* mid, const float* bal, int D, int bits,
                    int kbits, int h, uint8_t* KQ, uint16_t* KSZ, uint8_t* VQ, uint16_t* VS, uint16_t* VZ, int64_t lc,
                    int64_t lslot) {
  const int G = D / QG;
  const int qmax = (1 << bits) - 1, kmax = (1 << kbits) - 1;
  const int kzp = 1 << (kbits - 1);  // key zero point: 8 at 4 bits, 2 at 2 bits
  const int64_t blk = lslot / BT, i = lslot % BT, col = i % (BT / 2);
  const bool high = i >= BT / 2;
  alignas(64) float kx[MAXD], vx[MAXD];
  for (int d = 0; d < D; ++d) {
    kx[d] = (bf2f(k[d]) - mid[d]) / bal[d];
    vx[d] = bf2f(v[d]);
  }
  for (int g = 0; g < G; ++g) {
    uint8_t kc[QG], vc[QG];
    uint16_t ks, kz, vsc, vzr;
    quantize_group(kx + g * QG, kzp, kmax, kc, &ks, &kz);
    quantize_group(vx + g * QG, 0, qmax, vc, &vsc, &vzr);
    const int64_t gs = (static_cast<int64_t>(h) * G + g) * lc + lslot;
    if (kbits == 4) {  // blocked, d-major (the INT4 tier's keys and K4V2's)
      for (int j = 0; j < QG; ++j) {
        uint8_t* byte = KQ + ((static_cast<int64_t>(h) * (lc / BT) + blk) * D + g * QG + j) * (BT / 2) + col;
        *byte = high ? static_cast<uint8_t>((*byte & 0x0F) | (kc[j] << 4)) : static_cast<uint8_t>((*byte & 0xF0) | kc[j]);
      }
    } else {  // INT2: token-major, four codes a byte
      uint8_t* krow = KQ + (static_cast<int64_t>(h) * lc + lslot) * (D / 4) + g * (QG / 4);
      for (int j = 0; j < QG / 4; ++j) krow[j] = pack_quad(kc + 4 * j);
    }
    if (bits == 4)
      for (int j = 0; j < QG / 2; ++j) VQ[gs * (QG / 2) + j] = static_cast<uint8_t>(vc[2 * j] | (vc[2 * j + 1] << 4));
    else
      for (int j = 0; j < QG / 4; ++j) VQ[gs * (QG / 4) + j] = pack_quad(vc + 4 * j);
    KSZ[2 * gs] = ks;
    KSZ[2 * gs + 1] = kz;
    VS[gs] = vsc;
    VZ[gs] = vzr;
  }
}

// Whether (value width, key width) names a low tier: (4, 4) the L tier, (2, 2) or (2, 4) the L2 tier.
inline bool tier_widths_ok(int bits, int kbits) {
  return bits == 4 ? kbits == 4 : bits == 2 && (kbits == 2 || kbits == 4);
}

extern "C" {

// For each of `nstores` stores (the layers of one or more (sequence, layer group) pairs, e.g. every
// row's token leaving its recent window in a decode step): quantise H slot `slot` of every kv head
// into low-tier slot `lslot` at `bits` (4: the blocked INT4 layout; 2: four codes per byte,
// token-major keys), keys balanced by kbal, then move H slot `last` into `slot` (unless equal).
// `desc` holds MOVE_FIELDS int64 per store, store after store:
//   hk hv hcap slot last kq ksz vq vs vz lcap lslot kbal
// (pointers as integers). Stores listed once each run in parallel on `nthreads`; a store listed
// twice makes the whole call run in order (the second move sees the first done). The caller has
// grown the low tiers to hold `lslot` and does the bookkeeping. Returns 0, -1 on a bad shape, width
// or slot (nothing written then).
constexpr int MOVE_FIELDS = 13;

int pask_move_to_low(int nstores, int hkv, int D, const int64_t* desc, int bits, int kbits, int nthreads) {
  if (D % QG != 0 || D > MAXD || D <= 0 || hkv < 1 || nstores < 0 || !tier_widths_ok(bits, kbits)) return -1;
  auto field = [desc](int li, int f) { return desc[static_cast<int64_t>(li) * MOVE_FIELDS + f]; };
  for (int li = 0; li < nstores; ++li) {
    const int64_t hc = field(li, 2), sl = field(li, 3), la = field(li, 4), lc = field(li, 10), ls = field(li, 11);
    if (sl < 0 || sl >= hc || la < 0 || la >= hc || ls < 0 || ls >= lc) return -1;
  }
  bool parallel = nthreads > 1 && nstores > 1;
  if (parallel) {  // only if every store is listed once (a store is its H tier's key tensor)
    std::vector<int64_t> keys(static_cast<size_t>(nstores));
    for (int li = 0; li < nstores; ++li) keys[static_cast<size_t>(li)] = field(li, 0);
    std::sort(keys.begin(), keys.end());
    parallel = std::adjacent_find(keys.begin(), keys.end()) == keys.end();
  }
  auto one = [&](int li) {
    auto ptr = [&](int f) { return reinterpret_cast<void*>(static_cast<intptr_t>(field(li, f))); };
    uint16_t* K = static_cast<uint16_t*>(ptr(0));
    uint16_t* V = static_cast<uint16_t*>(ptr(1));
    uint8_t* KQ = static_cast<uint8_t*>(ptr(5));
    uint16_t* KSZ = static_cast<uint16_t*>(ptr(6));
    uint8_t* VQ = static_cast<uint8_t*>(ptr(7));
    uint16_t* VS = static_cast<uint16_t*>(ptr(8));
    uint16_t* VZ = static_cast<uint16_t*>(ptr(9));
    const float* bal_all = static_cast<const float*>(ptr(12));
    const int64_t hc = field(li, 2), sl = field(li, 3), la = field(li, 4), lc = field(li, 10), ls = field(li, 11);
    for (int h = 0; h < hkv; ++h) {
      uint16_t* k = K + (static_cast<int64_t>(h) * hc + sl) * D;
      uint16_t* v = V + (static_cast<int64_t>(h) * hc + sl) * D;
      const float* mid = bal_all + static_cast<int64_t>(h) * 2 * D;
      quantize_token(k, v, mid, mid + D, D, bits, kbits, h, KQ, KSZ, VQ, VS, VZ, lc, ls);
      if (la != sl) {
        std::memcpy(k, K + (static_cast<int64_t>(h) * hc + la) * D, D * sizeof(uint16_t));
        std::memcpy(v, V + (static_cast<int64_t>(h) * hc + la) * D, D * sizeof(uint16_t));
      }
    }
  };
  if (parallel) {
    // each store's moves touch only that store's tensors: the stores' memory latency overlaps
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int li = 0; li < nstores; ++li) one(li);
  } else {
    for (int li = 0; li < nstores; ++li) one(li);
  }
  return 0;
}


// Quantise n tokens k, v [hkv, n, D] bf16 (contiguous) of one store into its L slots
// [lslot, lslot + n) (capacity already reserved), bit-exact with pask.kv.quant as the move is.
// Parallel over (kv head, 64-slot block): the two slots sharing an INT4 key byte stay in one task.
// With `slots` non-null, token t is read from row slots[t] of k, v [hkv, src_cap, D] instead (an H
// tier's slots, without gathering them first; each in [0, src_cap)).
int pask_quantize_low(int hkv, int D, const void* k, const void* v, int64_t n, void* kq, void* ksz, void* vq, void* vs,
                      void* vz, int64_t lcap, int64_t lslot, const void* kbal, int bits, int kbits, int nthreads,
                      const int64_t* slots, int64_t src_cap) {
  if (D % QG != 0 || D > MAXD || D <= 0 || hkv < 1 || n < 0 || !tier_widths_ok(bits, kbits)) return -1;
  if (lslot < 0 || lslot + n > lcap) return -1;
  if (slots != nullptr)
    for (int64_t t = 0; t < n; ++t)
      if (slots[t] < 0 || slots[t] >= src_cap) return -1;
  const uint16_t* K = static_cast<const uint16_t*>(k);
  const uint16_t* V = static_cast<const uint16_t*>(v);
  const float* bal_all = static_cast<const float*>(kbal);
  const int64_t b0 = lslot / BT, b1 = (lslot + n + BT - 1) / BT, nblk = b1 - b0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? nthreads : 1)
  for (int64_t task = 0; task < hkv * nblk; ++task) {
    const int h = static_cast<int>(task / nblk);
    const int64_t blk = b0 + task % nblk;
    const int64_t s0 = std::max(lslot, blk * BT), s1 = std::min(lslot + n, (blk + 1) * BT);
    const float* mid = bal_all + static_cast<int64_t>(h) * 2 * D;
    for (int64_t sl = s0; sl < s1; ++sl) {
      const int64_t t = sl - lslot;
      const int64_t row = slots != nullptr ? h * src_cap + slots[t] : h * n + t;
      quantize_token(K + row * D, V + row * D, mid, mid + D, D, bits, kbits, h, static_cast<uint8_t*>(kq),
                     static_cast<uint16_t*>(ksz), static_cast<uint8_t*>(vq), static_cast<uint16_t*>(vs),
                     static_cast<uint16_t*>(vz), lcap, sl);
    }
  }
  return 0;
}

// A decode step's new token of each row into its H tier: for row r with kd[r] non-null,
// kd[r][h][slot[r]][:] = k[r][h][:] and the same for v (bf16; k, v [rows, hkv, D] contiguous;
// tiers [hkv, cap[r], D]). One call per layer in place of a PyTorch copy per row and part.
// Returns 0, -1 on a bad shape or a slot past its tier's capacity (nothing written then).
int pask_append_h(int64_t rows, int hkv, int D, const void* k, const void* v, void* const* kd, void* const* vd,
                  const int64_t* cap, const int64_t* slot) {
  if (rows < 0 || hkv < 1 || D < 1) return -1;
  for (int64_t r = 0; r < rows; ++r)
    if (kd[r] != nullptr && (vd[r] == nullptr || slot[r] < 0 || slot[r] >= cap[r])) return -1;
  const uint16_t* K = static_cast<const uint16_t*>(k);
  const uint16_t* V = static_cast<const uint16_t*>(v);
  for (int64_t r = 0; r < rows; ++r) {
    if (kd[r] == nullptr) continue;
    for (int h = 0; h < hkv; ++h) {
      const int64_t src = (r * hkv + h) * D, dst = (h * cap[r] + slot[r]) * D;
      std::copy(K + src, K + src + D, static_cast<uint16_t*>(kd[r]) + dst);
      std::copy(V + src, V + src + D, static_cast<uint16_t*>(vd[r]) + dst);
    }
  }
  return 0;
}

// Per-channel range of a store's keys for the key balance (pask.kv.storage.key_balance):
// hi[h][d] = max, lo[h][d] = min over the n tokens of k [hkv][.][D] (bf16, head h at k + h * head_stride),
// as fp32; a NaN in a channel makes both NaN (PyTorch's amax / amin propagate it). Exact: no arithmetic.
int pask_key_range(int hkv, int64_t n, int D, const void* k, int64_t head_stride, float* hi, float* lo) {
  if (hkv < 1 || n < 1 || D < 1 || D > MAXD) return -1;
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // one pass over the rows, 16 channels per vector; NaNs tracked by an unordered compare
    const int nv = D / 16;
    for (int h = 0; h < hkv; ++h) {
      const uint16_t* K = static_cast<const uint16_t*>(k) + h * head_stride;
      auto load = [&](int64_t t, int v) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(K + t * D + v * 16));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      };
      __m512 mx[MAXD / 16], mn[MAXD / 16];
      __mmask16 nan[MAXD / 16];
      for (int v = 0; v < nv; ++v) {
        mx[v] = mn[v] = load(0, v);
        nan[v] = _mm512_cmp_ps_mask(mx[v], mx[v], _CMP_UNORD_Q);
      }
      for (int64_t t = 1; t < n; ++t)
        for (int v = 0; v < nv; ++v) {
          const __m512 x = load(t, v);
          mx[v] = _mm512_max_ps(mx[v], x);
          mn[v] = _mm512_min_ps(mn[v], x);
          nan[v] |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        }
      const __m512 qnan = _mm512_set1_ps(NAN);
      for (int v = 0; v < nv; ++v) {
        _mm512_storeu_ps(hi + h * D + v * 16, _mm512_mask_mov_ps(mx[v], nan[v], qnan));
        _mm512_storeu_ps(lo + h * D + v * 16, _mm512_mask_mov_ps(mn[v], nan[v], qnan));
      }
    }
    return 0;
  }
#endif
  for (int h = 0; h < hkv; ++h) {
    const uint16_t* K = static_cast<const uint16_t*>(k) + h * head_stride;
    float mx[MAXD], mn[MAXD];
    bool nan[MAXD] = {};
    for (int d = 0; d < D; ++d) mx[d] = mn[d] = bf2f(K[d]);
    for (int64_t t = 1; t < n; ++t) {
      const uint16_t* row = K + t * D;
      for (int d = 0; d < D; ++d) {
        const float x = bf2f(row[d]);
        mx[d] = x > mx[d] ? x : mx[d];
        mn[d] = x < mn[d] ? x : mn[d];
        nan[d] |= x != x;
      }
    }
    for (int d = 0; d < D; ++d) {
      const bool bad = nan[d] || mx[d] != mx[d];
      hi[h * D + d] = bad ? NAN : mx[d];
      lo[h * D + d] = bad ? NAN : mn[d];
    }
  }
  return 0;
}

}  // extern "C"

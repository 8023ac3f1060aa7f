// Pieces shared by pask's native kernels (native_attention.cpp, native_gemv.cpp, native_norm.cpp, native_rotary.cpp):
// included by each; pask/cpu/native.py hashes it into each library's build key.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pask_native {

inline float bf2f(uint16_t x) {  // bf16 -> fp32 (exact: a shift)
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16 as c10::BFloat16 rounds (to nearest even; a NaN -> the quiet NaN 0x7FC0): the
// kernels that reproduce PyTorch's bf16 ops bit for bit (native_norm.cpp, native_rotary.cpp).
inline uint16_t f2bf_torch(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512F__)
// Lane i of the result = sum of the 16 lanes of v[i].
inline __m512 hsum16(__m512* v) {
  __m512 r[8], s[4], w[2];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    __m512d a = _mm512_castps_pd(r[2 * k]), b = _mm512_castps_pd(r[2 * k + 1]);
    s[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#endif

#if defined(__AMX_TILE__)
// Whether Linux grants this process AMX tile state (asked once per process and library).
inline bool amx_granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each of the 16 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

}  // namespace pask_native

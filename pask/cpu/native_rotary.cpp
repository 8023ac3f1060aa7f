// Rotary position embedding of bf16 query / key rows, bit-identical to transformers' apply_rotary_pos_emb
// in PyTorch (pask/cpu/native_rotary.py): out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)),
// rotate_half(x) = cat(-x[D/2:], x[:D/2]). Each product of two bf16 values is exact in fp32 and
// rounded once to bf16, the sum is an fp32 addition rounded to bf16: PyTorch's three elementwise
// ops, one rounding each (a NaN becomes 0x7FC0, as PyTorch's scalar conversion writes it; its
// vectorised one writes 0xFFFF: a NaN's payload is the one difference). Built with
// -ffp-contract=off (no fused multiply-add).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "native_common.h"

namespace {

using pask_native::bf2f;
constexpr auto f2bf = pask_native::f2bf_torch;

// x [B, H, S, D] (strides in elements, the last 1), cos / sin [CB, S, D] contiguous (CB = B, or 1:
// shared by every batch row) -> out [B, H, S, D] contiguous.
void rotate(int64_t B, int64_t H, int64_t S, int64_t D, const uint16_t* x, const int64_t* st, const uint16_t* cs,
            const uint16_t* sn, int64_t cb, uint16_t* out) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s) {
        const uint16_t* xr = x + b * st[0] + h * st[1] + s * st[2];
        const int64_t c0 = ((cb == 1 ? 0 : b) * S + s) * D;
        uint16_t* o = out + ((b * H + h) * S + s) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -bf2f(xr[d + half]) : bf2f(xr[d - half]);
          const float a = bf2f(f2bf(bf2f(xr[d]) * bf2f(cs[c0 + d])));
          const float r = bf2f(f2bf(rot * bf2f(sn[c0 + d])));
          o[d] = f2bf(a + r);
        }
      }
}

}  // namespace

extern "C" {

// q [B, Hq, S, D] and k [B, Hk, S, D] (strides qs, ks: 4 each, the last 1) -> qo, ko contiguous.
// Returns 0, or -1 for a shape it does not take.
int pask_rotary_bf16(int64_t B, int64_t Hq, int64_t Hk, int64_t S, int64_t D, const uint16_t* q, const int64_t* qs,
                     const uint16_t* k, const int64_t* ks, const uint16_t* cos, const uint16_t* sin, int64_t cb,
                     uint16_t* qo, uint16_t* ko) {
  if (B <= 0 || Hq <= 0 || Hk <= 0 || S <= 0 || D <= 0 || D % 2 != 0 || (cb != 1 && cb != B) || qs[3] != 1 ||
      ks[3] != 1)
    return -1;
  rotate(B, Hq, S, D, q, qs, cos, sin, cb, qo);
  rotate(B, Hk, S, D, k, ks, cos, sin, cb, ko);
  return 0;
}

}  // extern "C"

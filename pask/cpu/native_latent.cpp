// BellowsKV's key scores (pask/kv/native_latent.py): for every latent token of a layer, its
// rebuilt pre-RoPE key (the output of one GEMM, bias not yet added) gets the bias, is rotated at the
// token's position and scored against the query rows of its sequence, in one pass over the keys.
// It replaces four full-size fp32 temporaries per layer in the PyTorch path (bias, float, rotate,
// rotate-and-add), which cost more than the key GEMM itself (benchmarks/bellows_layer.py).
//
// Layouts (row-major, contiguous):
//   keys   [m, hkv * d]  bf16 (keys_bf16 = 1) or fp32  pre-RoPE keys without their bias
//   bias   [hkv * d]     fp32
//   cos, sin [m, cs_stride]  fp32  the RoPE table of each token, its first d / 2 values read (HF layout:
//                        both halves share one angle)
//   starts [nseq + 1]    token ranges of the sequences (tokens of sequence b: starts[b] .. starts[b+1])
//   q      [nseq, hkv, rows, d] fp32  query rows (rows = query heads per kv head x query tokens)
//   out    [hkv, rows, m] fp32  scale * q . rope(key + bias)
#include <omp.h>

#include <vector>

#include "native_common.h"

namespace {

constexpr int kTile = 16;  // tokens scored together (one vector of lanes)
constexpr int kMaxDim = 256;

struct Tile {
  int64_t seq, t0, n;
};

template <bool kBf16>
void score_tile(const void* keys, const float* bias, const float* cos, const float* sin, const float* q,
                const Tile& tile, int64_t m, int hkv, int rows, int d, int64_t cs_stride, float scale, float* out) {
  const int half = d / 2, width = hkv * d;
  alignas(64) float y[kMaxDim * kTile];  // y[e * kTile + j]: rotated key value e of token t0 + j
  for (int h = 0; h < hkv; ++h) {
    for (int64_t j = 0; j < kTile; ++j) {
      if (j >= tile.n) {
        for (int e = 0; e < d; ++e) y[e * kTile + j] = 0.0f;
        continue;
      }
      const int64_t t = tile.t0 + j;
      const float* c = cos + t * cs_stride;
      const float* s = sin + t * cs_stride;
      const float* b = bias + h * d;
      for (int e = 0; e < half; ++e) {
        float x1, x2;
        if constexpr (kBf16) {
          const uint16_t* k = static_cast<const uint16_t*>(keys) + t * width + h * d;
          x1 = pask_native::bf2f(k[e]) + b[e];
          x2 = pask_native::bf2f(k[e + half]) + b[e + half];
        } else {
          const float* k = static_cast<const float*>(keys) + t * width + h * d;
          x1 = k[e] + b[e];
          x2 = k[e + half] + b[e + half];
        }
        y[e * kTile + j] = x1 * c[e] - x2 * s[e];
        y[(e + half) * kTile + j] = x2 * c[e] + x1 * s[e];
      }
    }
    const float* qh = q + (tile.seq * hkv + h) * static_cast<int64_t>(rows) * d;
    for (int r = 0; r < rows; ++r) {
      const float* qr = qh + static_cast<int64_t>(r) * d;
      alignas(64) float acc[kTile] = {};
      for (int e = 0; e < d; ++e) {
        const float qe = qr[e];
#pragma omp simd aligned(acc : 64)
        for (int j = 0; j < kTile; ++j) acc[j] += qe * y[e * kTile + j];
      }
      float* o = out + (static_cast<int64_t>(h) * rows + r) * m + tile.t0;
      for (int64_t j = 0; j < tile.n; ++j) o[j] = acc[j] * scale;
    }
  }
}

}  // namespace

extern "C" {

// 0 on success, 1 when a shape is out of range.
int pask_latent_scores(int64_t m, int hkv, int rows, int d, const void* keys, int keys_bf16, const float* bias,
                       const float* cos, const float* sin, int64_t cs_stride, int nseq, const int64_t* starts, const float* q,
                       float scale, float* out, int threads) {
  if (d <= 0 || d % 2 || d > kMaxDim || hkv <= 0 || rows <= 0 || nseq < 0 || m < 0 || cs_stride < d / 2) return 1;
  std::vector<Tile> tiles;
  for (int b = 0; b < nseq; ++b) {
    if (starts[b] > starts[b + 1] || starts[b] < 0 || starts[b + 1] > m) return 1;
    for (int64_t t = starts[b]; t < starts[b + 1]; t += kTile)
      tiles.push_back({b, t, std::min<int64_t>(kTile, starts[b + 1] - t)});
  }
  const int64_t count = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
  for (int64_t i = 0; i < count; ++i) {
    if (keys_bf16)
      score_tile<true>(keys, bias, cos, sin, q, tiles[i], m, hkv, rows, d, cs_stride, scale, out);
    else
      score_tile<false>(keys, bias, cos, sin, q, tiles[i], m, hkv, rows, d, cs_stride, scale, out);
  }
  return 0;
}

}  // extern "C"

// RMSNorm of bf16 rows, bit-identical to transformers' Qwen2 / Llama RMSNorm in PyTorch (pask/cpu/native_norm.py):
//   h = x.float(); var = h.pow(2).mean(-1); y = bf16(h * rsqrt(var + eps)); out = bf16(w * y)
// Every step is an IEEE operation with one rounding; the one order that matters is the sum of
// squares, which follows PyTorch's CPU sum (aten/src/ATen/native/cpu/SumKernel.cpp,
// vectorized_inner_sum): `vec`-lane vectors summed by row_sum (4 interleaved accumulators over a
// multi-level cascade), the scalar tail, then the lanes in order. `vec` (8 or 16) is the width of
// PyTorch's Vectorized<float> in that kernel, found by the Python probe. Built with
// -ffp-contract=off: a fused multiply-add would skip a rounding PyTorch makes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace {

using pask_native::bf2f;
constexpr auto f2bf = pask_native::f2bf_torch;

int ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return x <= 1 ? 0 : 1;
  int r = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v; v >>= 1) ++r;
  return r;
}

// PyTorch's sum of n contiguous floats with V-lane vectors (V = 8 or 16).
template <int V>
float torch_sum(const float* x, int64_t n) {
  struct Vec {
    float l[V];
  };
  auto zero = [] {
    Vec z;
    for (int i = 0; i < V; ++i) z.l[i] = 0.0f;
    return z;
  };
  auto add = [](Vec& a, const Vec& b) {
    for (int i = 0; i < V; ++i) a.l[i] = a.l[i] + b.l[i];
  };
  auto load = [&](int64_t v) {
    Vec r;
    std::memcpy(r.l, x + v * V, sizeof(r.l));
    return r;
  };
  const int64_t nvec = n / V, size_ilp = nvec / 4;
  constexpr int levels = 4;
  const int level_power = ceil_log2(size_ilp) / levels > 4 ? ceil_log2(size_ilp) / levels : 4;
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  Vec acc[levels][4];
  for (auto& lv : acc)
    for (auto& a : lv) a = zero();
  int64_t i = 0;
  while (i + level_step <= size_ilp) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add(acc[0][k], load(4 * i + k));
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k) {
        add(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = zero();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int k = 0; k < 4; ++k) add(acc[0][k], load(4 * i + k));
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k) add(acc[0][k], acc[j][k]);
  for (int64_t v = size_ilp * 4; v < nvec; ++v) add(acc[0][0], load(v));
  for (int k = 1; k < 4; ++k) add(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t t = nvec * V; t < n; ++t) total = total + x[t];
  for (int l = 0; l < V; ++l) total = total + acc[0][0].l[l];
  return total;
}

}  // namespace

extern "C" {

// out[r, :] = RMSNorm(x[r, :]) * w for `rows` contiguous rows of `n` bf16 values. Returns 0, or -1
// for a `vec` other than 8 / 16 or n < 1.
int pask_rms_norm_bf16(int64_t rows, int64_t n, const uint16_t* x, const uint16_t* w, float eps, int vec,
                       uint16_t* out) {
  if ((vec != 8 && vec != 16) || n < 1) return -1;
#pragma omp parallel for schedule(static) if (rows >= 64)  // prefill; a decode step's few rows stay serial
  for (int64_t r = 0; r < rows; ++r) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
    float* sq = buf.data();
    const uint16_t* xr = x + r * n;
    uint16_t* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float h = bf2f(xr[i]);
      sq[i] = h * h;
    }
    const float sum = vec == 8 ? torch_sum<8>(sq, n) : torch_sum<16>(sq, n);
    const float var = sum / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(var + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(xr[i]) * inv)));
  }
  return 0;
}

}  // extern "C"

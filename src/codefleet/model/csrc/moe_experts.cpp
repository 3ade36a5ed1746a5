// Fused SwiGLU experts for small slot counts on CPU (decode): `codefleet::moe_experts`.
//
//   y[n] = sum_k w[n, k] * (silu(x[n] @ Wg[e]) * (x[n] @ Wu[e])) @ Wd[e],   e = experts[n, k] - e0
//
// x [N, D], experts [N, K] (int64, global ids; slots outside this shard's e0..e0+E-1 are skipped),
// weights [N, K], w_gate_up [E, D, 2F] (gate columns first, then up), w_down [E, F, D]; fp32, contiguous.
// The slots are sorted by expert here (a counting sort), every expert's weights are read once per call,
// however many slots it has, and only its real rows are computed (no padding to the busiest expert).
// A slot's result depends only on its own row (each dot product runs over k in order), so a token's
// output is the same alone or in any batch. Work is split into (expert, column tile) tasks over ATen's
// thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // rows per register block
constexpr int64_t kCols = 32;  // columns per half tile: a block computes two halves, 4 x 64 sums in registers

// c0[r][j] = sum_k a[r][k] b0[k][j], c1 likewise with b1, for R rows a[0..R-1] and NT columns of
// b0 and b1 (row stride ldb): gate and up columns of the same hidden units, or two adjacent column tiles
template <int64_t R, int64_t NT>
inline void block(const float* const* a, const float* b0, const float* b1, int64_t ldb, int64_t K,
                  float (*c0)[kCols], float (*c1)[kCols]) {
  float s0[R][NT] = {}, s1[R][NT] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* p0 = b0 + k * ldb;
    const float* p1 = b1 + k * ldb;
    for (int64_t r = 0; r < R; ++r) {
      const float ar = a[r][k];
      for (int64_t j = 0; j < NT; ++j) {
        s0[r][j] += ar * p0[j];
        s1[r][j] += ar * p1[j];
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NT; ++j) c0[r][j] = s0[r][j], c1[r][j] = s1[r][j];
}

// `block` for any rows (<= kRows) and columns (<= kCols; a last, narrower tile takes a scalar loop)
inline void block_any(int64_t rows, int64_t cols, const float* const* a, const float* b0, const float* b1,
                      int64_t ldb, int64_t K, float (*c0)[kCols], float (*c1)[kCols]) {
  if (cols == kCols) {
    switch (rows) {
      case 4: return block<4, kCols>(a, b0, b1, ldb, K, c0, c1);
      case 3: return block<3, kCols>(a, b0, b1, ldb, K, c0, c1);
      case 2: return block<2, kCols>(a, b0, b1, ldb, K, c0, c1);
      default: return block<1, kCols>(a, b0, b1, ldb, K, c0, c1);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float x0 = 0.f, x1 = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        x0 += a[r][k] * b0[k * ldb + j];
        x1 += a[r][k] * b1[k * ldb + j];
      }
      c0[r][j] = x0, c1[r][j] = x1;
    }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& w_gate_up, const at::Tensor& w_down, int64_t e0) {
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && weights.sizes() == experts.sizes() && w_gate_up.dim() == 3 &&
                  w_down.dim() == 3,
              "moe_experts: x [N, D], experts [N, K], weights [N, K], w_gate_up [E, D, 2F], w_down [E, F, D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat &&
                  w_gate_up.scalar_type() == at::kFloat && w_down.scalar_type() == at::kFloat &&
                  experts.scalar_type() == at::kLong,
              "moe_experts: fp32 tensors and int64 expert ids");
  TORCH_CHECK(x.is_contiguous() && experts.is_contiguous() && weights.is_contiguous() && w_gate_up.is_contiguous() &&
                  w_down.is_contiguous(),
              "moe_experts: contiguous tensors");
  const int64_t N = x.size(0), D = x.size(1), K = experts.size(1), E = w_gate_up.size(0), F = w_down.size(1);
  TORCH_CHECK(experts.size(0) == N && w_gate_up.size(1) == D && w_gate_up.size(2) == 2 * F && w_down.size(0) == E &&
                  w_down.size(2) == D,
              "moe_experts: shapes do not agree");

  // counting sort of this shard's slots by expert (stable: slot order within an expert)
  const int64_t* ids = experts.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), slot_of, pos_of(N * K, -1);
  for (int64_t i = 0; i < N * K; ++i) {
    const int64_t e = ids[i] - e0;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t S = start[E];
  slot_of.resize(S);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < N * K; ++i) {
      const int64_t e = ids[i] - e0;
      if (e >= 0 && e < E) pos_of[i] = fill[e], slot_of[fill[e]++] = i;
    }
  }

  at::Tensor y = at::zeros({N, D}, x.options());
  if (S == 0) return y;
  at::Tensor h = at::empty({S, F}, x.options());
  at::Tensor ys = at::empty({S, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wgu = w_gate_up.data_ptr<float>();
  const float* wd = w_down.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* ysp = ys.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  // phase 1: h = silu(x @ Wg) * (x @ Wu), tasks (expert, tile of kCols hidden units: gate and up columns)
  const int64_t tiles_f = (F + kCols - 1) / kCols;
  at::parallel_for(0, E * tiles_f, 1, [&](int64_t begin, int64_t end) {
    float g[kRows][kCols], u[kRows][kCols];
    const float* rows_x[kRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / tiles_f, j0 = (task % tiles_f) * kCols, cols = std::min(kCols, F - j0);
      const float* wg = wgu + e * D * 2 * F + j0;
      for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kRows) {
        const int64_t rows = std::min(kRows, start[e + 1] - p0);
        for (int64_t r = 0; r < rows; ++r) rows_x[r] = xp + slot_of[p0 + r] / K * D;
        block_any(rows, cols, rows_x, wg, wg + F, 2 * F, D, g, u);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j)
            hp[(p0 + r) * F + j0 + j] = g[r][j] / (1.f + std::exp(-g[r][j])) * u[r][j];
      }
    }
  });
  // phase 2: ys = h @ Wd, tasks (expert, tile of 2 kCols output columns, computed as two halves)
  const int64_t tiles_d = (D + 2 * kCols - 1) / (2 * kCols);
  at::parallel_for(0, E * tiles_d, 1, [&](int64_t begin, int64_t end) {
    float c0[kRows][kCols], c1[kRows][kCols];
    const float* rows_h[kRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / tiles_d, d0 = (task % tiles_d) * 2 * kCols;
      const int64_t cols0 = std::min(kCols, D - d0), cols1 = std::max<int64_t>(0, std::min(kCols, D - d0 - kCols));
      const float* w = wd + e * F * D + d0;
      for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kRows) {
        const int64_t rows = std::min(kRows, start[e + 1] - p0);
        for (int64_t r = 0; r < rows; ++r) rows_h[r] = hp + (p0 + r) * F;
        if (cols1 == kCols) {
          block_any(rows, kCols, rows_h, w, w + kCols, D, F, c0, c1);
        } else {  // the last, narrower columns
          block_any(rows, cols0, rows_h, w, w, D, F, c0, c0);
          if (cols1 > 0) block_any(rows, cols1, rows_h, w + kCols, w + kCols, D, F, c1, c1);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* out = ysp + (p0 + r) * D + d0;
          for (int64_t j = 0; j < cols0; ++j) out[j] = c0[r][j];
          for (int64_t j = 0; j < cols1; ++j) out[kCols + j] = c1[r][j];
        }
      }
    }
  });
  // combine: y[n] = sum over n's slots here, in slot order, of weight * expert output
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t p = pos_of[n * K + k];
        if (p < 0) continue;
        const float w = wp[n * K + k];
        const float* src = ysp + p * D;
        float* dst = yp + n * D;
        for (int64_t j = 0; j < D; ++j) dst[j] += w * src[j];
      }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(codefleet, m) {
  m.def("moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor w_gate_up, Tensor w_down, int e0) -> Tensor");
}

TORCH_LIBRARY_IMPL(codefleet, CPU, m) { m.impl("moe_experts", moe_experts); }

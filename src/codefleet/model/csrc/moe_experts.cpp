// Fused SwiGLU experts for small slot counts on CPU (decode): `codefleet::moe_experts`.
//
//   y[n] = sum_k w[n, k] * (silu(x[n] @ Wg[e]) * (x[n] @ Wu[e])) @ Wd[e],   e = experts[n, k] - e0
//
// x [N, D], experts [N, K] (int64, global ids; slots outside this shard's e0..e0+E-1 are skipped),
// weights [N, K]; fp32, contiguous. The expert weights come packed in column tiles so that every task
// streams one contiguous block (`pack_experts` in kernels.py):
//   gate_up [E, ceil(F/32), D, 64]: for hidden units j0..j0+31, row k holds 32 gate then 32 up columns,
//   down    [E, ceil(D/64), F, 64]: for output columns d0..d0+63, row f holds those 64 columns,
// zero-padded past F and D. The slots are sorted by expert here (a counting sort), every expert's weights
// are read once per call however many slots it has, and only its real rows are computed (no padding to
// the busiest expert). A slot's result depends only on its own row (each dot product runs over k in
// order), so a token's output is the same alone or in any batch. Work is split into (expert, tile) tasks
// over ATen's thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRows = 4;   // rows per register block
constexpr int64_t kTile = 64;  // columns per packed tile row: 4 x 64 sums stay in registers
constexpr int64_t kAhead = 8;  // packed rows prefetched ahead (2 KB): cold weights ran ~20% slower without

// c[r][j] = sum_k a[r][k] * b[k][j] for R rows a[0..R-1] and one packed tile b [K, kTile]
template <int64_t R>
inline void block(const float* const* a, const float* b, int64_t K, float (*c)[kTile]) {
  float s[R][kTile] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * kTile;
    for (int64_t line = 0; line < kTile; line += 16) __builtin_prefetch(bk + kAhead * kTile + line);
    for (int64_t r = 0; r < R; ++r) {
      const float ar = a[r][k];
      for (int64_t j = 0; j < kTile; ++j) s[r][j] += ar * bk[j];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < kTile; ++j) c[r][j] = s[r][j];
}

inline void block_rows(int64_t rows, const float* const* a, const float* b, int64_t K, float (*c)[kTile]) {
  switch (rows) {
    case 4: return block<4>(a, b, K, c);
    case 3: return block<3>(a, b, K, c);
    case 2: return block<2>(a, b, K, c);
    default: return block<1>(a, b, K, c);
  }
}

// One phase over (expert, tile) tasks on ATen's thread pool: for each block of up to kRows of expert e's
// rows (sorted positions p), the sums of rows `row(p)` (length K) times the task's packed tile [K, kTile],
// handed to `store(p0, rows, tile, c)`.
template <typename Row, typename Store>
void expert_tiles(int64_t E, int64_t tiles, const std::vector<int64_t>& start, const float* packed, int64_t K,
                  Row row, Store store) {
  at::parallel_for(0, E * tiles, 1, [&](int64_t begin, int64_t end) {
    float c[kRows][kTile];
    const float* a[kRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t e = task / tiles;
      for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kRows) {
        const int64_t rows = std::min(kRows, start[e + 1] - p0);
        for (int64_t r = 0; r < rows; ++r) a[r] = row(p0 + r);
        block_rows(rows, a, packed + task * K * kTile, K, c);
        store(p0, rows, task % tiles, c);
      }
    }
  });
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t e0) {
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && weights.sizes() == experts.sizes() && gate_up.dim() == 4 &&
                  down.dim() == 4,
              "moe_experts: x [N, D], experts [N, K], weights [N, K], packed gate_up [E, F/32, D, 64] and "
              "down [E, D/64, F, 64]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat &&
                  gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat &&
                  experts.scalar_type() == at::kLong,
              "moe_experts: fp32 tensors and int64 expert ids");
  TORCH_CHECK(x.is_contiguous() && experts.is_contiguous() && weights.is_contiguous() && gate_up.is_contiguous() &&
                  down.is_contiguous(),
              "moe_experts: contiguous tensors");
  const int64_t N = x.size(0), D = x.size(1), K = experts.size(1), E = gate_up.size(0);
  const int64_t tiles_f = gate_up.size(1), tiles_d = down.size(1), F = down.size(2);
  TORCH_CHECK(experts.size(0) == N && gate_up.size(2) == D && gate_up.size(3) == kTile && down.size(0) == E &&
                  down.size(3) == kTile && tiles_f == (F + kTile / 2 - 1) / (kTile / 2) &&
                  tiles_d == (D + kTile - 1) / kTile,
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
  const float* gu = gate_up.data_ptr<float>();
  const float* dn = down.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* ysp = ys.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kHalf = kTile / 2;

  // phase 1: h = silu(x @ Wg) * (x @ Wu), tasks (expert, tile of 32 hidden units)
  expert_tiles(
      E, tiles_f, start, gu, D, [&](int64_t p) { return xp + slot_of[p] / K * D; },
      [&](int64_t p0, int64_t rows, int64_t tile, float (*c)[kTile]) {
        const int64_t j0 = tile * kHalf, cols = std::min(kHalf, F - j0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j) {
            const float g = c[r][j];
            hp[(p0 + r) * F + j0 + j] = g / (1.f + std::exp(-g)) * c[r][kHalf + j];
          }
      });
  // phase 2: ys = h @ Wd, tasks (expert, tile of 64 output columns)
  expert_tiles(
      E, tiles_d, start, dn, F, [&](int64_t p) { return static_cast<const float*>(hp + p * F); },
      [&](int64_t p0, int64_t rows, int64_t tile, float (*c)[kTile]) {
        const int64_t d0 = tile * kTile, cols = std::min(kTile, D - d0);
        for (int64_t r = 0; r < rows; ++r) std::copy(c[r], c[r] + cols, ysp + (p0 + r) * D + d0);
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

TORCH_LIBRARY_FRAGMENT(codefleet, m) {
  m.def("moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down, int e0) -> Tensor");
}

TORCH_LIBRARY_IMPL(codefleet, CPU, m) { m.impl("moe_experts", moe_experts); }

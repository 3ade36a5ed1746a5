// SwiGLU experts for training on CPU, forward and backward: `codefleet::moe_train_forward/backward`.
//
//   y[n] = sum_k w[n, k] * (silu(x[n] @ Wg[e]) * (x[n] @ Wu[e])) @ Wd[e],   e = experts[n, k] - e0
//
// x [N, D], experts [N, K] (int64, global ids; entries outside this shard's e0 .. e0 + E - 1 are skipped),
// weights [N, K], and the parameters as they are: gate_up [E, D, 2F] (gate then up columns), down [E, F, D];
// fp32, contiguous. The backward returns the gradients of x, weights, gate_up and down.
//
// Why not the PyTorch path's grouped products: with 2 threads every ~500-row product is split across both
// cores, and each pass (gather, gate/up product, SwiGLU, down product, scatter) runs over all experts before
// the next, so its operands come back from memory. Here the routing entries are sorted by expert (a counting
// sort) and one task is one expert, start to finish, on one core: its rows are gathered, the products run
// single-threaded in the BLAS torch links (MKL does not spawn threads inside a parallel region), the SwiGLU
// and its derivative run between them on data still in cache, and the outputs land in slot order. Experts
// are handed out biggest first from a shared counter so the cores finish together. Each token then sums
// its slots in routing order (no atomics; nothing depends on which thread ran which expert). The forward
// saves each slot's gathered input and gate/up pre-activations (chunked, see `Chunked`) for the backward.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

// the BLAS that torch links (MKL in the x86 wheels) exports the Fortran GEMM; without it the library does not
// load and callers take the PyTorch path
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

// row-major C[M, N] (row stride ldc) = op(A) [M, K] @ op(B) [K, N]; op transposes when asked. BLAS is
// column-major, so this is C^T = op(B)^T @ op(A)^T there.
void mm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, bool ta, const float* B, int64_t ldb, bool tb,
        float* C, int64_t ldc) {
  const int m = N, n = M, k = K, la = ldb, lb = lda, lc = ldc;
  const float one = 1.f, zero = 0.f;
  sgemm_(tb ? "T" : "N", ta ? "T" : "N", &m, &n, &k, &one, B, &la, A, &lb, &zero, C, &lc);
}

// exp(x) without branches, so that loops over it vectorise (glibc's expf does not without -ffast-math):
// Cephes' expf, range reduction by ln 2 and a degree-6 polynomial, ~1 ulp; x clamped to [-87, 88].
inline float exp_(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = x * x;
  const float p = ((((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
                     1.6666665459e-1f) * x + 5.0000001201e-1f) * z + x) + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

inline float sigmoid(float g) { return 1.f / (1.f + exp_(-g)); }

struct Slots {
  int64_t N, D, F, E, K, S;
  std::vector<int64_t> start;        // [E + 1]: expert e's slots are start[e] .. start[e + 1] - 1
  std::vector<int64_t> slot_of;      // [S]: sorted slot p is routing entry slot_of[p] = n * K + k
  std::vector<int64_t> pos_of;       // [N * K]: the sorted slot of each routing entry, -1 off this shard
  std::vector<int64_t> order;        // experts, most slots first
  std::vector<int64_t> chunk_start;  // slot-ordered buffers come in chunks of whole experts (see `chunked`)
};

// Buffers of one row per slot, allocated in chunks of whole experts of about `chunk_slots` slots: a fresh
// tensor above glibc's mmap threshold (32 MB) is page-faulted in again on every call (~10 ms each here),
// smaller ones are reused from the heap. rows[p]: slot p's row.
struct Chunked {
  std::vector<at::Tensor> chunks;
  std::vector<float*> rows;
};

Chunked chunked(const Slots& s, int64_t width, const at::TensorOptions& options) {
  Chunked c;
  c.rows.resize(s.S);
  for (size_t i = 0; i + 1 < s.chunk_start.size(); ++i) {
    const int64_t p0 = s.chunk_start[i], p1 = s.chunk_start[i + 1];
    c.chunks.push_back(at::empty({p1 - p0, width}, options));
    float* base = c.chunks.back().data_ptr<float>();
    for (int64_t p = p0; p < p1; ++p) c.rows[p] = base + (p - p0) * width;
  }
  return c;
}

// The routing entries of this shard's experts e0 .. e0 + E - 1 sorted by expert (a counting sort, stable:
// entry order within an expert, as a stable argsort), after checking the inputs.
Slots slots(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights, const at::Tensor& gate_up,
            const at::Tensor& down, int64_t e0, int64_t chunk_slots, const char* op) {
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && weights.sizes() == experts.sizes() && gate_up.dim() == 3 &&
                  down.dim() == 3,
              op, ": x [N, D], experts [N, K], weights [N, K], gate_up [E, D, 2F] and down [E, F, D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weights.scalar_type() == at::kFloat &&
                  gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat &&
                  experts.scalar_type() == at::kLong,
              op, ": fp32 tensors and int64 expert ids");
  TORCH_CHECK(x.is_contiguous() && experts.is_contiguous() && weights.is_contiguous() && gate_up.is_contiguous() &&
                  down.is_contiguous(),
              op, ": contiguous tensors");
  TORCH_CHECK(chunk_slots > 0, op, ": chunk_slots must be positive");
  Slots s{x.size(0), x.size(1), down.size(1), gate_up.size(0), experts.size(1), 0, {}, {}, {}, {}, {}};
  TORCH_CHECK(experts.size(0) == s.N && gate_up.size(1) == s.D && gate_up.size(2) == 2 * s.F && down.size(0) == s.E &&
                  down.size(2) == s.D,
              op, ": shapes do not agree");
  const int64_t* ids = experts.data_ptr<int64_t>();
  const int64_t entries = s.N * s.K;
  s.start.assign(s.E + 1, 0);
  for (int64_t i = 0; i < entries; ++i) {
    const int64_t e = ids[i] - e0;
    if (e >= 0 && e < s.E) ++s.start[e + 1];
  }
  for (int64_t e = 0; e < s.E; ++e) s.start[e + 1] += s.start[e];
  s.S = s.start[s.E];
  s.slot_of.resize(s.S);
  s.pos_of.assign(entries, -1);
  std::vector<int64_t> fill(s.start.begin(), s.start.end() - 1);
  for (int64_t i = 0; i < entries; ++i) {
    const int64_t e = ids[i] - e0;
    if (e >= 0 && e < s.E) s.pos_of[i] = fill[e], s.slot_of[fill[e]++] = i;
  }
  s.chunk_start.push_back(0);
  for (int64_t e = 0; e < s.E; ++e)
    if (s.start[e + 1] - s.chunk_start.back() >= chunk_slots || (e == s.E - 1 && s.start[e + 1] > s.chunk_start.back()))
      s.chunk_start.push_back(s.start[e + 1]);
  s.order.resize(s.E);
  std::iota(s.order.begin(), s.order.end(), 0);
  std::stable_sort(s.order.begin(), s.order.end(),
                   [&](int64_t a, int64_t b) { return s.start[a + 1] - s.start[a] > s.start[b + 1] - s.start[b]; });
  return s;
}

// fn(e) for every expert with slots, biggest first, on ATen's threads
template <typename Fn>
void each_expert(const Slots& s, Fn fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), s.E));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < s.E; i = next++)
      if (s.start[s.order[i] + 1] > s.start[s.order[i]]) fn(s.order[i]);
  });
}

// out[n] = sum of rows[p] over token n's slots p on this shard, in routing order (k = 0 .. K - 1)
void sum_by_token(const Slots& s, const std::vector<float*>& rows, float* out) {
  at::parallel_for(0, s.N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* o = out + n * s.D;
      std::fill(o, o + s.D, 0.f);
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t p = s.pos_of[n * s.K + k];
        if (p < 0) continue;
        const float* r = rows[p];
        for (int64_t j = 0; j < s.D; ++j) o[j] += r[j];
      }
    }
  });
}

// the rows of the tokens of sorted slots p0 .. p0 + rows - 1
void gather(const Slots& s, const float* src, int64_t p0, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * s.D, src + s.slot_of[p0 + r] / s.K * s.D, s.D * sizeof(float));
}

// (y [N, D], saved: per chunk of experts the gathered inputs [slots, D] and the gate/up pre-activations
// [slots, 2F], which the backward needs: chunk i's are saved[2i], saved[2i + 1])
std::tuple<at::Tensor, std::vector<at::Tensor>> moe_train_forward(const at::Tensor& x, const at::Tensor& experts,
                                                                  const at::Tensor& weights, const at::Tensor& gate_up,
                                                                  const at::Tensor& down, int64_t e0,
                                                                  int64_t chunk_slots) {
  const Slots s = slots(x, experts, weights, gate_up, down, e0, chunk_slots, "moe_train_forward");
  const int64_t D = s.D, F = s.F, G = 2 * s.F;
  at::Tensor y = at::empty({s.N, D}, x.options());
  Chunked xs = chunked(s, D, x.options()), h = chunked(s, G, x.options()), ys = chunked(s, D, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weights.data_ptr<float>(), *gu = gate_up.data_ptr<float>(),
              *dn = down.data_ptr<float>();
  each_expert(s, [&](int64_t e) {
    const int64_t p0 = s.start[e], M = s.start[e + 1] - p0;
    thread_local std::vector<float> a;
    a.resize(M * F);
    float *xe = xs.rows[p0], *he = h.rows[p0];  // an expert's rows are contiguous within its chunk
    gather(s, xp, p0, M, xe);
    mm(M, G, D, xe, D, false, gu + e * D * G, G, false, he, G);
    for (int64_t r = 0; r < M; ++r) {
      const float* g = he + r * G;
      float* ar = a.data() + r * F;
      const float wr = wp[s.slot_of[p0 + r]];
      for (int64_t j = 0; j < F; ++j) ar[j] = g[j] * sigmoid(g[j]) * g[F + j] * wr;
    }
    mm(M, D, F, a.data(), F, false, dn + e * F * D, D, false, ys.rows[p0], D);
  });
  sum_by_token(s, ys.rows, y.data_ptr<float>());
  std::vector<at::Tensor> saved;
  for (size_t i = 0; i < h.chunks.size(); ++i) saved.insert(saved.end(), {xs.chunks[i], h.chunks[i]});
  return {y, saved};
}

// (dx [N, D], dweights [N, K] (zero off this shard), dgate_up [E, D, 2F], ddown [E, F, D])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_train_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
    const at::Tensor& gate_up, const at::Tensor& down, int64_t e0, at::TensorList saved, int64_t chunk_slots) {
  const Slots s = slots(x, experts, weights, gate_up, down, e0, chunk_slots, "moe_train_backward");
  const int64_t D = s.D, F = s.F, G = 2 * s.F;
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == at::kFloat && dy.is_contiguous(),
              "moe_train_backward: dy must be like x");
  const size_t n_chunks = s.chunk_start.size() - 1;
  TORCH_CHECK(saved.size() == 2 * n_chunks, "moe_train_backward: saved must be what the forward returned");
  std::vector<const float*> x_rows(s.S), h_rows(s.S);
  for (size_t i = 0; i < n_chunks; ++i) {
    const int64_t p0 = s.chunk_start[i], p1 = s.chunk_start[i + 1];
    for (auto [t, width, rows] : {std::tuple{saved[2 * i], D, &x_rows}, std::tuple{saved[2 * i + 1], G, &h_rows}}) {
      TORCH_CHECK(t.dim() == 2 && t.size(0) == p1 - p0 && t.size(1) == width && t.scalar_type() == at::kFloat &&
                      t.is_contiguous(),
                  "moe_train_backward: saved must be what the forward returned");
      for (int64_t p = p0; p < p1; ++p) (*rows)[p] = t.data_ptr<float>() + (p - p0) * width;
    }
  }
  at::Tensor dx = at::empty({s.N, D}, x.options());
  at::Tensor dw = at::zeros_like(weights);
  at::Tensor dgu = at::empty({s.E, D, G}, x.options());
  at::Tensor ddn = at::empty({s.E, F, D}, x.options());
  Chunked dxs = chunked(s, D, x.options());
  const float *dyp = dy.data_ptr<float>(), *wp = weights.data_ptr<float>(), *gu = gate_up.data_ptr<float>(),
              *dn = down.data_ptr<float>();
  float *dwp = dw.data_ptr<float>(), *dgup = dgu.data_ptr<float>(), *ddnp = ddn.data_ptr<float>();
  for (int64_t e = 0; e < s.E; ++e)
    if (s.start[e + 1] == s.start[e]) {  // nobody was routed here: zero gradients
      std::fill(dgup + e * D * G, dgup + (e + 1) * D * G, 0.f);
      std::fill(ddnp + e * F * D, ddnp + (e + 1) * F * D, 0.f);
    }
  each_expert(s, [&](int64_t e) {
    const int64_t p0 = s.start[e], M = s.start[e + 1] - p0;
    thread_local std::vector<float> dys, da, aw, dh;
    dys.resize(M * D);
    da.resize(M * F);
    aw.resize(M * F);
    dh.resize(M * G);
    gather(s, dyp, p0, M, dys.data());                                            // dy of each slot's token
    mm(M, F, D, dys.data(), D, false, dn + e * F * D, D, true, da.data(), F);  // d(weighted activation) / w
    const float* he = h_rows[p0];
    for (int64_t r = 0; r < M; ++r) {
      const float* g = he + r * G;
      const float* dar = da.data() + r * F;
      float* awr = aw.data() + r * F;
      float* dhr = dh.data() + r * G;
      const int64_t entry = s.slot_of[p0 + r];
      const float wr = wp[entry];
      float dwr = 0.f;
#pragma omp simd reduction(+ : dwr)
      for (int64_t j = 0; j < F; ++j) {
        const float sg = sigmoid(g[j]), silu = g[j] * sg, act = silu * g[F + j], d = dar[j] * wr;
        dwr += dar[j] * act;
        awr[j] = act * wr;
        dhr[F + j] = d * silu;                             // d up
        dhr[j] = d * g[F + j] * (sg + silu * (1.f - sg));  // d gate: silu' = s + silu (1 - s)
      }
      dwp[entry] = dwr;
    }
    mm(F, D, M, aw.data(), F, true, dys.data(), D, false, ddnp + e * F * D, D);  // dWd = (w act)^T dy
    mm(D, G, M, x_rows[p0], D, true, dh.data(), G, false, dgup + e * D * G, G);  // dWgu = x^T dh
    mm(M, D, G, dh.data(), G, false, gu + e * D * G, G, true, dxs.rows[p0], D);    // dx per slot = dh Wgu^T
  });
  sum_by_token(s, dxs.rows, dx.data_ptr<float>());
  return {dx, dw, dgu, ddn};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(codefleet, m) {
  m.def("moe_train_forward(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down, int e0, "
        "int chunk_slots) -> (Tensor, Tensor[])");
  m.def("moe_train_backward(Tensor dy, Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down, int e0, "
        "Tensor[] saved, int chunk_slots) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(codefleet, CPU, m) {
  m.impl("moe_train_forward", moe_train_forward);
  m.impl("moe_train_backward", moe_train_backward);
}

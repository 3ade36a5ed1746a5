// A decode step's small ops on CPU, fused: `codefleet::decode_attention` and `codefleet::moe_route`.
//
// A batch-32 decode step of the tiny model ran ~60 ATen calls per layer from Python (two norms, the fused
// projection's views, RoPE, two cache writes, the attention's baddbmm/softmax/bmm, the router's softmax,
// top-k and renormalisation, the residual adds), each a few microseconds of dispatch for a few of work.
// These ops do the same math in one call each: the GEMMs, the attention's baddbmm/softmax/bmm and the
// router's scores through ATen (the calls the Python path makes), norms, RoPE, cache writes, mask and top-k
// in plain loops. fp32, contiguous tensors; the Python paths (transformer.py, moe.py, cache.py) are the
// definition and tests/test_model_kernels.py holds these equal to them (to float rounding: the norms sum
// in another order). model/decode.py drives them.
//
// decode_attention(x [B, D], attn_norm [D], w_qkv [(H + 2 Hkv) Dh, D], wo [D, H Dh], ffn_norm [D],
//                  rope [P, 2, 1, Dh], k_cache, v_cache [layers, slots, Hkv, max_len, Dh], layer,
//                  slots [B], positions [B], n_heads, eps, q_norm [Dh] or None, k_norm [Dh] or None) -> (x2, h)
//
// is one transformer block's attention half for one new token per row b at position positions[b] of cache
// slot slots[b]: h0 = rms_norm(x) * attn_norm; q, k, v = h0 @ w_qkv^T; with q_norm and k_norm (Qwen3's q/k
// norm) each query head rms_norm(q) * q_norm and each key head rms_norm(k) * k_norm; RoPE on q and k from the table
// (`rope_table`: cos, and sin with the rotate-half sign folded in); k and v written to the cache; each
// query head attends over positions 0..positions[b] of its kv head (head h uses kv head h / (H / Hkv));
// x2 = x + attention @ wo^T; h = rms_norm(x2) * ffn_norm (the feed-forward's input).
//
// moe_route(h [N, D], w [E, D], bias [E] or None, sigmoid, renorm, top_k) -> (experts [N, K] int64,
//           weights [N, K]) is `Router.forward` without losses: scores = softmax (or sigmoid) of h @ w^T, the
// top_k highest scores (+ bias, for the choice only) in descending order, their scores as weights,
// renormalised to sum to one if asked.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // partial sums per reduction: independent, so the compiler vectorizes them

// out[b] = x[b] * (1 / sqrt(mean(x[b]^2) + eps)) * w as `F.rms_norm` computes it, the sum of squares in
// kLanes partial sums (so within float rounding of it, not bit-equal)
void rms_norm(const float* x, const float* w, float* out, int64_t B, int64_t D, float eps) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xb = x + b * D;
    float part[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= D; j += kLanes)
      for (int64_t i = 0; i < kLanes; ++i) part[i] += xb[j + i] * xb[j + i];
    for (; j < D; ++j) part[0] += xb[j] * xb[j];
    for (int64_t width = kLanes / 2; width > 0; width /= 2)
      for (int64_t i = 0; i < width; ++i) part[i] += part[i + width];
    const float r = 1.f / std::sqrt(part[0] / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[b * D + i] = xb[i] * r * w[i];
  }
}

// x * cos + roll(x, Dh / 2) * sin_signed, in place on one head
void rope(float* x, const float* cos, const float* sin, int64_t Dh) {
  const int64_t half = Dh / 2;
  float tmp[1024];
  std::copy(x, x + Dh, tmp);
  for (int64_t d = 0; d < half; ++d) x[d] = tmp[d] * cos[d] + tmp[d + half] * sin[d];
  for (int64_t d = half; d < Dh; ++d) x[d] = tmp[d] * cos[d] + tmp[d - half] * sin[d];
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), "decode_attention: ",
              name, " must be a contiguous fp32 CPU tensor");
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& x, const at::Tensor& attn_norm,
                                                    const at::Tensor& w_qkv, const at::Tensor& wo,
                                                    const at::Tensor& ffn_norm, const at::Tensor& rope_tab,
                                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                    int64_t layer, const at::Tensor& slots,
                                                    const at::Tensor& positions, int64_t n_heads, double eps,
                                                    const std::optional<at::Tensor>& q_norm,
                                                    const std::optional<at::Tensor>& k_norm) {
  check_f32(x, "x");
  check_f32(attn_norm, "attn_norm");
  check_f32(w_qkv, "w_qkv");
  check_f32(wo, "wo");
  check_f32(ffn_norm, "ffn_norm");
  check_f32(rope_tab, "rope");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.is_contiguous() &&
                  positions.is_contiguous(),
              "decode_attention: slots and positions must be contiguous int64 tensors");
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && rope_tab.dim() == 4,
              "decode_attention: x [B, D], caches [layers, slots, Hkv, max_len, Dh], rope [P, 2, 1, Dh]");
  const int64_t B = x.size(0), D = x.size(1);
  const int64_t n_layers = k_cache.size(0), n_slots = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t max_len = k_cache.size(3), Dh = k_cache.size(4), H = n_heads;
  TORCH_CHECK(H > 0 && H % Hkv == 0 && Dh % 2 == 0 && Dh <= 1024, "decode_attention: n_heads must be a multiple "
              "of the cache's kv heads and head_dim even (at most 1024)");
  TORCH_CHECK(w_qkv.dim() == 2 && w_qkv.size(0) == (H + 2 * Hkv) * Dh && w_qkv.size(1) == D && wo.dim() == 2 &&
                  wo.size(0) == D && wo.size(1) == H * Dh && attn_norm.numel() == D && ffn_norm.numel() == D &&
                  rope_tab.size(1) == 2 && rope_tab.size(3) == Dh && slots.numel() == B && positions.numel() == B,
              "decode_attention: shapes do not agree");
  TORCH_CHECK(0 <= layer && layer < n_layers, "decode_attention: layer ", layer, " outside the cache's ",
              n_layers);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_attention: q_norm and k_norm come together");
  if (q_norm) {
    check_f32(*q_norm, "q_norm");
    check_f32(*k_norm, "k_norm");
    TORCH_CHECK(q_norm->numel() == Dh && k_norm->numel() == Dh,
                "decode_attention: q_norm and k_norm hold head_dim weights");
  }
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* pos_p = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= slot_p[b] && slot_p[b] < n_slots && 0 <= pos_p[b] && pos_p[b] < max_len &&
                    pos_p[b] < rope_tab.size(0),
                "decode_attention: row ", b, " has slot ", slot_p[b], " and position ", pos_p[b],
                ", outside the cache or the rotary table");

  const float eps_f = static_cast<float>(eps);
  at::Tensor h0 = at::empty({B, D}, x.options());
  rms_norm(x.data_ptr<float>(), attn_norm.data_ptr<float>(), h0.data_ptr<float>(), B, D, eps_f);
  at::Tensor qkv = at::mm(h0, w_qkv.t());  // [B, (H + 2 Hkv) Dh]: q heads, k heads, v heads

  // RoPE on the query and key heads, the new keys and values into the cache, the queries gathered as
  // [B * Hkv, G, Dh] (the G query heads of a kv head together, as cache.attend folds them)
  const int64_t G = H / Hkv, width = (H + 2 * Hkv) * Dh;
  at::Tensor q = at::empty({B * Hkv, G, Dh}, x.options());
  float* qkv_p = qkv.data_ptr<float>();
  float* q_p = q.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* tab = rope_tab.data_ptr<float>();
  int64_t L = 0;  // keys to attend over: the longest row's
  bool packed = true;  // rows are slots 0..B-1: the attention reads a view of the cache
  for (int64_t b = 0; b < B; ++b) {
    const int64_t pos = pos_p[b];
    const float* cos = tab + pos * 2 * Dh;
    const float* sin = cos + Dh;
    float* row = qkv_p + b * width;
    if (q_norm) {  // each head over its own Dh values, in place (rms_norm reads a head before it writes it)
      for (int64_t head = 0; head < H; ++head)
        rms_norm(row + head * Dh, q_norm->data_ptr<float>(), row + head * Dh, 1, Dh, eps_f);
      for (int64_t head = H; head < H + Hkv; ++head)
        rms_norm(row + head * Dh, k_norm->data_ptr<float>(), row + head * Dh, 1, Dh, eps_f);
    }
    for (int64_t head = 0; head < H + Hkv; ++head) rope(row + head * Dh, cos, sin, Dh);
    std::copy(row, row + H * Dh, q_p + b * H * Dh);
    for (int64_t kv = 0; kv < Hkv; ++kv) {
      const int64_t at = (((layer * n_slots + slot_p[b]) * Hkv + kv) * max_len + pos) * Dh;
      std::copy(row + (H + kv) * Dh, row + (H + kv + 1) * Dh, kc + at);
      std::copy(row + (H + Hkv + kv) * Dh, row + (H + Hkv + kv + 1) * Dh, vc + at);
    }
    L = std::max(L, pos + 1);
    packed = packed && slot_p[b] == b;
  }
  // the attention as cache.attend's decode branch computes it: mask + scale * q k^T, softmax, times v, with
  // (row, kv head) folded into one batch axis and a mask of 0 (visible) and -inf per row
  at::Tensor mask = at::empty({B * Hkv, 1, L}, x.options());
  float* mask_p = mask.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kv = 0; kv < Hkv; ++kv)
      for (int64_t l = 0; l < L; ++l) mask_p[(b * Hkv + kv) * L + l] = l <= pos_p[b] ? 0.f : -INFINITY;
  at::Tensor keys = k_cache.select(0, layer), values = v_cache.select(0, layer);
  if (packed) {
    keys = keys.narrow(0, 0, B), values = values.narrow(0, 0, B);
  } else {
    keys = keys.index_select(0, slots), values = values.index_select(0, slots);
  }
  keys = keys.narrow(2, 0, L).reshape({B * Hkv, L, Dh});
  values = values.narrow(2, 0, L).reshape({B * Hkv, L, Dh});
  const double scale = std::pow(static_cast<double>(Dh), -0.5);  // `D ** -0.5` in cache.attend
  const at::Tensor scores = at::baddbmm(mask, q, keys.transpose(1, 2), 1.0, scale);
  const at::Tensor att = at::bmm(at::softmax(scores, -1), values).view({B, H * Dh});
  at::Tensor x2 = at::mm(att, wo.t());  // then x + it, in place
  float* x2_p = x2.data_ptr<float>();
  const float* x_p = x.data_ptr<float>();
  for (int64_t i = 0; i < B * D; ++i) x2_p[i] = x_p[i] + x2_p[i];
  at::Tensor h = at::empty({B, D}, x.options());
  rms_norm(x2_p, ffn_norm.data_ptr<float>(), h.data_ptr<float>(), B, D, eps_f);
  return {x2, h};
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& w,
                                             const std::optional<at::Tensor>& bias, bool sigmoid, bool renorm,
                                             int64_t top_k) {
  TORCH_CHECK(h.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && h.is_contiguous() &&
                  w.is_contiguous() && h.device().is_cpu(),
              "moe_route: contiguous fp32 CPU tensors");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0)),
              "moe_route: the bias must be a contiguous fp32 tensor of one entry per expert");
  TORCH_CHECK(h.dim() == 2 && w.dim() == 2 && h.size(1) == w.size(1), "moe_route: h [N, D] and w [E, D]");
  const int64_t N = h.size(0), E = w.size(0), K = top_k;
  TORCH_CHECK(1 <= K && K <= E, "moe_route: top_k must be between 1 and the number of experts");
  // the scores through ATen, as Router.forward computes them: the combine weights come out bit-identical
  const at::Tensor logits = at::mm(h, w.t());  // [N, E]
  const at::Tensor scores = sigmoid ? at::sigmoid(logits) : at::softmax(logits, -1);
  at::Tensor experts = at::empty({N, K}, h.options().dtype(at::kLong));
  at::Tensor weights = at::empty({N, K}, h.options());
  const float* sp = scores.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  int64_t* ep = experts.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> select(E);
    std::vector<char> taken(E);
    for (int64_t n = begin; n < end; ++n) {
      const float* s = sp + n * E;
      for (int64_t e = 0; e < E; ++e) select[e] = bp ? s[e] + bp[e] : s[e], taken[e] = 0;
      float total = 0.f;
      for (int64_t k = 0; k < K; ++k) {  // the highest remaining, the lowest id on a tie
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[e] && (best < 0 || select[e] > select[best])) best = e;
        taken[best] = 1;
        ep[n * K + k] = best;
        wp[n * K + k] = s[best];
        total += s[best];
      }
      if (renorm)
        for (int64_t k = 0; k < K; ++k) wp[n * K + k] /= total + 1e-20f;
    }
  });
  return {experts, weights};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(codefleet, m) {
  m.def(
      "decode_attention(Tensor x, Tensor attn_norm, Tensor w_qkv, Tensor wo, Tensor ffn_norm, Tensor rope, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor slots, Tensor positions, int n_heads, float eps, "
      "Tensor? q_norm=None, Tensor? k_norm=None) "
      "-> (Tensor, Tensor)");
  m.def("moe_route(Tensor h, Tensor w, Tensor? bias, bool sigmoid, bool renorm, int top_k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(codefleet, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("moe_route", moe_route);
}

// Fused float32 CPU kernels for the decode step of Qwen3.5: conv update, gating, the recurrent gated delta rule, the
// norms, paged attention and the MoE's routing (kernels/cpu/__init__.py builds and loads this file; the linear
// layers and the fused MoE are in linear_ops.cpp and moe_ops.cpp).
//
// Each op computes what its plain-PyTorch reference in kernels/<family>/naive.py computes, in one pass over its
// operands instead of the reference's 5-15 dispatched ops: on the CPU a decode step is made of small ops, and the
// dispatch of each one costs more than its arithmetic. Rows may be strided (views of packed projections); the last
// dimension of every float tensor must be contiguous. Work is split over at::parallel_for (torch's OpenMP pool).
#include "common.h"
#include "gemm.h"
#include "ops.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace sgl_cpu {

// ---- causal conv1d, one decode token per request ----------------------------------------------------------------

// One request's decode token through every channel, its state [D, W] packed: out = silu(state . w[:W] + x w[W]),
// then the state shifts by one and takes x. The silu runs as a second pass over the row, which vectorises (vexp);
// inside the channel loop, whose strided state does not, each channel's exp ran scalar. One request through the op
// from Python on a Zen 3: 1024 channels 15.1 -> 5.7 us a call, 4096 43.7 -> 13.0 (a 64-channel call: 3.4-3.8), the
// same bits.
template <int W>
void conv_step(float* state, const float* w, const float* x, float* out, int64_t dim, bool silu) {
  for (int64_t d = 0; d < dim; ++d) {
    float* s = state + d * W;
    const float* wd = w + d * (W + 1);
    float acc = x[d] * wd[W];
    for (int j = 0; j < W; ++j) acc += s[j] * wd[j];
    for (int j = 0; j + 1 < W; ++j) s[j] = s[j + 1];
    s[W - 1] = x[d];
    out[d] = acc;
  }
  if (silu) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = out[d] * sigmoid(out[d]);
  }
}

void conv_update_core(const float* xs, int64_t x_row, int64_t batch, int64_t dim, const float* w, int64_t taps,
                      float* states, const Index& slots, int64_t s_slot, int64_t s_chan, bool silu, float* o) {
  const int64_t width = taps - 1;
  const bool packed = s_chan == width;
  at::parallel_for(0, batch, grain(dim * taps), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* row = o + b * dim;
      float* slot = states + slots[b] * s_slot;
      const float* newest = xs + b * x_row;
      if (packed && width == 3) {  // Qwen3.5's 4 taps: fixed strides the compiler vectorises across channels
        conv_step<3>(slot, w, newest, row, dim, silu);
        continue;
      }
      for (int64_t d = 0; d < dim; ++d) {
        float* state = slot + d * s_chan;
        const float* wd = w + d * taps;
        float acc = 0.0f;
        for (int64_t j = 0; j < width; ++j) acc += state[j] * wd[j];
        row[d] = acc + newest[d] * wd[width];
        for (int64_t j = 0; j + 1 < width; ++j) state[j] = state[j + 1];
        if (width > 0) state[width - 1] = newest[d];
      }
      if (silu) {
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] = row[d] * sigmoid(row[d]);
      }
    }
  });
}

void check_conv_update(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                       const at::Tensor& state_indices) {
  check_float(x, "x", 2);
  check_float(weight, "weight", 2);
  check_float(conv_states, "conv_states", 3);
  const int64_t batch = x.size(0), dim = x.size(1), width = weight.size(1) - 1;
  TORCH_CHECK(weight.size(0) == dim && weight.is_contiguous(), "weight must be a contiguous [", dim, ", K] tensor");
  TORCH_CHECK(conv_states.size(1) == dim && conv_states.size(2) == width, "conv_states must be [S, ", dim, ", ",
              width, "], got ", conv_states.sizes());
  TORCH_CHECK(state_indices.numel() == batch, "state_indices must hold one slot per row of x");
  check_slots(Index(state_indices, "state_indices"), batch, conv_states.size(0), "state_indices");
}

at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                                const at::Tensor& state_indices, bool silu) {
  check_conv_update(x, weight, conv_states, state_indices);
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  conv_update_core(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), weight.data_ptr<float>(), weight.size(1),
                   conv_states.data_ptr<float>(), Index(state_indices, "state_indices"), conv_states.stride(0),
                   conv_states.stride(1), silu, out.data_ptr<float>());
  return out;
}

// ---- gated delta rule: gating and the recurrent decode step -----------------------------------------------------

void gdn_gating_core(const float* a, int64_t a_row, const float* b, int64_t b_row, int64_t tokens, int64_t heads,
                     const float* A_log, const float* dt_bias, float* g, float* beta) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      g[t * heads + h] = -std::exp(A_log[h]) * softplus(a[t * a_row + h] + dt_bias[h]);
      beta[t * heads + h] = sigmoid(b[t * b_row + h]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> gdn_gating(const at::Tensor& A_log, const at::Tensor& a, const at::Tensor& dt_bias,
                                              const at::Tensor& b) {
  check_float(a, "a", 2);
  check_float(b, "b", 2);
  check_float(A_log, "A_log", 1);
  check_float(dt_bias, "dt_bias", 1);
  const int64_t tokens = a.size(0), heads = a.size(1);
  TORCH_CHECK(b.sizes() == a.sizes() && A_log.size(0) == heads && dt_bias.size(0) == heads,
              "a and b must be [T, H] and A_log, dt_bias [H]; got a ", a.sizes(), ", b ", b.sizes(), ", A_log ",
              A_log.sizes(), ", dt_bias ", dt_bias.sizes());
  at::Tensor g = at::empty({tokens, heads}, a.options()), beta = at::empty({tokens, heads}, a.options());
  gdn_gating_core(a.data_ptr<float>(), a.stride(0), b.data_ptr<float>(), b.stride(0), tokens, heads,
                  A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>());
  return {g, beta};
}

// One (request, value head): S [dk, dv] decays by exp(g), takes the delta update with the l2-normalised key, and
// is read by the query. S^T k and S^T q come from one pass; the update is a second pass over a 16 KB state that is
// still in L1; the output needs no third: S'^T q = exp(g) S^T q + (k . q) delta.
void delta_rule_step(float* state, const float* q, const float* k, const float* v, float g, float beta, int64_t dk,
                     int64_t dv, float scale, bool l2norm, float* kn, float* qn, float* reads_k, float* reads_q,
                     float* out) {
  const float q_factor = l2norm ? scale / std::sqrt(sum_of_squares(q, dk) + 1e-6f) : scale;
  const float k_factor = l2norm ? 1.0f / std::sqrt(sum_of_squares(k, dk) + 1e-6f) : 1.0f;
  for (int64_t i = 0; i < dk; ++i) {
    qn[i] = q[i] * q_factor;
    kn[i] = k[i] * k_factor;
  }
  std::fill(reads_k, reads_k + dv, 0.0f);
  std::fill(reads_q, reads_q + dv, 0.0f);
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = state + i * dv;
    const float ki = kn[i], qi = qn[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      reads_k[j] += ki * row[j];
      reads_q[j] += qi * row[j];
    }
  }
  const float decay = std::exp(g), kq = dot(kn, qn, dk);
  float* delta = reads_k;  // reused in place
#pragma omp simd
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = (v[j] - reads_k[j] * decay) * beta;
    out[j] = reads_q[j] * decay + kq * delta[j];
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const float ki = kn[i];
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) row[j] = row[j] * decay + ki * delta[j];
  }
}

void delta_rule_decode_core(const Rows& qs, const Rows& ks, const Rows& vs, const float* g, int64_t g_row,
                             const float* beta, int64_t beta_row, const GdnShapes& shapes, float* states,
                             const Index& slots, int64_t s_slot, int64_t s_head, float scale, bool l2norm, float* o) {
  const int64_t batch = shapes.tokens, hk = shapes.hk, dk = shapes.dk, hv = shapes.hv, dv = shapes.dv;
  const int64_t groups = hv / hk;
  at::parallel_for(0, batch * hv, grain(2 * dk * dv), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dk + 2 * dv);
    float *kn = scratch.data(), *qn = kn + dk, *reads_k = qn + dk, *reads_q = reads_k + dv;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / hv, h = i % hv, key_row = b * hk + h / groups;
      delta_rule_step(states + slots[b] * s_slot + h * s_head, qs[key_row], ks[key_row], vs[i], g[b * g_row + h],
                      beta[b * beta_row + h], dk, dv, scale, l2norm, kn, qn, reads_k, reads_q, o + i * dv);
    }
  });
}

at::Tensor gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, const at::Tensor& ssm_states,
                                   const at::Tensor& state_indices, double scale, bool use_qk_l2norm) {
  const GdnShapes shapes = check_gdn_operands(q, k, v, g, beta, ssm_states);
  Index slots(state_indices, "state_indices");
  TORCH_CHECK(state_indices.numel() == shapes.tokens, "state_indices must hold one slot per request");
  check_slots(slots, shapes.tokens, ssm_states.size(0), "state_indices");
  at::Tensor out = at::empty({shapes.tokens, shapes.hv, shapes.dv}, v.options());
  delta_rule_decode_core(Rows(q), Rows(k), Rows(v), g.data_ptr<float>(), g.stride(0), beta.data_ptr<float>(),
                         beta.stride(0), shapes, ssm_states.data_ptr<float>(), slots, ssm_states.stride(0),
                         ssm_states.stride(1), static_cast<float>(scale), use_qk_l2norm, out.data_ptr<float>());
  return out;
}

// ---- RMSNorms ---------------------------------------------------------------------------------------------------

// Gemma RMSNorm of rows of n: y = x * rsqrt(mean(x^2) + eps) * (1 + w), x the row plus its residual row when given
// (that sum written to `sum`); y and sum contiguous.
void gemma_norm_core(const Rows& xs, const Rows* residual, int64_t rows, int64_t n, const float* w, float eps, float* y,
                     float* sum) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = xs[r];
      if (residual != nullptr) {
        float* s = sum + r * n;
        const float* res = (*residual)[r];
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) s[j] = in[j] + res[j];
        in = s;
      }
      const float inv = 1.0f / std::sqrt(sum_of_squares(in, n) / static_cast<float>(n) + eps);
      float* out = y + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = in[j] * inv * (1.0f + w[j]);
    }
  });
}

// Gemma RMSNorm of every row of x [A, B, n] (x + residual first, when given): x * rsqrt(mean(x^2) + eps) * (1 + w).
// Returns the normalised rows and, with a residual, the sum (both contiguous, shaped like x).
std::tuple<at::Tensor, at::Tensor> gemma_rmsnorm(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                                                 const c10::optional<at::Tensor>& residual_in) {
  const at::Tensor x = as_rows(x_in);
  const c10::optional<at::Tensor> residual =
      residual_in.has_value() ? c10::optional<at::Tensor>(as_rows(*residual_in)) : c10::nullopt;
  check_float(x, "x", 3);
  check_float(weight, "weight", 1);
  const int64_t n = x.size(2), rows = x.size(0) * x.size(1);
  TORCH_CHECK(weight.size(0) == n, "weight must have ", n, " elements, got ", weight.size(0));
  const bool add = residual.has_value();
  if (add) {
    check_float(*residual, "residual", 3);
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must be shaped like x ", x.sizes());
  }
  at::Tensor y = at::empty(x_in.sizes(), x.options());  // shaped like the input; rows in x's order
  at::Tensor sum = at::empty(add ? x_in.sizes() : at::IntArrayRef{0}, x.options());  // empty: no residual
  const Rows xs(x);
  const c10::optional<Rows> rs = add ? c10::optional<Rows>(Rows(*residual)) : c10::nullopt;
  gemma_norm_core(xs, add ? &*rs : nullptr, rows, n, weight.data_ptr<float>(), static_cast<float>(eps),
                  y.data_ptr<float>(), add ? sum.data_ptr<float>() : nullptr);
  return {y, sum};
}

// Gated RMSNorm of rows of n with their gates: y = w * o * rsqrt(mean(o^2) + eps) * silu(z), y contiguous.
void gated_norm_core(const Rows& os, const Rows& zs, int64_t rows, int64_t n, const float* w, float eps, float* y) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *in = os[r], *gate = zs[r];
      const float inv = 1.0f / std::sqrt(sum_of_squares(in, n) / static_cast<float>(n) + eps);
      float* out = y + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = in[j] * inv * w[j] * (gate[j] * sigmoid(gate[j]));
    }
  });
}

// Gated RMSNorm of every row of o [A, B, n] with its gate z: w * o * rsqrt(mean(o^2) + eps) * silu(z).
at::Tensor gated_rmsnorm(const at::Tensor& o_in, const at::Tensor& z_in, const at::Tensor& weight, double eps) {
  const at::Tensor o = as_rows(o_in), z = as_rows(z_in);
  check_float(o, "o", 3);
  check_float(z, "z", 3);
  check_float(weight, "weight", 1);
  const int64_t n = o.size(2), rows = o.size(0) * o.size(1);
  TORCH_CHECK(z.sizes() == o.sizes(), "z must be shaped like o ", o.sizes(), ", got ", z.sizes());
  TORCH_CHECK(weight.size(0) == n, "weight must have ", n, " elements, got ", weight.size(0));
  at::Tensor y = at::empty(o_in.sizes(), o.options());
  gated_norm_core(Rows(o), Rows(z), rows, n, weight.data_ptr<float>(), static_cast<float>(eps), y.data_ptr<float>());
  return y;
}

// ---- paged decode attention --------------------------------------------------------------------------------------

// Checks what decode attention reads (every slot of every request inside the pool); returns the longest request.
int64_t check_decode_attention(int64_t batch, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& page_table,
                               const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, int64_t page_size) {
  check_float(k_cache, "k_cache", 3);
  check_float(v_cache, "v_cache", 3);
  const int64_t kv_heads = k_cache.size(1);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == hd && heads % kv_heads == 0,
              "k_cache and v_cache must be [N, KV, ", hd, "] with KV dividing ", heads, " heads, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(page_table.dim() == 2 && page_table.stride(1) == 1 &&
                  (page_table.scalar_type() == at::kLong || page_table.scalar_type() == at::kInt),
              "page_table must be an int32 or int64 [R, C] tensor, contiguous in its rows");
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1, got ", page_size);
  Index rows(req_pool_indices, "req_pool_indices"), lens(seq_lens, "seq_lens");
  TORCH_CHECK(req_pool_indices.numel() == batch && seq_lens.numel() == batch,
              "req_pool_indices and seq_lens must hold one entry per query");
  const int64_t pool = k_cache.size(0), context = page_table.size(1) * page_size;
  check_slots(rows, batch, page_table.size(0), "req_pool_indices");
  const TokenTable table(page_table, page_size);
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= context, "seq_lens[", b, "] = ", lens[b], " must be in [1, ", context, "]");
    longest = std::max(longest, lens[b]);
    for (int64_t t = 0; t < lens[b]; ++t) {  // a bad slot would read outside the pool
      const int64_t slot = table(rows[b], t);
      TORCH_CHECK(slot >= 0 && slot < pool, "page_table[", rows[b], ", ", t / page_size, "] puts position ", t,
                  " in slot ", slot, ", outside the KV pool of ", pool, " slots");
    }
  }
  return longest;
}

// Positions whose keys gather_keys_values transposes together.
constexpr int64_t kKeyTile = 16;

// The first `len` cached tokens of KV head h of page-table row `row`: keys transposed into keys [hd, len] (both
// attention products then run along contiguous rows) and values into values [len, hd]. A tile of positions at a
// time: its key rows stay in L1 while each of their columns is written out as one run (a position at a time wrote
// every one of its elements to another line, and took most of a decode layer's attention at context ~300).
void gather_keys_values(const at::Tensor& k_cache, const at::Tensor& v_cache, const TokenTable& table, int64_t row,
                        int64_t h, int64_t len, float* keys, float* values) {
  const int64_t hd = k_cache.size(2);
  const float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t k_slot = k_cache.stride(0), k_head = k_cache.stride(1);
  const int64_t v_slot = v_cache.stride(0), v_head = v_cache.stride(1);
  const float* tile[kKeyTile];
  for (int64_t t0 = 0; t0 < len; t0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, len - t0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = table(row, t0 + t);
      tile[t] = kc + slot * k_slot + h * k_head;
      std::copy_n(vc + slot * v_slot + h * v_head, hd, values + (t0 + t) * hd);
    }
    for (int64_t d = 0; d < hd; ++d) {
      float* column = keys + d * len + t0;
      for (int64_t t = 0; t < n; ++t) column[t] = tile[t][d];
    }
  }
}

// s[0:n] = softmax(s[0:n]), in place.
void softmax_in_place(float* s, int64_t n) {
  const float top = *std::max_element(s, s + n);
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] = vexp(s[t] - top);
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) total += s[t];
  const float inv = 1.0f / total;
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// One query per request (rows b * heads + h of qs) over its first seq_lens[b] cached tokens; the KV heads are shared
// by groups of query heads. Per (request, KV head): its keys and values are gathered into contiguous rows, then
// scores = (scale q) K^T and out = softmax(scores) V run as two small blocked matmuls over the group's query heads.
// out [batch, heads, hd] contiguous.
void decode_attention_core(const Rows& qs, int64_t batch, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const TokenTable& table, const Index& rows,
                           const Index& lens, int64_t longest, float scale, float* o) {
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * hd), scores(group * longest), keys(longest * hd), values(longest * hd);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads, len = lens[b], row = rows[b];
      for (int64_t j = 0; j < group; ++j) {
        const float* src = qs[b * heads + h * group + j];
        for (int64_t d = 0; d < hd; ++d) queries[j * hd + d] = src[d] * scale;
      }
      gather_keys_values(k_cache, v_cache, table, row, h, len, keys.data(), values.data());
      matmul_wt(queries.data(), hd, group, keys.data(), 1, len, len, hd, scores.data(), len);
      for (int64_t j = 0; j < group; ++j) softmax_in_place(scores.data() + j * len, len);
      matmul_wt(scores.data(), len, group, values.data(), 1, hd, hd, len, o + (b * heads + h * group) * hd, hd);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t page_size) {
  check_float(q, "q", 3);
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t longest = check_decode_attention(batch, heads, hd, k_cache, v_cache, page_table, req_pool_indices,
                                                 seq_lens, page_size);
  at::Tensor out = at::empty({batch, heads, hd}, q.options());
  decode_attention_core(Rows(q), batch, heads, hd, k_cache, v_cache, TokenTable(page_table, page_size),
                        Index(req_pool_indices, "req_pool_indices"), Index(seq_lens, "seq_lens"), longest,
                        static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// ---- MoE routing -------------------------------------------------------------------------------------------------

// Routing of rows of router logits (row apart), top_k and, with shared logits (shared_row apart), the shared
// expert's column: weights [T, k'] and ids [T, k'] contiguous.
void moe_route_core(const float* logits, int64_t row, int64_t tokens, int64_t experts, const float* shared_p,
                    int64_t shared_row, int64_t top_k, bool renormalize, int64_t shared_id, float* wp, int32_t* ip) {
  const bool with_shared = shared_p != nullptr;
  const int64_t width = top_k + (with_shared ? 1 : 0);
  at::parallel_for(0, tokens, grain(experts * top_k), [&](int64_t begin, int64_t end) {
    std::vector<float> probs(experts);
    std::vector<char> taken(experts);
    for (int64_t t = begin; t < end; ++t) {
      const float* l = logits + t * row;
      const float top = *std::max_element(l, l + experts);
      float total = 0.0f;
      for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(l[e] - top);
      for (int64_t e = 0; e < experts; ++e) probs[e] /= total;
      std::fill(taken.begin(), taken.end(), 0);
      float kept = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e) {
          if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        }
        taken[best] = 1;
        wp[t * width + j] = probs[best];
        ip[t * width + j] = static_cast<int32_t>(best);
        kept += probs[best];
      }
      if (renormalize) {
        for (int64_t j = 0; j < top_k; ++j) wp[t * width + j] /= kept;
      }
      if (with_shared) {
        wp[t * width + top_k] = 1.0f / (1.0f + std::exp(-shared_p[t * shared_row]));
        ip[t * width + top_k] = static_cast<int32_t>(shared_id);
      }
    }
  });
}

// Per token: softmax over the router logits [T, E], the top_k largest probabilities (descending; ties to the lower
// id), renormalised to sum to 1 when asked; with shared_logits [T, 1], one more column: the fused shared expert
// (id shared_id) with weight sigmoid(shared logit). Returns (weights float32 [T, k'], ids int32 [T, k']).
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& router_logits, const c10::optional<at::Tensor>& shared,
                                             int64_t top_k, bool renormalize, int64_t shared_id) {
  check_float(router_logits, "router_logits", 2);
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, ", experts, "], got ", top_k);
  const bool with_shared = shared.has_value();
  if (with_shared) {
    check_float(*shared, "shared_logits", 2);
    TORCH_CHECK(shared->size(0) == tokens && shared->size(1) == 1, "shared_logits must be [", tokens,
                ", 1], got ", shared->sizes());
  }
  const int64_t width = top_k + (with_shared ? 1 : 0);
  at::Tensor weights = at::empty({tokens, width}, router_logits.options());
  at::Tensor ids = at::empty({tokens, width}, router_logits.options().dtype(at::kInt));
  moe_route_core(router_logits.data_ptr<float>(), router_logits.stride(0), tokens, experts,
                 with_shared ? shared->data_ptr<float>() : nullptr, with_shared ? shared->stride(0) : 0, top_k,
                 renormalize, shared_id, weights.data_ptr<float>(), ids.data_ptr<int32_t>());
  return {weights, ids};
}

// The first index of each row's maximum of [B, V] float32 logits (rows may be strided), NaN counting as the maximum:
// torch's argmax(dim=-1). One pass a vector register at a time for the maximum and whether a NaN is there, one to its
// first index.
static int64_t argmax_row(const float* row, int64_t vocab) {
  const float lowest = -std::numeric_limits<float>::infinity();
  vreg top = {};
  top += lowest;
  ivreg nan = {};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const vreg x = load_reg(row + v);
    top = x > top ? x : top;
    nan |= x != x;
  }
  float best = lowest;
  bool any_nan = false;
  for (int lane = 0; lane < kLanes; ++lane) {
    best = std::max(best, top[lane]);
    any_nan |= nan[lane] != 0;
  }
  for (; v < vocab; ++v) {
    best = std::max(best, row[v]);
    any_nan |= row[v] != row[v];
  }
  // the first register's worth of columns that holds it, then the column
  vreg target = {};
  target += best;
  int64_t at = 0;
  for (; at + kLanes <= vocab; at += kLanes) {
    const vreg x = load_reg(row + at);
    const ivreg hit = any_nan ? (x != x) : (x == target);
    int32_t found = 0;
    for (int lane = 0; lane < kLanes; ++lane) found |= hit[lane];
    if (found) break;
  }
  if (any_nan) {
    while (row[at] == row[at]) ++at;
  } else {
    while (row[at] != best) ++at;
  }
  return at;
}

void argmax_rows_into(const at::Tensor& logits, int64_t* out) {
  check_float(logits, "logits", 2);
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(vocab > 0, "logits must have at least one column");
  const float* base = logits.data_ptr<float>();
  at::parallel_for(0, rows, grain(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(base + r * stride, vocab);
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  argmax_rows_into(logits, out.data_ptr<int64_t>());
  return out;
}

}  // namespace sgl_cpu

using namespace sgl_cpu;

TORCH_LIBRARY(sglang_lite_cpu, m) {
  m.def("causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) conv_states, Tensor state_indices, bool silu) "
        "-> Tensor");
  m.def("gdn_gating(Tensor A_log, Tensor a, Tensor dt_bias, Tensor b) -> (Tensor, Tensor)");
  m.def("gated_delta_rule_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm_states, "
        "Tensor state_indices, float scale, bool use_qk_l2norm) -> Tensor");
  m.def("gemma_rmsnorm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("gated_rmsnorm(Tensor o, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor req_pool_indices, "
        "Tensor seq_lens, float scale, int page_size) -> Tensor");
  m.def("moe_route(Tensor router_logits, Tensor? shared_logits, int top_k, bool renormalize, int shared_id) "
        "-> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglang_lite_cpu, CPU, m) {
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("gdn_gating", &gdn_gating);
  m.impl("gated_delta_rule_decode", &gated_delta_rule_decode);
  m.impl("gemma_rmsnorm", &gemma_rmsnorm);
  m.impl("gated_rmsnorm", &gated_rmsnorm);
  m.impl("decode_attention", &decode_attention);
  m.impl("moe_route", &moe_route);
}

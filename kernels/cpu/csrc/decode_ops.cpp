// Fused float32 CPU kernels for the decode step of Qwen3.5, and the linear layers and fused MoE that its prefill
// takes too (kernels/cpu/__init__.py builds and loads this file).
//
// Each op computes what its plain-PyTorch reference in kernels/<family>/naive.py computes, in one pass over its
// operands instead of the reference's 5-15 dispatched ops: on the CPU a decode step is made of small ops, and the
// dispatch of each one costs more than its arithmetic. Rows may be strided (views of packed projections); the last
// dimension of every float tensor must be contiguous. Work is split over at::parallel_for (torch's OpenMP pool).
#include "common.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using namespace sgl_cpu;

// ---- causal conv1d, one decode token per request ----------------------------------------------------------------

// One request's decode token through every channel, its state [D, W] packed: out = silu(state . w[:W] + x w[W]),
// then the state shifts by one and takes x.
template <int W>
void conv_step(float* state, const float* w, const float* x, float* out, int64_t dim, bool silu) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    float* s = state + d * W;
    const float* wd = w + d * (W + 1);
    float acc = x[d] * wd[W];
    for (int j = 0; j < W; ++j) acc += s[j] * wd[j];
    for (int j = 0; j + 1 < W; ++j) s[j] = s[j + 1];
    s[W - 1] = x[d];
    out[d] = silu ? acc * sigmoid(acc) : acc;
  }
}

at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                                const at::Tensor& state_indices, bool silu) {
  check_float(x, "x", 2);
  check_float(weight, "weight", 2);
  check_float(conv_states, "conv_states", 3);
  const int64_t batch = x.size(0), dim = x.size(1), taps = weight.size(1), width = taps - 1;
  TORCH_CHECK(weight.size(0) == dim && weight.is_contiguous(), "weight must be a contiguous [", dim, ", K] tensor");
  TORCH_CHECK(conv_states.size(1) == dim && conv_states.size(2) == width, "conv_states must be [S, ", dim, ", ",
              width, "], got ", conv_states.sizes());
  Index slots(state_indices, "state_indices");
  TORCH_CHECK(state_indices.numel() == batch, "state_indices must hold one slot per row of x");
  check_slots(slots, batch, conv_states.size(0), "state_indices");
  at::Tensor out = at::empty({batch, dim}, x.options());
  const float *xs = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *states = conv_states.data_ptr<float>(), *o = out.data_ptr<float>();
  const int64_t x_row = x.stride(0), s_slot = conv_states.stride(0), s_chan = conv_states.stride(1);
  const bool packed = conv_states.stride(2) == 1 && s_chan == width;
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
  return out;
}

// ---- gated delta rule: gating and the recurrent decode step -----------------------------------------------------

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
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  const float *alog = A_log.data_ptr<float>(), *bias = dt_bias.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *betap = beta.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      gp[t * heads + h] = -std::exp(alog[h]) * softplus(ap[t * a.stride(0) + h] + bias[h]);
      betap[t * heads + h] = sigmoid(bp[t * b.stride(0) + h]);
    }
  }
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

at::Tensor gated_delta_rule_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, const at::Tensor& ssm_states,
                                   const at::Tensor& state_indices, double scale, bool use_qk_l2norm) {
  const GdnShapes shapes = check_gdn_operands(q, k, v, g, beta, ssm_states);
  const int64_t batch = shapes.tokens, hk = shapes.hk, dk = shapes.dk, hv = shapes.hv, dv = shapes.dv;
  Index slots(state_indices, "state_indices");
  TORCH_CHECK(state_indices.numel() == batch, "state_indices must hold one slot per request");
  check_slots(slots, batch, ssm_states.size(0), "state_indices");
  at::Tensor out = at::empty({batch, hv, dv}, v.options());
  const int64_t groups = hv / hk;
  const Rows qs(q), ks(k), vs(v);
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *states = ssm_states.data_ptr<float>(), *o = out.data_ptr<float>();
  const int64_t s_slot = ssm_states.stride(0), s_head = ssm_states.stride(1);
  at::parallel_for(0, batch * hv, grain(2 * dk * dv), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dk + 2 * dv);
    float *kn = scratch.data(), *qn = kn + dk, *reads_k = qn + dk, *reads_q = reads_k + dv;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / hv, h = i % hv, key_row = b * hk + h / groups;
      delta_rule_step(states + slots[b] * s_slot + h * s_head, qs[key_row], ks[key_row], vs[i],
                      gp[b * g.stride(0) + h], bp[b * beta.stride(0) + h], dk, dv, static_cast<float>(scale),
                      use_qk_l2norm, kn, qn, reads_k, reads_q, o + i * dv);
    }
  });
  return out;
}

// ---- RMSNorms ---------------------------------------------------------------------------------------------------

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
  const float* w = weight.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *sp = add ? sum.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = xs[r];
      if (add) {
        float* s = sp + r * n;
        const float* res = (*rs)[r];
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) s[j] = in[j] + res[j];
        in = s;
      }
      const float inv = 1.0f / std::sqrt(sum_of_squares(in, n) / static_cast<float>(n) + static_cast<float>(eps));
      float* out = yp + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = in[j] * inv * (1.0f + w[j]);
    }
  });
  return {y, sum};
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
  const Rows os(o), zs(z);
  const float* w = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *in = os[r], *gate = zs[r];
      const float inv = 1.0f / std::sqrt(sum_of_squares(in, n) / static_cast<float>(n) + static_cast<float>(eps));
      float* out = yp + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) out[j] = in[j] * inv * w[j] * (gate[j] * sigmoid(gate[j]));
    }
  });
  return y;
}

// ---- linear layers of a few rows ----------------------------------------------------------------------------------

// y = x W^T for x [M, K] and W an [N, K] view of [K, N] row-major memory (weight_layout's [in, out] storage), M
// small: MKL packs the whole weight for every call, which at a few rows (the LM head of a decode batch) keeps it far
// below the GEMM peak. Here each thread takes blocks of 32 output columns and runs every row through them while the
// block's K x 32 weights stay in cache; a last block of 16 and single columns finish N.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight) {
  check_float(x, "x", 2);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be a float32 CPU matrix, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must be [N, ", K, "], got ", weight.sizes());
  TORCH_CHECK(weight.stride(0) == 1 || weight.stride(1) == 1, "weight must be contiguous along one of its "
              "dimensions, got strides ", weight.strides());
  at::Tensor out = at::empty({M, N}, x.options());
  const float *xs = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (weight.stride(0) != 1 || N == 1) {  // [out, in] rows (a tied LM head is the embedding): dot products
    const int64_t wn = weight.stride(0), lda = x.stride(0);
    at::parallel_for(0, (N + 63) / 64, grain(M * K * 64 / 4), [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n0 = blk * 64, width = std::min<int64_t>(64, N - n0);
        matmul_wt(xs, lda, M, w + n0 * wn, wn, 1, width, K, o + n0, N);
      }
    });
    return out;
  }
  const int64_t lda = x.stride(0), ldw = weight.stride(1);
  int64_t n = 0;
  // One row reads each weight once, from memory: blocks of 512 columns (128 where that leaves too few blocks for the
  // threads) stream runs of 4 weight rows at a time: the LM head at batch 1, weights out of cache, reads at the
  // machine's read bandwidth, above MKL; register-blocked 32-column blocks, reading short runs far apart, fell below
  // MKL (docs/performance.md).
  if (M == 1) {
    const bool wide = N >= 512 * 2 * at::get_num_threads();
    const int64_t width = wide ? 512 : 128, blocks = N / width;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        if (wide) {
          one_row_times_columns<32>(xs, w + blk * width, ldw, K, o + blk * width);
        } else {
          one_row_times_columns<8>(xs, w + blk * width, ldw, K, o + blk * width);
        }
      }
    });
    n = blocks * width;
  }
  const int64_t first_block = n / 32, blocks = N / 32;
  at::parallel_for(first_block, blocks, grain(M * K * 32 / 4), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) all_rows_times_columns<2>(xs, lda, M, w + blk * 32, ldw, K, o + blk * 32, N);
  });
  rows_times_weight_columns(xs, lda, M, w, ldw, K, blocks * 32, N, o, N);  // the last N % 32 columns
  return out;
}

// ---- paged decode attention --------------------------------------------------------------------------------------

// One query per request over its first seq_lens[b] cached tokens; the KV heads are shared by groups of query heads.
// Per (request, KV head): its keys and values are gathered into contiguous rows, then scores = (scale q) K^T and
// out = softmax(scores) V run as two small blocked matmuls over the group's query heads.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t page_size) {
  check_float(q, "q", 3);
  check_float(k_cache, "k_cache", 3);
  check_float(v_cache, "v_cache", 3);
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = k_cache.size(1);
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
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= context, "seq_lens[", b, "] = ", lens[b], " must be in [1, ", context, "]");
    longest = std::max(longest, lens[b]);
  }
  const bool wide = page_table.scalar_type() == at::kLong;
  const void* table = page_table.data_ptr();
  const int64_t table_row = page_table.stride(0);
  auto slot_of = [&](int64_t row, int64_t t) {  // position t: offset t % page_size of page t / page_size
    const int64_t at = row * table_row + t / page_size;
    const int64_t page = wide ? static_cast<const int64_t*>(table)[at] : int64_t(static_cast<const int32_t*>(table)[at]);
    return page * page_size + t % page_size;
  };
  for (int64_t b = 0; b < batch; ++b) {  // a bad slot would read outside the pool
    for (int64_t t = 0; t < lens[b]; ++t) {
      const int64_t slot = slot_of(rows[b], t);
      TORCH_CHECK(slot >= 0 && slot < pool, "page_table[", rows[b], ", ", t / page_size, "] puts position ", t,
                  " in slot ", slot, ", outside the KV pool of ", pool, " slots");
    }
  }
  at::Tensor out = at::empty({batch, heads, hd}, q.options());
  const int64_t group = heads / kv_heads;
  const Rows qs(q);
  const float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t k_slot = k_cache.stride(0), k_head = k_cache.stride(1);
  const int64_t v_slot = v_cache.stride(0), v_head = v_cache.stride(1);
  float* o = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * hd), scores(group * longest), keys(longest * hd), values(longest * hd);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads, len = lens[b], row = rows[b];
      for (int64_t j = 0; j < group; ++j) {
        const float* src = qs[b * heads + h * group + j];
        for (int64_t d = 0; d < hd; ++d) queries[j * hd + d] = src[d] * sc;
      }
      for (int64_t t = 0; t < len; ++t) {  // keys transposed ([hd, len]): both products run along contiguous rows
        const int64_t slot = slot_of(row, t);
        const float* key = kc + slot * k_slot + h * k_head;
        for (int64_t d = 0; d < hd; ++d) keys[d * len + t] = key[d];
        std::copy_n(vc + slot * v_slot + h * v_head, hd, values.data() + t * hd);
      }
      matmul_wt(queries.data(), hd, group, keys.data(), 1, len, len, hd, scores.data(), len);
      for (int64_t j = 0; j < group; ++j) {
        float* s = scores.data() + j * len;
        const float top = *std::max_element(s, s + len);
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] = vexp(s[t] - top);
        float total = 0.0f;
        for (int64_t t = 0; t < len; ++t) total += s[t];
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      matmul_wt(scores.data(), len, group, values.data(), 1, hd, hd, len, o + (b * heads + h * group) * hd, hd);
    }
  });
  return out;
}

// ---- MoE routing -------------------------------------------------------------------------------------------------

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
  const float* logits = router_logits.data_ptr<float>();
  const float* shared_p = with_shared ? shared->data_ptr<float>() : nullptr;
  const int64_t row = router_logits.stride(0), shared_row = with_shared ? shared->stride(0) : 0;
  float* wp = weights.data_ptr<float>();
  int32_t* ip = ids.data_ptr<int32_t>();
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
  return {weights, ids};
}

// ---- fused MoE ---------------------------------------------------------------------------------------------------

// sum over each token's selected experts of weight * down(silu(gate(x)) * up(x)). Pairs (token, slot) are grouped
// by expert and run through both projections (below, by the weights' layout), one output row per pair; a last pass
// sums each token's k rows in slot order.
constexpr int64_t kMoeChunk = 8;
constexpr int64_t kMklRows = 128;  // rows of one expert from which MKL's GEMM runs it

// Both projections for weights in any other layout: each work item runs up to kMoeChunk rows of one expert through
// both (its weights then come from cache).
void experts_by_row_chunks(const float* xs, int64_t x_row, const at::Tensor& w13, const at::Tensor& w2,
                           const std::vector<int64_t>& starts, const std::vector<int64_t>& order, int64_t top_k,
                           int64_t hidden, int64_t inter, float* rows) {
  const int64_t experts = static_cast<int64_t>(starts.size()) - 1;
  const float *w13p = w13.data_ptr<float>(), *w2p = w2.data_ptr<float>();
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first position in order)
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t i = starts[e]; i < starts[e + 1]; i += kMoeChunk) items.emplace_back(e, i);
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(kMoeChunk * hidden), gate_up(kMoeChunk * 2 * inter), out(kMoeChunk * hidden);
    for (int64_t item = begin; item < end; ++item) {
      const auto [e, first] = items[item];
      const int64_t count = std::min(kMoeChunk, starts[e + 1] - first);
      for (int64_t r = 0; r < count; ++r) {
        const float* src = xs + (order[first + r] / top_k) * x_row;
        std::copy(src, src + hidden, a.data() + r * hidden);
      }
      matmul_wt(a.data(), hidden, count, w13p + e * w13.stride(0), w13.stride(1), w13.stride(2), 2 * inter, hidden,
                gate_up.data(), 2 * inter);
      for (int64_t r = 0; r < count; ++r) silu_and_mul(gate_up.data() + r * 2 * inter, inter);
      matmul_wt(gate_up.data(), 2 * inter, count, w2p + e * w2.stride(0), w2.stride(1), w2.stride(2), hidden, inter,
                out.data(), hidden);
      for (int64_t r = 0; r < count; ++r) {
        std::copy(out.data() + r * hidden, out.data() + (r + 1) * hidden, rows + order[first + r] * hidden);
      }
    }
  });
}

// Both projections of every expert hit, for weights stored [in, out] (w13 [H, 2I] and w2 [I, H] row-major per
// expert): the pairs' token rows are copied in expert order, then each work item runs one expert's rows through one
// block of output columns (register-blocked, the block's weights in cache), so the threads share every expert even
// when a few tokens hit a few experts (decode at batch 1: 5 experts on 2 threads).
void experts_input_major(const float* xs, int64_t x_row, const float* w13, int64_t w13_expert, int64_t w13_row,
                         const float* w2, int64_t w2_expert, int64_t w2_row, const std::vector<int64_t>& starts,
                         const std::vector<int64_t>& order, int64_t top_k, int64_t hidden, int64_t inter,
                         float* rows) {
  const int64_t pairs = static_cast<int64_t>(order.size()), experts = static_cast<int64_t>(starts.size()) - 1;
  std::vector<float> gathered(pairs * hidden), gate_up(pairs * 2 * inter), expert_out(pairs * hidden);
  at::parallel_for(0, pairs, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = xs + (order[i] / top_k) * x_row;
      std::copy(src, src + hidden, gathered.data() + i * hidden);
    }
  });
  // Experts of many rows (a prefill's) go to MKL's GEMM, one expert at a time (faster at the mid shape than every
  // expert in the work items below, and no slower at H 512); the rest are shared out as work items.
  std::vector<int64_t> hit, big;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = starts[e + 1] - starts[e];
    if (count >= kMklRows) {
      big.push_back(e);
    } else if (count > 0) {
      hit.push_back(e);
    }
  }
  const int64_t hits = static_cast<int64_t>(hit.size());
  int64_t most_rows = 0;
  for (int64_t e : hit) most_rows = std::max(most_rows, starts[e + 1] - starts[e]);
  auto gemm = [&](const float* in, int64_t lda, int64_t depth, const float* w, int64_t w_expert, int64_t w_row,
                  int64_t width, float* out) {
    const auto options = at::TensorOptions().dtype(at::kFloat);
    for (int64_t e : big) {
      const int64_t first = starts[e], count = starts[e + 1] - first;
      at::Tensor a = at::from_blob(const_cast<float*>(in + first * lda), {count, depth}, {lda, 1}, options);
      at::Tensor b = at::from_blob(const_cast<float*>(w + e * w_expert), {depth, width}, {w_row, 1}, options);
      at::Tensor c = at::from_blob(out + first * width, {count, width}, {width, 1}, options);
      at::mm_out(c, a, b);
    }
  };
  // Items (expert hit, column block); the last block of each expert takes the columns left over. Experts of one or
  // two rows (decode at small batches) read each weight once: 128-column blocks read 512 B runs of each weight row
  // (32-column ones ran the batch-1 MoE slower); more rows reuse each block's weights from cache.
  const bool wide = most_rows <= 2;
  const int64_t block = wide ? 128 : 64;
  auto project = [&](const float* in, int64_t lda, int64_t depth, const float* w, int64_t w_expert, int64_t w_row,
                     int64_t width, float* out) {
    const int64_t blocks = std::max<int64_t>(1, width / block);
    at::parallel_for(0, hits * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t e = hit[item / blocks], j = item % blocks, first = starts[e], count = starts[e + 1] - first;
        const int64_t n0 = j * block, n1 = j + 1 == blocks ? width : n0 + block;
        const float* a = in + first * lda;
        float* c = out + first * width;
        if (wide && count == 1 && n1 - n0 == 128) {
          one_row_times_columns<8>(a, w + e * w_expert + n0, w_row, depth, c + n0);
        } else if (wide) {
          rows_times_weight_columns<8>(a, lda, count, w + e * w_expert, w_row, depth, n0, n1, c, width);
        } else {
          rows_times_weight_columns<4>(a, lda, count, w + e * w_expert, w_row, depth, n0, n1, c, width);
        }
      }
    });
  };
  gemm(gathered.data(), hidden, hidden, w13, w13_expert, w13_row, 2 * inter, gate_up.data());
  project(gathered.data(), hidden, hidden, w13, w13_expert, w13_row, 2 * inter, gate_up.data());
  at::parallel_for(0, pairs, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) silu_and_mul(gate_up.data() + i * 2 * inter, inter);
  });
  gemm(gate_up.data(), 2 * inter, inter, w2, w2_expert, w2_row, hidden, expert_out.data());  // the gate half
  project(gate_up.data(), 2 * inter, inter, w2, w2_expert, w2_row, hidden, expert_out.data());
  at::parallel_for(0, pairs, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::copy(expert_out.data() + i * hidden, expert_out.data() + (i + 1) * hidden, rows + order[i] * hidden);
    }
  });
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  check_float(x, "x", 2);
  check_float(topk_weights, "topk_weights", 2);
  TORCH_CHECK(w13.device().is_cpu() && w13.scalar_type() == at::kFloat && w13.dim() == 3, "w13 must be a float32 "
              "CPU tensor [E, 2I, H], got ", w13.scalar_type(), " ", w13.sizes());
  TORCH_CHECK(w2.device().is_cpu() && w2.scalar_type() == at::kFloat && w2.dim() == 3, "w2 must be a float32 CPU "
              "tensor [E, H, I], got ", w2.scalar_type(), " ", w2.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(0) == experts && w2.size(1) == hidden,
              "w13 [E, 2I, H] and w2 [E, H, I] do not match x [T, ", hidden, "]: w13 ", w13.sizes(), ", w2 ",
              w2.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
              "topk_ids and topk_weights must both be [", tokens, ", k], got ", topk_ids.sizes(), " and ",
              topk_weights.sizes());
  TORCH_CHECK(topk_ids.is_contiguous(), "topk_ids must be contiguous");
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  Index ids(topk_ids.view({-1}), "topk_ids");
  check_slots(ids, pairs, experts, "topk_ids");
  std::vector<int64_t> starts(experts + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++starts[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[fill[ids[p]]++] = p;
  // rows: each pair's expert output, at its pair index (token * top_k + slot)
  at::Tensor pair_rows = at::empty({pairs, hidden}, x.options());
  const float *xs = x.data_ptr<float>(), *w13p = w13.data_ptr<float>(), *w2p = w2.data_ptr<float>();
  float* rows = pair_rows.data_ptr<float>();
  const int64_t x_row = x.stride(0);
  if (w13.stride(1) == 1 && w2.stride(1) == 1) {
    experts_input_major(xs, x_row, w13p, w13.stride(0), w13.stride(2), w2p, w2.stride(0), w2.stride(2), starts, order,
                        top_k, hidden, inter, rows);
  } else {
    experts_by_row_chunks(xs, x_row, w13, w2, starts, order, top_k, hidden, inter, rows);
  }
  at::Tensor result = at::empty({tokens, hidden}, x.options());
  float* res = result.data_ptr<float>();
  const float* wts = topk_weights.data_ptr<float>();
  const int64_t w_row = topk_weights.stride(0), w_col = topk_weights.stride(1);
  at::parallel_for(0, tokens, grain(hidden * top_k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = res + t * hidden;
      const float w0 = wts[t * w_row];
      const float* r0 = rows + t * top_k * hidden;
#pragma omp simd
      for (int64_t j = 0; j < hidden; ++j) o[j] = r0[j] * w0;
      for (int64_t slot = 1; slot < top_k; ++slot) {
        const float w = wts[t * w_row + slot * w_col];
        const float* r = rows + (t * top_k + slot) * hidden;
#pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) o[j] += r[j] * w;
      }
    }
  });
  return result;
}

}  // namespace

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
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor");
  m.def("linear_rows(Tensor x, Tensor weight) -> Tensor");
  m.def("moe_route(Tensor router_logits, Tensor? shared_logits, int top_k, bool renormalize, int shared_id) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sglang_lite_cpu, CPU, m) {
  m.impl("causal_conv1d_update", &causal_conv1d_update);
  m.impl("gdn_gating", &gdn_gating);
  m.impl("gated_delta_rule_decode", &gated_delta_rule_decode);
  m.impl("gemma_rmsnorm", &gemma_rmsnorm);
  m.impl("gated_rmsnorm", &gated_rmsnorm);
  m.impl("decode_attention", &decode_attention);
  m.impl("fused_moe", &fused_moe);
  m.impl("linear_rows", &linear_rows);
  m.impl("moe_route", &moe_route);
}

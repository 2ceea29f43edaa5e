// Fused float32 CPU kernels for the prefill of Qwen3.5's Gated DeltaNet layers: the gated delta rule run token by
// token with each state held in cache, and the causal conv1d over packed requests.
//
// The chunked form of the delta rule (kernels/gated_delta_rule/naive.py) exists for matrix units: it trades the
// token-by-token recurrence for small matmuls, a triangular solve and chunk-major copies of every operand, which on
// the CPU cost more than the recurrence itself. Here each (request, value head) walks its tokens with its [dk, dv]
// state in L1/L2: one pass over the state per token, which decays and updates it for this token and reads it for
// the next (S^T k and S^T q). That is 6 dk dv flops per token and head, fewer than the chunked form's.
#include "common.h"
#include "gemm.h"
#include "ops.h"

#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace sgl_cpu;

// Columns [0, 16 NV) of the state rows S[i, :] (row stride dv), i < dk. UPDATE: S = decay S + kn delta^T. READ:
// rk = S^T a, rq = S^T b of the rows as they leave (a, b: the next token's key and query after an update, this
// token's otherwise).
template <int NV, bool UPDATE, bool READ>
void state_block(float* S, int64_t dv, int64_t dk, float decay, const float* kn, const float* delta, const float* a,
                 const float* b, float* rk, float* rq) {
  vec16 dl[NV], ak[NV], aq[NV];
  for (int v = 0; v < NV; ++v) {
    dl[v] = UPDATE ? load16(delta + 16 * v) : vec16{};
    ak[v] = vec16{};
    aq[v] = vec16{};
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    for (int v = 0; v < NV; ++v) {
      vec16 r = load16(row + 16 * v);
      if (UPDATE) {
        r = r * decay + kn[i] * dl[v];
        store16(row + 16 * v, r);
      }
      if (READ) {
        ak[v] += a[i] * r;
        aq[v] += b[i] * r;
      }
    }
  }
  if (READ) {
    for (int v = 0; v < NV; ++v) {
      store16(rk + 16 * v, ak[v]);
      store16(rq + 16 * v, aq[v]);
    }
  }
}

// Vectors of a state block: its 3 kStateVectors vec16 (delta and the two reads) stay in registers (64 columns on
// AVX-512, 32 on AVX2 and NEON).
constexpr int kStateVectors = kVec16Registers >= 32 ? 4 : (kVec16Registers >= 8 ? 2 : 1);

// The same over every column: blocks of 16 kStateVectors and 16 columns, then the last dv % 16 one by one.
template <bool UPDATE, bool READ>
void state_pass(float* S, int64_t dv, int64_t dk, float decay, const float* kn, const float* delta, const float* a,
                const float* b, float* rk, float* rq) {
  constexpr int64_t kWidth = 16 * kStateVectors;
  int64_t j = 0;
  for (; j + kWidth <= dv; j += kWidth) {
    state_block<kStateVectors, UPDATE, READ>(S + j, dv, dk, decay, kn, delta + j, a, b, rk + j, rq + j);
  }
  for (; j + 16 <= dv; j += 16) state_block<1, UPDATE, READ>(S + j, dv, dk, decay, kn, delta + j, a, b, rk + j, rq + j);
  for (; j < dv; ++j) {
    float ak = 0.0f, aq = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      float& s = S[i * dv + j];
      if (UPDATE) s = s * decay + kn[i] * delta[j];
      if (READ) {
        ak += a[i] * s;
        aq += b[i] * s;
      }
    }
    if (READ) {
      rk[j] = ak;
      rq[j] = aq;
    }
  }
}

// The normalised query and key of one token: l2-normalised (eps 1e-6 under the root, as the reference) and the
// query scaled.
inline void normalise_qk(const float* q, const float* k, int64_t dk, float scale, bool l2norm, float* qn, float* kn) {
  const float q_factor = l2norm ? scale / std::sqrt(sum_of_squares(q, dk) + 1e-6f) : scale;
  const float k_factor = l2norm ? 1.0f / std::sqrt(sum_of_squares(k, dk) + 1e-6f) : 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < dk; ++i) {
    qn[i] = q[i] * q_factor;
    kn[i] = k[i] * k_factor;
  }
}

}  // namespace

// ---- gated delta rule over packed requests -----------------------------------------------------------------------

namespace sgl_cpu {  // the ops (ops.h): the decode blocks take them too, batch invariant

// Reads cu_seqlens (int32 or int64, [B + 1]) and checks that it splits `tokens` rows into B requests.
std::vector<int64_t> request_bounds(const at::Tensor& cu_seqlens, int64_t batch, int64_t tokens) {
  Index cu(cu_seqlens, "cu_seqlens");
  TORCH_CHECK(cu_seqlens.numel() == batch + 1, "cu_seqlens must hold ", batch + 1, " entries (one more than the ",
              batch, " state_indices), got ", cu_seqlens.numel());
  std::vector<int64_t> bounds(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) bounds[b] = cu[b];
  TORCH_CHECK(bounds[0] == 0 && bounds[batch] == tokens, "cu_seqlens must run from 0 to the ", tokens,
              " tokens, got ", bounds[0], " to ", bounds[batch]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(bounds[b] <= bounds[b + 1], "cu_seqlens must not decrease, got ", bounds[b], " then ", bounds[b + 1]);
  }
  return bounds;
}

// q, k [T, HK, dk]; v [T, HV, dv]; g, beta [T, HV]; ssm_states [S, HV, dk, dv] (float32, updated in place: each
// request starts from its slot's state and leaves its final state there). Returns o [T, HV, dv].
at::Tensor gated_delta_rule_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, const at::Tensor& ssm_states,
                                    const at::Tensor& state_indices, const at::Tensor& cu_seqlens, double scale,
                                    bool use_qk_l2norm) {
  const GdnShapes shapes = check_gdn_operands(q, k, v, g, beta, ssm_states);
  Index slots(state_indices, "state_indices");
  const int64_t batch = state_indices.numel();
  check_slots(slots, batch, ssm_states.size(0), "state_indices");
  const std::vector<int64_t> bounds = request_bounds(cu_seqlens, batch, shapes.tokens);
  at::Tensor out = at::empty({shapes.tokens, shapes.hv, shapes.dv}, v.options());
  delta_rule_prefill_core(Rows(q), Rows(k), Rows(v), g.data_ptr<float>(), g.stride(0), beta.data_ptr<float>(),
                          beta.stride(0), shapes, ssm_states.data_ptr<float>(), slots, ssm_states.stride(0),
                          ssm_states.stride(1), bounds.data(), batch, static_cast<float>(scale), use_qk_l2norm,
                          out.data_ptr<float>());
  return out;
}

// The gated delta rule of `batch` requests, request b's tokens [bounds[b], bounds[b + 1]) (the op's operands as
// pointers: q, k rows of dk by (token * HK + key head), v rows of dv by (token * HV + head), g and beta rows apart
// by g_row and b_row), states at slots[b] * s_slot + head * s_head, o [T, HV, dv]. The (request, head) items are
// taken as the threads free up (their costs follow the requests' lengths).
void delta_rule_prefill_core(const Rows& qs, const Rows& ks, const Rows& vs, const float* gp, int64_t g_row,
                             const float* bp, int64_t b_row, const GdnShapes& shapes, float* states, const Index& slots,
                             int64_t s_slot, int64_t s_head, const int64_t* bounds, int64_t batch, float sc,
                             bool use_qk_l2norm, float* o) {
  const int64_t hk = shapes.hk, dk = shapes.dk, hv = shapes.hv, dv = shapes.dv, groups = hv / hk;
  parallel_items(batch * hv, 1, [&](int64_t item, int64_t) {
    const int64_t b = item / hv, h = item % hv, first = bounds[b], last = bounds[b + 1];
    if (first == last) return;
    std::vector<float> scratch(4 * dk + 3 * dv);
    float *qn = scratch.data(), *kn = qn + dk, *qn_next = kn + dk, *kn_next = qn_next + dk;
    float *rk = kn_next + dk, *rq = rk + dv, *delta = rq + dv;
    float* S = states + slots[b] * s_slot + h * s_head;
    const int64_t key_head = h / groups;
    normalise_qk(qs[first * hk + key_head], ks[first * hk + key_head], dk, sc, use_qk_l2norm, qn, kn);
    state_pass<false, true>(S, dv, dk, 1.0f, kn, delta, kn, qn, rk, rq);  // S^T k and S^T q of the first
    for (int64_t t = first; t < last; ++t) {
      const float decay = std::exp(gp[t * g_row + h]), b_t = bp[t * b_row + h], kq = dot(kn, qn, dk);
      const float* vt = vs[t * hv + h];
      float* ot = o + (t * hv + h) * dv;
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = (vt[j] - decay * rk[j]) * b_t;
        ot[j] = decay * rq[j] + kq * delta[j];  // S'^T q = exp(g) S^T q + (k . q) delta
      }
      const bool more = t + 1 < last;
      if (more) {
        normalise_qk(qs[(t + 1) * hk + key_head], ks[(t + 1) * hk + key_head], dk, sc, use_qk_l2norm, qn_next,
                     kn_next);
      }
      if (more) {
        state_pass<true, true>(S, dv, dk, decay, kn, delta, kn_next, qn_next, rk, rq);
      } else {
        state_pass<true, false>(S, dv, dk, decay, kn, delta, kn_next, qn_next, rk, rq);
      }
      std::swap(qn, qn_next);
      std::swap(kn, kn_next);
    }
  });
}

// ---- causal conv1d over packed requests --------------------------------------------------------------------------

constexpr int64_t kConvChannels = 256;  // channels per work item: one row segment of every tap stays in cache
constexpr int64_t kMaxTaps = 16;

// x [T, D] packed requests (rows may be strided); weight [D, K]; conv_states [S, D, K-1], the last K-1 inputs of
// each request oldest first, read as the inputs before its first token and replaced by its last K-1 inputs.
// Returns silu(conv) (or the plain conv) [T, D].
at::Tensor causal_conv1d_prefill(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& conv_states,
                                 const at::Tensor& state_indices, const at::Tensor& cu_seqlens, bool silu) {
  check_float(x, "x", 2);
  check_float(weight, "weight", 2);
  check_float(conv_states, "conv_states", 3);
  const int64_t tokens = x.size(0), dim = x.size(1), taps = weight.size(1), width = taps - 1;
  TORCH_CHECK(weight.size(0) == dim && weight.is_contiguous(), "weight must be a contiguous [", dim, ", K] tensor");
  TORCH_CHECK(taps >= 1 && taps <= kMaxTaps, "the conv1d kernel must have 1 to ", kMaxTaps, " taps, got ", taps);
  TORCH_CHECK(conv_states.size(1) == dim && conv_states.size(2) == width, "conv_states must be [S, ", dim, ", ",
              width, "], got ", conv_states.sizes());
  Index slots(state_indices, "state_indices");
  const int64_t batch = state_indices.numel();
  check_slots(slots, batch, conv_states.size(0), "state_indices");
  const std::vector<int64_t> bounds = request_bounds(cu_seqlens, batch, tokens);
  const at::Tensor taps_major = weight.t().contiguous();  // [K, D]: each tap's weights along the channels
  at::Tensor out = at::empty({tokens, dim}, x.options());
  conv_prefill_core(x.data_ptr<float>(), x.stride(0), tokens, dim, taps_major.data_ptr<float>(), taps,
                    conv_states.data_ptr<float>(), slots, conv_states.stride(0), conv_states.stride(1),
                    conv_states.stride(2), bounds.data(), batch, silu, out.data_ptr<float>());
  return out;
}

// The conv of `batch` requests, request b's tokens [bounds[b], bounds[b + 1]) of x (rows x_row apart), w the taps'
// weights [K, D] (taps-major), states at slots[b] * s_slot (channels s_chan, taps s_tap apart), o [T, D].
void conv_prefill_core(const float* xs, int64_t x_row, int64_t tokens, int64_t dim, const float* w, int64_t taps,
                       float* states, const Index& slots, int64_t s_slot, int64_t s_chan, int64_t s_tap,
                       const int64_t* bounds, int64_t batch, bool silu, float* o) {
  const int64_t width = taps - 1;
  const int64_t blocks = (dim + kConvChannels - 1) / kConvChannels;
  // items of a few tokens (a decode step's, batch invariant) run on the calling thread, as the decode update's do
  const int64_t tokens_per_request = std::max<int64_t>(1, tokens / std::max<int64_t>(1, batch));
  const int64_t item_grain = grain(tokens_per_request * kConvChannels * taps);
  at::parallel_for(0, batch * blocks, item_grain, [&](int64_t begin, int64_t end) {
    std::vector<float> history(std::max<int64_t>(width, 1) * kConvChannels);  // [K-1, channels]: the state
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / blocks, d0 = (item % blocks) * kConvChannels;
      const int64_t channels = std::min(kConvChannels, dim - d0), first = bounds[b], last = bounds[b + 1];
      float* state = states + slots[b] * s_slot + d0 * s_chan;
      for (int64_t j = 0; j < width; ++j) {
        for (int64_t c = 0; c < channels; ++c) history[j * kConvChannels + c] = state[c * s_chan + j * s_tap];
      }
      // input u of this request (u < 0: the state's, -1 the newest) for the block's channels
      auto input = [&](int64_t u) -> const float* {
        return u >= 0 ? xs + (first + u) * x_row + d0 : history.data() + (width + u) * kConvChannels;
      };
      for (int64_t t = 0; t < last - first; ++t) {
        const float* in[kMaxTaps];
        for (int64_t j = 0; j < taps; ++j) in[j] = input(t - width + j);
        float* row = o + (first + t) * dim + d0;
        int64_t c = 0;
        for (; c + 16 <= channels; c += 16) {
          vec16 acc = vec16{};
          for (int64_t j = 0; j < taps; ++j) acc += load16(w + j * dim + d0 + c) * load16(in[j] + c);
          store16(row + c, acc);
        }
        for (; c < channels; ++c) {
          float acc = 0.0f;
          for (int64_t j = 0; j < taps; ++j) acc += w[j * dim + d0 + c] * in[j][c];
          row[c] = acc;
        }
        if (silu) {
#pragma omp simd
          for (int64_t i = 0; i < channels; ++i) row[i] = row[i] * sigmoid(row[i]);
        }
      }
      for (int64_t j = 0; j < width; ++j) {  // the last K-1 inputs become the state (history is a copy)
        const float* src = input(last - first - width + j);
        for (int64_t c = 0; c < channels; ++c) state[c * s_chan + j * s_tap] = src[c];
      }
    }
  });
}

// ---- causal attention of a prefill's new tokens over the paged KV pool ------------------------------------------

// Tokens of one request whose queries (with a KV head's group of query heads) a work item takes: their scores against
// every key up to the last one's position sit in the thread's buffer.
constexpr int64_t kQueryTokens = 32;

// Request b's new tokens (rows [bounds[b], bounds[b + 1]) of qs, `heads` rows each) at positions prefix[b] + i attend
// to its cached tokens [0, prefix[b] + i] (their keys and values already in the pool); the KV heads are shared by
// groups of query heads. Per (request, KV head, block of kQueryTokens tokens): the keys up to the block's last
// position gathered (transposed) with their values, scores = (scale q) K^T, the causal softmax, out = P V.
// o [T, heads, hd] contiguous.
void extend_attention_core(const Rows& qs, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const TokenTable& table, const Index& rows, const Index& prefix,
                           const int64_t* bounds, int64_t batch, float scale, float* o) {
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  std::vector<std::array<int64_t, 3>> items;  // (request, KV head, first token of the block)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i0 = 0; i0 < bounds[b + 1] - bounds[b]; i0 += kQueryTokens) {
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({b, h, i0});
    }
  }
  // A block's work grows with the keys it reads (its last token's position): the threads take contiguous ranges of
  // items, so the items alternate between the cheapest and the dearest left (a 128-token prompt's 32-token blocks
  // in order gave one thread 70% of the work). Each item's values do not depend on the order.
  std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) {
    return prefix[x[0]] + x[2] < prefix[y[0]] + y[2];
  });
  std::vector<std::array<int64_t, 3>> alternating;
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    alternating.push_back(items[lo++]);
    if (lo < hi) alternating.push_back(items[--hi]);
  }
  items.swap(alternating);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries, scores, keys, values, out;
    for (int64_t item = begin; item < end; ++item) {
      const auto [b, h, i0] = items[item];
      const int64_t n = std::min(kQueryTokens, bounds[b + 1] - bounds[b] - i0), rows_q = n * group;
      const int64_t len = prefix[b] + i0 + n, row = rows[b], first = bounds[b] + i0;
      queries.resize(rows_q * hd);
      scores.resize(rows_q * len);
      keys.resize(len * hd);
      values.resize(len * hd);
      out.resize(rows_q * hd);
      for (int64_t i = 0; i < n; ++i) {  // row i * group + j: token first + i, query head h * group + j
        for (int64_t j = 0; j < group; ++j) {
          const float* src = qs[(first + i) * heads + h * group + j];
          for (int64_t d = 0; d < hd; ++d) queries[(i * group + j) * hd + d] = src[d] * scale;
        }
      }
      gather_keys_values(k_cache, v_cache, table, row, h, len, keys.data(), values.data());
      matmul_wt(queries.data(), hd, rows_q, keys.data(), 1, len, len, hd, scores.data(), len);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t visible = prefix[b] + i0 + i + 1;  // keys up to the token's own position
        for (int64_t j = 0; j < group; ++j) {
          float* sc = scores.data() + (i * group + j) * len;
          softmax_in_place(sc, visible);
          std::fill(sc + visible, sc + len, 0.0f);
        }
      }
      matmul_wt(scores.data(), len, rows_q, values.data(), 1, hd, hd, len, out.data(), hd);
      for (int64_t i = 0; i < n; ++i) {
        std::copy_n(out.data() + i * group * hd, group * hd, o + ((first + i) * heads + h * group) * hd);
      }
    }
  });
}

// Checks a prefill's attention operands (as check_decode_attention, over every request's cached tokens including
// the new ones) and returns the request bounds of the new tokens' rows.
std::vector<int64_t> check_extend_attention(int64_t tokens, int64_t heads, int64_t hd, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& page_table,
                                            const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
                                            const at::Tensor& extend_lens, int64_t page_size) {
  const int64_t batch = req_pool_indices.numel();
  const Index prefix(prefix_lens, "prefix_lens"), extend(extend_lens, "extend_lens");
  TORCH_CHECK(prefix_lens.numel() == batch && extend_lens.numel() == batch,
              "prefix_lens and extend_lens must hold one entry per request");
  std::vector<int64_t> bounds(batch + 1, 0), lens(batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(prefix[b] >= 0 && extend[b] >= 0, "request ", b, " has prefix ", prefix[b], " and ", extend[b],
                " new tokens");
    bounds[b + 1] = bounds[b] + extend[b];
    lens[b] = std::max<int64_t>(1, prefix[b] + extend[b]);  // (an empty request reads nothing)
  }
  TORCH_CHECK(bounds[batch] == tokens, "extend_lens sum to ", bounds[batch], ", the queries hold ", tokens, " tokens");
  const at::Tensor seq_lens = at::from_blob(lens.data(), {batch}, at::TensorOptions().dtype(at::kLong));
  check_decode_attention(batch, heads, hd, k_cache, v_cache, page_table, req_pool_indices, seq_lens, page_size);
  return bounds;
}

// q [T, heads, hd] (float32, packed by request); the rest as extend_attention_core reads it. Returns [T, heads, hd].
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                            int64_t page_size) {
  check_float(q, "q", 3);
  const int64_t tokens = q.size(0), heads = q.size(1), hd = q.size(2);
  const std::vector<int64_t> bounds = check_extend_attention(tokens, heads, hd, k_cache, v_cache, page_table,
                                                             req_pool_indices, prefix_lens, extend_lens, page_size);
  at::Tensor out = at::empty({tokens, heads, hd}, q.options());
  extend_attention_core(Rows(q), heads, hd, k_cache, v_cache, TokenTable(page_table, page_size),
                        Index(req_pool_indices, "req_pool_indices"), Index(prefix_lens, "prefix_lens"),
                        bounds.data(), req_pool_indices.numel(), static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

}  // namespace sgl_cpu

TORCH_LIBRARY_FRAGMENT(sglang_lite_cpu, m) {
  m.def("extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor req_pool_indices, "
        "Tensor prefix_lens, Tensor extend_lens, float scale, int page_size) -> Tensor");
  m.def("gated_delta_rule_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm_states, "
        "Tensor state_indices, Tensor cu_seqlens, float scale, bool use_qk_l2norm) -> Tensor");
  m.def("causal_conv1d_prefill(Tensor x, Tensor weight, Tensor(a!) conv_states, Tensor state_indices, "
        "Tensor cu_seqlens, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(sglang_lite_cpu, CPU, m) {
  m.impl("extend_attention", &sgl_cpu::extend_attention);
  m.impl("gated_delta_rule_prefill", &sgl_cpu::gated_delta_rule_prefill);
  m.impl("causal_conv1d_prefill", &sgl_cpu::causal_conv1d_prefill);
}

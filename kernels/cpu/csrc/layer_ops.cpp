// The blocks of a decode step, each in one call: a layer's input norm with its mixer (the Gated DeltaNet or gated
// attention), and its post-attention norm with its MLP (the MoE block or the dense one).
//
// Through the modules a decode layer is ~30 dispatched ops, each a Python call and a trip through the dispatcher
// that at batch 1 cost more than its arithmetic; here the same C++ ops run back to back. Each block computes what its
// modules compute (layers/gdn.py, attention.py, mlp.py; the norms of models/qwen3_5.py) from the same weights and
// pools, and returns (output, residual): the residual is the pre-norm sum the next norm adds to. A projection's
// weight is whatever linear_core takes: float32, bf16, block FP8 with its scales, or MXFP4 with its e8m0 scales;
// MXFP4 experts go to fused_moe_core the same way. A prefill's layers take the same blocks (gdn_prefill_block,
// attention_prefill_block, and the MLP blocks over any rows): its mixers then run the prefill kernels.
#include "bf16_planes.h"
#include "common.h"
#include "gemm.h"
#include "greedy_head.h"
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <poll.h>
#include <tuple>
#include <vector>

namespace sgl_cpu {

namespace {

using OptTensor = c10::optional<at::Tensor>;

// How every projection of a block runs: FP8 block size (empty: none) and how bf16 weights meet the rows (gemm.h's
// bf16_dot_for).
struct Projections {
  at::IntArrayRef block;
  int64_t bf16_dot;
  void operator()(const float* x, int64_t lda, int64_t rows, int64_t K, const at::Tensor& weight,
                  const OptTensor& scale, float* out, const Bf16Planes* planes = nullptr) const {
    linear_core(x, lda, rows, K, weight, scale, block, bf16_dot, out, planes);
  }
};

// A projection's input width: an MXFP4 weight (uint8 [out, in / 2], linear_core) holds two inputs a byte.
int64_t in_features(const at::Tensor& weight) {
  return weight.scalar_type() == at::kByte ? 2 * weight.size(1) : weight.size(1);
}

// Scratch of a block, reused from call to call (the blocks run on the calling thread, one at a time; the kernels
// they call keep their own).
float* workspace(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t width) {
  check_float(t, name, 2);
  TORCH_CHECK(t.is_contiguous() && t.size(0) == rows && t.size(1) == width, name, " must be a contiguous [", rows,
              ", ", width, "] tensor, got ", t.sizes());
}

// A block's input norm: hidden [B, H] (+ residual, when the layer has one yet) normalised into `normed`; returns the
// residual for the next norm (the sum, or hidden itself in the first layer).
at::Tensor pre_norm(const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& weight, double eps,
                    float* normed) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  check_rows(hidden, "hidden", rows, width);
  check_float(weight, "norm weight", 1);
  TORCH_CHECK(weight.size(0) == width, "the norm weight must have ", width, " elements, got ", weight.size(0));
  const Rows xs(hidden.data_ptr<float>(), 1, width, 0);
  if (!residual.has_value()) {
    gemma_norm_core(xs, nullptr, rows, width, weight.data_ptr<float>(), static_cast<float>(eps), normed, nullptr);
    return hidden;
  }
  check_rows(*residual, "residual", rows, width);
  at::Tensor sum = at::empty({rows, width}, hidden.options());
  const Rows rs(residual->data_ptr<float>(), 1, width, 0);
  gemma_norm_core(xs, &rs, rows, width, weight.data_ptr<float>(), static_cast<float>(eps), normed,
                  sum.data_ptr<float>());
  return sum;
}

// down(silu(gate) * up) of rows x [B, H] into out [B, H], gate and up packed in one projection of 2I columns;
// `gate_up` is scratch of B * 2I floats.
void gated_mlp(const float* x, int64_t rows, int64_t hidden, const at::Tensor& gate_up_w, const OptTensor& gate_up_s,
               const at::Tensor& down_w, const OptTensor& down_s, const Projections& project, float* gate_up,
               float* out) {
  const int64_t inter = gate_up_w.size(0) / 2;
  project(x, hidden, rows, hidden, gate_up_w, gate_up_s, gate_up);
  at::parallel_for(0, rows, grain(4 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul(gate_up + r * 2 * inter, inter);
  });
  project(gate_up, 2 * inter, rows, inter, down_w, down_s, out);
}

// Partial NeoX rotary, in place, of the first rotary_dim dims of rows [T, heads, hd] (contiguous); cos_sin
// [positions, rotary_dim] holds cos then sin.
void rotate(float* x, int64_t tokens, int64_t heads, int64_t hd, const Index& pos, const at::Tensor& cos_sin,
            int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "positions[", t, "] = ", pos[t], " is past the ",
                cos_sin.size(0), " positions of the rotary table");
  }
  at::parallel_for(0, tokens, grain(heads * rotary_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *cos = cos_sin.data_ptr<float>() + pos[t] * cos_sin.stride(0), *sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * hd;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * cos[i] - x2 * sin[i];
          v[i + half] = x2 * cos[i] + x1 * sin[i];
        }
      }
    }
  });
}

// Rows [T, heads, hd] (rows apart by `row`, heads by `head`) into the pool's slots loc[t].
void store_rows(const float* src, int64_t row, int64_t head, int64_t tokens, int64_t heads, int64_t hd,
                const at::Tensor& cache, const Index& loc) {
  float* dst = cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(loc[t] >= 0 && loc[t] < cache.size(0), "out_cache_loc[", t, "] = ", loc[t],
                " is outside the KV pool of ", cache.size(0), " slots");
  }
  at::parallel_for(0, tokens, grain(heads * hd), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        std::copy_n(src + t * row + h * head, hd, dst + loc[t] * cache.stride(0) + h * cache.stride(1));
      }
    }
  });
}

// rows[r] *= sigmoid(gates[r]) for `count` rows of n: the attention output's gate.
void gate_by_sigmoid(float* rows, const Rows& gates, int64_t count, int64_t n) {
  at::parallel_for(0, count, grain(4 * n), [&](int64_t begin, int64_t end) {  // a sigmoid: ~4 products' time
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gates[r];
      float* row = rows + r * n;
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) row[d] *= sigmoid(gate[d]);
    }
  });
}

// out += sigmoid(logit) * shared over a row of n: a separate shared expert's contribution.
void add_gated(float* out, const float* shared, float logit, int64_t n) {
  const float gate = sigmoid(logit);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] += gate * shared[j];
}

}  // namespace

// ---- the blocks' own steps as ops: with batch invariance the modules take them too (layers/*.py), so that a
// prompt token computes what a decode token does ---------------------------------------------------------------------

// x [T, heads, hd] (last dimension contiguous) rotated as the attention block rotates: a contiguous copy.
at::Tensor rotary_rows(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin,
                       int64_t rotary_dim) {
  check_float(x, "x", 3);
  check_float(cos_sin, "cos_sin_cache", 2);
  TORCH_CHECK(rotary_dim <= x.size(2) && rotary_dim % 2 == 0 && cos_sin.size(1) == rotary_dim,
              "cos_sin_cache must be [P, ", rotary_dim, "] with an even rotary_dim <= ", x.size(2));
  TORCH_CHECK(positions.numel() == x.size(0), "positions must hold one entry per token");
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  rotate(out.data_ptr<float>(), x.size(0), x.size(1), x.size(2), Index(positions, "positions"), cos_sin,
         rotary_dim);
  return out;
}

// out [T, heads, hd] times sigmoid(gate) [T, heads, hd] (strided views): a contiguous result.
at::Tensor sigmoid_gate_rows(const at::Tensor& out, const at::Tensor& gate) {
  check_float(out, "out", 3);
  check_float(gate, "gate", 3);
  TORCH_CHECK(gate.sizes() == out.sizes(), "gate must be shaped like out ", out.sizes(), ", got ", gate.sizes());
  at::Tensor result = out.clone(at::MemoryFormat::Contiguous);
  gate_by_sigmoid(result.data_ptr<float>(), Rows(gate), out.size(0) * out.size(1), out.size(2));
  return result;
}

// silu(gate) * up of rows [gate | up] [T, 2I]: [T, I].
at::Tensor silu_and_mul_rows(const at::Tensor& gate_up) {
  check_float(gate_up, "gate_up", 2);
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor rows = gate_up.clone(at::MemoryFormat::Contiguous);
  for (int64_t r = 0; r < rows.size(0); ++r) silu_and_mul(rows.data_ptr<float>() + r * 2 * inter, inter);
  return rows.narrow(1, 0, inter).contiguous();
}

// routed + sigmoid(logit) * shared, rows [T, H] and logit [T, 1]: a separate shared expert added.
at::Tensor add_gated_rows(const at::Tensor& routed, const at::Tensor& shared, const at::Tensor& logit) {
  check_float(routed, "routed", 2);
  check_float(shared, "shared", 2);
  check_float(logit, "logit", 2);
  TORCH_CHECK(shared.sizes() == routed.sizes() && logit.size(0) == routed.size(0) && logit.size(1) == 1,
              "routed and shared must be [T, H] and logit [T, 1]");
  at::Tensor out = routed.clone(at::MemoryFormat::Contiguous);
  const at::Tensor s = shared.contiguous();
  const int64_t width = out.size(1);
  for (int64_t r = 0; r < out.size(0); ++r) {
    add_gated(out.data_ptr<float>() + r * width, s.data_ptr<float>() + r * width,
              logit.data_ptr<float>()[r * logit.stride(0)], width);
  }
  return out;
}

// A speculative verify forward's rows (forward_batch.VerifyStates): rows[j] the rows of each request's token j,
// reqs[j] those requests; after each token the layer's states go to conv[req, j, layer], ssm[req, j, layer].
struct Verify {
  std::vector<at::Tensor> rows, reqs;
  at::Tensor conv, ssm;
  int64_t layer;
};

namespace {

// One layer's conv state [conv_dim, K-1] (channels `s_chan` apart) and recurrent state [HV, dk, dv] (heads `s_head`
// apart) of a slot, after a verify row, into the verify buffers at (request, token).
void record_states(const Verify& v, int64_t req, int64_t j, const float* conv, int64_t conv_dim, int64_t width,
                   int64_t s_chan, const float* ssm, int64_t heads, int64_t head_floats, int64_t s_head) {
  float* conv_out =
      v.conv.data_ptr<float>() + req * v.conv.stride(0) + j * v.conv.stride(1) + v.layer * v.conv.stride(2);
  for (int64_t d = 0; d < conv_dim; ++d) std::copy_n(conv + d * s_chan, width, conv_out + d * width);
  float* ssm_out =
      v.ssm.data_ptr<float>() + req * v.ssm.stride(0) + j * v.ssm.stride(1) + v.layer * v.ssm.stride(2);
  for (int64_t h = 0; h < heads; ++h) std::copy_n(ssm + h * s_head, head_floats, ssm_out + h * head_floats);
}

// The Gated DeltaNet layer of a decode step (gdn_decode_block below), or over a verify forward's rows when
// `verify` is given: each row holds its request's state slot, and the conv and the delta rule step the requests'
// tokens in order (token j of every request at once), keeping the states after each. With `cu_seqlens` [R + 1], a
// prefill (gdn_prefill_block): the rows are R requests' tokens, one state slot a request, through the prefill kernels
// as the modules run them.
std::tuple<at::Tensor, at::Tensor> gdn_block(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qkvz_w, const OptTensor& qkvz_s, const at::Tensor& ba_w, const OptTensor& ba_s,
    const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& gated_norm_w,
    double gated_norm_eps, const at::Tensor& out_w, const OptTensor& out_s, const at::Tensor& conv_states,
    const at::Tensor& ssm_states, const at::Tensor& state_slots, int64_t key_heads, int64_t value_heads,
    int64_t key_dim, int64_t value_dim, at::IntArrayRef block, int64_t bf16_dot, const Verify* verify,
    const at::Tensor* cu_seqlens = nullptr, const Bf16Planes* qkvz_planes = nullptr,
    const Bf16Planes* out_planes = nullptr) {
  const Projections project{block, bf16_dot};
  const int64_t batch = hidden.size(0), width = hidden.size(1);
  const int64_t keys = key_heads * key_dim, values = value_heads * value_dim, conv_dim = 2 * keys + values;
  const int64_t qkvz_width = conv_dim + values;
  TORCH_CHECK(qkvz_w.size(0) == qkvz_width && ba_w.size(0) == 2 * value_heads && in_features(out_w) == values,
              "in_proj_qkvz, in_proj_ba and out_proj do not match the heads: ", qkvz_w.sizes(), ", ", ba_w.sizes(),
              ", ", out_w.sizes());
  const GdnShapes shapes{batch, key_heads, key_dim, value_heads, value_dim};
  check_float(ssm_states, "ssm_states", 4);
  TORCH_CHECK(ssm_states.size(1) == value_heads && ssm_states.size(2) == key_dim &&
                  ssm_states.size(3) == value_dim && ssm_states.stride(2) == value_dim,
              "ssm_states must be [S, ", value_heads, ", ", key_dim, ", ", value_dim, "] with contiguous states (slots "
              "and heads may be strided), got ", ssm_states.sizes());
  TORCH_CHECK(A_log.numel() == value_heads && dt_bias.numel() == value_heads && gated_norm_w.numel() == value_dim,
              "A_log, dt_bias and the gated norm's weight do not match the heads");
  float* normed = workspace(batch * (width + qkvz_width + 2 * value_heads + conv_dim + 2 * value_heads + 2 * values));
  float* qkvz = normed + batch * width;
  float* ba = qkvz + batch * qkvz_width;
  float* conv = ba + batch * 2 * value_heads;
  float* gates = conv + batch * conv_dim;  // g, then beta
  float* o = gates + batch * 2 * value_heads;
  float* o_normed = o + batch * values;
  at::Tensor res = pre_norm(hidden, residual, norm_weight, eps, normed);
  project(normed, width, batch, width, qkvz_w, qkvz_s, qkvz, qkvz_planes);
  project(normed, width, batch, width, ba_w, ba_s, ba);
  const int64_t requests = cu_seqlens != nullptr ? state_slots.numel() : batch;  // a prefill's: one slot each
  const std::vector<int64_t> bounds =
      cu_seqlens != nullptr ? request_bounds(*cu_seqlens, requests, batch) : std::vector<int64_t>{};
  check_conv_update(at::from_blob(qkvz, {requests, conv_dim}, {qkvz_width, 1}), conv_weight, conv_states,
                    state_slots);
  TORCH_CHECK(ssm_states.size(0) == conv_states.size(0), "conv_states and ssm_states must hold the same slots");
  const Index slots(state_slots, "state_slots");
  gdn_gating_core(ba + value_heads, 2 * value_heads, ba, 2 * value_heads, batch, value_heads, A_log.data_ptr<float>(),
                  dt_bias.data_ptr<float>(), gates, gates + batch * value_heads);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(key_dim)));
  const int64_t taps = conv_weight.size(1);
  // A prefill or batch invariant: the conv's weights taps-major ([K, D]), as the prefill kernel reads them.
  std::vector<float> taps_major;
  if (batch_invariant() || cu_seqlens != nullptr) {
    const float* w = conv_weight.data_ptr<float>();
    taps_major.resize(conv_dim * taps);
    for (int64_t d = 0; d < conv_dim; ++d) {
      for (int64_t j = 0; j < taps; ++j) taps_major[j * conv_dim + d] = w[d * taps + j];
    }
  }
  // The conv update and the delta rule over `n` rows whose inputs are `x` (rows x_row apart), gates g and beta,
  // state slots `slot_of`: conv outputs to `c`, attention outputs to `out` (rows contiguous). Batch invariant: the
  // prefill kernels, one token a request, as the modules run them then (kernels/cpu/__init__.py), so that a decode
  // token computes what a prompt token does.
  auto mix = [&](const float* x, int64_t x_row, int64_t n, const float* g, const float* beta, const Index& slot_of,
                 float* c, float* out) {
    if (batch_invariant() || cu_seqlens != nullptr) {
      std::vector<int64_t> one_each(n + 1);  // a decode step's rows: one token a request
      std::iota(one_each.begin(), one_each.end(), int64_t{0});
      const int64_t* request_rows = cu_seqlens != nullptr ? bounds.data() : one_each.data();
      const int64_t reqs = cu_seqlens != nullptr ? requests : n;
      conv_prefill_core(x, x_row, n, conv_dim, taps_major.data(), taps, conv_states.data_ptr<float>(), slot_of,
                        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), request_rows, reqs,
                        true, c);
      const float scale_as_modules = static_cast<float>(std::pow(static_cast<double>(key_dim), -0.5));  // dk ** -0.5
      delta_rule_prefill_core(Rows(c, key_heads, conv_dim, key_dim), Rows(c + keys, key_heads, conv_dim, key_dim),
                              Rows(c + 2 * keys, value_heads, conv_dim, value_dim), g, value_heads, beta, value_heads,
                              GdnShapes{n, key_heads, key_dim, value_heads, value_dim}, ssm_states.data_ptr<float>(),
                              slot_of, ssm_states.stride(0), ssm_states.stride(1), request_rows, reqs,
                              scale_as_modules, true, out);
      return;
    }
    conv_update_core(x, x_row, n, conv_dim, conv_weight.data_ptr<float>(), taps, conv_states.data_ptr<float>(), slot_of,
                     conv_states.stride(0), conv_states.stride(1), true, c);
    delta_rule_decode_core(Rows(c, key_heads, conv_dim, key_dim), Rows(c + keys, key_heads, conv_dim, key_dim),
                           Rows(c + 2 * keys, value_heads, conv_dim, value_dim), g, value_heads, beta, value_heads,
                           GdnShapes{n, key_heads, key_dim, value_heads, value_dim}, ssm_states.data_ptr<float>(),
                           slot_of, ssm_states.stride(0), ssm_states.stride(1), scale, true, out);
  };
  TORCH_CHECK(verify == nullptr || cu_seqlens == nullptr, "a verify forward is no prefill");
  if (verify == nullptr) {
    mix(qkvz, qkvz_width, batch, gates, gates + batch * value_heads, slots, conv, o);
  } else {
    TORCH_CHECK(verify->rows.size() == verify->reqs.size(), "verify rows and requests differ in steps");
    TORCH_CHECK(conv_states.stride(2) == 1, "conv_states must have contiguous taps to be recorded");
    std::vector<float> x(batch * conv_dim), g(batch * value_heads), beta(batch * value_heads);
    std::vector<float> c(batch * conv_dim), out(batch * values);
    std::vector<int64_t> row_slots(batch);
    const int64_t width = taps - 1, head_floats = key_dim * value_dim;
    for (size_t j = 0; j < verify->rows.size(); ++j) {
      const at::Tensor& rows_t = verify->rows[j];
      const Index rows(rows_t, "verify rows"), reqs(verify->reqs[j], "verify requests");
      const int64_t n = rows_t.numel();
      for (int64_t i = 0; i < n; ++i) {  // token j of each request, gathered
        const int64_t r = rows[i];
        TORCH_CHECK(r >= 0 && r < batch, "verify row ", r, " is outside the batch of ", batch);
        std::copy_n(qkvz + r * qkvz_width, conv_dim, x.data() + i * conv_dim);
        std::copy_n(gates + r * value_heads, value_heads, g.data() + i * value_heads);
        std::copy_n(gates + (batch + r) * value_heads, value_heads, beta.data() + i * value_heads);
        row_slots[i] = slots[r];
      }
      const Index step_slots(at::from_blob(row_slots.data(), {n}, at::TensorOptions().dtype(at::kLong)),
                             "verify slots");
      mix(x.data(), conv_dim, n, g.data(), beta.data(), step_slots, c.data(), out.data());
      for (int64_t i = 0; i < n; ++i) {
        std::copy_n(out.data() + i * values, values, o + rows[i] * values);
        record_states(*verify, reqs[i], static_cast<int64_t>(j),
                      conv_states.data_ptr<float>() + row_slots[i] * conv_states.stride(0), conv_dim, width,
                      conv_states.stride(1), ssm_states.data_ptr<float>() + row_slots[i] * ssm_states.stride(0),
                      value_heads,
                      head_floats, ssm_states.stride(1));
      }
    }
  }
  gated_norm_core(Rows(o, value_heads, values, value_dim), Rows(qkvz + conv_dim, value_heads, qkvz_width, value_dim),
                  batch * value_heads, value_dim, gated_norm_w.data_ptr<float>(), static_cast<float>(gated_norm_eps),
                  o_normed);
  at::Tensor out = at::empty({batch, width}, hidden.options());
  project(o_normed, values, batch, values, out_w, out_s, out.data_ptr<float>(), out_planes);
  return {out, res};
}

}  // namespace

// The Gated DeltaNet layer of a decode step (layers/gdn.py): input norm, in_proj_qkvz and in_proj_ba, the conv
// update and the recurrent gated delta rule (states updated in place in the pools' slots), the gated norm, out_proj.
std::tuple<at::Tensor, at::Tensor> gdn_decode_block(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qkvz_w, const OptTensor& qkvz_s, const at::Tensor& ba_w, const OptTensor& ba_s,
    const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& gated_norm_w,
    double gated_norm_eps, const at::Tensor& out_w, const OptTensor& out_s, const at::Tensor& conv_states,
    const at::Tensor& ssm_states, const at::Tensor& state_slots, int64_t key_heads, int64_t value_heads,
    int64_t key_dim, int64_t value_dim, at::IntArrayRef block, int64_t bf16_dot) {
  return gdn_block(hidden, residual, norm_weight, eps, qkvz_w, qkvz_s, ba_w, ba_s, conv_weight, A_log, dt_bias,
                   gated_norm_w, gated_norm_eps, out_w, out_s, conv_states, ssm_states, state_slots, key_heads,
                   value_heads, key_dim, value_dim, block, bf16_dot, nullptr);
}

// The Gated DeltaNet layer of a prefill (layers/gdn.py) as gdn_decode_block computes a decode step's, over R
// requests' tokens (cu_seqlens [R + 1], state_slots [R]): the causal conv and the delta rule run each request's
// tokens from its slot's states (left there after its last token), with the prefill kernels the modules call.
std::tuple<at::Tensor, at::Tensor> gdn_prefill_block(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qkvz_w, const OptTensor& qkvz_s, const at::Tensor& ba_w, const OptTensor& ba_s,
    const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& gated_norm_w,
    double gated_norm_eps, const at::Tensor& out_w, const OptTensor& out_s, const at::Tensor& conv_states,
    const at::Tensor& ssm_states, const at::Tensor& state_slots, int64_t key_heads, int64_t value_heads,
    int64_t key_dim, int64_t value_dim, at::IntArrayRef block, int64_t bf16_dot, const at::Tensor& cu_seqlens) {
  return gdn_block(hidden, residual, norm_weight, eps, qkvz_w, qkvz_s, ba_w, ba_s, conv_weight, A_log, dt_bias,
                   gated_norm_w, gated_norm_eps, out_w, out_s, conv_states, ssm_states, state_slots, key_heads,
                   value_heads, key_dim, value_dim, block, bf16_dot, nullptr, &cu_seqlens);
}

namespace {

// A prefill's requests for the attention block: their cached tokens before the new ones, and the new ones' count.
struct Extend {
  const at::Tensor& prefix_lens;
  const at::Tensor& extend_lens;
};

// The gated attention layer (attention_decode_block, attention_prefill_block): input norm, qkv_proj (each query head
// with its gate), per-head q and k norms, partial NeoX rotary, the new keys and values into the pool, paged attention
// (a decode step's one query a request over its seq_lens tokens, or with `extend` a prefill's new tokens causally
// over their requests' prefixes and themselves), the sigmoid gate, o_proj.
std::tuple<at::Tensor, at::Tensor> attention_block(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qkv_w, const OptTensor& qkv_s, const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
    double head_eps, const at::Tensor& o_w, const OptTensor& o_s, const at::Tensor& cos_sin_cache,
    int64_t rotary_dim, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
    const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const at::Tensor& positions,
    const at::Tensor& out_cache_loc, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
    int64_t page_size, at::IntArrayRef block, int64_t bf16_dot, const Extend* extend) {
  const Projections project{block, bf16_dot};
  const int64_t batch = hidden.size(0), width = hidden.size(1), hd = head_dim;
  const int64_t queries = heads * hd, kvs = kv_heads * hd, qkv_width = 2 * queries + 2 * kvs;
  TORCH_CHECK(qkv_w.size(0) == qkv_width && in_features(o_w) == queries,
              "qkv_proj and o_proj do not match the heads: ", qkv_w.sizes(), ", ", o_w.sizes());
  TORCH_CHECK(q_norm_w.numel() == hd && k_norm_w.numel() == hd, "the q and k norms must have ", hd, " elements");
  check_float(cos_sin_cache, "cos_sin_cache", 2);
  TORCH_CHECK(rotary_dim <= hd && rotary_dim % 2 == 0 && cos_sin_cache.size(1) == rotary_dim,
              "cos_sin_cache must be [P, ", rotary_dim, "] with an even rotary_dim <= ", hd);
  TORCH_CHECK(positions.numel() == batch && out_cache_loc.numel() == batch, "positions and out_cache_loc must hold "
              "one entry per ", extend != nullptr ? "token" : "request");
  std::vector<int64_t> bounds;  // a prefill's: each request's rows
  int64_t longest = 0;
  if (extend != nullptr) {
    bounds = check_extend_attention(batch, heads, hd, k_cache, v_cache, page_table, req_pool_indices,
                                    extend->prefix_lens, extend->extend_lens, page_size);
  } else {
    longest = check_decode_attention(batch, heads, hd, k_cache, v_cache, page_table, req_pool_indices, seq_lens,
                                     page_size);
  }
  float* normed = workspace(batch * (width + qkv_width + queries + kvs + queries));
  float* qkv = normed + batch * width;
  float* q = qkv + batch * qkv_width;
  float* k = q + batch * queries;
  float* attended = k + batch * kvs;
  at::Tensor res = pre_norm(hidden, residual, norm_weight, eps, normed);
  project(normed, width, batch, width, qkv_w, qkv_s, qkv);
  const float head_eps_f = static_cast<float>(head_eps);
  gemma_norm_core(Rows(qkv, heads, qkv_width, 2 * hd), nullptr, batch * heads, hd, q_norm_w.data_ptr<float>(),
                  head_eps_f, q, nullptr);
  gemma_norm_core(Rows(qkv + 2 * queries, kv_heads, qkv_width, hd), nullptr, batch * kv_heads, hd,
                  k_norm_w.data_ptr<float>(), head_eps_f, k, nullptr);
  const Index pos(positions, "positions"), loc(out_cache_loc, "out_cache_loc");
  rotate(q, batch, heads, hd, pos, cos_sin_cache, rotary_dim);
  rotate(k, batch, kv_heads, hd, pos, cos_sin_cache, rotary_dim);
  store_rows(k, kvs, hd, batch, kv_heads, hd, k_cache, loc);
  store_rows(qkv + 2 * queries + kvs, qkv_width, hd, batch, kv_heads, hd, v_cache, loc);
  const TokenTable table(page_table, page_size);
  const Index rows(req_pool_indices, "req_pool_indices");
  if (extend != nullptr && batch_invariant()) {  // each new token as a decode query over its first tokens
    const int64_t requests = req_pool_indices.numel();
    const Index prefix(extend->prefix_lens, "prefix_lens");
    std::vector<int64_t> token_rows(batch), token_lens(batch);
    for (int64_t b = 0; b < requests; ++b) {
      for (int64_t t = bounds[b]; t < bounds[b + 1]; ++t) {
        token_rows[t] = rows[b];
        token_lens[t] = prefix[b] + t - bounds[b] + 1;
        longest = std::max(longest, token_lens[t]);
      }
    }
    const auto as_index = [](std::vector<int64_t>& v) {
      return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
    };
    decode_attention_core(Rows(q, heads, queries, hd), batch, heads, hd, k_cache, v_cache, table,
                          Index(as_index(token_rows), "rows"), Index(as_index(token_lens), "lens"), longest,
                          static_cast<float>(scale), attended);
  } else if (extend != nullptr) {
    extend_attention_core(Rows(q, heads, queries, hd), heads, hd, k_cache, v_cache, table, rows,
                          Index(extend->prefix_lens, "prefix_lens"), bounds.data(), req_pool_indices.numel(),
                          static_cast<float>(scale), attended);
  } else {
    decode_attention_core(Rows(q, heads, queries, hd), batch, heads, hd, k_cache, v_cache, table, rows,
                          Index(seq_lens, "seq_lens"), longest, static_cast<float>(scale), attended);
  }
  // times sigmoid(gate), the second half of each head's [q | gate]
  gate_by_sigmoid(attended, Rows(qkv + hd, heads, qkv_width, 2 * hd), batch * heads, hd);
  at::Tensor out = at::empty({batch, width}, hidden.options());
  project(attended, queries, batch, queries, o_w, o_s, out.data_ptr<float>());
  return {out, res};
}

}  // namespace

// The gated attention layer of a decode step (layers/attention.py): attention_block, one query a request.
std::tuple<at::Tensor, at::Tensor> attention_decode_block(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qkv_w, const OptTensor& qkv_s, const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
    double head_eps, const at::Tensor& o_w, const OptTensor& o_s, const at::Tensor& cos_sin_cache,
    int64_t rotary_dim, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
    const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const at::Tensor& positions,
    const at::Tensor& out_cache_loc, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
    int64_t page_size, at::IntArrayRef block, int64_t bf16_dot) {
  return attention_block(hidden, residual, norm_weight, eps, qkv_w, qkv_s, q_norm_w, k_norm_w, head_eps, o_w, o_s,
                         cos_sin_cache, rotary_dim, k_cache, v_cache, page_table, req_pool_indices, seq_lens,
                         positions, out_cache_loc, heads, kv_heads, head_dim, scale, page_size, block, bf16_dot,
                         nullptr);
}

// The gated attention layer of a prefill: attention_block over R requests' new tokens (extend_lens [R], each after
// its prefix_lens [R] cached tokens; positions and out_cache_loc one a token), causal.
std::tuple<at::Tensor, at::Tensor> attention_prefill_block(
    const at::Tensor& hidden, const OptTensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& qkv_w, const OptTensor& qkv_s, const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
    double head_eps, const at::Tensor& o_w, const OptTensor& o_s, const at::Tensor& cos_sin_cache,
    int64_t rotary_dim, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& page_table,
    const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
    const at::Tensor& positions, const at::Tensor& out_cache_loc, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scale, int64_t page_size, at::IntArrayRef block, int64_t bf16_dot) {
  const Extend extend{prefix_lens, extend_lens};
  return attention_block(hidden, residual, norm_weight, eps, qkv_w, qkv_s, q_norm_w, k_norm_w, head_eps, o_w, o_s,
                         cos_sin_cache, rotary_dim, k_cache, v_cache, page_table, req_pool_indices, extend_lens,
                         positions, out_cache_loc, heads, kv_heads, head_dim, scale, page_size, block, bf16_dot,
                         &extend);
}

// The MoE block (layers/mlp.py): post-attention norm, the router's softmax top-k (renormalised), the experts; the
// shared expert as expert `shared_id` of the fused experts (weight sigmoid(shared_expert_gate(x))), or, with
// shared_id < 0, its own gated MLP times that sigmoid, added.
std::tuple<at::Tensor, at::Tensor> moe_decode_block(
    const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& gate_w, const at::Tensor& shared_gate_w, const at::Tensor& w13, const OptTensor& w13_s,
    const at::Tensor& w2, const OptTensor& w2_s, const OptTensor& shared_gate_up_w, const OptTensor& shared_gate_up_s,
    const OptTensor& shared_down_w, const OptTensor& shared_down_s, int64_t top_k, int64_t shared_id,
    at::IntArrayRef block, int64_t bf16_dot) {
  const Projections project{block, bf16_dot};
  const int64_t batch = hidden.size(0), width = hidden.size(1), experts = gate_w.size(0);
  const bool fused = shared_id >= 0;
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, ", experts, "], got ", top_k);
  TORCH_CHECK(shared_gate_w.size(0) == 1 && (!fused || shared_id < w13.size(0)),
              "the shared expert's gate must be [1, H] and its id one of the experts'");
  TORCH_CHECK(fused || (shared_gate_up_w.has_value() && shared_down_w.has_value()),
              "a separate shared expert needs its gate_up and down weights");
  check_experts(w13, w2, width);
  const int64_t k = top_k + (fused ? 1 : 0);
  const int64_t shared_inter = fused ? 0 : shared_gate_up_w->size(0) / 2;
  float* normed = workspace(batch * (width + experts + 1 + k + width + 2 * shared_inter));
  float* router = normed + batch * width;
  float* shared_logit = router + batch * experts;
  float* weights = shared_logit + batch;
  float* shared = weights + batch * k;
  std::vector<int32_t> ids(batch * k);
  float* shared_gate_up = shared + batch * width;
  at::Tensor res = pre_norm(hidden, residual, norm_weight, eps, normed);
  project(normed, width, batch, width, gate_w, c10::nullopt, router);
  project(normed, width, batch, width, shared_gate_w, c10::nullopt, shared_logit);
  moe_route_core(router, experts, batch, experts, fused ? shared_logit : nullptr, 1, top_k, true, shared_id, weights,
                 ids.data());
  at::Tensor out = at::empty({batch, width}, hidden.options());
  float* o = out.data_ptr<float>();
  fused_moe_core(normed, width, batch, width, w13, w2, w13_s, w2_s, block, Index(ids.data()), weights, k, 1, k,
                 bf16_dot, o);
  if (!fused) {
    gated_mlp(normed, batch, width, *shared_gate_up_w, shared_gate_up_s, *shared_down_w, shared_down_s, project,
              shared_gate_up, shared);
    at::parallel_for(0, batch, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) add_gated(o + r * width, shared + r * width, shared_logit[r], width);
    });
  }
  return {out, res};
}

// The dense MLP block: post-attention norm, down(silu(gate) * up).
std::tuple<at::Tensor, at::Tensor> mlp_decode_block(const at::Tensor& hidden, const at::Tensor& residual,
                                                    const at::Tensor& norm_weight, double eps,
                                                    const at::Tensor& gate_up_w, const OptTensor& gate_up_s,
                                                    const at::Tensor& down_w, const OptTensor& down_s,
                                                    at::IntArrayRef block, int64_t bf16_dot) {
  const Projections project{block, bf16_dot};
  const int64_t batch = hidden.size(0), width = hidden.size(1), inter = gate_up_w.size(0) / 2;
  float* normed = workspace(batch * (width + 2 * inter));
  at::Tensor res = pre_norm(hidden, residual, norm_weight, eps, normed);
  at::Tensor out = at::empty({batch, width}, hidden.options());
  gated_mlp(normed, batch, width, gate_up_w, gate_up_s, down_w, down_s, project, normed + batch * width,
            out.data_ptr<float>());
  return {out, res};
}

// The MTP head's input (models/qwen3_5.py, Qwen3_5MTP): the next tokens' embeddings and the model's hidden states
// [N, H], each Gemma-RMS-normed, side by side [embedding | hidden], projected 2H -> H by fc.
at::Tensor mtp_input_block(const at::Tensor& embedded, const at::Tensor& hidden, const at::Tensor& embed_norm_w,
                           double embed_eps, const at::Tensor& hidden_norm_w, double hidden_eps,
                           const at::Tensor& fc_w, const OptTensor& fc_s, at::IntArrayRef block, int64_t bf16_dot) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  check_rows(embedded, "embedded", rows, width);
  check_rows(hidden, "hidden", rows, width);
  check_float(embed_norm_w, "embedding norm weight", 1);
  check_float(hidden_norm_w, "hidden norm weight", 1);
  TORCH_CHECK(embed_norm_w.numel() == width && hidden_norm_w.numel() == width, "the norm weights must have ", width,
              " elements");
  float* normed = workspace(rows * 4 * width);  // each norm's rows, then them side by side
  float* joined = normed + rows * 2 * width;
  gemma_norm_core(Rows(embedded.data_ptr<float>(), 1, width, 0), nullptr, rows, width,
                  embed_norm_w.data_ptr<float>(), static_cast<float>(embed_eps), normed, nullptr);
  gemma_norm_core(Rows(hidden.data_ptr<float>(), 1, width, 0), nullptr, rows, width, hidden_norm_w.data_ptr<float>(),
                  static_cast<float>(hidden_eps), normed + rows * width, nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(normed + r * width, width, joined + r * 2 * width);
    std::copy_n(normed + (rows + r) * width, width, joined + r * 2 * width + width);
  }
  at::Tensor out = at::empty({rows, width}, hidden.options());
  Projections{block, bf16_dot}(joined, 2 * width, rows, 2 * width, fc_w, fc_s, out.data_ptr<float>());
  return out;
}

// ---- a model's decode layers in one call ---------------------------------------------------------------------------

namespace {

// The rows `ids` [B] of an embedding [V, H] as float32 [B, H]: at::embedding(...).to(kFloat), copied (float32) or
// widened (bf16, exactly) here for the common layouts; its three dispatched ops took ~12 us of a ~1.1 ms decode step
// at the mid shape.
at::Tensor embedded_rows(const at::Tensor& embedding, const at::Tensor& ids) {
  const bool direct = (embedding.scalar_type() == at::kFloat || embedding.scalar_type() == at::kBFloat16) &&
                      embedding.stride(1) == 1 && ids.dim() == 1 && ids.is_contiguous() &&
                      (ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt);
  if (!direct) return at::embedding(embedding, ids).to(at::kFloat).contiguous();
  const Index index(ids, "input_ids");
  const int64_t rows = ids.numel(), vocab = embedding.size(0), width = embedding.size(1);
  at::Tensor out = at::empty({rows, width}, embedding.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t id = index[r];
    TORCH_CHECK(id >= 0 && id < vocab, "input_ids[", r, "] = ", id, " is outside the vocabulary of ", vocab);
    if (embedding.scalar_type() == at::kFloat) {
      std::copy_n(embedding.data_ptr<float>() + id * embedding.stride(0), width, o + r * width);
    } else {
      const uint16_t* row = static_cast<const uint16_t*>(embedding.data_ptr()) + id * embedding.stride(0);
      for (int64_t j = 0; j < width; ++j) o[r * width + j] = bf16_to_float(row[j]);
    }
  }
  return out;
}

// Whether `fd` (-1: none) can be read now, without waiting: one poll(2) (~0.4 us on a pipe, a Zen 4 host).
bool readable(int64_t fd) {
  if (fd < 0) return false;
  pollfd watched{static_cast<int>(fd), POLLIN, 0};
  return ::poll(&watched, 1, 0) > 0 && (watched.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

// t + 1 in place, for a decode loop's own copy of its lengths or positions (int64 or int32, contiguous): the
// dispatched add took a few microseconds a step.
void add_one(at::Tensor& t) {
  if (t.is_contiguous() && t.scalar_type() == at::kLong) {
    int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) ++p[i];
  } else if (t.is_contiguous() && t.scalar_type() == at::kInt) {
    int32_t* p = t.data_ptr<int32_t>();
    for (int64_t i = 0; i < t.numel(); ++i) ++p[i];
  } else {
    t.add_(1);
  }
}

}  // namespace

// The blocks of every layer, run back to back (models/qwen3_5.py): each block's arguments that stay the same from
// step to step (weights, norms, heads, this layer's pools) are given once, and a step passes only what changes. At
// batch 1 the dispatcher's parsing of a block's ~20 arguments cost about a third of the block's own time.
class DecodeLayers : public torch::CustomClassHolder {
 public:
  // What a decode step changes: its requests' state slots and pages, their lengths and positions, the new tokens'
  // KV slots, and how bf16 weights meet the rows.
  struct Step {
    at::Tensor state_slots, req_pool_indices, seq_lens, positions, out_cache_loc;
    int64_t bf16_dot;
    const Verify* verify;  // a verify forward's rows, or null
  };
  using Block = std::function<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const Step&)>;

  void add_gdn(at::Tensor norm_weight, double eps, at::Tensor qkvz_w, OptTensor qkvz_s, at::Tensor ba_w,
               OptTensor ba_s, at::Tensor conv_weight, at::Tensor A_log, at::Tensor dt_bias, at::Tensor gated_norm_w,
               double gated_norm_eps, at::Tensor out_w, OptTensor out_s, at::Tensor conv_states,
               at::Tensor ssm_states, int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim,
               std::vector<int64_t> block, int64_t state_layer) {
    const std::shared_ptr<const Bf16Planes> qkvz_planes = planes_of(qkvz_w), out_planes = planes_of(out_w);
    blocks_.push_back([=](const at::Tensor& hidden, const OptTensor& residual, const Step& step) {
      Verify verify;
      if (step.verify != nullptr) {  // this layer's place in the verify buffers
        verify = *step.verify;
        verify.layer = state_layer;
      }
      return gdn_block(hidden, residual, norm_weight, eps, qkvz_w, qkvz_s, ba_w, ba_s, conv_weight, A_log, dt_bias,
                       gated_norm_w, gated_norm_eps, out_w, out_s, conv_states, ssm_states, step.state_slots,
                       key_heads, value_heads, key_dim, value_dim, block, step.bf16_dot,
                       step.verify != nullptr ? &verify : nullptr, nullptr, qkvz_planes.get(), out_planes.get());
    });
  }

  void add_attention(at::Tensor norm_weight, double eps, at::Tensor qkv_w, OptTensor qkv_s, at::Tensor q_norm_w,
                     at::Tensor k_norm_w, double head_eps, at::Tensor o_w, OptTensor o_s, at::Tensor cos_sin_cache,
                     int64_t rotary_dim, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, double scale, int64_t page_size, std::vector<int64_t> block) {
    blocks_.push_back([=](const at::Tensor& hidden, const OptTensor& residual, const Step& step) {
      return attention_decode_block(hidden, residual, norm_weight, eps, qkv_w, qkv_s, q_norm_w, k_norm_w, head_eps,
                                    o_w, o_s, cos_sin_cache, rotary_dim, k_cache, v_cache, page_table,
                                    step.req_pool_indices, step.seq_lens, step.positions, step.out_cache_loc, heads,
                                    kv_heads, head_dim, scale, page_size, block, step.bf16_dot);
    });
  }

  void add_moe(at::Tensor norm_weight, double eps, at::Tensor gate_w, at::Tensor shared_gate_w, at::Tensor w13,
               OptTensor w13_s, at::Tensor w2, OptTensor w2_s, OptTensor shared_gate_up_w, OptTensor shared_gate_up_s,
               OptTensor shared_down_w, OptTensor shared_down_s, int64_t top_k, int64_t shared_id,
               std::vector<int64_t> block) {
    blocks_.push_back([=](const at::Tensor& hidden, const OptTensor& residual, const Step& step) {
      TORCH_CHECK(residual.has_value(), "an MLP block follows a mixer");
      return moe_decode_block(hidden, *residual, norm_weight, eps, gate_w, shared_gate_w, w13, w13_s, w2, w2_s,
                              shared_gate_up_w, shared_gate_up_s, shared_down_w, shared_down_s, top_k, shared_id,
                              block, step.bf16_dot);
    });
  }

  void add_mlp(at::Tensor norm_weight, double eps, at::Tensor gate_up_w, OptTensor gate_up_s, at::Tensor down_w,
               OptTensor down_s, std::vector<int64_t> block) {
    blocks_.push_back([=](const at::Tensor& hidden, const OptTensor& residual, const Step& step) {
      TORCH_CHECK(residual.has_value(), "an MLP block follows a mixer");
      return mlp_decode_block(hidden, *residual, norm_weight, eps, gate_up_w, gate_up_s, down_w, down_s, block,
                              step.bf16_dot);
    });
  }

  // The step's two ends, for run_logits: the embedding [V, H] (any float dtype), the final norm and the LM head
  // [V, H] (a weight as linear_core takes it, with its scales when quantized).
  void set_ends(at::Tensor embedding, at::Tensor norm_weight, double eps, at::Tensor head_w, OptTensor head_s) {
    check_float(norm_weight, "final norm weight", 1);
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == norm_weight.size(0) &&
                    in_features(head_w) == norm_weight.size(0),
                "the embedding [V, H], final norm [H] and LM head [V, H] disagree: ", embedding.sizes(), ", ",
                norm_weight.sizes(), ", ", head_w.sizes());
    ends_ = Ends{std::move(embedding), std::move(norm_weight), eps, std::move(head_w), std::move(head_s)};
    greedy_head_.reset();
    greedy_head_tried_ = false;
    screen_misses_ = 0.0;
  }

  // A decode step from token ids to logits [B, V]: the embedding's rows through every block, the final norm and the
  // LM head; what Qwen3_5ForCausalLM.forward_batch computes through the modules, in one call.
  at::Tensor run_logits(at::Tensor input_ids, at::Tensor state_slots, at::Tensor req_pool_indices,
                        at::Tensor seq_lens, at::Tensor positions, at::Tensor out_cache_loc, int64_t bf16_dot) {
    const at::Tensor normed =
        run_normed(input_ids, state_slots, req_pool_indices, seq_lens, positions, out_cache_loc, bf16_dot);
    return head_logits(normed, bf16_dot);
  }

  // Greedy decode steps back to back, each as run_logits followed by argmax_rows: a step's tokens are the next
  // step's input, one position further, their KV into the next row of out_cache_loc [steps, B]. Ends after the
  // step in which a row's token is one of its stop ids (stop_ids [B, S], -1 where a row has fewer), after a step
  // at whose end `wake_fd` (a file descriptor, -1: none) is readable (the scheduler's inbox: a command arrived),
  // or after every row of out_cache_loc. Returns the tokens [steps run, B]. `greedy_head`: a few rows' argmax
  // found through GreedyHead (greedy_head.h: the same tokens, reading an int8 copy of a float32 or bf16 head, built
  // on first use, and the few rows that can be the maximum) where it decides every row; the whole head's logits
  // where it does not.
  at::Tensor run_greedy(at::Tensor input_ids, at::Tensor state_slots, at::Tensor req_pool_indices,
                        at::Tensor seq_lens, at::Tensor positions, at::Tensor out_cache_loc, at::Tensor stop_ids,
                        int64_t bf16_dot, bool greedy_head, int64_t wake_fd) {
    const int64_t steps = out_cache_loc.size(0), rows = input_ids.size(0);
    TORCH_CHECK(out_cache_loc.dim() == 2 && out_cache_loc.size(1) == rows && stop_ids.dim() == 2 &&
                    stop_ids.size(0) == rows && stop_ids.scalar_type() == at::kLong && stop_ids.is_contiguous(),
                "run_greedy takes out_cache_loc [steps, B] and int64 stop_ids [B, S] for input_ids [B]: ",
                out_cache_loc.sizes(), ", ", stop_ids.sizes(), ", ", input_ids.sizes());
    at::Tensor tokens = at::empty({steps, rows}, input_ids.options().dtype(at::kLong));
    const int64_t* stops = stop_ids.data_ptr<int64_t>();
    const int64_t width = stop_ids.size(1);
    at::Tensor ids = input_ids;
    seq_lens = seq_lens.clone();  // the loop's own, advanced in place
    positions = positions.clone();
    const GreedyHead* screen = greedy_head && screens_rows(rows) ? screen_of_head() : nullptr;
    for (int64_t j = 0; j < steps; ++j) {
      const at::Tensor normed =
          run_normed(ids, state_slots, req_pool_indices, seq_lens, positions, out_cache_loc.select(0, j), bf16_dot);
      at::Tensor next = tokens.select(0, j);
      head_argmax_into(screen, normed, bf16_dot, next.data_ptr<int64_t>());
      const int64_t* picked = next.data_ptr<int64_t>();
      bool stopped = false;
      for (int64_t r = 0; r < rows && !stopped; ++r) {
        for (int64_t s = 0; s < width; ++s) stopped |= stops[r * width + s] == picked[r];
      }
      if (stopped || (j + 1 < steps && readable(wake_fd))) return tokens.narrow(0, 0, j + 1);
      ids = next;
      add_one(seq_lens);
      add_one(positions);
    }
    return tokens;
  }

  // Each row's argmax of the LM head's logits for rows after the final norm [B, H] (a prefill's last tokens), as
  // run_greedy finds a step's: through the screen where it would take it for B rows, else the whole head's logits.
  at::Tensor head_argmax(at::Tensor normed, int64_t bf16_dot, bool greedy_head) {
    TORCH_CHECK(ends_.has_value(), "DecodeLayers.head_argmax needs set_ends first");
    check_float(normed, "normed rows", 2);
    TORCH_CHECK(normed.is_contiguous() && normed.size(1) == ends_->norm_weight.size(0),
                "head_argmax takes contiguous rows [B, ", ends_->norm_weight.size(0), "], got ", normed.sizes());
    at::Tensor tokens = at::empty({normed.size(0)}, normed.options().dtype(at::kLong));
    const GreedyHead* screen = greedy_head && screens_rows(normed.size(0)) ? screen_of_head() : nullptr;
    head_argmax_into(screen, normed, bf16_dot, tokens.data_ptr<int64_t>());
    return tokens;
  }

  // hidden [B, H] (the embeddings) through every block: (the last block's output, residual), for the final norm.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor state_slots, at::Tensor req_pool_indices,
                                         at::Tensor seq_lens, at::Tensor positions, at::Tensor out_cache_loc,
                                         int64_t bf16_dot) {
    return run_step(hidden, Step{state_slots, req_pool_indices, seq_lens, positions, out_cache_loc, bf16_dot, nullptr});
  }

  // The same over a speculative verify forward's rows (one a token, forward_batch.build_rows_batch): rows[j] and
  // reqs[j] the rows of each request's token j and those requests; the Gated DeltaNet layers step them in order and
  // keep their states after each in conv [R, T, layers, conv_dim, K-1] and ssm [R, T, layers, HV, dk, dv].
  std::tuple<at::Tensor, at::Tensor> run_verify(at::Tensor hidden, at::Tensor state_slots,
                                                at::Tensor req_pool_indices, at::Tensor seq_lens, at::Tensor positions,
                                                at::Tensor out_cache_loc, int64_t bf16_dot,
                                                std::vector<at::Tensor> rows, std::vector<at::Tensor> reqs,
                                                at::Tensor conv, at::Tensor ssm) {
    check_float(conv, "verify conv states", 5);
    check_float(ssm, "verify ssm states", 6);
    TORCH_CHECK(conv.stride(4) == 1 && conv.stride(3) == conv.size(4) && ssm.stride(5) == 1 &&
                    ssm.stride(4) == ssm.size(5) && ssm.stride(3) == ssm.size(4) * ssm.size(5),
                "each verify state must be contiguous");
    const Verify verify{std::move(rows), std::move(reqs), conv, ssm, 0};
    return run_step(hidden,
                    Step{state_slots, req_pool_indices, seq_lens, positions, out_cache_loc, bf16_dot, &verify});
  }

  int64_t size() const { return static_cast<int64_t>(blocks_.size()); }

  // Whether blocks added from now on keep 12-bit planes of their bf16 projections (bf16_planes.h) for one-row
  // products: ~0.75x the bytes a decode step at batch 1 reads of them, the same values, kept beside the bf16 weights
  // (which every other row count reads). Off: none.
  void set_bf16_planes(bool on) { bf16_planes_ = on; }

  // The bytes the blocks' planes keep.
  int64_t bf16_planes_bytes() const { return planes_bytes_; }

 private:
  std::shared_ptr<const Bf16Planes> planes_of(const at::Tensor& weight) {
    if (!bf16_planes_) return nullptr;
    std::shared_ptr<const Bf16Planes> planes = Bf16Planes::of_weight(weight);
    if (planes != nullptr) planes_bytes_ += planes->bytes();
    return planes;
  }

  // A decode step's rows after the final norm [B, H]: run_logits without the LM head.
  at::Tensor run_normed(const at::Tensor& input_ids, const at::Tensor& state_slots, const at::Tensor& req_pool_indices,
                        const at::Tensor& seq_lens, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                        int64_t bf16_dot) {
    TORCH_CHECK(ends_.has_value(), "DecodeLayers.run_logits needs set_ends first");
    const Ends& ends = *ends_;
    const at::Tensor embedded = embedded_rows(ends.embedding, input_ids);
    auto [hidden, residual] =
        run_step(embedded, Step{state_slots, req_pool_indices, seq_lens, positions, out_cache_loc, bf16_dot, nullptr});
    const int64_t rows = hidden.size(0), width = hidden.size(1);
    at::Tensor normed = at::empty({rows, width}, hidden.options());
    at::Tensor sum = at::empty({rows, width}, hidden.options());
    const Rows rs(residual.data_ptr<float>(), 1, width, 0);
    gemma_norm_core(Rows(hidden.data_ptr<float>(), 1, width, 0), &rs, rows, width, ends.norm_weight.data_ptr<float>(),
                    static_cast<float>(ends.eps), normed.data_ptr<float>(), sum.data_ptr<float>());
    return normed;
  }

  at::Tensor head_logits(const at::Tensor& normed, int64_t bf16_dot) const {
    const Ends& ends = *ends_;
    const int64_t rows = normed.size(0), width = normed.size(1);
    at::Tensor logits = at::empty({rows, ends.head_w.size(0)}, normed.options());
    linear_core(normed.data_ptr<float>(), width, rows, width, ends.head_w, ends.head_s, {}, bf16_dot,
                logits.data_ptr<float>());
    return logits;
  }

  // A step it leaves undecided reads the screen and then the whole head: where more than a quarter of recent steps
  // went so (logits whose top crowds: a model with flat outputs, a vocabulary of 10^5 and more with random
  // weights), steps read the whole head, and one in kScreenRetry tries the screen again.
  static constexpr double kScreenMissRate = 0.25, kScreenMemory = 16.0;
  static constexpr int64_t kScreenRetry = 64;
  // Rows x hidden up to which a step takes the screen (beyond one row): its products grow with the rows, the whole
  // head's read does not. The decode loop, alternating, medians: mid (H 256) +17%, +25% and +8% at 2, 4 and 8
  // requests; 120M (H 512) +18% at 2, -4.5% at 4, even at 8.
  static constexpr int64_t kScreenRowsTimesHidden = 1024;

  bool screens_rows(int64_t rows) const {
    if (!ends_.has_value()) return false;
    return rows == 1 ||
           (rows <= GreedyHead::kMaxRows && rows * ends_->norm_weight.size(0) <= kScreenRowsTimesHidden);
  }

  bool screen_this_step() { return screen_misses_ <= kScreenMissRate || ++screen_skipped_ % kScreenRetry == 0; }

  // Each row's argmax of the head's logits into out: through `screen` (null: none) where this step takes it and it
  // decides every row, else from the whole head's logits.
  void head_argmax_into(const GreedyHead* screen, const at::Tensor& normed, int64_t bf16_dot, int64_t* out) {
    if (screen == nullptr || !screen_this_step() || !screened(*screen, normed, bf16_dot, out)) {
      argmax_rows_into(head_logits(normed, bf16_dot), out);
    }
  }

  // Each row's token into out through the screen; false where it left one undecided.
  bool screened(const GreedyHead& screen, const at::Tensor& normed, int64_t bf16_dot, int64_t* out) {
    const int64_t rows = normed.size(0);
    screen.argmax_rows(normed.data_ptr<float>(), normed.size(1), rows, ends_->head_w, bf16_dot, out);
    const bool decided = std::all_of(out, out + rows, [](int64_t token) { return token >= 0; });
    screen_misses_ += ((decided ? 0.0 : 1.0) - screen_misses_) / kScreenMemory;  // a moving average
    return decided;
  }

  // The LM head's GreedyHead, built on the first call that asks (null for a quantized head or one with non-finite
  // values).
  const GreedyHead* screen_of_head() {
    if (!greedy_head_tried_) {
      greedy_head_tried_ = true;
      const Ends& ends = *ends_;
      const auto type = ends.head_w.scalar_type();
      if (!ends.head_s.has_value() && (type == at::kFloat || type == at::kBFloat16)) {
        greedy_head_ = GreedyHead::build(ends.head_w);
      }
    }
    return greedy_head_.get();
  }

  std::tuple<at::Tensor, at::Tensor> run_step(at::Tensor hidden, const Step& step) {
    TORCH_CHECK(!blocks_.empty(), "DecodeLayers holds no blocks");
    OptTensor residual;
    for (const Block& block : blocks_) {
      auto [out, res] = block(hidden, residual, step);
      hidden = std::move(out);
      residual = std::move(res);
    }
    return {hidden, *residual};
  }

  struct Ends {
    at::Tensor embedding, norm_weight;
    double eps;
    at::Tensor head_w;
    OptTensor head_s;
  };

  std::vector<Block> blocks_;
  bool bf16_planes_ = false;
  int64_t planes_bytes_ = 0;
  c10::optional<Ends> ends_;
  std::unique_ptr<GreedyHead> greedy_head_;
  bool greedy_head_tried_ = false;
  double screen_misses_ = 0.0;  // the share of recent screened steps left undecided
  int64_t screen_skipped_ = 0;
};

// Each row's argmax of x [B, K] W^T as linear_rows would give it for runs of up to GreedyHead::kMaxRows rows, through
// a GreedyHead built from W (float32 or bf16 [V, K], unscaled) for this call, a run of rows at a time: -1 where the
// screen leaves a row undecided.
at::Tensor greedy_head_argmax(const at::Tensor& x, const at::Tensor& head_w, int64_t bf16_dot) {
  check_float(x, "x", 2);
  TORCH_CHECK(head_w.dim() == 2 && head_w.size(1) == x.size(1), "the head must be [V, ", x.size(1), "], got ",
              head_w.sizes());
  TORCH_CHECK(head_w.stride(0) == 1 || head_w.stride(1) == 1, "the head must be contiguous along one dimension");
  at::Tensor out = at::full({x.size(0)}, -1, x.options().dtype(at::kLong));
  const std::unique_ptr<GreedyHead> screen = GreedyHead::build(head_w);
  if (screen == nullptr) return out;
  for (int64_t r = 0; r < x.size(0); r += GreedyHead::kMaxRows) {
    const int64_t rows = std::min(GreedyHead::kMaxRows, x.size(0) - r);
    screen->argmax_rows(x.data_ptr<float>() + r * x.stride(0), x.stride(0), rows, head_w, bf16_dot,
                        out.data_ptr<int64_t>() + r);
  }
  return out;
}

}  // namespace sgl_cpu

TORCH_LIBRARY_FRAGMENT(sglang_lite_cpu, m) {
  m.def("greedy_head_argmax(Tensor x, Tensor head_w, int bf16_dot) -> Tensor");
  m.class_<sgl_cpu::DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_gdn", &sgl_cpu::DecodeLayers::add_gdn)
      .def("set_bf16_planes", &sgl_cpu::DecodeLayers::set_bf16_planes)
      .def("bf16_planes_bytes", &sgl_cpu::DecodeLayers::bf16_planes_bytes)
      .def("add_attention", &sgl_cpu::DecodeLayers::add_attention)
      .def("add_moe", &sgl_cpu::DecodeLayers::add_moe)
      .def("add_mlp", &sgl_cpu::DecodeLayers::add_mlp)
      .def("set_ends", &sgl_cpu::DecodeLayers::set_ends)
      .def("run_logits", &sgl_cpu::DecodeLayers::run_logits)
      .def("run_greedy", &sgl_cpu::DecodeLayers::run_greedy)
      .def("head_argmax", &sgl_cpu::DecodeLayers::head_argmax)
      .def("run", &sgl_cpu::DecodeLayers::run)
      .def("run_verify", &sgl_cpu::DecodeLayers::run_verify)
      .def("size", &sgl_cpu::DecodeLayers::size);
  m.def("gdn_decode_block(Tensor hidden, Tensor? residual, Tensor norm_weight, float eps, Tensor qkvz_w, "
        "Tensor? qkvz_s, Tensor ba_w, Tensor? ba_s, Tensor conv_weight, Tensor A_log, Tensor dt_bias, "
        "Tensor gated_norm_w, float gated_norm_eps, Tensor out_w, Tensor? out_s, Tensor(a!) conv_states, "
        "Tensor(b!) ssm_states, Tensor state_slots, int key_heads, int value_heads, int key_dim, int value_dim, "
        "int[] block, int bf16_dot) -> (Tensor, Tensor)");
  m.def("gdn_prefill_block(Tensor hidden, Tensor? residual, Tensor norm_weight, float eps, Tensor qkvz_w, "
        "Tensor? qkvz_s, Tensor ba_w, Tensor? ba_s, Tensor conv_weight, Tensor A_log, Tensor dt_bias, "
        "Tensor gated_norm_w, float gated_norm_eps, Tensor out_w, Tensor? out_s, Tensor(a!) conv_states, "
        "Tensor(b!) ssm_states, Tensor state_slots, int key_heads, int value_heads, int key_dim, int value_dim, "
        "int[] block, int bf16_dot, Tensor cu_seqlens) -> (Tensor, Tensor)");
  m.def("attention_decode_block(Tensor hidden, Tensor? residual, Tensor norm_weight, float eps, Tensor qkv_w, "
        "Tensor? qkv_s, Tensor q_norm_w, Tensor k_norm_w, float head_eps, Tensor o_w, Tensor? o_s, "
        "Tensor cos_sin_cache, int rotary_dim, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor page_table, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor positions, Tensor out_cache_loc, int heads, "
        "int kv_heads, int head_dim, float scale, int page_size, int[] block, int bf16_dot) -> (Tensor, Tensor)");
  m.def("attention_prefill_block(Tensor hidden, Tensor? residual, Tensor norm_weight, float eps, Tensor qkv_w, "
        "Tensor? qkv_s, Tensor q_norm_w, Tensor k_norm_w, float head_eps, Tensor o_w, Tensor? o_s, "
        "Tensor cos_sin_cache, int rotary_dim, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor page_table, "
        "Tensor req_pool_indices, Tensor prefix_lens, Tensor extend_lens, Tensor positions, Tensor out_cache_loc, "
        "int heads, int kv_heads, int head_dim, float scale, int page_size, int[] block, int bf16_dot) "
        "-> (Tensor, Tensor)");
  m.def("moe_decode_block(Tensor hidden, Tensor residual, Tensor norm_weight, float eps, Tensor gate_w, "
        "Tensor shared_gate_w, Tensor w13, Tensor? w13_s, Tensor w2, Tensor? w2_s, Tensor? shared_gate_up_w, "
        "Tensor? shared_gate_up_s, Tensor? shared_down_w, Tensor? shared_down_s, int top_k, int shared_id, "
        "int[] block, int bf16_dot) -> (Tensor, Tensor)");
  m.def("mtp_input_block(Tensor embedded, Tensor hidden, Tensor embed_norm_w, float embed_eps, "
        "Tensor hidden_norm_w, float hidden_eps, Tensor fc_w, Tensor? fc_s, int[] block, int bf16_dot) -> Tensor");
  m.def("rotary_rows(Tensor x, Tensor positions, Tensor cos_sin, int rotary_dim) -> Tensor");
  m.def("sigmoid_gate_rows(Tensor out, Tensor gate) -> Tensor");
  m.def("silu_and_mul_rows(Tensor gate_up) -> Tensor");
  m.def("add_gated_rows(Tensor routed, Tensor shared, Tensor logit) -> Tensor");
  m.def("mlp_decode_block(Tensor hidden, Tensor residual, Tensor norm_weight, float eps, Tensor gate_up_w, "
        "Tensor? gate_up_s, Tensor down_w, Tensor? down_s, int[] block, int bf16_dot) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sglang_lite_cpu, CPU, m) {
  m.impl("greedy_head_argmax", &sgl_cpu::greedy_head_argmax);
  m.impl("gdn_decode_block", &sgl_cpu::gdn_decode_block);
  m.impl("gdn_prefill_block", &sgl_cpu::gdn_prefill_block);
  m.impl("attention_decode_block", &sgl_cpu::attention_decode_block);
  m.impl("attention_prefill_block", &sgl_cpu::attention_prefill_block);
  m.impl("moe_decode_block", &sgl_cpu::moe_decode_block);
  m.impl("mlp_decode_block", &sgl_cpu::mlp_decode_block);
  m.impl("mtp_input_block", &sgl_cpu::mtp_input_block);
  m.impl("rotary_rows", &sgl_cpu::rotary_rows);
  m.impl("sigmoid_gate_rows", &sgl_cpu::sigmoid_gate_rows);
  m.impl("silu_and_mul_rows", &sgl_cpu::silu_and_mul_rows);
  m.impl("add_gated_rows", &sgl_cpu::add_gated_rows);
}

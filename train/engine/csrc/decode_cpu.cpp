// Native CPU kernels for generation with Cascade's policy (train/model/modeling.py): prefill and
// decoding steps, and sampling.
//
// On CPU, generation with a small model is dominated by per-operator overhead: a Qwen3(-MoE) layer
// is ~80 small ATen calls from Python. These ops run a whole attention block, MoE block or dense MLP
// block for a set of new tokens in one call: the matrix products stay in ATen (MKL/oneDNN), the glue
// (norms, q/k norm + RoPE, KV-cache writes, masked attention, routing, expert grouping, weighted
// combine) is vectorised loops. Math and order of operations follow the Python model, in fp32.
//
// Built at first use by train/engine/native.py (torch.utils.cpp_extension); registered as
// torch.ops.cascade_native.{attn_block, moe_block, mlp_block, sample_rows} and, for ZAYA1 decoding steps,
// {zaya_attn_step, zaya_moe_step}.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// y = w * (x / sqrt(mean(x^2) + eps)) over n elements (F.rms_norm, then the weight).
inline void rms_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

at::Tensor rms_rows(const at::Tensor& x, const at::Tensor& w, float eps) {
  const int64_t B = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) rms_row(xp + b * H, wp, yp + b * H, H, eps);
  return y;
}

// q/k norm (w == nullptr: none, as Qwen2 and Llama) then rotary embedding (HF half-rotation layout):
// out = x*cos + rotate_half(x)*sin.
inline void norm_rope(const float* x, const float* w, const float* cos, const float* sin, float* out,
                      int64_t d, float eps, float scale) {
  float tmp[1024];
  if (w != nullptr)
    rms_row(x, w, tmp, d, eps);
  else
    for (int64_t c = 0; c < d; ++c) tmp[c] = x[c];
  const int64_t h = d / 2;
  for (int64_t c = 0; c < h; ++c) {
    out[c] = (tmp[c] * cos[c] + (-tmp[c + h]) * sin[c]) * scale;
    out[c + h] = (tmp[c + h] * cos[c + h] + tmp[c] * sin[c + h]) * scale;
  }
}

// Attention inner loops over one (row, kv head): head sizes 16/32/64/128/256 use explicit 16-float
// vectors (GCC/Clang vector extensions: AVX-512 registers where the CPU has them, narrower
// otherwise) with accumulators kept in registers; other sizes take the plain loops.
typedef float vf __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline vf loadv(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(vf v) {
  const vf8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

typedef int32_t vi __attribute__((vector_size(64)));

// exp of 16 floats (Cephes expf: range reduction by ln 2, degree-6 polynomial, about 1 ulp);
// exactly 0 below -87.3 (so -inf, a masked score, gives a weight of 0).
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.3f, hi = vf{} + 88.3f;
  const vi under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;  // n = floor(x / ln 2 + 1/2)
  vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);  // truncated toward zero
  n = n > fx ? n - 1.0f : n;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  const vf out = y * scale;
  return under ? vf{} : out;
}

// x[0:n] = exp(x[0:n] - m); returns their sum
inline float exp_shift_sum(float* x, int64_t n, float m) {
  vf acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf e = vexp(loadv(x + i) - m);
    __builtin_memcpy(x + i, &e, sizeof e);
    acc += e;
  }
  float sum = hsum(acc);
  if (i < n) {
    vf tail = vf{} - std::numeric_limits<float>::infinity();
    __builtin_memcpy(&tail, x + i, (n - i) * sizeof(float));
    const vf e = vexp(tail - m);
    __builtin_memcpy(x + i, &e, (n - i) * sizeof(float));
    sum += hsum(e);
  }
  return sum;
}

// softmax of x[0:n] in place (at least one finite entry)
inline void softmax_inplace(float* x, int64_t n) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  const float inv = 1.0f / exp_shift_sum(x, n, m);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// out[t] = q . k[t] for t < T (k rows of D floats); hidden slots (visible[t] false) get -inf
template <int D>
void dots_fixed(const float* q, const float* k, int64_t T, const bool* visible, float* out) {
  constexpr int NV = D / 16;
  vf qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = loadv(q + 16 * i);
  for (int64_t t = 0; t < T; ++t) {
    const float* kt = k + t * D;
    vf acc = qv[0] * loadv(kt);
    for (int i = 1; i < NV; ++i) acc += qv[i] * loadv(kt + 16 * i);
    out[t] = visible[t] ? hsum(acc) : -std::numeric_limits<float>::infinity();
  }
}

void dots(const float* q, const float* k, int64_t T, int64_t d, const bool* visible, float* out) {
  switch (d) {
    case 16: return dots_fixed<16>(q, k, T, visible, out);
    case 32: return dots_fixed<32>(q, k, T, visible, out);
    case 64: return dots_fixed<64>(q, k, T, visible, out);
    case 128: return dots_fixed<128>(q, k, T, visible, out);
    case 256: return dots_fixed<256>(q, k, T, visible, out);
    default: break;
  }
  for (int64_t t = 0; t < T; ++t) {
    float acc = 0.f;
    for (int64_t e = 0; e < d; ++e) acc += q[e] * k[t * d + e];
    out[t] = visible[t] ? acc : -std::numeric_limits<float>::infinity();
  }
}

// out = sum_t p[t] * v[t] (v rows of D floats); two accumulator sets over t hide the FMA latency
template <int D>
void weighted_sum_fixed(const float* p, const float* v, int64_t T, float* out) {
  constexpr int NV = D / 16;
  vf a0[NV] = {}, a1[NV] = {};
  int64_t t = 0;
  for (; t + 1 < T; t += 2) {
    const float w0 = p[t], w1 = p[t + 1];
    const float *v0 = v + t * D, *v1 = v0 + D;
    for (int i = 0; i < NV; ++i) {
      a0[i] += w0 * loadv(v0 + 16 * i);
      a1[i] += w1 * loadv(v1 + 16 * i);
    }
  }
  if (t < T)
    for (int i = 0; i < NV; ++i) a0[i] += p[t] * loadv(v + t * D + 16 * i);
  for (int i = 0; i < NV; ++i) {
    const vf s = a0[i] + a1[i];
    __builtin_memcpy(out + 16 * i, &s, sizeof s);
  }
}

void weighted_sum(const float* p, const float* v, int64_t T, int64_t d, float* out) {
  switch (d) {
    case 16: return weighted_sum_fixed<16>(p, v, T, out);
    case 32: return weighted_sum_fixed<32>(p, v, T, out);
    case 64: return weighted_sum_fixed<64>(p, v, T, out);
    case 128: return weighted_sum_fixed<128>(p, v, T, out);
    case 256: return weighted_sum_fixed<256>(p, v, T, out);
    default: break;
  }
  for (int64_t e = 0; e < d; ++e) out[e] = 0.f;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < d; ++e) out[e] += p[t] * v[t * d + e];
}

// x + o_proj(attention(q_norm/k_norm/RoPE(qkv_proj(rms(x))))) for N new tokens: token n belongs to
// batch row rows[n] and sits at cache slot slots[n] (one token per row when decoding; a row's prompt
// tokens when prefilling). First every token's key and value are written to the cache, then each
// token attends to the keys of its row at slots <= its own where `valid` (its own slot always).
// x [N, H]; wqkv [(hq+2hk)*d, H]; cos/sin [N, d]; kc, vc [B, hk, cap, d]; valid [B, cap] bool.
// One (query row, kv head) against the cache: the g query heads of kv head j (queries at q, heads
// of width d, hq per row) attend to the first Tk slots of the cache row (kbase, vbase: [cap, d]) that
// are valid in vrow, the current slot always; outputs at out. score and vis hold >= Tk entries.
inline void attend_kv_head(const float* q, const float* kbase, const float* vbase, const bool* vrow, int64_t Tk,
                           int64_t slot, int64_t d, int64_t g, int64_t j, float* out, float* score, char* vis) {
  for (int64_t t = 0; t < Tk; ++t) vis[t] = vrow[t];
  vis[slot] = 1;
  for (int64_t gi = 0; gi < g; ++gi) {
    const int64_t head = j * g + gi;
    dots(q + head * d, kbase, Tk, d, reinterpret_cast<const bool*>(vis), score);
    softmax_inplace(score, Tk);
    weighted_sum(score, vbase, Tk, d, out + head * d);
  }
}

// Attention when the first `shared` cache slots hold the same keys and values in every row, all valid
// (a prefix computed once and copied to every row: train/engine/prefix_cache.py), and every token sits
// at a slot >= shared. The shared part is done for all tokens at once, per kv head, as two matrix
// products against row 0's copy (Hydragen-style: the prefix is read once, not once per row); each
// token's own slots shared..slot as in attend_kv_head; one softmax over both parts. q [N, hq, d]
// (pre-scaled); out [N, hq * d].
void shared_prefix_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const bool* vp,
                             const int64_t* row_of, const int64_t* slot_of, int64_t N, int64_t hk, int64_t g,
                             int64_t d, int64_t cap, int64_t shared, at::Tensor& out) {
  const int64_t hq = hk * g;
  // scores against the shared keys: per kv head j, [N * g, shared] (rows: token n, head j*g + gi)
  at::Tensor qg = q.view({N, hk, g, d}).permute({1, 0, 2, 3}).reshape({hk, N * g, d});
  at::Tensor kp = kc.select(0, 0).narrow(1, 0, shared);  // [hk, shared, d]
  at::Tensor vsh = vc.select(0, 0).narrow(1, 0, shared);
  at::Tensor sp = at::bmm(qg, kp.transpose(1, 2)).contiguous();  // [hk, N * g, shared]
  float* spp = sp.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float *kcp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t max_own = 1;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(slot_of[n] >= shared, "attn_block: token ", n, " at slot ", slot_of[n], " inside the shared prefix (",
                shared, " slots)");
    max_own = std::max(max_own, slot_of[n] - shared + 1);
  }
  // own slots: scores, then one softmax over shared + own scores; the own part's weighted sum into out
  at::parallel_for(0, N * hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(max_own);
    std::vector<char> vis(max_own);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t n = it / hk, j = it % hk, b = row_of[n], slot = slot_of[n], T = slot - shared + 1;
      const bool* vrow = vp + b * cap + shared;
      for (int64_t t = 0; t < T; ++t) vis[t] = vrow[t];
      vis[T - 1] = 1;
      const float* kbase = kcp + ((b * hk + j) * cap + shared) * d;
      const float* vbase = vcp + ((b * hk + j) * cap + shared) * d;
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t head = j * g + gi;
        float* srow = spp + (j * N * g + n * g + gi) * shared;
        dots(qp + (n * hq + head) * d, kbase, T, d, reinterpret_cast<const bool*>(vis.data()), score.data());
        float m = srow[0];
        for (int64_t t = 1; t < shared; ++t) m = std::max(m, srow[t]);
        for (int64_t t = 0; t < T; ++t) m = std::max(m, score[t]);
        const float inv = 1.0f / (exp_shift_sum(srow, shared, m) + exp_shift_sum(score.data(), T, m));
        for (int64_t t = 0; t < shared; ++t) srow[t] *= inv;
        for (int64_t t = 0; t < T; ++t) score[t] *= inv;
        weighted_sum(score.data(), vbase, T, d, op + (n * hq + head) * d);
      }
    }
  });
  // plus the shared values weighted by their probabilities, per kv head as one matrix product
  at::Tensor o = out.view({N, hk, g, d});
  o.add_(at::bmm(sp, vsh).view({hk, N, g, d}).permute({1, 0, 2, 3}));
}

at::Tensor attn_block(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& wqkv,
                      const c10::optional<at::Tensor>& bqkv, const c10::optional<at::Tensor>& qn_w,
                      const c10::optional<at::Tensor>& kn_w,
                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kc, const at::Tensor& vc,
                      const at::Tensor& valid, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& wo,
                      const c10::optional<at::Tensor>& bo, int64_t hq, int64_t hk, double eps_d, int64_t shared) {
  for (const at::Tensor* t : {&x, &ln_w, &wqkv, &cos, &sin, &kc, &vc, &wo}) check_f32(*t, "attn_block tensor");
  const bool qk_norm = qn_w.has_value() && qn_w->defined();
  TORCH_CHECK(qk_norm == (kn_w.has_value() && kn_w->defined()), "attn_block: q_norm and k_norm weights go together");
  if (qk_norm) {
    check_f32(*qn_w, "attn_block q_norm");
    check_f32(*kn_w, "attn_block k_norm");
  }
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous(), "valid must be a contiguous bool tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && rows.is_contiguous() &&
              slots.is_contiguous(), "rows and slots must be contiguous int64 tensors");
  const float eps = static_cast<float>(eps_d);
  const int64_t N = x.size(0), B = kc.size(0), d = kc.size(3), cap = kc.size(2), g = hq / hk;
  TORCH_CHECK(hq % hk == 0 && kc.size(1) == hk && d <= 1024 && d % 2 == 0, "attn_block: bad head layout");
  TORCH_CHECK(rows.numel() == N && slots.numel() == N && valid.size(0) == B && valid.size(1) == cap,
              "attn_block: rows/slots/valid do not match the cache");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  int64_t max_slot = 0;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(row_of[n] >= 0 && row_of[n] < B && slot_of[n] >= 0 && slot_of[n] < cap, "attn_block: token ", n, " at row ", row_of[n],
                " slot ", slot_of[n], " is outside the cache [", B, ", ", cap, "]");
    max_slot = std::max(max_slot, slot_of[n]);
  }
  const int64_t width = (hq + 2 * hk) * d;
  at::Tensor h = rms_rows(x, ln_w, eps);
  at::Tensor qkv = bqkv.has_value() && bqkv->defined() ? at::addmm(*bqkv, h, wqkv.t()) : at::mm(h, wqkv.t());
  at::Tensor q = at::empty({N, hq, d}, x.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float *qkvp = qkv.data_ptr<float>(), *qnw = qk_norm ? qn_w->data_ptr<float>() : nullptr,
              *knw = qk_norm ? kn_w->data_ptr<float>() : nullptr;
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  float *kcp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>(), *qp = q.data_ptr<float>();
  // 1. queries (normed, rotated, pre-scaled), and the new keys and values into the cache
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = qkvp + n * width;
      const float *c = cp + n * d, *sn = snp + n * d;
      for (int64_t head = 0; head < hq; ++head)
        norm_rope(row + head * d, qnw, c, sn, qp + (n * hq + head) * d, d, eps, scale);
      for (int64_t j = 0; j < hk; ++j) {
        const int64_t off = ((row_of[n] * hk + j) * cap + slot_of[n]) * d;
        norm_rope(row + (hq + j) * d, knw, c, sn, kcp + off, d, eps, 1.0f);
        const float* vnew = row + (hq + hk + j) * d;
        for (int64_t e = 0; e < d; ++e) vcp[off + e] = vnew[e];
      }
    }
  });
  // 2. per (token, kv head): scores of its query heads, softmax, weighted sum of the values
  at::Tensor attn = at::empty({N, hq * d}, x.options());
  float* ap = attn.data_ptr<float>();
  if (shared > 0) {
    shared_prefix_attention(q, kc, vc, vp, row_of, slot_of, N, hk, g, d, cap, shared, attn);
    at::Tensor res = bo.has_value() && bo->defined() ? x + *bo : x;
    return at::addmm(res, attn, wo.t());
  }
  at::parallel_for(0, N * hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(max_slot + 1);
    std::vector<char> vis(max_slot + 1);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t n = it / hk, j = it % hk, b = row_of[n], slot = slot_of[n];
      attend_kv_head(qp + n * hq * d, kcp + (b * hk + j) * cap * d, vcp + (b * hk + j) * cap * d, vp + b * cap,
                     slot + 1, slot, d, g, j, ap + n * hq * d, score.data(), vis.data());
    }
  });
  at::Tensor res = bo.has_value() && bo->defined() ? x + *bo : x;
  return at::addmm(res, attn, wo.t());
}

// x + SparseMoE(rms(x)): softmax router, top-k (optionally renormalised), experts gate_up [E, 2I, H]
// and down [E, H, I] applied to the tokens routed to each, outputs combined with the router weights.
// `routed` (optional, int64 [B, top_k]) receives each token's expert ids, highest weight first (the
// order of torch.topk), for router replay.
// Expert e's rows [start[e], start[e+1]) of the grouped tokens xe: gate/up product, silu(gate) * up,
// down product, into hb [N, 2I] and yb [N, H] (rows grouped by expert).
inline void expert_rows(const at::Tensor& xe, const at::Tensor& hb, const at::Tensor& yb, const at::Tensor& gate_up,
                        const at::Tensor& down, const std::vector<int64_t>& start, int64_t e, int64_t I) {
  const int64_t s = start[e], n = start[e + 1] - s;
  if (!n) return;
  at::Tensor h_e = hb.narrow(0, s, n), y_e = yb.narrow(0, s, n);
  at::mm_out(h_e, xe.narrow(0, s, n), gate_up[e].t());
  at::Tensor act = at::silu(h_e.narrow(1, 0, I)).mul_(h_e.narrow(1, I, I));
  at::mm_out(y_e, act, down[e].t());
}

// Every expert's rows (expert_rows), E experts over N grouped rows: one after another on one thread or
// when the products are large enough to use all threads each; otherwise small products scale poorly
// across threads, so experts run in parallel, one thread each, dealt to threads largest first so that
// each thread gets about the same number of rows.
void all_experts(const at::Tensor& xe, const at::Tensor& hb, const at::Tensor& yb, const at::Tensor& gate_up,
                 const at::Tensor& down, const std::vector<int64_t>& start, int64_t E, int64_t N, int64_t I) {
  auto expert = [&](int64_t e) { expert_rows(xe, hb, yb, gate_up, down, start, e, I); };
  const int64_t threads = at::get_num_threads();
  if (threads == 1 || N >= 256 * E) {
    for (int64_t e = 0; e < E; ++e) expert(e);
    return;
  }
  std::vector<int64_t> by_size(E);
  for (int64_t e = 0; e < E; ++e) by_size[e] = e;
  std::sort(by_size.begin(), by_size.end(),
            [&](int64_t a, int64_t b) { return start[a + 1] - start[a] > start[b + 1] - start[b]; });
  std::vector<std::vector<int64_t>> bins(threads);
  std::vector<int64_t> load(threads, 0);
  for (int64_t e : by_size) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    bins[t].push_back(e);
    load[t] += start[e + 1] - start[e];
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's grad mode
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t e : bins[t]) expert(e);
  });
}

at::Tensor moe_block(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& router_w,
                     const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k, bool norm_topk,
                     double eps_d, const c10::optional<at::Tensor>& routed) {
  for (const at::Tensor* t : {&x, &ln_w, &router_w, &gate_up, &down}) check_f32(*t, "moe_block tensor");
  const int64_t B = x.size(0), H = x.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_block: top_k ", top_k, " with ", E, " experts");
  const bool record = routed.has_value() && routed->defined();
  if (record)
    TORCH_CHECK(routed->device().is_cpu() && routed->scalar_type() == at::kLong && routed->is_contiguous() &&
                    routed->dim() == 2 && routed->size(0) == B && routed->size(1) == top_k,
                "moe_block: routed must be a contiguous int64 CPU tensor [", B, ", ", top_k, "]");
  at::Tensor h = rms_rows(x, ln_w, static_cast<float>(eps_d));
  at::Tensor logits = at::mm(h, router_w.t()).contiguous();
  const float* lp = logits.data_ptr<float>();
  const int64_t N = B * top_k;
  std::vector<int64_t> idx(N);
  std::vector<float> wt(N), probs(E);
  std::vector<char> taken(E);
  for (int64_t b = 0; b < B; ++b) {
    const float* l = lp + b * E;
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(l[e] - m));
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    float tot = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {  // highest first, lowest index among equals
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      idx[b * top_k + k] = best;
      tot += (wt[b * top_k + k] = probs[best]);
    }
    if (norm_topk)
      for (int64_t k = 0; k < top_k; ++k) wt[b * top_k + k] /= tot;
  }
  if (record) std::copy(idx.begin(), idx.end(), routed->data_ptr<int64_t>());
  // (token, choice) pairs grouped by expert, in token order within an expert (a stable sort)
  std::vector<int64_t> start(E + 1, 0), order(N);
  for (int64_t i = 0; i < N; ++i) ++start[idx[i] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < N; ++i) order[cursor[idx[i]]++] = i;
  at::Tensor tokens = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t p = 0; p < N; ++p) tp[p] = order[p] / top_k;
  at::Tensor xe = h.index_select(0, tokens);
  at::Tensor hb = at::empty({N, 2 * I}, x.options());
  at::Tensor yb = at::empty({N, H}, x.options());
  all_experts(xe, hb, yb, gate_up, down, start, E, N, I);
  at::Tensor moe = at::zeros_like(x);
  float* mp = moe.data_ptr<float>();
  const float* yp = yb.data_ptr<float>();
  for (int64_t p = 0; p < N; ++p) {
    const float w = wt[order[p]];
    float* dst = mp + tp[p] * H;
    const float* src = yp + p * H;
    for (int64_t c = 0; c < H; ++c) dst[c] += w * src[c];
  }
  return x + moe;
}

// x + down(silu(gate(rms(x))) * up(rms(x))) with gate and up stacked: w_gate_up [2I, H].
at::Tensor mlp_block(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& w_gate_up,
                     const at::Tensor& w_down, double eps_d) {
  for (const at::Tensor* t : {&x, &ln_w, &w_gate_up, &w_down}) check_f32(*t, "mlp_block tensor");
  const int64_t I = w_gate_up.size(0) / 2;
  at::Tensor h = rms_rows(x, ln_w, static_cast<float>(eps_d));
  at::Tensor gu = at::mm(h, w_gate_up.t());
  at::Tensor act = at::silu(gu.narrow(1, 0, I)).mul_(gu.narrow(1, I, I));
  return at::addmm(x, act, w_down.t());
}

// One token per row of logits [B, V] from softmax(logits / temperature), by inverse transform of
// the uniform u[b] in [0, 1): the first token whose running probability mass reaches u * total
// (the token probabilities summed in blocks of 16, then within the block). Returns the tokens and
// their log-probabilities under softmax(logits / temperature) (what train/engine/sampling.py's
// untruncated path computes; rounding of the running sums differs).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, double temperature, const at::Tensor& u) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && u.dim() == 1 && u.size(0) == logits.size(0), "sample_rows: logits [B, V], u [B]");
  TORCH_CHECK(temperature > 0, "sample_rows: temperature must be > 0");
  TORCH_CHECK(logits.size(1) > 0, "sample_rows: empty vocabulary");
  const at::Tensor uf = u.to(at::kDouble).contiguous();
  const int64_t B = logits.size(0), V = logits.size(1), nb = (V + 15) / 16;
  at::Tensor tok = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor logp = at::empty({B}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const double* up = uf.data_ptr<double>();
  int64_t* tp = tok.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  const float temp = static_cast<float>(temperature);
  at::parallel_for(0, B, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> xs(nb * 16), e(nb * 16);
    std::vector<double> block(nb);
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = lp + r * V;
      for (int64_t i = 0; i < V; ++i) xs[i] = l[i] / temp;
      for (int64_t i = V; i < nb * 16; ++i) xs[i] = -std::numeric_limits<float>::infinity();
      vf mv = loadv(xs.data());
      for (int64_t k = 1; k < nb; ++k) {
        const vf v = loadv(xs.data() + 16 * k);
        mv = v > mv ? v : mv;
      }
      float m = mv[0];
      for (int i = 1; i < 16; ++i) m = std::max(m, mv[i]);
      double total = 0.0;  // running sums in double: fewer draws land on a rounding boundary
      for (int64_t k = 0; k < nb; ++k) {
        const vf ev = vexp(loadv(xs.data() + 16 * k) - m);
        __builtin_memcpy(e.data() + 16 * k, &ev, sizeof ev);
        total += (block[k] = hsum(ev));
      }
      const double target = up[r] * total;
      int64_t pick = -1;
      double run = 0.0;
      for (int64_t k = 0; k < nb && pick < 0; ++k) {
        if (run + block[k] < target && k + 1 < nb) {
          run += block[k];
          continue;
        }
        for (int64_t i = 16 * k; i < std::min(V, 16 * k + 16); ++i) {
          run += e[i];
          if (e[i] > 0.f && run >= target) {
            pick = i;
            break;
          }
        }
      }
      if (pick < 0)  // rounding left the target above the summed mass: the last token with mass
        for (int64_t i = V - 1; i >= 0 && pick < 0; --i)
          if (e[i] > 0.f) pick = i;
      if (pick < 0)  // no finite logit at all (a NaN or all -inf row): token 0, a NaN logprob
        pick = 0;
      tp[r] = pick;
      op[r] = (xs[pick] - m) - std::log(total);
    }
  });
  return {tok, logp};
}


// ---- ZAYA1 (train/model/zaya.py): one decoding step (one new token per batch row) ---------------

// Residual scaling in place: out = (out + rs[1]) * rs[0] + (x + rs[3]) * rs[2] (rs [4, H]:
// hidden_states_scale, hidden_states_bias, residual_scale, residual_bias).
void residual_scaling(float* out, const float* x, const float* rs, int64_t B, int64_t H) {
  const float *hs = rs, *hb = rs + H, *rsc = rs + 2 * H, *rb = rs + 3 * H;
  for (int64_t b = 0; b < B; ++b) {
    float* o = out + b * H;
    const float* xr = x + b * H;
#pragma omp simd
    for (int64_t c = 0; c < H; ++c) o[c] = (o[c] + hb[c]) * hs[c] + (xr[c] + rb[c]) * rsc[c];
  }
}

// The grouped conv of ZAYA1's CCA for n rows (n a multiple of 4): dcv [n, k1, C] (the depthwise
// conv's k1 outputs per channel), w [G, k1, d_in, d_out], bias [C] -> qk [n, C] (C = G * d). Head
// sizes 16/32/64: four rows at a time with the accumulators in registers.
template <int D>
void grouped_conv_fixed(const float* dcv, const float* w, const float* bias, float* qk, int64_t n, int64_t G,
                        int64_t k1) {
  constexpr int NV = D / 16;
  const int64_t C = G * D, stride = k1 * C;
  for (int64_t gr = 0; gr < G; ++gr)
    for (int64_t b0 = 0; b0 < n; b0 += 4) {
      vf acc[4][NV] = {};
      for (int64_t t = 0; t < k1; ++t)
        for (int64_t ci = 0; ci < D; ++ci) {
          const float* wr = w + ((gr * k1 + t) * D + ci) * D;
          vf wv[NV];
          for (int i = 0; i < NV; ++i) wv[i] = loadv(wr + 16 * i);
          const int64_t col = t * C + gr * D + ci;
          for (int r = 0; r < 4; ++r) {
            const float a = dcv[(b0 + r) * stride + col];
            for (int i = 0; i < NV; ++i) acc[r][i] += a * wv[i];
          }
        }
      for (int r = 0; r < 4; ++r)
        for (int i = 0; i < NV; ++i) {
          const vf s = acc[r][i] + loadv(bias + gr * D + 16 * i);
          __builtin_memcpy(qk + (b0 + r) * C + gr * D + 16 * i, &s, sizeof s);
        }
    }
}

void grouped_conv(const float* dcv, const float* w, const float* bias, float* qk, int64_t n, int64_t G, int64_t k1,
                  int64_t d) {
  switch (d) {
    case 16: return grouped_conv_fixed<16>(dcv, w, bias, qk, n, G, k1);
    case 32: return grouped_conv_fixed<32>(dcv, w, bias, qk, n, G, k1);
    case 64: return grouped_conv_fixed<64>(dcv, w, bias, qk, n, G, k1);
    default: break;
  }
  const int64_t C = G * d;
  std::vector<float> acc(d);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t gr = 0; gr < G; ++gr) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < k1; ++t)
        for (int64_t ci = 0; ci < d; ++ci) {
          const float a = dcv[(b * k1 + t) * C + gr * d + ci];
          const float* wr = w + ((gr * k1 + t) * d + ci) * d;
          for (int64_t o = 0; o < d; ++o) acc[o] += a * wr[o];
        }
      for (int64_t o = 0; o < d; ++o) qk[b * C + gr * d + o] = acc[o] + bias[gr * d + o];
    }
}

// x_next = RS(x, o_proj(CCA attention(rms(x)))) for one new token per row, written at cache slot
// `slot` of every row (decoding: all rows share the write position). wproj [hq*d + 2*hk*d, H]: q, k,
// current and delayed value projections stacked; conv_state [B, C, K] (C = (hq+hk)*d, K = k0+k1-2;
// absent when K == 0) and vstate [B, hk*d/2] are read and updated in place; dw_w [k0, C], dw_b [C]:
// the depthwise conv (taps first); gw_w [G, k1, d_in, d_out], gw_b [C]: the grouped conv (one group
// of d channels per head, G = hq + hk; conv1d's weight [C, d_in, k1] permuted);
// qk_scale [hq+hk]: each head's scale after L2 normalisation (sqrt(d), times the key temperature for
// key heads); cos/sin [B, rd] (RoPE on the first rd dims of each head); rs [4, H] residual scaling.
at::Tensor zaya_attn_step(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& wproj,
                          const c10::optional<at::Tensor>& bproj, const c10::optional<at::Tensor>& conv_state,
                          const at::Tensor& dw_w, const at::Tensor& dw_b, const at::Tensor& gw_w,
                          const at::Tensor& gw_b, const at::Tensor& vstate, const at::Tensor& qk_scale,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kc, const at::Tensor& vc,
                          const at::Tensor& valid, int64_t slot, const at::Tensor& wo,
                          const c10::optional<at::Tensor>& bo, const at::Tensor& rs, int64_t hq, int64_t hk,
                          double eps_d) {
  for (const at::Tensor* t : {&x, &ln_w, &wproj, &dw_w, &dw_b, &gw_w, &gw_b, &vstate, &qk_scale, &cos, &sin, &kc,
                              &vc, &wo, &rs})
    check_f32(*t, "zaya_attn_step tensor");
  const bool has_bproj = bproj.has_value() && bproj->defined(), has_bo = bo.has_value() && bo->defined();
  if (has_bproj) check_f32(*bproj, "zaya_attn_step bproj");
  if (has_bo) check_f32(*bo, "zaya_attn_step bo");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous(), "valid must be a contiguous bool tensor");
  const int64_t B = x.size(0), H = x.size(1), d = kc.size(3), cap = kc.size(2);
  TORCH_CHECK(hk > 0 && hq % hk == 0 && kc.size(0) == B && kc.size(1) == hk && vc.sizes() == kc.sizes() &&
                  d % 2 == 0 && d <= 1024,
              "zaya_attn_step: bad head layout");
  const int64_t g = hq / hk, G = hq + hk, C = G * d, half = hk * d / 2, P = hq * d + 2 * hk * d;
  TORCH_CHECK(dw_w.dim() == 2 && gw_w.dim() == 4, "zaya_attn_step: dw_w [k0, C], gw_w [G, k1, d, d]");
  const int64_t k0 = dw_w.size(0), k1 = gw_w.size(1), K = k0 + k1 - 2, rd = cos.size(1);
  TORCH_CHECK(wproj.size(0) == P && wproj.size(1) == H && dw_w.size(1) == C && dw_b.numel() == C &&
                  gw_w.size(0) == G && gw_w.size(2) == d && gw_w.size(3) == d && gw_b.numel() == C &&
                  qk_scale.numel() == G &&
                  vstate.size(0) == B && vstate.numel() == B * half && cos.size(0) == B && sin.sizes() == cos.sizes() &&
                  rd % 2 == 0 && rd <= d && rs.size(0) == 4 && rs.size(1) == H && wo.size(1) == hq * d,
              "zaya_attn_step: shapes do not match");
  TORCH_CHECK(slot >= 0 && slot < cap && valid.size(0) == B && valid.size(1) == cap, "zaya_attn_step: slot ", slot,
              " outside the cache [", B, ", ", cap, "]");
  const bool has_state = conv_state.has_value() && conv_state->defined();
  TORCH_CHECK(has_state == (K > 0), "zaya_attn_step: a convolution state goes with a look-back K > 0");
  float* sp = nullptr;
  if (has_state) {
    check_f32(*conv_state, "zaya_attn_step conv_state");
    TORCH_CHECK(conv_state->size(0) == B && conv_state->size(1) == C && conv_state->size(2) == K,
                "zaya_attn_step: conv_state must be [B, C, K]");
    sp = conv_state->data_ptr<float>();
  }
  const float eps = static_cast<float>(eps_d);
  const float norm_eps = std::numeric_limits<float>::epsilon();  // F.normalize's eps in QKNorm (fp32)
  at::Tensor h = rms_rows(x, ln_w, eps);
  at::Tensor proj = has_bproj ? at::addmm(*bproj, h, wproj.t()) : at::mm(h, wproj.t());
  const float *pp = proj.data_ptr<float>(), *dww = dw_w.data_ptr<float>(), *dwb = dw_b.data_ptr<float>(),
              *gww = gw_w.data_ptr<float>(), *gwb = gw_b.data_ptr<float>(), *qs = qk_scale.data_ptr<float>(),
              *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *vsp = vstate.data_ptr<float>(), *kcp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>();
  at::Tensor q = at::empty({B, hq, d}, x.options());
  float* qp = q.data_ptr<float>();
  const float qscale = 1.0f / std::sqrt(static_cast<float>(d));
  // 1. per row: the convolutions over (state, new column), residual paths, q/k norm + RoPE; the new
  // key and value into the cache; the states moved on by one column
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin, n4 = (n + 3) / 4 * 4;
    std::vector<float> colT((K + 1) * C), dcv(n4 * k1 * C, 0.f), qk_all(n4 * C), qr(hq * d), kr(hk * d), head(d);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = pp + b * P;
      const float *xq = row, *xk = row + hq * d;
      // the K + 1 columns [K + 1, C] (the state's, then the new one); the state moves on by one column
      float* st = has_state ? sp + b * C * K : nullptr;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t i = 0; i < K; ++i) colT[i * C + c] = st[c * K + i];
      std::copy(xq, xq + hq * d, colT.data() + K * C);
      std::copy(xk, xk + hk * d, colT.data() + K * C + hq * d);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t i = 0; i < K; ++i) st[c * K + i] = colT[(i + 1) * C + c];
      // depthwise conv: k1 outputs per channel, [k1, C] per row
      for (int64_t l = 0; l < k1; ++l) {
        float* out = dcv.data() + ((b - begin) * k1 + l) * C;
        std::fill(out, out + C, 0.f);
        for (int64_t i = 0; i < k0; ++i) {
          const float *in = colT.data() + (l + i) * C, *w = dww + i * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) out[c] += in[c] * w[c];
        }
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) out[c] = dwb[c] + out[c];
      }
    }
    grouped_conv(dcv.data(), gww, gwb, qk_all.data(), n4, G, k1, d);
    for (int64_t b = begin; b < end; ++b) {
      const float* row = pp + b * P;
      const float *xq = row, *xk = row + hq * d, *vcur = row + (hq + hk) * d, *vdel = vcur + half;
      const float* qk = qk_all.data() + (b - begin) * C;
      for (int64_t hh = 0; hh < hq; ++hh)  // residual paths: (q + its group's k) / 2, keys their group mean
        for (int64_t e = 0; e < d; ++e) qr[hh * d + e] = (xq[hh * d + e] + xk[(hh / g) * d + e]) * 0.5f;
      for (int64_t j = 0; j < hk; ++j)
        for (int64_t e = 0; e < d; ++e) {
          float s = 0.f;
          for (int64_t gi = 0; gi < g; ++gi) s += qr[(j * g + gi) * d + e];
          kr[j * d + e] = s / static_cast<float>(g);
        }
      const float *c_ = cp + b * rd, *sn = snp + b * rd;
      for (int64_t hh = 0; hh < G; ++hh) {
        const float* res = hh < hq ? qr.data() + hh * d : kr.data() + (hh - hq) * d;
        float ss = 0.f;
        for (int64_t e = 0; e < d; ++e) {
          head[e] = qk[hh * d + e] + res[e];
          ss += head[e] * head[e];
        }
        const float nrm = std::max(std::sqrt(ss), norm_eps);
        for (int64_t e = 0; e < d; ++e) head[e] = head[e] / nrm * qs[hh];
        float* out = hh < hq ? qp + (b * hq + hh) * d : kcp + ((b * hk + (hh - hq)) * cap + slot) * d;
        const float sc = hh < hq ? qscale : 1.0f;  // queries pre-scaled for the dot products
        const int64_t r2 = rd / 2;
        for (int64_t e = 0; e < r2; ++e) {
          out[e] = (head[e] * c_[e] + (-head[e + r2]) * sn[e]) * sc;
          out[e + r2] = (head[e + r2] * c_[e + r2] + head[e] * sn[e + r2]) * sc;
        }
        for (int64_t e = rd; e < d; ++e) out[e] = head[e] * sc;
      }
      // value: the current projection, then the previous token's delayed one; heads of d over both
      float* vs = vsp + b * half;
      for (int64_t j = 0; j < hk; ++j) {
        float* dst = vcp + ((b * hk + j) * cap + slot) * d;
        for (int64_t e = 0; e < d; ++e) {
          const int64_t i = j * d + e;
          dst[e] = i < half ? vcur[i] : vs[i - half];
        }
      }
      for (int64_t i = 0; i < half; ++i) vs[i] = vdel[i];
    }
  });
  // 2. attention over slots <= slot where valid (its own slot always)
  at::Tensor attn = at::empty({B, hq * d}, x.options());
  float* ap = attn.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  const int64_t Tk = slot + 1;
  at::parallel_for(0, B * hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(Tk);
    std::vector<char> vis(Tk);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / hk, j = it % hk;
      attend_kv_head(qp + b * hq * d, kcp + (b * hk + j) * cap * d, vcp + (b * hk + j) * cap * d, vp + b * cap,
                     Tk, slot, d, g, j, ap + b * hq * d, score.data(), vis.data());
    }
  });
  at::Tensor out = has_bo ? at::addmm(*bo, attn, wo.t()) : at::mm(attn, wo.t());
  residual_scaling(out.data_ptr<float>(), x.data_ptr<float>(), rs.data_ptr<float>(), B, H);
  return out;
}

// The ZAYA1 MoE block for one token per row: (x_next = RS(x, experts(rms(x))), router state r).
// Router: r = down(rms(x)) (+ state * rss: depth averaging, all but the first layer), then
// RMSNorm, fc1, GELU, fc2, GELU, out_proj over E + 1 classes, fp32 softmax; class = argmax of
// probability + balancing bias; gate = the probability (0 for the skip class E, which computes
// nothing). `routed` (optional int64 [B, 1]) receives the classes.
std::tuple<at::Tensor, at::Tensor> zaya_moe_step(
    const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& down_w, const at::Tensor& down_b,
    const c10::optional<at::Tensor>& state, const c10::optional<at::Tensor>& rss, const at::Tensor& rn_w,
    const at::Tensor& fc1_w, const at::Tensor& fc1_b, const at::Tensor& fc2_w, const at::Tensor& fc2_b,
    const at::Tensor& out_w, const at::Tensor& bal, const at::Tensor& gate_up, const at::Tensor& down,
    const at::Tensor& rs, double eps_d, const c10::optional<at::Tensor>& routed) {
  for (const at::Tensor* t : {&x, &ln_w, &down_w, &down_b, &rn_w, &fc1_w, &fc1_b, &fc2_w, &fc2_b, &out_w, &bal,
                              &gate_up, &down, &rs})
    check_f32(*t, "zaya_moe_step tensor");
  const int64_t B = x.size(0), H = x.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(out_w.size(0) == E + 1 && bal.numel() == E + 1 && rs.size(0) == 4 && rs.size(1) == H,
              "zaya_moe_step: shapes do not match");
  const float eps = static_cast<float>(eps_d);
  const bool record = routed.has_value() && routed->defined();
  if (record)
    TORCH_CHECK(routed->device().is_cpu() && routed->scalar_type() == at::kLong && routed->is_contiguous() &&
                    routed->numel() == B,
                "zaya_moe_step: routed must be a contiguous int64 CPU tensor [", B, ", 1]");
  at::Tensor h = rms_rows(x, ln_w, eps);
  at::Tensor r = at::addmm(down_b, h, down_w.t());
  const bool eda = state.has_value() && state->defined();
  if (eda) {
    TORCH_CHECK(rss.has_value() && rss->defined(), "zaya_moe_step: a router state needs router_states_scale");
    r = r + *state * *rss;
  }
  at::Tensor a = at::gelu(at::addmm(fc1_b, rms_rows(r, rn_w, eps), fc1_w.t()));
  a = at::gelu(at::addmm(fc2_b, a, fc2_w.t()));
  at::Tensor logits = at::mm(a, out_w.t()).contiguous();
  const float *lp = logits.data_ptr<float>(), *bp = bal.data_ptr<float>();
  std::vector<int64_t> idx(B);
  std::vector<float> wt(B), probs(E + 1);
  for (int64_t b = 0; b < B; ++b) {
    const float* l = lp + b * (E + 1);
    float m = l[0];
    for (int64_t e = 1; e <= E; ++e) m = std::max(m, l[e]);
    float sum = 0.f;
    for (int64_t e = 0; e <= E; ++e) sum += (probs[e] = std::exp(l[e] - m));
    int64_t best = 0;
    for (int64_t e = 0; e <= E; ++e) {
      probs[e] /= sum;
      if (probs[e] + bp[e] > probs[best] + bp[best]) best = e;
    }
    idx[b] = best;
    wt[b] = best == E ? 0.f : probs[best];
  }
  if (record) std::copy(idx.begin(), idx.end(), routed->data_ptr<int64_t>());
  // tokens grouped by expert (token order within one; the skip class left out)
  std::vector<int64_t> start(E + 2, 0), order(B);
  for (int64_t b = 0; b < B; ++b) ++start[idx[b] + 1];
  for (int64_t e = 0; e <= E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t b = 0; b < B; ++b) order[cursor[idx[b]]++] = b;
  const int64_t N = start[E];  // routed to a real expert
  at::Tensor out = at::zeros_like(x);
  if (N > 0) {
    at::Tensor tokens = at::from_blob(order.data(), {N}, x.options().dtype(at::kLong));
    at::Tensor xe = h.index_select(0, tokens);
    at::Tensor hb = at::empty({N, 2 * I}, x.options());
    at::Tensor yb = at::empty({N, H}, x.options());
    all_experts(xe, hb, yb, gate_up, down, start, E, N, I);
    float* mp = out.data_ptr<float>();
    const float* yp = yb.data_ptr<float>();
    for (int64_t p = 0; p < N; ++p) {
      const float w = wt[order[p]];
      float* dst = mp + order[p] * H;
      const float* src = yp + p * H;
      for (int64_t c = 0; c < H; ++c) dst[c] = w * src[c];
    }
  }
  residual_scaling(out.data_ptr<float>(), x.data_ptr<float>(), rs.data_ptr<float>(), B, H);
  return {out, r};
}

}  // namespace

TORCH_LIBRARY(cascade_native, m) {
  m.def("attn_block(Tensor x, Tensor ln_w, Tensor wqkv, Tensor? bqkv, Tensor? qn_w, Tensor? kn_w, Tensor cos, "
        "Tensor sin, Tensor(a!) kc, Tensor(b!) vc, Tensor valid, Tensor rows, Tensor slots, Tensor wo, Tensor? bo, "
        "int hq, int hk, "
        "float eps, int shared=0) -> Tensor");
  m.def("moe_block(Tensor x, Tensor ln_w, Tensor router_w, Tensor gate_up, Tensor down, int top_k, bool norm_topk, "
        "float eps, Tensor(a!)? routed=None) -> Tensor");
  m.def("mlp_block(Tensor x, Tensor ln_w, Tensor w_gate_up, Tensor w_down, float eps) -> Tensor");
  m.def("sample_rows(Tensor logits, float temperature, Tensor u) -> (Tensor, Tensor)");
  m.def("zaya_attn_step(Tensor x, Tensor ln_w, Tensor wproj, Tensor? bproj, Tensor(a!)? conv_state, Tensor dw_w, "
        "Tensor dw_b, Tensor gw_w, Tensor gw_b, Tensor(b!) vstate, Tensor qk_scale, Tensor cos, Tensor sin, "
        "Tensor(c!) kc, Tensor(d!) vc, Tensor valid, int slot, Tensor wo, Tensor? bo, Tensor rs, int hq, int hk, "
        "float eps) -> Tensor");
  m.def("zaya_moe_step(Tensor x, Tensor ln_w, Tensor down_w, Tensor down_b, Tensor? state, Tensor? rss, "
        "Tensor rn_w, Tensor fc1_w, Tensor fc1_b, Tensor fc2_w, Tensor fc2_b, Tensor out_w, Tensor bal, "
        "Tensor gate_up, Tensor down, Tensor rs, float eps, Tensor(a!)? routed=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cascade_native, CPU, m) {
  m.impl("attn_block", attn_block);
  m.impl("moe_block", moe_block);
  m.impl("mlp_block", mlp_block);
  m.impl("sample_rows", sample_rows);
  m.impl("zaya_attn_step", zaya_attn_step);
  m.impl("zaya_moe_step", zaya_moe_step);
}

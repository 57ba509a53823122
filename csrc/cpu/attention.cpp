// The fused softmax / sparsemax / entmax15 / α-entmax attention op on the
// CPU, forward and backward (the op contract is in csrc/attnkern.cpp): the
// checks and the problem set-up, and the schedules that hand blocks of query
// rows to the two algorithms (attention_softmax.cpp, attention_rows.cpp; what
// they share is in attention_problem.h).
//
// Parallelism: the forward over batch x heads x query blocks. The backward
// over batch x kv-heads x chunks of query blocks; the query blocks of a head
// are split into a fixed number of chunks (kBackwardTasks per call, whatever
// the thread count) with their own dK/dV accumulators, summed at the end in a
// fixed order, so both cores work even for a single head and the result does
// not depend on the thread count.

#include <cmath>
#include <string>

#include "attention_problem.h"
#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using namespace attn;  // NOLINT(build/namespaces)

// ------------------------------------------------------------ scheduling

template <typename acc_t>
bool all_softmax_heads(const Problem<acc_t>& P) {
  return std::all_of(P.fam.begin(), P.fam.end(), [](Family f) { return f == Family::kSoftmax; });
}

// Whether the forward takes the decoding path (decode_forward), which reads K
// in place: no packed copy is needed.
template <typename acc_t>
bool decodes(const Problem<acc_t>& P) {
  return P.L <= kDecodeRows && all_softmax_heads(P);
}

// Decoding: every (batch, head) split over fixed chunks of keys from the
// first of its band, one task per chunk, then the chunks of each head merged
// in order. (Chunks take absolute key indices: P.key0 stays 0.)
template <typename acc_t>
void decode_forward(const Problem<acc_t>& P, acc_t* out, float* shift) {
  const int64_t m = P.L;
  std::vector<std::pair<int64_t, int64_t>> range(P.B);
  int64_t n_max = 0;
  for (int64_t bi = 0; bi < P.B; ++bi) {
    range[bi] = P.block_keys(bi, 0, m);
    n_max = std::max(n_max, range[bi].second);
  }
  const int64_t nchunks = std::max<int64_t>(1, (n_max + kDecodeKeys - 1) / kDecodeKeys);
  const int64_t heads = P.B * P.H;
  std::vector<acc_t> po(heads * nchunks * m * P.Ev), pm(heads * nchunks * m), pl(heads * nchunks * m);
  // A paged cache's tasks run a chunk's heads back to back, so that the heads
  // of a kv-head look up its rows' addresses once (softmax_decode_chunk) and
  // find them in cache (the order changes no result).
  const bool paged = P.kv_pages != nullptr;
  at::parallel_for(0, heads * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> y(m * std::min(n_max, kDecodeKeys));
    PagedRows rows;
    FlushDenormals ftz;
    for (int64_t task = begin; task < end; ++task) {
      // t indexes the (batch, head, chunk) buffers; paged tasks run (batch, chunk, head), heads innermost.
      int64_t t = task;
      if (paged) {
        const int64_t task_batch = task / (nchunks * P.H), task_chunk = task / P.H % nchunks, task_head = task % P.H;
        t = (task_batch * P.H + task_head) * nchunks + task_chunk;
      }
      const int64_t bh = t / nchunks, u = t % nchunks, bi = bh / P.H;
      const auto [jb, n] = range[bi];
      if (u * kDecodeKeys >= n) {  // (no key in this chunk)
        std::fill(pm.begin() + t * m, pm.begin() + (t + 1) * m, -std::numeric_limits<acc_t>::infinity());
        continue;
      }
      softmax_decode_chunk(P, bi, bh % P.H, 0, m, jb + u * kDecodeKeys, std::min(kDecodeKeys, n - u * kDecodeKeys),
                           y.data(), po.data() + t * m * P.Ev, pm.data() + t * m, pl.data() + t * m, rows);
    }
  });
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh)
      softmax_merge_chunks(m, P.Ev, nchunks, po.data() + bh * nchunks * m * P.Ev, pm.data() + bh * nchunks * m,
                           pl.data() + bh * nchunks * m, out + bh * m * P.Ev, shift + bh * m);
  });
}

// Where the forward's output goes: (B, H, L, ev) contiguous rows of dtype.
// The kernels make rows of P.Ev accumulation-type values; where the output
// holds them as they are they write there, else each block's rows are made in
// scratch and converted, instead of a whole padded or float copy of the
// output (a pass more, and fresh pages on every call).
struct OutRows {
  void* data;
  at::ScalarType dtype;
  int64_t ev;
};

template <typename acc_t>
bool writes_in_place(const Problem<acc_t>& P, const OutRows& out) {
  return out.dtype == c10::CppTypeToScalarType<acc_t>::value && out.ev == P.Ev;
}

// Output rows [row0, row0 + m) from m rows of accumulation-type values, ld apart.
template <typename acc_t>
void store_rows(const acc_t* o, int64_t m, int64_t ld, const OutRows& out, int64_t row0) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.dtype, "attnkern_store_rows", [&] {
    scalar_t* dst = static_cast<scalar_t*>(out.data) + row0 * out.ev;
    for (int64_t r = 0; r < m; ++r) convert_row(o + r * ld, dst + r * out.ev, out.ev);
  });
}

// pack_panels of one head's keys src (S x E) into dst (round_up_panel(S) x
// Ep of acc_t), converted and zero-padded a panel of keys at a time in keys
// (scratch): no widened or padded copy of K first.
template <typename acc_t, typename src_t>
void pack_head(const src_t* src, int64_t S, int64_t E, int64_t Ep, acc_t* dst, LineVector<acc_t>& keys) {
  if constexpr (std::is_same_v<src_t, acc_t>) {
    if (E == Ep) return pack_panels(src, S, E, E, dst);
  }
  constexpr int64_t NR = kPanel<acc_t>;
  keys.assign(NR * Ep, acc_t(0));  // (columns E.. stay zero)
  for (int64_t j0 = 0; j0 < S; j0 += NR) {
    const int64_t w = std::min(NR, S - j0);
    for (int64_t j = 0; j < w; ++j) convert_row(src + (j0 + j) * E, keys.data() + j * Ep, E);
    pack_panels(keys.data(), w, Ep, Ep, dst + j0 * Ep);
  }
}

// Problem::k_src: Pt (the thread's copy of P) pointed at the key panels of
// (bi, h)'s kv-head, packed into ws unless ws holds them already.
template <typename acc_t>
void pack_thread_keys(const Problem<acc_t>& P, int64_t bi, int64_t h, Problem<acc_t>& Pt, Workspace<acc_t>& ws) {
  const int64_t head = bi * P.Hk + h / P.group(), Sp = round_up_panel<acc_t>(P.S);
  if (!ws.k_panels.empty() && Pt.kp_head0 == head) return;
  ws.k_panels.resize(Sp * P.E);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, P.k_src_type, "attnkern_pack_head", [&] {
    const scalar_t* src = static_cast<const scalar_t*>(P.k_src) + head * P.S * P.k_src_e;
    pack_head(src, P.S, P.k_src_e, P.E, ws.k_panels.data(), ws.keys);
  });
  Pt.kp = ws.k_panels.data(), Pt.kp_head0 = head;
}

// Problem::q_half: Pt (the thread's copy of P) pointed at the block's q rows
// [i0, i0 + m) of (bi, h), widened into ws, and for a softmax head at its
// kv-head's V, widened unless ws holds it already.
template <typename acc_t>
void widen_half_inputs(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, Problem<acc_t>& Pt,
                       Workspace<acc_t>& ws) {
  const int64_t row0 = P.row_id(bi, h, i0);
  Pt.q = widen_half_rows(static_cast<const h16*>(P.q_half) + row0 * P.e_half, P.half_is_bf16, m, P.e_half, P.E,
                         ws.q_wide);
  Pt.q_row0 = row0;
  if (!P.widen_v_heads) return;  // (V: P's whole widened copy)
  if (P.fam[h] != Family::kSoftmax) {
    Pt.v = nullptr;  // (the other heads read v_rows_half as it is)
    return;
  }
  const int64_t head = bi * P.Hk + h / P.group();
  if (!ws.v_wide.empty() && Pt.v == ws.v_wide.data() && Pt.v_head0 == head) return;
  Pt.v = widen_half_rows(static_cast<const h16*>(P.v_rows_half) + head * P.S * P.ev_half, P.half_is_bf16, P.S,
                         P.ev_half, P.Ev, ws.v_wide);
  Pt.v_head0 = head;
}

template <typename acc_t>
void forward_kernel(const Problem<acc_t>& P, const OutRows& out, float* shift) {
  const bool in_place = writes_in_place(P, out);
  if (decodes(P)) {
    if (in_place) return decode_forward(P, static_cast<acc_t*>(out.data), shift);
    std::vector<acc_t> rows(P.B * P.H * P.L * P.Ev);  // (at most kDecodeRows rows a head)
    decode_forward(P, rows.data(), shift);
    return store_rows(rows.data(), P.B * P.H * P.L, P.Ev, out, 0);
  }
  // Softmax heads run online over key tiles and need only BM x
  // softmax_block_keys() of scores; the sparse normalizers need whole rows.
  const bool all_softmax = all_softmax_heads(P);
  const bool half = P.q16 != nullptr;
  const int64_t BM = all_softmax ? softmax_block_rows(P.L, half)
                                 : band_block_rows(P.S, P.win_left, P.win_right, P.L, sizeof(acc_t));
  const int64_t row_keys = band_keys_bound(P.S, P.win_left, P.win_right, BM);  // (the rows' widest block)
  const int64_t tile = std::min(softmax_block_keys(half), round_up_panel<acc_t>(P.S));
  const int64_t nb = (P.L + BM - 1) / BM;
  const int64_t tasks = P.B * P.H * nb;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Problem<acc_t> Pt = P;  // (this thread's: q and V widened from the half type into ws)
    Workspace<acc_t> ws;
    ws.y.resize(BM *
                std::max<int64_t>({all_softmax ? 0 : rows_ld(row_keys, half), half ? half_tile_ld(tile) : tile, 1}));
    ws.work.resize(std::max<int64_t>(2 * P.S, 1));  // normalize_scores: candidates + scratch
    ws.pidx.resize(P.S + Vec<acc_t>::size());  // (room for whole-vector stores)
    ws.mrow.resize(BM);
    ws.lsum.resize(BM);
    if (!in_place) ws.out_rows.resize(BM * P.Ev);
    FlushDenormals ftz;
    HalfGemmScope gemm16(P.q16 != nullptr && !P.hg.emulated);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nb, bi = bh / P.H, h = bh % P.H;
      const int64_t i0 = zigzag(t % nb, nb) * BM, m = std::min(BM, P.L - i0);
      const auto [jb, n] = P.block_keys(bi, i0, m);
      Pt.key0 = jb;
      acc_t* o = in_place ? static_cast<acc_t*>(out.data) + (bh * P.L + i0) * P.Ev : ws.out_rows.data();
      float* c = shift + bh * P.L + i0;
      if (n > 0 && P.k_src) pack_thread_keys(P, bi, h, Pt, ws);
      if (n > 0 && P.q_half) widen_half_inputs(P, bi, h, i0, m, Pt, ws);
      if (n == 0) {
        std::fill(o, o + m * P.Ev, acc_t(0));
        std::fill(c, c + m, std::numeric_limits<float>::infinity());
      } else if (P.fam[h] == Family::kSoftmax) {
        softmax_forward_block(Pt, bi, h, i0, m, n, ws.y.data(), o, c, ws.mrow.data(), ws.lsum.data());
      } else {
        rows_forward_block(Pt, bi, h, i0, m, n, o, c, ws);
      }
      if (!in_place) store_rows(o, m, P.Ev, out, bh * P.L + i0);
    }
  });
}

// The backward's operands of kv-head `head` in ws, Pt (the thread's copy of
// P) pointed at them: K and V widened (Problem::widen_kv) and their panels
// (pack_k_task, pack_v_task).
template <typename acc_t>
void backward_task_operands(const Problem<acc_t>& P, int64_t head, Problem<acc_t>& Pt, Workspace<acc_t>& ws) {
  const int64_t Sp = round_up_panel<acc_t>(P.S);
  if (P.widen_kv && (ws.k_wide.empty() || Pt.k_head0 != head)) {
    Pt.k = widen_half_rows(static_cast<const h16*>(P.k_src) + head * P.S * P.k_src_e, P.half_is_bf16, P.S,
                           P.k_src_e, P.E, ws.k_wide);
    Pt.v = widen_half_rows(static_cast<const h16*>(P.v_rows_half) + head * P.S * P.ev_half, P.half_is_bf16, P.S,
                           P.ev_half, P.Ev, ws.v_wide);
    Pt.k_head0 = Pt.v_head0 = head;
  }
  const int64_t bi = head / P.Hk, hk = head % P.Hk;
  if (P.pack_k_task && (ws.k_panels.empty() || Pt.kp_head0 != head)) {
    ws.k_panels.resize(Sp * P.E);
    pack_panels(Pt.k_head(bi, hk), P.S, P.E, P.E, ws.k_panels.data());
    Pt.kp = ws.k_panels.data(), Pt.kp_head0 = head;
  }
  if (P.pack_v_task && (ws.v_panels.empty() || Pt.vp_head0 != head)) {
    ws.v_panels.resize(Sp * P.Ev);
    pack_panels(Pt.v_head(bi, hk), P.S, P.Ev, P.Ev, ws.v_panels.data());
    Pt.vp = ws.v_panels.data(), Pt.vp_head0 = head;
  }
}

// With Problem::widen_kv: Pt pointed at the block's q rows [i0, i0 + m) of
// (bi, h) widened into ws; returns the block's dO rows widened into ws.
template <typename acc_t>
const acc_t* backward_block_operands(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m,
                                     Problem<acc_t>& Pt, Workspace<acc_t>& ws) {
  const int64_t row0 = P.row_id(bi, h, i0);
  Pt.q = widen_half_rows(static_cast<const h16*>(P.q_half) + row0 * P.e_half, P.half_is_bf16, m, P.e_half, P.E,
                         ws.q_wide);
  Pt.q_row0 = row0;
  return widen_half_rows(static_cast<const h16*>(P.do_half) + row0 * P.ev_half, P.half_is_bf16, m, P.ev_half, P.Ev,
                         ws.do_wide);
}

template <typename acc_t>
void backward_kernel(const Problem<acc_t>& P, const acc_t* dout, const float* shift, const acc_t* delta, acc_t* dq,
                     acc_t* dk_acc, acc_t* dv_acc, int64_t nchunks, double* dalpha_acc) {
  const int64_t BM = band_block_rows(P.S, P.win_left, P.win_right, P.L, sizeof(acc_t));
  const int64_t row_keys = band_keys_bound(P.S, P.win_left, P.win_right, BM);  // (the rows' widest block)
  const int64_t nb = (P.L + BM - 1) / BM;
  const bool half = P.q16 != nullptr;
  const int64_t BMs = softmax_block_rows(P.L, half);
  const int64_t nbs = (P.L + BMs - 1) / BMs;
  const int64_t G = P.group();
  const int64_t tasks = P.B * P.Hk * nchunks;
  // (Transposed accumulators with half-type GEMMs: E x round_up_vnni(S).)
  const int64_t Sa = P.do16 ? round_up_vnni(P.S) : P.S;
  const int64_t kv_head_k = Sa * P.E, kv_head_v = Sa * P.Ev;
  // Softmax heads take the tiled path unless dα is wanted (α-entmax heads in
  // the softmax limit): the row-buffer path reduces it.
  auto tiled = [&](int64_t h) { return P.fam[h] == Family::kSoftmax && dalpha_acc == nullptr; };
  bool any_tiled = false, any_rows = false;
  for (int64_t h = 0; h < P.H; ++h) (tiled(h) ? any_tiled : any_rows) = true;
  const int64_t tile = std::min(softmax_block_keys(half), round_up_panel<acc_t>(P.S));
  const int64_t buf =
      std::max<int64_t>({any_rows ? BM * row_keys : 0, any_tiled ? BMs * (half ? half_tile_ld(tile) : tile) : 0, 1});
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Problem<acc_t> Pt = P;  // (this thread's: the task's and the block's operands in ws)
    Workspace<acc_t> ws;
    ws.y.resize(buf);
    ws.d.resize(buf);
    ws.work.resize(std::max<int64_t>(2 * P.S, 1));  // normalize_scores: candidates + scratch
    ws.pidx.resize(P.S + Vec<acc_t>::size());  // (room for whole-vector stores)
    ws.lse.resize(BMs);
    FlushDenormals ftz;
    HalfGemmScope gemm16(P.q16 != nullptr && !P.hg.emulated);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk = t % nchunks, bk = t / nchunks, bi = bk / P.Hk, hk = bk % P.Hk;
      acc_t* dk = dk_acc + (chunk * P.B * P.Hk + bk) * kv_head_k;
      acc_t* dv = dv_acc + (chunk * P.B * P.Hk + bk) * kv_head_v;
      Pt.key0 = 0;  // (the task's operands are whole heads)
      backward_task_operands(P, bk, Pt, ws);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        const int64_t bh = bi * P.H + h;
        double* da = dalpha_acc ? dalpha_acc + (chunk * P.B + bi) * P.H + h : nullptr;
        const bool tiled_h = tiled(h);
        const int64_t bm = tiled_h ? BMs : BM, nbh = tiled_h ? nbs : nb;
        for (int64_t u = chunk; u < nbh; u += nchunks) {
          const int64_t i0 = zigzag(u, nbh) * bm, m = std::min(bm, P.L - i0);
          const auto [jb, n] = P.block_keys(bi, i0, m);
          Pt.key0 = jb;
          // (The block's keys in the accumulators: transposed ones, E x Sa, by column.)
          acc_t* dkb = P.do16 ? dk + jb : dk + jb * P.E;
          acc_t* dvb = P.do16 ? dv + jb : dv + jb * P.Ev;
          acc_t* dqb = dq + (bh * P.L + i0) * P.E;
          const acc_t* dob = dout ? dout + (bh * P.L + i0) * P.Ev : nullptr;
          const float* c = shift + bh * P.L + i0;
          if (n > 0 && P.widen_kv) dob = backward_block_operands(P, bi, h, i0, m, Pt, ws);
          if (n == 0) {
            std::fill(dqb, dqb + m * P.E, acc_t(0));
          } else if (tiled_h) {
            softmax_backward_block(Pt, bi, h, i0, m, n, c, delta + bh * P.L + i0, dob, dqb, dkb, dvb, ws.y.data(),
                                   ws.d.data(), ws.lse.data(), ws.keep);
          } else {
            rows_backward_block(Pt, bi, h, i0, m, n, c, dob, dqb, dkb, dvb, da, ws);
          }
        }
      }
    }
  });
}

// ------------------------------------------------------------------- ops

// fusedmax and oscarmax: heads of family sparsemax whose rows a prox
// precedes (Problem::prox), with λ per head in the op's alpha argument.
Prox normalizer_prox(c10::string_view name) {
  if (name == "fusedmax") return Prox::kFusedmax;
  if (name == "oscarmax") return Prox::kOscarmax;
  return Prox::kNone;
}

Family normalizer_family(c10::string_view name) {
  if (normalizer_prox(name) != Prox::kNone) return Family::kSparsemax;
  std::string names;
  for (int f = 0; f < math::kNumFamilies; ++f) {
    if (name == math::kFamilyNames[f]) return static_cast<Family>(f);
    names += std::string(f ? ", " : "") + math::kFamilyNames[f];
  }
  TORCH_CHECK(false, "attnkern.attention: normalizer must be one of ", names, ", fusedmax, oscarmax; got '",
              std::string(name), "'");
}

struct Checked {
  int64_t B, H, Hk, L, S, E, Ev;
  at::ScalarType acc;
};

Checked check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  for (auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), "attnkern.attention: expected CPU tensors");
    TORCH_CHECK(at::isFloatingType(t->scalar_type()), "attnkern.attention: q, k, v must be floating point");
    TORCH_CHECK(t->dim() == 4, "attnkern.attention: q, k, v must be 4-d (B, H, L, E), got ", t->dim(), "-d");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attnkern.attention: q, k, v must have one dtype");
  Checked c;
  c.B = q.size(0), c.H = q.size(1), c.L = q.size(2), c.E = q.size(3);
  c.Hk = k.size(1), c.S = k.size(2), c.Ev = v.size(3);
  TORCH_CHECK(k.size(0) == c.B && v.size(0) == c.B, "attnkern.attention: batch sizes differ");
  TORCH_CHECK(k.size(3) == c.E, "attnkern.attention: q and k head dims differ");
  TORCH_CHECK(v.size(1) == c.Hk && v.size(2) == c.S, "attnkern.attention: k and v shapes differ");
  TORCH_CHECK(c.Hk > 0 && c.H % c.Hk == 0, "attnkern.attention: query heads (", c.H,
              ") must be a multiple of key/value heads (", c.Hk, ")");
  c.acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return c;
}

// The key band's arguments: the window's sides (-1 unbounded) and the valid
// keys per batch (key_lengths, int64 (B,), or undefined).
struct Band {
  int64_t left = -1, right = -1;
  Tensor key_lengths;
  Tensor row_bounds;
};

Band prepare_band(int64_t window_left, int64_t window_right, const c10::optional<Tensor>& key_lengths,
                  const c10::optional<Tensor>& row_bounds, const Checked& c) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "attnkern.attention: window sides must be >= 0, or -1 for unbounded; got (", window_left, ", ",
                    window_right, ")");
  Band band{window_left, window_right, Tensor()};
  if (key_lengths.has_value() && key_lengths->defined()) {
    const Tensor& kl = *key_lengths;
    TORCH_CHECK_VALUE(kl.device().is_cpu() && kl.scalar_type() == at::kLong && kl.dim() == 1 && kl.size(0) == c.B,
                      "attnkern.attention: key_lengths must be a CPU int64 tensor of shape (", c.B, "), got ",
                      kl.scalar_type(), " ", kl.sizes(), " on ", kl.device());
    band.key_lengths = kl.contiguous();
    const int64_t* p = band.key_lengths.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < c.B; ++b)
      TORCH_CHECK_VALUE(p[b] >= 0 && p[b] <= c.S, "attnkern.attention: key_lengths[", b, "] = ", p[b],
                        " lies outside [0, S = ", c.S, "]");
  }
  if (row_bounds.has_value() && row_bounds->defined()) {
    const Tensor& rk = *row_bounds;
    TORCH_CHECK_VALUE(rk.device().is_cpu() && rk.scalar_type() == at::kLong &&
                          rk.sizes() == at::IntArrayRef({c.B, c.L, 2}),
                      "attnkern.attention: row_bounds must be a CPU int64 tensor of shape (", c.B, ", ", c.L,
                      ", 2), got ", rk.scalar_type(), " ", rk.sizes(), " on ", rk.device());
    band.row_bounds = rk.contiguous();
    const int64_t* p = band.row_bounds.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < c.B * c.L; ++r)
      TORCH_CHECK_VALUE(p[2 * r] >= 0 && p[2 * r + 1] <= c.S, "attnkern.attention: row_bounds of row ", r,
                        " = [", p[2 * r], ", ", p[2 * r + 1], ") lies outside [0, S = ", c.S, "]");
  }
  return band;
}

template <typename acc_t>
Problem<acc_t> make_problem(const Checked& c, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& mask, bool is_causal, const Band& band, double scale, Family fam,
                            const Tensor& alpha) {
  Problem<acc_t> P;
  // (Undefined q, k or v: decoding reads half-precision K and V in place, and
  // half-type GEMMs read half-type copies.)
  P.q = q.defined() ? q.const_data_ptr<acc_t>() : nullptr;
  P.k = k.defined() ? k.const_data_ptr<acc_t>() : nullptr;
  P.v = v.defined() ? v.const_data_ptr<acc_t>() : nullptr;
  P.B = c.B, P.H = c.H, P.Hk = c.Hk, P.L = c.L, P.S = c.S;
  P.E = round_up_panel<acc_t>(c.E), P.Ev = round_up_panel<acc_t>(c.Ev);
  P.scale = static_cast<acc_t>(scale);
  P.causal = is_causal;
  P.win_left = band.left, P.win_right = band.right;
  P.key_len = band.key_lengths.defined() ? band.key_lengths.const_data_ptr<int64_t>() : nullptr;
  P.row_bounds = band.row_bounds.defined() ? band.row_bounds.const_data_ptr<int64_t>() : nullptr;
  if (mask.defined()) {
    P.mask = mask.const_data_ptr<acc_t>();
    P.msb = mask.stride(0), P.msh = mask.stride(1), P.msl = mask.stride(2), P.mss = mask.stride(3);
  }
  P.b.resize(c.H);
  P.fam.resize(c.H);
  for (int64_t h = 0; h < c.H; ++h) {
    if (fam == Family::kGeneric) {
      const acc_t b = static_cast<acc_t>(alpha.const_data_ptr<double>()[h]) - acc_t(1);
      P.b[h] = b;
      P.fam[h] = math::family_of<acc_t>(b);
    } else {
      P.fam[h] = fam;
      P.b[h] = math::fixed_b<acc_t>(fam);
    }
  }
  return P;
}

Tensor prepare_mask(const c10::optional<Tensor>& mask, const Checked& c) {
  if (!mask.has_value() || !mask->defined()) return Tensor();
  TORCH_CHECK(mask->device().is_cpu(), "attnkern.attention: mask must be a CPU tensor");
  TORCH_CHECK(at::isFloatingType(mask->scalar_type()),
              "attnkern.attention: mask must be a float tensor (-inf = not allowed), got ", mask->scalar_type());
  // Keeps broadcast dimensions as stride-0 views; only the last dim is made
  // unit-stride when it is neither 1 nor 0.
  Tensor m = mask->to(c.acc).expand({c.B, c.H, c.L, c.S});
  if (m.stride(3) != 1 && m.stride(3) != 0 && c.S > 1) m = m.contiguous();
  return m;
}

Dropout prepare_dropout(double dropout_p, const c10::optional<Tensor>& seed, int64_t S) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "attnkern.attention: dropout_p must be in [0, 1), got ",
              dropout_p);
  if (dropout_p == 0.0) return Dropout();
  TORCH_CHECK(seed.has_value() && seed->defined() && seed->numel() == 1 && seed->scalar_type() == at::kLong,
              "attnkern.attention: dropout_p > 0 needs dropout_seed, an int64 tensor of one element");
  return Dropout::make(dropout_p, static_cast<uint64_t>(seed->item<int64_t>()), S);
}

// Sums acc (n, count) over its first dim into out (count), in chunk order
// whatever the thread count (each entry is summed by one thread).
template <typename scalar_t>
void sum_chunks(const Tensor& acc, Tensor& out) {
  const int64_t n = acc.size(0), count = out.numel();
  if (n == 0) {  // nothing to sum (e.g. dα of a batch of size 0)
    out.zero_();
    return;
  }
  const scalar_t* a = acc.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scalar_t t = a[i];
      for (int64_t c = 1; c < n; ++c) t += a[c * count + i];
      o[i] = t;
    }
  });
}

// α > 2 with float32 (or half) inputs runs in double, from those inputs, and
// rounds once: the weights have an infinite slope at the edge of the support,
// so the rounding of float32 scores moves them by far more than float32's
// resolution, and in the backward g = p^(2-α), unbounded there, multiplies the
// rounding of dp = dO·v_j.
void widen_for_alpha_above_two(Checked& c, const Tensor& alpha) {
  if (alpha.defined() && c.acc == at::kFloat && (alpha > 2.0).any().item<bool>()) c.acc = at::kDouble;
}

Tensor prepare_alpha(const c10::optional<Tensor>& alpha, Family fam, const Checked& c) {
  if (fam != Family::kGeneric) return Tensor();
  TORCH_CHECK(alpha.has_value() && alpha->defined(), "attnkern.attention: normalizer 'entmax' needs alpha");
  TORCH_CHECK(alpha->numel() == c.H, "attnkern.attention: alpha must have one value per query head (", c.H,
              "), got shape ", alpha->sizes());
  // In double: a float64 α reaches the float64 kernels unrounded (float32
  // and half α convert exactly).
  Tensor a = alpha->to(at::kDouble).contiguous().view({c.H});
  auto ac = a.accessor<double, 1>();
  for (int64_t h = 0; h < c.H; ++h)
    TORCH_CHECK_VALUE(std::isfinite(ac[h]) && ac[h] > 0, "attnkern.attention: alpha must be finite and > 0, got ",
                      ac[h]);
  return a;
}

// λ per head of a structured normalizer (given as the op's alpha), in double;
// undefined for the other normalizers.
Tensor prepare_lam(const c10::optional<Tensor>& lam, Prox prox, const Checked& c) {
  if (prox == Prox::kNone) return Tensor();
  TORCH_CHECK(lam.has_value() && lam->defined(), "attnkern.attention: normalizers fusedmax and oscarmax need lam "
              "(one value per query head, in the alpha argument)");
  TORCH_CHECK(lam->numel() == c.H, "attnkern.attention: lam must have one value per query head (", c.H,
              "), got shape ", lam->sizes());
  Tensor l = lam->to(at::kDouble).contiguous().view({c.H});
  auto lc = l.accessor<double, 1>();
  for (int64_t h = 0; h < c.H; ++h)
    TORCH_CHECK_VALUE(std::isfinite(lc[h]) && lc[h] >= 0, "attnkern.attention: lam must be finite and >= 0, got ",
                      lc[h]);
  return l;
}

template <typename acc_t>
void set_prox(Problem<acc_t>& P, Prox prox, const Tensor& lam) {
  P.prox = prox;
  if (prox != Prox::kNone) P.lam.assign(lam.const_data_ptr<double>(), lam.const_data_ptr<double>() + P.H);
}

// t (..., d) contiguous in the accumulation type, zero-padded to `width`
// columns (no copy when it already has them).
Tensor padded(const Tensor& t, at::ScalarType acc, int64_t width) {
  Tensor x = t.to(acc).contiguous();
  if (x.size(-1) == width) return x;
  return at::constant_pad_nd(x, {0, width - x.size(-1)}, 0).contiguous();
}

// The dtype attention's GEMMs take for inputs of dtype dt: dt itself, except
// that float32 inputs take bfloat16 where the user allows it for oneDNN's
// float32 matmuls (torch.backends.mkldnn.matmul.fp32_precision = "bf16",
// inherited from torch.backends.mkldnn.fp32_precision and
// torch.backends.fp32_precision when "none"; set_float32_matmul_precision
// ("medium") sets it) and AMX tiles run bfloat16 (or the test emulation
// stands in for them): bfloat16 operands with float32 sums, float32
// outputs and gradients. "tf32" has no x86 unit and means float32.
at::ScalarType gemm_dtype(at::ScalarType dt) {
  if (dt != at::kFloat) return dt;
  if (at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL) !=
      at::Float32Precision::BF16)
    return dt;
  HalfGemm g;
  const char* unit = "";
  if (!half_gemm_enabled(at::kBFloat16, &g, &unit)) return dt;
  return g.emulated || std::string(unit) == "AMX-BF16" ? at::kBFloat16 : dt;
}

// One packed copy (pack_keys, or pack_values with `values`, in g's layout) of
// each (batch, kv-head) of x (B, Hk, S, d), bfloat16 or float16.
Tensor pack_heads16(const HalfGemm& g, const Tensor& x, bool values) {
  const int64_t heads = x.size(0) * x.size(1), S = x.size(2), d = x.size(3), Sk = round_up_vnni(S);
  Tensor packed = at::empty({heads * Sk * d}, x.options());
  const h16* src = static_cast<const h16*>(x.const_data_ptr());
  h16* dst = static_cast<h16*>(packed.mutable_data_ptr());
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      (values ? pack_values : pack_keys)(g.vnni, src + i * S * d, S, d, d, dst + i * Sk * d);
  });
  return packed;
}

// One packed copy (pack_panels) of each (batch, kv-head) of x (B, Hk, S, d).
template <typename acc_t>
Tensor pack_heads(const Tensor& x) {
  const int64_t heads = x.size(0) * x.size(1), S = x.size(2), d = x.size(3), Sp = round_up_panel<acc_t>(S);
  Tensor packed = at::empty({heads * Sp * d}, x.options());
  const acc_t* src = x.const_data_ptr<acc_t>();
  acc_t* dst = packed.mutable_data_ptr<acc_t>();
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack_panels(src + i * S * d, S, d, d, dst + i * Sp * d);
  });
  return packed;
}

// Whether the kernels make K's and V's panels and widened copies a kv-head
// at a time in each thread's workspace (Problem::k_src, widen_v_heads,
// widen_kv, pack_k_task, pack_v_task) rather than for the whole problem
// first: when there are at least as many kv-heads as threads. With fewer,
// several threads would each hold a copy of the same head (a long single
// head on many cores: many times the memory of one shared copy).
bool operands_per_head(const Checked& c) { return c.B * c.Hk >= at::get_num_threads(); }

// bfloat16 and float16: the half types the kernels read as they are (float8
// inputs, also reduced floating types, are widened to float32 copies first).
bool is_half_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

template <typename acc_t>
bool has_softmax_head(const Problem<acc_t>& P) {
  return std::any_of(P.fam.begin(), P.fam.end(), [](Family f) { return f == Family::kSoftmax; });
}

// Whether every head is of the softmax family (normalizer softmax, or
// α-entmax with every α in softmax's limit).
bool all_softmax_family(Family fam, const Tensor& alpha) {
  if (fam != Family::kGeneric) return fam == Family::kSoftmax;
  const double* a = alpha.const_data_ptr<double>();
  for (int64_t h = 0; h < alpha.numel(); ++h)
    if (math::family_of<float>(static_cast<float>(a[h]) - 1.0f) != Family::kSoftmax) return false;
  return true;
}

// The half-type score GEMMs' operands on P: q in dt (rows of Ep values) and
// K packed by pack_keys, held by q16 and k16.
template <typename acc_t>
void set_half_scores(Problem<acc_t>& P, const HalfGemm& hg, const Tensor& q_in, const Tensor& k_in,
                     at::ScalarType dt, int64_t Ep, Tensor& q16, Tensor& k16) {
  q16 = padded(q_in, dt, Ep);
  k16 = pack_heads16(hg, padded(k_in, dt, Ep), false);
  P.hg = hg;
  P.q16 = static_cast<const h16*>(q16.const_data_ptr());
  P.k16 = static_cast<const h16*>(k16.const_data_ptr());
}

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const c10::optional<Tensor>& mask_in, bool is_causal, double scale,
                                         c10::string_view normalizer, const c10::optional<Tensor>& alpha_in,
                                         double dropout_p, const c10::optional<Tensor>& dropout_seed,
                                         int64_t window_left, int64_t window_right,
                                         const c10::optional<Tensor>& key_lengths,
                                         const c10::optional<Tensor>& row_bounds) {
  Checked c = check_inputs(q_in, k_in, v_in);
  const Band band = prepare_band(window_left, window_right, key_lengths, row_bounds, c);
  const Family fam = normalizer_family(normalizer);
  const Prox prox = normalizer_prox(normalizer);
  const Dropout drop = prepare_dropout(dropout_p, dropout_seed, c.S);
  Tensor alpha = prepare_alpha(alpha_in, fam, c);
  const Tensor lam = prepare_lam(alpha_in, prox, c);
  widen_for_alpha_above_two(c, alpha);
  Tensor mask = prepare_mask(mask_in, c);
  Tensor out;
  Tensor shift = at::empty({c.B, c.H, c.L}, q_in.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES(c.acc, "attnkern_attention_fwd", [&] {
    const int64_t Ep = round_up_panel<scalar_t>(c.E), Evp = round_up_panel<scalar_t>(c.Ev);
    const bool half_in = std::is_same_v<scalar_t, float> && is_half_type(q_in.scalar_type());
    // Softmax decoding of bfloat16 / float16 reads K and V as they are, and
    // so does that of float32 / float64 K and V in another layout whose rows
    // need no padding (Problem::kv_strided): a copy would cost more than the
    // decoding.
    const bool half_kv = fam == Family::kSoftmax && c.L <= kDecodeRows && half_in;
    const bool strided_kv = fam == Family::kSoftmax && c.L <= kDecodeRows && !half_in &&
                            k_in.scalar_type() == c.acc && v_in.scalar_type() == c.acc && c.E == Ep &&
                            c.Ev == Evp && k_in.stride(3) == 1 && v_in.stride(3) == 1 &&
                            !(k_in.is_contiguous() && v_in.is_contiguous());
    // Half-type GEMMs (half_gemm.h) beyond decoding: q and K in the input's
    // half type (or bfloat16 for float32: gemm_dtype), V in it for the
    // softmax heads' P·V and in float32 for the others'.
    const at::ScalarType dt = gemm_dtype(q_in.scalar_type());
    HalfGemm hg;
    const bool gemm16 = std::is_same_v<scalar_t, float> && c.L > kDecodeRows && c.S > 0 && half_gemm_enabled(dt, &hg);
    // Key panels for the score GEMMs of every normalizer, packed a head at a
    // time from K as it is (Problem::k_src; a few query rows, decoding among
    // them, read K unpacked: kPackRows).
    const bool pack_k = !gemm16 && c.L > kPackRows, per_head = operands_per_head(c);
    // Half-type inputs with float32 GEMMs: q (and V, per_head) widened in the
    // kernel (Problem::q_half).
    const bool widen_blocks = half_in && pack_k;
    Tensor q = gemm16 || widen_blocks ? Tensor() : padded(q_in, c.acc, Ep);
    Tensor k = half_kv || strided_kv || gemm16 || (pack_k && per_head) ? Tensor() : padded(k_in, c.acc, Ep);
    Tensor v, v_rows, q_rows, k_rows;
    Tensor k_half = half_kv ? k_in.contiguous() : Tensor(), v_half = half_kv ? v_in.contiguous() : Tensor();
    Tensor q16, k16, v16;
    // Whether the kernels read K and write the output in the input's dtype
    // (pack_head, OutRows); other dtypes (float8) are widened to the
    // accumulation type first and the output rounded after.
    const bool as_is = is_half_type(q_in.scalar_type()) || q_in.scalar_type() == at::kFloat ||
                       q_in.scalar_type() == at::kDouble;
    Tensor out_k = at::empty({c.B, c.H, c.L, c.Ev}, q_in.options().dtype(as_is ? q_in.scalar_type() : c.acc));
    if (out_k.numel() > 0 || shift.numel() > 0) {
      auto P = make_problem<scalar_t>(c, q, k, v, mask, is_causal, band, scale, fam, alpha);
      P.drop = drop;
      set_prox(P, prox, lam);
      if (gemm16) {
        set_half_scores(P, hg, q_in, k_in, dt, Ep, q16, k16);
        if (has_softmax_head(P)) {
          v16 = pack_heads16(hg, padded(v_in, dt, Evp), true);
          P.v16 = static_cast<const h16*>(v16.const_data_ptr());
        }
      }
      // The heads that are not softmax read bfloat16 / float16 V as it is
      // (Problem::v_rows_half).
      if (half_in && (widen_blocks || !all_softmax_heads(P))) {
        v_rows = v_in.contiguous();
        P.v_rows_half = v_rows.const_data_ptr();
        P.half_is_bf16 = v_in.scalar_type() == at::kBFloat16;
        P.ev_half = c.Ev;
      }
      if (widen_blocks) {
        q_rows = q_in.contiguous();
        P.q_half = q_rows.const_data_ptr();
        P.e_half = c.E;
        P.widen_v_heads = per_head && has_softmax_head(P);
      }
      // V widened: for the softmax heads of float32 GEMMs, and for the other
      // heads unless they read it as it is.
      const bool softmax_reads_v = has_softmax_head(P) && !half_kv && !strided_kv && !gemm16 && !P.widen_v_heads;
      if (softmax_reads_v || (!all_softmax_heads(P) && !P.v_rows_half)) {
        v = padded(v_in, c.acc, Evp);
        P.v = v.const_data_ptr<scalar_t>();
      }
      if (strided_kv) {
        P.kv_strided = true;
        P.k = k_in.const_data_ptr<scalar_t>(), P.v = v_in.const_data_ptr<scalar_t>();
        for (int d = 0; d < 3; ++d) P.k_stride[d] = k_in.stride(d), P.v_stride[d] = v_in.stride(d);
      }
      if (half_kv) {
        P.k_half = k_half.const_data_ptr(), P.v_half = v_half.const_data_ptr();
        P.half_is_bf16 = k_in.scalar_type() == at::kBFloat16;
        P.e_half = c.E, P.ev_half = c.Ev;
      }
      Tensor kpack;
      if (pack_k && per_head) {
        k_rows = as_is ? k_in.contiguous() : padded(k_in, c.acc, Ep);
        P.k_src = k_rows.const_data_ptr(), P.k_src_type = k_rows.scalar_type(), P.k_src_e = k_rows.size(3);
      } else if (pack_k) {
        kpack = pack_heads<scalar_t>(k);
        P.kp = kpack.const_data_ptr<scalar_t>();
      }
      forward_kernel<scalar_t>(P, OutRows{out_k.mutable_data_ptr(), out_k.scalar_type(), c.Ev},
                               shift.mutable_data_ptr<float>());
    }
    out = as_is ? out_k : out_k.to(q_in.scalar_type());
  });
  return {out, shift};
}

// Softmax decoding from a paged cache: q (N, H, m, E) with m <= kDecodeRows
// query rows per document, K and V pools of pages (pages, page, Hk, E / Ev),
// document d's keys [0, seqused_k[d]) in its pages block_table[d, :] in order,
// its m queries the last m positions (the window bottom-right, as
// attention_fwd's key_lengths). Each decoding chunk reads its rows in their
// pages (Problem::kv_pages), with no copy of the cache; the arithmetic is
// decode_forward's, so each document gets what attention_fwd gives on its keys
// gathered into (1, Hk, n, E) when the head dims need no padding (otherwise the
// gathered call reads rows padded with zeros and may round differently).
std::tuple<Tensor, Tensor> attention_decode_paged(const Tensor& q_in, const Tensor& k_pages, const Tensor& v_pages,
                                                  const Tensor& block_table, const Tensor& seqused_k, double scale,
                                                  int64_t window_left, int64_t window_right) {
  const char* op = "attnkern.attention_decode_paged";
  for (auto* t : {&q_in, &k_pages, &v_pages, &block_table, &seqused_k})
    TORCH_CHECK_VALUE(t->device().is_cpu(), op, ": expected CPU tensors");
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_pages.dim() == 4 && v_pages.dim() == 4, op,
                    ": q must be (N, H, m, E) and the pools (pages, page_size, Hk, dim), got ", q_in.sizes(), ", ",
                    k_pages.sizes(), ", ", v_pages.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(q_in.scalar_type()) && q_in.scalar_type() == k_pages.scalar_type() &&
                        q_in.scalar_type() == v_pages.scalar_type(),
                    op, ": q, k, v must have one floating dtype");
  const auto dt = q_in.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || is_half_type(dt), op,
                    ": q, k, v must be float64, float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK_VALUE(q_in.size(2) <= kDecodeRows, op, ": at most ", kDecodeRows, " query rows a document, got ",
                    q_in.size(2));
  TORCH_CHECK_VALUE(v_pages.size(0) == k_pages.size(0) && v_pages.size(1) == k_pages.size(1) &&
                        v_pages.size(2) == k_pages.size(2) && k_pages.size(3) == q_in.size(3),
                    op, ": the pools must share pages, page size and heads, and K q's head dim; got ", k_pages.sizes(),
                    " and ", v_pages.sizes());
  TORCH_CHECK_VALUE(k_pages.stride(3) == 1 && v_pages.stride(3) == 1, op, ": the pools' rows must be contiguous");
  const int64_t N = q_in.size(0), page = k_pages.size(1), pool = k_pages.size(0);
  TORCH_CHECK_VALUE(page > 0, op, ": page_size must be positive");
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == N,
                    op, ": block_table must be int64 (N = ", N, ", max_pages), got ", block_table.scalar_type(), " ",
                    block_table.sizes());
  TORCH_CHECK_VALUE(seqused_k.scalar_type() == at::kLong && seqused_k.dim() == 1 && seqused_k.size(0) == N, op,
                    ": seqused_k must be int64 (N = ", N, "), got ", seqused_k.scalar_type(), " ", seqused_k.sizes());
  const Tensor table = block_table.contiguous(), used = seqused_k.contiguous();
  const int64_t max_pages = table.size(1);
  const int64_t* tp = table.const_data_ptr<int64_t>();
  const int64_t* up = used.const_data_ptr<int64_t>();
  for (int64_t d = 0; d < N; ++d) {
    TORCH_CHECK_VALUE(up[d] >= 0 && up[d] <= max_pages * page, op, ": seqused_k[", d, "] = ", up[d],
                      " lies outside [0, ", max_pages * page, "] (the block table's pages)");
    for (int64_t g = 0; g < (up[d] + page - 1) / page; ++g)
      TORCH_CHECK_VALUE(tp[d * max_pages + g] >= 0 && tp[d * max_pages + g] < pool, op, ": block_table[", d, ", ",
                        g, "] = ", tp[d * max_pages + g], " names a page outside the pool of ", pool);
  }
  Checked c;
  c.B = N, c.H = q_in.size(1), c.L = q_in.size(2), c.E = q_in.size(3);
  c.Hk = k_pages.size(2), c.S = max_pages * page, c.Ev = v_pages.size(3);
  TORCH_CHECK_VALUE(c.Hk > 0 && c.H % c.Hk == 0, op, ": query heads (", c.H, ") must be a multiple of key/value heads (",
                    c.Hk, ")");
  c.acc = dt == at::kDouble ? at::kDouble : at::kFloat;
  const Band band = prepare_band(window_left, window_right, used, c10::nullopt, c);
  Tensor out = at::empty({c.B, c.H, c.L, c.Ev}, q_in.options());
  Tensor shift = at::empty({c.B, c.H, c.L}, q_in.options().dtype(at::kFloat));
  if (out.numel() == 0 && shift.numel() == 0) return {out, shift};
  AT_DISPATCH_FLOATING_TYPES(c.acc, "attnkern_attention_decode_paged", [&] {
    const Tensor q = padded(q_in, c.acc, round_up_panel<scalar_t>(c.E));
    auto P = make_problem<scalar_t>(c, q, Tensor(), Tensor(), Tensor(), false, band, scale, Family::kSoftmax,
                                    Tensor());
    P.kv_pages = tp, P.kv_page = page, P.kv_max_pages = max_pages, P.kv_e = c.E, P.kv_ev = c.Ev;
    P.k_stride[0] = k_pages.stride(0), P.k_stride[1] = k_pages.stride(2), P.k_stride[2] = k_pages.stride(1);
    P.v_stride[0] = v_pages.stride(0), P.v_stride[1] = v_pages.stride(2), P.v_stride[2] = v_pages.stride(1);
    if (is_half_type(dt)) {
      P.k_half = k_pages.const_data_ptr(), P.v_half = v_pages.const_data_ptr();
      P.half_is_bf16 = dt == at::kBFloat16;
    } else {
      P.k = k_pages.const_data_ptr<scalar_t>(), P.v = v_pages.const_data_ptr<scalar_t>();
    }
    forward_kernel<scalar_t>(P, OutRows{out.mutable_data_ptr(), dt, c.Ev}, shift.mutable_data_ptr<float>());
  });
  return {out, shift};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_bwd(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const c10::optional<Tensor>& mask_in, bool is_causal, double scale, c10::string_view normalizer,
    const c10::optional<Tensor>& alpha_in, const Tensor& out, const Tensor& shift_in, bool alpha_grad,
    double dropout_p, const c10::optional<Tensor>& dropout_seed, int64_t window_left, int64_t window_right,
    const c10::optional<Tensor>& key_lengths, const c10::optional<Tensor>& row_bounds) {
  Checked c = check_inputs(q_in, k_in, v_in);
  const Band band = prepare_band(window_left, window_right, key_lengths, row_bounds, c);
  const Family fam = normalizer_family(normalizer);
  const Dropout drop = prepare_dropout(dropout_p, dropout_seed, c.S);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({c.B, c.H, c.L, c.Ev}),
              "attnkern.attention_bwd: grad_out must have shape (B, H, L, Ev)");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({c.B, c.H, c.L, c.Ev}),
              "attnkern.attention_bwd: out must have shape (B, H, L, Ev)");
  TORCH_CHECK(shift_in.sizes() == at::IntArrayRef({c.B, c.H, c.L}),
              "attnkern.attention_bwd: shift must have shape (B, H, L)");
  Tensor shift = shift_in.to(at::kFloat).contiguous();
  const Prox prox = normalizer_prox(normalizer);
  Tensor alpha = prepare_alpha(alpha_in, fam, c);
  const Tensor lam = prepare_lam(alpha_in, prox, c);
  // (dalpha: dα of α-entmax, dλ of fusedmax and oscarmax.)
  const bool want_alpha = alpha_grad && (fam == Family::kGeneric || prox != Prox::kNone);
  widen_for_alpha_above_two(c, alpha);
  Tensor mask = prepare_mask(mask_in, c);

  // The query blocks of each kv-head are split into chunks with dK/dV
  // accumulators of their own, so that a call with fewer kv-heads than cores
  // still uses every core. The split is fixed (not the thread count's), and the
  // chunks are summed in order, so results do not depend on the thread count.
  const int64_t bhk = c.B * c.Hk;
  const int64_t BM = band_block_rows(c.S, band.left, band.right, c.L, c.acc == at::kDouble ? 8 : 4);
  const int64_t nb = (c.L + BM - 1) / BM;
  const int64_t nchunks = std::clamp<int64_t>((kBackwardTasks + bhk - 1) / std::max<int64_t>(bhk, 1), 1,
                                              std::max<int64_t>(nb, 1));

  Tensor dq, dk, dv;
  Tensor dalpha_acc = want_alpha ? at::zeros({nchunks, c.B, c.H}, q_in.options().dtype(at::kDouble)) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(c.acc, "attnkern_attention_bwd", [&] {
    if (c.Ev == 0) {
      // No value columns: the output is empty and depends on nothing, so
      // the gradients are zeros, as SDPA gives (the kernels' half-type path
      // would find no dO rows to read).
      auto opts = q_in.options().dtype(c.acc);
      dq = at::zeros({c.B, c.H, c.L, c.E}, opts), dk = at::zeros({c.B, c.Hk, c.S, c.E}, opts);
      dv = at::zeros({c.B, c.Hk, c.S, 0}, opts);
      return;
    }
    const int64_t Ep = round_up_panel<scalar_t>(c.E), Evp = round_up_panel<scalar_t>(c.Ev);
    // Half-type GEMMs when every head takes the tiled softmax backward (its
    // dK, dV accumulators are then transposed, which the row-buffer path's
    // are not).
    const at::ScalarType dt = gemm_dtype(q_in.scalar_type());
    HalfGemm hg;
    // (Not for E < kHalfK: dQ = dS·K then sums a few terms of dS rounded to
    // the half type, which cancel; the K dim is padded to kHalfK anyway, so
    // float32 GEMMs cost no more there.)
    const bool gemm16 = std::is_same_v<scalar_t, float> && c.S > 0 && c.E >= kHalfK && !want_alpha &&
                        all_softmax_family(fam, alpha) && half_gemm_enabled(dt, &hg);
    const int64_t Sa = gemm16 ? round_up_vnni(c.S) : c.S;
    // float32 inputs whose forward took its scores in bfloat16 (gemm_dtype;
    // beyond decoding) and whose backward runs in float32 get q and k rounded
    // as the forward had them: the scores it recomputes must be the ones the
    // forward's shifts were found on.
    const bool rounded_qk = !gemm16 && dt != q_in.scalar_type() && c.L > kDecodeRows && c.S > 0;
    auto score_operand = [&](const Tensor& x) { return padded(rounded_qk ? x.to(dt) : x, c.acc, Ep); };
    // bfloat16 / float16 inputs with float32 GEMMs: q, K, V and dO widened in
    // the kernel (Problem::widen_kv).
    const bool per_head = operands_per_head(c);
    const bool widen_kv =
        per_head && !gemm16 && std::is_same_v<scalar_t, float> && is_half_type(q_in.scalar_type()) && c.L > kPackRows;
    const bool own_copies = gemm16 || widen_kv;
    Tensor q = own_copies ? Tensor() : score_operand(q_in), k = own_copies ? Tensor() : score_operand(k_in);
    Tensor v = own_copies ? Tensor() : padded(v_in, c.acc, Evp);
    Tensor dout = own_copies ? Tensor() : padded(grad_out, c.acc, Evp);
    Tensor q_rows, k_rows, v_rows, do_rows;
    auto opts = q_in.options().dtype(c.acc);
    Tensor dq_p = at::empty({c.B, c.H, c.L, Ep}, opts);
    Tensor dk_acc = at::zeros(gemm16 ? at::IntArrayRef{nchunks, c.B, c.Hk, Ep, Sa}
                                     : at::IntArrayRef{nchunks, c.B, c.Hk, c.S, Ep}, opts);
    Tensor dv_acc = at::zeros(gemm16 ? at::IntArrayRef{nchunks, c.B, c.Hk, Evp, Sa}
                                     : at::IntArrayRef{nchunks, c.B, c.Hk, c.S, Evp}, opts);
    if (dq_p.numel() > 0 || dk_acc.numel() > 0 || dv_acc.numel() > 0) {
      auto P = make_problem<scalar_t>(c, q, k, v, mask, is_causal, band, scale, fam, alpha);
      P.drop = drop;
      set_prox(P, prox, lam);
      Tensor q16, k16, do16, vk16, kv16, delta;
      if (gemm16) {
        q16 = padded(q_in, dt, Ep);
        do16 = padded(grad_out, dt, Evp);
        Tensor kb = padded(k_in, dt, Ep), vb = padded(v_in, dt, Evp);
        k16 = pack_heads16(hg, kb, false);
        kv16 = pack_heads16(hg, kb, true);
        vk16 = pack_heads16(hg, vb, false);
        auto bits = [](const Tensor& t) { return static_cast<const h16*>(t.const_data_ptr()); };
        P.hg = hg;
        P.q16 = bits(q16), P.k16 = bits(k16), P.do16 = bits(do16), P.vk16 = bits(vk16), P.kv16 = bits(kv16);
      }
      // Rows of the sparse families recompute their scores as the forward
      // took them: in the half type when its GEMMs did (the same products
      // summed in the same order, so the very scores its shifts were found
      // on, and at the half-type GEMMs' speed). Not beside tiled softmax
      // heads, whose half-type path needs every operand in the half type.
      const bool scores16 = !gemm16 && std::is_same_v<scalar_t, float> && c.L > kDecodeRows && c.S > 0 &&
                            (want_alpha || !has_softmax_head(P)) && half_gemm_enabled(dt, &hg);
      if (scores16) set_half_scores(P, hg, q_in, k_in, dt, Ep, q16, k16);
      if (widen_kv) {
        q_rows = q_in.contiguous(), k_rows = k_in.contiguous(), v_rows = v_in.contiguous();
        do_rows = grad_out.contiguous();
        P.widen_kv = true;
        P.half_is_bf16 = q_in.scalar_type() == at::kBFloat16;
        P.q_half = q_rows.const_data_ptr(), P.e_half = c.E;
        P.k_src = k_rows.const_data_ptr(), P.k_src_e = c.E;
        P.v_rows_half = v_rows.const_data_ptr(), P.do_half = do_rows.const_data_ptr(), P.ev_half = c.Ev;
      }
      // Key and value panels for the S and dP GEMMs of every normalizer,
      // packed a kv-head at a time where operands_per_head, else for every
      // head first (a few query rows read K and V as they are).
      const bool pack_kv = !gemm16 && c.L > kPackRows;
      P.pack_k_task = pack_kv && per_head && !scores16;
      P.pack_v_task = pack_kv && per_head;
      Tensor kpack, vpack;
      if (pack_kv && !per_head) {
        if (!scores16) {
          kpack = pack_heads<scalar_t>(k);
          P.kp = kpack.const_data_ptr<scalar_t>();
        }
        vpack = pack_heads<scalar_t>(v);
        P.vp = vpack.const_data_ptr<scalar_t>();
      }
      if (has_softmax_head(P) && !want_alpha) {  // the tiled softmax backward runs
        // δ = dO·O per query row (its Σ_j p_j dp_j). The output of a half type
        // carries its rounding, which dS = P ⊙ (dP - δ) keeps on peaked rows;
        // where SDPA computes such shapes in float32 (E != Ev), rows longer
        // than one key tile take δ from their own P and dP instead (one more
        // pass over the keys; rows within a tile always do: tile_deltas).
        delta = (grad_out.to(c.acc) * out.to(c.acc)).sum(-1).contiguous();
        P.own_delta = at::isReducedFloatingType(q_in.scalar_type()) && c.E != c.Ev;
      }
      backward_kernel<scalar_t>(P, dout.defined() ? dout.const_data_ptr<scalar_t>() : nullptr,
                                shift.const_data_ptr<float>(),
                                delta.defined() ? delta.const_data_ptr<scalar_t>() : nullptr,
                                dq_p.mutable_data_ptr<scalar_t>(),
                                dk_acc.mutable_data_ptr<scalar_t>(), dv_acc.mutable_data_ptr<scalar_t>(), nchunks,
                                want_alpha ? dalpha_acc.mutable_data_ptr<double>() : nullptr);
    }
    Tensor dk_p = dk_acc[0], dv_p = dv_acc[0];
    if (nchunks > 1) {
      dk_p = at::empty_like(dk_p);
      dv_p = at::empty_like(dv_p);
      sum_chunks<scalar_t>(dk_acc, dk_p);
      sum_chunks<scalar_t>(dv_acc, dv_p);
    }
    if (gemm16) {  // (E x Sa) -> (S x E)
      dk_p = dk_p.narrow(3, 0, c.S).transpose(2, 3);
      dv_p = dv_p.narrow(3, 0, c.S).transpose(2, 3);
    }
    dq = Ep == c.E ? dq_p : dq_p.narrow(3, 0, c.E);
    dk = Ep == c.E ? dk_p : dk_p.narrow(3, 0, c.E);
    dv = Evp == c.Ev ? dv_p : dv_p.narrow(3, 0, c.Ev);
  });
  // (H,) whenever asked for (zeros for the normalizers without α), else empty.
  Tensor dalpha_h;
  if (want_alpha) {
    dalpha_h = at::empty({c.H}, dalpha_acc.options());
    sum_chunks<double>(dalpha_acc.view({nchunks * c.B, c.H}), dalpha_h);
  }
  // dalpha in α's dtype: float64 for a float64 α, else float32.
  const auto alpha_dtype =
      alpha_in.has_value() && alpha_in->defined() && alpha_in->scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor dalpha = want_alpha   ? dalpha_h.to(alpha_dtype)
                  : alpha_grad ? at::zeros({c.H}, q_in.options().dtype(alpha_dtype))
                               : at::empty({0}, q_in.options().dtype(alpha_dtype));
  return {dq.to(q_in.scalar_type()).contiguous(), dk.to(k_in.scalar_type()).contiguous(),
          dv.to(v_in.scalar_type()).contiguous(), dalpha};
}

Tensor attention_dropout_mask(int64_t B, int64_t H, int64_t L, int64_t S, double dropout_p,
                              const Tensor& dropout_seed) {
  TORCH_CHECK(B >= 0 && H >= 0 && L >= 0 && S >= 0, "attnkern.attention_dropout_mask: negative size");
  const Dropout d = prepare_dropout(dropout_p, dropout_seed, S);
  Tensor keep = at::empty({B, H, L, S}, dropout_seed.options().dtype(at::kBool).device(at::kCPU));
  bool* kp = keep.mutable_data_ptr<bool>();
  at::parallel_for(0, B * H * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> f(std::max<int64_t>(S, 1), 1.0f);
    for (int64_t r = begin; r < end; ++r) {
      if (d.on) dropout_keeps(d, r, 0, S, f.data());
      for (int64_t j = 0; j < S; ++j) kp[r * S + j] = f[j] != 0.0f;
    }
  });
  return keep;
}

}  // namespace

void add_attention_kernels(KernelTable& t) {
  t.attention_fwd = &attention_fwd;
  t.attention_bwd = &attention_bwd;
  t.attention_decode_paged = &attention_decode_paged;
  t.attention_dropout_mask = &attention_dropout_mask;
  t.half_gemm = [](at::ScalarType dtype, const char** unit) { return half_gemm_enabled(dtype, nullptr, unit); };
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

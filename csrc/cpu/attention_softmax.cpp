// Softmax attention on the CPU, tiled as FlashAttention: a block of query
// rows meets the keys tile by tile; the forward keeps a running max and sum
// and rescales the output, the backward recomputes P from the saved
// log-sum-exp and uses δ = dO·O per row, so no row is ever held whole. Every
// product runs on the register-blocked kernel of tile_gemm.h over K and V
// packed once per head, not on BLAS calls that would repack their operands at
// every tile.
#include "attnkern/isa_features.h"
#include <tuple>

#include "attention_problem.h"
#include "attnkern/reduced_store.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace attn {


// Scores of a tile: y (m x w, row stride ldy) = scale · q_rows · kᵀ over keys
// [j0, j0 + w) through the packed key panels (or in the half type: P.q16; or,
// for a few query rows, from K as it is), plus the mask, -inf above the
// causal diagonal. Columns [w, ldy) hold scores against zero padding keys.
template <typename acc_t>
void score_tile(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t w,
                acc_t* y, int64_t ldy) {
  if (scores_half_masked(P, bi, h, i0, m, j0, w, y, ldy)) return;
  if (P.kp) {
    tile_gemm<acc_t>(m, ldy, P.E, P.scale, P.q_rows(bi, h, i0), P.E, 1, P.kp_head(bi, h / P.group()) + j0 * P.E,
                     kPanel<acc_t>, P.E * kPanel<acc_t>, y, ldy, false);
  } else {  // (a few query rows: K unpacked)
    gemm_unpacked_keys<acc_t>(m, w, P.E, P.scale, P.q_rows(bi, h, i0), P.k_head(bi, h / P.group()) + j0 * P.E, y,
                              ldy);
  }
  mask_scores(P, bi, h, i0, m, j0, w, y, ldy);
}

// One tile's step of the online softmax for a row whose running max goes
// from old to mx (finite) and whose tile adds `sum`: the running sum and the
// output row orow (ev values) rescaled by e^(old - mx), 0 when old = -inf.
template <typename acc_t>
inline void online_step(acc_t old, acc_t mx, acc_t sum, acc_t& m, acc_t& l, acc_t* orow, int64_t ev) {
  if (mx != old) {
    const acc_t corr = std::exp(old - mx);
    l *= corr;
    if (old != -std::numeric_limits<acc_t>::infinity())
      for (int64_t e = 0; e < ev; ++e) orow[e] *= corr;
    m = mx;
  }
  l += sum;
}

// The max of y[0:n] (n > 0) for the half-type path, without at::vec's NaN
// propagation (a compare and a blend a vector): a NaN may be lost here, and
// the sum of the exponentials, NaN then, reports it.
inline float row_max_loose(const float* y, int64_t n) {
#if ATTNKERN_HAS(AVX512)
  if (n >= 64) {
    __m512 a = _mm512_loadu_ps(y), b = _mm512_loadu_ps(y + 16), c = _mm512_loadu_ps(y + 32),
           d = _mm512_loadu_ps(y + 48);
    int64_t j = 64;
    for (; j + 64 <= n; j += 64) {
      a = _mm512_max_ps(a, _mm512_loadu_ps(y + j)), b = _mm512_max_ps(b, _mm512_loadu_ps(y + j + 16));
      c = _mm512_max_ps(c, _mm512_loadu_ps(y + j + 32)), d = _mm512_max_ps(d, _mm512_loadu_ps(y + j + 48));
    }
    for (; j + 16 <= n; j += 16) a = _mm512_max_ps(a, _mm512_loadu_ps(y + j));
    float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
    for (; j < n; ++j) m = std::max(m, y[j]);
    return m;
  }
#endif
  return row_max(y, n);
}

// 2^(a · y[j] + b) for j < wr, rounded to the half type T into dst[0:wk]
// (zeros from wr on); returns the sum of the unrounded values. -inf scores
// give exactly 0.
template <typename T>
float exp2_row_to_half_as(const float* y, int64_t wr, int64_t wk, float a, float b, h16* dst) {
  using Vf = Vec<float>;
  using Vh = at::vec::Vectorized<T>;
  const Vf va(a), vb(b);
  Vf s0(0.f), s1(0.f);
  T* out = reinterpret_cast<T*>(dst);
  int64_t j = 0;
  for (; j + Vh::size() <= wr; j += Vh::size()) {
    const Vf lo = exp2_fast(at::vec::fmadd(Vf::loadu(y + j), va, vb));
    const Vf hi = exp2_fast(at::vec::fmadd(Vf::loadu(y + j + Vf::size()), va, vb));
    s0 += lo, s1 += hi;
    at::vec::convert_from_float<T>(lo, hi).store(out + j);
  }
  float sum = hsum(s0 + s1);
  for (; j < wr; ++j) {
    const float e = std::exp2(std::fma(y[j], a, b));
    sum += e;
    out[j] = T(e);
  }
  for (; j < wk; ++j) out[j] = T(0.f);
  return sum;
}

#if ATTNKERN_HAS(AVX512) && ATTNKERN_HAS(GNU_EXTENSIONS)
// exp2_row_to_half_as for bfloat16 where cpu_has_avx512_bf16() (every AMX
// CPU has the extension): vcvtne2ps2bf16 rounds two vectors in one
// instruction (reduced_store.h says why the values are the same).
__attribute__((target("avx512bf16"))) float exp2_row_to_bf16_native(const float* y, int64_t wr, int64_t wk, float a,
                                                                     float b, h16* dst) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= wr; j += 32) {
    const __m512 lo = exp2_fast(_mm512_fmadd_ps(_mm512_loadu_ps(y + j), va, vb));
    const __m512 hi = exp2_fast(_mm512_fmadd_ps(_mm512_loadu_ps(y + j + 16), va, vb));
    s0 = _mm512_add_ps(s0, lo), s1 = _mm512_add_ps(s1, hi);
    _mm512_storeu_si512(dst + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; j < wr; ++j) {
    const float e = std::exp2(std::fma(y[j], a, b));
    sum += e;
    dst[j] = c10::BFloat16(e).x;
  }
  for (; j < wk; ++j) dst[j] = 0;
  return sum;
}
#endif

inline float exp2_row_to_half(bool fp16, const float* y, int64_t wr, int64_t wk, float a, float b, h16* dst) {
  if (fp16) return exp2_row_to_half_as<c10::Half>(y, wr, wk, a, b, dst);
#if ATTNKERN_HAS(AVX512) && ATTNKERN_HAS(GNU_EXTENSIONS)
  if (cpu_has_avx512_bf16()) return exp2_row_to_bf16_native(y, wr, wk, a, b, dst);
#endif
  return exp2_row_to_half_as<c10::BFloat16>(y, wr, wk, a, b, dst);
}

constexpr float kLog2e = 1.4426950408889634f;

// The scores of a tile for the fused half-type passes, y (m x w, row stride
// ldy): the raw products when there is no mask and the scale keeps the
// scores' order, so that the exponentials apply the scale; else scaled and
// masked in a pass of their own (scores_half_masked). Returns the factor the
// exponentials still apply (the scale, or 1). Causal tiles are cut at the
// band's end by the caller (Problem::keys_seen).
inline float half_tile_scores(const Problem<float>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0,
                              int64_t w, float* y, int64_t ldy) {
  if (P.mask == nullptr && P.scale > 0.f) {
    scores_half(P.hg, m, w, P.key0 + j0, P.E, P.q16_rows(bi, h, i0), P.k16_head(bi, h / P.group()), y, ldy);
    mask_band_start(P, bi, i0, m, j0, w, y, ldy);
    return P.scale;
  }
  scores_half_masked(P, bi, h, i0, m, j0, w, y, ldy);
  return 1.f;
}

// softmax_forward_block with half-type GEMMs and no dropout: each tile's
// scores go through two passes, the row max, and the exponentials rounded
// straight into the A operand of P·V (the scale folded into them), where a
// scale pass, a max pass, an exponential pass and a rounding pass each read
// the tile: with the products on AMX tiles, those passes set the speed.
template <typename acc_t>
void softmax_forward_block_half(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                                acc_t* y, acc_t* o, acc_t* mrow, acc_t* lrow) {
  static_assert(std::is_same_v<acc_t, float>, "half-type GEMMs accumulate in float32");
  constexpr float inf = std::numeric_limits<float>::infinity();
  const int64_t hk = h / P.group();
  const int64_t BN = softmax_block_keys(P.q16 != nullptr);
  thread_local std::vector<h16> ph;
  ph.resize(m * round_up_k(BN));
  for (int64_t j0 = 0; j0 < n; j0 += BN) {
    const int64_t w = std::min(BN, n - j0), ldy = half_tile_ld(w), wk = round_up_k(w);
    const float sc = half_tile_scores(P, bi, h, i0, m, j0, w, y, ldy);
    for (int64_t r = 0; r < m; ++r) {
      const float* row = y + r * ldy;
      h16* prow = ph.data() + r * wk;
      const int64_t wr = P.keys_seen(bi, i0 + r, j0, w);
      const float bm = wr > 0 ? sc * row_max_loose(row, wr) : -inf;
      const float old = mrow[r];
      float mx = std::max(old, bm);
      if (bm != bm || old != old) mx = std::numeric_limits<float>::quiet_NaN();
      if (mx == -inf || mx != mx) {  // nothing allowed yet, or NaN: zeros (NaN is set below)
        std::fill(prow, prow + wk, h16(0));
        if (mx != mx) mrow[r] = mx;
        continue;
      }
      // exp(sc · y - mx) = 2^(sc·log2(e) · y - mx·log2(e))
      const float sum = exp2_row_to_half(P.hg.fp16, row, wr, wk, sc * kLog2e, -mx * kLog2e, prow);
      if (sum != sum) {  // a NaN score
        std::fill(prow, prow + wk, h16(0));
        mrow[r] = sum;
        continue;
      }
      online_step(old, mx, sum, mrow[r], lrow[r], o + r * P.Ev, P.Ev);
    }
    // The first tile writes o (rows with nothing allowed yet get 0 · V = 0).
    pv_half_rows(P.hg, m, wk, P.key0 + j0, ph.data(), P.v16_head(bi, hk), P.S, P.Ev, o, j0 > 0);
  }
}

// Softmax forward of one block of query rows, online over key tiles (as
// FlashAttention): the scores of a tile stay in L2 and the output is
// rescaled when the running max grows; o (m x Ev) accumulates P·V in place.
// y: m x softmax_block_keys(half) scratch; mrow, lrow: m entries.
template <typename acc_t>
void softmax_forward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                           acc_t* y, acc_t* o, float* c, acc_t* mrow, acc_t* lrow) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  const int64_t hk = h / P.group();
  const int64_t BN = softmax_block_keys(P.q16 != nullptr);
  std::fill(mrow, mrow + m, -inf);
  std::fill(lrow, lrow + m, acc_t(0));
  bool done = false;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (P.v16 && !P.drop.on) {
      softmax_forward_block_half(P, bi, h, i0, m, n, y, o, mrow, lrow);
      done = true;
    }
  }
  for (int64_t j0 = 0; j0 < n && !done; j0 += BN) {
    const int64_t w = std::min(BN, n - j0), ldy = round_up_panel<acc_t>(w);
    score_tile(P, bi, h, i0, m, j0, w, y, ldy);
    for (int64_t r = 0; r < m; ++r) {
      acc_t* row = y + r * ldy;
      const acc_t bm = row_max(row, w);
      const acc_t old = mrow[r];
      if (bm != bm || old != old) {
        std::fill(row, row + w, nan);
        mrow[r] = nan;
        continue;
      }
      const acc_t mx = std::max(old, bm);
      if (mx == -inf) {  // nothing allowed yet in this row
        std::fill(row, row + w, acc_t(0));
        continue;
      }
      const acc_t sum = exp_shifted(row, w, mx, row);  // exp_u20, in place
      online_step(old, mx, sum, mrow[r], lrow[r], o + r * P.Ev, P.Ev);
    }
    if (P.drop.on) apply_dropout(P.drop, y, m, w, ldy, P.row_id(bi, h, i0), P.key0 + j0);
    // The first tile writes o (rows with nothing allowed yet get 0 · V = 0).
    if constexpr (std::is_same_v<acc_t, float>) {
      if (P.v16) {
        pv_half(P.hg, m, w, P.key0 + j0, y, ldy, P.v16_head(bi, hk), P.S, P.Ev, o, j0 > 0);
        continue;
      }
    }
    tile_gemm<acc_t>(m, P.Ev, w, acc_t(1), y, ldy, 1, P.v_head(bi, hk) + j0 * P.Ev, P.Ev, kPanel<acc_t>, o, P.Ev,
                     j0 > 0);
  }
  for (int64_t r = 0; r < m; ++r) {
    acc_t* orow = o + r * P.Ev;
    if (mrow[r] != mrow[r]) {
      std::fill(orow, orow + P.Ev, nan);
      c[r] = std::numeric_limits<float>::quiet_NaN();
    } else if (mrow[r] == -inf || !(lrow[r] > acc_t(0))) {
      std::fill(orow, orow + P.Ev, acc_t(0));
      c[r] = std::numeric_limits<float>::infinity();
    } else {
      const acc_t f = acc_t(1) / lrow[r];
      for (int64_t e = 0; e < P.Ev; ++e) orow[e] *= f;
      c[r] = static_cast<float>(mrow[r] + std::log(lrow[r]));
    }
  }
}

// The three B / A operands of a backward tile with half-type GEMMs, from its
// scores y and dP = dO·Vᵀ (d), both m x w with row stride ldy: P =
// 2^(a·y + b[r]) and dS = scale · P ⊙ (dP − δ[r]) on the first lim[r] keys
// of row r (zero past them), rounded to the half type and packed as
// pack_rows packs (P into ppack for dVᵀ += dOᵀ·P, dS into dspack for
// dKᵀ += Qᵀ·dS; round_up_k(m) rows) and, for dQ = dS·K, as rows of wk =
// round_up_k(w) (dsrows). One pass over the tile, where the exponentials, dS, two
// pack_rows and a rounding of dS each read it.
void backward_half_operands(const HalfGemm& g, const float* y, const float* d, int64_t m, int64_t w, int64_t ldy,
                            const int64_t* lim, float a, const float* b, const float* delta, float scale,
                            h16* ppack, h16* dspack, h16* dsrows) {
  const int64_t wk = round_up_k(w);
#if ATTNKERN_HAS(AVX512)
  const int64_t mk = round_up_k(m);
  const bool fp16 = g.fp16;
  const __m512 va = _mm512_set1_ps(a), vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < mk; i += 2) {
    for (int64_t c0 = 0; c0 < w; c0 += kVnniBlock) {
      const int64_t bw = (std::min(kVnniBlock, w - c0) + 15) / 16 * 16;
      h16* pp = ppack + c0 * mk + i * bw;
      h16* dp = dspack + c0 * mk + i * bw;
      for (int64_t c = 0; c < bw; c += 16) {
        const int64_t j = c0 + c;
        __m512i pb[2], sb[2];
        for (int64_t q = 0; q < 2; ++q) {
          const int64_t r = i + q;
          const int64_t live_n = r < m ? std::clamp<int64_t>(lim[r] - j, 0, 16) : 0;
          pb[q] = sb[q] = _mm512_setzero_si512();
          if (live_n > 0) {
            const __mmask16 live = static_cast<__mmask16>((1u << live_n) - 1);
            const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(y + r * ldy + j), va, _mm512_set1_ps(b[r]));
            const __m512 p = _mm512_maskz_mov_ps(live, exp2_fast(t));
            const __m512 dpv = _mm512_sub_ps(_mm512_loadu_ps(d + r * ldy + j), _mm512_set1_ps(delta[r]));
            const __m512 ds = _mm512_maskz_mul_ps(live, _mm512_mul_ps(vscale, p), dpv);
            pb[q] = half_bits(p, fp16);
            sb[q] = half_bits(ds, fp16);
          }
          if (r < m && j < wk) {  // (zeros too: the row's stale scratch must not reach dQ)
            const int64_t n = std::min<int64_t>(16, wk - j);
            _mm256_mask_storeu_epi16(dsrows + r * wk + j, static_cast<__mmask16>((1u << n) - 1),
                                     _mm512_cvtepi32_epi16(sb[q]));
          }
        }
        if (g.vnni) {
          _mm512_storeu_si512(pp + 2 * c, _mm512_or_si512(pb[0], _mm512_slli_epi32(pb[1], 16)));
          _mm512_storeu_si512(dp + 2 * c, _mm512_or_si512(sb[0], _mm512_slli_epi32(sb[1], 16)));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + c), _mm512_cvtepi32_epi16(pb[0]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + bw + c), _mm512_cvtepi32_epi16(pb[1]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dp + c), _mm512_cvtepi32_epi16(sb[0]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dp + bw + c), _mm512_cvtepi32_epi16(sb[1]));
        }
      }
    }
  }
  const int64_t written = (w + 15) / 16 * 16;  // dsrows' columns the vectors reached
  for (int64_t r = 0; r < m && written < wk; ++r) std::fill(dsrows + r * wk + written, dsrows + (r + 1) * wk, h16(0));
#else
  // (Below AVX512 only the test emulation runs half-type GEMMs: the same
  // values in float first, then packed and rounded as the separate passes do.)
  using Vf = Vec<float>;
  thread_local std::vector<float> pf, sf;
  pf.assign(m * ldy, 0.f);
  sf.assign(m * ldy, 0.f);
  const Vf va(a), vscale(scale);
  for (int64_t r = 0; r < m; ++r) {
    const Vf vb(b[r]), vdelta(delta[r]);
    for (int64_t j = 0; j < lim[r]; j += Vf::size()) {
      const int64_t n = std::min<int64_t>(Vf::size(), lim[r] - j);
      const Vf p = exp2_fast(at::vec::fmadd(Vf::loadu(y + r * ldy + j), va, vb));
      const Vf ds = vscale * p * (Vf::loadu(d + r * ldy + j) - vdelta);
      p.store(pf.data() + r * ldy + j, n);
      ds.store(sf.data() + r * ldy + j, n);
    }
  }
  pack_rows(g, pf.data(), m, w, ldy, ppack);
  pack_rows(g, sf.data(), m, w, ldy, dspack);
  rows_to_half(g.fp16, sf.data(), m, w, ldy, dsrows, wk);
#endif
}

// δ = Σ_j P_j dP_j per row when one key tile holds the rows, from that
// tile's own P (p, unnormalized; the first lim[r] entries of row r) and dP
// (d), both with row stride ldy. With P normalized to sum to 1 (in place),
// each row's dS = P ⊙ (dP - δ) sums to zero as the exact one does (one
// allowed key: P = 1 and dS = 0 exactly), where δ = dO·O from the forward's
// output carries the forward's roundings, that of a half-type output among
// them. Returns the row sums of P (0: the row keeps `delta`) in sums and the
// deltas in out.
template <typename acc_t>
void tile_deltas(int64_t m, const int64_t* lim, acc_t* p, const acc_t* d, int64_t ldy, const acc_t* delta,
                 acc_t* sums, acc_t* out) {
  using V = Vec<acc_t>;
  for (int64_t r = 0; r < m; ++r) {
    acc_t* prow = p + r * ldy;
    const acc_t* drow = d + r * ldy;
    const int64_t w = lim[r];
    V vs(0);
    int64_t j = 0;
    for (; j + V::size() <= w; j += V::size()) vs += V::loadu(prow + j);
    acc_t sum = hsum(vs);
    for (; j < w; ++j) sum += prow[j];
    sums[r] = sum > acc_t(0) && sum < std::numeric_limits<acc_t>::infinity() ? sum : acc_t(0);
    if (sums[r] == acc_t(0)) {
      out[r] = delta[r];
      continue;
    }
    const V vsum(sum);
    V vdot(0);
    for (j = 0; j + V::size() <= w; j += V::size()) {
      const V pj = V::loadu(prow + j) / vsum;  // (a division: P / P is exactly 1)
      pj.store(prow + j);
      vdot = at::vec::fmadd(pj, V::loadu(drow + j), vdot);
    }
    acc_t dot = hsum(vdot);
    for (; j < w; ++j) {
      prow[j] /= sum;
      dot += prow[j] * drow[j];
    }
    out[r] = dot;
  }
}

// Softmax backward of one block of query rows over its key tiles, as
// FlashAttention: P is recomputed from the saved log-sum-exp c, δ = dO·O per
// row (delta) replaces Σ_j p_j dp_j (except for rows within one key tile:
// tile_deltas), and dS = scale · P ⊙ (dO·Vᵀ − δ).
// dQ (dqb, m x E) = Σ over tiles of dS·K; dK += dSᵀ·Q and dV += Pᵀ·dO go
// into the chunk's accumulators dk, dv (from key key0: the caller offsets them).
// y, d: m x softmax_block_keys(half) scratch; lse: m entries.
template <typename acc_t>
void softmax_backward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                            const float* c, const acc_t* delta, const acc_t* dob, acc_t* dqb, acc_t* dk,
                            acc_t* dv, acc_t* y, acc_t* d, acc_t* lse, std::vector<float>& keep) {
  using V = Vec<acc_t>;
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const int64_t hk = h / P.group();
  // (No float copies of q, k and V's panels with half-type GEMMs.)
  const acc_t* qb = P.q ? P.q_rows(bi, h, i0) : nullptr;
  const acc_t* kh = P.k ? P.k_head(bi, hk) : nullptr;
  const acc_t* vp = P.vp ? P.vp_head(bi, hk) : nullptr;
  const int64_t BN = softmax_block_keys(P.q16 != nullptr);
  for (int64_t r = 0; r < m; ++r) lse[r] = static_cast<acc_t>(c[r]);
  // Half-type GEMMs (P.do16): Qᵀ and dOᵀ of the block, the A operands of
  // dKᵀ += Qᵀ·dS and dVᵀ += dOᵀ·P; P and dS of a tile packed as their B
  // operands (pack_rows) in yk.
  const bool b16 = P.do16 != nullptr;
  const int64_t mk = round_up_k(m);
  const h16* do16 = b16 ? P.do16 + P.row_id(bi, h, i0) * P.Ev : nullptr;  // the block's dO rows
  thread_local std::vector<h16> qt, dot_t, yk;
  if (b16) {
    qt.resize(P.E * mk);
    dot_t.resize(P.Ev * mk);
    yk.resize(mk * round_up_vnni(BN));
    transpose_half(P.q16_rows(bi, h, i0), m, P.E, P.E, qt.data(), mk);
    transpose_half(do16, m, P.Ev, P.Ev, dot_t.data(), mk);
  }
  const int64_t ldt = round_up_vnni(P.S);  // row stride of the transposed dK, dV accumulators
  // (Scratch of the single-tile rows' P and δ: tile_deltas.)
  thread_local std::vector<int64_t> tile_lim;
  thread_local std::vector<float> tile_p, tile_sum, tile_delta;
  thread_local std::vector<acc_t> acc_sum, acc_delta;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (b16 && !P.drop.on) {
      // Per tile: the scores (half_tile_scores) and dP, then
      // backward_half_operands makes the three GEMMs' operands in one pass.
      thread_local std::vector<h16> dsk, dsa;
      thread_local std::vector<int64_t> lim;
      thread_local std::vector<float> shift2;
      dsk.resize(mk * round_up_vnni(BN));
      dsa.resize(m * round_up_k(BN));
      lim.resize(m);
      shift2.resize(m);
      for (int64_t r = 0; r < m; ++r) shift2[r] = -lse[r] * kLog2e;  // (+inf: no allowed key, P = 0)
      // A tile's scores and dP (in y and d), with each row's keys seen in lim.
      auto tile_scores_dp = [&](int64_t j0, int64_t w, int64_t ldy) {
        const float sc = half_tile_scores(P, bi, h, i0, m, j0, w, y, ldy);
        scores_half(P.hg, m, w, P.key0 + j0, P.Ev, do16, P.vk16_head(bi, hk), d, ldy);
        for (int64_t r = 0; r < m; ++r) lim[r] = P.keys_seen(bi, i0 + r, j0, w);
        return sc;
      };
      // The tile's P (unnormalized) and δ (tile_deltas), P into scratch.
      auto tile_p_delta = [&](float sc, int64_t ldy) {
        tile_p.resize(m * ldy);
        tile_sum.resize(m);
        tile_delta.resize(m);
        const Vec<float> va(sc * kLog2e);
        for (int64_t r = 0; r < m; ++r) {
          const Vec<float> vb(shift2[r]);
          for (int64_t j = 0; j < lim[r]; j += Vec<float>::size())
            (Vec<float>::loadu(y + r * ldy + j) * va + vb).exp2().store(tile_p.data() + r * ldy + j);
        }
        tile_deltas<float>(m, lim.data(), tile_p.data(), d, ldy, delta, tile_sum.data(), tile_delta.data());
      };
      const float* row_delta = delta;
      thread_local std::vector<float> own_sum, own_delta;
      if (n > BN && P.own_delta) {
        // δ = Σ P dP over every tile of the row, with P normalized by its sum
        // (which also goes into the shifts), before the tiles' products.
        own_sum.assign(m, 0.f);
        own_delta.assign(m, 0.f);
        for (int64_t j0 = 0; j0 < n; j0 += BN) {
          const int64_t w = std::min(BN, n - j0), ldy = half_tile_ld(w);
          tile_p_delta(tile_scores_dp(j0, w, ldy), ldy);
          for (int64_t r = 0; r < m; ++r) {
            own_sum[r] += tile_sum[r];
            own_delta[r] += tile_sum[r] * tile_delta[r];
          }
        }
        for (int64_t r = 0; r < m; ++r) {
          if (own_sum[r] > 0.f) {
            shift2[r] -= std::log2(own_sum[r]);
            own_delta[r] /= own_sum[r];
          } else {
            own_delta[r] = delta[r];
          }
        }
        row_delta = own_delta.data();
      }
      for (int64_t j0 = 0; j0 < n; j0 += BN) {
        const int64_t w = std::min(BN, n - j0), ldy = half_tile_ld(w);
        const float sc = tile_scores_dp(j0, w, ldy);
        const float* dl = row_delta;
        if (n <= BN) {
          // One tile holds the rows: P and δ from the tile itself (its
          // normalization goes into the shifts).
          tile_p_delta(sc, ldy);
          for (int64_t r = 0; r < m; ++r)
            if (tile_sum[r] > 0.f) shift2[r] -= std::log2(tile_sum[r]);
          dl = tile_delta.data();
        }
        backward_half_operands(P.hg, y, d, m, w, ldy, lim.data(), sc * kLog2e, shift2.data(), dl, P.scale,
                               yk.data(), dsk.data(), dsa.data());
        // dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS, dQ (+)= dS·K.
        rows_product_half(P.hg, P.Ev, m, w, dot_t.data(), yk.data(), dv + j0, ldt);
        rows_product_half(P.hg, P.E, m, w, qt.data(), dsk.data(), dk + j0, ldt);
        pv_half_rows(P.hg, m, round_up_k(w), P.key0 + j0, dsa.data(), P.kv16_head(bi, hk), P.S, P.E, dqb, j0 > 0);
      }
      return;
    }
  }
  // dP = dO·Vᵀ of a tile into d, the dropout's keep flags applied (kept in
  // keep, which drops P for dV too).
  auto tile_dp = [&](int64_t j0, int64_t w, int64_t ldy) {
    bool dp_done = false;
    if constexpr (std::is_same_v<acc_t, float>) {
      if (b16) {
        scores_half(P.hg, m, w, P.key0 + j0, P.Ev, do16, P.vk16_head(bi, hk), d, ldy);
        dp_done = true;
      }
    }
    if (!dp_done && vp) {
      tile_gemm<acc_t>(m, ldy, P.Ev, acc_t(1), dob, P.Ev, 1, vp + j0 * P.Ev, kPanel<acc_t>, P.Ev * kPanel<acc_t>,
                       d, ldy, false);
    } else if (!dp_done) {  // (a few query rows: V unpacked)
      gemm_unpacked_keys<acc_t>(m, w, P.Ev, acc_t(1), dob, P.v_head(bi, hk) + j0 * P.Ev, d, ldy);
    }
    if (P.drop.on) {
      // dP of the kept weights, times 1 / (1 - p).
      keep.resize(static_cast<size_t>(m * w));
      for (int64_t r = 0; r < m; ++r) {
        dropout_keeps(P.drop, P.row_id(bi, h, i0) + r, P.key0 + j0, w, keep.data() + r * w);
        apply_keep(d + r * ldy, keep.data() + r * w, w, P.drop);
      }
    }
  };
  const acc_t* row_delta = delta;
  thread_local std::vector<acc_t> own_delta;
  if (n > BN && (std::is_same_v<acc_t, double> || P.L <= kDecodeRows || P.own_delta)) {
    // The shift is stored in float32: one pass over the row's tiles sums
    // exp(s - c) and corrects c to double precision. Calls of a few query
    // rows take it in float32 too: their forward (decoding) summed the
    // scores' products in another order than the tiles recompute them, so
    // that P = exp(s - c) would not sum to 1 (at scores of order 80, one ulp
    // of c is 8e-6); the pass costs one score GEMM over a few rows. With
    // P.own_delta the same pass takes δ = Σ P dP (dP's GEMM too). (Rows
    // within one tile need no pass: tile_deltas normalizes their P.)
    std::vector<acc_t> sums(m, acc_t(0));
    if (P.own_delta) own_delta.assign(m, acc_t(0));
    for (int64_t j0 = 0; j0 < n; j0 += BN) {
      const int64_t w = std::min(BN, n - j0), ldy = round_up_panel<acc_t>(w);
      score_tile(P, bi, h, i0, m, j0, w, y, ldy);
      for (int64_t r = 0; r < m; ++r)
        if (std::isfinite(lse[r])) sums[r] += exp_shifted(y + r * ldy, w, lse[r], y + r * ldy);
      if (P.own_delta) {
        tile_dp(j0, w, ldy);
        for (int64_t r = 0; r < m; ++r)
          if (std::isfinite(lse[r])) own_delta[r] += dot(y + r * ldy, d + r * ldy, w);
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      const bool ok = std::isfinite(lse[r]) && sums[r] > 0;
      if (ok) lse[r] += std::log(sums[r]);
      if (P.own_delta) own_delta[r] = ok ? own_delta[r] / sums[r] : delta[r];
    }
    if (P.own_delta) row_delta = own_delta.data();
  }
  for (int64_t j0 = 0; j0 < n; j0 += BN) {
    const int64_t w = std::min(BN, n - j0), ldy = round_up_panel<acc_t>(w);
    score_tile(P, bi, h, i0, m, j0, w, y, ldy);
    for (int64_t r = 0; r < m; ++r) {
      acc_t* row = y + r * ldy;
      if (lse[r] != lse[r]) {
        std::fill(row, row + w, std::numeric_limits<acc_t>::quiet_NaN());
      } else if (lse[r] == inf) {  // no allowed key
        std::fill(row, row + w, acc_t(0));
      } else {
        exp_shifted(row, w, lse[r], row);
      }
    }
    // dP, then dS in place.
    tile_dp(j0, w, ldy);
    const acc_t* dl = row_delta;
    if (n <= BN) {
      // One tile holds the rows: P normalized and δ from the tile itself.
      tile_lim.assign(m, w);
      acc_sum.resize(m);
      acc_delta.resize(m);
      tile_deltas<acc_t>(m, tile_lim.data(), y, d, ldy, delta, acc_sum.data(), acc_delta.data());
      dl = acc_delta.data();
    }
    const V vscale(P.scale);
    for (int64_t r = 0; r < m; ++r) {
      const acc_t* prow = y + r * ldy;
      acc_t* drow = d + r * ldy;
      const V vdelta(dl[r]);
      int64_t j = 0;
      for (; j + V::size() <= w; j += V::size())
        (vscale * V::loadu(prow + j) * (V::loadu(drow + j) - vdelta)).store(drow + j);
      for (; j < w; ++j) drow[j] = P.scale * prow[j] * (drow[j] - dl[r]);
    }
    if (P.drop.on)
      for (int64_t r = 0; r < m; ++r) apply_keep(y + r * ldy, keep.data() + r * w, w, P.drop);
    if constexpr (std::is_same_v<acc_t, float>) {
      if (b16) {
        // dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS, dQ (+)= dS·K.
        pack_rows(P.hg, y, m, w, ldy, yk.data());
        rows_product_half(P.hg, P.Ev, m, w, dot_t.data(), yk.data(), dv + j0, ldt);
        pack_rows(P.hg, d, m, w, ldy, yk.data());
        rows_product_half(P.hg, P.E, m, w, qt.data(), yk.data(), dk + j0, ldt);
        pv_half(P.hg, m, w, P.key0 + j0, d, ldy, P.kv16_head(bi, hk), P.S, P.E, dqb, j0 > 0);
        continue;
      }
    }
    // dV += Pᵀ·dO, dK += dSᵀ·Q (A read transposed), dQ (+)= dS·K.
    tile_gemm<acc_t>(w, P.Ev, m, acc_t(1), y, 1, ldy, dob, P.Ev, kPanel<acc_t>, dv + j0 * P.Ev, P.Ev, true);
    tile_gemm<acc_t>(w, P.E, m, acc_t(1), d, 1, ldy, qb, P.E, kPanel<acc_t>, dk + j0 * P.E, P.E, true);
    tile_gemm<acc_t>(m, P.E, w, acc_t(1), d, ldy, 1, kh + j0 * P.E, P.E, kPanel<acc_t>, dqb, P.E, j0 > 0);
  }
}

// Two float vectors of a row of values from p (float, bfloat16 or float16).
template <typename kv_t>
inline void load_pair(const kv_t* p, Vec<float>& a, Vec<float>& b) {
  if constexpr (std::is_same_v<kv_t, float>) {
    a = Vec<float>::loadu(p);
    b = Vec<float>::loadu(p + Vec<float>::size());
  } else {
    std::tie(a, b) = at::vec::convert_to_float<kv_t>(Vec<kv_t>::loadu(p));
  }
}

// Where decode_chunk finds key or value row j of its chunk: at base + j·ld
// (a contiguous or strided cache), or at the address listed for it (a paged
// cache, whose rows' addresses are looked up once per chunk).
template <typename kv_t>
struct StridedRows {
  using value_type = kv_t;
  const kv_t* base;
  int64_t ld;
  const kv_t* operator()(int64_t j) const { return base + j * ld; }
};
template <typename kv_t>
struct ListedRows {
  using value_type = kv_t;
  const char* const* rows;
  const kv_t* operator()(int64_t j) const { return reinterpret_cast<const kv_t*>(rows[j]); }
};

// Rows a decoding pass asks for this many rows before it reads them, where
// they are listed: a paged cache's pages lie anywhere, and a page's rows of
// one head (a few hundred bytes each, a page's heads apart) are too few for
// a hardware prefetcher to follow before the next page. Contiguous rows are
// left to the prefetchers, which asking only slows.
constexpr int64_t kListedRowsAhead = 16;

template <typename Rows>
inline void ask_row_ahead(const Rows& rows, int64_t j, int64_t w, int64_t row_bytes) {
  if constexpr (std::is_same_v<Rows, ListedRows<typename Rows::value_type>>) {
    if (j + kListedRowsAhead < w)
      prefetch_span(reinterpret_cast<const char*>(rows(j + kListedRowsAhead)), row_bytes, false);
  }
}

// o[0:ev] = Σ_j y[j] v(j)[0:ev] over the keys with y[j] != 0 (o zero on
// entry), the columns in register blocks of four vectors: an axpy per key
// would carry every column through a store and a reload. Keys are added in
// order, as by the axpys.
template <typename Rows>
void accumulate_pv(const float* y, int64_t w, const Rows& v, int64_t ev, float* o) {
  using kv_t = typename Rows::value_type;
  using Vf = Vec<float>;
  constexpr int64_t W2 = 2 * Vf::size();
  int64_t c = 0;
  for (; c + 2 * W2 <= ev; c += 2 * W2) {
    Vf a0(0), a1(0), a2(0), a3(0), x0, x1, x2, x3;
    for (int64_t j = 0; j < w; ++j) {
      if (c == 0) ask_row_ahead(v, j, w, ev * static_cast<int64_t>(sizeof(kv_t)));
      if (y[j] == 0.f) continue;
      const Vf p(y[j]);
      load_pair(v(j) + c, x0, x1);
      load_pair(v(j) + c + W2, x2, x3);
      a0 = a0 + p * x0, a1 = a1 + p * x1, a2 = a2 + p * x2, a3 = a3 + p * x3;
    }
    a0.store(o + c), a1.store(o + c + Vf::size()), a2.store(o + c + W2), a3.store(o + c + W2 + Vf::size());
  }
  for (; c + W2 <= ev; c += W2) {
    Vf a0(0), a1(0), x0, x1;
    for (int64_t j = 0; j < w; ++j) {
      if (y[j] == 0.f) continue;
      const Vf p(y[j]);
      load_pair(v(j) + c, x0, x1);
      a0 = a0 + p * x0, a1 = a1 + p * x1;
    }
    a0.store(o + c), a1.store(o + c + Vf::size());
  }
  if (c == ev) return;
  for (int64_t j = 0; j < w; ++j) {  // the last columns (fewer than a pair of vectors)
    if (y[j] == 0.f) continue;
    if constexpr (std::is_same_v<kv_t, float>) {
      axpy(o + c, v(j) + c, y[j], ev - c);
    } else {
      for (int64_t e = c; e < ev; ++e) o[e] += y[j] * static_cast<float>(v(j)[e]);
    }
  }
}

// Softmax forward of a few query rows (decoding) split over key chunks: the
// scores of keys [j0, j0 + w) against the m rows from i0, exponentiated
// against the chunk's own row max mx; o (m x Ev) = that chunk's
// unnormalised P·V, l = its row sums. softmax_merge_chunks combines the
// chunks. K and V are read in place (no packing: with one query row the
// packing would cost as much as the product). y: m x w scratch.
// K and V rows (found by k_rows and v_rows: StridedRows or ListedRows) hold
// ek and ev values of kv_t (float, or the half type of the inputs).
template <typename acc_t, typename Rows>
void decode_chunk(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t w,
                  const Rows& k_rows, int64_t ek, const Rows& v_rows, int64_t ev, acc_t* y, acc_t* o, acc_t* mx,
                  acc_t* l) {
  using kv_t = typename Rows::value_type;
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  // A few query rows: dot products and axpys, each key and value row read
  // once for all the rows (BLAS calls on 1-row products cost more than they do).
  const acc_t* qr = P.q_rows(bi, h, i0);
  int64_t j = 0;
#if ATTNKERN_HAS(AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    float s[8];
    const kv_t* rows8[8];
    for (; j + 8 <= w; j += 8) {
      for (int i = 0; i < 8; ++i) rows8[i] = k_rows(j + i), ask_row_ahead(k_rows, j + i, w, ek * sizeof(kv_t));
      for (int64_t r = 0; r < m; ++r) {
        dot8_rows(qr + r * P.E, rows8, ek, s);
        for (int i = 0; i < 8; ++i) y[r * w + j + i] = P.scale * s[i];
      }
    }
  }
#endif
  for (; j < w; ++j)
    for (int64_t r = 0; r < m; ++r) y[r * w + j] = P.scale * dot(qr + r * P.E, k_rows(j), ek);
  mask_scores(P, bi, h, i0, m, j0, w, y, w);
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * w;
    const acc_t bm = row_max(row, w);
    mx[r] = bm;
    if (bm != bm || bm == -inf) {  // NaN row, or nothing allowed in this chunk
      std::fill(row, row + w, acc_t(0));
      l[r] = acc_t(0);
      continue;
    }
    l[r] = exp_shifted(row, w, bm, row);
  }
  if (P.drop.on) apply_dropout(P.drop, y, m, w, w, P.row_id(bi, h, i0), P.key0 + j0);
  std::fill(o, o + m * P.Ev, acc_t(0));  // (columns ev.. of o are padding: zeros)
  if constexpr (std::is_same_v<acc_t, float>) {
    for (int64_t r = 0; r < m; ++r) accumulate_pv(y + r * w, w, v_rows, ev, o + r * P.Ev);
  } else {
    for (int64_t j = 0; j < w; ++j)
      for (int64_t r = 0; r < m; ++r)
        if (y[r * w + j] != acc_t(0)) axpy(o + r * P.Ev, v_rows(j), y[r * w + j], ev);
  }
}

// The addresses of rows j .. j + w - 1 of one (batch bi, kv-head) of a paged
// K or V (Problem::kv_pages) into dst: head is the kv-head's row 0 in page 0
// of the pool, rows are ld apart within a page and pages page_stride apart.
template <typename acc_t, typename kv_t>
void page_rows(const Problem<acc_t>& P, const kv_t* head, int64_t ld, int64_t page_stride, int64_t bi, int64_t j,
               int64_t w, const char** dst) {
  const int64_t* pages = P.kv_pages + bi * P.kv_max_pages;
  for (int64_t t = 0; t < w;) {
    const int64_t page = (j + t) / P.kv_page, row = (j + t) % P.kv_page, run = std::min(w - t, P.kv_page - row);
    const kv_t* src = head + pages[page] * page_stride + row * ld;
    for (int64_t r = 0; r < run; ++r) dst[t + r] = reinterpret_cast<const char*>(src + r * ld);
    t += run;
  }
}

template <typename acc_t>
void softmax_decode_chunk(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0,
                          int64_t w, acc_t* y, acc_t* o, acc_t* mx, acc_t* l, PagedRows& paged) {
  const int64_t hk = h / P.group(), j = P.key0 + j0;
  if (P.kv_pages) {
    // A paged cache: the chunk's rows read in place, their addresses looked
    // up from the page table into the thread's PagedRows unless it holds
    // them (the query heads of a kv-head run back to back). The arithmetic is
    // the contiguous call's.
    auto run = [&](auto tag, const void* k, const void* v, int64_t ek, int64_t ev) {
      using kv_t = decltype(tag);
      if (paged.bi != bi || paged.hk != hk || paged.j != j || paged.w != w) {
        page_rows(P, static_cast<const kv_t*>(k) + hk * P.k_stride[1], P.k_stride[2], P.k_stride[0], bi, j, w,
                  paged.k_rows);
        page_rows(P, static_cast<const kv_t*>(v) + hk * P.v_stride[1], P.v_stride[2], P.v_stride[0], bi, j, w,
                  paged.v_rows);
        paged.bi = bi, paged.hk = hk, paged.j = j, paged.w = w;
      }
      decode_chunk(P, bi, h, i0, m, j0, w, ListedRows<kv_t>{paged.k_rows}, ek, ListedRows<kv_t>{paged.v_rows}, ev,
                   y, o, mx, l);
    };
    if constexpr (std::is_same_v<acc_t, float>) {
      if (P.k_half) {
        return P.half_is_bf16 ? run(c10::BFloat16(), P.k_half, P.v_half, P.kv_e, P.kv_ev)
                              : run(c10::Half(), P.k_half, P.v_half, P.kv_e, P.kv_ev);
      }
    }
    return run(acc_t(), P.k, P.v, P.kv_e, P.kv_ev);
  }
  if constexpr (std::is_same_v<acc_t, float>) {
    if (P.k_half) {
      const int64_t head = bi * P.Hk + hk;
      auto run = [&](auto tag) {
        using half_t = decltype(tag);
        const half_t* kh = static_cast<const half_t*>(P.k_half) + (head * P.S + j) * P.e_half;
        const half_t* vh = static_cast<const half_t*>(P.v_half) + (head * P.S + j) * P.ev_half;
        decode_chunk(P, bi, h, i0, m, j0, w, StridedRows<half_t>{kh, P.e_half}, P.e_half,
                     StridedRows<half_t>{vh, P.ev_half}, P.ev_half, y, o, mx, l);
      };
      return P.half_is_bf16 ? run(c10::BFloat16()) : run(c10::Half());
    }
  }
  if (P.kv_strided) {
    const acc_t* kh = P.k + bi * P.k_stride[0] + hk * P.k_stride[1] + j * P.k_stride[2];
    const acc_t* vh = P.v + bi * P.v_stride[0] + hk * P.v_stride[1] + j * P.v_stride[2];
    return decode_chunk(P, bi, h, i0, m, j0, w, StridedRows<acc_t>{kh, P.k_stride[2]}, P.E,
                        StridedRows<acc_t>{vh, P.v_stride[2]}, P.Ev, y, o, mx, l);
  }
  decode_chunk(P, bi, h, i0, m, j0, w, StridedRows<acc_t>{P.k_head(bi, hk) + j0 * P.E, P.E}, P.E,
               StridedRows<acc_t>{P.v_head(bi, hk) + j0 * P.Ev, P.Ev}, P.Ev, y, o, mx, l);
}

// The output rows (m x Ev) and log-sum-exp c of one head from its nchunks
// chunk results (chunk u at o + u·m·Ev, mx + u·m, l + u·m), in chunk order.
template <typename acc_t>
void softmax_merge_chunks(int64_t m, int64_t Ev, int64_t nchunks, const acc_t* o, const acc_t* mx, const acc_t* l,
                          acc_t* out, float* c) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  for (int64_t r = 0; r < m; ++r) {
    acc_t* orow = out + r * Ev;
    acc_t top = -inf;
    bool nan = false;
    for (int64_t u = 0; u < nchunks; ++u) {
      const acc_t v = mx[u * m + r];
      nan |= v != v;
      top = std::max(top, v);
    }
    if (nan || top == inf) {
      std::fill(orow, orow + Ev, std::numeric_limits<acc_t>::quiet_NaN());
      c[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    std::fill(orow, orow + Ev, acc_t(0));
    acc_t sum = 0;
    for (int64_t u = 0; u < nchunks; ++u) {
      const acc_t v = mx[u * m + r];
      if (v == -inf) continue;
      const acc_t f = std::exp(v - top);
      sum += f * l[u * m + r];
      axpy(orow, o + (u * m + r) * Ev, f, Ev);
    }
    if (!(sum > acc_t(0))) {
      std::fill(orow, orow + Ev, acc_t(0));
      c[r] = std::numeric_limits<float>::infinity();
      continue;
    }
    const acc_t inv = acc_t(1) / sum;
    for (int64_t e = 0; e < Ev; ++e) orow[e] *= inv;
    c[r] = static_cast<float>(top + std::log(sum));
  }
}

#define AK_INSTANTIATE_SOFTMAX(T)                                                                              \
  template void softmax_forward_block<T>(const Problem<T>&, int64_t, int64_t, int64_t, int64_t, int64_t, T*, T*, \
                                         float*, T*, T*);                                                     \
  template void softmax_backward_block<T>(const Problem<T>&, int64_t, int64_t, int64_t, int64_t, int64_t,      \
                                          const float*, const T*, const T*, T*, T*, T*, T*, T*, T*,             \
                                          std::vector<float>&);                                        \
  template void softmax_decode_chunk<T>(const Problem<T>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                        T*, T*, T*, T*, PagedRows&);                                          \
  template void softmax_merge_chunks<T>(int64_t, int64_t, int64_t, const T*, const T*, const T*, T*, float*);
AK_INSTANTIATE_SOFTMAX(float)
AK_INSTANTIATE_SOFTMAX(double)

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

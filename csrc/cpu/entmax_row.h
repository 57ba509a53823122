// Vectorized per-row building blocks of the α-entmax family on the CPU: the
// row max, the threshold ("shift", see attnkern/entmax_math.h), the
// probabilities and the backward of a sparse row. Shared by the row-wise normalizers and the fused attention
// kernels, so each threshold algorithm has one home.
//
// A row is read three times: its max, one pass that gathers the entries that
// can be in the support at all (solve_row), and the write of the
// probabilities; the search for the shift runs over the gathered candidates.
// The shift is found by safeguarded Newton from the left with the candidate
// list compacted after every step: an entry outside the support at a point
// left of the root stays outside, so after a step or two the iterations touch
// only the few entries that can still be in the support. sparsemax and
// entmax15 finish with their closed form on the support. Long enough rows
// of α-entmax and entmax15 start instead from row_max's running maxima
// (subset_start) and gather a shorter list; entmax15 then chooses its
// support by ranks when that list is short (ranked_entmax15_shift).
#pragma once

#include "attnkern/isa_features.h"

#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attnkern/entmax_edge.h"
#include "attnkern/entmax_math.h"
#include "simd.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

using math::Family;

template <typename acc_t>
struct ShiftSums {
  acc_t p = 0, g = 0, h = 0;
};

// Adds the terms of one vector of t = y - c to the running Σp, Σg, Σg/d.
// (Always inlined: out of line, its three sums made a round trip through
// memory at every vector.)
template <typename acc_t, Family FAM>
__attribute__((always_inline)) inline void add_shift_terms(const Vec<acc_t>& t, acc_t b, Vec<acc_t>& sp, Vec<acc_t>& sg, Vec<acc_t>& sh) {
  using V = Vec<acc_t>;
  const V vone(1), vzero(0);
  if constexpr (FAM == Family::kSparsemax) {
    V d = vone + t;
    V pos = d > vzero;
    sp += V::blendv(vzero, d, pos);
    sg += V::blendv(vzero, vone, pos);
  } else if constexpr (FAM == Family::kEntmax15) {
    V d = vone + t * V(acc_t(0.5));
    V pos = d > vzero;
    d = V::blendv(vzero, d, pos);
    sp += d * d;
    sg += d;
    sh += V::blendv(vzero, vone, pos);
  } else {
#if ATTNKERN_HAS(AVX512)
    if constexpr (std::is_same_v<acc_t, float>) {
      if (b >= kFastPowMinB<float>) {
        // The same terms on one support mask (at::vec's compares and
        // blends round-trip each mask through a vector).
        const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(b), t, _mm512_set1_ps(1.0f));
        const __mmask16 pos = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 p = pow_unit_masked(d, 1.0f / b, pos);
        const __m512 r = recip<float>(V(d));
        const __m512 g = _mm512_maskz_mul_ps(pos, p, r);
        sp = _mm512_add_ps(sp, p);
        sg = _mm512_add_ps(sg, g);
        sh = _mm512_mask3_fmadd_ps(g, r, sh, pos);
        return;
      }
    }
#endif
    V bt = V(b) * t;
    V d = vone + bt;
    V pos = d > vzero;
    // b > 0: d in (0, 1] on the support; b < 0: d >= 1, keep the exact path.
    V p = V::blendv(vzero,
                    b >= kFastPowMinB<acc_t> ? pow_unit<acc_t>(d, acc_t(1) / b)
                                             : (bt.log1p() * V(acc_t(1) / b)).exp(),
                    pos);
    // d = +inf (y = -inf, b < 0) gives g = 0; d <= 0 is masked.
    V r = recip<acc_t>(d);
    V g = V::blendv(vzero, p * r, pos);
    sp += p;
    sg += g;
    sh += g * r;
  }
}

// Evaluates the sums at c over src[0:n] and, in the same pass, appends the
// entries above `cut` to dst (which may alias src: it never runs ahead of the
// read position). Returns their count.
template <typename acc_t, Family FAM>
inline int64_t eval_compact(const acc_t* src, int64_t n, acc_t c, acc_t b, acc_t cut, acc_t* dst,
                            ShiftSums<acc_t>& out) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vc(c), vcut(cut);
  V sp(0), sg(0), sh(0);
  int64_t j = 0, k = 0;
  for (; j + kLanes <= n; j += kLanes) {
    V v = V::loadu(src + j);
    const int keep = lane_mask<acc_t>(v > vcut);
    add_shift_terms<acc_t, FAM>(v - vc, b, sp, sg, sh);
    k += left_pack(dst + k, v, keep);
  }
  if (j < n) {
    // The tail as one masked vector (the fill c gives finite terms, masked out).
    const int64_t rest = n - j;
    const V v = load_tail(src + j, rest, c), live = tail_lanes<acc_t>(rest), vzero(0);
    const int keep = lane_mask<acc_t>(v > vcut) & ((1 << rest) - 1);
    V tp(0), tg(0), th(0);
    add_shift_terms<acc_t, FAM>(v - vc, b, tp, tg, th);
    sp += V::blendv(vzero, tp, live);
    sg += V::blendv(vzero, tg, live);
    sh += V::blendv(vzero, th, live);
    k += left_pack_bounded(dst + k, v, keep);
  }
  out.p = hsum(sp);
  out.g = hsum(sg);
  out.h = hsum(sh);
  return k;
}

// Σ φ(y - c), Σ g and Σ g/d over y[0:n] (no compaction).
template <typename acc_t, Family FAM>
inline ShiftSums<acc_t> shift_sums(const acc_t* y, int64_t n, acc_t c, acc_t b) {
  using V = Vec<acc_t>;
  const V vc(c);
  V sp(0), sg(0), sh(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) add_shift_terms<acc_t, FAM>(V::loadu(y + j) - vc, b, sp, sg, sh);
  if (j < n) {
    const int64_t rest = n - j;
    const V live = tail_lanes<acc_t>(rest), vzero(0);
    V tp(0), tg(0), th(0);
    add_shift_terms<acc_t, FAM>(load_tail(y + j, rest, c) - vc, b, tp, tg, th);
    sp += V::blendv(vzero, tp, live);
    sg += V::blendv(vzero, tg, live);
    sh += V::blendv(vzero, th, live);
  }
  return {hsum(sp), hsum(sg), hsum(sh)};
}

// Appends the entries of src[0:n] greater than `cut` to dst (which may alias
// src: it never runs ahead of the read position) and returns their count and
// sum, without data-dependent branches.
template <typename acc_t>
inline int64_t compact_above(const acc_t* src, int64_t n, acc_t cut, acc_t* dst, acc_t* sum_out) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vcut(cut), vzero(0);
  V vsum(0);
  int64_t k = 0, j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    V v = V::loadu(src + j);
    V keep = v > vcut;
    vsum += V::blendv(vzero, v, keep);
    k += left_pack(dst + k, v, lane_mask<acc_t>(keep));
  }
  if (j < n) {
    // The tail as one masked vector (fill `cut`: never kept); nothing is
    // written past dst[n).
    const V v = load_tail(src + j, n - j, cut);
    const V keep = v > vcut;
    vsum += V::blendv(vzero, v, keep);
    k += left_pack_bounded(dst + k, v, lane_mask<acc_t>(keep));
  }
  if (sum_out) *sum_out = hsum(vsum);
  return k;
}

// The entries of src[0:n] greater than `cut`, appended to dst (not aliasing
// src), for a pass over a whole row that keeps few of them (a row's first
// candidates): a vector with none costs a load, a compare and a predicted
// branch, where compact_above's branch-free compaction pays a compress, a
// store and its sum at every vector (docs/benchmarks.md has the profile).
// Returns their count.
// With pos, their positions are appended there too (room for n +
// Vec<acc_t>::size()).
template <typename acc_t>
inline int64_t few_above(const acc_t* src, int64_t n, acc_t cut, acc_t* dst, int32_t* pos = nullptr) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vcut(cut);
  int64_t k = 0, j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const V v = V::loadu(src + j);
    const int mask = gt_mask<acc_t>(v, vcut);
    if (mask == 0) continue;
    if (pos) left_pack_index<kLanes>(pos + k, static_cast<int32_t>(j), mask);
    k += left_pack(dst + k, v, mask);
  }
  for (; j < n; ++j) {
    if (!(src[j] > cut)) continue;
    if (pos) pos[k] = static_cast<int32_t>(j);
    dst[k++] = src[j];
  }
  return k;
}

// Sparsemax shift of y[0:n] (max 0) by Michelot's algorithm: c = 1 + (Σ_A y - 1)/|A|
// over the candidates A = {y > c - 1}, shrinking A until it stops changing.
// The candidates end in work[0:k]; returns c.
template <typename acc_t>
inline acc_t sparsemax_shift(const acc_t* y, int64_t n, acc_t* work, int64_t* k_out) {
  acc_t sum;
  int64_t k = compact_above(y, n, acc_t(-1), work, &sum);
  acc_t c = math::sparsemax_shift_on_support<acc_t>(sum, k);
  for (int it = 0; it < 2 * 64 + 8; ++it) {
    int64_t k_new = compact_above(work, k, c - acc_t(1), work, &sum);
    if (k_new == k || k_new == 0) break;
    k = k_new;
    c = math::sparsemax_shift_on_support<acc_t>(sum, k);
  }
  *k_out = k;
  return c;
}

// Σ v[0:k] in double, whatever acc_t (eight partial sums, so that the loop
// vectorizes without reassociating).
template <typename acc_t>
inline double sum_in_double(const acc_t* v, int64_t k) {
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int l = 0; l < 8; ++l) part[l] += static_cast<double>(v[i + l]);
  for (; i < k; ++i) part[0] += static_cast<double>(v[i]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The largest acc_t at or below t: x > t holds for an acc_t x exactly when
// x > floor_to<acc_t>(t).
template <typename acc_t>
inline acc_t floor_to(double t) {
  acc_t f = static_cast<acc_t>(t);
  if (static_cast<double>(f) > t) f = std::nextafter(f, -std::numeric_limits<acc_t>::infinity());
  return f;
}

// Sparsemax's threshold θ of a row x[0:n] with finite max m, p = [x - θ]_+,
// by Michelot's iterations on the unshifted scores: θ = (Σ_A x - 1)/|A| over
// the candidates A = {x > θ}, from A = {x > m - 1}, until A stops shrinking.
// The sums are in double and θ is returned in double: written as 1 + (y - c)
// with c = 1 + θ - m, every p would be rounded at the scale of 1, whatever its
// size (a float32 row of 32768 near-equal scores then summed to 1 - 1e-4).
// work: scratch of n entries (the candidates).
template <typename acc_t>
inline double sparsemax_threshold_listed(acc_t* work, int64_t k, acc_t m);

template <typename acc_t>
inline double sparsemax_threshold(const acc_t* x, int64_t n, acc_t m, acc_t* work) {
  return sparsemax_threshold_listed(work, few_above(x, n, floor_to<acc_t>(static_cast<double>(m) - 1.0), work), m);
}

// How many running maxima row_max hands the searches' starts (subset_start,
// sparsemax_subset_cut), and start_lanes the buffer for them when the family
// uses them and the row has that many entries (else nullptr: row_max keeps
// none).
template <typename acc_t>
constexpr int64_t kStartLanes = 4 * Vec<acc_t>::size();

// A cut below sparsemax's threshold θ of a row with max m, from a subset of
// its entries (sub: row_max's kStartLanes running maxima): Michelot's
// iterations on the subset, vectorized in acc_t, whose θ is at most the
// row's (an added entry can only raise it). Each step keeps the entries
// above its θ less a margin that covers the rounding of the step's sum, so
// the set stays a superset of the subset's support and the cut returned is
// below the subset's exact θ. Entries above it are the row's candidates:
// with the maxima of 64 strided parts, about the support itself, where the
// cut m - 1 keeps several times as many on random scores.
template <typename acc_t>
inline acc_t sparsemax_subset_cut(const acc_t* sub, acc_t m) {
  using V = Vec<acc_t>;
  constexpr int kVecs = static_cast<int>(kStartLanes<acc_t> / V::size());
  const acc_t floor_cut = floor_to<acc_t>(static_cast<double>(m) - 1.0);
  const acc_t margin = acc_t(2 * kStartLanes<acc_t>) * std::numeric_limits<acc_t>::epsilon() * (std::abs(m) + 1);
  acc_t cut = floor_cut;
  int64_t last = -1;
  for (int it = 0; it < 2 * kStartLanes<acc_t>; ++it) {
    const V vcut(cut), zero(0);
    V sum(0);
    int64_t cnt = 0;
    for (int i = 0; i < kVecs; ++i) {
      const V v = V::loadu(sub + i * V::size());
      const V keep = v > vcut;
      sum += V::blendv(zero, v, keep);
      cnt += __builtin_popcount(static_cast<unsigned>(lane_mask<acc_t>(keep)));
    }
    if (cnt == 0 || cnt == last) break;
    last = cnt;
    cut = std::max(floor_cut, (hsum(sum) - acc_t(1)) / acc_t(cnt) - margin);
  }
  return cut;
}

// Sparsemax's threshold θ from a list work[0:k] of a row's entries (max m)
// that holds its support, in increasing position order; the list is
// compacted in place. (sparsemax_threshold says how.)
template <typename acc_t>
inline double sparsemax_threshold_listed(acc_t* work, int64_t k, acc_t m) {
  acc_t sum = 0;
  for (int64_t t = 0; t < k; ++t) sum += work[t];
  // The iterations in acc_t first (their sums come with the compaction), to
  // a candidate list that holds the support; then in double from there, which
  // usually confirms the list in one step.
  // (A cut at or above the max, by rounding at huge scores, would empty the
  // list: the iterations stop before it.)
  for (int it = 0; it < 2 * 64 + 8; ++it) {
    const acc_t cut = (sum - acc_t(1)) / acc_t(k);
    if (!(cut < m)) break;
    const int64_t k_new = compact_above(work, k, cut, work, &sum);
    if (k_new == k) break;
    k = k_new;
  }
  double theta = (sum_in_double(work, k) - 1.0) / static_cast<double>(k);
  for (int it = 0; it < 2 * 64 + 8; ++it) {
    const acc_t cut = floor_to<acc_t>(theta);
    if (!(cut < m)) break;
    const int64_t k_new = compact_above(work, k, cut, work, static_cast<acc_t*>(nullptr));
    if (k_new == k) break;
    k = k_new;
    theta = (sum_in_double(work, k) - 1.0) / static_cast<double>(k);
  }
  return theta;
}

// out[j] = [x[j] - θ]_+ (out may alias x), with θ as two acc_t terms so that
// each p keeps its own relative resolution: x - θ_hi is exact near the edge of
// the support (Sterbenz) and rounds at p's own scale elsewhere.
template <typename acc_t>
inline void write_sparsemax(const acc_t* x, int64_t n, double theta, acc_t* out) {
  using V = Vec<acc_t>;
  const acc_t hi = static_cast<acc_t>(theta);
  const V vhi(hi), vlo(static_cast<acc_t>(theta - static_cast<double>(hi))), vzero(0);
  // (clamp_min keeps a NaN score NaN.)
  auto probs = [&](const V& v) { return at::vec::clamp_min((v - vhi) - vlo, vzero); };
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) probs(V::loadu(x + j)).store(out + j);
  if (j < n) probs(load_tail(x + j, n - j, hi)).store(out + j, static_cast<int>(n - j));
}

// exp(y - m) into e (which may alias y), returns the sum. ATen's exp_u20
// (~20 ulp, as PyTorch's own softmax kernels) runs about twice as fast as
// the 1-ulp exp; -inf gives exactly 0.
template <typename acc_t>
inline acc_t exp_shifted(const acc_t* y, int64_t n, acc_t m, acc_t* e) {
  using V = Vec<acc_t>;
  const V vm(m);
  V s(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V v = (V::loadu(y + j) - vm).exp_u20();
    v.store(e + j);
    s += v;
  }
  acc_t sum = hsum(s);
  for (; j < n; ++j) {
    e[j] = std::exp(y[j] - m);
    sum += e[j];
  }
  return sum;
}

// entmax15's closed-form shift on a candidate support a[0:k]. Returns NaN
// when the candidates are not yet exactly the support.
template <typename acc_t, Family FAM>
inline acc_t exact_shift(const acc_t* a, int64_t k) {
  static_assert(FAM == Family::kEntmax15, "closed form implemented for entmax15 (sparsemax: Michelot)");
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const V vzero(0);
  // Sums over a[0:k] a vector at a time, the tail masked (filled with `fill`).
  auto reduce = [&](acc_t fill, auto term) {
    V acc(0);
    int64_t j = 0;
    for (; j + W <= k; j += W) acc += term(V::loadu(a + j));
    if (j < k) acc += V::blendv(vzero, term(load_tail(a + j, k - j, fill)), tail_lanes<acc_t>(k - j));
    return hsum(acc);
  };
  // With a_i = 1 + y_i/2: mean and population variance, two-pass.
  const acc_t mean_y = reduce(acc_t(0), [](const V& v) { return v; }) / acc_t(k);
  const V vmean(mean_y);
  const acc_t ss = reduce(mean_y, [&](const V& v) { return (v - vmean) * (v - vmean); });
  acc_t var_a = acc_t(0.25) * ss / acc_t(k);
  acc_t mean_a = acc_t(1) + acc_t(0.5) * mean_y;
  acc_t c = math::entmax15_shift_on_support<acc_t>(mean_a, var_a, k);
  if (c != c) return c;
  // Every candidate inside the support at c (the smallest decides).
  acc_t lowest = std::numeric_limits<acc_t>::infinity();
  if (k >= W) {
    V vmin = V::loadu(a);
    for (int64_t j = W; j + W <= k; j += W) vmin = at::vec::minimum(vmin, V::loadu(a + j));
    lowest = at::vec::vec_reduce_all<acc_t>([](V& x, V& y) { return at::vec::minimum(x, y); }, vmin);
  }
  for (int64_t j = k - k % W; j < k; ++j) lowest = std::min(lowest, a[j]);
  if (!(acc_t(1) + acc_t(0.5) * (lowest - c) > acc_t(0))) return std::numeric_limits<acc_t>::quiet_NaN();
  return c;
}

constexpr int kMaxIterations = 200;

// Finds the shift c of one row y[0:n] whose max is 0 (the caller subtracted
// it). work: scratch of n entries. Returns c; sets *norm to the factor that
// makes the output sum to one (1 for the exact families).
//
// Starting points (proven bounds, so the safeguarded iteration keeps its
// bracket):
// - 0 < b <= 1: φ_b(t) >= φ_1(t) = [1 + t]_+, so the sparsemax shift (cheap:
//   additions only) is left of the root; entries with y <= c_sparsemax - 1/b
//   are out of the support for good, which on sparse rows leaves a few
//   percent of the row for the iterations, whose every pass costs a power.
// - b > 1: the sparsemax shift is right of the root; start from the max.
// - b < 0: the log-sum-exp is left of the root (φ_b >= exp there).
// Each pass also drops the candidates that are outside the support at the
// last point known to be left of the root. (solve_row takes the generic
// family with 0 < b < 1 to solve_generic_convex instead.)
template <typename acc_t, Family FAM>
acc_t find_shift(const acc_t* y, int64_t n, acc_t b, acc_t* work, acc_t* norm) {
  *norm = acc_t(1);
  if constexpr (FAM == Family::kSoftmax) {
    return std::log(exp_shifted(y, n, acc_t(0), work));
  } else if constexpr (FAM == Family::kSparsemax) {
    int64_t k;
    return sparsemax_shift(y, n, work, &k);
  } else {
    constexpr acc_t kNoCut = -std::numeric_limits<acc_t>::infinity();
    acc_t lo = 0, hi = math::entmax_shift_upper<acc_t>(n, b);
    acc_t c = 0;
    int64_t k;
    if (b > acc_t(0)) {
      int64_t ks;
      const acc_t csp = sparsemax_shift(y, n, work, &ks);
      if (b <= acc_t(1)) {
        lo = c = csp;
        k = compact_above(y, n, csp - acc_t(1) / b, work, static_cast<acc_t*>(nullptr));
      } else {
        hi = std::min(hi, csp);
        k = compact_above(y, n, -acc_t(1) / b, work, static_cast<acc_t*>(nullptr));
      }
    } else {
      acc_t lse = std::log(exp_shifted(y, n, acc_t(0), work));
      lo = std::max(lo, lse);
      c = lo;
      k = compact_above(y, n, kNoCut, work, static_cast<acc_t*>(nullptr));
    }
    // For 0 < b <= 1 the steps are Newton's on the convex h = (Σp)^b
    // (entmax_norm_newton_update): from either side they land left of the
    // root, so every such iterate is a valid cut for dropping candidates in
    // the very pass that evaluates it. Otherwise (b > 1 or b < 0, or after a
    // bisection) the cut lags at `lo` and the step is a safeguarded Halley's.
    const acc_t curv = acc_t(1) - b;  // f'' = (1 - b) Σ g/d
    const bool convex = b > acc_t(0) && b <= acc_t(1);
    bool c_is_left = convex && c == lo;
    int64_t k_prev = -1;
    ShiftSums<acc_t> s;
    bool s_at_c = false;
    for (int it = 0; it < kMaxIterations; ++it) {
      acc_t cut = b > acc_t(0) ? (c_is_left ? c : lo) - acc_t(1) / b : kNoCut;
      k = eval_compact<acc_t, FAM>(work, k, c, b, cut, work, s);
      if (s.p >= acc_t(1)) {
        lo = c;
        if constexpr (FAM == Family::kEntmax15) {
          // Closed form once the candidates stop shrinking.
          if (k == k_prev) {
            int64_t ke = compact_above(work, k, c - acc_t(2), work, static_cast<acc_t*>(nullptr));
            acc_t ce = exact_shift<acc_t, FAM>(work, ke);
            if (ce == ce) return ce;
            k = ke;
          }
        }
        k_prev = k;
      } else {
        hi = c;
      }
      s_at_c = true;
      if (math::entmax_converged<acc_t>(s.p, lo, hi, k)) break;
      acc_t next;
      if (convex) {
        next = math::entmax_norm_newton_update<acc_t>(c, s.p, s.g, b, lo, hi);
        c_is_left = next != acc_t(0.5) * (lo + hi);
      } else {
        next = math::entmax_halley_update<acc_t>(c, s.p, s.g, curv * s.h, lo, hi);
        c_is_left = false;
      }
      if (next == c) break;  // below the dtype's resolution
      c = next;
      s_at_c = false;
    }
    if constexpr (FAM == Family::kEntmax15) {
      int64_t ke = compact_above(work, k, c - acc_t(2), work, static_cast<acc_t*>(nullptr));
      acc_t ce = exact_shift<acc_t, FAM>(work, ke);
      if (ce == ce) return ce;
    }
    // (The loop's last sums are at c unless it ran out of iterations.)
    if (!s_at_c) eval_compact<acc_t, FAM>(work, k, c, b, kNoCut, work, s);
    if (s.p > acc_t(0)) *norm = acc_t(1) / s.p;
    return c;
  }
}

// out[j] = norm · φ((x[j] - m) - c) (out may alias x).
template <typename acc_t, Family FAM>
inline void write_probs(const acc_t* x, int64_t n, acc_t m, acc_t c, acc_t b, acc_t norm, acc_t* out) {
  using V = Vec<acc_t>;
  const V vm(m), vc(c), vone(1), vzero(0), vb(b), vinv_b(acc_t(1) / b), vnorm(norm);
  auto probs = [&](const V& t) {
    if constexpr (FAM == Family::kSoftmax) {
      return t.exp_u20() * vnorm;
    } else if constexpr (FAM == Family::kSparsemax) {
      // clamp_min(a, 0) is max(0, a): a NaN a stays NaN, as with
      // at::vec::maximum, without its compare and blend (two of the loop's
      // ten operations a vector).
      return at::vec::clamp_min(vone + t, vzero) * vnorm;
    } else if constexpr (FAM == Family::kEntmax15) {
      V d = at::vec::clamp_min(vone + t * V(acc_t(0.5)), vzero);
      return d * d * vnorm;
    } else {
      V bt = vb * t;
      V pos = (vone + bt) > vzero;
      return V::blendv(vzero,
                       b >= kFastPowMinB<acc_t> ? pow_unit<acc_t>(vone + bt, acc_t(1) / b) : (bt.log1p() * vinv_b).exp(),
                       pos) * vnorm;
    }
  };
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) probs((V::loadu(x + j) - vm) - vc).store(out + j);
  if (j < n) probs((load_tail(x + j, n - j, m) - vm) - vc).store(out + j, static_cast<int>(n - j));
}

#if ATTNKERN_HAS(AVX512)
// The positions (idx) of the entries of x[0:n] whose vector lane `keep`
// selects, in order; returns their count. The pass compacts positions only
// (one compression a vector, the positions advanced by an add, not
// broadcast), since it is bound by the shuffle port, which every compression
// and broadcast takes; callers gather the values of the few entries kept
// (gather_listed_values).
template <typename Keep>
inline int64_t positions_where(const float* x, int64_t n, int32_t* idx, Keep keep) {
  const __m512i step = _mm512_set1_epi32(16);
  __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t k = 0, j = 0;
  for (; j + 16 <= n; j += 16) {
    const __mmask16 in = keep(_mm512_loadu_ps(x + j));
    _mm512_storeu_si512(idx + k, _mm512_maskz_compress_epi32(in, pos));
    k += __builtin_popcount(in);
    pos = _mm512_add_epi32(pos, step);
  }
  if (j < n) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __mmask16 in = keep(_mm512_maskz_loadu_ps(rest, x + j)) & rest;
    _mm512_mask_storeu_epi32(idx + k, static_cast<__mmask16>((1u << __builtin_popcount(in)) - 1),
                             _mm512_maskz_compress_epi32(in, pos));
    k += __builtin_popcount(in);
  }
  return k;
}

// vals[t] = value(x[idx[t]]) for t < k.
template <typename Value>
inline void gather_listed_values(const float* x, const int32_t* idx, int64_t k, float* vals, Value value) {
  int64_t t = 0;
  for (; t + 16 <= k; t += 16) _mm512_storeu_ps(vals + t, value(_mm512_i32gather_ps(_mm512_loadu_si512(idx + t), x, 4)));
  if (t < k) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (k - t)) - 1);
    const __m512 g = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rest, _mm512_maskz_loadu_epi32(rest, idx + t), x, 4);
    _mm512_mask_storeu_ps(vals + t, rest, value(g));
  }
}
#endif

// Positions (idx) and values y = x - m (vals, not aliasing x) of the entries
// of x[0:n] with y above `cut`; returns their count.
template <typename acc_t>
inline int64_t positions_above(const acc_t* x, int64_t n, acc_t m, acc_t cut, acc_t* vals, int32_t* idx) {
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m512 vm = _mm512_set1_ps(m), vcut = _mm512_set1_ps(cut);
    const int64_t k = positions_where(x, n, idx, [&](__m512 v) {
      return _mm512_cmp_ps_mask(_mm512_sub_ps(v, vm), vcut, _CMP_GT_OQ);
    });
    gather_listed_values(x, idx, k, vals, [&](__m512 v) { return _mm512_sub_ps(v, vm); });
    return k;
  }
#endif
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vm(m), vcut(cut);
  int64_t k = 0, j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    V v = V::loadu(x + j) - vm;
    const int mask = gt_mask<acc_t>(v, vcut);
    left_pack(vals + k, v, mask);
    k += left_pack_index<kLanes>(idx + k, static_cast<int32_t>(j), mask);
  }
  for (; j < n; ++j) {
    const acc_t v = x[j] - m;
    if (v > cut) {
      vals[k] = v;
      idx[k++] = static_cast<int32_t>(j);
    }
  }
  return k;
}

// positions_above for the scores scale·x of a row x not yet scaled (scale
// > 0), m being in the scores' units (their max, exactly scale·max(x); or
// 0): the values are y = scale·x - m, as the scaled row gives them. On
// AVX-512 the pass compares x itself, against the cut taken back to x's
// units and lowered by a few roundings, so the list may hold a few entries
// more, with y a rounding or so below the cut: the searches give them zero
// (they are left of the support of any shift right of the cut).
template <typename acc_t>
inline int64_t positions_above_scaled(const acc_t* x, int64_t n, acc_t m, acc_t scale, acc_t cut, acc_t* vals,
                                      int32_t* idx) {
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const float thr = (m + cut) / scale - 8 * std::numeric_limits<float>::epsilon() * (std::abs(m) + std::abs(cut)) / scale;
    const __m512 vthr = _mm512_set1_ps(thr), vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m);
    const int64_t k =
        positions_where(x, n, idx, [&](__m512 v) { return _mm512_cmp_ps_mask(v, vthr, _CMP_GT_OQ); });
    gather_listed_values(x, idx, k, vals, [&](__m512 v) { return _mm512_sub_ps(_mm512_mul_ps(v, vs), vm); });
    return k;
  }
#endif
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t v = x[j] * scale - m;
    if (v > cut) {
      vals[k] = v;
      idx[k++] = static_cast<int32_t>(j);
    }
  }
  return k;
}

// The support of a row p (its entries above zero; a NaN is not) with dp at
// the same positions, and dx zeroed, in one pass: values to pk and dpk
// (widened to float for bfloat16 / half), positions to idx; returns their
// count. dx may alias dp (each vector of dp is read before its zeros are
// stored), not p. The pass streams p and dp in and dx out together, as the
// dense backward does, so that more memory requests are in flight than when
// p is scanned alone and dp's lines are gathered after it. kValues = false:
// p's values are not gathered (pk unused; sparsemax's backward needs only
// the positions).
template <typename scalar_t, typename acc_t, bool kValues = true>
inline int64_t support_entries(const scalar_t* p, const scalar_t* dp, scalar_t* dx, int64_t n, acc_t* pk,
                               acc_t* dpk, int32_t* idx) {
  static_assert(std::is_same_v<scalar_t, acc_t> || std::is_same_v<acc_t, float>,
                "reduced-precision rows widen to float");
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  auto load = [](const scalar_t* ptr) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      return V::loadu(ptr);
    } else {
      V v;
      at::vec::load_to_float(ptr, v);
      return v;
    }
  };
  const V vzero(0);
  int64_t k = 0, j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const V v = load(p + j), d = load(dp + j);
    const int mask = gt_mask<acc_t>(v, vzero);
    std::memset(static_cast<void*>(dx + j), 0, sizeof(scalar_t) * kLanes);
    if constexpr (kValues) left_pack(pk + k, v, mask);
    left_pack(dpk + k, d, mask);
    k += left_pack_index<kLanes>(idx + k, static_cast<int32_t>(j), mask);
  }
  for (; j < n; ++j) {
    const acc_t v = static_cast<acc_t>(p[j]), d = static_cast<acc_t>(dp[j]);
    dx[j] = scalar_t(0);
    if (v > acc_t(0)) {
      if constexpr (kValues) pk[k] = v;
      dpk[k] = d;
      idx[k++] = static_cast<int32_t>(j);
    }
  }
  return k;
}

// out[0:n] = 0, then out[pos[i]] = p[i] · norm.
template <typename acc_t>
inline void scatter_row(const acc_t* p, const int32_t* pos, int64_t k, acc_t norm, int64_t n, acc_t* out) {
  std::fill(out, out + n, acc_t(0));
  for (int64_t i = 0; i < k; ++i) out[pos[i]] = p[i] * norm;
}

// write_probs for the generic family with b > 0 on a sparse row: zeros, then
// the powers of the support entries only, scattered to their positions.
// Falls back to the dense pass when the support is a large part of the row.
template <typename acc_t>
inline void write_probs_sparse(const acc_t* x, int64_t n, acc_t m, acc_t c, acc_t b, acc_t norm, acc_t* out,
                               acc_t* vals, int32_t* idx) {
  if (!(b > acc_t(0))) return write_probs<acc_t, Family::kGeneric>(x, n, m, c, b, norm, out);
  // The support: entries with 1 + b(y - c) > 0.
  const int64_t k = positions_above(x, n, m, c - acc_t(1) / b, vals, idx);
  if (4 * k > n) return write_probs<acc_t, Family::kGeneric>(x, n, m, c, b, norm, out);
  write_probs<acc_t, Family::kGeneric>(vals, k, acc_t(0), c, b, norm, vals);
  scatter_row<acc_t>(vals, idx, k, acc_t(1), n, out);
}

// The entries of p[0:k] other than 0 (a NaN stays), times norm, into out
// (which may be p) in order, and their positions idx[0:k] alike, in place;
// returns their count. out needs room for a whole vector past it. Without a
// branch (on entmax15's candidate lists, some zeros in between, one was
// mispredicted every few entries), and at AVX-512 float a vector at a time.
template <typename acc_t>
inline int64_t drop_zeros(const acc_t* p, int32_t* idx, int64_t k, acc_t norm, acc_t* out) {
  int64_t kept = 0, t = 0;
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m512 vnorm = _mm512_set1_ps(norm);
    for (; t + 16 <= k; t += 16) {
      const __m512 v = _mm512_loadu_ps(p + t);
      const __m512i at = _mm512_loadu_si512(idx + t);
      const __mmask16 nonzero = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      _mm512_storeu_ps(out + kept, _mm512_maskz_compress_ps(nonzero, _mm512_mul_ps(v, vnorm)));
      _mm512_storeu_si512(idx + kept, _mm512_maskz_compress_epi32(nonzero, at));
      kept += __builtin_popcount(nonzero);
    }
  }
#endif
  for (; t < k; ++t) {
    const acc_t v = p[t];
    const int32_t j = idx[t];
    out[kept] = v * norm;
    idx[kept] = j;
    kept += !(v == acc_t(0));
  }
  return kept;
}

// The probabilities of a row on a list of its entries that holds the
// support: vals[0:k] (sparsemax: the scores x; else y = x - m) become what
// write_sparsemax (p = [x - θ]_+, shift θ) or write_probs (p = norm · φ(y -
// c), shift c) would write at their positions idx[0:k], each by the same
// operations, and the entries that came out 0 are dropped, in order. Returns
// the count left.
template <typename acc_t, Family FAM>
inline int64_t listed_probs(acc_t* vals, int32_t* idx, int64_t k, double shift, acc_t b, acc_t norm) {
  static_assert(FAM != Family::kSoftmax, "softmax rows are dense");
  if constexpr (FAM == Family::kSparsemax) {
    write_sparsemax<acc_t>(vals, k, shift, vals);
  } else {
    write_probs<acc_t, FAM>(vals, k, acc_t(0), static_cast<acc_t>(shift), b, norm, vals);
  }
  return drop_zeros<acc_t>(vals, idx, k, acc_t(1), vals);
}

// The non-zero entries of a row's probabilities, as positions (idx) and
// values (vals) in increasing position order, from its scores x[0:n] (max
// m) at its shift without writing the row (listed_probs): one pass over the
// row gathers the entries above a cut an ulp below the support's edge
// (b > 0). vals and idx need room for n + Vec<acc_t>::size() entries.
// Returns the count.
template <typename acc_t, Family FAM>
inline int64_t support_list(const acc_t* x, int64_t n, acc_t m, double shift, acc_t b, acc_t norm, acc_t* vals,
                            int32_t* idx) {
  constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  int64_t k;
  if constexpr (FAM == Family::kSparsemax) {
    // (x > floor_to(θ) holds exactly when x > θ.)
    k = few_above(x, n, std::nextafter(floor_to<acc_t>(shift), ninf), vals, idx);
  } else {
    // (Supports of a few percent of the row: the branch-free compaction,
    // where few_above's branch would often be mispredicted.)
    k = positions_above(x, n, m, std::nextafter(static_cast<acc_t>(shift) - acc_t(1) / b, ninf), vals, idx);
  }
  return listed_probs<acc_t, FAM>(vals, idx, k, shift, b, norm);
}

// The entries of x[0:n] whose y = x - m is above `cut`, as y, into dst (not
// aliasing x); returns their count. One pass: a row's shift candidates.
template <typename acc_t>
inline int64_t shifted_above(const acc_t* x, int64_t n, acc_t m, acc_t cut, acc_t* dst) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vm(m), vcut(cut);
  int64_t k = 0, j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const V v = V::loadu(x + j) - vm;
    k += left_pack(dst + k, v, gt_mask<acc_t>(v, vcut));
  }
  for (; j < n; ++j) {
    const acc_t v = x[j] - m;
    if (v > cut) dst[k++] = v;
  }
  return k;
}

// The generic family's probabilities at the shift c of a row (0 < b < 1), if
// c is converged: gathers the support (y - c > -1/b) with positions_above,
// takes its powers and, when their sum is within entmax_sum_converged's
// tolerance of 1, writes out = φ(y - c) / Σ and returns true. Otherwise
// (also when the support is over a quarter of the row, where the dense write
// is as cheap) it writes nothing and returns false. out may alias x; vals
// and idx are scratch of n entries.
template <typename acc_t>
inline bool write_if_converged(const acc_t* x, int64_t n, acc_t m, acc_t c, acc_t b, acc_t* out, acc_t* vals,
                               int32_t* idx) {
  using V = Vec<acc_t>;
  const int64_t k = positions_above(x, n, m, c - acc_t(1) / b, vals, idx);
  if (k == 0 || 4 * k > n) return false;
  const V vc(c), vb(b), vone(1);
  const acc_t inv_b = acc_t(1) / b;
  V vsum(0);
  int64_t i = 0;
  // Every gathered entry is in the support (1 + b(y - c) > 0).
  for (; i + V::size() <= k; i += V::size()) {
    const V p = pow_unit<acc_t>(vone + vb * (V::loadu(vals + i) - vc), inv_b);
    p.store(vals + i);
    vsum += p;
  }
  if (i < k) {
    const int64_t rest = k - i;
    const V p = V::blendv(V(0), pow_unit<acc_t>(vone + vb * (load_tail(vals + i, rest, c) - vc), inv_b),
                          tail_lanes<acc_t>(rest));
    p.store(vals + i, static_cast<int>(rest));
    vsum += p;
  }
  const acc_t sum = hsum(vsum);
  if (!math::entmax_sum_converged<acc_t>(sum, k)) return false;
  const acc_t norm = acc_t(1) / sum;
  std::fill(out, out + n, acc_t(0));
  for (i = 0; i < k; ++i) out[idx[i]] = vals[i] * norm;
  return true;
}

// Newton's steps on the strided maxima that start entmax15's rows
// (subset_start): each shortens the candidate list that the rank rule's
// quadratic pass then runs over.
constexpr int kEntmax15LaneSteps = 2;

// entmax15's Newton steps from c = 0 that give solve_generic_convex its start.
constexpr int kEntmax15StartSteps = 3;

// Residual |Σp - 1| below which the next step of solve_generic_convex is
// expected to converge (Halley's error is cubic: 0.05 leaves ~1e-6), so its
// evaluation is the write itself (write_if_converged).
constexpr double kFinishResidual = 0.05;

// math::entmax_shift_upper(n, b) (two libm calls), remembered for the last
// (n, b) this thread asked for: the rows of one call mostly share both.
template <typename acc_t>
inline acc_t shift_upper_memo(int64_t n, acc_t b) {
  thread_local int64_t last_n = -1;
  thread_local acc_t last_b = 0, last_hi = 0;
  if (n != last_n || b != last_b) {
    last_hi = math::entmax_shift_upper<acc_t>(n, b);
    last_n = n;
    last_b = b;
  }
  return last_hi;
}

// One step of the generic family's search from the sums s at c over k
// candidates: the bracket [lo, hi] takes c, then c moves to Halley's point on
// the norm; false (c unchanged) once converged or when the step is below the
// dtype's resolution. finish: the residual at c was small enough for the
// write at the next point to be tried (kFinishResidual).
template <typename acc_t>
inline bool halley_norm_step(const ShiftSums<acc_t>& s, int64_t k, acc_t b, acc_t& c, acc_t& lo, acc_t& hi,
                             bool& finish) {
  if (s.p >= acc_t(1)) {
    lo = c;
  } else {
    hi = c;
  }
  if (math::entmax_converged<acc_t>(s.p, lo, hi, k)) return false;
  const acc_t next = math::entmax_norm_halley_update<acc_t>(c, s.p, s.g, s.h, b, lo, hi);
  if (next == c) return false;
  finish = std::abs(s.p - acc_t(1)) < acc_t(kFinishResidual);
  c = next;
  return true;
}

template <typename acc_t, Family FAM>
inline acc_t* start_lanes(acc_t* buf, int64_t n) {
  return (FAM == Family::kGeneric || FAM == Family::kEntmax15) && n >= kStartLanes<acc_t> ? buf : nullptr;
}

// A point for the start of the search on a row with 0 < b < 1 (FAM: the
// generic family, or entmax15 with b = 1/2, whose powers are squares), from
// the row's max m and 4 · V::size() distinct entries of it (lanes: row_max's
// running maxima). A sum over a subset of the entries is at most the row's,
// so a point where the subset's sum is at least 1 is left of the row's
// shift. From c = 0 (the max alone gives φ(0) = 1), Newton's steps on the
// subset's norm h = (Σp)^b, convex and decreasing in c, stay left of the
// subset's root, hence of the row's, up to rounding. The caller gathers the
// entries that can be in the support right of the point and confirms the
// point afterwards, at no cost: the search's first evaluation there must
// find Σp >= 1 (ListedSearch), or the shift found must not be left of it
// (solve_entmax15_from_lanes); else (by rounding, or ties) it starts over
// from c = 0. More steps shorten the list of candidates: worth a second one
// for entmax15, whose rank rule is quadratic in the list, not for the
// generic family's powers (docs/benchmarks.md has the measurements).
template <typename acc_t, Family FAM = Family::kGeneric>
inline acc_t subset_start(const acc_t* lanes, acc_t m, acc_t b, int steps = 1) {
  using V = Vec<acc_t>;
  const V vm(m);
  acc_t c = 0;
  for (int step = 0; step < steps; ++step) {
    const V vc(c);
    V sp(0), sg(0), sh(0);
    for (int i = 0; i < 4; ++i)
      add_shift_terms<acc_t, FAM>((V::loadu(lanes + i * V::size()) - vm) - vc, b, sp, sg, sh);
    const acc_t sum_p = hsum(sp), sum_g = hsum(sg);
    const acc_t move = sum_g > acc_t(0) ? math::entmax_norm_residual<acc_t>(sum_p, b) / sum_g : acc_t(0);
    if (!(move > acc_t(0))) break;
    c += move;
  }
  return c;
}

// The generic family's probabilities (0 < b < 1) over a list of entries
// y[0:k]: p = φ(y - c), zero outside the support; returns Σp.
template <typename acc_t>
inline acc_t listed_probs(const acc_t* y, int64_t k, acc_t c, acc_t b, acc_t* p) {
  using V = Vec<acc_t>;
  const V vc(c), vb(b), vone(1), vzero(0);
  const acc_t inv_b = acc_t(1) / b;
  auto phi = [&](const V& v) {
#if ATTNKERN_HAS(AVX512)
    if constexpr (std::is_same_v<acc_t, float>) {
      if (b >= kFastPowMinB<float>) {  // (one support mask, as add_shift_terms)
        const __m512 d = _mm512_fmadd_ps(vb, _mm512_sub_ps(v, vc), vone);
        return V(pow_unit_masked(d, inv_b, _mm512_cmp_ps_mask(d, vzero, _CMP_GT_OQ)));
      }
    }
#endif
    const V bt = vb * (v - vc), d = vone + bt;
    return V::blendv(vzero,
                     b >= kFastPowMinB<acc_t> ? pow_unit<acc_t>(d, inv_b) : (bt.log1p() * V(inv_b)).exp(),
                     d > vzero);
  };
  V vsum(0);
  int64_t i = 0;
  for (; i + V::size() <= k; i += V::size()) {
    const V pv = phi(V::loadu(y + i));
    pv.store(p + i);
    vsum += pv;
  }
  if (i < k) {
    const int64_t rest = k - i;
    const V pv = V::blendv(vzero, phi(load_tail(y + i, rest, c)), tail_lanes<acc_t>(rest));
    pv.store(p + i, static_cast<int>(rest));
    vsum += pv;
  }
  return hsum(vsum);
}

// solve_generic_convex's search when every entry that can be in the support
// is listed (y[0:k] with positions pos, k at most a quarter of the row)
// and c is left of the shift: Halley's steps on the norm over the list (no
// compaction: the list is already within ~30% of the support), and the
// write from the list (no pass over the row). As in solve_generic_convex,
// once the residual is small the next point is written directly and kept if
// its sum is within tolerance. p: scratch of k entries. The search is a
// state advanced one round at a time, so that two rows can advance in
// lockstep (normalize_generic_pair): each round is a chain of dependent
// operations, and two independent chains overlap.
template <typename acc_t>
struct ListedSearch {
  const acc_t* y;
  const int32_t* pos;
  int64_t k, n;
  acc_t c, b, lo, hi;
  acc_t* p;
  acc_t* out;
  bool finish = false;
  bool refused = false;  // the start was not left of the shift (nothing written)
  int it = 0;
  acc_t norm = 1;        // once written: the factor 1 / Σp

  ListedSearch(const acc_t* y_, const int32_t* pos_, int64_t k_, int64_t n_, acc_t c_, acc_t b_, acc_t hi_,
               acc_t* p_, acc_t* out_)
      : y(y_), pos(pos_), k(k_), n(n_), c(c_), b(b_), lo(c_), hi(hi_), p(p_), out(out_) {}

  // One round: the write attempt when due (it fails only on slow
  // convergence), else a Halley step; false once the row is written, or
  // refused: the first evaluation, at the start, found Σp < 1.
  bool advance() {
    if (finish) {
      finish = false;
      const acc_t sum = listed_probs<acc_t>(y, k, c, b, p);
      if (math::entmax_sum_converged<acc_t>(sum, k)) return write(sum);
    }
    const ShiftSums<acc_t> s = shift_sums<acc_t, Family::kGeneric>(y, k, c, b);
    if (it == 0 && !(s.p >= acc_t(1))) {
      refused = true;
      return false;
    }
    if (it++ < kMaxIterations && halley_norm_step<acc_t>(s, k, b, c, lo, hi, finish)) return true;
    return write(listed_probs<acc_t>(y, k, c, b, p));
  }

  // out = p · norm at the list's positions, zero elsewhere (out null: p and
  // norm are left for the caller); false (the row is done).
  bool write(acc_t sum) {
    norm = sum > acc_t(0) ? acc_t(1) / sum : acc_t(1);
    if (out) scatter_row<acc_t>(p, pos, k, norm, n, out);
    return false;
  }
};

// The whole ListedSearch; false (nothing written) if it refused its start.
template <typename acc_t>
inline bool solve_listed(const acc_t* y, const int32_t* pos, int64_t k, int64_t n, acc_t& c, acc_t b, acc_t hi,
                         acc_t* p, acc_t* out) {
  ListedSearch<acc_t> search(y, pos, k, n, c, b, hi, p, out);
  while (search.advance()) {
  }
  c = search.c;
  return !search.refused;
}

// The listed start of solve_generic_convex for a row x[0:n] with finite max m
// and row_max's lanes: the start c (subset_start, to be confirmed by the
// search) and the candidates right of it, with their positions, in cand and
// idx; returns their count (the list is for solve_listed when it is at most
// a quarter of the row). With raw_scale > 0, x is the row still to be scaled
// by raw_scale, and m and lanes are scaled (positions_above_scaled).
template <typename acc_t>
inline int64_t listed_candidates(const acc_t* x, int64_t n, acc_t m, acc_t b, const acc_t* lanes, acc_t* cand,
                                 int32_t* idx, acc_t& c, acc_t raw_scale = acc_t(0)) {
  c = subset_start<acc_t>(lanes, m, b);
  const acc_t cut = c - acc_t(1) / b;
  if (raw_scale > acc_t(0)) return positions_above_scaled(x, n, m, raw_scale, cut, cand, idx);
  return positions_above(x, n, m, cut, cand, idx);
}

// The generic family with 0 < b < 1 (1 < α < 2), the range a learned α
// mostly lives in: shift and probabilities of one row x[0:n] with finite max
// m; returns c. cand, work: scratch of n entries; idx: n.
//
// The entries that can be in the support (y > -1/b, see solve_row) are
// gathered; the start is entmax15's shift for b < 1/2 (φ_b >= φ_(1/2): left
// of the root; its power is a square, so it costs little) or sparsemax's;
// then Halley's steps on the norm h = (Σp)^b (entmax_norm_halley_update).
// Each evaluation first compacts the candidates to those inside the support
// at its point, into the other buffer, and takes powers of those only; the
// shorter list is kept only if the point turns out left of the root
// (Σp >= 1; Halley's step may overshoot, unlike Newton's). Once the
// residual is small, the next point is not evaluated but written directly,
// and accepted if its sum is within tolerance: on a random row of 1024 the
// search costs two passes of powers over a few hundred candidates and the
// write one over the support.
template <typename acc_t>
inline acc_t solve_generic_convex(const acc_t* x, int64_t n, acc_t m, acc_t b, acc_t* out, acc_t* cand,
                                  acc_t* work, int32_t* idx, const acc_t* lanes) {
  const acc_t inv_b = acc_t(1) / b;
  const acc_t hi0 = shift_upper_memo<acc_t>(n, b);
  int64_t k;
  acc_t c;
  if (lanes) {
    // The start from row_max's running maxima: the candidates right of it
    // are gathered with their positions, and when they are few the search
    // and the write run on that list alone. A start the search refuses, or
    // a long list, goes the way below (from c = 0).
    k = listed_candidates<acc_t>(x, n, m, b, lanes, cand, idx, c);
    if (4 * k <= n && solve_listed<acc_t>(cand, idx, k, n, c, b, hi0, work, out)) return c;
  }
  if (k = shifted_above(x, n, m, -inv_b, cand); b < acc_t(0.5)) {
    // A few of entmax15's Newton steps on its norm from c = 0: each lands
    // left of entmax15's shift, hence of this one; its exact shift is not
    // needed, only a start close enough for two of Halley's steps.
    ShiftSums<acc_t> s15;
    c = 0;
    int64_t k15 = eval_compact<acc_t, Family::kEntmax15>(cand, k, c, acc_t(0.5), c - acc_t(2), work, s15);
    for (int it = 0; it < kEntmax15StartSteps && s15.g > acc_t(0); ++it) {
      // The plain step (no bracket: a bisection could land right of the
      // root); it stops moving once entmax15's shift is reached.
      const acc_t next = c + math::entmax_norm_residual<acc_t>(s15.p, acc_t(0.5)) / s15.g;
      if (!(next > c)) break;
      c = next;
      k15 = eval_compact<acc_t, Family::kEntmax15>(work, k15, c, acc_t(0.5), c - acc_t(2), work, s15);
    }
  } else {
    int64_t ks;
    c = sparsemax_shift(cand, k, work, &ks);
  }
  acc_t lo = c, hi = hi0;
  acc_t* live = work;   // the candidates
  acc_t* spare = cand;  // the next compaction
  k = compact_above(cand, k, c - inv_b, live, static_cast<acc_t*>(nullptr));
  ShiftSums<acc_t> s;
  bool s_at_c = false, finish = false, tried = false;
  for (int it = 0; it < kMaxIterations; ++it) {
    if (finish && !tried) {
      // One attempt: it fails only on slow convergence or a dense support.
      tried = true;
      if (write_if_converged(x, n, m, c, b, out, spare, idx)) return c;
    }
    // Entries at or below c - 1/b add nothing at c: they are dropped before
    // their powers are taken, into the spare buffer (the sums at c are exact
    // either way; the shorter list replaces the live one only if c is left
    // of the root, since points left of c may need them).
    int64_t kept = compact_above(live, k, c - inv_b, spare, static_cast<acc_t*>(nullptr));
    kept = eval_compact<acc_t, Family::kGeneric>(spare, kept, c, b, c - inv_b, spare, s);
    s_at_c = true;
    if (s.p >= acc_t(1)) {
      std::swap(live, spare);
      k = kept;
    }
    if (!halley_norm_step<acc_t>(s, k, b, c, lo, hi, finish)) break;
    s_at_c = false;
  }
  if (!s_at_c) eval_compact<acc_t, Family::kGeneric>(live, k, c, b, c - inv_b, spare, s);
  const acc_t norm = s.p > acc_t(0) ? acc_t(1) / s.p : acc_t(1);
  write_probs_sparse<acc_t>(x, n, m, c, b, norm, out, spare, idx);
  return c;
}

// entmax15 by ranks: the longest list ranked_entmax15_shift takes (4
// vectors; its work grows with the square of the list).
template <typename acc_t>
constexpr int64_t kRankedMax = 4 * Vec<acc_t>::size();

// For a list y[0:k] (k <= NB vectors) holding entmax15's support, the
// smallest entry of the support as the sort-based rule reads it (Peters et
// al., 2019): taking the entries at or above y_j as the support, the closed
// form gives a shift c_j, and the support is the largest such set whose
// smallest entry is inside at its own c_j. Each entry's set is counted
// directly (for every i, every j with y_j <= y_i adds y_i, y_i² and 1: k²
// comparisons, no sort, no data-dependent branch); the sums are one-pass
// and in the list's dtype, good enough to choose the set, which the caller
// verifies. Returns +inf if no entry qualifies (not for a list that holds
// the row's max).
template <typename acc_t, int NB>
inline acc_t ranked_entmax15_cut(const acc_t* y, int64_t k) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  V yj[NB], cnt[NB], sy[NB], sq[NB];
  for (int b = 0; b < NB; ++b) {
    // Lanes past the list hold +inf: no entry is at or above them (they count nothing).
    const int64_t rest = k - b * W;
    yj[b] = rest >= W ? V::loadu(y + b * W) : rest > 0 ? load_tail(y + b * W, rest, inf) : V(inf);
    cnt[b] = sy[b] = sq[b] = V(0);
  }
  const V vone(1);
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    // Masked adds (one instruction per sum), two entries per step on
    // separate sums so that the adds' latency is not the loop's.
    __m512 c0[NB], s0[NB], q0[NB], c1[NB], s1[NB], q1[NB];
    for (int b = 0; b < NB; ++b) c0[b] = s0[b] = q0[b] = c1[b] = s1[b] = q1[b] = _mm512_setzero_ps();
    const __m512 one = _mm512_set1_ps(1.f);
    auto add = [&](__m512* c, __m512* sum, __m512* sq2, float v) {
      const __m512 yi = _mm512_set1_ps(v), yi2 = _mm512_set1_ps(v * v);
      for (int b = 0; b < NB; ++b) {
        const __mmask16 in = _mm512_cmp_ps_mask(__m512(yj[b]), yi, _CMP_LE_OQ);
        c[b] = _mm512_mask_add_ps(c[b], in, c[b], one);
        sum[b] = _mm512_mask_add_ps(sum[b], in, sum[b], yi);
        sq2[b] = _mm512_mask_add_ps(sq2[b], in, sq2[b], yi2);
      }
    };
    int64_t i = 0;
    for (; i + 2 <= k; i += 2) {
      add(c0, s0, q0, y[i]);
      add(c1, s1, q1, y[i + 1]);
    }
    if (i < k) add(c0, s0, q0, y[i]);
    for (int b = 0; b < NB; ++b) {
      cnt[b] = V(_mm512_add_ps(c0[b], c1[b]));
      sy[b] = V(_mm512_add_ps(s0[b], s1[b]));
      sq[b] = V(_mm512_add_ps(q0[b], q1[b]));
    }
  } else
#endif
  {
    for (int64_t i = 0; i < k; ++i) {
      const V yi(y[i]), yi2(y[i] * y[i]);
      for (int b = 0; b < NB; ++b) {
        const V in = yj[b] <= yi;
        cnt[b] += in & vone;
        sy[b] += in & yi;
        sq[b] += in & yi2;
      }
    }
  }
  // With a = 1 + y/2 over the set: c/2 = mean(a) - sqrt(1/K - var(a))
  // (math::entmax15_shift_on_support); NaN (K = 0 lanes, 1/K < var(a))
  // compares false, so such lanes do not qualify.
  const V vhalf(acc_t(0.5)), vquarter(acc_t(0.25)), vzero(0);
  V lowest(inf);
  for (int b = 0; b < NB; ++b) {
    const V inv = vone / cnt[b];
    const V mean_y = sy[b] * inv;
    const V disc = inv - vquarter * (sq[b] * inv - mean_y * mean_y);
    const V half_c = vone + vhalf * mean_y - disc.sqrt();
    const V inside = (disc >= vzero) & (vone + vhalf * yj[b] > half_c);
    lowest = at::vec::minimum(lowest, V::blendv(V(inf), yj[b], inside));
  }
  return at::vec::vec_reduce_all<acc_t>([](V& a, V& c) { return at::vec::minimum(a, c); }, lowest);
}

// entmax15's shift from a list y[0:k] (k <= kRankedMax) that holds every
// entry of the support, without iterations: ranked_entmax15_cut chooses the
// support, exact_shift (the same closed form as find_shift's last step, on
// the same entries in the same order, so the same value) takes it, and the
// result is kept only if it is a fixed point: every chosen entry inside the
// support at c (exact_shift's check) and the largest entry left out outside
// it. Then Σ φ(y - c) over the row is exactly the chosen entries' sum, 1.
// Otherwise (rounding at the support's edge) returns NaN. work: k entries.
template <typename acc_t>
inline acc_t ranked_entmax15_shift(const acc_t* y, int64_t k, acc_t* work) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  const int64_t vectors = (k + W - 1) / W;
  const acc_t cut = vectors <= 1 ? ranked_entmax15_cut<acc_t, 1>(y, k)
                    : vectors <= 2 ? ranked_entmax15_cut<acc_t, 2>(y, k)
                    : vectors <= 3 ? ranked_entmax15_cut<acc_t, 3>(y, k)
                                   : ranked_entmax15_cut<acc_t, 4>(y, k);
  if (!(cut <= acc_t(0))) return nan;
  // The entries at or above the cut to work (in order), and the largest below it.
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  const V vcut(cut), vninf(ninf);
  V vbelow(ninf);
  int64_t ka = 0, j = 0;
  auto split = [&](const V& v, bool tail) {
    const V keep = v >= vcut;
    vbelow = at::vec::maximum(vbelow, V::blendv(v, vninf, keep));
    const int mask = lane_mask<acc_t>(keep);
    ka += tail ? left_pack_bounded(work + ka, v, mask) : left_pack(work + ka, v, mask);
  };
  for (; j + W <= k; j += W) split(V::loadu(y + j), false);
  if (j < k) split(load_tail(y + j, k - j, ninf), true);  // (fill -inf: never kept)
  const acc_t below = at::vec::vec_reduce_all<acc_t>([](V& a, V& c) { return at::vec::maximum(a, c); }, vbelow);
  const acc_t c = exact_shift<acc_t, Family::kEntmax15>(work, ka);
  if (c != c || acc_t(1) + acc_t(0.5) * (below - c) > acc_t(0)) return nan;
  return c;
}

// entmax15's row with row_max's lanes: the start from the lanes
// (subset_start), the candidates above it (on random rows of 1024 about
// 1.6 times the support, against 6.5 times at c = 0), and the shift by ranks
// when they are few, else (or when the ranks' choice is not confirmed) by
// find_shift over the same list, which holds the support either way.
template <typename acc_t>
//
// With pos (then out is null), the candidates' positions are gathered too
// (room for n + Vec<acc_t>::size()), and *k_out gets their count: cand[0:k]
// (y = x - m) and pos[0:k] hold the support, for a caller that lists it.
// With raw_scale > 0 too, x is the row still to be scaled by raw_scale, and
// m its scaled max (positions_above_scaled).
inline acc_t solve_entmax15_from_lanes(const acc_t* x, int64_t n, acc_t m, acc_t* out, acc_t* cand, acc_t* work,
                                       const acc_t* lanes, acc_t* norm_out = nullptr, int32_t* pos = nullptr,
                                       int64_t* k_out = nullptr, acc_t raw_scale = acc_t(0)) {
  const acc_t b(0.5);
  const acc_t start = subset_start<acc_t, Family::kEntmax15>(lanes, m, b, kEntmax15LaneSteps);
  auto gather = [&](acc_t cut) {
    if (raw_scale > acc_t(0)) return positions_above_scaled(x, n, m, raw_scale, cut, cand, pos);
    return pos ? positions_above(x, n, m, cut, cand, pos) : shifted_above(x, n, m, cut, cand);
  };
  int64_t k = gather(start - acc_t(2));
  acc_t c = k <= kRankedMax<acc_t> ? ranked_entmax15_shift<acc_t>(cand, k, work)
                                   : std::numeric_limits<acc_t>::quiet_NaN();
  acc_t norm = acc_t(1);
  if (c != c) c = find_shift<acc_t, Family::kEntmax15>(cand, k, b, work, &norm);
  if (!(c >= start)) {
    // The start was not left of the shift (by rounding, or ties): the list
    // may miss part of the support. From c = 0, which is left.
    k = gather(acc_t(-2));
    c = find_shift<acc_t, Family::kEntmax15>(cand, k, b, work, &norm);
  }
  if (k_out) *k_out = k;
  if (norm_out) *norm_out = norm;
  if (out) write_probs<acc_t, Family::kEntmax15>(x, n, m, c, b, norm, out);
  return c;
}

// The generic family's probabilities for b > 1 (α > 2), in p-space
// (math::edge_solve, attnkern/entmax_edge.h, says why), over the entries with
// 1 + b(y - c) > -1/8 at the shift c found by find_shift, which hold the
// support with a wide margin (checked: the largest entry left out must be
// outside by the support rule, else the whole row is taken). out may alias
// x; vals and idx are scratch of n entries.
template <typename acc_t>
inline void write_probs_edge(const acc_t* x, int64_t n, acc_t m, acc_t c, acc_t b, acc_t* out, acc_t* vals,
                             int32_t* idx) {
  thread_local std::vector<double> z;  // the gathered scores
  const double inf = std::numeric_limits<double>::infinity();
  const double bd = static_cast<double>(b);
  int64_t k = 0;
  double left_out = -inf;  // the largest score not gathered
  auto gather = [&](acc_t cut) {
    k = positions_above(x, n, m, cut, vals, idx);
    z.resize(k);
    for (int64_t t = 0; t < k; ++t) z[t] = static_cast<double>(x[idx[t]]);
    using V = Vec<acc_t>;
    // (The same test as positions_above's, (x - m) > cut, so that every entry is on one side.)
    const V vm(m), vcut(cut), vninf(-std::numeric_limits<acc_t>::infinity());
    V vmax = vninf;
    int64_t j = 0;
    for (; j + V::size() <= n; j += V::size()) {
      const V v = V::loadu(x + j);
      vmax = at::vec::maximum(vmax, V::blendv(v, vninf, (v - vm) > vcut));
    }
    acc_t rest = -std::numeric_limits<acc_t>::infinity();
    for (; j < n; ++j)
      if (!(x[j] - m > cut) && x[j] > rest) rest = x[j];
    const acc_t most = std::max(rest, at::vec::vec_reduce_all<acc_t>(
                                          [](V& a, V& c) { return at::vec::maximum(a, c); }, vmax));
    left_out = static_cast<double>(most);
  };
  const math::SerialLanes one;
  const auto score = [&](int64_t t) { return z[t]; };
  gather(c - acc_t(1.125) / b);
  if (k == 0 || (left_out > -inf && math::edge_probe(one, score, k, left_out, -inf, inf, bd).s < 1.0)) {
    // The margin did not hold the support (it always should): take the row.
    gather(-std::numeric_limits<acc_t>::infinity());
  }
  const double md = static_cast<double>(m), cd = static_cast<double>(c);
  const double tol = 8.0 * std::numeric_limits<acc_t>::epsilon() * (1.0 + std::abs(md) + std::abs(cd) + 1.0 / bd);
  const math::EdgeRow e = math::edge_solve(one, score, k, md, bd, md + cd - 1.0 / bd, tol);
  std::fill(out, out + n, acc_t(0));
  for (int64_t t = 0; t < k; ++t) out[idx[t]] = static_cast<acc_t>(math::edge_prob(e, z[t], bd));
}

// Shift and probabilities of one row x[0:n] of a sparse family (or the
// generic one) whose max m is finite: out = norm · φ((x - m) - c), returns c.
// out may alias x; cand and work are scratch of n entries each, idx of n.
//
// With y = x - m, the max entry alone gives φ(-c) <= 1, so c >= 0 and for
// b > 0 no entry with y <= -1/b is ever in the support: the search runs over
// the entries above -1/b only, gathered in one pass (for random scores a
// tenth of the row for entmax15), and the row itself is read once more, to
// write the probabilities.
//
// entmax15 also solves without writing (out null), for a caller that gathers
// the support itself (support_list): *norm_out gets the factor.
template <typename acc_t, Family FAM>
inline acc_t solve_row(const acc_t* x, int64_t n, acc_t m, acc_t b, acc_t* out, acc_t* cand, acc_t* work,
                       int32_t* idx, const acc_t* lanes = nullptr, acc_t* norm_out = nullptr) {
  static_assert(FAM != Family::kSoftmax, "softmax rows have no shift search");
  if constexpr (FAM == Family::kEntmax15) {
    if (lanes) return solve_entmax15_from_lanes<acc_t>(x, n, m, out, cand, work, lanes, norm_out);
  }
  if constexpr (FAM == Family::kGeneric) {
    if (b > acc_t(0) && b < acc_t(1)) return solve_generic_convex<acc_t>(x, n, m, b, out, cand, work, idx, lanes);
  }
  if constexpr (FAM == Family::kSparsemax) {
    // Sparsemax returns its threshold θ - m instead of c = 1 + θ - m, which
    // would round every p at the scale of 1 (sparsemax_threshold).
    const double theta = sparsemax_threshold<acc_t>(x, n, m, cand);
    write_sparsemax<acc_t>(x, n, theta, out);
    return static_cast<acc_t>(theta - static_cast<double>(m));
  }
  int64_t k = n;
  if (b > acc_t(0)) {
    k = shifted_above(x, n, m, -acc_t(1) / b, cand);
  } else {
    subtract_into(x, n, m, cand);
  }
  acc_t norm;
  const acc_t c = find_shift<acc_t, FAM>(cand, k, b, work, &norm);
  if constexpr (FAM == Family::kEntmax15) {
    if (norm_out) *norm_out = norm;
    if (!out) return c;
  }
  if constexpr (FAM == Family::kGeneric) {
    if (b > acc_t(1)) {
      write_probs_edge<acc_t>(x, n, m, c, b, out, work, idx);
    } else {
      write_probs_sparse<acc_t>(x, n, m, c, b, norm, out, work, idx);
    }
  } else {
    write_probs<acc_t, FAM>(x, n, m, c, b, norm, out);
  }
  return c;
}

// The backward of a sparse family on a sparse row: only the support's entries
// are gathered (support_entries, one pass that also zeroes dx), so g (a power
// for the generic family, a square root for entmax15) and the two sums cost
// O(support) instead of two passes over the row: dx = scale · g ⊙ (dp - Σ g
// dp / Σ g), zero off the support (dx may alias dp, not p). p, dp and dx are
// stored in scalar_t (acc_t, or bfloat16 / half widened to float as read and
// rounded once as written: no full row is converted). gbuf: 2n entries, the
// gathered p then g (first k) and dp (from n); idx: n entries. Returns false
// when the support is over a quarter of the row, where the dense passes are
// as cheap: dx then holds dp on the support and zeros elsewhere, so a dense
// backward that reads dp from dx (the same buffer) gets the entries it uses.
template <typename acc_t, Family FAM, typename scalar_t = acc_t>
inline bool backward_row_sparse(const scalar_t* p, const scalar_t* dp, scalar_t* dx, acc_t* gbuf, int32_t* idx,
                                int64_t n, acc_t b, acc_t scale) {
  static_assert(FAM != Family::kSoftmax, "softmax rows are dense");
  acc_t* g = gbuf;
  acc_t* dpk = gbuf + n;
  // (sparsemax: g = 1 on the support, so p's values are not gathered.)
  const int64_t k = support_entries<scalar_t, acc_t, FAM != Family::kSparsemax>(p, dp, dx, n, g, dpk, idx);
  if (k == 0 || 4 * k > n) {
    // The dense passes take the row (k = 0: a NaN or empty row). dx is zero
    // now; dp's entries on the support go back (dp may be dx): those are the
    // only ones the dense backward uses (g is zero off the support).
    for (int64_t i = 0; i < k; ++i) dx[idx[i]] = static_cast<scalar_t>(dpk[i]);
    return false;
  }
  using V = Vec<acc_t>;
  // g from the gathered p (sparsemax: 1, the gathered values are not read).
  auto g_of = [&](const acc_t* pk, int64_t rest) -> V {
    if constexpr (FAM == Family::kSparsemax) {
      return V(acc_t(1));
    }
    const V pv = rest < V::size() ? load_tail(pk, rest, acc_t(1)) : V::loadu(pk);  // fill 1: a valid p
    if constexpr (FAM == Family::kEntmax15) {
      return pv.sqrt();
    } else {
      // pow_unit takes exponents in (0, 1); for b > 1 (α > 2) the exponent is negative.
      return b < acc_t(1) ? pow_unit<acc_t>(pv, acc_t(1) - b) : (V(acc_t(1) - b) * pv.log()).exp();
    }
  };
  int64_t i = 0;
  V vgsum(0), vgdp(0);
  for (; i + V::size() <= k; i += V::size()) {
    const V gv = g_of(g + i, V::size());
    gv.store(g + i);
    vgsum += gv;
    vgdp += gv * V::loadu(dpk + i);
  }
  if (i < k) {  // the tail as one masked vector
    const int64_t rest = k - i;
    const V gv = V::blendv(V(0), g_of(g + i, rest), tail_lanes<acc_t>(rest));
    gv.store(g + i, static_cast<int>(rest));
    vgsum += gv;
    vgdp += gv * V::loadu(dpk + i, rest);
  }
  const acc_t gsum = hsum(vgsum), gdp = hsum(vgdp);
  const acc_t mean = gsum > acc_t(0) ? gdp / gsum : acc_t(0);
  i = 0;
  if constexpr (!std::is_same_v<scalar_t, acc_t>) {
    // bfloat16 / half: rounded a vector pair at a time (a scalar rounding
    // with its NaN check was a fifth of this function), then scattered.
    constexpr int64_t W = V::size();
    const V vs(scale), vm(mean);
    alignas(64) scalar_t rounded[2 * W];
    for (; i + 2 * W <= k; i += 2 * W) {
      at::vec::convert_from_float<scalar_t>(vs * V::loadu(g + i) * (V::loadu(dpk + i) - vm),
                                            vs * V::loadu(g + i + W) * (V::loadu(dpk + i + W) - vm))
          .store(rounded);
      for (int64_t l = 0; l < 2 * W; ++l) dx[idx[i + l]] = rounded[l];
    }
  }
  for (; i < k; ++i) dx[idx[i]] = static_cast<scalar_t>(scale * g[i] * (dpk[i] - mean));
  return true;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

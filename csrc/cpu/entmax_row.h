// Vectorized per-row building blocks of the α-entmax family on the CPU: the
// row max, the threshold ("shift", see attnkern/entmax_math.h) and the
// probabilities. Shared by the row-wise normalizers and the fused attention
// kernels, so each threshold algorithm has one home.
//
// The shift is found by safeguarded Newton from the left with the candidate
// list compacted after every step: an entry outside the support at a point
// left of the root stays outside, so after a step or two the iterations touch
// only the few entries that can still be in the support. sparsemax and
// entmax15 finish with their closed form on the support.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attnkern/entmax_math.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace attnkern {
namespace cpu {

using math::Family;

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

// Flushes denormal results and inputs to zero while in scope (restores the
// thread's mode after). Probabilities below the smallest normal float are
// zeros for every purpose here, and denormal arithmetic costs ~100 cycles an
// operation on the tails of the powers.
struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

template <typename acc_t>
inline acc_t hsum(const Vec<acc_t>& v) {
  return at::vec::vec_reduce_all<acc_t>([](Vec<acc_t>& a, Vec<acc_t>& b) { return a + b; }, v);
}

// Stores the lanes of v selected by `mask` (bit l = lane l) contiguously at
// dst and returns how many: branch-free stream compaction. dst must have
// room for a whole vector (it may alias the lanes just loaded: the store never
// runs ahead of the read position).
template <typename acc_t>
inline int left_pack(acc_t* dst, const Vec<acc_t>& v, int mask) {
  alignas(64) acc_t lanes[Vec<acc_t>::size()];
  v.store(lanes);
  int k = 0;
  for (int l = 0; l < Vec<acc_t>::size(); ++l) {
    dst[k] = lanes[l];
    k += (mask >> l) & 1;
  }
  return k;
}

#if !defined(CPU_CAPABILITY_AVX2)
inline int left_pack_index(int32_t* dst, int32_t j, int mask) {
  int k = 0;
  for (int l = 0; l < 8; ++l) {
    dst[k] = j + l;
    k += (mask >> l) & 1;
  }
  return k;
}
#endif

// Lane-index mask of a comparison result (bit l set where lane l is true).
template <typename acc_t>
inline int lane_mask(const Vec<acc_t>& cmp) {
  return ~cmp.zero_mask() & ((1 << Vec<acc_t>::size()) - 1);
}

#if defined(CPU_CAPABILITY_AVX2)
struct LeftPackTable {
  alignas(32) int32_t idx[256][8];
  constexpr LeftPackTable() : idx() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int l = 0; l < 8; ++l)
        if ((m >> l) & 1) idx[m][k++] = l;
    }
  }
};
inline constexpr LeftPackTable kLeftPack{};

template <>
inline int left_pack<float>(float* dst, const Vec<float>& v, int mask) {
  __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLeftPack.idx[mask]));
  _mm256_storeu_ps(dst, _mm256_permutevar8x32_ps(__m256(v), perm));
  return __builtin_popcount(mask);
}

// The positions j..j+7 of the lanes selected by mask, stored at dst.
inline int left_pack_index(int32_t* dst, int32_t j, int mask) {
  __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLeftPack.idx[mask]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_add_epi32(perm, _mm256_set1_epi32(j)));
  return __builtin_popcount(mask);
}
#define ATTNKERN_HAS_LEFT_PACK_INDEX 1

template <>
inline int lane_mask<float>(const Vec<float>& cmp) {
  return _mm256_movemask_ps(__m256(cmp));
}
#endif

// 1/d: exact division in general; on AVX2 float, the hardware estimate with
// one Newton-Raphson step (~2 ulp), which keeps the divider (one ymm division
// per 5 cycles) off the critical path of the power passes.
template <typename acc_t>
inline Vec<acc_t> recip(const Vec<acc_t>& d) {
  return Vec<acc_t>(acc_t(1)) / d;
}

#if defined(CPU_CAPABILITY_AVX2)
template <>
inline Vec<float> recip<float>(const Vec<float>& dv) {
  __m256 d = __m256(dv);
  __m256 r = _mm256_rcp_ps(d);
  return Vec<float>(_mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.0f))));
}
#endif

// d^e for 0 < d <= 1 (lanes outside are the caller's to mask), e > 0.
// These powers are the cost of every α-entmax pass; Sleef's u10 log1p/exp
// spend ~250 instructions a vector on them. For float on AVX2 this computes
// 2^(e·log2 d) with short polynomials instead: log via atanh series on the
// mantissa in [1/√2, √2) (|s| <= 0.172, 5 terms, ~1e-9), 2^f via Taylor
// around f = 1/2 (7 terms, ~5e-9); relative error a few float ulps times e.
// Denormal d are flushed to the smallest normal and results below 2^-126 to
// zero (they are below any probability that matters, and denormal arithmetic
// is slow).
template <typename acc_t>
inline Vec<acc_t> pow_unit(const Vec<acc_t>& d, acc_t e) {
  return (d.log() * Vec<acc_t>(e)).exp();
}

// Smallest b = α - 1 for which pow_unit's error (a few ulps times 1/b) stays
// near float32 resolution; below it the exact log1p/exp path is used.
template <typename acc_t>
constexpr acc_t kFastPowMinB = acc_t(1.0 / 32);

#if defined(CPU_CAPABILITY_AVX2)
template <>
inline Vec<float> pow_unit<float>(const Vec<float>& dv, float e) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 d = _mm256_max_ps(__m256(dv), _mm256_set1_ps(1.17549435e-38f));
  __m256i bits = _mm256_castps_si256(d);
  __m256i ex = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  // m in [1, 2): fold to [1/√2, √2).
  __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  __m256 exf = _mm256_add_ps(_mm256_cvtepi32_ps(ex), _mm256_and_ps(big, one));
  __m256 sv = _mm256_mul_ps(_mm256_sub_ps(m, one), __m256(recip<float>(Vec<float>(_mm256_add_ps(m, one)))));
  __m256 s2 = _mm256_mul_ps(sv, sv);
  __m256 q = _mm256_fmadd_ps(s2, _mm256_set1_ps(1.0f / 9), _mm256_set1_ps(1.0f / 7));
  q = _mm256_fmadd_ps(q, s2, _mm256_set1_ps(1.0f / 5));
  q = _mm256_fmadd_ps(q, s2, _mm256_set1_ps(1.0f / 3));
  q = _mm256_fmadd_ps(q, s2, one);
  // log2 d = ex + 2 s q / ln 2
  __m256 l2 = _mm256_fmadd_ps(_mm256_mul_ps(sv, q), _mm256_set1_ps(2.88539008f), exf);
  __m256 z = _mm256_mul_ps(l2, _mm256_set1_ps(e));
  __m256 tiny = _mm256_cmp_ps(z, _mm256_set1_ps(-126.0f), _CMP_LT_OQ);
  z = _mm256_max_ps(z, _mm256_set1_ps(-126.0f));
  __m256 n = _mm256_floor_ps(z);
  __m256 x = _mm256_mul_ps(_mm256_sub_ps(_mm256_sub_ps(z, n), _mm256_set1_ps(0.5f)),
                           _mm256_set1_ps(0.693147181f));
  __m256 r = _mm256_fmadd_ps(x, _mm256_set1_ps(1.0f / 5040), _mm256_set1_ps(1.0f / 720));
  r = _mm256_fmadd_ps(r, x, _mm256_set1_ps(1.0f / 120));
  r = _mm256_fmadd_ps(r, x, _mm256_set1_ps(1.0f / 24));
  r = _mm256_fmadd_ps(r, x, _mm256_set1_ps(1.0f / 6));
  r = _mm256_fmadd_ps(r, x, _mm256_set1_ps(0.5f));
  r = _mm256_fmadd_ps(r, x, one);
  r = _mm256_fmadd_ps(r, x, one);
  r = _mm256_mul_ps(r, _mm256_set1_ps(1.41421356f));
  __m256i sc = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return Vec<float>(_mm256_andnot_ps(tiny, _mm256_mul_ps(r, _mm256_castsi256_ps(sc))));
}
#endif

template <typename acc_t>
inline acc_t row_max(const acc_t* y, int64_t n) {
  using V = Vec<acc_t>;
  int64_t j = 0;
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  if (n >= V::size()) {
    V vm = V::loadu(y);
    for (j = V::size(); j + V::size() <= n; j += V::size()) vm = at::vec::maximum(vm, V::loadu(y + j));
    m = at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; j < n; ++j) {
    acc_t v = y[j];
    m = (v > m || v != v) ? v : m;
  }
  return m;
}

template <typename acc_t>
inline void subtract(acc_t* y, int64_t n, acc_t m) {
  using V = Vec<acc_t>;
  const V vm(m);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) (V::loadu(y + j) - vm).store(y + j);
  for (; j < n; ++j) y[j] -= m;
}

// dst = src - m.
template <typename acc_t>
inline void subtract_into(const acc_t* src, int64_t n, acc_t m, acc_t* dst) {
  using V = Vec<acc_t>;
  const V vm(m);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) (V::loadu(src + j) - vm).store(dst + j);
  for (; j < n; ++j) dst[j] = src[j] - m;
}

// Σ φ(y - c), Σ g and Σ g/d over y[0:n] for the family FAM (b = α - 1);
// g = p/d = -∂p/∂c and g/d = ∂²p/∂c² / (1 - b) feed Newton and Halley steps.
template <typename acc_t>
struct ShiftSums {
  acc_t p = 0, g = 0, h = 0;
};

// Adds the terms of one vector of t = y - c to the running Σp, Σg, Σg/d.
template <typename acc_t, Family FAM>
inline void add_shift_terms(const Vec<acc_t>& t, acc_t b, Vec<acc_t>& sp, Vec<acc_t>& sg, Vec<acc_t>& sh) {
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

// The scalar tail of add_shift_terms.
template <typename acc_t, Family FAM>
inline void add_shift_terms(acc_t t, acc_t b, ShiftSums<acc_t>& s) {
  acc_t p = math::entmax_phi<acc_t>(t, b, FAM);
  if (p > acc_t(0)) {
    acc_t g = math::entmax_g_from_p<acc_t>(p, b, FAM);
    s.p += p;
    s.g += g;
    s.h += g / math::entmax_base<acc_t>(t, b);
  }
}

// Evaluates the sums at c over cand[0:n] and, in the same pass, drops the
// entries not above `cut` (cand is compacted in place). Returns the new count.
template <typename acc_t, Family FAM>
inline int64_t eval_compact(acc_t* cand, int64_t n, acc_t c, acc_t b, acc_t cut, ShiftSums<acc_t>& out) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vc(c), vcut(cut);
  V sp(0), sg(0), sh(0);
  int64_t j = 0, k = 0;
  for (; j + kLanes <= n; j += kLanes) {
    V v = V::loadu(cand + j);
    const int keep = lane_mask<acc_t>(v > vcut);
    add_shift_terms<acc_t, FAM>(v - vc, b, sp, sg, sh);
    k += left_pack(cand + k, v, keep);
  }
  ShiftSums<acc_t> s;
  s.p = hsum(sp);
  s.g = hsum(sg);
  s.h = hsum(sh);
  for (; j < n; ++j) {
    acc_t e = cand[j];
    if (!(e > cut)) continue;
    cand[k++] = e;
    add_shift_terms<acc_t, FAM>(e - c, b, s);
  }
  out = s;
  return k;
}

// Σ φ(y - c) and Σ g over y[0:n] (no compaction).
template <typename acc_t, Family FAM>
inline void eval_shift(const acc_t* y, int64_t n, acc_t c, acc_t b, acc_t& sum_p, acc_t& sum_g) {
  using V = Vec<acc_t>;
  const V vc(c);
  V sp(0), sg(0), sh(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) add_shift_terms<acc_t, FAM>(V::loadu(y + j) - vc, b, sp, sg, sh);
  ShiftSums<acc_t> s;
  s.p = hsum(sp);
  s.g = hsum(sg);
  for (; j < n; ++j) add_shift_terms<acc_t, FAM>(y[j] - c, b, s);
  sum_p = s.p;
  sum_g = s.g;
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
  acc_t sum = hsum(vsum);
  for (; j < n; ++j) {
    acc_t e = src[j];
    if (e > cut) {
      dst[k++] = e;
      sum += e;
    }
  }
  if (sum_out) *sum_out = sum;
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
  acc_t s = 0;
  for (int64_t j = 0; j < k; ++j) s += a[j];
  // With a_i = 1 + y_i/2: mean and population variance, two-pass.
  acc_t mean_y = s / acc_t(k);
  acc_t ss = 0;
  for (int64_t j = 0; j < k; ++j) {
    acc_t t = a[j] - mean_y;
    ss += t * t;
  }
  acc_t var_a = acc_t(0.25) * ss / acc_t(k);
  acc_t mean_a = acc_t(1) + acc_t(0.5) * mean_y;
  acc_t c = math::entmax15_shift_on_support<acc_t>(mean_a, var_a, k);
  if (c != c) return c;
  for (int64_t j = 0; j < k; ++j)
    if (!(acc_t(1) + acc_t(0.5) * (a[j] - c) > acc_t(0))) return std::numeric_limits<acc_t>::quiet_NaN();
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
// last point known to be left of the root.
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
      acc_t csp = sparsemax_shift(y, n, work, &ks);
      if constexpr (FAM == Family::kGeneric) {
        // For b < 1/2, φ_b >= φ_(1/2) too, and entmax15's shift (cheap: its
        // power is a square) is a closer left start than sparsemax's.
        if (b < acc_t(0.5)) {
          acc_t unused;
          csp = find_shift<acc_t, Family::kEntmax15>(y, n, acc_t(0.5), work, &unused);
        }
      }
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
    for (int it = 0; it < kMaxIterations; ++it) {
      acc_t cut = b > acc_t(0) ? (c_is_left ? c : lo) - acc_t(1) / b : kNoCut;
      k = eval_compact<acc_t, FAM>(work, k, c, b, cut, s);
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
    }
    if constexpr (FAM == Family::kEntmax15) {
      int64_t ke = compact_above(work, k, c - acc_t(2), work, static_cast<acc_t*>(nullptr));
      acc_t ce = exact_shift<acc_t, FAM>(work, ke);
      if (ce == ce) return ce;
    }
    eval_compact<acc_t, FAM>(work, k, c, b, kNoCut, s);
    if (s.p > acc_t(0)) *norm = acc_t(1) / s.p;
    return c;
  }
}

// out[j] = norm · φ(y[j] - c).
template <typename acc_t, Family FAM>
inline void write_probs(const acc_t* y, int64_t n, acc_t c, acc_t b, acc_t norm, acc_t* out) {
  using V = Vec<acc_t>;
  const V vc(c), vone(1), vzero(0), vb(b), vinv_b(acc_t(1) / b), vnorm(norm);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V t = V::loadu(y + j) - vc;
    V p;
    if constexpr (FAM == Family::kSoftmax) {
      p = t.exp_u20();
    } else if constexpr (FAM == Family::kSparsemax) {
      p = at::vec::maximum(vone + t, vzero);
    } else if constexpr (FAM == Family::kEntmax15) {
      V d = at::vec::maximum(vone + t * V(acc_t(0.5)), vzero);
      p = d * d;
    } else {
      V bt = vb * t;
      V pos = (vone + bt) > vzero;
      p = V::blendv(vzero, b >= kFastPowMinB<acc_t> ? pow_unit<acc_t>(vone + bt, acc_t(1) / b) : (bt.log1p() * vinv_b).exp(),
                    pos);
    }
    (p * vnorm).store(out + j);
  }
  for (; j < n; ++j) out[j] = norm * math::entmax_phi<acc_t>(y[j] - c, b, FAM);
}

// Positions (idx) and values (vals) of the entries of y[0:n] above `cut`;
// returns their count.
template <typename acc_t>
inline int64_t positions_above(const acc_t* y, int64_t n, acc_t cut, acc_t* vals, int32_t* idx) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V vcut(cut);
  int64_t k = 0, j = 0;
  if constexpr (kLanes == 8) {
    for (; j + kLanes <= n; j += kLanes) {
      V v = V::loadu(y + j);
      int mask = lane_mask<acc_t>(v > vcut);
      left_pack(vals + k, v, mask);
      k += left_pack_index(idx + k, static_cast<int32_t>(j), mask);
    }
  }
  for (; j < n; ++j) {
    if (y[j] > cut) {
      vals[k] = y[j];
      idx[k++] = static_cast<int32_t>(j);
    }
  }
  return k;
}

// write_probs for the generic family with b > 0 on a sparse row: zeros, then
// the powers of the support entries only, scattered to their positions.
// Falls back to the dense pass when the support is a large part of the row.
template <typename acc_t>
inline void write_probs_sparse(const acc_t* y, int64_t n, acc_t c, acc_t b, acc_t norm, acc_t* out, acc_t* vals,
                               int32_t* idx) {
  if (!(b > acc_t(0))) return write_probs<acc_t, Family::kGeneric>(y, n, c, b, norm, out);
  // The support: entries with 1 + b(y - c) > 0.
  const int64_t k = positions_above(y, n, c - acc_t(1) / b, vals, idx);
  if (4 * k > n) return write_probs<acc_t, Family::kGeneric>(y, n, c, b, norm, out);
  write_probs<acc_t, Family::kGeneric>(vals, k, c, b, norm, vals);
  std::fill(out, out + n, acc_t(0));
  for (int64_t i = 0; i < k; ++i) out[idx[i]] = vals[i];
}

}  // namespace cpu
}  // namespace attnkern

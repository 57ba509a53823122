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

namespace attnkern {
namespace cpu {

using math::Family;

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

template <typename acc_t>
inline acc_t hsum(const Vec<acc_t>& v) {
  return at::vec::vec_reduce_all<acc_t>([](Vec<acc_t>& a, Vec<acc_t>& b) { return a + b; }, v);
}

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

// Σ φ(y - c) and Σ g over y[0:n] for the family FAM (b = α - 1).
template <typename acc_t, Family FAM>
inline void eval_shift(const acc_t* y, int64_t n, acc_t c, acc_t b, acc_t& sum_p, acc_t& sum_g) {
  using V = Vec<acc_t>;
  const V vc(c), vone(1), vzero(0), vb(b), vinv_b(acc_t(1) / b);
  V sp(0), sg(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V t = V::loadu(y + j) - vc;
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
    } else {
      V bt = vb * t;
      V d = vone + bt;
      V p = (bt.log1p() * vinv_b).exp();
      V pos = d > vzero;
      p = V::blendv(vzero, p, pos);
      sp += p;
      // g = p / d; d = +inf (y = -inf, b < 0) gives 0, d <= 0 is masked.
      sg += V::blendv(vzero, p / d, pos);
    }
  }
  acc_t s_p = hsum(sp), s_g = hsum(sg);
  for (; j < n; ++j) {
    acc_t t = y[j] - c;
    acc_t p = math::entmax_phi<acc_t>(t, b, FAM);
    s_p += p;
    if (p > acc_t(0)) s_g += math::entmax_g_from_p<acc_t>(p, b, FAM);
  }
  sum_p = s_p;
  sum_g = s_g;
}

// Keeps the entries of src whose base 1 + b(y - c) is positive (b > 0);
// src and dst may alias. Returns the new count.
template <typename acc_t>
inline int64_t compact_support(const acc_t* src, int64_t n, acc_t cut, acc_t* dst) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) {
    acc_t v = src[j];
    dst[k] = v;
    k += (v > cut) ? 1 : 0;
  }
  return k;
}

// exp(y - m) into e, returns the sum.
template <typename acc_t>
inline acc_t exp_shifted(const acc_t* y, int64_t n, acc_t m, acc_t* e) {
  using V = Vec<acc_t>;
  const V vm(m);
  V s(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V v = (V::loadu(y + j) - vm).exp();
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

// Closed-form finish on a candidate support (sparsemax, entmax15). Returns
// NaN when the candidates are not yet exactly the support.
template <typename acc_t, Family FAM>
inline acc_t exact_shift(const acc_t* a, int64_t k) {
  acc_t s = 0;
  for (int64_t j = 0; j < k; ++j) s += a[j];
  acc_t c;
  if constexpr (FAM == Family::kSparsemax) {
    c = math::sparsemax_shift_on_support<acc_t>(s, k);
    for (int64_t j = 0; j < k; ++j)
      if (!(acc_t(1) + (a[j] - c) > acc_t(0))) return std::numeric_limits<acc_t>::quiet_NaN();
  } else {
    // a_i = 1 + (y_i - m)/2: mean and population variance, two-pass.
    acc_t mean_y = s / acc_t(k);
    acc_t ss = 0;
    for (int64_t j = 0; j < k; ++j) {
      acc_t t = a[j] - mean_y;
      ss += t * t;
    }
    acc_t var_a = acc_t(0.25) * ss / acc_t(k);
    acc_t mean_a = acc_t(1) + acc_t(0.5) * mean_y;
    c = math::entmax15_shift_on_support<acc_t>(mean_a, var_a, k);
    if (c != c) return c;
    for (int64_t j = 0; j < k; ++j)
      if (!(acc_t(1) + acc_t(0.5) * (a[j] - c) > acc_t(0))) return std::numeric_limits<acc_t>::quiet_NaN();
  }
  return c;
}

constexpr int kMaxIterations = 200;

// Finds the shift c of one row y[0:n] whose max is 0 (the caller subtracted
// it). work: scratch of n entries. Returns c; sets *norm to the factor that
// makes the output sum to one (1 for the exact families).
template <typename acc_t, Family FAM>
acc_t find_shift(const acc_t* y, int64_t n, acc_t b, acc_t* work, acc_t* norm) {
  *norm = acc_t(1);
  if constexpr (FAM == Family::kSoftmax) {
    return std::log(exp_shifted(y, n, acc_t(0), work));
  } else {
    acc_t lo = 0, hi = math::entmax_shift_upper<acc_t>(n, b);
    acc_t c = 0;
    if constexpr (FAM == Family::kGeneric) {
      // Near softmax, Newton from the max needs about ln(n) steps; the
      // log-sum-exp is a bound on the correct side (b < 0: left; b > 0:
      // right, and one Newton step from the right of a convex root lands on
      // its left) and cuts that to a few.
      if (b < acc_t(0.25)) {
        acc_t lse = std::log(exp_shifted(y, n, acc_t(0), work));
        if (b < acc_t(0)) {
          lo = std::max(lo, lse);
        } else {
          hi = std::min(hi, lse);
        }
        c = std::max(lo, std::min(lse, hi));
      }
    }
    const acc_t* cand = y;  // entries that can still be in the support
    int64_t k = n;
    bool from_newton = false;  // c came from a Newton step on the current candidates
    acc_t sum_p = 0, sum_g = 0;
    for (int it = 0; it < kMaxIterations; ++it) {
      eval_shift<acc_t, FAM>(cand, k, c, b, sum_p, sum_g);
      if (sum_p >= acc_t(1)) {
        lo = c;
        if (b > acc_t(0)) {
          // c is left of the root: an entry outside the support here stays
          // outside for good.
          int64_t k_new = compact_support(cand, k, c - acc_t(1) / b, work);
          bool stable = from_newton && k_new == k;
          cand = work;
          k = k_new;
          if constexpr (FAM == Family::kSparsemax) {
            // Newton is Michelot's algorithm here: once no candidate drops
            // out after a Newton step, c solves the support exactly.
            if (stable) return c;
          } else if constexpr (FAM == Family::kEntmax15) {
            if (stable) {
              acc_t ce = exact_shift<acc_t, FAM>(cand, k);
              if (ce == ce) return ce;
            }
          }
        }
      } else {
        hi = c;
      }
      if (math::entmax_converged<acc_t>(sum_p, lo, hi, k)) break;
      acc_t next = math::entmax_newton_update<acc_t>(c, sum_p, sum_g, lo, hi);
      from_newton = sum_g > acc_t(0) && next == c + (sum_p - acc_t(1)) / sum_g;
      if (next == c) break;  // below the dtype's resolution
      c = next;
    }
    if constexpr (FAM == Family::kGeneric) {
      eval_shift<acc_t, FAM>(cand, k, c, b, sum_p, sum_g);
      if (sum_p > acc_t(0)) *norm = acc_t(1) / sum_p;
    } else if constexpr (FAM == Family::kEntmax15) {
      acc_t ce = exact_shift<acc_t, FAM>(cand, k);
      if (ce == ce) return ce;
      eval_shift<acc_t, FAM>(cand, k, c, b, sum_p, sum_g);
      if (sum_p > acc_t(0)) *norm = acc_t(1) / sum_p;
    } else {
      eval_shift<acc_t, FAM>(cand, k, c, b, sum_p, sum_g);
      if (sum_p > acc_t(0)) *norm = acc_t(1) / sum_p;
    }
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
      p = t.exp();
    } else if constexpr (FAM == Family::kSparsemax) {
      p = at::vec::maximum(vone + t, vzero);
    } else if constexpr (FAM == Family::kEntmax15) {
      V d = at::vec::maximum(vone + t * V(acc_t(0.5)), vzero);
      p = d * d;
    } else {
      V bt = vb * t;
      p = V::blendv(vzero, (bt.log1p() * vinv_b).exp(), (vone + bt) > vzero);
    }
    (p * vnorm).store(out + j);
  }
  for (; j < n; ++j) out[j] = norm * math::entmax_phi<acc_t>(y[j] - c, b, FAM);
}

}  // namespace cpu
}  // namespace attnkern

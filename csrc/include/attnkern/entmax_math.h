// Scalar math shared by every attnkern kernel (CPU and CUDA).
//
// The α-entmax family is written in "shift" form. For one row of scores z and
// b = α - 1,
//
//     p_i = φ_b(z_i - c),   φ_b(y) = [1 + b·y]_+^(1/b)   (b ≠ 0),   φ_0(y) = exp(y)
//
// with the per-row shift c chosen so that Σ p_i = 1. This is the usual
// p = [(α-1)z - τ]_+^(1/(α-1)) with τ = b·c - 1, but c stays meaningful as
// b → 0 (it tends to the log-sum-exp), so one float per row, c, is what every
// normalizer saves: softmax saves the log-sum-exp, sparsemax/entmax save c.
// A row whose scores are all -inf has no support; its shift is +inf so that
// φ(z - c) = 0 for every entry.
//
// See docs/algorithms.md for the derivations; every formula here is checked
// against the float64 reference in tests/.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define AK_HD __host__ __device__ __forceinline__
#else
#define AK_HD inline
#endif

namespace attnkern {
namespace math {

// Below this |α - 1| the normalizer is treated as softmax in the forward pass
// (the difference is O(|α - 1|), far below float32 resolution at this size).
constexpr double kSoftmaxForwardBand = 1e-6;

// Below this |α - 1| the gradient in α uses its softmax limit; above it the
// general formula, whose two O(1/b) terms cancel, is accurate enough in the
// accumulation type (error about eps / b²).
template <typename acc_t>
AK_HD acc_t alpha_grad_limit_band() {
  return sizeof(acc_t) >= 8 ? acc_t(1e-5) : acc_t(1e-3);
}

enum class Family : int { kSoftmax = 0, kSparsemax = 1, kEntmax15 = 2, kGeneric = 3 };

// b = α - 1 classified into the family member with an exact algorithm.
template <typename acc_t>
AK_HD Family family_of(acc_t b) {
  if (b == acc_t(1)) return Family::kSparsemax;
  if (b == acc_t(0.5)) return Family::kEntmax15;
  if (b > acc_t(-kSoftmaxForwardBand) && b < acc_t(kSoftmaxForwardBand)) return Family::kSoftmax;
  return Family::kGeneric;
}

// d = 1 + b·y, the base of the power in φ_b; entries with d <= 0 (b > 0) are
// outside the support.
template <typename acc_t>
AK_HD acc_t entmax_base(acc_t y, acc_t b) {
  return acc_t(1) + b * y;
}

// φ_b(y) for one entry, any b (use the vectorized forms in hot CPU loops).
template <typename acc_t>
AK_HD acc_t entmax_phi(acc_t y, acc_t b, Family fam) {
  switch (fam) {
    case Family::kSoftmax:
      return std::exp(y);
    case Family::kSparsemax: {
      acc_t d = acc_t(1) + y;
      return d > acc_t(0) ? d : acc_t(0);
    }
    case Family::kEntmax15: {
      acc_t d = acc_t(1) + acc_t(0.5) * y;
      return d > acc_t(0) ? d * d : acc_t(0);
    }
    default: {
      acc_t by = b * y;
      if (!(by > acc_t(-1))) {
        // b > 0: outside the support. b < 0: y = +inf cannot happen after the
        // max shift; y = -inf gives d = +inf and p = 0.
        return acc_t(0);
      }
      return std::exp(std::log1p(by) / b);
    }
  }
}

// g = p^(2-α) = p / d: the weight in the Jacobian-vector product, from p alone.
template <typename acc_t>
AK_HD acc_t entmax_g_from_p(acc_t p, acc_t b, Family fam) {
  switch (fam) {
    case Family::kSoftmax:
      return p;
    case Family::kSparsemax:
      return p > acc_t(0) ? acc_t(1) : acc_t(0);
    case Family::kEntmax15:
      return std::sqrt(p);
    default:
      return p > acc_t(0) ? std::exp((acc_t(1) - b) * std::log(p)) : acc_t(0);
  }
}

// Bracket for the shift, relative to the row max m (scores y = z - m <= 0):
// at c = 0 the top entry alone has p = 1, so Σp >= 1; at
// c = (1 - n^(-b)) / b every entry has p <= 1/n, so Σp <= 1.
template <typename acc_t>
AK_HD acc_t entmax_shift_upper(int64_t n, acc_t b) {
  acc_t ln_n = std::log(acc_t(n));
  if (b == acc_t(0)) return ln_n;
  return -std::expm1(-b * ln_n) / b;
}

// Sparsemax shift from a known support of k entries with Σ y = sum_y.
template <typename acc_t>
AK_HD acc_t sparsemax_shift_on_support(acc_t sum_y, int64_t k) {
  return acc_t(1) + (sum_y - acc_t(1)) / acc_t(k);
}

// entmax15 shift from a known support: with a_i = 1 + y_i / 2, the shift
// solves Σ (a_i - c/2)^2 = 1 on the support, whose left root is
// c/2 = mean(a) - sqrt(1/k - var(a)). Returns NaN when 1/k < var(a), which
// means the candidate set is not the support yet.
template <typename acc_t>
AK_HD acc_t entmax15_shift_on_support(acc_t mean_a, acc_t var_a, int64_t k) {
  acc_t disc = acc_t(1) / acc_t(k) - var_a;
  if (disc < acc_t(0)) return std::numeric_limits<acc_t>::quiet_NaN();
  return acc_t(2) * (mean_a - std::sqrt(disc));
}

// One safeguarded Newton update of the shift. f(c) = Σ φ(y - c) - 1 is
// decreasing; f'(c) = -Σ g. (lo, hi) brackets the root; the result stays
// strictly inside it, falling back to bisection.
template <typename acc_t>
AK_HD acc_t entmax_newton_update(acc_t c, acc_t sum_p, acc_t sum_g, acc_t lo, acc_t hi) {
  acc_t next = (sum_g > acc_t(0)) ? c + (sum_p - acc_t(1)) / sum_g
                                  : std::numeric_limits<acc_t>::quiet_NaN();
  if (!(next > lo && next < hi)) next = acc_t(0.5) * (lo + hi);
  return next;
}

// For 0 < b <= 1, h(c) = (Σ p)^b = ||[1 + b(y - c)]_+||_(1/b) is a norm of a
// clipped affine map of c: convex and decreasing. Newton on h (rather than on
// Σp) is exact for softmax (b -> 0: a log-sum-exp step) and for sparsemax on a
// fixed support, lands left of the root from either side, and needs few steps
// in between:  c <- c + Σp (1 - (Σp)^(-b)) / (b Σg).
template <typename acc_t>
AK_HD acc_t entmax_norm_newton_update(acc_t c, acc_t sum_p, acc_t sum_g, acc_t b, acc_t lo, acc_t hi) {
  acc_t next = std::numeric_limits<acc_t>::quiet_NaN();
  if (sum_g > acc_t(0) && sum_p > acc_t(0)) {
    next = c - sum_p * std::expm1(-b * std::log(sum_p)) / (b * sum_g);
  }
  if (!(next > lo && next < hi)) next = acc_t(0.5) * (lo + hi);
  return next;
}

// One safeguarded Halley update: f = sum_p - 1, f' = -sum_g, f'' = curv
// (= (1 - b) Σ g/d). Cubic convergence; falls back to Newton, then to
// bisection, when a step would leave the bracket (lo, hi).
template <typename acc_t>
AK_HD acc_t entmax_halley_update(acc_t c, acc_t sum_p, acc_t sum_g, acc_t curv, acc_t lo, acc_t hi) {
  acc_t f = sum_p - acc_t(1);
  acc_t denom = acc_t(2) * sum_g * sum_g - f * curv;
  if (denom > acc_t(0)) {
    acc_t next = c + acc_t(2) * f * sum_g / denom;
    if (next > lo && next < hi) return next;
  }
  return entmax_newton_update<acc_t>(c, sum_p, sum_g, lo, hi);
}

// Gradient of the loss in α for one row, from the row reductions of the
// backward pass (dp = upstream gradient on p):
//   pdp = Σ p dp,  gdp = Σ g dp,  gsum = Σ g,
//   plp = Σ p ln p dp,  ent = -Σ p ln p,  pl2dp = Σ p (ln p)^2 dp,  pl2 = Σ p (ln p)^2.
// General b:   dα = (pdp - ĝdp)/b² - (plp + ent·ĝdp)/b,  ĝdp = gdp / gsum.
// Near b = 0:  dα = -(pl2dp - pdp·pl2) / 2  (the derivative of entmax in α at α = 1).
template <typename acc_t>
AK_HD acc_t entmax_alpha_grad_row(acc_t b, acc_t pdp, acc_t gdp, acc_t gsum, acc_t plp, acc_t ent,
                                  acc_t pl2dp, acc_t pl2) {
  if (!(gsum > acc_t(0))) return acc_t(0);
  if (b > -alpha_grad_limit_band<acc_t>() && b < alpha_grad_limit_band<acc_t>()) {
    return -acc_t(0.5) * (pl2dp - pdp * pl2);
  }
  acc_t ghat_dp = gdp / gsum;
  return (pdp - ghat_dp) / (b * b) - (plp + ent * ghat_dp) / b;
}

// Convergence test for the iterative shift: Σp within a few ulps of 1 or a
// bracket too narrow to split.
template <typename acc_t>
AK_HD bool entmax_converged(acc_t sum_p, acc_t lo, acc_t hi, int64_t n) {
  const acc_t eps = std::numeric_limits<acc_t>::epsilon();
  acc_t err = sum_p - acc_t(1);
  if (err < acc_t(0)) err = -err;
  acc_t w = hi - lo;
  acc_t mag = (lo < acc_t(0) ? -lo : lo) + (hi < acc_t(0) ? -hi : hi) + acc_t(1);
  return err <= acc_t(4) * eps * std::sqrt(acc_t(n)) || w <= acc_t(4) * eps * mag;
}

}  // namespace math
}  // namespace attnkern

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
// normalizer saves: softmax saves the log-sum-exp, entmax saves c. The CPU
// and Triton attention kernels' sparsemax saves its threshold θ = c - 1 instead (p = [z - θ]_+):
// 1 + (z - c) would round every p at the scale of 1.
// A row whose scores are all -inf has no support; its shift is +inf so that
// φ(z - c) = 0 for every entry.
//
// See docs/algorithms.md for the derivations; every formula here is checked
// against the float64 reference in tests/.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "attnkern/family.h"
#include "attnkern/isa_namespace.h"

namespace attnkern {
namespace math {
ATTNKERN_ISA_BEGIN

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
    case Family::kGeneric: {
      acc_t by = b * y;
      if (!(by > acc_t(-1))) {
        // b > 0: outside the support. b < 0: y = +inf cannot happen after the
        // max shift; y = -inf gives d = +inf and p = 0.
        return acc_t(0);
      }
      return std::exp(std::log1p(by) / b);
    }
  }
  __builtin_unreachable();
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
    case Family::kGeneric:
      return p > acc_t(0) ? std::exp((acc_t(1) - b) * std::log(p)) : acc_t(0);
  }
  __builtin_unreachable();
}

// Bracket for the shift, relative to the row max m (scores y = z - m <= 0):
// at c = 0 the top entry alone has p = 1, so Σp >= 1; at
// c = (1 - n^(-b)) / b every entry has p <= 1/n, so Σp <= 1.
template <typename acc_t>
AK_HD acc_t entmax_shift_upper(int64_t n, acc_t b) {
  // sparsemax and entmax15 without libm calls (once per row on the CPU).
  if (b == acc_t(1)) return acc_t(1) - acc_t(1) / acc_t(n);
  if (b == acc_t(0.5)) return acc_t(2) - acc_t(2) / std::sqrt(acc_t(n));
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
// in between:  c <- c + u / Σg  with  u = (h - 1) / (b (Σp)^(b-1)) = Σp (1 - (Σp)^(-b)) / b,
// the residual of h in units of Σp's slope.
template <typename acc_t>
AK_HD acc_t entmax_norm_residual(acc_t sum_p, acc_t b) {
  // (Σp)^(-b) - 1, without cancellation as Σp -> 1: by expm1 in general,
  // by (1 - Σp) over a product for entmax15 and sparsemax (no libm calls).
  acc_t ratio_m1;
  if (b == acc_t(0.5)) {
    const acc_t r = std::sqrt(sum_p);
    ratio_m1 = (acc_t(1) - sum_p) / (r * (acc_t(1) + r));
  } else if (b == acc_t(1)) {
    ratio_m1 = (acc_t(1) - sum_p) / sum_p;
  } else if (sizeof(acc_t) == 4 && sum_p > acc_t(0.875) && sum_p < acc_t(1.125)) {
    // float near Σp = 1, where the search takes its late steps: series in
    // double instead of two libm calls. ln s = 2 atanh(z), z = (s-1)/(s+1),
    // |z| < 0.059, to z^9 (relative error < 1e-12); then expm1(x) to x^8/8!
    // (|x| < 0.134 for |b| <= 1; relative error < 1e-11 there).
    const double z = (double(sum_p) - 1.0) / (double(sum_p) + 1.0), z2 = z * z;
    const double ln_s = 2.0 * z * (1.0 + z2 * (1.0 / 3 + z2 * (1.0 / 5 + z2 * (1.0 / 7 + z2 / 9))));
    const double x = -double(b) * ln_s;
    if (x > -0.14 && x < 0.14) {
      ratio_m1 = acc_t(x * (1.0 + x * (1.0 / 2 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 +
                 x * (1.0 / 720 + x * (1.0 / 5040 + x / 40320))))))));
    } else {
      ratio_m1 = acc_t(std::expm1(x));
    }
  } else if (sizeof(acc_t) == 4 && b >= acc_t(1.0 / 32)) {
    // float away from Σp = 1 with |b ln Σp| >= 0.0037: one pow (its
    // latency is half that of log and expm1, and the search waits on it),
    // and Σp^(-b) - 1 cancels at most eight bits there.
    ratio_m1 = std::pow(sum_p, -b) - acc_t(1);
  } else {
    ratio_m1 = std::expm1(-b * std::log(sum_p));
  }
  return -sum_p * ratio_m1 / b;
}

// The step c + u / Σg from a residual u, bisecting when it leaves (lo, hi).
template <typename acc_t>
AK_HD acc_t entmax_norm_newton_step(acc_t c, acc_t u, acc_t sum_g, acc_t lo, acc_t hi) {
  const acc_t next = c + u / sum_g;
  return next > lo && next < hi ? next : acc_t(0.5) * (lo + hi);
}

template <typename acc_t>
AK_HD acc_t entmax_norm_newton_update(acc_t c, acc_t sum_p, acc_t sum_g, acc_t b, acc_t lo, acc_t hi) {
  if (!(sum_g > acc_t(0) && sum_p > acc_t(0))) return acc_t(0.5) * (lo + hi);
  return entmax_norm_newton_step<acc_t>(c, entmax_norm_residual<acc_t>(sum_p, b), sum_g, lo, hi);
}

// Halley's step on the same h, for 0 < b < 1: cubic convergence, so from an
// entmax15 start two steps usually reach float32 resolution where Newton's
// needs three. With u as above, h'/(b Σp^(b-1)) = -Σg and
// h''/(b Σp^(b-1)) = (1 - b)(Σ g/d - (Σg)²/Σp) >= 0 (Cauchy-Schwarz), so
//   c <- c + 2 u Σg / (2 (Σg)² - u (1 - b)(Σ g/d - (Σg)²/Σp)).
// Unlike Newton's, the step may land right of the root. Falls back to
// Newton's step when the denominator is not positive or the step leaves
// the bracket (lo, hi).
template <typename acc_t>
AK_HD acc_t entmax_norm_halley_update(acc_t c, acc_t sum_p, acc_t sum_g, acc_t sum_gd, acc_t b, acc_t lo, acc_t hi) {
  if (!(sum_g > acc_t(0) && sum_p > acc_t(0))) return acc_t(0.5) * (lo + hi);
  const acc_t u = entmax_norm_residual<acc_t>(sum_p, b);
  const acc_t bend = (acc_t(1) - b) * (sum_gd - sum_g * sum_g / sum_p);
  const acc_t denom = acc_t(2) * sum_g * sum_g - u * bend;
  acc_t next = denom > acc_t(0) ? c + acc_t(2) * u * sum_g / denom : std::numeric_limits<acc_t>::quiet_NaN();
  if (next > lo && next < hi) return next;
  return entmax_norm_newton_step<acc_t>(c, u, sum_g, lo, hi);
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

// Gradient of the loss in α for one row (dp = upstream gradient on p). With
// g = p^(2-α), ĝ = g / Σg, b = α - 1 and H = -Σ p ln p, the closed form
//   dα = (Σ p dp - Σ ĝ dp)/b² - (Σ p ln p dp + H Σ ĝ dp)/b
// has two O(1/b) terms that cancel to O(1): the rounding of the sums (even in
// double) is divided by b², ~1e-4 relative at |b| = 1e-6. For |b| below
// kAlphaGradSeriesBand the same quantity is taken in a form without
// cancellation. With l = ln p, E = p^(-b) = e^(-b l) and
//   Q = (E - 1 + b l)/b² = l² φ(-b l),   φ(x) = (eˣ - 1 - x)/x²,
// (so p^(1-b) = p (1 - b l + b² Q)) and Z = Σ p E,
//   dα = (Σp dp · ΣpQ - ΣpQ dp - b ΣpQ · Σp l dp - b H ΣpQ dp) / Z,
// which at b = 0 is the softmax limit -(Σ p l² dp - Σ p dp Σ p l²)/2.
// Every sum is in double over p renormalized to p̃ = p / Σp (a float32 p never
// sums to exactly 1; the formula is exact for p̃, itself a member of the
// family). Renormalizing is done on the sums: ln p̃ = l - Λ with Λ = ln Σp, and
// Q(l - Λ) = Q - Λ R + Λ²/2 E + O(Λ³ b) with R = dQ/dl = l ψ(-b l), so
// one pass over the support suffices (|Λ| ~ 1e-7 for float32 rows) and
// partial sums of a row merge with `merge`.
constexpr double kAlphaGradSeriesBand = 0.25;

// The cap on ln g in the sums of the α gradient (AlphaGradSums::add).
constexpr double kAlphaGradExpCap = 650.0;

// φ(x) = (eˣ - 1 - x)/x²: its Taylor series Σ x^k/(k+2)! (k <= 8, error below
// 3e-17) for |x| < 0.1, the closed form with expm1 beyond.
AK_HD double expm1_excess(double x) {
  if (x > -0.1 && x < 0.1) {
    double s = 0.0, f = 1.0 / 39916800.0;  // 1/11!, then down to 1/2!
    for (int k = 8; k >= 0; --k) {
      f *= static_cast<double>(k + 3);
      s = s * x + f;
    }
    return s;
  }
  return (std::expm1(x) - x) / (x * x);
}

// ψ(x) = (eˣ - 1)/x (ψ(0) = 1), accurate everywhere through expm1.
AK_HD double expm1_ratio(double x) {
  return x == 0.0 ? 1.0 : std::expm1(x) / x;
}

// The sums of a row's gradient in α, in the form of docs/algorithms.md, section 4
// (the Triton backward and attnkern.autograd.entmax_alpha_derivative take the same).
struct AlphaGradSums {
  // Σp, Σ p^(1-b), Σ p^(1-b) dp, Σ p dp, Σ p l, Σ p l dp (general and near
  // forms); Σ p Q, Σ p Q dp, Σ p R, Σ p R dp (near form only).
  double sp = 0, gsum = 0, gdp = 0, pdp = 0, pl = 0, pldp = 0, pq = 0, pqdp = 0, pr = 0, prdp = 0;
  static constexpr int kCount = 10;

  // One support entry (p > 0); entries with p <= 0 are ignored.
  AK_HD void add(double p, double dp, double b) {
    if (!(p > 0)) return;
    const double l = std::log(p), pl_ = p * l;
    sp += p;
    pdp += p * dp;
    pl += pl_;
    pldp += pl_ * dp;
    if (b > -kAlphaGradSeriesBand && b < kAlphaGradSeriesBand) {
      const double x = -b * l, g = p * std::exp(x);
      const double q = p * l * l * expm1_excess(x), r = pl_ * expm1_ratio(x);
      gsum += g;
      gdp += g * dp;
      pq += q;
      pqdp += q * dp;
      pr += r;
      prdp += r * dp;
    } else {
      // Only the ratio Σ g dp / Σ g is used, and g = p^(1-b) overflows double
      // at the edge of the support for large α: the exponent is capped. In
      // effect that is exact: two distinct support entries p_i > p_j have
      // p_i^b - p_j^b = b (z_i - z_j), at least b ulps of the scores, so only
      // one group of tied scores can come near the cap (scores of order 1e-3
      // or more keep every other g below e^45 up to α = 20), and beside it
      // the other entries' weights are below e^-600 either way.
      const double x = (1.0 - b) * l;
      const double g = std::exp(x < kAlphaGradExpCap ? x : kAlphaGradExpCap);
      gsum += g;
      gdp += g * dp;
    }
  }

  AK_HD void merge(const AlphaGradSums& o) {
    sp += o.sp, gsum += o.gsum, gdp += o.gdp, pdp += o.pdp, pl += o.pl, pldp += o.pldp;
    pq += o.pq, pqdp += o.pqdp, pr += o.pr, prdp += o.prdp;
  }

  // The sums as an array (for reductions across threads) and back.
  AK_HD void to_array(double* a) const {
    a[0] = sp, a[1] = gsum, a[2] = gdp, a[3] = pdp, a[4] = pl;
    a[5] = pldp, a[6] = pq, a[7] = pqdp, a[8] = pr, a[9] = prdp;
  }
  AK_HD void from_array(const double* a) {
    sp = a[0], gsum = a[1], gdp = a[2], pdp = a[3], pl = a[4];
    pldp = a[5], pq = a[6], pqdp = a[7], pr = a[8], prdp = a[9];
  }

  // dα of the row; 0 for a row without support.
  AK_HD double grad(double b) const {
    if (!(sp > 0) || !(gsum > 0)) return 0.0;
    const double L = std::log(sp), inv = 1.0 / sp;
    // Sums over p̃ = p / sp, with ln p̃ = ln p - L.
    const double t_pdp = pdp * inv;
    const double t_pldp = (pldp - L * pdp) * inv;
    const double t_ent = -(pl * inv - L);
    if (b > -kAlphaGradSeriesBand && b < kAlphaGradSeriesBand) {
      const double t_pq = (pq - L * pr + 0.5 * L * L * gsum) * inv;
      const double t_pqdp = (pqdp - L * prdp + 0.5 * L * L * gdp) * inv;
      const double t_z = gsum * std::exp(b * L) * inv;
      return (t_pdp * t_pq - t_pqdp - b * t_pq * t_pldp - b * t_ent * t_pqdp) / t_z;
    }
    const double ghat_dp = gdp / gsum;
    return (t_pdp - ghat_dp) / (b * b) - (t_pldp + t_ent * ghat_dp) / b;
  }
};

// Convergence test for the iterative shift: Σp (of n terms) within a few
// ulps of 1 ...
template <typename acc_t>
AK_HD bool entmax_sum_converged(acc_t sum_p, int64_t n) {
  const acc_t err = sum_p - acc_t(1);
  return (err < acc_t(0) ? -err : err) <= acc_t(4) * std::numeric_limits<acc_t>::epsilon() * std::sqrt(acc_t(n));
}

// ... or a bracket too narrow to split.
template <typename acc_t>
AK_HD bool entmax_converged(acc_t sum_p, acc_t lo, acc_t hi, int64_t n) {
  const acc_t eps = std::numeric_limits<acc_t>::epsilon();
  acc_t w = hi - lo;
  acc_t mag = (lo < acc_t(0) ? -lo : lo) + (hi < acc_t(0) ? -hi : hi) + acc_t(1);
  return entmax_sum_converged<acc_t>(sum_p, n) || w <= acc_t(4) * eps * mag;
}

ATTNKERN_ISA_END
}  // namespace math
}  // namespace attnkern

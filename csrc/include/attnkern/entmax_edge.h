// α-entmax for α > 2 (b = α - 1 > 1) in p-space, forward and backward, written
// once for a group of lanes that share a row: the CPU kernels run it on one
// lane (SerialLanes) over their gathered candidates, the CUDA row kernels on a
// thread, a warp or a block per row.
//
// Why p-space: the shift form p = (1 + b(y - c))^(1/b) needs 1 + b(y - c) =
// p^b at the edge of the support, 1e-36 for p = 1e-4 at α = 10, beside terms
// of order 1. Measured from the support's smallest score z_r (the pivot),
// every support entry is p_i = (q^b + b(z_i - z_r))^(1/b) with q = p_r: a sum
// of two non-negative terms, accurate to the rounding of z_i - z_r, and q
// solves F(q) = m_r q + Σ_(z_i > z_r) (q^b + b(z_i - z_r))^(1/b) = 1 (m_r
// entries tied at z_r), a convex increasing function with F' >= m_r: well
// conditioned where the shift's equation is not (docs/algorithms.md).
//
// A group G offers lane(), size(), sum<N>(double*) and max(double) over its
// lanes, every lane getting the same result (the CUDA kernels' thread groups).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "attnkern/family.h"
#include "attnkern/isa_namespace.h"

namespace attnkern {
namespace math {
ATTNKERN_ISA_BEGIN

// One lane holding the whole row: nothing to reduce.
struct SerialLanes {
  AK_HD int lane() const { return 0; }
  AK_HD int size() const { return 1; }
  template <int N, typename T>
  AK_HD void sum(T*) const {}
  template <typename T>
  AK_HD T max(T v) const {
    return v;
  }
};

// The solution of one row: every support entry's probability follows.
struct EdgeRow {
  double pivot;  // z_r, the support's smallest score
  double q;      // p at the pivot (and at every score tied with it)
  double qb;     // q^b
};

AK_HD double edge_prob(const EdgeRow& e, double z, double b) {
  if (z == e.pivot) return e.q;
  if (!(z > e.pivot)) return 0.0;
  return std::exp(std::log(e.qb + b * (z - e.pivot)) / b);
}

// The support rule: with S(t) = Σ_(z_i > t) (b(z_i - t))^(1/b), a score z_j is
// in the support iff S(z_j) < 1. S decreases in t, so the support is every
// score above the point τ where S crosses 1 (τ is the threshold of the usual
// form); S is evaluated at exact scores or points between them, never through
// τ itself, so no entry's membership rests on resolving z_j - τ.
struct EdgeProbe {
  double s;        // S(t)
  double below;    // scores strictly inside (lo, t)
  double above;    // scores strictly inside (t, hi)
  double least;    // the smallest score >= t (+inf if none)
};

template <typename G, typename Z>
AK_HD EdgeProbe edge_probe(const G& grp, const Z& z, int64_t n, double t, double lo, double hi, double b) {
  const double inv_b = 1.0 / b;
  double s[3] = {0.0, 0.0, 0.0};
  double least = std::numeric_limits<double>::infinity();
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const double v = z(j);
    if (v > t) {
      s[0] += std::exp(std::log(b * (v - t)) * inv_b);
      if (v < hi) s[2] += 1.0;
    } else if (v < t && v > lo) {
      s[1] += 1.0;
    }
    if (v >= t && v < least) least = v;
  }
  grp.template sum<3>(s);
  return {s[0], s[1], s[2], -grp.max(-least)};
}

// Solves one row z[0:n] (-inf entries are outside; the caller has ruled out
// NaN and a non-finite max zmax). hint: an estimate of τ (from the shift
// search), tol: about its accuracy; both only steer the first probes.
template <typename G, typename Z>
AK_HD EdgeRow edge_solve(const G& grp, const Z& z, int64_t n, double zmax, double b, double hint, double tol) {
  const double inf = std::numeric_limits<double>::infinity();
  // S(lo) >= 1 (lo = -inf: not yet known), S(hi) < 1; pivot: the smallest
  // score >= hi. The max alone gives S >= 1 at zmax - 1/b: τ is above it.
  double lo = -inf, hi = zmax, pivot = zmax;
  const double floor_t = zmax - 1.0625 / b;
  if (!(hint < hi)) hint = hi;
  if (!(hint > floor_t)) hint = floor_t;
  if (!(tol > 0.0)) tol = 1e-300;
  double down = tol, between = 1.0;
  bool probed_up = false;
  for (int it = 0; it < 4096 && between > 0.0; ++it) {
    double t;
    if (lo == -inf) {  // below the hint, further each time, down to floor_t
      t = hint - down;
      if (!(t < hi)) t = hi - down;
      if (!(t > floor_t)) t = floor_t;
      down *= 64.0;
    } else if (!probed_up && hint + tol > lo && hint + tol < hi) {  // just above the hint
      t = hint + tol;
      probed_up = true;
    } else {
      t = lo + 0.5 * (hi - lo);
      if (!(t > lo && t < hi)) break;  // adjacent doubles: no score between
    }
    const EdgeProbe pr = edge_probe(grp, z, n, t, lo, hi, b);
    if (pr.s < 1.0) {
      hi = t;
      pivot = pr.least;
      between = pr.below;
      if (lo == -inf && t == floor_t) between = 0.0;  // (cannot happen in exact arithmetic)
    } else {
      lo = t;
      between = pr.above;
    }
  }
  // q by Newton's steps on the convex increasing F from the right (F(1) >= 0):
  // monotone, no overshoot; stop when F <= 0 or q stops decreasing.
  const double inv_b = 1.0 / b;
  double q = 1.0;
  for (int it = 0; it < 200; ++it) {
    const double qb = std::exp(b * std::log(q));
    const double qb1 = qb / q;  // q^(b-1)
    double s[2] = {0.0, 0.0};  // F(q) + 1, F'(q)
    for (int64_t j = grp.lane(); j < n; j += grp.size()) {
      const double v = z(j);
      if (v == pivot) {
        s[0] += q;
        s[1] += 1.0;
      } else if (v > pivot) {
        const double u = qb + b * (v - pivot);
        const double pu = std::exp(std::log(u) * inv_b);
        s[0] += pu;
        s[1] += qb1 * pu / u;
      }
    }
    grp.template sum<2>(s);
    const double f = s[0] - 1.0;
    if (!(f > 0.0)) break;
    const double next = q - f / s[1];
    if (!(next < q)) break;
    q = next > 0.0 ? next : 0.5 * q;
  }
  return {pivot, q, std::exp(b * std::log(q))};
}

// The backward of one row for α > 2: dz = g ⊙ (dp - m), g = p^(1-b) on the
// support (p > 0), m = Σ g dp / Σ g. There g is unbounded at the edge of the
// support: it overflows float32 below p = 7e-3 and double below p = 1e-17 at
// α = 20, and one entry's g can exceed the others' by 10^10, so that dp_i - m
// cancels to below the resolution while g_i multiplies it. Both go away when
// dp is measured from the dp of the largest g (the pivot r, the smallest p)
// and the weights are taken relative to it, ĝ = g / g_r <= 1: with
// N = Σ g (dp - dp_r) and Γ = Σ ĝ,
//   dz_i = g_i (dp_i - dp_r) - ĝ_i N / Γ,
// where g_i (dp_i - dp_r) overflows only if the true gradient does (an entry
// tied with the pivot, with another dp). p(j), dp(j) read entry j as double;
// put(j, v) writes dz_j (0 off the support; NaN over the support if a p is NaN).
template <typename G, typename P, typename D, typename W>
AK_HD void edge_vjp(const G& grp, int64_t n, const P& p, const D& dp, const W& put, double b) {
  const double inf = std::numeric_limits<double>::infinity();
  double least = inf, nans[1] = {0.0};
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const double v = p(j);
    if (v > 0.0 && v < least) least = v;
    if (v != v) nans[0] += 1.0;
  }
  least = -grp.max(-least);
  grp.template sum<1>(nans);
  // The pivot's dp: the largest among the entries at the smallest p (any of
  // them gives the same dz in exact arithmetic).
  double pivot_dp = -inf;
  for (int64_t j = grp.lane(); j < n; j += grp.size())
    if (p(j) == least && dp(j) > pivot_dp) pivot_dp = dp(j);
  pivot_dp = grp.max(pivot_dp);
  const double e = 1.0 - b, lr = std::log(least);
  double s[2] = {0.0, 0.0};  // N, Γ
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const double v = p(j);
    if (!(v > 0.0)) continue;
    const double l = std::log(v), d = dp(j);
    s[1] += std::exp(e * (l - lr));
    if (d != pivot_dp) s[0] += std::exp(e * l) * (d - pivot_dp);
  }
  grp.template sum<2>(s);
  const double scaled = nans[0] > 0.0 ? std::numeric_limits<double>::quiet_NaN() : s[0] / s[1];
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const double v = p(j);
    if (v > 0.0) {
      const double l = std::log(v), d = dp(j);
      const double own = d != pivot_dp ? std::exp(e * l) * (d - pivot_dp) : 0.0;
      put(j, own - std::exp(e * (l - lr)) * scaled);
    } else {
      put(j, v != v ? scaled : 0.0);
    }
  }
}

// edge_vjp over gathered arrays p[0:k], dp[0:k] on one lane (the CPU kernels).
AK_HD void entmax_edge_vjp(const double* p, const double* dp, double* dz, int64_t k, double b) {
  edge_vjp(
      SerialLanes{}, k, [p](int64_t j) { return p[j]; }, [dp](int64_t j) { return dp[j]; },
      [dz](int64_t j, double v) { dz[j] = v; }, b);
}

ATTNKERN_ISA_END
}  // namespace math
}  // namespace attnkern

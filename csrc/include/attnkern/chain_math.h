// The binary linear-chain CRF's per-row math in double, in log space, shared
// by the CPU kernel (csrc/cpu/chain.cpp: its rows with a masked entry or
// scores too wide for the linear sweep, and the backward of every row taken
// one at a time; the tests check it against enumeration) and the CUDA row
// kernel (csrc/cuda/chain.cu). docs/algorithms.md, section 11.
//
// A row is its m >= 1 finite entries u (the masked ones removed), scored
// Σ_i u_i z_i + Σ_i w[2 z_i + z_{i+1}] over z in {0, 1}^m.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "attnkern/family.h"
#include "attnkern/isa_namespace.h"

namespace attnkern {
namespace math {
ATTNKERN_ISA_BEGIN

// log(e^a + e^b); -inf when both are.
AK_HD double log_add(double a, double b) {
  const double hi = a > b ? a : b, lo = a > b ? b : a;
  if (lo == -std::numeric_limits<double>::infinity()) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// The share of e^b in e^a + e^b (the weight of b's tangent in log_add's);
// 0 when both are -inf (an unreachable state: its tangent is never used).
AK_HD double share_of_second(double a, double b) {
  if (b == -std::numeric_limits<double>::infinity()) return 0.0;
  if (a == -std::numeric_limits<double>::infinity()) return 1.0;
  return 1.0 / (1.0 + std::exp(a - b));
}

// Forward-backward on u[0..m): μ_i = P(z_i = 1) into mu, the forward
// log-messages into fwd0 / fwd1 (labelings of entries 0..i ending in z_i = 0 /
// 1), and the shares the backward needs: fshare_t[i] (i >= 1) =
// P(z_{i-1} = 1 | z_i = t) among entries 0..i, and bshare_a[i] (i <= m - 2) =
// P(z_{i+1} = 1 | z_i = a) among entries i..m-1. Returns false when no
// labeling has a score (possible only with -inf in w).
AK_HD bool crf_sweeps_log(const double* u, int64_t m, const double* w, double* fwd0, double* fwd1, double* mu,
                          double* fshare0, double* fshare1, double* bshare0, double* bshare1) {
  fwd0[0] = 0.0;
  fwd1[0] = u[0];
  for (int64_t i = 1; i < m; ++i) {
    const double stay0 = fwd0[i - 1] + w[0], from1_to0 = fwd1[i - 1] + w[2];
    const double from0_to1 = fwd0[i - 1] + w[1], stay1 = fwd1[i - 1] + w[3];
    fshare0[i] = share_of_second(stay0, from1_to0);
    fshare1[i] = share_of_second(from0_to1, stay1);
    fwd0[i] = log_add(stay0, from1_to0);
    fwd1[i] = u[i] + log_add(from0_to1, stay1);
  }
  if (!(log_add(fwd0[m - 1], fwd1[m - 1]) > -std::numeric_limits<double>::infinity())) return false;
  double back0 = 0.0, back1 = 0.0;  // log-sums over entries i+1..m-1 given z_i = 0, 1
  mu[m - 1] = share_of_second(fwd0[m - 1], fwd1[m - 1]);
  for (int64_t i = m - 2; i >= 0; --i) {
    const double to0_from0 = w[0] + back0, to1_from0 = w[1] + u[i + 1] + back1;
    const double to0_from1 = w[2] + back0, to1_from1 = w[3] + u[i + 1] + back1;
    bshare0[i] = share_of_second(to0_from0, to1_from0);
    bshare1[i] = share_of_second(to0_from1, to1_from1);
    back0 = log_add(to0_from0, to1_from0);
    back1 = log_add(to0_from1, to1_from1);
    mu[i] = share_of_second(fwd0[i] + back0, fwd1[i] + back1);
  }
  return true;
}

// The backward of one row after a forward-backward that gave mu and the
// shares: du = Jᵀg (J = ∂μ/∂u, the covariance of z, symmetric) into du[0..m),
// and Σ_i ∂(g·μ)/∂w added into dw (2×2) unless it is null. Jg is the
// derivative of μ along g: the tangents of the forward (ta*) and backward
// (tb*) messages, each the share-weighted mean of its terms' tangents; the
// pairwise marginal is ξ_i(a, b) = P(z_{i+1} = b)·P(z_i = a | z_{i+1} = b).
AK_HD void crf_backward(const double* g, const double* mu, const double* fshare0, const double* fshare1,
                        const double* bshare0, const double* bshare1, int64_t m, double* ta0, double* ta1, double* tb0,
                        double* tb1, double* du, double* dw) {
  // Forward tangents at entry i and backward ones at entry j = m-1-i in one
  // loop (independent recurrences), the last of each carried in registers.
  double t0 = 0.0, t1 = g[0], r0 = 0.0, r1 = 0.0;
  ta0[0] = t0;
  ta1[0] = t1;
  tb0[m - 1] = tb1[m - 1] = 0.0;
  for (int64_t i = 1, j = m - 2; i < m; ++i, --j) {
    const double step = t1 - t0;
    t1 = g[i] + t0 + fshare1[i] * step;
    t0 = t0 + fshare0[i] * step;
    ta0[i] = t0;
    ta1[i] = t1;
    const double back_step = g[j + 1] + r1 - r0;
    r1 = r0 + bshare1[j] * back_step;
    r0 = r0 + bshare0[j] * back_step;
    tb0[j] = r0;
    tb1[j] = r1;
  }
  double log_z_tangent = 0.0;  // d log Z along g = g·μ
  for (int64_t i = 0; i < m; ++i) {
    log_z_tangent += g[i] * mu[i];
    du[i] = mu[i] * (1.0 - mu[i]) * (ta1[i] + tb1[i] - ta0[i] - tb0[i]);
  }
  if (!dw) return;
  for (int64_t i = 0; i + 1 < m; ++i) {
    for (int b = 0; b < 2; ++b) {
      const double next = b ? mu[i + 1] : 1.0 - mu[i + 1];
      const double from1 = b ? fshare1[i + 1] : fshare0[i + 1];
      const double rest = (b ? g[i + 1] : 0.0) + (b ? tb1[i + 1] : tb0[i + 1]) - log_z_tangent;
      dw[b] += next * (1.0 - from1) * (ta0[i] + rest);
      dw[2 + b] += next * from1 * (ta1[i] + rest);
    }
  }
}

ATTNKERN_ISA_END
}  // namespace math
}  // namespace attnkern

// The structured normalizers' per-row math in double, shared by the CPU
// kernels (csrc/cpu/structured.cpp, where the tests check it against the
// float64 reference and generic solvers) and the CUDA row kernels
// (csrc/cuda/structured.cu): the 1-D total-variation prox, sparsemax's
// threshold and vector-Jacobian product, and fusedmax's backward.
// docs/algorithms.md, section 10.
#pragma once

#include <cstdint>

#include "attnkern/family.h"
#include "attnkern/isa_namespace.h"

namespace attnkern {
namespace math {
ATTNKERN_ISA_BEGIN

// Whether the prox of lam·TV at x (n >= 2 entries) is x's mean everywhere,
// and if so y = that mean: exactly when every running sum of x - mean, the
// dual of y = mean, is within lam. (Where lam dwarfs x the sweep below would
// lose x in its bounds x ± lam.) Each y_i of a constant y is within 2·lam of
// x_i, so a row spread over more than 4·lam is not, and one pass for the
// extremes decides most rows.
AK_HD bool tv_prox_constant(const double* x, int64_t n, double lam, double* y) {
  // (Four lanes of extremes: one would wait on each comparison.)
  double low[4] = {x[0], x[0], x[0], x[0]}, high[4] = {x[0], x[0], x[0], x[0]};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int l = 0; l < 4; ++l) {
      low[l] = x[i + l] < low[l] ? x[i + l] : low[l];
      high[l] = x[i + l] > high[l] ? x[i + l] : high[l];
    }
  }
  for (; i < n; ++i) {
    low[0] = x[i] < low[0] ? x[i] : low[0];
    high[0] = x[i] > high[0] ? x[i] : high[0];
  }
  for (int l = 1; l < 4; ++l) {
    low[0] = low[l] < low[0] ? low[l] : low[0];
    high[0] = high[l] > high[0] ? high[l] : high[0];
  }
  if (high[0] - low[0] > 4.0 * lam) return false;
  double sum = 0.0;
  for (i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / double(n);
  double run = 0.0;
  for (i = 0; i + 1 < n; ++i) {
    run += x[i] - mean;
    if (run > lam || run < -lam) return false;
  }
  for (i = 0; i < n; ++i) y[i] = mean;
  return true;
}

// y = prox of lam·TV at x (n >= 1 entries, lam >= 0).
AK_HD void tv_prox(const double* x, int64_t n, double lam, double* y) {
  if (n == 1 || lam == 0.0) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i];
    return;
  }
  if (tv_prox_constant(x, n, lam, y)) return;
  // The segment starts at `first`; its value lies in [lo, hi]. lo_dual /
  // hi_dual: the dual variable at k if the segment took lo / hi; lo_end /
  // hi_end: the last k where lo / hi was raised / lowered (where the segment
  // ends if the next jump goes down / up).
  int64_t k = 0, first = 0, lo_end = 0, hi_end = 0;
  double lo = x[0] - lam, hi = x[0] + lam, lo_dual = lam, hi_dual = -lam;
  auto close = [&](int64_t last, double value) {
    for (; first <= last; ++first) y[first] = value;
  };
  for (;;) {
    while (k == n - 1) {  // the row's end: the dual must come back to 0 there
      if (lo_dual < 0.0) {  // even the lowest value is too high: down-jump after lo_end
        close(lo_end, lo);
        k = lo_end = first;
        lo = x[first];
        lo_dual = lam;
        hi_dual = lo + lam - hi;
      } else if (hi_dual > 0.0) {  // even the highest value is too low: up-jump after hi_end
        close(hi_end, hi);
        k = hi_end = first;
        hi = x[first];
        hi_dual = -lam;
        lo_dual = hi - lam - lo;
      } else {
        close(k, lo + lo_dual / double(k - first + 1));
        return;
      }
    }
    lo_dual += x[k + 1] - lo;
    if (lo_dual < -lam) {  // the segment ends at lo_end at its lowest value; the next is below
      close(lo_end, lo);
      k = lo_end = hi_end = first;
      lo = x[first];
      hi = lo + 2.0 * lam;
      lo_dual = lam;
      hi_dual = -lam;
      continue;
    }
    hi_dual += x[k + 1] - hi;
    if (hi_dual > lam) {  // ends at hi_end at its highest value; the next is above
      close(hi_end, hi);
      k = lo_end = hi_end = first;
      hi = x[first];
      lo = hi - 2.0 * lam;
      lo_dual = lam;
      hi_dual = -lam;
      continue;
    }
    ++k;
    if (lo_dual >= lam) {
      lo_end = k;
      lo += (lo_dual - lam) / double(k - first + 1);
      lo_dual = lam;
    }
    if (hi_dual <= -lam) {
      hi_end = k;
      hi += (hi_dual + lam) / double(k - first + 1);
      hi_dual = -lam;
    }
  }
}

// sparsemax's threshold τ of y (n >= 1 finite entries): Σ max(y - τ, 0) = 1, by
// Michelot's steps τ <- (Σ_{y > τ} y - 1) / |{y > τ}| from τ = max(y) - 1,
// which is left of the root (no weight exceeds 1); each step only raises τ
// and drops entries, and the first step that keeps the set gives τ exactly.
// The steps run on the entries above the start only, compacted into
// `scratch` (n entries): rows of scores usually have few. No sort. They work
// on y - max(y) (exact for the entries within 1 of the top, which are all
// they read): sums of y itself would carry rounding of the size of y into τ,
// which a row far from 0 with a wide support shows in its weights' sum.
AK_HD double sparsemax_threshold(const double* y, int64_t n, double* scratch) {
  double top = y[0];
  for (int64_t i = 1; i < n; ++i) top = y[i] > top ? y[i] : top;
  // (>=: an entry at the start only shortens the first step.)
  // (Compacted without a branch per entry: which entries pass is a coin flip
  // near the threshold. Adding 0.0 for the others leaves the sums' bits as
  // they are: the sums start at +0.0.)
  int64_t count = 0;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = y[i] - top;
    const bool in = d >= -1.0;
    scratch[count] = d;
    count += in;
    sum += in ? d : 0.0;
  }
  double tau = (sum - 1.0) / double(count);
  for (;;) {
    double s = 0.0;
    int64_t c = 0;
    for (int64_t i = 0; i < count; ++i) {
      const double v = scratch[i];
      const bool in = v > tau;
      scratch[c] = v;
      c += in;
      s += in ? v : 0.0;
    }
    if (c == count || c == 0) return top + tau;
    count = c;
    tau = (s - 1.0) / double(c);
  }
}

// sparsemax's vector-Jacobian product on y's m entries: v = g - mean_S g on the
// support S = {y > tau}, 0 off it (into v; g may be v).
AK_HD void sparsemax_vjp(const double* y, double tau, const double* g, int64_t m, double* v) {
  double gsum = 0.0;
  int64_t support = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (y[i] > tau) {
      gsum += g[i];
      ++support;
    }
  }
  const double gmean = support > 0 ? gsum / double(support) : 0.0;
  for (int64_t i = 0; i < m; ++i) v[i] = y[i] > tau ? g[i] - gmean : 0.0;
}

// fusedmax's backward on a row's m finite entries (docs/algorithms.md, section
// 10): given y = prox(x), sparsemax's threshold tau on it and v = the
// sparsemax VJP (sparsemax_vjp), dx into dxs (v averaged over each segment
// of y inside the support); returns dλ. Only the support's segments are
// walked: an entry of y > tau starts its segment (the entry before it is off
// the support or in another segment), and the segments off the support, most
// of a row at small lam, add nothing (their ends would be a mispredicted
// branch each).
AK_HD double fusedmax_vjp(const double* y, const double* v, int64_t m, double tau, double* dxs) {
  double dlam = 0.0;
  for (int64_t i = 0; i < m; ++i) dxs[i] = 0.0;
  int64_t a = 0;
  for (;;) {
    while (a < m && !(y[a] > tau)) ++a;
    if (a == m) return dlam;
    int64_t b = a;
    while (b + 1 < m && y[b + 1] == y[a]) ++b;  // the segment [a, b] of y
    double vsum = 0.0;
    for (int64_t i = a; i <= b; ++i) vsum += v[i];
    const double size = double(b - a + 1);
    for (int64_t i = a; i <= b; ++i) dxs[i] = vsum / size;
    const double left = a == 0 ? 0.0 : (y[a] > y[a - 1] ? 1.0 : -1.0);
    const double right = b == m - 1 ? 0.0 : (y[b + 1] > y[b] ? 1.0 : -1.0);
    dlam += (right - left) / size * vsum;
    a = b + 1;
  }
}

ATTNKERN_ISA_END
}  // namespace math
}  // namespace attnkern

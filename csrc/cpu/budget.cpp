// budget-sparsemax on the CPU, forward: p = clip(x - τ, 0, 1) with Σ p = B per
// row. Σ clip(x - τ, 0, 1) is piecewise linear and decreasing in τ; on the
// piece where the active set A = {0 < x - τ < 1} and the capped count C are
// fixed, its root is τ = (C + Σ_A x - B) / |A|. Iterating that step (Newton on
// a piecewise-linear function), safeguarded by a bisection bracket, ends
// exactly once A and C stop changing — typically in a handful of passes, each
// over the shrinking list of entries not yet known to be 0 or 1.
// budget_bwd: dx = s ⊙ (g - Σ_A g / |A|), s the active indicator, and the
// budget's gradient Σ_A g / |A|, one pass per row over the saved p.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnkern/row_layout.h"
#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using at::Tensor;

constexpr int kMaxSteps = 200;

// One row (contiguous, acc type) -> out (may alias x). cand, spare: scratch of n.
// The root stays inside [lo, hi], so an entry at or below lo is 0 and one at
// or above hi + 1 is 1 for every τ still possible: both leave the candidate
// list for good, and later passes touch only the entries still undecided.
template <typename acc_t>
void budget_row(const acc_t* x, int64_t n, double B, acc_t* out, double* cand, double* spare) {
  using V = at::vec::Vectorized<acc_t>;
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  // Vectorized min and max (both propagate NaN): a row with no -inf needs no
  // candidate copy, the first pass below reads x directly.
  V vmax(-inf), vmin(inf);
  int64_t j0 = 0;
  for (; j0 + V::size() <= n; j0 += V::size()) {
    const V v = V::loadu(x + j0);
    vmax = at::vec::maximum(vmax, v);
    vmin = at::vec::minimum(vmin, v);
  }
  acc_t mx = -inf, mn = inf;
  {
    alignas(64) acc_t a[V::size()], b[V::size()];
    vmax.store(a);
    vmin.store(b);
    for (int k = 0; k < V::size(); ++k) {
      mx = (a[k] != a[k] || a[k] > mx) ? a[k] : mx;
      mn = (b[k] != b[k] || b[k] < mn) ? b[k] : mn;
    }
    for (; j0 < n; ++j0) {
      mx = (x[j0] != x[j0] || x[j0] > mx) ? x[j0] : mx;
      mn = (x[j0] != x[j0] || x[j0] < mn) ? x[j0] : mn;
    }
  }
  if (mx != mx || mn != mn || mx == inf) {
    std::fill(out, out + n, std::numeric_limits<acc_t>::quiet_NaN());
    return;
  }
  double lo = double(mn), hi = double(mx);
  int64_t m = n;
  const bool masked = mn == -inf;
  if (masked) {
    m = 0;
    lo = std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      if (x[j] > -inf) {
        cand[m++] = double(x[j]);
        lo = std::min(lo, double(x[j]));
      }
    }
  }
  if (m == 0 || B >= double(m)) {
    for (int64_t j = 0; j < n; ++j) out[j] = (m > 0 && x[j] > -inf) ? acc_t(1) : acc_t(0);
    return;
  }
  lo -= 2;  // f(lo) = m - B > 0, f(hi) = -B < 0
  double tau = hi - 1;
  int64_t fixed_capped = 0;
  for (int step = 0; step < kMaxSteps; ++step) {
    // The entries above tau go to spare as they are counted: if tau turns out
    // left of the root it becomes lo, and they are exactly the new candidates.
    double sum_active = 0;
    int64_t k = 0, capped = fixed_capped, w = 0;
    const bool from_x = step == 0 && !masked;
    for (int64_t i = 0; i < m; ++i) {
      const double v = from_x ? double(x[i]) : cand[i], d = v - tau;
      if (d > 0) {
        spare[w++] = v;
        if (d >= 1) {
          ++capped;
        } else {
          ++k;
          sum_active += v;
        }
      }
    }
    const double f = double(capped) + sum_active - double(k) * tau - B;
    if (f == 0) break;
    if (f > 0) lo = tau; else hi = tau;
    double next = 0.5 * (lo + hi);
    if (k > 0) {
      const double t = (double(capped) + sum_active - B) / double(k);
      if (t == tau) break;  // the piece's root: converged
      if (t > lo && t < hi) next = t;
    }
    if (next == tau || !(hi > lo)) break;
    tau = next;
    if (f > 0) {
      std::swap(cand, spare);
      m = w;
    } else {
      int64_t keep = 0;
      for (int64_t i = 0; i < m; ++i) {
        const double v = from_x ? double(x[i]) : cand[i];
        if (v <= lo) continue;
        if (v >= hi + 1) {
          ++fixed_capped;
          continue;
        }
        cand[keep++] = v;
      }
      m = keep;
    }
  }
  // p = clip(x - τ, 0, 1); -inf entries give 0.
  const acc_t t = acc_t(tau);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V d = V::loadu(x + j) - V(t);
    at::vec::minimum(at::vec::maximum(d, V(0)), V(1)).store(out + j);
  }
  for (; j < n; ++j) out[j] = std::min(acc_t(1), std::max(acc_t(0), x[j] - t));
}

template <typename scalar_t>
void budget_impl(const Tensor& x, Tensor& out, const Tensor& budget, int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const double* bp = budget.const_data_ptr<double>();
  const int64_t n = lay.n;
  const bool direct = lay.inner == 1 && std::is_same_v<scalar_t, acc_t>;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row(direct ? 0 : n);
    std::vector<double> cand(n), spare(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      if (direct) {
        budget_row<acc_t>(reinterpret_cast<const acc_t*>(xp + base), n, bp[r], reinterpret_cast<acc_t*>(op + base),
                          cand.data(), spare.data());
      } else {
        lay.load(xp + base, row.data());
        budget_row<acc_t>(row.data(), n, bp[r], row.data(), cand.data(), spare.data());
        lay.store(row.data(), op + base);
      }
    }
  });
}

Tensor budget_fwd(const Tensor& x_in, const Tensor& budget_in, int64_t dim) {
  check_cpu_float(x_in, "x");
  dim = at::maybe_wrap_dim(dim, x_in.dim());
  Tensor x = x_in.contiguous();
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return out;
  Tensor budget = per_row(budget_in, x, dim, at::kDouble);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_budget_fwd",
                                  [&] { budget_impl<scalar_t>(x, out, budget, dim); });
  return out;
}

// Backward of one row, s the active indicator (0 < p < 1), k = Σ s:
// dx = s ⊙ (g - Σ s g / k); returns d budget = Σ s g / k (0 when k = 0).
template <typename acc_t>
acc_t budget_bwd_row(const acc_t* p, const acc_t* g, acc_t* dx, int64_t n) {
  using V = at::vec::Vectorized<acc_t>;
  const V zero(0), one(1);
  V vk(0), vs(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V pv = V::loadu(p + j);
    const V active = (pv > zero) & (pv < one);
    vk += V::blendv(zero, one, active);
    vs += V::blendv(zero, V::loadu(g + j), active);
  }
  alignas(64) acc_t a[V::size()], b[V::size()];
  vk.store(a);
  vs.store(b);
  acc_t k = 0, sg = 0;
  for (int i = 0; i < V::size(); ++i) {
    k += a[i];
    sg += b[i];
  }
  for (int64_t i = j; i < n; ++i) {
    if (p[i] > acc_t(0) && p[i] < acc_t(1)) {
      k += acc_t(1);
      sg += g[i];
    }
  }
  const acc_t v = k > acc_t(0) ? sg / k : acc_t(0);
  const V vv(v);
  for (j = 0; j + V::size() <= n; j += V::size()) {
    const V pv = V::loadu(p + j);
    const V active = (pv > zero) & (pv < one);
    V::blendv(zero, V::loadu(g + j) - vv, active).store(dx + j);
  }
  for (; j < n; ++j) dx[j] = (p[j] > acc_t(0) && p[j] < acc_t(1)) ? g[j] - v : acc_t(0);
  return v;
}

template <typename scalar_t>
void budget_bwd_impl(const Tensor& p, const Tensor& grad, Tensor& dx, Tensor& dbudget, int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(p, dim);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  double* bp = dbudget.defined() ? dbudget.mutable_data_ptr<double>() : nullptr;
  const int64_t n = lay.n;
  // Rows already contiguous in the accumulation type are used in place.
  const bool direct = lay.inner == 1 && std::is_same_v<scalar_t, acc_t>;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(direct ? 0 : 3 * n);
    acc_t *pb = buf.data(), *gb = pb + n, *db = gb + n;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      if (lay.nan_row_gradient(pp, dp, base)) {
        if (bp) bp[r] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      acc_t v;
      if (direct) {
        v = budget_bwd_row<acc_t>(reinterpret_cast<const acc_t*>(pp + base),
                                  reinterpret_cast<const acc_t*>(gp + base), reinterpret_cast<acc_t*>(dp + base), n);
      } else {
        lay.load(pp + base, pb);
        lay.load(gp + base, gb);
        v = budget_bwd_row<acc_t>(pb, gb, db, n);
        lay.store(db, dp + base);
      }
      if (bp) bp[r] = double(v);
    }
  });
}

std::tuple<Tensor, Tensor> budget_bwd(const Tensor& p_in, const Tensor& grad_in, int64_t dim, bool budget_grad) {
  const RowBackwardInputs in = row_backward_inputs(p_in, grad_in, dim);
  const Tensor& p = in.p;
  const Tensor& grad = in.grad;
  dim = in.dim;
  Tensor dx = at::empty_like(p, at::MemoryFormat::Contiguous);
  Tensor db = budget_grad ? per_row(at::zeros({}, p.options().dtype(at::kDouble)), p, dim, at::kDouble) : Tensor();
  if (p.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "attnkern_budget_bwd",
                                    [&] { budget_bwd_impl<scalar_t>(p, grad, dx, db, dim); });
  }
  if (!db.defined()) db = at::empty({0}, p.options().dtype(at::kDouble));
  return {dx, db};
}

}  // namespace

void add_budget_kernels(KernelTable& t) {
  t.budget_fwd = &budget_fwd;
  t.budget_bwd = &budget_bwd;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

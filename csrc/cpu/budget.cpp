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
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "row_layout.h"

namespace attnkern {
namespace cpu {
namespace {

using at::Tensor;

constexpr int kMaxSteps = 200;

// One row (contiguous, acc type) -> out (may alias x). cand: scratch of n.
// The root stays inside [lo, hi], so an entry at or below lo is 0 and one at
// or above hi + 1 is 1 for every τ still possible: both leave the candidate
// list for good, and later passes touch only the entries still undecided.
template <typename acc_t>
void budget_row(const acc_t* x, int64_t n, double B, acc_t* out, double* cand) {
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  int64_t m = 0;
  bool bad = false;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t v = x[j];
    if (v != v || v == inf) bad = true;
    if (v > -inf) {
      cand[m++] = double(v);
      lo = std::min(lo, double(v));
      hi = std::max(hi, double(v));
    }
  }
  if (bad) {
    std::fill(out, out + n, std::numeric_limits<acc_t>::quiet_NaN());
    return;
  }
  if (m == 0 || B >= double(m)) {
    for (int64_t j = 0; j < n; ++j) out[j] = (m > 0 && x[j] > -inf) ? acc_t(1) : acc_t(0);
    return;
  }
  lo -= 2;  // f(lo) = m - B > 0, f(hi) = -B < 0
  double tau = hi - 1;
  int64_t fixed_capped = 0;
  for (int step = 0; step < kMaxSteps; ++step) {
    double sum_active = 0;
    int64_t k = 0, capped = fixed_capped;
    for (int64_t i = 0; i < m; ++i) {
      const double d = cand[i] - tau;
      if (d >= 1) {
        ++capped;
      } else if (d > 0) {
        ++k;
        sum_active += cand[i];
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
    int64_t w = 0;
    for (int64_t i = 0; i < m; ++i) {
      const double v = cand[i];
      if (v <= lo) continue;
      if (v >= hi + 1) {
        ++fixed_capped;
        continue;
      }
      cand[w++] = v;
    }
    m = w;
  }
  for (int64_t j = 0; j < n; ++j) {
    const double d = double(x[j]) - tau;
    out[j] = x[j] > -inf ? acc_t(std::min(1.0, std::max(0.0, d))) : acc_t(0);
  }
}

template <typename scalar_t>
void budget_impl(const Tensor& x, Tensor& out, const Tensor& budget, int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const double* bp = budget.const_data_ptr<double>();
  const int64_t n = lay.n;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row(n);
    std::vector<double> cand(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(xp + base, row.data());
      budget_row<acc_t>(row.data(), n, bp[r], row.data(), cand.data());
      lay.store(row.data(), op + base);
    }
  });
}

Tensor budget_fwd(const Tensor& x_in, const Tensor& budget_in, int64_t dim) {
  TORCH_CHECK(x_in.device().is_cpu() && at::isFloatingType(x_in.scalar_type()),
              "attnkern: x must be a floating-point CPU tensor");
  dim = at::maybe_wrap_dim(dim, x_in.dim());
  Tensor x = x_in.contiguous();
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return out;
  auto shape = x.sizes().vec();
  if (!shape.empty()) shape[dim] = 1;
  Tensor budget = budget_in.to(at::kDouble).expand(shape).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_budget_fwd",
                                  [&] { budget_impl<scalar_t>(x, out, budget, dim); });
  return out;
}

// Backward of one row, s the active indicator (0 < p < 1), k = Σ s:
// dx = s ⊙ (g - Σ s g / k); returns d budget = Σ s g / k (0 when k = 0).
template <typename acc_t>
acc_t budget_bwd_row(const acc_t* p, const acc_t* g, acc_t* dx, int64_t n) {
  double sg = 0;
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] > acc_t(0) && p[j] < acc_t(1)) {
      ++k;
      sg += double(g[j]);
    }
  }
  const double v = k > 0 ? sg / double(k) : 0.0;
  for (int64_t j = 0; j < n; ++j) dx[j] = (p[j] > acc_t(0) && p[j] < acc_t(1)) ? acc_t(double(g[j]) - v) : acc_t(0);
  return acc_t(v);
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
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(3 * n);
    acc_t *pb = buf.data(), *gb = pb + n, *db = gb + n;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(pp + base, pb);
      lay.load(gp + base, gb);
      const acc_t v = budget_bwd_row<acc_t>(pb, gb, db, n);
      lay.store(db, dp + base);
      if (bp) bp[r] = double(v);
    }
  });
}

std::tuple<Tensor, Tensor> budget_bwd(const Tensor& p_in, const Tensor& grad_in, int64_t dim, bool budget_grad) {
  TORCH_CHECK(p_in.device().is_cpu() && at::isFloatingType(p_in.scalar_type()),
              "attnkern: p must be a floating-point CPU tensor");
  TORCH_CHECK(p_in.sizes() == grad_in.sizes(), "attnkern: grad must have the shape of p");
  dim = at::maybe_wrap_dim(dim, p_in.dim());
  Tensor p = p_in.contiguous();
  Tensor grad = grad_in.to(p.scalar_type()).contiguous();
  Tensor dx = at::empty_like(p, at::MemoryFormat::Contiguous);
  auto shape = p.sizes().vec();
  if (!shape.empty()) shape[dim] = 1;
  Tensor db = budget_grad ? at::zeros(shape, p.options().dtype(at::kDouble)) : Tensor();
  if (p.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "attnkern_budget_bwd",
                                    [&] { budget_bwd_impl<scalar_t>(p, grad, dx, db, dim); });
  }
  if (!db.defined()) db = at::empty({0}, p.options().dtype(at::kDouble));
  return {dx, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CPU, m) {
  m.impl("budget_fwd", &budget_fwd);
  m.impl("budget_bwd", &budget_bwd);
}

}  // namespace cpu
}  // namespace attnkern

// α-normmax on the CPU, backward. The forward runs on the α'-entmax kernels
// (attnkern/compat.py: α' = 2 - 1/α); this is its vector-Jacobian product.
//
// On the support, p = q / Q with q = d^β, d = x - τ, β = 1/(α-1), Σ q^α = 1 and
// Q = Σ q. From the constraint, dτ = Σ p dx; dq_i = w_i (dx_i - dτ) with
// w_i = β q_i^(2-α); dp = (dq - p Σ dq) / Q. So, with h = (g - Σ p g) / Q,
//     dx = w ⊙ h - (Σ w h) p,      and Q = (Σ p^α)^(-1/α) from p alone.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attnkern/row_layout.h"
#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using at::Tensor;

template <typename acc_t>
void normmax_bwd_row(const acc_t* p, const acc_t* g, acc_t* dx, int64_t n, double alpha) {
  double s1 = 0, sa = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] > acc_t(0)) {
      s1 += double(p[j]) * double(g[j]);
      sa += std::pow(double(p[j]), alpha);
    }
  }
  if (!(sa > 0)) {  // no support (a fully masked row) or a NaN row
    const acc_t fill = sa != sa ? std::numeric_limits<acc_t>::quiet_NaN() : acc_t(0);
    std::fill(dx, dx + n, fill);
    return;
  }
  const double Q = std::pow(sa, -1.0 / alpha), beta = 1.0 / (alpha - 1.0);
  double swh = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] > acc_t(0)) {
      const double wh = beta * std::pow(double(p[j]) * Q, 2.0 - alpha) * (double(g[j]) - s1) / Q;
      dx[j] = acc_t(wh);
      swh += wh;
    } else {
      dx[j] = acc_t(0);
    }
  }
  for (int64_t j = 0; j < n; ++j)
    if (p[j] > acc_t(0)) dx[j] = acc_t(double(dx[j]) - swh * double(p[j]));
}

template <typename scalar_t>
void normmax_bwd_impl(const Tensor& p, const Tensor& grad, Tensor& dx, const Tensor& alpha, int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(p, dim);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  const double* ap = alpha.const_data_ptr<double>();
  const int64_t n = lay.n;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(3 * n);
    acc_t *pb = buf.data(), *gb = pb + n, *db = gb + n;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      if (lay.nan_row_gradient(pp, dp, base)) continue;
      lay.load(pp + base, pb);
      lay.load(gp + base, gb);
      normmax_bwd_row<acc_t>(pb, gb, db, n, ap[r]);
      lay.store(db, dp + base);
    }
  });
}

// p: the normmax output; alpha: one value per row (broadcastable, size 1 along dim).
Tensor normmax_bwd(const Tensor& p_in, const Tensor& grad_in, const Tensor& alpha_in, int64_t dim) {
  const RowBackwardInputs in = row_backward_inputs(p_in, grad_in, dim);
  const Tensor& p = in.p;
  const Tensor& grad = in.grad;
  dim = in.dim;
  Tensor dx = at::empty_like(p, at::MemoryFormat::Contiguous);
  if (p.numel() == 0) return dx;
  Tensor alpha = per_row(alpha_in, p, dim, at::kDouble);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "attnkern_normmax_bwd",
                                  [&] { normmax_bwd_impl<scalar_t>(p, grad, dx, alpha, dim); });
  return dx;
}

}  // namespace

void add_normmax_kernels(KernelTable& t) {
  t.normmax_bwd = &normmax_bwd;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

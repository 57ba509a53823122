// The marginals of a binary linear-chain CRF on the CPU (Kim, Denton, Hoang &
// Rush, 2017): z in {0,1}^m over a row's m finite entries, scored
// Σ_i u_i z_i + Σ_i W[z_i][z_{i+1}], and μ_i = P(z_i = 1) by forward-backward
// in log space, in double; docs/algorithms.md, section 11.
//
// Entries at -inf take no part (the finite ones are neighbours in their order,
// a removed one gets μ = 0); a row with NaN or +inf gives NaN, and so does a
// row that no labeling can score (possible only with -inf in W).
//
// The backward needs Jᵀg with J = ∂μ/∂u, the covariance of z, which is the
// Hessian of log Z and so symmetric: Jᵀg = Jg is the derivative of μ along g,
// computed exactly by carrying tangents through a second forward-backward
// (each log-sum-exp's tangent is the softmax-weighted mean of its terms'
// tangents). The same tangents give ∂(g·μ)/∂W = Σ_i d/dt of the pairwise
// marginals ξ_i(a, b), by the Hessian's symmetry between u and W.
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "attnkern/cpu_kernels.h"
#include "attnkern/row_layout.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using at::Tensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// log(e^a + e^b); -inf when both are.
inline double log_add(double a, double b) {
  const double hi = std::max(a, b), lo = std::min(a, b);
  if (lo == kNegInf) return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

// The share of e^b in e^a + e^b (the weight of b's tangent in log_add's);
// 0 when both are -inf (an unreachable state: its tangent is never used).
inline double share_of_second(double a, double b) {
  if (b == kNegInf) return 0.0;
  if (a == kNegInf) return 1.0;
  return 1.0 / (1.0 + std::exp(a - b));
}

// Scratch of one row of n entries: the row as loaded, the gradient, the
// output, the finite entries u and their gradients g (compacted), their
// positions, and the log messages (forward fa, backward fb) with their
// tangents (ta, tb), two states per entry. Not zeroed: every entry is
// written before it is read.
struct ChainScratch {
  std::unique_ptr<double[]> buf;
  std::unique_ptr<int64_t[]> pos;
  double *row, *grad, *out, *u, *g, *fa, *fb, *ta, *tb;
  explicit ChainScratch(int64_t n) : buf(new double[13 * n]), pos(new int64_t[n]) {
    double* b = buf.get();
    for (double** a : {&row, &grad, &out, &u, &g}) {
      *a = b;
      b += n;
    }
    for (double** a : {&fa, &fb, &ta, &tb}) {
      *a = b;
      b += 2 * n;
    }
  }
};

// Compacts the row's finite entries into s.u (positions into s.pos, count m);
// false if the row holds a NaN or +inf.
bool chain_entries(ChainScratch& s, int64_t n, int64_t& m) {
  m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double x = s.row[j];
    if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) return false;
    if (x > kNegInf) {
      s.u[m] = x;
      s.pos[m++] = j;
    }
  }
  return true;
}

// The log messages of the chain on s.u[0..m) with transition scores w (2×2,
// row-major, w[2a + b] for z_i = a, z_{i+1} = b): fa[2i + t] is the log-sum
// over labelings of entries 0..i with z_i = t, fb[2i + s] over entries
// i+1..m-1 given z_i = s. Returns log Z.
double chain_messages(ChainScratch& s, int64_t m, const double* w) {
  const double* u = s.u;
  double *fa = s.fa, *fb = s.fb;
  fa[0] = 0.0;
  fa[1] = u[0];
  for (int64_t i = 1; i < m; ++i) {
    for (int t = 0; t < 2; ++t) {
      fa[2 * i + t] = (t ? u[i] : 0.0) + log_add(fa[2 * i - 2] + w[t], fa[2 * i - 1] + w[2 + t]);
    }
  }
  fb[2 * m - 2] = fb[2 * m - 1] = 0.0;
  for (int64_t i = m - 2; i >= 0; --i) {
    for (int a = 0; a < 2; ++a) {
      fb[2 * i + a] = log_add(w[2 * a] + fb[2 * i + 2], w[2 * a + 1] + u[i + 1] + fb[2 * i + 3]);
    }
  }
  return log_add(fa[2 * m - 2], fa[2 * m - 1]);
}

// μ_i from the messages: the share of z_i = 1 in the labelings' total weight.
inline double marginal(const ChainScratch& s, int64_t i) {
  return share_of_second(s.fa[2 * i] + s.fb[2 * i], s.fa[2 * i + 1] + s.fb[2 * i + 1]);
}

// Per-row W in double, checked: -inf forbids a transition; NaN and +inf are
// refused.
Tensor checked_pairwise(const Tensor& pairwise, const Tensor& x, int64_t dim) {
  check_cpu_float(pairwise, "pairwise");
  auto shape = x.sizes().vec();
  if (!shape.empty()) shape.erase(shape.begin() + dim);
  shape.push_back(2);
  shape.push_back(2);
  TORCH_CHECK_VALUE(pairwise.dim() >= 2 && pairwise.size(-1) == 2 && pairwise.size(-2) == 2 &&
                        at::is_expandable_to(pairwise.sizes(), shape),
                    "attnkern: crf_marginals pairwise must have shape (2, 2) or broadcast to ", at::IntArrayRef(shape),
                    " (the unary scores' shape without dim, then 2×2), got ", pairwise.sizes());
  Tensor rows = pairwise.to(at::kDouble).expand(shape).contiguous();
  const double* wp = rows.const_data_ptr<double>();
  for (int64_t k = 0; k < rows.numel(); ++k) {
    TORCH_CHECK_VALUE(!std::isnan(wp[k]) && wp[k] != std::numeric_limits<double>::infinity(),
                      "attnkern: crf_marginals pairwise must not hold NaN or +inf (-inf forbids a transition), got ",
                      wp[k]);
  }
  return rows;
}

template <typename scalar_t>
void crf_fwd_impl(const Tensor& x, const Tensor& w, Tensor& out, int64_t dim) {
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const double* wp = w.const_data_ptr<double>();
  const int64_t n = lay.n;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    ChainScratch s(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(xp + base, s.row);
      int64_t m = 0;
      if (!chain_entries(s, n, m)) {
        std::fill(s.out, s.out + n, nan);
      } else {
        std::fill(s.out, s.out + n, 0.0);
        if (m > 0) {
          const bool feasible = chain_messages(s, m, wp + 4 * r) > kNegInf;
          for (int64_t i = 0; i < m; ++i) s.out[s.pos[i]] = feasible ? marginal(s, i) : nan;
        }
      }
      lay.store(s.out, op + base);
    }
  });
}

Tensor crf_marginals_fwd(const Tensor& x_in, const Tensor& pairwise, int64_t dim) {
  check_cpu_float(x_in, "unary");
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor w = checked_pairwise(pairwise, x, dim);
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_crf_marginals_fwd",
                                    [&] { crf_fwd_impl<scalar_t>(x, w, out, dim); });
  }
  return out;
}

// The backward of one feasible row of m >= 1 entries whose messages are in s
// (log Z given), with the incoming gradient compacted in s.g: du into s.out's
// places, and Σ_i dξ_i(a, b) added into dw (2×2) when it is not null.
void chain_backward(ChainScratch& s, int64_t m, const double* w, double log_z, double* dw) {
  const double *u = s.u, *g = s.g, *fa = s.fa, *fb = s.fb;
  double *ta = s.ta, *tb = s.tb;
  ta[0] = 0.0;
  ta[1] = g[0];
  for (int64_t i = 1; i < m; ++i) {
    for (int t = 0; t < 2; ++t) {
      const double share = share_of_second(fa[2 * i - 2] + w[t], fa[2 * i - 1] + w[2 + t]);
      ta[2 * i + t] = (t ? g[i] : 0.0) + (1.0 - share) * ta[2 * i - 2] + share * ta[2 * i - 1];
    }
  }
  tb[2 * m - 2] = tb[2 * m - 1] = 0.0;
  for (int64_t i = m - 2; i >= 0; --i) {
    for (int a = 0; a < 2; ++a) {
      const double share = share_of_second(w[2 * a] + fb[2 * i + 2], w[2 * a + 1] + u[i + 1] + fb[2 * i + 3]);
      tb[2 * i + a] = (1.0 - share) * tb[2 * i + 2] + share * (g[i + 1] + tb[2 * i + 3]);
    }
  }
  double log_z_tangent = 0.0;  // d log Z along g = g·μ
  for (int64_t i = 0; i < m; ++i) {
    const double mu = marginal(s, i);
    log_z_tangent += g[i] * mu;
    s.out[s.pos[i]] = mu * (1.0 - mu) * (ta[2 * i + 1] + tb[2 * i + 1] - ta[2 * i] - tb[2 * i]);
  }
  if (!dw) return;
  for (int64_t i = 0; i + 1 < m; ++i) {
    for (int a = 0; a < 2; ++a) {
      for (int b = 0; b < 2; ++b) {
        const double log_xi = fa[2 * i + a] + w[2 * a + b] + (b ? u[i + 1] : 0.0) + fb[2 * i + 2 + b] - log_z;
        if (log_xi == kNegInf) continue;
        const double tangent = ta[2 * i + a] + (b ? g[i + 1] : 0.0) + tb[2 * i + 2 + b] - log_z_tangent;
        dw[2 * a + b] += std::exp(log_xi) * tangent;
      }
    }
  }
}

template <typename scalar_t>
void crf_bwd_impl(const Tensor& x, const Tensor& grad, const Tensor& w, Tensor& dx, Tensor& dw, int64_t dim) {
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  const double* wp = w.const_data_ptr<double>();
  double* dwp = dw.defined() ? dw.mutable_data_ptr<double>() : nullptr;
  const int64_t n = lay.n;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    ChainScratch s(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(xp + base, s.row);
      lay.load(gp + base, s.grad);
      double* dw_row = dwp ? dwp + 4 * r : nullptr;
      if (dw_row) std::fill(dw_row, dw_row + 4, 0.0);
      int64_t m = 0;
      bool nan_row = !chain_entries(s, n, m);
      if (!nan_row) {
        std::fill(s.out, s.out + n, 0.0);
        if (m > 0) {
          const double log_z = chain_messages(s, m, wp + 4 * r);
          nan_row = !(log_z > kNegInf);
          if (!nan_row) {
            for (int64_t i = 0; i < m; ++i) s.g[i] = s.grad[s.pos[i]];
            chain_backward(s, m, wp + 4 * r, log_z, dw_row);
          }
        }
      }
      if (nan_row) {
        std::fill(s.out, s.out + n, nan);
        if (dw_row) std::fill(dw_row, dw_row + 4, nan);
      }
      lay.store(s.out, dp + base);
    }
  });
}

std::tuple<Tensor, Tensor> crf_marginals_bwd(const Tensor& x_in, const Tensor& grad_in, const Tensor& pairwise,
                                             int64_t dim, bool pairwise_grad) {
  check_cpu_float(x_in, "unary");
  check_cpu_float(grad_in, "grad");
  TORCH_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), "attnkern: crf_marginals_bwd: grad of shape ", grad_in.sizes(),
                    " does not match unary of shape ", x_in.sizes());
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor grad = grad_in.to(x.scalar_type()).contiguous();
  const Tensor w = checked_pairwise(pairwise, x, dim);
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dw = pairwise_grad ? at::empty_like(w) : Tensor();
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_crf_marginals_bwd",
                                    [&] { crf_bwd_impl<scalar_t>(x, grad, w, dx, dw, dim); });
  } else if (dw.defined()) {
    dw.zero_();
  }
  if (!dw.defined()) dw = at::empty({0}, x.options().dtype(at::kDouble));
  return {dx, dw};
}

}  // namespace

void add_crf_kernels(KernelTable& t) {
  t.crf_marginals_fwd = &crf_marginals_fwd;
  t.crf_marginals_bwd = &crf_marginals_bwd;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

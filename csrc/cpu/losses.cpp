// Fused Fenchel-Young losses of the α-entmax family on the CPU: one pass per
// row computes p = entmax_α(x) into the gradient buffer, the loss
//   L = <p, x - m> - (x_t - m) + H_α(p)      (m = row max; Σ p = 1)
// with H_α the Tsallis entropy (Shannon at α = 1), and then the gradient
// p - e_t in place. Masked (-inf) logits get p = 0 and contribute nothing.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "attnkern/entmax_math.h"
#include "normalize_row.h"

namespace attnkern {
namespace cpu {
namespace {

using at::Tensor;

// H_α(p) of a normalized row, b = α - 1.
template <typename acc_t>
acc_t tsallis_entropy(const acc_t* p, int64_t n, acc_t b) {
  const Family fam = math::family_of<acc_t>(b);
  double s = 0;
  if (fam == Family::kSoftmax) {
    for (int64_t j = 0; j < n; ++j)
      if (p[j] > acc_t(0)) s -= double(p[j]) * std::log(double(p[j]));
    return acc_t(s);
  }
  if (fam == Family::kSparsemax) {
    for (int64_t j = 0; j < n; ++j) s += double(p[j]) * double(p[j]);
    return acc_t((1.0 - s) / 2.0);
  }
  if (fam == Family::kEntmax15) {
    for (int64_t j = 0; j < n; ++j)
      if (p[j] > acc_t(0)) s += double(p[j]) * std::sqrt(double(p[j]));
    return acc_t((1.0 - s) / 0.75);
  }
  const double a = double(b) + 1.0;
  for (int64_t j = 0; j < n; ++j)
    if (p[j] > acc_t(0)) s += std::pow(double(p[j]), a);
  return acc_t((1.0 - s) / (a * double(b)));
}

template <typename scalar_t>
void loss_impl(const Tensor& x, const Tensor& target, const Tensor& alpha, Tensor& loss, Tensor& grad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = x.size(0), n = x.size(1);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const int64_t* tp = target.const_data_ptr<int64_t>();
  const acc_t* ap = alpha.const_data_ptr<acc_t>();
  acc_t* lp = loss.mutable_data_ptr<acc_t>();
  scalar_t* gp = grad.mutable_data_ptr<scalar_t>();
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    RowScratch<acc_t> scratch(n);
    acc_t* row = scratch.row();
    acc_t* y = scratch.y();
    acc_t* work = scratch.work();
    int32_t* idx = scratch.idx.data();
    std::vector<acc_t> pbuf(n);
    acc_t* p = pbuf.data();
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = xp + r * n;
      for (int64_t j = 0; j < n; ++j) row[j] = static_cast<acc_t>(xr[j]);
      const int64_t t = tp[r];
      const acc_t b = ap[r] - acc_t(1);
      const acc_t m = row_max(row, n);
      normalize_row_alpha<acc_t, Family::kGeneric>(row, n, b, p, y, work, idx);
      acc_t l;
      if (m != m || m == inf) {
        l = std::numeric_limits<acc_t>::quiet_NaN();
      } else if (m == -inf) {
        l = inf;  // every logit masked, the target's too
      } else {
        double inner = 0;
        for (int64_t j = 0; j < n; ++j)
          if (p[j] > acc_t(0)) inner += double(p[j]) * double(row[j] - m);
        l = acc_t(inner - double(row[t] - m)) + tsallis_entropy(p, n, b);
      }
      lp[r] = l;
      scalar_t* gr = gp + r * n;
      for (int64_t j = 0; j < n; ++j) gr[j] = static_cast<scalar_t>(p[j] - (j == t ? acc_t(1) : acc_t(0)));
    }
  });
}

// x (rows, n), target (rows,) int64 in [0, n), alpha (rows,) -> (loss (rows,)
// in the accumulation type, grad = p - onehot (rows, n) in x's dtype).
std::tuple<Tensor, Tensor> entmax_loss_fwd(const Tensor& x_in, const Tensor& target_in, const Tensor& alpha_in) {
  TORCH_CHECK(x_in.device().is_cpu() && at::isFloatingType(x_in.scalar_type()),
              "attnkern: x must be a floating-point CPU tensor");
  TORCH_CHECK(x_in.dim() == 2, "attnkern: entmax_loss_fwd expects x of shape (rows, classes)");
  TORCH_CHECK(target_in.dim() == 1 && target_in.size(0) == x_in.size(0), "attnkern: target must be (rows,)");
  const int64_t n = x_in.size(1);
  Tensor x = x_in.contiguous();
  Tensor target = target_in.to(at::kLong).contiguous();
  auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  Tensor alpha = alpha_in.to(acc).expand({x.size(0)}).contiguous();
  Tensor loss = at::empty({x.size(0)}, x.options().dtype(acc));
  Tensor grad = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return {loss.zero_(), grad};
  if (target.numel()) {
    TORCH_CHECK(target.min().item<int64_t>() >= 0 && target.max().item<int64_t>() < n,
                "attnkern: target out of range [0, ", n, ")");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_entmax_loss_fwd",
                                  [&] { loss_impl<scalar_t>(x, target, alpha, loss, grad); });
  return {loss, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CPU, m) { m.impl("entmax_loss_fwd", &entmax_loss_fwd); }

}  // namespace cpu
}  // namespace attnkern

// Fused Fenchel-Young losses of the α-entmax family on the CPU: one pass per
// row computes p = entmax_α(x) into the gradient buffer, the loss
//   L = <p, x - m> - (x_t - m) + H_α(p)      (m = row max; Σ p = 1)
// with H_α the Tsallis entropy (Shannon at α = 1), and then the gradient
// p - e_t in place. Masked (-inf) logits get p = 0 and contribute nothing.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attnkern/entmax_math.h"
#include "normalize_row.h"
#include "attnkern/row_layout.h"
#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using at::Tensor;

// <p, x - m> over the support (masked entries have p = 0 and x = -inf) and
// H_α(p), b = α - 1, of a normalized row p.
template <typename acc_t>
void loss_terms(const acc_t* p, const acc_t* x, int64_t n, acc_t m, acc_t b, acc_t* inner, acc_t* entropy) {
  using V = Vec<acc_t>;
  const Family fam = math::family_of<acc_t>(b);
  const V zero(0), vm(m);
  V vin(0), vs(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V pv = V::loadu(p + j);
    const V pos = pv > zero;
    vin += V::blendv(zero, pv * (V::loadu(x + j) - vm), pos);
    if (fam == Family::kSoftmax) {
      vs += V::blendv(zero, pv * pv.log(), pos);
    } else if (fam == Family::kSparsemax) {
      vs += pv * pv;
    } else if (fam == Family::kEntmax15) {
      vs += pv * pv.sqrt();
    }
  }
  acc_t in = hsum(vin), s = hsum(vs);
  for (; j < n; ++j) {
    if (!(p[j] > acc_t(0))) continue;
    in += p[j] * (x[j] - m);
    if (fam == Family::kSoftmax) s += p[j] * std::log(p[j]);
    else if (fam == Family::kSparsemax) s += p[j] * p[j];
    else if (fam == Family::kEntmax15) s += p[j] * std::sqrt(p[j]);
  }
  if (fam == Family::kGeneric) {
    const acc_t a = b + acc_t(1);
    for (int64_t i = 0; i < n; ++i)
      if (p[i] > acc_t(0)) s += std::pow(p[i], a);
  }
  *inner = in;
  switch (fam) {
    case Family::kSoftmax: *entropy = -s; break;
    case Family::kSparsemax: *entropy = (acc_t(1) - s) / acc_t(2); break;
    case Family::kEntmax15: *entropy = (acc_t(1) - s) / acc_t(0.75); break;
    case Family::kGeneric: *entropy = (acc_t(1) - s) / ((b + acc_t(1)) * b); break;
  }
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
    std::vector<acc_t> pbuf(std::is_same_v<scalar_t, acc_t> ? 0 : n);
    for (int64_t r = begin; r < end; ++r) {
      scratch.place({xp + r * n});
      acc_t* row = scratch.row();
      acc_t* y = scratch.y();
      acc_t* work = scratch.work();
      int32_t* idx = scratch.idx();
      const acc_t* xr;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        xr = reinterpret_cast<const acc_t*>(xp + r * n);
      } else {
        for (int64_t j = 0; j < n; ++j) row[j] = static_cast<acc_t>(xp[r * n + j]);
        xr = row;
      }
      const int64_t t = tp[r];
      const acc_t b = ap[r] - acc_t(1);
      const acc_t m = row_max(xr, n);
      acc_t* p = std::is_same_v<scalar_t, acc_t> ? reinterpret_cast<acc_t*>(gp + r * n) : pbuf.data();
      normalize_row_alpha<acc_t, Family::kGeneric>(xr, n, b, p, y, work, idx);
      acc_t l;
      if (m != m || m == inf) {
        l = std::numeric_limits<acc_t>::quiet_NaN();
      } else if (m == -inf) {
        l = inf;  // every logit masked, the target's too
      } else {
        acc_t inner, entropy;
        loss_terms(p, xr, n, m, b, &inner, &entropy);
        l = inner - (xr[t] - m) + entropy;
      }
      lp[r] = l;
      if constexpr (!std::is_same_v<scalar_t, acc_t>) {
        scalar_t* gr = gp + r * n;
        for (int64_t j = 0; j < n; ++j) gr[j] = static_cast<scalar_t>(p[j]);
      }
      gp[r * n + t] = static_cast<scalar_t>(p[t] - acc_t(1));
    }
  });
}

// x (rows, n), target (rows,) int64 in [0, n), alpha (rows,) -> (loss (rows,)
// in the accumulation type, grad = p - onehot (rows, n) in x's dtype).
std::tuple<Tensor, Tensor> entmax_loss_fwd(const Tensor& x_in, const Tensor& target_in, const Tensor& alpha_in) {
  check_cpu_float(x_in, "x");
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

void add_loss_kernels(KernelTable& t) {
  t.entmax_loss_fwd = &entmax_loss_fwd;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

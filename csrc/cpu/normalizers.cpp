// Row-wise softmax / sparsemax / entmax15 / α-entmax on the CPU, forward and
// backward. Rows run in parallel (at::parallel_for); the per-row math is in
// entmax_row.h (vectorized with at::vec) and attnkern/entmax_math.h.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "attnkern/entmax_math.h"
#include "entmax_row.h"
#include "row_layout.h"

namespace attnkern {
namespace cpu {
namespace {

using at::Tensor;

template <typename acc_t, Family FAM>
void normalize_row(acc_t* y, int64_t n, acc_t b, acc_t* work) {
  acc_t m = row_max(y, n);
  if (m != m) {
    std::fill(y, y + n, std::numeric_limits<acc_t>::quiet_NaN());
    return;
  }
  if (m == -std::numeric_limits<acc_t>::infinity()) {
    // Every entry masked: no support, zeros (never NaN).
    std::fill(y, y + n, acc_t(0));
    return;
  }
  if (m == std::numeric_limits<acc_t>::infinity()) {
    // As torch.softmax: +inf scores make the row undefined.
    std::fill(y, y + n, std::numeric_limits<acc_t>::quiet_NaN());
    return;
  }
  subtract(y, n, m);
  acc_t norm;
  acc_t c = find_shift<acc_t, FAM>(y, n, b, work, &norm);
  write_probs<acc_t, FAM>(y, n, c, b, norm, y);
}

template <typename scalar_t, Family FAM>
void forward_impl(const Tensor& x, Tensor& out, const Tensor& alpha, int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const acc_t* ap = (FAM == Family::kGeneric) ? alpha.const_data_ptr<acc_t>() : nullptr;
  const int64_t n = lay.n;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(2 * n);
    acc_t* y = buf.data();
    acc_t* work = y + n;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(xp + base, y);
      if constexpr (FAM == Family::kGeneric) {
        acc_t b = ap[r] - acc_t(1);
        switch (math::family_of<acc_t>(b)) {
          case Family::kSoftmax:
            normalize_row<acc_t, Family::kSoftmax>(y, n, acc_t(0), work);
            break;
          case Family::kSparsemax:
            normalize_row<acc_t, Family::kSparsemax>(y, n, acc_t(1), work);
            break;
          case Family::kEntmax15:
            normalize_row<acc_t, Family::kEntmax15>(y, n, acc_t(0.5), work);
            break;
          default:
            normalize_row<acc_t, Family::kGeneric>(y, n, b, work);
        }
      } else {
        constexpr acc_t b = FAM == Family::kSparsemax ? acc_t(1) : FAM == Family::kEntmax15 ? acc_t(0.5) : acc_t(0);
        normalize_row<acc_t, FAM>(y, n, b, work);
      }
      lay.store(y, op + base);
    }
  });
}

// Backward of one row: dx = g ⊙ (dp - Σ g dp / Σ g); optionally the α
// gradient's row reductions. p and dp are loaded into pbuf/gbuf (acc type).
template <typename acc_t, Family FAM>
acc_t backward_row(const acc_t* p, acc_t* dp_dx, int64_t n, acc_t b, bool want_alpha) {
  using V = Vec<acc_t>;
  const V vzero(0), vone_minus_b(acc_t(1) - b);
  V vgsum(0), vgdp(0);
  int64_t j = 0;
  auto g_of = [&](const V& pv) -> V {
    if constexpr (FAM == Family::kSoftmax) {
      return pv;
    } else if constexpr (FAM == Family::kSparsemax) {
      return V::blendv(vzero, V(acc_t(1)), pv > vzero);
    } else if constexpr (FAM == Family::kEntmax15) {
      return pv.sqrt();
    } else {
      return V::blendv(vzero, (vone_minus_b * pv.log()).exp(), pv > vzero);
    }
  };
  for (; j + V::size() <= n; j += V::size()) {
    V pv = V::loadu(p + j);
    V g = g_of(pv);
    vgsum += g;
    vgdp += g * V::loadu(dp_dx + j);
  }
  acc_t gsum = hsum(vgsum), gdp = hsum(vgdp);
  for (; j < n; ++j) {
    acc_t g = math::entmax_g_from_p<acc_t>(p[j], b, FAM);
    gsum += g;
    gdp += g * dp_dx[j];
  }
  acc_t dalpha = 0;
  if (want_alpha) {
    // Row reductions of the α gradient (scalar: only rows whose α requires
    // grad pay for the logarithms). Accumulated in double.
    double pdp = 0, plp = 0, ent = 0, pl2dp = 0, pl2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      double pi = p[i], dpi = dp_dx[i];
      if (pi > 0) {
        double l = std::log(pi);
        pdp += pi * dpi;
        plp += pi * l * dpi;
        ent -= pi * l;
        pl2dp += pi * l * l * dpi;
        pl2 += pi * l * l;
      }
    }
    dalpha = static_cast<acc_t>(math::entmax_alpha_grad_row<double>(
        static_cast<double>(b), pdp, static_cast<double>(gdp), static_cast<double>(gsum), plp, ent, pl2dp, pl2));
  }
  const acc_t mean = gsum > acc_t(0) ? gdp / gsum : acc_t(0);
  const V vmean(mean);
  j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V g = g_of(V::loadu(p + j));
    (g * (V::loadu(dp_dx + j) - vmean)).store(dp_dx + j);
  }
  for (; j < n; ++j) dp_dx[j] = math::entmax_g_from_p<acc_t>(p[j], b, FAM) * (dp_dx[j] - mean);
  return dalpha;
}

template <typename scalar_t, Family FAM>
void backward_impl(const Tensor& p, const Tensor& grad, Tensor& dx, const Tensor& alpha, Tensor& dalpha,
                   int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(p, dim);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
  const acc_t* ap = (FAM == Family::kGeneric) ? alpha.const_data_ptr<acc_t>() : nullptr;
  acc_t* dap = dalpha.defined() ? dalpha.mutable_data_ptr<acc_t>() : nullptr;
  const int64_t n = lay.n;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(2 * n);
    acc_t* pb = buf.data();
    acc_t* db = pb + n;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(pp + base, pb);
      lay.load(gp + base, db);
      acc_t da = 0;
      if constexpr (FAM == Family::kGeneric) {
        acc_t b = ap[r] - acc_t(1);
        switch (math::family_of<acc_t>(b)) {
          case Family::kSoftmax:
            // The forward used softmax; the α gradient still uses the
            // softmax-limit derivative.
            da = backward_row<acc_t, Family::kSoftmax>(pb, db, n, b, dap != nullptr);
            break;
          case Family::kSparsemax:
            da = backward_row<acc_t, Family::kSparsemax>(pb, db, n, b, dap != nullptr);
            break;
          case Family::kEntmax15:
            da = backward_row<acc_t, Family::kEntmax15>(pb, db, n, b, dap != nullptr);
            break;
          default:
            da = backward_row<acc_t, Family::kGeneric>(pb, db, n, b, dap != nullptr);
        }
      } else {
        constexpr acc_t b = FAM == Family::kSparsemax ? acc_t(1) : FAM == Family::kEntmax15 ? acc_t(0.5) : acc_t(0);
        backward_row<acc_t, FAM>(pb, db, n, b, false);
      }
      if (dap) dap[r] = da;
      lay.store(db, dxp + base);
    }
  });
}

void check_input(const Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "attnkern: ", name, " must be a CPU tensor here");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "attnkern: ", name, " must be a floating-point tensor, got ",
              x.scalar_type());
}

Tensor alpha_rows(const Tensor& x, const Tensor& alpha, int64_t dim) {
  auto shape = x.sizes().vec();
  if (!shape.empty()) shape[dim] = 1;
  auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return alpha.to(acc).expand(shape).contiguous();
}

template <Family FAM>
Tensor forward_op(const Tensor& x_in, const Tensor& alpha_in, int64_t dim) {
  check_input(x_in, "x");
  dim = at::maybe_wrap_dim(dim, x_in.dim());
  Tensor x = x_in.contiguous();
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return out;
  Tensor alpha = FAM == Family::kGeneric ? alpha_rows(x, alpha_in, dim) : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_normalizer_fwd",
                                  [&] { forward_impl<scalar_t, FAM>(x, out, alpha, dim); });
  return out;
}

template <Family FAM>
std::tuple<Tensor, Tensor> backward_op(const Tensor& p_in, const Tensor& grad_in, const Tensor& alpha_in,
                                       int64_t dim, bool alpha_grad) {
  check_input(p_in, "p");
  check_input(grad_in, "grad");
  TORCH_CHECK(p_in.sizes() == grad_in.sizes(), "attnkern: grad must have the shape of the output");
  dim = at::maybe_wrap_dim(dim, p_in.dim());
  Tensor p = p_in.contiguous();
  Tensor grad = grad_in.to(p.scalar_type()).contiguous();
  Tensor dx = at::empty_like(p, at::MemoryFormat::Contiguous);
  Tensor alpha = FAM == Family::kGeneric ? alpha_rows(p, alpha_in, dim) : Tensor();
  Tensor dalpha;
  if (FAM == Family::kGeneric && alpha_grad) dalpha = at::zeros_like(alpha);
  if (p.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "attnkern_normalizer_bwd",
                                    [&] { backward_impl<scalar_t, FAM>(p, grad, dx, alpha, dalpha, dim); });
  }
  if (!dalpha.defined()) dalpha = at::empty({0}, p.options());
  return {dx, dalpha};
}

template <Family FAM>
Tensor fixed_forward(const Tensor& x, int64_t dim) {
  return forward_op<FAM>(x, Tensor(), dim);
}

template <Family FAM>
Tensor fixed_backward(const Tensor& p, const Tensor& grad, int64_t dim) {
  return std::get<0>(backward_op<FAM>(p, grad, Tensor(), dim, false));
}

Tensor entmax_forward(const Tensor& x, const Tensor& alpha, int64_t dim) {
  return forward_op<Family::kGeneric>(x, alpha, dim);
}

std::tuple<Tensor, Tensor> entmax_backward(const Tensor& p, const Tensor& grad, const Tensor& alpha, int64_t dim,
                                           bool alpha_grad) {
  return backward_op<Family::kGeneric>(p, grad, alpha, dim, alpha_grad);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CPU, m) {
  m.impl("softmax_fwd", &fixed_forward<Family::kSoftmax>);
  m.impl("softmax_bwd", &fixed_backward<Family::kSoftmax>);
  m.impl("sparsemax_fwd", &fixed_forward<Family::kSparsemax>);
  m.impl("sparsemax_bwd", &fixed_backward<Family::kSparsemax>);
  m.impl("entmax15_fwd", &fixed_forward<Family::kEntmax15>);
  m.impl("entmax15_bwd", &fixed_backward<Family::kEntmax15>);
  m.impl("entmax_fwd", &entmax_forward);
  m.impl("entmax_bwd", &entmax_backward);
}

}  // namespace cpu
}  // namespace attnkern

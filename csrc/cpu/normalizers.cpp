// Row-wise softmax / sparsemax / entmax15 / α-entmax on the CPU, forward and
// backward. Rows run in parallel (at::parallel_for); the per-row math is in
// entmax_row.h (vectorized with at::vec) and attnkern/entmax_math.h.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "attnkern/entmax_math.h"
#include "entmax_row.h"
#include "normalize_row.h"
#include "attnkern/row_layout.h"
#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using at::Tensor;

// The softmax backward of one bfloat16 / half row: dx = p (dp - m),
// m = Σ p dp / Σ p, in float. p and dp are read in their dtype twice (for
// the sums, then for dx), widened a vector at a time, and dx is rounded as
// it is stored: no full row is converted.
template <typename scalar_t>
void softmax_backward_reduced(const scalar_t* p, const scalar_t* dp, int64_t n, scalar_t* dx) {
  static_assert(at::is_reduced_floating_point_v<scalar_t>);
  using Vf = Vec<float>;
  constexpr int64_t W = Vf::size();
  Vf vs0(0), vs1(0), vd0(0), vd1(0);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    Vf p0, p1, d0, d1;
    at::vec::load_to_float(p + j, p0, p1);
    at::vec::load_to_float(dp + j, d0, d1);
    vs0 += p0;
    vs1 += p1;
    vd0 = at::vec::fmadd(p0, d0, vd0);
    vd1 = at::vec::fmadd(p1, d1, vd1);
  }
  float sum = hsum(vs0 + vs1), sum_dp = hsum(vd0 + vd1);
  for (int64_t i = j; i < n; ++i) {
    const float pi = static_cast<float>(p[i]);
    sum += pi;
    sum_dp += pi * static_cast<float>(dp[i]);
  }
  const float m = sum > 0.f ? sum_dp / sum : 0.f;
  const Vf vm(m);
  for (j = 0; j + 2 * W <= n; j += 2 * W) {
    Vf p0, p1, d0, d1;
    at::vec::load_to_float(p + j, p0, p1);
    at::vec::load_to_float(dp + j, d0, d1);
    at::vec::convert_from_float<scalar_t>(p0 * (d0 - vm), p1 * (d1 - vm)).store(dx + j);
  }
  for (; j < n; ++j) dx[j] = static_cast<scalar_t>(static_cast<float>(p[j]) * (static_cast<float>(dp[j]) - m));
}

template <typename scalar_t, Family FAM>
void forward_impl(const Tensor& x, Tensor& out, const Tensor& alpha, int64_t dim) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const acc_t* ap = (FAM == Family::kGeneric) ? alpha.const_data_ptr<acc_t>() : nullptr;
  const int64_t n = lay.n;
  // Rows already contiguous in the accumulation type are read and written in
  // place; others are gathered into a buffer first.
  const bool direct = lay.inner == 1 && std::is_same_v<scalar_t, acc_t>;
  constexpr bool kHalfSoftmax = FAM == Family::kSoftmax && at::is_reduced_floating_point_v<scalar_t>;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    RowScratch<acc_t> scratch(n);
    std::optional<RowScratch<acc_t>> scratch1;  // the second row of a pair
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      scratch.place({xp + base});
      acc_t* row = scratch.row();
      acc_t* y = scratch.y();
      acc_t* work = scratch.work();
      int32_t* idx = scratch.idx();
      const acc_t b = FAM == Family::kGeneric ? ap[r] - acc_t(1) : math::fixed_b<FAM, acc_t>();
      if constexpr (FAM == Family::kGeneric) {
        // Contiguous rows of α-entmax go two at a time (normalize_generic_pair).
        if (lay.inner == 1 && r + 1 < end) {
          if (!scratch1) scratch1.emplace(n);
          const int64_t base1 = lay.base(r + 1);
          scratch1->place({xp + base1});
          const acc_t b1 = ap[r + 1] - acc_t(1);
          // The next pair's rows, contiguous (lay.inner == 1), for the prefetch.
          const bool more = r + 3 < end;
          const void* next = more ? static_cast<const void*>(xp + lay.base(r + 2)) : nullptr;
          void* next_out = more ? static_cast<void*>(op + lay.base(r + 2)) : nullptr;
          const int64_t next_bytes = 2 * n * static_cast<int64_t>(sizeof(scalar_t));
          if (direct) {
            normalize_generic_pair<acc_t>(reinterpret_cast<const acc_t*>(xp + base),
                                          reinterpret_cast<const acc_t*>(xp + base1), n, b, b1,
                                          reinterpret_cast<acc_t*>(op + base), reinterpret_cast<acc_t*>(op + base1),
                                          scratch, *scratch1, next, next_out, next_bytes);
          } else {
            acc_t* row1 = scratch1->row();
            lay.load(xp + base, row);
            lay.load(xp + base1, row1);
            normalize_generic_pair<acc_t>(row, row1, n, b, b1, row, row1, scratch, *scratch1, next, next_out,
                                          next_bytes);
            lay.store(row, op + base);
            lay.store(row1, op + base1);
          }
          ++r;
          continue;
        }
      }
      if (direct) {
        normalize_row_alpha<acc_t, FAM>(reinterpret_cast<const acc_t*>(xp + base), n, b,
                                        reinterpret_cast<acc_t*>(op + base), y, work, idx);
      } else {
        if constexpr (kHalfSoftmax) {
          if (lay.inner == 1) {
            // Half-precision softmax rows: the final scaling is fused into the
            // rounding store (one pass over the row fewer; same values).
            const acc_t m = widen_row_max(xp + base, n, row);
            if (special_row(m, row, n)) {
              lay.store(row, op + base);
            } else {
              const acc_t inv = acc_t(1) / exp_shifted(row, n, m, row);
              store_rounded<scalar_t>(row, n, inv, op + base);
            }
            continue;
          }
        }
        if constexpr (at::is_reduced_floating_point_v<scalar_t> &&
                      (FAM == Family::kSparsemax || FAM == Family::kEntmax15)) {
          if (lay.inner == 1) {
            // Widened as the max is taken (one pass over the row fewer; same values).
            normalize_row_widened<scalar_t, FAM>(xp + base, n, b, row, y, work, idx);
            lay.store(row, op + base);
            continue;
          }
        }
        lay.load(xp + base, row);
        normalize_row_alpha<acc_t, FAM>(row, n, b, row, y, work, idx);
        lay.store(row, op + base);
      }
    }
  });
}

// Backward of one row: dx = g ⊙ (dp - Σ g dp / Σ g), g = p^(2-α) on the
// support; dx may alias dp. gbuf: 2n entries of scratch (g for the generic family,
// whose g costs a power). Returns the row's α gradient if want_alpha.
template <typename acc_t, Family FAM>
acc_t backward_row(const acc_t* p, const acc_t* dp, acc_t* dx, acc_t* gbuf, int32_t* idx, int64_t n, acc_t b,
                   bool want_alpha);

template <typename acc_t, Family FAM>
acc_t backward_row(const acc_t* p, const acc_t* dp, acc_t* dx, acc_t* gbuf, int32_t* idx, int64_t n, acc_t b,
                   bool want_alpha) {
  using V = Vec<acc_t>;
  constexpr int kAll = (1 << V::size()) - 1;
  constexpr bool kSparse = FAM != Family::kSoftmax;
  const V vzero(0), vone_minus_b(acc_t(1) - b);
  auto g_of = [&](const V& pv) -> V {
    if constexpr (FAM == Family::kSoftmax) {
      return pv;
    } else if constexpr (FAM == Family::kSparsemax) {
      return V::blendv(vzero, V(acc_t(1)), pv > vzero);
    } else if constexpr (FAM == Family::kEntmax15) {
      return pv.sqrt();
    } else {
      // g = p^(1-b); p in (0, 1] on the support.
      V g = b < acc_t(1) ? pow_unit<acc_t>(pv, acc_t(1) - b) : (vone_minus_b * pv.log()).exp();
      return V::blendv(vzero, g, pv > vzero);
    }
  };
  if constexpr (kSparse) {
    // (With the α gradient wanted, the dense pass keeps dp intact for it; the
    // generic family at b <= 0 has no zeros.)
    if (!want_alpha && b > acc_t(0) && backward_row_sparse<acc_t, FAM>(p, dp, dx, gbuf, idx, n, b, acc_t(1))) return 0;
  }
  V vgsum(0), vgdp(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V pv = V::loadu(p + j);
    if (kSparse && (pv.zero_mask() & kAll) == kAll) {
      if constexpr (FAM == Family::kGeneric) vzero.store(gbuf + j);
      continue;
    }
    V g = g_of(pv);
    if constexpr (FAM == Family::kGeneric) g.store(gbuf + j);
    vgsum += g;
    vgdp += g * V::loadu(dp + j);
  }
  acc_t gsum = hsum(vgsum), gdp = hsum(vgdp);
  for (; j < n; ++j) {
    acc_t g = math::entmax_g_from_p<acc_t>(p[j], b, FAM);
    gbuf[j] = g;
    gsum += g;
    gdp += g * dp[j];
  }
  acc_t dalpha = 0;
  if (want_alpha) {
    // Row reductions of the α gradient, in double over the support (only rows
    // whose α requires grad pay for the logarithms): see AlphaGradSums.
    math::AlphaGradSums sums;
    for (int64_t i = 0; i < n; ++i) sums.add(static_cast<double>(p[i]), static_cast<double>(dp[i]), b);
    dalpha = static_cast<acc_t>(sums.grad(static_cast<double>(b)));
  }
  const acc_t mean = gsum > acc_t(0) ? gdp / gsum : acc_t(0);
  const V vmean(mean);
  j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V g;
    if constexpr (FAM == Family::kGeneric) {
      g = V::loadu(gbuf + j);
    } else {
      V pv = V::loadu(p + j);
      if (kSparse && (pv.zero_mask() & kAll) == kAll) {
        vzero.store(dx + j);
        continue;
      }
      g = g_of(pv);
    }
    (g * (V::loadu(dp + j) - vmean)).store(dx + j);
  }
  for (; j < n; ++j) dx[j] = gbuf[j] * (dp[j] - mean);
  return dalpha;
}

// α > 2 (b > 1): g = p^(1-b) is unbounded at the edge of the support, so the
// row's backward runs in double over its support (math::edge_vjp).
// dx may alias dp.
template <typename acc_t>
acc_t backward_row_edge(const acc_t* p, const acc_t* dp, acc_t* dx, int64_t n, acc_t b, bool want_alpha) {
  thread_local std::vector<double> buf;
  thread_local std::vector<int64_t> pos;
  pos.clear();
  for (int64_t i = 0; i < n; ++i)
    if (p[i] > acc_t(0) || p[i] != p[i]) pos.push_back(i);
  const int64_t k = static_cast<int64_t>(pos.size());
  buf.resize(3 * k);
  double* pk = buf.data();
  double* d = pk + k;
  double* dz = d + k;
  const double bd = static_cast<double>(b);
  math::AlphaGradSums sums;
  for (int64_t t = 0; t < k; ++t) {
    pk[t] = static_cast<double>(p[pos[t]]);
    d[t] = static_cast<double>(dp[pos[t]]);
    if (want_alpha) sums.add(pk[t], d[t], bd);
  }
  math::entmax_edge_vjp(pk, d, dz, k, bd);
  std::fill(dx, dx + n, acc_t(0));
  for (int64_t t = 0; t < k; ++t) dx[pos[t]] = static_cast<acc_t>(dz[t]);
  return want_alpha ? static_cast<acc_t>(sums.grad(bd)) : acc_t(0);
}

template <typename acc_t, Family FAM>
inline acc_t backward_row_alpha(const acc_t* p, const acc_t* dp, acc_t* dx, acc_t* gbuf, int32_t* idx, int64_t n,
                                acc_t b, bool want_alpha) {
  if constexpr (FAM == Family::kGeneric) {
    // At α = 1 the forward used softmax; the α gradient uses the softmax-limit derivative.
    return math::with_family(math::family_of<acc_t>(b), [&](auto tag) {
      constexpr Family F = decltype(tag)::value;
      if constexpr (F == Family::kGeneric) {
        if (b > acc_t(1)) return backward_row_edge<acc_t>(p, dp, dx, n, b, want_alpha);
      }
      return backward_row<acc_t, F>(p, dp, dx, gbuf, idx, n, b, want_alpha);
    });
  } else {
    return backward_row<acc_t, FAM>(p, dp, dx, gbuf, idx, n, b, false);
  }
}

// The sparse backward of one contiguous bfloat16 / half row read and written
// in its own dtype (backward_row_sparse widens only the support's entries);
// false when the row's family is dense, or its support is not sparse, or
// α > 2 (whose backward runs in double: backward_row_edge).
template <typename scalar_t, Family FAM>
bool backward_row_reduced(const scalar_t* p, const scalar_t* dp, scalar_t* dx, float* gbuf, int32_t* idx,
                          int64_t n, float b) {
  return math::with_family(FAM == Family::kGeneric ? math::family_of<float>(b) : FAM, [&](auto tag) {
    constexpr Family F = decltype(tag)::value;
    if constexpr (F == Family::kSoftmax) {
      return false;
    } else {
      if (F == Family::kGeneric && !(b > 0.f && b <= 1.f)) return false;
      const float bf = F == Family::kGeneric ? b : math::fixed_b<F, float>();
      return backward_row_sparse<float, F, scalar_t>(p, dp, dx, gbuf, idx, n, bf, 1.f);
    }
  });
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
  const bool direct = lay.inner == 1 && std::is_same_v<scalar_t, acc_t>;
  constexpr bool kHalfSoftmax = FAM == Family::kSoftmax && at::is_reduced_floating_point_v<scalar_t>;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    RowScratch<acc_t> scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      scratch.place({pp + base, gp + base});
      acc_t* pb = scratch.row();
      acc_t* db = scratch.y();
      acc_t* gb = scratch.work();
      int32_t* idx = scratch.idx();
      const acc_t b = FAM == Family::kGeneric ? ap[r] - acc_t(1) : math::fixed_b<FAM, acc_t>();
      acc_t da;
      if (lay.nan_row_gradient(pp, dxp, base)) {
        if (dap) dap[r] = std::numeric_limits<acc_t>::quiet_NaN();
        continue;
      }
      if (direct) {
        da = backward_row_alpha<acc_t, FAM>(reinterpret_cast<const acc_t*>(pp + base),
                                            reinterpret_cast<const acc_t*>(gp + base),
                                            reinterpret_cast<acc_t*>(dxp + base), gb, idx, n, b, dap != nullptr);
      } else {
        if constexpr (at::is_reduced_floating_point_v<scalar_t> && FAM != Family::kSoftmax) {
          if (lay.inner == 1 && dap == nullptr &&
              backward_row_reduced<scalar_t, FAM>(pp + base, gp + base, dxp + base, gb, idx, n, b))
            continue;
        }
        if constexpr (kHalfSoftmax) {
          if (lay.inner == 1) {
            softmax_backward_reduced(pp + base, gp + base, n, dxp + base);
            continue;
          }
        }
        lay.load(pp + base, pb);
        lay.load(gp + base, db);
        da = backward_row_alpha<acc_t, FAM>(pb, db, db, gb, idx, n, b, dap != nullptr);
        lay.store(db, dxp + base);
      }
      if (dap) dap[r] = da;
    }
  });
}

Tensor alpha_rows(const Tensor& x, const Tensor& alpha, int64_t dim) {
  Tensor a = per_row(alpha, x, dim, x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  // attnkern.entmax checks α in eager mode; a compiled graph skips that check,
  // and a NaN or infinite α would otherwise give rows of zeros here. (A loop
  // over the contiguous rows' α, not tensor ops: small calls, as the RNN
  // attention makes every step, would pay an allocation and a reduction.)
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "attnkern_alpha_check", [&] {
    const scalar_t* p = a.const_data_ptr<scalar_t>();
    for (int64_t i = 0, n = a.numel(); i < n; ++i)
      // (The value as a double: the message's formatter is then the one the
      // portable copy also defines, which the linker keeps; tests/test_isa.py.)
      TORCH_CHECK_VALUE(std::isfinite(p[i]), "attnkern.entmax: alpha must be finite, got ", static_cast<double>(p[i]));
  });
  return a;
}

template <Family FAM>
Tensor forward_op(const Tensor& x_in, const Tensor& alpha_in, int64_t dim) {
  check_cpu_float(x_in, "x");
  dim = at::maybe_wrap_dim(dim, x_in.dim());
  TORCH_CHECK(x_in.dim() == 0 || x_in.size(dim) < (int64_t(1) << 31), "attnkern: rows longer than 2^31 - 1");
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
  const RowBackwardInputs in = row_backward_inputs(p_in, grad_in, dim);
  const Tensor& p = in.p;
  const Tensor& grad = in.grad;
  dim = in.dim;
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

void add_normalizer_kernels(KernelTable& t) {
  t.softmax_fwd = &fixed_forward<Family::kSoftmax>;
  t.softmax_bwd = &fixed_backward<Family::kSoftmax>;
  t.sparsemax_fwd = &fixed_forward<Family::kSparsemax>;
  t.sparsemax_bwd = &fixed_backward<Family::kSparsemax>;
  t.entmax15_fwd = &fixed_forward<Family::kEntmax15>;
  t.entmax15_bwd = &fixed_backward<Family::kEntmax15>;
  t.entmax_fwd = &entmax_forward;
  t.entmax_bwd = &entmax_backward;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

// A tensor seen as rows along one dim: (outer, n, inner) for a contiguous
// tensor, the row r = (o, i) starting at o·n·inner + i with stride inner.
// Rows along any dim are gathered into a contiguous buffer in the accumulation
// type, so no transposed copy of the tensor is ever made.
#pragma once

#include <ATen/ATen.h>
#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#endif

#include <algorithm>
#include <cstring>
#include <limits>

#include "attnkern/isa_namespace.h"
#include "attnkern/reduced_store.h"

namespace attnkern {
namespace cpu {
ATTNKERN_ISA_BEGIN

struct RowLayout {
  int64_t outer = 1, n = 1, inner = 1;

  static RowLayout of(const at::Tensor& x, int64_t dim) {
    RowLayout l;
    if (x.dim() == 0) return l;
    l.n = x.size(dim);
    for (int64_t d = 0; d < dim; ++d) l.outer *= x.size(d);
    for (int64_t d = dim + 1; d < x.dim(); ++d) l.inner *= x.size(d);
    return l;
  }

  int64_t rows() const { return outer * inner; }
  int64_t base(int64_t r) const { return (r / inner) * n * inner + r % inner; }
  // About 32K elements of work per task keeps the threads busy without
  // paying the scheduling cost per short row.
  int64_t grain() const { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

  template <typename scalar_t, typename acc_t>
  void load(const scalar_t* src, acc_t* dst) const {
    if (inner == 1) {
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        std::memcpy(dst, src, sizeof(acc_t) * n);
      } else {
        int64_t j = 0;
#if !defined(__CUDACC__) && !defined(__HIPCC__)
        if constexpr (at::is_reduced_floating_point_v<scalar_t> && std::is_same_v<acc_t, float>) {
          // bfloat16 / half rows widened a vector at a time (exact).
          using Vs = at::vec::Vectorized<scalar_t>;
          constexpr int64_t kHalf = at::vec::Vectorized<float>::size();
          for (; j + Vs::size() <= n; j += Vs::size()) {
            auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vs::loadu(src + j));
            lo.store(dst + j);
            hi.store(dst + j + kHalf);
          }
        }
#endif
        for (; j < n; ++j) dst[j] = static_cast<acc_t>(src[j]);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[j * inner]);
    }
  }

  template <typename acc_t, typename scalar_t>
  void store(const acc_t* src, scalar_t* dst) const {
    if (inner == 1) {
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        std::memcpy(dst, src, sizeof(acc_t) * n);
      } else {
        int64_t j = 0;
#if !defined(__CUDACC__) && !defined(__HIPCC__)
        if constexpr (at::is_reduced_floating_point_v<scalar_t> && std::is_same_v<acc_t, float>) {
          // Rounded to bfloat16 / half a vector pair at a time (reduced_store.h).
          return store_rounded<scalar_t>(src, n, 1.0f, dst);
        }
#endif
        for (; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j]);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) dst[j * inner] = static_cast<scalar_t>(src[j]);
    }
  }

  // The backward of a row whose output p (starting at p[base]) is NaN: the
  // forwards write NaN across a row with a NaN score, and its gradient is NaN
  // too (as torch.softmax's; the sparse families' support tests, false for
  // NaN, would otherwise give a silent 0). Returns whether it wrote one.
  template <typename scalar_t>
  bool nan_row_gradient(const scalar_t* p, scalar_t* dx, int64_t base) const {
    if (!(static_cast<float>(p[base]) != static_cast<float>(p[base]))) return false;
    const scalar_t nan = std::numeric_limits<scalar_t>::quiet_NaN();
    for (int64_t j = 0; j < n; ++j) dx[base + j * inner] = nan;
    return true;
  }
};

// Checks that a row-wise op's tensor argument is a floating-point CPU tensor.
inline void check_cpu_float(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "attnkern: ", name, " must be a CPU tensor here");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "attnkern: ", name, " must be a floating-point tensor, got ",
              x.scalar_type());
}

// Row indices are int32 in the kernels' scratch (support lists): refuse rows
// of 2^31 entries or more, in the backward as in the forward.
inline void check_row_length(const at::Tensor& x, int64_t dim) {
  TORCH_CHECK(x.dim() == 0 || x.size(dim) < (int64_t(1) << 31), "attnkern: rows longer than 2^31 - 1");
}

// A per-row parameter (α, budget) broadcast to one contiguous value per row of
// x along dim (x's shape with size 1 there), in the given dtype.
inline at::Tensor per_row(const at::Tensor& param, const at::Tensor& x, int64_t dim, at::ScalarType dtype) {
  auto shape = x.sizes().vec();
  if (!shape.empty()) shape[dim] = 1;
  return param.to(dtype).expand(shape).contiguous();
}

// The inputs of a row-wise backward, checked and made contiguous: p and the
// gradient on it (same shape; the gradient in p's dtype), dim wrapped.
struct RowBackwardInputs {
  at::Tensor p, grad;
  int64_t dim;
};

inline RowBackwardInputs row_backward_inputs(const at::Tensor& p, const at::Tensor& grad, int64_t dim) {
  check_cpu_float(p, "p");
  check_cpu_float(grad, "grad");
  TORCH_CHECK(p.sizes() == grad.sizes(), "attnkern: grad must have the shape of p");
  RowBackwardInputs in;
  in.dim = at::maybe_wrap_dim(dim, p.dim());
  check_row_length(p, in.dim);  // before any copy of p
  in.p = p.contiguous();
  in.grad = grad.to(in.p.scalar_type()).contiguous();
  return in;
}

ATTNKERN_ISA_END
}  // namespace cpu
}  // namespace attnkern

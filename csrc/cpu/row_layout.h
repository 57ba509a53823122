// A tensor seen as rows along one dim: (outer, n, inner) for a contiguous
// tensor, the row r = (o, i) starting at o·n·inner + i with stride inner.
// Rows along any dim are gathered into a contiguous buffer in the accumulation
// type, so no transposed copy of the tensor is ever made.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

namespace attnkern {
namespace cpu {

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
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<acc_t>(src[j]);
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
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j]);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) dst[j * inner] = static_cast<scalar_t>(src[j]);
    }
  }
};

}  // namespace cpu
}  // namespace attnkern

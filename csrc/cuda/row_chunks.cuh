// What the CUDA row kernels (one thread per row: csrc/cuda/structured.cu,
// csrc/cuda/chain.cu) share around their kernels: a tensor's rows along dim as
// a contiguous (rows, n) tensor and back, and launches over chunks of rows
// whose float64 scratch fits a fixed budget, so that long inputs do not need
// scratch of their size.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace attnkern {
namespace cuda {

constexpr int kRowThreads = 128;
constexpr int64_t kRowScratchBytes = int64_t(256) << 20;

// x's rows along dim as (rows, n), contiguous (a 0-d x is one row of one).
inline at::Tensor rows_along(const at::Tensor& x, int64_t dim) {
  const at::Tensor moved = x.dim() == 0 ? x.reshape({1}) : x.movedim(dim, -1);
  return moved.contiguous().reshape({-1, moved.size(-1)});
}

// rows_along's inverse: (rows, n) back to x's shape, rows along dim.
inline at::Tensor restore_rows(const at::Tensor& rows2d, const at::Tensor& x, int64_t dim) {
  if (x.dim() == 0) return rows2d.reshape({});
  return rows2d.reshape(x.movedim(dim, -1).sizes()).movedim(-1, dim).contiguous();
}

// The rows of one chunk: as many as kRowScratchBytes holds at bytes_per_row
// each (at least one), and no more than there are.
inline int64_t chunk_rows(int64_t rows, int64_t bytes_per_row) {
  return std::min(rows, std::max<int64_t>(1, kRowScratchBytes / std::max<int64_t>(bytes_per_row, 1)));
}

// launch(first_row, rows, blocks) for each chunk of `chunk` rows of `rows`,
// blocks counting kRowThreads threads a row each.
template <typename Launch>
void for_row_chunks(int64_t rows, int64_t chunk, Launch&& launch) {
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t count = std::min(chunk, rows - first);
    launch(first, count, static_cast<int>((count + kRowThreads - 1) / kRowThreads));
  }
}

}  // namespace cuda
}  // namespace attnkern

// crf_marginals on CUDA, forward and backward: the same semantics as the CPU
// kernel (csrc/cpu/chain.cpp), with its per-row math from
// attnkern/chain_math.h (forward-backward in log space and the backward's
// tangents), which the CPU tests check against enumeration.
//
// The recurrences are sequential along a row, so each row is one thread; a
// row's finite entries, messages, shares and tangents live in double scratch
// in global memory (kScratchPerEntry doubles and an index per entry),
// allocated for a chunk of rows at a time (row_chunks.cuh).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <math_constants.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnkern/chain_math.h"
#include "attnkern/row_layout.h"
#include "row_chunks.cuh"

namespace attnkern {
namespace cuda {
namespace {

using at::Tensor;

// Per entry: u, g, μ, du, the two forward messages, four shares, four tangents.
constexpr int kScratchPerEntry = 14;

// Row r solved: its scratch (kScratchPerEntry arrays of n doubles), its
// finite entries compacted into u (m of them, their positions into pos) and
// its forward-backward; ok = false for a row with NaN or +inf, feasible =
// false also for one that no labeling can score.
struct SolvedRow {
  double *u, *g, *mu, *du, *fwd0, *fwd1, *fs0, *fs1, *bs0, *bs1, *ta0, *ta1, *tb0, *tb1;
  int64_t* pos;
  int64_t m = 0;
  bool ok = true, feasible = true;

  template <typename scalar_t>
  __device__ SolvedRow(const scalar_t* x, const double* w, double* scratch, int64_t* pos_all, int64_t r, int64_t n)
      : pos(pos_all + r * n) {
    double** arrays[kScratchPerEntry] = {&u, &g, &mu, &du, &fwd0, &fwd1, &fs0, &fs1, &bs0, &bs1, &ta0, &ta1, &tb0,
                                         &tb1};
    for (int k = 0; k < kScratchPerEntry; ++k) *arrays[k] = scratch + (r * kScratchPerEntry + k) * n;
    for (int64_t j = 0; j < n; ++j) {
      const double v = static_cast<double>(x[r * n + j]);
      if (isnan(v) || v == CUDART_INF) ok = false;
      if (v > -CUDART_INF) {
        u[m] = v;
        pos[m++] = j;
      }
    }
    feasible = ok && (m == 0 || math::crf_sweeps_log(u, m, w + 4 * r, fwd0, fwd1, mu, fs0, fs1, bs0, bs1));
  }
};

template <typename scalar_t>
__global__ void crf_fwd_kernel(const scalar_t* x, const double* w, scalar_t* out, double* scratch, int64_t* pos,
                               int64_t rows, int64_t n) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const SolvedRow s(x, w, scratch, pos, r, n);
  scalar_t* o = out + r * n;
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<scalar_t>(s.ok ? 0.0 : CUDART_NAN);
  for (int64_t i = 0; s.ok && i < s.m; ++i) o[s.pos[i]] = static_cast<scalar_t>(s.feasible ? s.mu[i] : CUDART_NAN);
}

template <typename scalar_t>
__global__ void crf_bwd_kernel(const scalar_t* x, const scalar_t* g, const double* w, scalar_t* dx, double* dw,
                               double* scratch, int64_t* pos, int64_t rows, int64_t n) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const SolvedRow s(x, w, scratch, pos, r, n);
  // As on the CPU: a row with NaN or +inf, or without a feasible labeling, gets NaN everywhere.
  const bool nan_row = !s.ok || !s.feasible;
  double* dwr = dw ? dw + 4 * r : nullptr;
  if (dwr) {
    for (int k = 0; k < 4; ++k) dwr[k] = nan_row ? CUDART_NAN : 0.0;
  }
  scalar_t* d = dx + r * n;
  for (int64_t j = 0; j < n; ++j) d[j] = static_cast<scalar_t>(nan_row ? CUDART_NAN : 0.0);
  if (nan_row || s.m == 0) return;
  for (int64_t i = 0; i < s.m; ++i) s.g[i] = static_cast<double>(g[r * n + s.pos[i]]);
  math::crf_backward(s.g, s.mu, s.fs0, s.fs1, s.bs0, s.bs1, s.m, s.ta0, s.ta1, s.tb0, s.tb1, s.du, dwr);
  for (int64_t i = 0; i < s.m; ++i) d[s.pos[i]] = static_cast<scalar_t>(s.du[i]);
}

void check_cuda_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "attnkern.crf_marginals: ", name, " must be a CUDA tensor");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "attnkern.crf_marginals: ", name,
              " must be floating point, got ", t.scalar_type());
}

// The rows (along dim, contiguous, (rows, n)) and one 2×2 per row in double
// ((rows, 4)), checked as the CPU kernel checks them; shape: pairwise's
// per-row shape (unary's without dim, then 2, 2).
struct Rows {
  Tensor x, w;
  std::vector<int64_t> shape;
  int64_t dim, rows, n;
};

Rows prepare(const Tensor& x_in, const Tensor& pairwise, int64_t dim) {
  check_cuda_float(x_in, "unary");
  check_cuda_float(pairwise, "pairwise");
  TORCH_CHECK(pairwise.device() == x_in.device(), "attnkern.crf_marginals: pairwise must be on unary's device");
  Rows r;
  r.dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  cpu::check_row_length(x_in, r.dim);
  r.shape = x_in.sizes().vec();
  if (!r.shape.empty()) r.shape.erase(r.shape.begin() + r.dim);
  r.shape.push_back(2);
  r.shape.push_back(2);
  TORCH_CHECK_VALUE(pairwise.dim() >= 2 && pairwise.size(-1) == 2 && pairwise.size(-2) == 2 &&
                        at::is_expandable_to(pairwise.sizes(), r.shape),
                    "attnkern: crf_marginals pairwise must have shape (2, 2) or broadcast to ", at::IntArrayRef(r.shape),
                    " (the unary scores' shape without dim, then 2×2), got ", pairwise.sizes());
  Tensor w = pairwise.to(at::kDouble).expand(r.shape).contiguous();
  TORCH_CHECK_VALUE(w.numel() == 0 || !(w.isnan().any().item<bool>() || (w == INFINITY).any().item<bool>()),
                    "attnkern: crf_marginals pairwise must not hold NaN or +inf (-inf forbids a transition)");
  r.x = rows_along(x_in, r.dim);
  r.rows = r.x.size(0);
  r.n = r.x.size(1);
  r.w = w.reshape({r.rows, 4});
  return r;
}

// Scratch bytes per row of n entries.
int64_t scratch_bytes(int64_t n) { return (kScratchPerEntry * int64_t(sizeof(double)) + int64_t(sizeof(int64_t))) * n; }

Tensor crf_forward(const Tensor& x_in, const Tensor& pairwise, int64_t dim) {
  c10::cuda::CUDAGuard guard(x_in.device());
  Rows r = prepare(x_in, pairwise, dim);
  Tensor out = at::empty_like(r.x);
  if (r.x.numel() == 0) return restore_rows(out, x_in, r.dim);
  const int64_t chunk = chunk_rows(r.rows, scratch_bytes(r.n));
  Tensor scratch = at::empty({chunk, kScratchPerEntry * r.n}, r.x.options().dtype(at::kDouble));
  Tensor pos = at::empty({chunk, r.n}, r.x.options().dtype(at::kLong));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.x.scalar_type(), "attnkern_crf_fwd_cuda", [&] {
    for_row_chunks(r.rows, chunk, [&](int64_t r0, int64_t rows, int blocks) {
      crf_fwd_kernel<scalar_t><<<blocks, kRowThreads, 0, stream>>>(
          r.x.const_data_ptr<scalar_t>() + r0 * r.n, r.w.const_data_ptr<double>() + 4 * r0,
          out.mutable_data_ptr<scalar_t>() + r0 * r.n, scratch.mutable_data_ptr<double>(),
          pos.mutable_data_ptr<int64_t>(), rows, r.n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return restore_rows(out, x_in, r.dim);
}

std::tuple<Tensor, Tensor> crf_backward(const Tensor& x_in, const Tensor& grad_in, const Tensor& pairwise,
                                        int64_t dim, bool pairwise_grad) {
  c10::cuda::CUDAGuard guard(x_in.device());
  check_cuda_float(grad_in, "grad");
  TORCH_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), "attnkern: crf_marginals_bwd: grad of shape ", grad_in.sizes(),
                    " does not match unary of shape ", x_in.sizes());
  Rows r = prepare(x_in, pairwise, dim);
  Tensor g = grad_in.to(x_in.scalar_type());
  g = rows_along(g, r.dim);
  Tensor dx = at::empty_like(r.x);
  Tensor dw = pairwise_grad ? at::empty({r.rows, 4}, r.x.options().dtype(at::kDouble)) : Tensor();
  if (r.x.numel() > 0) {
    const int64_t chunk = chunk_rows(r.rows, scratch_bytes(r.n));
    Tensor scratch = at::empty({chunk, kScratchPerEntry * r.n}, r.x.options().dtype(at::kDouble));
    Tensor pos = at::empty({chunk, r.n}, r.x.options().dtype(at::kLong));
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.x.scalar_type(), "attnkern_crf_bwd_cuda", [&] {
      for_row_chunks(r.rows, chunk, [&](int64_t r0, int64_t rows, int blocks) {
        crf_bwd_kernel<scalar_t><<<blocks, kRowThreads, 0, stream>>>(
            r.x.const_data_ptr<scalar_t>() + r0 * r.n, g.const_data_ptr<scalar_t>() + r0 * r.n,
            r.w.const_data_ptr<double>() + 4 * r0, dx.mutable_data_ptr<scalar_t>() + r0 * r.n,
            dw.defined() ? dw.mutable_data_ptr<double>() + 4 * r0 : nullptr, scratch.mutable_data_ptr<double>(),
            pos.mutable_data_ptr<int64_t>(), rows, r.n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  } else if (dw.defined()) {
    dw.zero_();
  }
  Tensor dpair = dw.defined() ? dw.reshape(r.shape) : at::empty({0}, x_in.options().dtype(at::kDouble));
  return {restore_rows(dx, x_in, r.dim), dpair};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CUDA, m) {
  m.impl("crf_marginals_fwd", &crf_forward);
  m.impl("crf_marginals_bwd", &crf_backward);
}

}  // namespace cuda
}  // namespace attnkern

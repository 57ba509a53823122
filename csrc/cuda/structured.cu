// fusedmax on CUDA, forward and backward: the same semantics as the CPU kernel
// (csrc/cpu/structured.cpp), with its per-row math from
// attnkern/structured_math.h, which the CPU tests check.
//
// The prox is a sequential sweep per row, so each row is one thread; the
// rows' finite entries, prox values and gradients live in double scratch in
// global memory (three doubles and an index per entry), allocated for a chunk
// of rows at a time so that long inputs do not need scratch of their size.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <math_constants.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attnkern/row_layout.h"
#include "attnkern/structured_math.h"
#include "row_chunks.cuh"

namespace attnkern {
namespace cuda {
namespace {

using at::Tensor;

// Scratch per entry, in bytes: three doubles and an index.
constexpr int64_t kScratchPerEntry = 32;

// One row's finite entries compacted into xs, their positions into pos;
// false if the row holds a NaN or +inf.
template <typename scalar_t>
__device__ bool finite_entries(const scalar_t* x, int64_t n, double* xs, int64_t* pos, int64_t& m) {
  m = 0;
  bool ok = true;
  for (int64_t j = 0; j < n; ++j) {
    const double v = static_cast<double>(x[j]);
    if (isnan(v) || v == CUDART_INF) ok = false;
    if (v > -CUDART_INF) {
      xs[m] = v;
      pos[m++] = j;
    }
  }
  return ok;
}

// One row's prox and threshold: its finite entries (positions into pos), y =
// prox(x) and tau, sparsemax's threshold on y (xs is its scratch); m counts
// the finite entries. false (nothing solved) for a row with NaN or +inf.
template <typename scalar_t>
__device__ bool solve_row(const scalar_t* x, int64_t n, double lam, double* xs, double* y, int64_t* pos, int64_t& m,
                          double& tau) {
  if (!finite_entries(x, n, xs, pos, m)) return false;
  if (m == 0) return true;
  math::tv_prox(xs, m, lam, y);
  tau = math::sparsemax_threshold(y, m, xs);  // (xs is free after the prox)
  return true;
}

// Rows [0, rows) of x (rows x n, contiguous) into out; lam one value per row.
template <typename scalar_t>
__global__ void fusedmax_fwd_kernel(const scalar_t* x, const double* lam, scalar_t* out, double* xs, double* y,
                                    int64_t* pos, int64_t rows, int64_t n) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  scalar_t* o = out + r * n;
  double* yr = y + r * n;
  int64_t* pr = pos + r * n;
  int64_t m = 0;
  double tau = 0.0;
  const bool ok = solve_row(x + r * n, n, lam[r], xs + r * n, yr, pr, m, tau);
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<scalar_t>(ok ? 0.0 : CUDART_NAN);
  for (int64_t i = 0; ok && i < m; ++i) o[pr[i]] = static_cast<scalar_t>(fmax(yr[i] - tau, 0.0));
}

// The backward of rows [0, rows): dx (rows x n) and, with dlam, dλ per row.
template <typename scalar_t>
__global__ void fusedmax_bwd_kernel(const scalar_t* x, const scalar_t* g, const double* lam, scalar_t* dx,
                                    double* dlam, double* xs, double* y, double* dxs, int64_t* pos, int64_t rows,
                                    int64_t n) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const scalar_t* gr = g + r * n;
  scalar_t* d = dx + r * n;
  double* xsr = xs + r * n;
  double* yr = y + r * n;
  double* dr = dxs + r * n;
  int64_t* pr = pos + r * n;
  int64_t m = 0;
  double tau = 0.0, dl = 0.0;
  const bool ok = solve_row(x + r * n, n, lam[r], xsr, yr, pr, m, tau);
  for (int64_t j = 0; j < n; ++j) d[j] = static_cast<scalar_t>(ok ? 0.0 : CUDART_NAN);
  if (ok && m > 0) {
    for (int64_t i = 0; i < m; ++i) xsr[i] = static_cast<double>(gr[pr[i]]);  // (the gradient, compacted)
    math::sparsemax_vjp(yr, tau, xsr, m, xsr);
    dl = math::fusedmax_vjp(yr, xsr, m, tau, dr);
    for (int64_t i = 0; i < m; ++i) d[pr[i]] = static_cast<scalar_t>(dr[i]);
  }
  if (dlam) dlam[r] = ok ? dl : CUDART_NAN;
}

void check_cuda_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "attnkern.fusedmax: ", name, " must be a CUDA tensor");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "attnkern.fusedmax: ", name, " must be floating point, got ",
              t.scalar_type());
}

// x with `dim` last, contiguous (rows x n), and λ per row in double, checked.
struct Rows {
  Tensor x, lam;
  int64_t dim, rows, n;
};

Rows prepare(const Tensor& x_in, const Tensor& lam_in, int64_t dim) {
  check_cuda_float(x_in, "x");
  TORCH_CHECK(lam_in.device() == x_in.device(), "attnkern.fusedmax: lam must be on x's device");
  Rows r;
  r.dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  r.lam = cpu::per_row(lam_in, x_in, r.dim, at::kDouble);
  TORCH_CHECK_VALUE(r.lam.numel() == 0 || (r.lam >= 0).logical_and(r.lam.isfinite()).all().item<bool>(),
                    "attnkern: fusedmax lam must be finite and >= 0");
  r.x = rows_along(x_in, r.dim);
  r.rows = r.x.size(0);
  r.n = r.x.size(1);
  r.lam = (x_in.dim() == 0 ? r.lam.reshape({1}) : r.lam.movedim(r.dim, -1)).contiguous().reshape({-1});
  return r;
}

Tensor fusedmax_forward(const Tensor& x_in, const Tensor& lam_in, int64_t dim) {
  c10::cuda::CUDAGuard guard(x_in.device());
  Rows r = prepare(x_in, lam_in, dim);
  Tensor out = at::empty_like(r.x);
  if (r.x.numel() == 0) return restore_rows(out, x_in, r.dim);
  const int64_t chunk = chunk_rows(r.rows, kScratchPerEntry * r.n);
  auto dopt = r.x.options().dtype(at::kDouble);
  Tensor xs = at::empty({chunk, r.n}, dopt), y = at::empty({chunk, r.n}, dopt);
  Tensor pos = at::empty({chunk, r.n}, r.x.options().dtype(at::kLong));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.x.scalar_type(), "attnkern_fusedmax_fwd_cuda", [&] {
    for_row_chunks(r.rows, chunk, [&](int64_t r0, int64_t rows, int blocks) {
      fusedmax_fwd_kernel<scalar_t><<<blocks, kRowThreads, 0, stream>>>(
          r.x.const_data_ptr<scalar_t>() + r0 * r.n, r.lam.const_data_ptr<double>() + r0,
          out.mutable_data_ptr<scalar_t>() + r0 * r.n, xs.mutable_data_ptr<double>(), y.mutable_data_ptr<double>(),
          pos.mutable_data_ptr<int64_t>(), rows, r.n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return restore_rows(out, x_in, r.dim);
}

std::tuple<Tensor, Tensor> fusedmax_backward(const Tensor& x_in, const Tensor& grad_in, const Tensor& lam_in,
                                             int64_t dim, bool lam_grad) {
  c10::cuda::CUDAGuard guard(x_in.device());
  check_cuda_float(grad_in, "grad");
  TORCH_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), "attnkern: fusedmax_bwd: grad of shape ", grad_in.sizes(),
                    " does not match x of shape ", x_in.sizes());
  Rows r = prepare(x_in, lam_in, dim);
  Tensor g = grad_in.to(x_in.scalar_type());
  g = rows_along(g, r.dim);
  Tensor dx = at::empty_like(r.x);
  Tensor dl = lam_grad ? at::empty({r.rows}, r.x.options().dtype(at::kDouble)) : Tensor();
  if (r.x.numel() > 0) {
    const int64_t chunk = chunk_rows(r.rows, kScratchPerEntry * r.n);
    auto dopt = r.x.options().dtype(at::kDouble);
    Tensor xs = at::empty({chunk, r.n}, dopt), y = at::empty({chunk, r.n}, dopt), dxs = at::empty({chunk, r.n}, dopt);
    Tensor pos = at::empty({chunk, r.n}, r.x.options().dtype(at::kLong));
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.x.scalar_type(), "attnkern_fusedmax_bwd_cuda", [&] {
      for_row_chunks(r.rows, chunk, [&](int64_t r0, int64_t rows, int blocks) {
        fusedmax_bwd_kernel<scalar_t><<<blocks, kRowThreads, 0, stream>>>(
            r.x.const_data_ptr<scalar_t>() + r0 * r.n, g.const_data_ptr<scalar_t>() + r0 * r.n,
            r.lam.const_data_ptr<double>() + r0, dx.mutable_data_ptr<scalar_t>() + r0 * r.n,
            dl.defined() ? dl.mutable_data_ptr<double>() + r0 : nullptr, xs.mutable_data_ptr<double>(),
            y.mutable_data_ptr<double>(), dxs.mutable_data_ptr<double>(), pos.mutable_data_ptr<int64_t>(), rows,
            r.n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  } else if (dl.defined()) {
    dl.zero_();
  }
  // dλ per row, shaped as the CPU kernel returns it: x's shape with size 1 along dim.
  Tensor dlam;
  if (dl.defined()) {
    dlam = x_in.dim() == 0 ? dl.reshape({})
                           : restore_rows(dl.reshape({r.rows, 1}), cpu::per_row(lam_in, x_in, r.dim, at::kDouble), r.dim);
  } else {
    dlam = at::empty({0}, x_in.options().dtype(at::kDouble));
  }
  return {restore_rows(dx, x_in, r.dim), dlam};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CUDA, m) {
  m.impl("fusedmax_fwd", &fusedmax_forward);
  m.impl("fusedmax_bwd", &fusedmax_backward);
}

}  // namespace cuda
}  // namespace attnkern

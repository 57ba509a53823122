// Row-major GEMM on raw pointers for the fused attention kernels.
//
// ATen's own float/double cpublas::gemm overloads forward to the Fortran BLAS
// symbols sgemm_/dgemm_ (MKL in the official wheels), but they are not
// exported from libtorch_cpu. The BLAS symbols themselves are, so we call them
// directly; they are declared weak so that a torch built without an exported
// BLAS still loads this library and falls back to at::mm (slower per call on
// small blocks, same results).
//
// The calls come from inside at::parallel_for and must give the same bits
// whatever the thread count. MKL threads a call by its own counts (on the
// calling thread the one torch.set_num_threads set, on torch's workers its
// global one), and its sums' order follows its thread count, so every call
// runs with MKL's thread-local count set to 1 (MKL_Set_Num_Threads_Local, the
// C entry, which takes its int by value) and restored afterwards: the
// parallelism is ours, and MKL's process-wide settings stay the user's.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));
}

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

namespace detail {

// MKL's thread-local thread count set to 1 for a scope (no-op without MKL).
struct SingleThreadedBlas {
  int saved = 0;
  SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) saved = MKL_Set_Num_Threads_Local(1);
  }
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(saved);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;
};

// MKL picks its kernels by its operands' alignment, and kernels of other
// reduction orders give other bits: an operand that does not start on a
// 64-byte boundary (a view at an odd storage offset) goes to the BLAS as an
// aligned copy with the same layout, so that its bits do not depend on where
// the caller's tensor happens to start. Returns p itself when it is aligned.
template <typename T>
const T* aligned_operand(const T* p, int64_t rows, int64_t cols, int64_t ld, at::Tensor& holder) {
  if (reinterpret_cast<std::uintptr_t>(p) % 64 == 0) return p;
  const int64_t span = (rows - 1) * ld + cols;
  holder = at::empty({span}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));  // 64-byte aligned
  std::copy(p, p + span, holder.data_ptr<T>());
  return holder.data_ptr<T>();
}

template <typename T>
at::Tensor wrap(const T* p, int64_t rows, int64_t cols, int64_t ld, bool trans) {
  auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  // Stored row-major as (rows x cols) when not transposed, (cols x rows) when transposed.
  if (!trans) return at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1}, opts);
  return at::from_blob(const_cast<T*>(p), {cols, rows}, {ld, 1}, opts).t();
}

}  // namespace detail

// C (M x N, row stride ldc) = alpha * op(A) * op(B) + beta * C, all row-major:
// op(A) is M x K (A stored K x M when trans_a), op(B) is K x N (B stored
// N x K when trans_b). beta = 0 ignores C's previous contents (even NaN).
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  // Column-major BLAS on row-major data: C^T = op(B)^T op(A)^T.
  const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  detail::SingleThreadedBlas one_thread;
  at::Tensor a_copy, b_copy;
  if ((std::is_same_v<T, float> && sgemm_ != nullptr) || (std::is_same_v<T, double> && dgemm_ != nullptr)) {
    A = detail::aligned_operand(A, trans_a ? K : M, trans_a ? M : K, lda, a_copy);
    B = detail::aligned_operand(B, trans_b ? N : K, trans_b ? K : N, ldb, b_copy);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_ != nullptr) {
      sgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
      return;
    }
  } else if constexpr (std::is_same_v<T, double>) {
    if (dgemm_ != nullptr) {
      dgemm_(&ta, &tb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
      return;
    }
  }
  at::Tensor a = detail::wrap(A, M, K, lda, trans_a);
  at::Tensor b = detail::wrap(B, K, N, ldb, trans_b);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  if (beta == T(0)) {
    at::mm_out(c, a, b);
    if (alpha != T(1)) c.mul_(alpha);
  } else {
    c.addmm_(a, b, beta, alpha);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

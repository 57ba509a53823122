// Register-blocked GEMM for the tiles of the fused softmax attention.
//
// Every product the softmax forward and backward form (S = Q·Kᵀ, O += P·V,
// dP = dO·Vᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K) is C (M x N) (+)=
// alpha · A (M x K) · B (K x N) where
//   - A is read one element at a time (broadcast), at A[i * ars + k * aks],
//     so a transposed operand (Pᵀ, dSᵀ) costs nothing: swap the strides;
//   - B is read as panels of kPanel<T> contiguous columns: row k of panel p at
//     B + p * bps + k * bs. A row-major matrix whose width is a multiple of the
//     panel is its own panel layout (bs = row stride, bps = kPanel); K and V
//     are packed once per head into key panels (pack_panels) for Q·Kᵀ and
//     dO·Vᵀ, so no product repacks its operands as a BLAS call would (MKL's
//     packing was 12-15% of the attention's time).
// N must be a multiple of kPanel<T> (the callers pad head dims once).
//
// The micro-kernel keeps a kRows x kPanel block of C in registers (12 of the
// 16 AVX2 registers, 16 of the 32 AVX-512 ones), one FMA per broadcast and
// loaded vector; the driver loops over B panels outside and row strips
// inside, so a float panel (K x kPanel: 64·K bytes on AVX2, 128·K on
// AVX-512, 8 / 16 KiB at K = 128) stays in L1 while A streams from L2.
#pragma once

#include "attnkern/isa_features.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if ATTNKERN_HAS(AVX2) && ATTNKERN_HAS(GNU_EXTENSIONS)
#include <immintrin.h>
#endif

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

template <typename T>
inline constexpr int64_t kPanel = 2 * at::vec::Vectorized<T>::size();
// Rows of C a micro-kernel call keeps in registers (2 vectors each): 6 on
// AVX2 (12 of its 16 vector registers), 8 on AVX-512 (16 of 32).
inline constexpr int kMaxRows = 8;
#if ATTNKERN_HAS(AVX512)
inline constexpr int kRows = 8;
#else
inline constexpr int kRows = 6;
#endif

template <typename T>
inline int64_t round_up_panel(int64_t n) {
  return (n + kPanel<T> - 1) / kPanel<T> * kPanel<T>;
}

namespace detail {

template <typename T, int MR>
inline void micro_kernel(int64_t K, const T* __restrict A, int64_t ars, int64_t aks, const T* __restrict B,
                         int64_t bs, T* C, int64_t cs, T alpha, bool accumulate) {
  using V = at::vec::Vectorized<T>;
  constexpr int W = V::size();
  V c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    c0[r] = V(T(0));
    c1[r] = V(T(0));
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const V b0 = V::loadu(B + k * bs), b1 = V::loadu(B + k * bs + W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V a(A[r * ars + k * aks]);
      c0[r] = at::vec::fmadd(a, b0, c0[r]);
      c1[r] = at::vec::fmadd(a, b1, c1[r]);
    }
  }
  const V va(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    V x0 = c0[r] * va, x1 = c1[r] * va;
    if (accumulate) {
      x0 = x0 + V::loadu(C + r * cs);
      x1 = x1 + V::loadu(C + r * cs + W);
    }
    x0.store(C + r * cs);
    x1.store(C + r * cs + W);
  }
}

#if ATTNKERN_HAS(AVX2) && ATTNKERN_HAS(GNU_EXTENSIONS)
#define ATTNKERN_REG_GEMM 1
// AVX2 and AVX-512, float and double: the same kernel with the accumulators
// as named register values: GCC keeps those in registers, but arrays of
// Vectorized<T> objects in stack memory inside the extension, storing them
// back on every k step and zeroing them with rep stos at every call.
template <typename R>
struct Regs;
#if ATTNKERN_HAS(AVX512)
template <>
struct Regs<float> {
  using reg = __m512;
  static constexpr int W = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
};
template <>
struct Regs<double> {
  using reg = __m512d;
  static constexpr int W = 8;
  static reg zero() { return _mm512_setzero_pd(); }
  static reg bcast(const double* p) { return _mm512_set1_pd(*p); }
  static reg set1(double x) { return _mm512_set1_pd(x); }
  static reg load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, reg x) { _mm512_storeu_pd(p, x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_pd(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_pd(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_pd(a, b); }
};
#else
template <>
struct Regs<float> {
  using reg = __m256;
  static constexpr int W = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
};
template <>
struct Regs<double> {
  using reg = __m256d;
  static constexpr int W = 4;
  static reg zero() { return _mm256_setzero_pd(); }
  static reg bcast(const double* p) { return _mm256_broadcast_sd(p); }
  static reg set1(double x) { return _mm256_set1_pd(x); }
  static reg load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, reg x) { _mm256_storeu_pd(p, x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_pd(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_pd(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_pd(a, b); }
};
#endif

template <typename T, int MR>
inline void micro_kernel_regs(int64_t K, const T* __restrict A, int64_t ars, int64_t aks, const T* __restrict B,
                              int64_t bs, T* C, int64_t cs, T alpha, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMaxRows, "rows");
  using X = Regs<T>;
  using reg = typename X::reg;
#define ATTNKERN_ACC(r) reg c##r##0 = X::zero(), c##r##1 = X::zero();
  ATTNKERN_ACC(0) ATTNKERN_ACC(1) ATTNKERN_ACC(2) ATTNKERN_ACC(3) ATTNKERN_ACC(4) ATTNKERN_ACC(5)
  ATTNKERN_ACC(6) ATTNKERN_ACC(7)
#undef ATTNKERN_ACC
#define ATTNKERN_ROW(r)                                   \
  if constexpr (MR > r) {                                 \
    const reg a = X::bcast(A + r * ars + k * aks);        \
    c##r##0 = X::fma(a, b0, c##r##0);                     \
    c##r##1 = X::fma(a, b1, c##r##1);                     \
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const reg b0 = X::load(B + k * bs), b1 = X::load(B + k * bs + X::W);
    ATTNKERN_ROW(0)
    ATTNKERN_ROW(1)
    ATTNKERN_ROW(2)
    ATTNKERN_ROW(3)
    ATTNKERN_ROW(4)
    ATTNKERN_ROW(5)
    ATTNKERN_ROW(6)
    ATTNKERN_ROW(7)
  }
#undef ATTNKERN_ROW
  const reg va = X::set1(alpha);
#define ATTNKERN_STORE(r)                                                   \
  if constexpr (MR > r) {                                                   \
    reg x0 = X::mul(c##r##0, va), x1 = X::mul(c##r##1, va);                 \
    if (accumulate) {                                                       \
      x0 = X::add(x0, X::load(C + r * cs));                                 \
      x1 = X::add(x1, X::load(C + r * cs + X::W));                          \
    }                                                                       \
    X::store(C + r * cs, x0);                                               \
    X::store(C + r * cs + X::W, x1);                                        \
  }
  ATTNKERN_STORE(0)
  ATTNKERN_STORE(1)
  ATTNKERN_STORE(2)
  ATTNKERN_STORE(3)
  ATTNKERN_STORE(4)
  ATTNKERN_STORE(5)
  ATTNKERN_STORE(6)
  ATTNKERN_STORE(7)
#undef ATTNKERN_STORE
}
#endif

template <typename T>
inline void micro_kernel_rows(int rows, int64_t K, const T* A, int64_t ars, int64_t aks, const T* B, int64_t bs,
                              T* C, int64_t cs, T alpha, bool accumulate) {
#define ATTNKERN_CASE(kernel, r) \
  case r: return kernel<T, r>(K, A, ars, aks, B, bs, C, cs, alpha, accumulate);
#if defined(ATTNKERN_REG_GEMM)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    static_assert(kPanel<T> == 2 * Regs<T>::W, "panel width");
    switch (rows) {
      ATTNKERN_CASE(micro_kernel_regs, 8)
      ATTNKERN_CASE(micro_kernel_regs, 7)
      ATTNKERN_CASE(micro_kernel_regs, 6)
      ATTNKERN_CASE(micro_kernel_regs, 5)
      ATTNKERN_CASE(micro_kernel_regs, 4)
      ATTNKERN_CASE(micro_kernel_regs, 3)
      ATTNKERN_CASE(micro_kernel_regs, 2)
      default: return micro_kernel_regs<T, 1>(K, A, ars, aks, B, bs, C, cs, alpha, accumulate);
    }
  }
#endif
  switch (rows) {
    ATTNKERN_CASE(micro_kernel, 8)
    ATTNKERN_CASE(micro_kernel, 7)
    ATTNKERN_CASE(micro_kernel, 6)
    ATTNKERN_CASE(micro_kernel, 5)
    ATTNKERN_CASE(micro_kernel, 4)
    ATTNKERN_CASE(micro_kernel, 3)
    ATTNKERN_CASE(micro_kernel, 2)
    default: return micro_kernel<T, 1>(K, A, ars, aks, B, bs, C, cs, alpha, accumulate);
  }
#undef ATTNKERN_CASE
}

}  // namespace detail

// C (M x N, row stride cs) = alpha · A · B, or += with `accumulate`; see the
// file comment for the A and B layouts. N % kPanel<T> == 0. K == 0 gives
// alpha · 0 (C = 0, or C unchanged with `accumulate`).
template <typename T>
void tile_gemm(int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t ars, int64_t aks, const T* B,
               int64_t bs, int64_t bps, T* C, int64_t cs, bool accumulate) {
  constexpr int64_t NR = kPanel<T>;
  for (int64_t p = 0; p < N / NR; ++p) {
    const T* bp = B + p * bps;
    for (int64_t i = 0; i < M; i += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, M - i));
      detail::micro_kernel_rows<T>(rows, K, A + i * ars, ars, aks, bp, bs, C + i * cs + p * NR, cs, alpha,
                                   accumulate);
    }
  }
}

// Loads one value of every cache line of rows [0, w) of src (d values a row,
// row stride ld) in memory order, the values discarded. pack_panels'
// transposes read a panel's rows a vector of each at a time, an order no
// hardware prefetcher follows; run through in order first, the panel comes
// in at streaming speed and the transposes find it in L1.
template <typename T>
inline void read_in_order(const T* src, int64_t w, int64_t d, int64_t ld) {
#if ATTNKERN_HAS(GNU_EXTENSIONS)
  constexpr int64_t kLineValues = 64 / static_cast<int64_t>(sizeof(T));
  using Bits = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>>;
  const int64_t span = ld == d ? w * d : d;  // (contiguous rows: one run)
  for (int64_t j = 0; j < (ld == d ? 1 : w); ++j)
    for (int64_t e = 0; e < span; e += kLineValues) {
      Bits x;
      std::memcpy(&x, src + j * ld + e, sizeof(x));
      asm volatile("" : : "r"(x));  // (the load stays; nothing else happens)
    }
#endif
}

// Packs the rows of src (n x d, row stride ld) into key panels: panel p holds
// rows [p·kPanel, (p+1)·kPanel) transposed, as d rows of kPanel entries
// (dst[p·d·kPanel + e·kPanel + jj] = src[(p·kPanel + jj)·ld + e]), zero past
// row n. dst has round_up_panel(n) · d entries. Then Q·Kᵀ is tile_gemm with
// B = dst, bs = kPanel, bps = d·kPanel.
// Whole panels go as square blocks of a vector's width through ATen's
// register transposes (float: 16 x 16 on AVX-512, 8 x 8 on AVX2), which move
// a vector at a time where an entry-by-entry gather moves one value; the
// rest entry by entry.
template <typename T>
void pack_panels(const T* src, int64_t n, int64_t d, int64_t ld, T* dst) {
  constexpr int64_t NR = kPanel<T>;
  constexpr int TB = static_cast<int>(at::vec::Vectorized<T>::size());  // NR = 2·TB
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    T* panel = dst + j0 * d;
    const int64_t w = std::min(NR, n - j0);
    read_in_order(src + j0 * ld, w, d, ld);
    int64_t e0 = 0;
    if (w == NR)
      for (; e0 + TB <= d; e0 += TB)
        for (int64_t jb = 0; jb < NR; jb += TB)
          at::vec::transpose_mxn<T, TB, TB>(src + (j0 + jb) * ld + e0, ld, panel + e0 * NR + jb, NR);
    for (int64_t e = e0; e < d; ++e) {
      T* row = panel + e * NR;
      for (int64_t jj = 0; jj < w; ++jj) row[jj] = src[(j0 + jj) * ld + e];
      for (int64_t jj = w; jj < NR; ++jj) row[jj] = T(0);
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

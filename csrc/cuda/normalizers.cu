// Row-wise softmax / sparsemax / entmax15 / α-entmax on CUDA, forward and
// backward. Same semantics as csrc/cpu/normalizers.cpp; the scalar math is
// attnkern/entmax_math.h, shared with (and tested through) the CPU kernels.
//
// A contiguous tensor is seen as rows (outer, n, inner): row r starts at
// (r / inner)·n·inner + r % inner and has stride inner. A group of threads
// cooperates on one row:
//   - one thread per row when the rows are interleaved (inner >= 32) and
//     there are many of them: neighbouring threads then read neighbouring
//     addresses, and no reduction is needed;
//   - one warp per row for n <= kWarpMaxN;
//   - one block per row for longer rows.
// The per-row algorithm is written once against a small group interface
// (lane, size, sum, max, leader), so the three layouts run the same code.
//
// Forward: the row max, then the shift c of attnkern/entmax_math.h by
// safeguarded Newton steps inside the bracket [0, entmax_shift_upper] (scores
// relative to the max), each step one pass with three reductions (Σp, Σg and
// the support size, which sets the convergence tolerance as the CPU's
// candidate count does).
// Rows are re-read from global memory on every pass (they stay in L1/L2);
// sparsemax and entmax15 finish with their closed form on the support found
// at the bracket's left end, falling back to the Newton shift renormalized.
// Backward: g from p, two reductions (Σg, Σg·dp), dx = g (dp - Σg dp / Σg),
// plus seven reductions in double for the gradient in α.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attnkern/entmax_edge.h"
#include "attnkern/entmax_math.h"
#include "attnkern/row_layout.h"

namespace attnkern {
namespace cuda {
namespace {

using at::Tensor;
using math::Family;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;
// Same cap as the CPU kernels; Newton needs 3-11 steps on ordinary rows, the
// bisection fallback at most a few dozen.
constexpr int kMaxIterations = 200;

// NaN-propagating max: any NaN in a row makes its max NaN.
template <typename T>
__host__ __device__ __forceinline__ T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// ---------------------------------------------------------------------------
// Per-row algorithms. Every thread of a group runs these with the same row;
// thread `lane()` of `size()` handles entries lane, lane + size, ... Branches
// depend only on reduced values, which every thread of the group receives
// bit for bit identical, so control flow is uniform across the group (the
// warp shuffles and __syncthreads in the reductions need that).
// ---------------------------------------------------------------------------

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ acc_t load_acc(const scalar_t* __restrict__ x, int64_t j, int64_t stride) {
  return static_cast<acc_t>(x[j * stride]);
}

template <typename acc_t, typename scalar_t, typename G>
__device__ acc_t row_max(const G& grp, const scalar_t* __restrict__ x, int64_t n, int64_t stride) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  for (int64_t j = grp.lane(); j < n; j += grp.size()) m = nan_max(m, load_acc<acc_t>(x, j, stride));
  return grp.max(m);
}

// Σ exp(x - m) over the row.
template <typename acc_t, typename scalar_t, typename G>
__device__ acc_t row_sum_exp(const G& grp, const scalar_t* __restrict__ x, int64_t n, int64_t stride, acc_t m) {
  acc_t s[1] = {acc_t(0)};
  for (int64_t j = grp.lane(); j < n; j += grp.size()) s[0] += std::exp(load_acc<acc_t>(x, j, stride) - m);
  grp.template sum<1>(s);
  return s[0];
}

// Σ φ(y - c), Σ g and the support size at c over the row, y = x - m.
template <typename acc_t, Family FAM, typename scalar_t, typename G>
__device__ void eval_shift(const G& grp, const scalar_t* __restrict__ x, int64_t n, int64_t stride, acc_t m,
                           acc_t c, acc_t b, acc_t& sum_p, acc_t& sum_g, acc_t& support) {
  acc_t s[3] = {acc_t(0), acc_t(0), acc_t(0)};
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const acc_t t = (load_acc<acc_t>(x, j, stride) - m) - c;
    const acc_t p = math::entmax_phi<acc_t>(t, b, FAM);
    if (p > acc_t(0)) {
      s[0] += p;
      if constexpr (FAM == Family::kGeneric) {
        // g = p^(2-α) = p / (1 + b t), as the CPU's vectorized path: one
        // division instead of a log and an exp.
        s[1] += p / (acc_t(1) + b * t);
      } else {
        s[1] += math::entmax_g_from_p<acc_t>(p, b, FAM);
      }
      s[2] += acc_t(1);
    }
  }
  grp.template sum<3>(s);
  sum_p = s[0];
  sum_g = s[1];
  support = s[2];
}

// Closed-form shift of sparsemax/entmax15 on the support at `lo`, a point
// left of the root (Σp >= 1 there): that support contains the true one, and
// equals it when every entry stays positive at the closed-form shift (the
// smallest entry is checked; φ is monotone). Returns NaN otherwise.
template <typename acc_t, Family FAM, typename scalar_t, typename G>
__device__ acc_t exact_shift(const G& grp, const scalar_t* __restrict__ x, int64_t n, int64_t stride, acc_t m,
                             acc_t lo, acc_t b) {
  static_assert(FAM == Family::kSparsemax || FAM == Family::kEntmax15, "closed form for α = 2 and 1.5 only");
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  long long k[1] = {0};
  acc_t sum_y[1] = {acc_t(0)};
  acc_t neg_min = -std::numeric_limits<acc_t>::infinity();  // -(min y on the support)
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const acc_t y = load_acc<acc_t>(x, j, stride) - m;
    if (math::entmax_phi<acc_t>(y - lo, b, FAM) > acc_t(0)) {
      k[0] += 1;
      sum_y[0] += y;
      neg_min = nan_max(neg_min, -y);
    }
  }
  grp.template sum<1>(k);
  grp.template sum<1>(sum_y);
  const acc_t y_min = -grp.max(neg_min);
  if (k[0] <= 0) return nan;
  acc_t c;
  if constexpr (FAM == Family::kSparsemax) {
    c = math::sparsemax_shift_on_support<acc_t>(sum_y[0], k[0]);
  } else {
    // a = 1 + y/2: mean and population variance, two-pass.
    const acc_t mean_y = sum_y[0] / acc_t(k[0]);
    acc_t ss[1] = {acc_t(0)};
    for (int64_t j = grp.lane(); j < n; j += grp.size()) {
      const acc_t y = load_acc<acc_t>(x, j, stride) - m;
      if (math::entmax_phi<acc_t>(y - lo, b, FAM) > acc_t(0)) {
        const acc_t d = y - mean_y;
        ss[0] += d * d;
      }
    }
    grp.template sum<1>(ss);
    const acc_t var_a = acc_t(0.25) * ss[0] / acc_t(k[0]);
    const acc_t mean_a = acc_t(1) + acc_t(0.5) * mean_y;
    c = math::entmax15_shift_on_support<acc_t>(mean_a, var_a, k[0]);
    if (c != c) return nan;
  }
  if (!(math::entmax_phi<acc_t>(y_min - c, b, FAM) > acc_t(0))) return nan;
  return c;
}

template <typename acc_t>
struct Shift {
  acc_t c;     // p = norm · φ(x - m - c)
  acc_t norm;  // 1, or 1 / Σp when the shift is only known to the dtype's resolution
};

// The shift of one row whose max m is finite.
template <typename acc_t, Family FAM, typename scalar_t, typename G>
__device__ Shift<acc_t> find_shift(const G& grp, const scalar_t* __restrict__ x, int64_t n, int64_t stride,
                                   acc_t m, acc_t b) {
  if constexpr (FAM == Family::kSoftmax) {
    return {std::log(row_sum_exp<acc_t>(grp, x, n, stride, m)), acc_t(1)};
  } else {
    acc_t lo = 0, hi = math::entmax_shift_upper<acc_t>(n, b);
    acc_t c = 0;
    if constexpr (FAM == Family::kGeneric) {
      // Near softmax, Newton from the max needs about ln(n) steps; the
      // log-sum-exp bounds the root from the correct side (b < 0: left;
      // b > 0: right) and cuts that to a few (as the CPU kernels).
      if (b < acc_t(0.25)) {
        const acc_t lse = std::log(row_sum_exp<acc_t>(grp, x, n, stride, m));
        if (b < acc_t(0)) {
          lo = lo > lse ? lo : lse;
        } else {
          hi = hi < lse ? hi : lse;
        }
        c = lse < hi ? lse : hi;
        c = c > lo ? c : lo;
      }
    }
    acc_t sum_p = 0, sum_g = 0, support = 0;
    for (int it = 1;; ++it) {
      eval_shift<acc_t, FAM>(grp, x, n, stride, m, c, b, sum_p, sum_g, support);
      if (sum_p >= acc_t(1)) {
        lo = c;
      } else {
        hi = c;
      }
      // The tolerance grows with the number of terms summed: the support,
      // as the CPU's compacted candidate list (not n, which would stop
      // Newton early on long rows with a small support).
      const int64_t terms = support >= acc_t(1) ? static_cast<int64_t>(support) : int64_t(1);
      if (math::entmax_converged<acc_t>(sum_p, lo, hi, terms) || it >= kMaxIterations) break;
      const acc_t next = math::entmax_newton_update<acc_t>(c, sum_p, sum_g, lo, hi);
      if (next == c) break;  // below the dtype's resolution
      c = next;
    }
    // sum_p is Σp at c here: every exit follows an evaluation at c.
    Shift<acc_t> s{c, sum_p > acc_t(0) ? acc_t(1) / sum_p : acc_t(1)};
    if constexpr (FAM == Family::kSparsemax || FAM == Family::kEntmax15) {
      const acc_t ce = exact_shift<acc_t, FAM>(grp, x, n, stride, m, lo, b);
      if (ce == ce) s = {ce, acc_t(1)};
    }
    return s;
  }
}

// Sparsemax's threshold θ (p = [z - θ]_+) in double, as the CPU kernels
// keep it: p formed as 1 + (z - m) - c would round every entry at the scale
// of 1. Michelot's steps θ <- (Σ_(z > θ) z - 1) / |{z > θ}| from a point left
// of θ only grow and stop at θ, each a pass; they start from the converged
// shift c (θ = m + c - 1) nudged left by its rounding, or from m - 1 (always
// left: the max entry alone has p <= 1) if that start was not left.
template <typename acc_t, typename scalar_t, typename G>
__device__ double sparsemax_threshold(const G& grp, const scalar_t* __restrict__ x, int64_t n, int64_t stride,
                                      acc_t m, acc_t c) {
  const double md = m, cd = c;
  double theta = md + (cd - 1.0) - 16.0 * std::numeric_limits<acc_t>::epsilon() * (1.0 + std::fabs(cd));
  if (!(theta >= md - 1.0)) theta = md - 1.0;
  for (int it = 0; it < kMaxIterations; ++it) {
    double s[2] = {0.0, 0.0};  // Σ (z - m), count, over z > θ
    for (int64_t j = grp.lane(); j < n; j += grp.size()) {
      const double z = static_cast<double>(load_acc<acc_t>(x, j, stride));
      if (z > theta) {
        s[0] += z - md;
        s[1] += 1.0;
      }
    }
    grp.template sum<2>(s);
    const double next = md + (s[0] - 1.0) / s[1];
    if (next < theta && it == 0 && theta > md - 1.0) {
      theta = md - 1.0;  // the start was right of θ: from the safe one
      continue;
    }
    if (!(next > theta)) break;
    theta = next;
  }
  return theta;
}

template <typename acc_t, Family FAM, typename scalar_t, typename G>
__device__ void forward_row(const G& grp, const scalar_t* __restrict__ x, scalar_t* __restrict__ out, int64_t n,
                            int64_t stride, acc_t b) {
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t m = row_max<acc_t>(grp, x, n, stride);
  if (m != m || m == inf || m == -inf) {
    // NaN or +inf in the row: NaN (as torch.softmax). Every entry -inf
    // (fully masked): no support, zeros.
    const scalar_t fill = static_cast<scalar_t>(m == -inf ? acc_t(0) : std::numeric_limits<acc_t>::quiet_NaN());
    for (int64_t j = grp.lane(); j < n; j += grp.size()) out[j * stride] = fill;
    return;
  }
  const Shift<acc_t> s = find_shift<acc_t, FAM>(grp, x, n, stride, m, b);
  const auto score = [&](int64_t j) { return static_cast<double>(load_acc<acc_t>(x, j, stride)); };
  if constexpr (FAM == Family::kSparsemax) {
    const double theta = sparsemax_threshold<acc_t>(grp, x, n, stride, m, s.c);
    for (int64_t j = grp.lane(); j < n; j += grp.size()) {
      const double p = score(j) - theta;
      out[j * stride] = static_cast<scalar_t>(p > 0.0 ? p : 0.0);
    }
  } else {
    if constexpr (FAM == Family::kGeneric) {
      if (b > acc_t(1)) {
        // α > 2: in p-space (attnkern/entmax_edge.h), the shift only a hint.
        const double bd = b, md = m, cd = s.c;
        const double tol =
            8.0 * std::numeric_limits<acc_t>::epsilon() * (1.0 + std::fabs(md) + std::fabs(cd) + 1.0 / bd);
        const math::EdgeRow e = math::edge_solve(grp, score, n, md, bd, md + cd - 1.0 / bd, tol);
        for (int64_t j = grp.lane(); j < n; j += grp.size())
          out[j * stride] = static_cast<scalar_t>(math::edge_prob(e, score(j), bd));
        return;
      }
    }
    for (int64_t j = grp.lane(); j < n; j += grp.size()) {
      const acc_t y = load_acc<acc_t>(x, j, stride) - m;
      out[j * stride] = static_cast<scalar_t>(s.norm * math::entmax_phi<acc_t>(y - s.c, b, FAM));
    }
  }
}

// dx = g (dp - Σg dp / Σg) for one row; returns the row's gradient in α when
// want_alpha (else 0).
template <typename acc_t, Family FAM, typename scalar_t, typename G>
__device__ acc_t backward_row(const G& grp, const scalar_t* __restrict__ p, const scalar_t* __restrict__ dp,
                              scalar_t* __restrict__ dx, int64_t n, int64_t stride, acc_t b, bool want_alpha) {
  bool edge = false;
  if constexpr (FAM == Family::kGeneric) edge = b > acc_t(1);
  acc_t s[3] = {acc_t(0), acc_t(0), acc_t(0)};  // Σg, Σg dp, NaN entries of p
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const acc_t pj = load_acc<acc_t>(p, j, stride);
    if (pj != pj) {
      s[2] += acc_t(1);
    } else if (!edge) {
      const acc_t g = math::entmax_g_from_p<acc_t>(pj, b, FAM);
      s[0] += g;
      s[1] += g * load_acc<acc_t>(dp, j, stride);
    }
  }
  grp.template sum<3>(s);
  if (s[2] > acc_t(0)) {
    // A NaN in p (the forward's NaN row): NaN gradients, as the CPU kernels
    // (g of a NaN p would be 0 for sparsemax and drop it).
    const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    for (int64_t j = grp.lane(); j < n; j += grp.size()) dx[j * stride] = static_cast<scalar_t>(nan);
    return want_alpha ? nan : acc_t(0);
  }
  acc_t dalpha = 0;
  if (want_alpha) {
    // Every reduction of the α gradient in double on the renormalized row
    // (math::AlphaGradSums): the general formula cancels two O(1/b) terms.
    const double bd = static_cast<double>(b);
    math::AlphaGradSums a;
    for (int64_t j = grp.lane(); j < n; j += grp.size())
      a.add(static_cast<double>(load_acc<acc_t>(p, j, stride)), static_cast<double>(load_acc<acc_t>(dp, j, stride)),
            bd);
    double r[math::AlphaGradSums::kCount];
    a.to_array(r);
    grp.template sum<math::AlphaGradSums::kCount>(r);
    a.from_array(r);
    dalpha = static_cast<acc_t>(a.grad(bd));
  }
  if (edge) {
    // α > 2: in double, relative to a pivot (math::edge_vjp says why).
    math::edge_vjp(
        grp, n, [&](int64_t j) { return static_cast<double>(load_acc<acc_t>(p, j, stride)); },
        [&](int64_t j) { return static_cast<double>(load_acc<acc_t>(dp, j, stride)); },
        [&](int64_t j, double v) { dx[j * stride] = static_cast<scalar_t>(v); }, static_cast<double>(b));
    return dalpha;
  }
  const acc_t mean = s[0] > acc_t(0) ? s[1] / s[0] : acc_t(0);
  for (int64_t j = grp.lane(); j < n; j += grp.size()) {
    const acc_t g = math::entmax_g_from_p<acc_t>(load_acc<acc_t>(p, j, stride), b, FAM);
    dx[j * stride] = static_cast<scalar_t>(g * (load_acc<acc_t>(dp, j, stride) - mean));
  }
  return dalpha;
}

// ---------------------------------------------------------------------------
// Thread groups. Each knows its lane, its size, which rows it takes (a
// grid-stride loop, so any number of rows fits a bounded grid) and how to
// reduce across itself. Reductions leave the result in every thread.
// ---------------------------------------------------------------------------

enum class Strategy : int { kThread = 0, kWarp = 1, kBlock = 2 };

// XOR butterfly: every lane ends with the same bits (IEEE addition is
// commutative, so lanes i and i^k add the same two numbers). Needs all 32
// lanes of the warp converged here.
template <int N, typename T>
__device__ __forceinline__ void warp_sum(T* v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] += __shfl_xor_sync(kFullMask, v[k], offset);
  }
}

// nan_max is not commutative for ±0 and NaN payloads: broadcast lane 0's
// result so that every lane branches alike on it.
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = nan_max(v, __shfl_xor_sync(kFullMask, v, offset));
  return __shfl_sync(kFullMask, v, 0);
}

// One thread per row: nothing to reduce (the CPU kernels' SerialLanes).
struct ThreadGroup : math::SerialLanes {
  __device__ bool leader() const { return true; }
  __device__ int64_t first_row() const {
    return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  __device__ int64_t row_step() const { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
};

// blockDim.x is a multiple of 32; warp w of the block takes its own rows.
struct WarpGroup {
  __device__ int lane() const { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }
  __device__ int size() const { return kWarpSize; }
  __device__ bool leader() const { return lane() == 0; }
  __device__ int64_t first_row() const {
    return static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  }
  __device__ int64_t row_step() const { return static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize); }
  template <int N, typename T>
  __device__ void sum(T* v) const {
    warp_sum<N>(v);
  }
  template <typename T>
  __device__ T max(T v) const {
    return warp_max(v);
  }
};

// The most values one reduction of a block sums at once: the α gradient's row
// sums (math::AlphaGradSums). The block's shared scratch holds that many per warp.
constexpr int kMaxReduced = math::AlphaGradSums::kCount;
constexpr int kScratchDoubles = kMaxReduced * kWarpSize;

// The whole block on one row; blockDim.x is a multiple of 32, at most 1024.
// scratch: shared memory for N·32 values of the widest reduced type.
struct BlockGroup {
  void* scratch;

  __device__ int lane() const { return static_cast<int>(threadIdx.x); }
  __device__ int size() const { return static_cast<int>(blockDim.x); }
  __device__ bool leader() const { return threadIdx.x == 0; }
  __device__ int64_t first_row() const { return blockIdx.x; }
  __device__ int64_t row_step() const { return gridDim.x; }

  // Each warp reduces itself, lane 0 of each warp posts its partial, then
  // every warp reduces all the partials the same way, so every thread gets
  // the same bits without a third barrier. The leading barrier keeps this
  // call's writes from overtaking the previous call's reads.
  template <int N, typename T>
  __device__ void sum(T* v) const {
    static_assert(N <= kMaxReduced && sizeof(T) <= sizeof(double), "wider than the block's scratch");
    T* s = static_cast<T*>(scratch);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int warps = blockDim.x / kWarpSize;
    warp_sum<N>(v);
    __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < N; ++k) s[k * kWarpSize + warp] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = lane < warps ? s[k * kWarpSize + lane] : T(0);
    warp_sum<N>(v);
  }

  template <typename T>
  __device__ T max(T v) const {
    T* s = static_cast<T*>(scratch);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int warps = blockDim.x / kWarpSize;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = lane < warps ? s[lane] : -std::numeric_limits<T>::infinity();
    return warp_max(v);
  }
};

template <Strategy S>
__device__ __forceinline__ auto make_group(double* scratch) {
  if constexpr (S == Strategy::kThread) {
    return ThreadGroup{};
  } else if constexpr (S == Strategy::kWarp) {
    return WarpGroup{};
  } else {
    return BlockGroup{scratch};
  }
}

// ---------------------------------------------------------------------------
// Kernels. One kernel per (dtype, layout, direction); the family is chosen per
// row at run time (uniform within the group): from alpha[r] when alpha is
// given (entmax_*), else the fixed family of the op.
// ---------------------------------------------------------------------------

struct RowsArgs {
  int64_t rows, n, inner;
};

__device__ __forceinline__ int64_t row_base(int64_t r, const RowsArgs& a) {
  return (r / a.inner) * a.n * a.inner + r % a.inner;
}

// b = α - 1 of row r and its family: from alpha[r] when alpha is given, else
// the fixed family of the op.
template <typename acc_t>
__device__ __forceinline__ Family row_family(const acc_t* __restrict__ alpha, int64_t r, Family fixed, acc_t& b) {
  if (alpha == nullptr) {
    b = math::fixed_b<acc_t>(fixed);
    return fixed;
  }
  b = alpha[r] - acc_t(1);
  return math::family_of<acc_t>(b);
}

template <typename scalar_t, typename acc_t, Strategy S>
__device__ __forceinline__ void forward_rows(const scalar_t* __restrict__ x, scalar_t* __restrict__ out,
                                             const acc_t* __restrict__ alpha, Family fixed, RowsArgs a,
                                             double* scratch) {
  const auto grp = make_group<S>(scratch);
  for (int64_t r = grp.first_row(); r < a.rows; r += grp.row_step()) {
    const int64_t base = row_base(r, a);
    acc_t b;
    const Family fam = row_family(alpha, r, fixed, b);
    // fixed b for the fixed families (α = 1 runs as softmax), b itself otherwise
    math::with_family(fam, [&](auto tag) {
      constexpr Family F = decltype(tag)::value;
      const acc_t bf = F == Family::kGeneric ? b : math::fixed_b<F, acc_t>();
      forward_row<acc_t, F>(grp, x + base, out + base, a.n, a.inner, bf);
    });
  }
}

template <typename scalar_t, typename acc_t, Strategy S>
__device__ __forceinline__ void backward_rows(const scalar_t* __restrict__ p, const scalar_t* __restrict__ dp,
                                              scalar_t* __restrict__ dx, const acc_t* __restrict__ alpha,
                                              acc_t* __restrict__ dalpha, Family fixed, RowsArgs a,
                                              double* scratch) {
  const auto grp = make_group<S>(scratch);
  const bool want_alpha = dalpha != nullptr;
  for (int64_t r = grp.first_row(); r < a.rows; r += grp.row_step()) {
    const int64_t base = row_base(r, a);
    acc_t b;
    const Family fam = row_family(alpha, r, fixed, b);
    // At α = 1 the forward was softmax; the α gradient still gets
    // the true b (and uses the softmax-limit derivative there).
    const acc_t da = math::with_family(fam, [&](auto tag) {
      return backward_row<acc_t, decltype(tag)::value>(grp, p + base, dp + base, dx + base, a.n, a.inner, b,
                                                         want_alpha);
    });
    if (want_alpha && grp.leader()) dalpha[r] = da;
  }
}

constexpr int kThreadBlock = 256;  // threads per block, one thread per row
constexpr int kWarpBlock = 256;    // threads per block, one warp per row
constexpr int kMaxRowBlock = 512;  // most threads per block, one block per row
constexpr int64_t kWarpMaxN = 1024;
constexpr int64_t kThreadMaxN = 4096;

#define AK_NORMALIZER_KERNELS(STRATEGY, NAME, BOUND)                                                          \
  template <typename scalar_t, typename acc_t>                                                                \
  __global__ void __launch_bounds__(BOUND)                                                                    \
      NAME##_fwd_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out,                           \
                        const acc_t* __restrict__ alpha, Family fixed, RowsArgs a) {                          \
    __shared__ double scratch[kScratchDoubles];                                                               \
    forward_rows<scalar_t, acc_t, STRATEGY>(x, out, alpha, fixed, a, scratch);                                \
  }                                                                                                           \
  template <typename scalar_t, typename acc_t>                                                                \
  __global__ void __launch_bounds__(BOUND)                                                                    \
      NAME##_bwd_kernel(const scalar_t* __restrict__ p, const scalar_t* __restrict__ dp,                      \
                        scalar_t* __restrict__ dx, const acc_t* __restrict__ alpha, acc_t* __restrict__ dalpha, \
                        Family fixed, RowsArgs a) {                                                           \
    __shared__ double scratch[kScratchDoubles];                                                               \
    backward_rows<scalar_t, acc_t, STRATEGY>(p, dp, dx, alpha, dalpha, fixed, a, scratch);                    \
  }

AK_NORMALIZER_KERNELS(Strategy::kThread, thread, kThreadBlock)
AK_NORMALIZER_KERNELS(Strategy::kWarp, warp, kWarpBlock)
AK_NORMALIZER_KERNELS(Strategy::kBlock, block, kMaxRowBlock)
#undef AK_NORMALIZER_KERNELS

// ---------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------

struct LaunchPlan {
  Strategy strategy;
  int threads;
  unsigned blocks;
};

// Untuned defaults (no GPU to tune on): interleaved rows go one per thread
// when there are enough of them to fill the device; short rows one per warp;
// long rows one per block with about 16 entries per thread and pass.
LaunchPlan plan_launch(const cpu::RowLayout& lay) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t rows = lay.rows();
  LaunchPlan plan;
  int64_t blocks;
  if (lay.inner >= kWarpSize && lay.n <= kThreadMaxN && rows >= 2 * kThreadBlock * sms) {
    plan.strategy = Strategy::kThread;
    plan.threads = kThreadBlock;
    blocks = (rows + kThreadBlock - 1) / kThreadBlock;
  } else if (lay.n <= kWarpMaxN) {
    constexpr int64_t warps = kWarpBlock / kWarpSize;
    plan.strategy = Strategy::kWarp;
    plan.threads = kWarpBlock;
    blocks = (rows + warps - 1) / warps;
  } else {
    int threads = 128;
    while (threads < kMaxRowBlock && int64_t(threads) * 16 < lay.n) threads *= 2;
    plan.strategy = Strategy::kBlock;
    plan.threads = threads;
    blocks = rows;
  }
  // The kernels loop over rows, so the grid only needs to fill the device.
  blocks = std::min<int64_t>(blocks, 32 * sms);
  plan.blocks = static_cast<unsigned>(std::max<int64_t>(blocks, 1));
  return plan;
}

template <typename scalar_t>
void launch_forward(const Tensor& x, Tensor& out, const Tensor& alpha, Family fixed, const cpu::RowLayout& lay) {
  using acc_t = at::opmath_type<scalar_t>;
  const LaunchPlan plan = plan_launch(lay);
  const RowsArgs a{lay.rows(), lay.n, lay.inner};
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const acc_t* ap = alpha.defined() ? alpha.const_data_ptr<acc_t>() : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (plan.strategy) {
    case Strategy::kThread:
      thread_fwd_kernel<scalar_t, acc_t><<<plan.blocks, plan.threads, 0, stream>>>(xp, op, ap, fixed, a);
      break;
    case Strategy::kWarp:
      warp_fwd_kernel<scalar_t, acc_t><<<plan.blocks, plan.threads, 0, stream>>>(xp, op, ap, fixed, a);
      break;
    case Strategy::kBlock:
      block_fwd_kernel<scalar_t, acc_t><<<plan.blocks, plan.threads, 0, stream>>>(xp, op, ap, fixed, a);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_backward(const Tensor& p, const Tensor& grad, Tensor& dx, const Tensor& alpha, Tensor& dalpha,
                     Family fixed, const cpu::RowLayout& lay) {
  using acc_t = at::opmath_type<scalar_t>;
  const LaunchPlan plan = plan_launch(lay);
  const RowsArgs a{lay.rows(), lay.n, lay.inner};
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
  const acc_t* ap = alpha.defined() ? alpha.const_data_ptr<acc_t>() : nullptr;
  acc_t* dap = dalpha.defined() ? dalpha.mutable_data_ptr<acc_t>() : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (plan.strategy) {
    case Strategy::kThread:
      thread_bwd_kernel<scalar_t, acc_t><<<plan.blocks, plan.threads, 0, stream>>>(pp, gp, dxp, ap, dap, fixed, a);
      break;
    case Strategy::kWarp:
      warp_bwd_kernel<scalar_t, acc_t><<<plan.blocks, plan.threads, 0, stream>>>(pp, gp, dxp, ap, dap, fixed, a);
      break;
    case Strategy::kBlock:
      block_bwd_kernel<scalar_t, acc_t><<<plan.blocks, plan.threads, 0, stream>>>(pp, gp, dxp, ap, dap, fixed, a);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_input(const Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), "attnkern: ", name, " must be a CUDA tensor here");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "attnkern: ", name, " must be a floating-point tensor, got ",
              x.scalar_type());
}

// α per row in the accumulation type, on x's device: x's shape with size 1
// along dim, contiguous, so row r reads alpha[r].
Tensor alpha_rows(const Tensor& x, const Tensor& alpha, int64_t dim) {
  auto shape = x.sizes().vec();
  if (!shape.empty()) shape[dim] = 1;
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return alpha.to(x.device(), acc).expand(shape).contiguous();
}

Tensor forward_op(const Tensor& x_in, const Tensor& alpha_in, int64_t dim, Family fixed) {
  check_input(x_in, "x");
  dim = at::maybe_wrap_dim(dim, x_in.dim());
  const c10::cuda::CUDAGuard guard(x_in.device());
  Tensor x = x_in.contiguous();
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() == 0) return out;
  Tensor alpha = alpha_in.defined() ? alpha_rows(x, alpha_in, dim) : Tensor();
  const auto lay = cpu::RowLayout::of(x, dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_normalizer_fwd_cuda",
                                  [&] { launch_forward<scalar_t>(x, out, alpha, fixed, lay); });
  return out;
}

std::tuple<Tensor, Tensor> backward_op(const Tensor& p_in, const Tensor& grad_in, const Tensor& alpha_in,
                                       int64_t dim, bool alpha_grad, Family fixed) {
  check_input(p_in, "p");
  check_input(grad_in, "grad");
  TORCH_CHECK(p_in.sizes() == grad_in.sizes(), "attnkern: grad must have the shape of the output");
  TORCH_CHECK(p_in.device() == grad_in.device(), "attnkern: grad is on ", grad_in.device(), " but p is on ",
              p_in.device());
  dim = at::maybe_wrap_dim(dim, p_in.dim());
  const c10::cuda::CUDAGuard guard(p_in.device());
  Tensor p = p_in.contiguous();
  Tensor grad = grad_in.to(p.scalar_type()).contiguous();
  Tensor dx = at::empty_like(p, at::MemoryFormat::Contiguous);
  Tensor alpha = alpha_in.defined() ? alpha_rows(p, alpha_in, dim) : Tensor();
  Tensor dalpha;
  if (alpha.defined() && alpha_grad) dalpha = at::zeros_like(alpha);
  if (p.numel() > 0) {
    const auto lay = cpu::RowLayout::of(p, dim);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "attnkern_normalizer_bwd_cuda",
                                    [&] { launch_backward<scalar_t>(p, grad, dx, alpha, dalpha, fixed, lay); });
  }
  if (!dalpha.defined()) dalpha = at::empty({0}, p.options());
  return {dx, dalpha};
}

template <Family FAM>
Tensor fixed_forward(const Tensor& x, int64_t dim) {
  return forward_op(x, Tensor(), dim, FAM);
}

template <Family FAM>
Tensor fixed_backward(const Tensor& p, const Tensor& grad, int64_t dim) {
  return std::get<0>(backward_op(p, grad, Tensor(), dim, false, FAM));
}

Tensor entmax_forward(const Tensor& x, const Tensor& alpha, int64_t dim) {
  TORCH_CHECK(alpha.defined(), "attnkern: entmax_fwd needs alpha");
  // attnkern.entmax checks α in eager mode; a compiled graph does not, and a
  // NaN or infinite α would give rows of zeros. Checked on the device, without
  // a synchronization (as the CPU op checks it at once).
  at::_assert_async(at::isfinite(alpha).all(), "attnkern.entmax: alpha must be finite");
  return forward_op(x, alpha, dim, Family::kGeneric);
}

std::tuple<Tensor, Tensor> entmax_backward(const Tensor& p, const Tensor& grad, const Tensor& alpha, int64_t dim,
                                           bool alpha_grad) {
  TORCH_CHECK(alpha.defined(), "attnkern: entmax_bwd needs alpha");
  return backward_op(p, grad, alpha, dim, alpha_grad, Family::kGeneric);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CUDA, m) {
  m.impl("softmax_fwd", &fixed_forward<Family::kSoftmax>);
  m.impl("softmax_bwd", &fixed_backward<Family::kSoftmax>);
  m.impl("sparsemax_fwd", &fixed_forward<Family::kSparsemax>);
  m.impl("sparsemax_bwd", &fixed_backward<Family::kSparsemax>);
  m.impl("entmax15_fwd", &fixed_forward<Family::kEntmax15>);
  m.impl("entmax15_bwd", &fixed_backward<Family::kEntmax15>);
  m.impl("entmax_fwd", &entmax_forward);
  m.impl("entmax_bwd", &entmax_backward);
}

}  // namespace cuda
}  // namespace attnkern

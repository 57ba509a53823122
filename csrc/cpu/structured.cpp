// The structured normalizers on the CPU (Niculae & Blondel, 2017): sparsemax
// after the proximal operator of a penalty, y = prox(x), computed exactly in
// double; docs/algorithms.md, section 10.
//
// fusedmax: p = argmin over the simplex
// of ½‖p - x‖² + λ Σ|p_{i+1} - p_i|, which is sparsemax of y = prox_{λ·TV}(x),
// the 1-D total-variation denoising of the row (docs/algorithms.md, section 10).
// y is computed exactly, in double, by Condat's direct algorithm (2013): one
// sweep that keeps the current segment's lowest and highest feasible value
// and the dual variable at each, closing a segment when the dual leaves
// [-λ, λ]; linear in practice. Entries at -inf take no part: the finite ones
// are neighbours in their order, the removed ones get 0.
//
// oscarmax: sparsemax of the prox of the OSCAR penalty λ Σ_{i<j} max(|y_i|, |y_j|),
// an ordered weighted ℓ1 norm (weight λ(m - k) on the k-th largest |y_i| of the
// m finite entries): sort |x|, subtract the weights, pool adjacent violators
// into a non-increasing fit, clip at 0, restore order and signs. Clusters of
// equal |y| form regardless of position. (Not the simplex-constrained minimiser
// of ½‖p - x‖² + the penalty: the composition, as Niculae & Blondel compute it.)
// On long rows only the head of the sort that holds the support is sorted and
// pooled (oscar_prox_top).
//
// The backwards need y's segments, which the saved p, rounded to the input's
// dtype, cannot tell apart: fusedmax_bwd and oscarmax_bwd solve the prox again
// from x; fusedmax_bwd_segments and oscarmax_bwd_clusters read what
// fusedmax_fwd_segments and oscarmax_fwd_clusters kept (below). Then, with
// v = Jᵀ_sparsemax g
// (g minus its mean on the support S, 0 off it). fusedmax: dx averages v over
// each segment of y inside S, and dλ = Σ_segments (σ_right - σ_left) / |G| ·
// Σ_G v, σ the sign of y's jump at the segment's right and left ends (0 at a
// row end). oscarmax: within a cluster of nonzero |y|, dx_i = sign(x_i) times
// the cluster's mean of sign(x_j) v_j, and dλ = -Σ_clusters (mean weight / λ) ·
// Σ_G sign(x_j) v_j.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>

#include "attnkern/cpu_kernels.h"
#include "attnkern/row_layout.h"
#include "attnkern/structured_math.h"
#include "simd.h"
#include "structured_row.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

// Scratch of one row, n entries each: the row (free once its finite entries
// are compacted: oscar_prox_top's scratch), its finite entries, y, the
// gradient (as loaded and compacted), dx (compacted and placed; before it,
// sparsemax_threshold's scratch) and the finite
// entries' positions. Not zeroed: every entry is written before it
// is read (a std::vector's zero fill is an inline template that each
// instruction-set copy would compile, and one copy's would be shared).
// oscarmax's prox also keeps the sort order of |x| and its pooled blocks (their
// ends in sorted positions, their sums and means); its sort uses `keys` (2n)
// and order_tmp.
struct ProxScratch {
  std::unique_ptr<double[]> buf;
  std::unique_ptr<int64_t[]> ibuf;
  std::unique_ptr<uint64_t[]> keys;
  // support_tv_prox's entries near the top, with a vector's slack for
  // left_pack_index's whole-vector stores.
  std::unique_ptr<int32_t[]> near_buf;
  int32_t* near;
  double *row, *xs, *y, *g, *gs, *dxs, *out, *block_sum, *block_mean;
  int64_t *pos, *order, *block_end, *order_tmp;
  int64_t blocks = 0;
  bool zero_y = false;  // the prox set y to 0 without solving (oscar_prox)
  // oscar_prox solved only the leading pooled blocks (s.blocks of them, their
  // `ranked` entries first in order; sparsemax's threshold on y top_tau), y
  // is -inf elsewhere (oscar_prox_top).
  bool top_only = false;
  int64_t ranked = 0;
  double top_tau = 0.0;
  // oscar_prox_top already failed on this row (read in place, oscarmax_row_top):
  // oscar_prox sorts it whole without trying again.
  bool top_failed = false;
  // Where fusedmax's prox was solved only around the support: how many of
  // y's entries are finite, their values listed in index order in
  // block_mean; -1 where y was solved everywhere. The finite entries form
  // `regions` runs, [order_tmp[2r], order_tmp[2r + 1]] (disjoint, increasing).
  int64_t local = -1, regions = 0;
  explicit ProxScratch(int64_t n)
      : buf(new double[9 * n]), ibuf(new int64_t[4 * n]), keys(new uint64_t[2 * n]), near_buf(new int32_t[n + 64]) {
    near = near_buf.get();
    double* b = buf.get();
    for (double** a : {&row, &xs, &y, &g, &gs, &dxs, &out, &block_sum, &block_mean}) {
      *a = b;
      b += n;
    }
    pos = ibuf.get();
    order = pos + n;
    block_end = order + n;
    order_tmp = block_end + n;
  }
};

namespace {

using at::Tensor;



// Whether every entry of x is finite (no NaN, no ±inf): x - x is 0 exactly
// then, NaN otherwise.
template <typename T>
bool all_finite(const T* x, int64_t n) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    using V = at::vec::Vectorized<T>;
    V bad(T(0));
    for (; j + V::size() <= n; j += V::size()) {
      const V v = V::loadu(x + j);
      bad = bad | (v - v != V(T(0)));
    }
    if (bad.zero_mask() != (1 << V::size()) - 1) return false;
  }
  for (; j < n; ++j) {
    if (!std::isfinite(static_cast<double>(x[j]))) return false;
  }
  return true;
}

// The row's finite entries (compacted into xs, their positions into pos);
// false if the row holds a NaN or +inf (its output is NaN).
template <typename T>
bool finite_entries(const T* x, int64_t n, double* xs, int64_t* pos, int64_t& m) {
  // Unmasked rows, the common case, in vector passes.
  if (all_finite(x, n)) {
    for (int64_t j = 0; j < n; ++j) xs[j] = static_cast<double>(x[j]);
    std::iota(pos, pos + n, int64_t(0));
    m = n;
    return true;
  }
  m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double v = static_cast<double>(x[j]);
    if (std::isnan(v) || v == std::numeric_limits<double>::infinity()) return false;
    if (v > -std::numeric_limits<double>::infinity()) {
      xs[m] = v;
      pos[m++] = j;
    }
  }
  return true;
}

// Per-row λ in double, checked.
Tensor checked_lam(const Tensor& lam, const Tensor& x, int64_t dim, const char* op) {
  check_cpu_float(lam, "lam");
  Tensor rows = per_row(lam, x, dim, at::kDouble);
  const double* lp = rows.const_data_ptr<double>();
  for (int64_t r = 0; r < rows.numel(); ++r) {
    TORCH_CHECK_VALUE(lp[r] >= 0.0 && std::isfinite(lp[r]), "attnkern: ", op, " lam must be finite and >= 0, got ",
                      lp[r]);
  }
  return rows;
}


// fusedmax's segments, one byte per entry of x: what its backward needs of
// y = prox(x), so that it need not solve the prox again. Over the row's finite
// entries in order: kFirst on the first, kStart where a segment of y starts
// (the first entry, or y differs from the previous one: the segments of
// math::fusedmax_vjp), kUp where y rises from the previous entry, kSupport
// where y > τ; kNanRow on every entry of a row holding NaN or +inf; 0 on -inf.
constexpr uint8_t kSegStart = 1, kSegUp = 2, kSegSupport = 4, kSegFirst = 8, kSegNanRow = 16;

// oscarmax's clusters, what its backward needs of the prox: a byte of flags and
// the rank in the sort by decreasing |x| (int32; rows are shorter than 2^31)
// per entry of x. Flags on the finite entries: kFinite, kSupport where y > τ,
// kPositive / kNegative (x's sign), kBlockStart on the entry of lowest rank in
// its pooled block, kNonzero in a block whose magnitude is not clipped to 0;
// kNanRow on every entry of a row holding NaN or +inf; 0 (and rank 0) on -inf.
// Where the prox was 0 without a sort, no block is unclipped: the ranks stay 0,
// and the backward, finding no kNonzero in the row, writes zeros. Where only
// the head of the sort was solved (oscar_prox_top), the entries after it carry
// no block flags and rank 0: the backward reads the ranks of kNonzero entries
// only, which lead the sort.
constexpr uint8_t kClusterFinite = 1, kClusterSupport = 2, kClusterPositive = 4, kClusterNegative = 8,
                  kClusterBlockStart = 16, kClusterNonzero = 32, kClusterNanRow = 64;

template <typename T>
bool solve_windows(ProxScratch& s, const T* x, int64_t m, double lam, const int64_t* cand, int64_t count,
                   bool whole_y);

// The largest T at most d: for a T entry x, x > round_down(d) exactly when
// x > d, so a float row is compared against a double bound as floats.
template <typename T>
T round_down(double d) {
  T t = static_cast<T>(d);
  if (static_cast<double>(t) > d) t = std::nextafter(t, -std::numeric_limits<T>::infinity());
  return t;
}

// The row's largest entry and largest magnitude; false where an entry is NaN
// or ±inf (v - v is 0 exactly for the finite ones). Vector passes on float
// and double rows.
template <typename T>
bool row_extremes(const T* x, int64_t m, double& top, double& amax) {
  using Vec = at::vec::Vectorized<T>;
  int64_t j = 0;
  bool finite = true;
  T vtop = x[0], vamax = T(0);
  if (m >= Vec::size()) {
    Vec vmax = Vec::loadu(x), vabs(T(0)), bad(T(0));
    for (; j + Vec::size() <= m; j += Vec::size()) {
      const Vec v = Vec::loadu(x + j);
      bad = bad | (v - v != Vec(T(0)));
      vmax = at::vec::maximum(vmax, v);
      vabs = at::vec::maximum(vabs, v.abs());
    }
    finite = bad.zero_mask() == (1 << Vec::size()) - 1;
    auto larger = [](Vec& a, Vec& b) { return at::vec::maximum(a, b); };
    vtop = at::vec::vec_reduce_all<T>(larger, vmax);
    vamax = at::vec::vec_reduce_all<T>(larger, vabs);
  }
  for (; j < m; ++j) {
    finite &= std::isfinite(x[j]);
    vtop = std::max(vtop, x[j]);
    vamax = std::max(vamax, std::abs(x[j]));
  }
  top = static_cast<double>(vtop);
  amax = static_cast<double>(vamax);
  return finite;
}

// fusedmax's prox where only what sparsemax reads of it is solved: y exactly
// on the entries that can be in sparsemax's support and their neighbours,
// -inf elsewhere (below any threshold; the backwards read y only on the
// support and at its segments' ends). Each y_i is within 2·lam of x_i (a jump's
// dual is at most lam on either side), so sparsemax's threshold on y is at
// least its threshold on x minus 2·lam, and an entry with x_i + 2·lam below
// that is off the support. Around each cluster of the others, the prox of a
// window of the row is that of the window's data with each cut end moved by
// the unknown dual there, in [-lam, lam]; the prox is monotone in its data, so
// the windows solved with both ends at -lam and at +lam bound y, and where the
// two agree they give it. Each window grows until they agree; false where the
// candidates are many, the row short or a window large: the caller then sweeps
// the whole row. x: the m finite entries (all of a row, or compacted), top and
// amax: their largest entry and magnitude (row_extremes). whole_y: y is -inf
// off the regions solved; otherwise only next to them (a caller that reads y
// on the regions alone).
//
// Given tau_hint, sparsemax's threshold on y rounded to float (what a forward
// saved; NaN: none), the candidates are the entries with x_i above it minus
// 2·lam (and a margin for its rounding) instead: fewer, and found in one pass.
template <typename T>
bool support_tv_prox(ProxScratch& s, const T* x, int64_t m, double lam, double tau_hint, double top, double amax,
                     bool whole_y) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t kMinRow = 64, kMaxCandidateShare = 16;
  if (!(lam > 0.0) || m < kMinRow) return false;
  constexpr int kAll = int((1u << Vec::size()) - 1);
  int64_t* cand = s.order;
  int64_t count = 0;
  if (std::isfinite(tau_hint)) {
    // (float rounding moves tau by at most 2^-24 of it.)
    const double bound = tau_hint - 2.0 * lam - 1e-6 * (std::abs(tau_hint) + 2.0 * lam + 1.0);
    // (Entries of a float row above the double bound are those above it
    // rounded down to float.)
    const T vbound = round_down<T>(bound);
    int64_t j = 0;
    for (; j + Vec::size() <= m; j += Vec::size()) {
      for (int above = kAll & ~(Vec::loadu(x + j) > Vec(vbound)).zero_mask(); above != 0; above &= above - 1)
        cand[count++] = j + __builtin_ctz(above);
    }
    for (; j < m; ++j) {
      if (x[j] > vbound) cand[count++] = j;
    }
    return count > 0 && count * kMaxCandidateShare <= m && solve_windows(s, x, m, lam, cand, count, whole_y);
  }
  // (The margin keeps rounding in the thresholds from dropping a candidate.)
  const double margin = 1e-9 * (amax + 4.0 * lam + 1.0);
  // The threshold on x is at least max x - 1 and at most max x: every
  // candidate (below) lies above max x - 1 - 4·lam, and every entry above
  // max x - 4·lam is one. One pass lists the first (in index order) and
  // counts the second: too many of those (large lam) and the sweep is
  // cheaper.
  const T low = round_down<T>(top - 1.0 - 4.0 * lam - 2.0 * margin), sure_above = round_down<T>(top - 4.0 * lam);
  // (Listed without a branch per vector: a few hundredths of a row's
  // entries are listed, so whether a vector holds one is a coin flip.)
  int32_t* near = s.near;
  int64_t near_count = 0, sure = 0;
  int64_t j = 0;
  for (; j + Vec::size() <= m; j += Vec::size()) {
    const Vec v = Vec::loadu(x + j);
    sure += __builtin_popcount(lane_mask<T>(v > Vec(sure_above)));
    near_count += left_pack_index<Vec::size()>(near + near_count, int32_t(j), lane_mask<T>(v > Vec(low)));
  }
  for (; j < m; ++j) {
    sure += x[j] > sure_above;
    near[near_count] = int32_t(j);
    near_count += x[j] > low;
  }
  if (sure * kMaxCandidateShare > m) return false;
  double* near_x = s.block_sum;
  for (int64_t k = 0; k < near_count; ++k) near_x[k] = static_cast<double>(x[near[k]]);
  // The listed entries hold max x and, in index order, every entry the
  // threshold's passes read: the same bits as the threshold on all of x.
  const double tau_x = math::sparsemax_threshold(near_x, near_count, s.dxs);
  const double bound = tau_x - 4.0 * lam - margin;
  for (int64_t k = 0; k < near_count; ++k) {
    if (near_x[k] > bound) cand[count++] = near[k];
  }
  return count * kMaxCandidateShare <= m && solve_windows(s, x, m, lam, cand, count, whole_y);
}

// support_tv_prox's windows around the candidates cand[0:count] (in index
// order): y where the two extreme solutions agree; false where a window would
// grow past a quarter of the row. A cluster of candidates shares a window
// while they lie within its width; each window doubles on its own until its
// solutions agree (most agree at the first width; a row rarely holds more
// than one that needs more). The regions solved are disjoint and increasing:
// consecutive clusters' candidates are more than 2·half + 1 apart.
template <typename T>
bool solve_windows(ProxScratch& s, const T* x, int64_t m, double lam, const int64_t* cand, int64_t count,
                   bool whole_y) {
  constexpr int64_t kFirstHalfWidth = 2;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double *data = s.block_sum, *lower = s.block_mean, *upper = s.dxs;
  // The ends of the regions each window's solve sets (two entries each).
  int64_t* regions = s.order_tmp;
  if (whole_y) std::fill(s.y, s.y + m, -kInf);
  int64_t windows = 0;
  for (int64_t c = 0; c < count;) {
    // An isolated candidate i above both neighbours by more than 4·lam: as
    // |y_j - x_j| <= 2·lam, y jumps up into i and down after it, so i is a
    // segment of its own and y_i = x_i - 2·lam, no solve needed (most
    // candidates at small lam). Its region is i alone, its neighbours -inf:
    // below y_i, off the support (they are not candidates), as the backwards
    // need them.
    const int64_t i = cand[c];
    if (i > 0 && i < m - 1 && (c + 1 == count || cand[c + 1] - i > 2 * kFirstHalfWidth + 1)) {
      const double xi = static_cast<double>(x[i]), left = static_cast<double>(x[i - 1]),
                   right = static_cast<double>(x[i + 1]), below = xi - 2.0 * lam;
      // (The margin keeps rounding from deciding it.)
      auto clears = [&](double nb) { return below - (nb + 2.0 * lam) > 1e-9 * (std::abs(xi) + std::abs(nb) + 4.0 * lam); };
      if (clears(left) && clears(right)) {
        s.y[i - 1] = s.y[i + 1] = -kInf;
        s.y[i] = below;
        regions[2 * windows] = regions[2 * windows + 1] = i;
        ++windows;
        ++c;
        continue;
      }
    }
    for (int64_t half = kFirstHalfWidth;; half *= 2) {
      if (half * 4 > m) return false;
      int64_t e = c;  // candidates c..e share a window
      while (e + 1 < count && cand[e + 1] - cand[e] <= 2 * half + 1) ++e;
      const int64_t a = std::max<int64_t>(0, cand[c] - half), b = std::min<int64_t>(m - 1, cand[e] + half);
      const int64_t len = b - a + 1;
      for (double* solved : {lower, upper}) {
        const double shift = solved == lower ? -lam : lam;
        for (int64_t i = 0; i < len; ++i) data[i] = static_cast<double>(x[a + i]);
        if (a > 0) data[0] += shift;
        if (b < m - 1) data[len - 1] += shift;
        math::tv_prox(data, len, lam, solved);
      }
      const int64_t from = std::max<int64_t>(a, cand[c] - 1), to = std::min<int64_t>(b, cand[e] + 1);
      bool agree = true;
      for (int64_t i = from; i <= to && agree; ++i) agree = lower[i - a] == upper[i - a];
      if (!agree) continue;
      if (from > 0) s.y[from - 1] = -kInf;
      if (to < m - 1) s.y[to + 1] = -kInf;
      for (int64_t i = from; i <= to; ++i) s.y[i] = lower[i - a];
      regions[2 * windows] = from;
      regions[2 * windows + 1] = to;
      ++windows;
      c = e + 1;
      break;
    }
  }
  // y's finite entries, in index order, for the threshold.
  s.local = 0;
  s.regions = windows;
  for (int64_t w = 0; w < windows; ++w) {
    for (int64_t i = regions[2 * w]; i <= regions[2 * w + 1]; ++i) s.block_mean[s.local++] = s.y[i];
  }
  return true;
}

struct Fusedmax {
  static constexpr const char* kName = "fusedmax";
  static constexpr uint8_t kNanRow = kSegNanRow;
  static void prox(ProxScratch& s, int64_t m, double lam, double tau_hint = std::numeric_limits<double>::quiet_NaN()) {
    s.local = -1;
    double top = 0.0, amax = 0.0;
    if (!(row_extremes(s.xs, m, top, amax) && support_tv_prox(s, s.xs, m, lam, tau_hint, top, amax, true)))
      math::tv_prox(s.xs, m, lam, s.y);
    s.zero_y = false;
  }
  // What the backward needs of the row's prox (below).
  static void record(const ProxScratch& s, int64_t m, double tau, uint8_t* flags, int32_t* ranks);
  // The backward of one row (see the top of the file) on its m finite entries,
  // given y (prox) and v (sparsemax_vjp, in s.gs): dx into s.dxs, returns dλ.
  static double backward(ProxScratch& s, int64_t m, double tau);
};

double Fusedmax::backward(ProxScratch& s, int64_t m, double tau) {
  return math::fusedmax_vjp(s.y, s.gs, m, tau, s.dxs);
}

// A counting sort's first slot per bucket (a radix pass's, sort_head_keys'):
// the running sum of the counts.
template <int kBuckets>
void bucket_starts(const uint32_t* count, uint32_t* start) {
  uint32_t total = 0;
  for (int b = 0; b < kBuckets; ++b) {
    start[b] = total;
    total += count[b];
  }
}

// Sorts the keys of a row's head (magnitude_key's, at most a quarter of the
// row; tmp: as many again) in increasing order. The head's magnitudes lie in a
// narrow band, where std::sort's comparisons cost more than the few keys move:
// a counting sort on the top bits that differ among the keys' magnitude halves
// puts them into at most 64 ordered buckets (in the order listed within one),
// each then sorted on its own, by insertion while it holds a few keys.
void sort_head_keys(uint64_t* key, int64_t count, uint64_t* tmp) {
  constexpr int kBucketBits = 6, kBuckets = 1 << kBucketBits;
  constexpr int64_t kInsertionLimit = 16;
  auto sort_range = [](uint64_t* first, uint64_t* last) {
    if (last - first > kInsertionLimit) {
      std::sort(first, last);
      return;
    }
    for (uint64_t* k = first + 1; k < last; ++k) {
      const uint64_t v = *k;
      uint64_t* at = k;
      for (; at > first && at[-1] > v; --at) *at = at[-1];
      *at = v;
    }
  };
  if (count <= kInsertionLimit) {
    sort_range(key, key + count);
    return;
  }
  uint32_t lo = UINT32_MAX, hi = 0;
  for (int64_t k = 0; k < count; ++k) {
    const uint32_t top = uint32_t(key[k] >> 32);
    lo = std::min(lo, top);
    hi = std::max(hi, top);
  }
  const uint32_t range = hi - lo;
  // (range >> shift < 64: range has 32 - clz(range) bits.)
  const int shift = range < kBuckets ? 0 : 32 - __builtin_clz(range) - kBucketBits;
  auto bucket = [&](uint64_t k) { return (uint32_t(k >> 32) - lo) >> shift; };
  uint32_t in_bucket[kBuckets] = {}, start[kBuckets], next[kBuckets];
  for (int64_t k = 0; k < count; ++k) ++in_bucket[bucket(key[k])];
  bucket_starts<kBuckets>(in_bucket, start);
  std::copy(start, start + kBuckets, next);
  for (int64_t k = 0; k < count; ++k) tmp[next[bucket(key[k])]++] = key[k];
  // (Bucket b is now [start[b], next[b]) of tmp.)
  for (int b = 0; b < kBuckets; ++b) sort_range(tmp + start[b], tmp + next[b]);
  std::copy(tmp, tmp + count, key);
}

// s.order[0:m] = the indices of s.xs[0:m] by decreasing |x|, ties in index
// order (the prox does not depend on it: tied magnitudes always pool when
// lam > 0, and are equal anyway when lam = 0). Non-negative numbers order as
// their bit patterns, so a stable LSD radix sort on the complemented bits of
// |x|, a byte a pass, skipping the bytes all keys share; short rows by
// comparisons, where the passes' 256 buckets would cost more than the sort.
// When every |x| is a float (the input was float32, bfloat16 or float16), the
// float's bits and the index share one 64-bit key: half the bytes to move
// and at most four passes.
// The 64-bit sort key of magnitude a (>= 0) at index i < 2^32: a's float bits
// complemented, then the index, so that ascending keys order by decreasing a,
// ties by index; clears `floats` where a is not a float (the key then orders
// nothing).
inline uint64_t magnitude_key(double a, int64_t i, bool& floats) {
  const float f = static_cast<float>(a);
  floats &= static_cast<double>(f) == a;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return (uint64_t(~bits) << 32) | uint64_t(uint32_t(i));
}

void sort_by_magnitude(ProxScratch& s, int64_t m) {
  const double* x = s.xs;
  uint64_t* key = s.keys.get();
  int64_t* order = s.order;
  bool floats = m <= int64_t(UINT32_MAX);
  for (int64_t i = 0; i < m; ++i) key[i] = magnitude_key(std::abs(x[i]), i, floats);
  if (floats) {
    if (m <= 64) {
      std::sort(key, key + m);
    } else {
      uint32_t count[4][256] = {};
      for (int64_t i = 0; i < m; ++i) {
        for (int d = 0; d < 4; ++d) ++count[d][(key[i] >> (32 + 8 * d)) & 255];
      }
      uint64_t *from = key, *to = key + m;
      for (int d = 0; d < 4; ++d) {
        const int shift = 32 + 8 * d;
        if (count[d][(from[0] >> shift) & 255] == uint32_t(m)) continue;  // (every key has this byte)
        uint32_t start[256];
        bucket_starts<256>(count[d], start);
        for (int64_t i = 0; i < m; ++i) to[start[(from[i] >> shift) & 255]++] = from[i];
        std::swap(from, to);
      }
      key = from;
    }
    for (int64_t k = 0; k < m; ++k) order[k] = int64_t(key[k] & 0xffffffffu);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    const double a = std::abs(x[i]);
    uint64_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    key[i] = ~bits;
    order[i] = i;
  }
  if (m <= 64) {
    std::sort(order, order + m, [key](int64_t a, int64_t b) { return key[a] < key[b] || (key[a] == key[b] && a < b); });
    return;
  }
  uint32_t count[8][256] = {};
  for (int64_t i = 0; i < m; ++i) {
    for (int d = 0; d < 8; ++d) ++count[d][(key[i] >> (8 * d)) & 255];
  }
  uint64_t *from = key, *to = key + m;
  int64_t *from_order = order, *to_order = s.order_tmp;
  for (int d = 0; d < 8; ++d) {
    if (count[d][(from[0] >> (8 * d)) & 255] == uint32_t(m)) continue;  // (every key has this byte)
    uint32_t start[256];
    bucket_starts<256>(count[d], start);
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t at = start[(from[i] >> (8 * d)) & 255]++;
      to[at] = from[i];
      to_order[at] = from_order[i];
    }
    std::swap(from, to);
    std::swap(from_order, to_order);
  }
  if (from_order != order) std::copy(from_order, from_order + m, order);
}

// out = max(y - tau, 0) over m entries, a vector at a time.
void clip_below(const double* y, double tau, int64_t m, double* out) {
  using Vec = at::vec::Vectorized<double>;
  int64_t i = 0;
  for (; i + Vec::size() <= m; i += Vec::size()) at::vec::maximum(Vec::loadu(y + i) - Vec(tau), Vec(0.0)).store(out + i);
  for (; i < m; ++i) out[i] = std::max(y[i] - tau, 0.0);
}

// math::sparsemax_vjp with the same bits, in vector passes: the support's
// gradients summed in index order (support entries are few; blocks without
// one are skipped), then v = g - mean on the support, 0 elsewhere, without
// a branch per entry. v may be g.
void sparsemax_vjp_rows(const double* y, double tau, const double* g, int64_t m, double* v) {
  using Vec = at::vec::Vectorized<double>;
  constexpr int kAll = (1 << Vec::size()) - 1;
  double gsum = 0.0;
  int64_t support = 0, i = 0;
  for (; i + Vec::size() <= m; i += Vec::size()) {
    for (int in = kAll & ~(Vec::loadu(y + i) > Vec(tau)).zero_mask(); in != 0; in &= in - 1) {
      gsum += g[i + __builtin_ctz(in)];
      ++support;
    }
  }
  for (; i < m; ++i) {
    if (y[i] > tau) {
      gsum += g[i];
      ++support;
    }
  }
  const double gmean = support > 0 ? gsum / double(support) : 0.0;
  for (i = 0; i + Vec::size() <= m; i += Vec::size()) {
    const Vec on = Vec::loadu(y + i) > Vec(tau);
    (on & (Vec::loadu(g + i) - Vec(gmean))).store(v + i);
  }
  for (; i < m; ++i) v[i] = y[i] > tau ? g[i] - gmean : 0.0;
}

// sparsemax's threshold on the prox's y (m entries): on a y set to 0 without
// solving, what math::sparsemax_threshold returns on zeros, without its passes;
// on a y solved around the support only, its passes over the finite entries
// (in index order: the same bits as over all of y, whose -inf entries they
// skip).
double threshold(ProxScratch& s, int64_t m) {
  if (s.zero_y) return -1.0 / double(m);
  if (s.local >= 0) return math::sparsemax_threshold(s.block_mean, s.local, s.dxs);
  if (s.top_only) return s.top_tau;
  return math::sparsemax_threshold(s.y, m, s.dxs);
}

// -1, 0 or 1 without a branch: the signs of a row of scores are coin flips.
inline double sign_of(double x) { return double(int(x > 0.0) - int(x < 0.0)); }

// The backward of one unclipped oscarmax cluster, sorted positions [start,
// stop) of m (see the top of the file): entry(k) = the finite entry of rank k,
// sign(i) = sign(x_i), v = the sparsemax VJP by entry; writes dx(i, value) and
// returns the cluster's term of -dλ. Both oscarmax backwards call it, so they
// agree bit for bit.
template <typename Entry, typename Sign, typename Write>
double cluster_vjp(int64_t start, int64_t stop, int64_t m, Entry entry, Sign sign, const double* v, Write write) {
  const double size = double(stop - start);
  double ssum = 0.0;
  for (int64_t k = start; k < stop; ++k) ssum += sign(entry(k)) * v[entry(k)];
  for (int64_t k = start; k < stop; ++k) write(entry(k), sign(entry(k)) * ssum / size);
  // The cluster's magnitude is its mean of |x|_(k) - lam·(m-1-k).
  return ssum * (double(m - 1) - 0.5 * double(start + stop - 1));
}

// Pool adjacent violators over the first `count` entries of the sort order:
// blocks of a non-increasing fit to |x|_(k) - lam·(m-1-k), each block's mean
// kept beside its sum; returns how many. The blocks of a prefix of the order
// are the first blocks of the whole order's as far as later entries never
// merge into them (oscar_prox_top).
int64_t pool_adjacent_violators(ProxScratch& s, int64_t m, double lam, int64_t count) {
  const double* x = s.xs;
  const int64_t* order = s.order;
  int64_t blocks = 0;
  double* mean = s.block_mean;
  for (int64_t k = 0; k < count; ++k) {
    s.block_sum[blocks] = std::abs(x[order[k]]) - lam * double(m - 1 - k);
    mean[blocks] = s.block_sum[blocks];
    s.block_end[blocks++] = k + 1;
    while (blocks >= 2 && mean[blocks - 2] < mean[blocks - 1]) {
      const int64_t b = blocks - 1, first = blocks >= 3 ? s.block_end[b - 2] : 0;
      s.block_sum[b - 1] += s.block_sum[b];
      s.block_end[b - 1] = s.block_end[b];
      mean[b - 1] = s.block_sum[b - 1] / double(s.block_end[b - 1] - first);
      --blocks;
    }
  }
  return blocks;
}

// y at the entries of the first `blocks` pooled blocks: sign(x) times the
// block's mean clipped at 0.
void write_blocks(ProxScratch& s, int64_t blocks) {
  int64_t start = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const double mag = std::max(s.block_mean[b], 0.0);
    for (int64_t k = start; k < s.block_end[b]; ++k) {
      const int64_t i = s.order[k];
      s.y[i] = sign_of(s.xs[i]) * mag;
    }
    start = s.block_end[b];
  }
}

// oscarmax's prox where only what sparsemax reads of it is solved: the
// leading pooled blocks exactly, y = -inf at every other entry (below the
// threshold, which none of them reaches). The entries with |x| above a cut c
// are sorted and pooled alone. Every later target |x|_(k) - lam·(m-1-k) is at
// most some U <= c (an entry with |x| <= h is at most h, one above h ranks
// before all entries with |x| <= h, whose number N gives it a weight of at
// least lam·N: U = min over levels h of max(h, c - lam·N(h))), so a block of
// theirs whose mean exceeds U (by a margin for rounding) never merges with
// what follows (a merge needs a larger mean behind it, and everything behind
// is a mean of values at most its own), and neither do the blocks before it:
// those leading blocks are exact, with the bits of the whole sort's, and
// every later fitted value is at most U plus the margin, V. sparsemax's
// threshold over the leading blocks' y is at most its threshold over all of y
// (adding entries only raises it); where it exceeds V, no later entry is in
// the support and it is the threshold. The
// first cut is max|x| - lam·(m-1) - 1/4, just under the largest target; a cut
// that leaves no leading block, or whose threshold falls short, is lowered to
// that threshold (then the next one passes) but by no more than a step, the
// steps doubling from 1/2. False where the sorted entries pass a quarter of the
// row (the caller then sorts it whole).
//
// x: the m finite entries, s.xs itself or a float or double row read in place
// (then the listed entries alone are copied into s.xs, where the pooling reads
// them; the float comparisons are those of the double bounds rounded down).
// whole_y: y is -inf off the leading blocks; otherwise y is written on their
// entries alone (a caller that reads y there only).
constexpr int64_t kOscarTopMinRow = 64;

template <typename T>
bool oscar_prox_top(ProxScratch& s, const T* x, int64_t m, double lam, double amax, bool whole_y) {
  constexpr int64_t kMaxShare = 4;
  if (m < kOscarTopMinRow) return false;
  const double margin = 1e-9 * (amax + lam * double(m) + 1.0);
  double above = std::numeric_limits<double>::infinity(), cut = amax - lam * double(m - 1) - 0.25, step = 0.5;
  int64_t sorted = 0;
  constexpr int kLevels = 8;
  double level[kLevels];
  T vlevel[kLevels];  // (level rounded down to T)
  int64_t at_most[kLevels] = {};
  while (cut > 0.0) {
    // Append the entries with cut < |x| <= above, sorted by decreasing |x|
    // (ties by index, as sort_by_magnitude), after those already sorted.
    // The first pass also counts the entries with |x| at most each of
    // kLevels levels h up to the first cut (below).
    using Vec = at::vec::Vectorized<T>;
    int64_t* order = s.order;
    int32_t* listed = s.near;
    int64_t count = 0, i = 0;
    const bool first = sorted == 0;
    if (first) {
      const double lowest = std::max(0.0, cut - lam * double(m));
      for (int l = 0; l < kLevels; ++l) {
        level[l] = lowest + (cut - lowest) * double(l + 1) / kLevels;
        vlevel[l] = round_down<T>(level[l]);
      }
    }
    const T vcut = round_down<T>(cut), vabove = round_down<T>(above);
    // (Counted a lane at a time in vectors of T, exact: no lane counts 2^24
    // entries, as the callers' rows are shorter than that.)
    Vec counts[kLevels];
    for (Vec& c : counts) c = Vec(T(0));
    for (; i + Vec::size() <= m; i += Vec::size()) {
      const Vec a = Vec::loadu(x + i).abs();
      count += left_pack_index<Vec::size()>(listed + count, int32_t(i),
                                            lane_mask<T>((a > Vec(vcut)) & (a <= Vec(vabove))));
      if (first) {
        for (int l = 0; l < kLevels; ++l) counts[l] = counts[l] + ((a <= Vec(vlevel[l])) & Vec(T(1)));
      }
    }
    for (; i < m; ++i) {
      const T a = std::abs(x[i]);
      listed[count] = int32_t(i);
      count += a > vcut && a <= vabove;
      if (first) {
        for (int l = 0; l < kLevels; ++l) at_most[l] += a <= vlevel[l];
      }
    }
    if (first) {
      for (int l = 0; l < kLevels; ++l) {
        at_most[l] +=
            static_cast<int64_t>(at::vec::vec_reduce_all<T>([](Vec& u, Vec& w) { return u + w; }, counts[l]));
      }
    }
    const int64_t from = sorted;
    sorted += count;
    if (sorted * kMaxShare > m) return false;
    double* xs = s.xs;
    if (static_cast<const void*>(x) != static_cast<const void*>(xs)) {
      for (int64_t k = 0; k < count; ++k) xs[listed[k]] = static_cast<double>(x[listed[k]]);
    }
    // (On 64-bit keys where every listed |x| is a float, as from float32
    // rows, as sort_by_magnitude.)
    uint64_t* key = s.keys.get();
    bool floats = true;
    for (int64_t k = 0; k < count; ++k) key[k] = magnitude_key(std::abs(xs[listed[k]]), listed[k], floats);
    if (floats) {
      sort_head_keys(key, count, key + count);
      for (int64_t k = 0; k < count; ++k) order[from + k] = int64_t(key[k] & 0xffffffffu);
    } else {
      for (int64_t k = 0; k < count; ++k) order[from + k] = listed[k];
      std::sort(order + from, order + sorted, [xs](int64_t i, int64_t j) {
        const double a = std::abs(xs[i]), b = std::abs(xs[j]);
        return a > b || (a == b && i < j);
      });
    }
    const int64_t blocks = pool_adjacent_violators(s, m, lam, sorted);
    // Every later target is at most h if its |x| is at most h, else at most
    // cut - lam·(the entries with |x| at most h, all ranked after it): the
    // least over the levels of the larger of the two bounds them all.
    double later = cut;
    for (int l = 0; l < kLevels; ++l) {
      if (level[l] <= cut) later = std::min(later, std::max(level[l], cut - lam * double(at_most[l])));
    }
    const double bound = later + 2.0 * margin;  // V, above every later fitted value
    int64_t leading = 0;
    while (leading < blocks && s.block_mean[leading] > bound) ++leading;
    above = cut;
    if (leading == 0) {
      cut -= step;
      step *= 2.0;
      continue;
    }
    // The threshold over the leading blocks' y, listed in index order (by a
    // bitmap of their positions), where it has the bits of the threshold
    // over all of y, which skips the -inf entries: it is the row's threshold
    // (threshold()) when it passes the bound.
    const int64_t ranked = s.block_end[leading - 1];
    write_blocks(s, leading);
    uint64_t* bits = s.keys.get();  // (the keys are sorted into order by now)
    const int64_t words = (m + 63) / 64;
    std::fill(bits, bits + words, uint64_t(0));
    for (int64_t k = 0; k < ranked; ++k) bits[order[k] >> 6] |= uint64_t(1) << (order[k] & 63);
    int64_t listed_y = 0;
    for (int64_t w = 0; w < words; ++w) {
      for (uint64_t word = bits[w]; word != 0; word &= word - 1)
        s.row[listed_y++] = s.y[64 * w + __builtin_ctzll(word)];
    }
    const double tau = math::sparsemax_threshold(s.row, ranked, s.dxs);
    if (tau > bound) {
      if (whole_y) {
        std::fill(s.y, s.y + m, -std::numeric_limits<double>::infinity());
        write_blocks(s, leading);
      }
      s.blocks = leading;
      s.top_only = true;
      s.top_tau = tau;
      s.ranked = ranked;
      return true;
    }
    // (A threshold far below the cut, from few or negative leading entries,
    // says little: then the step.)
    cut = std::max(std::min(cut - margin, tau - 3.0 * margin), cut - step);
    step *= 2.0;
  }
  return false;
}

// Whether oscarmax's prox is 0 on m finite entries whose largest magnitude is
// amax, known without a sort: y is 0 wherever the largest fitted value, the
// largest mean of a prefix of the sorted targets |x|_(k) - lam·(m-1-k), is <= 0;
// each such prefix mean is at most max|x| - lam·(m-1)/2, so a row whose max|x|
// is below lam·(m-1)/2 needs no sort (long rows at moderate lam: the weights
// grow with m). The margin of 1e-6 keeps the rounding of the prefix sums from
// deciding it.
bool oscar_prox_is_zero(double amax, int64_t m, double lam) {
  return amax <= lam * double(m - 1) * 0.5 * (1.0 - 1e-6);
}

// y = prox of lam·OSCAR at the m finite entries (see the top of the file),
// keeping the sort order and the pooled blocks (s.blocks of them), or setting
// s.zero_y where y is 0 without a sort (below), or s.top_only where only the
// leading blocks were solved (oscar_prox_top).
void oscar_prox(ProxScratch& s, int64_t m, double lam) {
  const double* x = s.xs;
  s.top_only = false;
  double top = 0.0, amax = 0.0;
  row_extremes(x, m, top, amax);
  const bool top_failed = std::exchange(s.top_failed, false);
  if (oscar_prox_is_zero(amax, m, lam)) {
    for (int64_t i = 0; i < m; ++i) s.y[i] = sign_of(x[i]) * 0.0;  // (the sorted path's signed zeros)
    s.zero_y = true;
    return;
  }
  s.zero_y = false;
  if (!top_failed && oscar_prox_top(s, x, m, lam, amax, /*whole_y=*/true)) return;
  sort_by_magnitude(s, m);
  s.blocks = pool_adjacent_violators(s, m, lam, m);
  write_blocks(s, s.blocks);
}

struct Oscarmax {
  static constexpr const char* kName = "oscarmax";
  static constexpr uint8_t kNanRow = kClusterNanRow;
  static void prox(ProxScratch& s, int64_t m, double lam) {
    s.local = -1;
    oscar_prox(s, m, lam);
  }
  static void record(const ProxScratch& s, int64_t m, double tau, uint8_t* flags, int32_t* ranks);
  static double backward(ProxScratch& s, int64_t m, double tau);
};

double Oscarmax::backward(ProxScratch& s, int64_t m, double /*tau: v is 0 off the support*/) {
  double dlam = 0.0;
  // (Every cluster's magnitude is clipped, or only the leading ones solved:
  // the others are off the support, their gradient 0.)
  if (s.zero_y || s.top_only) std::fill(s.dxs, s.dxs + m, 0.0);
  if (s.zero_y) return dlam;
  int64_t start = 0;
  for (int64_t b = 0; b < s.blocks; ++b) {
    const int64_t end = s.block_end[b];
    if (s.block_sum[b] / double(end - start) > 0.0) {
      dlam -= cluster_vjp(
          start, end, m, [&](int64_t k) { return s.order[k]; }, [&](int64_t i) { return sign_of(s.xs[i]); }, s.gs,
          [&](int64_t i, double d) { s.dxs[i] = d; });
    } else {  // clipped to 0
      for (int64_t k = start; k < end; ++k) s.dxs[s.order[k]] = 0.0;
    }
    start = end;
  }
  return dlam;
}

// What a forward keeps for its backward, per entry of x (null: nothing).
struct Saved {
  uint8_t* flags = nullptr;
  int32_t* ranks = nullptr;  // (oscarmax's)
};

// The segment bytes of the row's m finite entries, the i-th at seg[pos(i)].
template <typename Pos>
void record_segments(const ProxScratch& s, int64_t m, double tau, uint8_t* seg, Pos pos) {
  const double* y = s.y;
  auto byte = [&](int64_t i) {
    return uint8_t((y[i] != y[i - 1] ? kSegStart : 0) | (y[i] > y[i - 1] ? kSegUp : 0) | (y[i] > tau ? kSegSupport : 0));
  };
  if (s.local >= 0) {
    // y is -inf off its regions (or, solved for the row-wise forward, set
    // only on them and next to them), so only a region's entries and the one
    // after it can have a byte other than 0 (seg comes zeroed).
    const bool first_solved = s.regions > 0 && s.order_tmp[0] == 0;
    seg[pos(0)] = kSegFirst | kSegStart | (first_solved && y[0] > tau ? kSegSupport : 0);
    for (int64_t r = 0; r < s.regions; ++r) {
      const int64_t to = std::min(s.order_tmp[2 * r + 1] + 1, m - 1);
      for (int64_t i = std::max<int64_t>(s.order_tmp[2 * r], 1); i <= to; ++i) seg[pos(i)] = byte(i);
    }
    return;
  }
  seg[pos(0)] = kSegFirst | kSegStart | (y[0] > tau ? kSegSupport : 0);
  for (int64_t i = 1; i < m; ++i) seg[pos(i)] = byte(i);
}

void Fusedmax::record(const ProxScratch& s, int64_t m, double tau, uint8_t* seg, int32_t* /*ranks*/) {
  record_segments(s, m, tau, seg, [&](int64_t i) { return s.pos[i]; });
}

// The row-wise fusedmax forward of a row of finite float or double entries
// at stride 1 whose prox support_tv_prox solves around the support: read and
// written in place (no row in double, only the solved regions written after
// a zero fill). False (nothing written that the general path would not
// overwrite) for any other row.
template <typename T>
bool fusedmax_row_local(ProxScratch& s, const T* x, int64_t n, double lam, T* out, uint8_t* seg) {
  double top = 0.0, amax = 0.0;
  s.local = -1;
  if (n == 0 || !row_extremes(x, n, top, amax) ||
      !support_tv_prox(s, x, n, lam, std::numeric_limits<double>::quiet_NaN(), top, amax, false))
    return false;
  s.zero_y = false;
  const double tau = threshold(s, n);
  std::fill(out, out + n, T(0));
  for (int64_t r = 0; r < s.regions; ++r) {
    for (int64_t i = s.order_tmp[2 * r]; i <= s.order_tmp[2 * r + 1]; ++i)
      out[i] = static_cast<T>(std::max(s.y[i] - tau, 0.0));
  }
  if (seg) {
    std::memset(seg, 0, n);
    record_segments(s, n, tau, seg, [](int64_t i) { return i; });
  }
  return true;
}

// The flags every finite entry x of an oscarmax row carries (kFinite and x's
// sign), without branches: signs are coin flips on rows of scores.
template <typename T>
uint8_t finite_entry_flags(T x) {
  return uint8_t(kClusterFinite | (x > T(0)) * kClusterPositive | (x < T(0)) * kClusterNegative);
}

// oscarmax's pooled blocks into the flags (kNonzero, kBlockStart) and ranks of
// the finite entries, the i-th at flags[pos(i)] and ranks[pos(i)].
template <typename Pos>
void record_blocks(const ProxScratch& s, uint8_t* flags, int32_t* ranks, Pos pos) {
  int64_t start = 0;
  for (int64_t b = 0; b < s.blocks; ++b) {
    // (The same test as the prox's clip and Oscarmax::backward's.)
    const uint8_t nonzero = s.block_sum[b] / double(s.block_end[b] - start) > 0.0 ? kClusterNonzero : 0;
    for (int64_t k = start; k < s.block_end[b]; ++k) {
      const int64_t j = pos(s.order[k]);
      ranks[j] = int32_t(k);
      flags[j] |= nonzero | (k == start ? kClusterBlockStart : 0);
    }
    start = s.block_end[b];
  }
}

// The row-wise oscarmax forward of a row of finite float or double entries at
// stride 1 whose support oscar_prox_top finds in the head of the sort: read and
// written in place (only the head's entries in double, only their outputs
// written after a zero fill), with the bits of the general path. False
// (nothing written that the general path would not overwrite) for any other
// row.
template <typename T>
bool oscarmax_row_top(ProxScratch& s, const T* x, int64_t n, double lam, T* out, uint8_t* flags, int32_t* ranks) {
  // (oscar_prox_top counts in vectors of T, exact below 2^24 a lane.)
  constexpr int64_t kLongestRow = int64_t(1) << 24;
  double top = 0.0, amax = 0.0;
  s.local = -1;
  s.top_only = false;
  if (n < kOscarTopMinRow || n >= kLongestRow || !row_extremes(x, n, top, amax) || oscar_prox_is_zero(amax, n, lam))
    return false;
  s.zero_y = false;
  if (!oscar_prox_top(s, x, n, lam, amax, /*whole_y=*/false)) {
    s.top_failed = true;
    return false;
  }
  const double tau = threshold(s, n);
  const int64_t* order = s.order;
  const double* y = s.y;
  std::fill(out, out + n, T(0));
  for (int64_t k = 0; k < s.ranked; ++k) out[order[k]] = static_cast<T>(std::max(y[order[k]] - tau, 0.0));
  if (flags) {
    // (Record's flags: y is -inf, below tau, off the head.)
    for (int64_t i = 0; i < n; ++i) flags[i] = finite_entry_flags(x[i]);
    for (int64_t k = 0; k < s.ranked; ++k) flags[order[k]] |= (y[order[k]] > tau) * kClusterSupport;
    std::fill(ranks, ranks + n, int32_t(0));
    record_blocks(s, flags, ranks, [](int64_t i) { return i; });
  }
  return true;
}

void Oscarmax::record(const ProxScratch& s, int64_t m, double tau, uint8_t* flags, int32_t* ranks) {
  // (Locals: the byte stores could alias s's pointers.)
  const double *xs = s.xs, *y = s.y;
  const int64_t* pos = s.pos;
  auto flag = [&](int64_t i) { return uint8_t(finite_entry_flags(xs[i]) | (y[i] > tau) * kClusterSupport); };
  if (pos[m - 1] == m - 1) {  // (pos, increasing, is the identity: a loop the compiler vectorizes)
    for (int64_t i = 0; i < m; ++i) flags[i] = flag(i);
  } else {
    for (int64_t i = 0; i < m; ++i) flags[pos[i]] = flag(i);
  }
  if (s.zero_y) return;  // (no unclipped block: the backward reads no rank)
  record_blocks(s, flags, ranks, [&](int64_t i) { return pos[i]; });
}

template <typename Op, typename scalar_t>
void structured_fwd_impl(const Tensor& x, const Tensor& lam, Tensor& out, Saved saved, int64_t dim) {
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const double* lp = lam.const_data_ptr<double>();
  const int64_t n = lay.n;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    ProxScratch s(n);
    // (Rows at stride 1 keep their flags and ranks in place.)
    const bool in_place = lay.inner == 1;
    std::unique_ptr<uint8_t[]> staged_flags(saved.flags && !in_place ? new uint8_t[n] : nullptr);
    std::unique_ptr<int32_t[]> staged_ranks(saved.ranks && !in_place ? new int32_t[n] : nullptr);
    double* p = s.out;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      uint8_t* flags = !saved.flags ? nullptr : in_place ? saved.flags + base : staged_flags.get();
      int32_t* ranks = !saved.ranks ? nullptr : in_place ? saved.ranks + base : staged_ranks.get();
      if constexpr (std::is_same_v<Op, Fusedmax> &&
                    (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
        if (in_place && fusedmax_row_local(s, xp + base, n, lp[r], op + base, flags)) continue;
      }
      if constexpr (std::is_same_v<Op, Oscarmax> &&
                    (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
        if (in_place && oscarmax_row_top(s, xp + base, n, lp[r], op + base, flags, ranks)) continue;
      }
      lay.load(xp + base, s.row);
      int64_t m = 0;
      if (flags) std::fill(flags, flags + n, uint8_t(0));
      if (ranks) std::fill(ranks, ranks + n, int32_t(0));
      if (!finite_entries(s.row, n, s.xs, s.pos, m)) {
        std::fill(p, p + n, std::numeric_limits<double>::quiet_NaN());
        if (flags) std::fill(flags, flags + n, Op::kNanRow);
      } else {
        if (m < n) std::fill(p, p + n, 0.0);
        if (m > 0) {
          Op::prox(s, m, lp[r]);
          const double tau = threshold(s, m);
          if (s.local >= 0) {  // (0 off y's finite regions)
            if (m == n) std::fill(p, p + n, 0.0);
            for (int64_t r = 0; r < s.regions; ++r) {
              for (int64_t i = s.order_tmp[2 * r]; i <= s.order_tmp[2 * r + 1]; ++i)
                p[s.pos[i]] = std::max(s.y[i] - tau, 0.0);
            }
          } else if (m == n) {  // (pos is the identity)
            clip_below(s.y, tau, m, p);
          } else {
            for (int64_t i = 0; i < m; ++i) p[s.pos[i]] = std::max(s.y[i] - tau, 0.0);
          }
          if (flags) Op::record(s, m, tau, flags, ranks);
        }
      }
      lay.store(p, op + base);
      if (flags && !in_place) lay.store(flags, saved.flags + base);
      if (ranks && !in_place) lay.store(ranks, saved.ranks + base);
    }
  });
}

// flags / ranks: null, or set to what the forward keeps for its backward
// (ranks: oscarmax's only).
template <typename Op>
Tensor structured_forward(const Tensor& x_in, const Tensor& lam_in, int64_t dim, Tensor* flags, Tensor* ranks) {
  check_cpu_float(x_in, "x");
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor lam = checked_lam(lam_in, x, dim, Op::kName);
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  Saved saved;
  if (flags) {
    *flags = at::empty(x.sizes(), x.options().dtype(at::kByte));
    saved.flags = flags->mutable_data_ptr<uint8_t>();
  }
  if (ranks) {
    *ranks = at::empty(x.sizes(), x.options().dtype(at::kInt));
    saved.ranks = ranks->mutable_data_ptr<int32_t>();
  }
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_structured_fwd",
                                    [&] { structured_fwd_impl<Op, scalar_t>(x, lam, out, saved, dim); });
  }
  return out;
}

template <typename Op>
Tensor structured_fwd(const Tensor& x, const Tensor& lam, int64_t dim) {
  return structured_forward<Op>(x, lam, dim, nullptr, nullptr);
}

std::tuple<Tensor, Tensor> fusedmax_fwd_segments(const Tensor& x, const Tensor& lam, int64_t dim) {
  Tensor segments;
  Tensor p = structured_forward<Fusedmax>(x, lam, dim, &segments, nullptr);
  return {p, segments};
}

std::tuple<Tensor, Tensor, Tensor> oscarmax_fwd_clusters(const Tensor& x, const Tensor& lam, int64_t dim) {
  Tensor flags, ranks;
  Tensor p = structured_forward<Oscarmax>(x, lam, dim, &flags, &ranks);
  return {p, flags, ranks};
}

// The positions of the support entries (kSegSupport) of a row of n segment
// bytes, in index order, into pos; returns their count. Eight bytes at a
// time: supports are a few entries, so most words hold none.
int64_t support_positions(const uint8_t* seg, int64_t n, int64_t* pos) {
  constexpr uint64_t kSupportBits = 0x0101010101010101ULL * kSegSupport;
  int64_t k = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t word;
    std::memcpy(&word, seg + j, 8);
    // (Little-endian byte order: bit 8·b + 2 is byte b's support bit.)
    for (uint64_t bits = word & kSupportBits; bits != 0; bits &= bits - 1) pos[k++] = j + __builtin_ctzll(bits) / 8;
  }
  for (; j < n; ++j) {
    if (seg[j] & kSegSupport) pos[k++] = j;
  }
  return k;
}

// fusedmax's backward from its segments: math::sparsemax_vjp and
// math::fusedmax_vjp walked over the row's entries with the same operations in
// the same order, so it equals the backward that solves the prox again, bit
// for bit. Only the support's entries and their segments' ends are read: the
// gradient is 0 elsewhere. Rows at stride 1 are read and written in place.
template <typename scalar_t>
void fusedmax_bwd_segments_impl(const Tensor& segments, const Tensor& grad, Tensor& dx, Tensor& dlam, int64_t dim) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "support_positions reads bytes as little-endian words");
  const RowLayout lay = RowLayout::of(segments, dim);
  const uint8_t* sp = segments.const_data_ptr<uint8_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  double* dlp = dlam.defined() ? dlam.mutable_data_ptr<double>() : nullptr;
  const int64_t n = lay.n;
  const bool in_place = lay.inner == 1;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    std::unique_ptr<uint8_t[]> seg_row(in_place ? nullptr : new uint8_t[n]);
    std::unique_ptr<scalar_t[]> rows(in_place ? nullptr : new scalar_t[2 * n]);
    std::unique_ptr<int64_t[]> support(new int64_t[n]);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      const uint8_t* seg = sp + base;
      const scalar_t* g = gp + base;
      scalar_t* out = dp + base;
      if (!in_place) {
        lay.load(sp + base, seg_row.get());
        lay.load(gp + base, rows.get());
        seg = seg_row.get(), g = rows.get(), out = rows.get() + n;
      }
      double dl = 0.0;
      if (n > 0 && (seg[0] & kSegNanRow)) {
        std::fill(out, out + n, std::numeric_limits<scalar_t>::quiet_NaN());
        dl = std::numeric_limits<double>::quiet_NaN();
      } else {
        const int64_t k = support_positions(seg, n, support.get());
        double gsum = 0.0;
        for (int64_t t = 0; t < k; ++t) gsum += static_cast<double>(g[support[t]]);
        const double gmean = k > 0 ? gsum / double(k) : 0.0;
        std::fill(out, out + n, scalar_t(0));
        // Segments of y on the support, one at a time: from a support entry
        // (which starts its segment: the entry before it is off the support or
        // in another segment) to the next start; in between, entries at -inf
        // (byte 0) take no part. jump: the sign of y's jump into the segment
        // starting at an entry (0 at the row's first entry and past its end).
        auto jump = [](uint8_t b) { return (b & kSegFirst) ? 0.0 : ((b & kSegUp) ? 1.0 : -1.0); };
        for (int64_t t = 0; t < k;) {
          const int64_t first = support[t++];
          const double left = jump(seg[first]);
          double size = 1.0, vsum = 0.0;
          vsum += static_cast<double>(g[first]) - gmean;  // (from 0.0, as the solving backward: -0.0 sums to 0.0)
          int64_t j = first + 1;
          for (; j < n && !(seg[j] & kSegStart); ++j) {
            if (seg[j] & kSegSupport) {
              size += 1.0;
              vsum += static_cast<double>(g[j]) - gmean;
            }
          }
          const scalar_t value = static_cast<scalar_t>(vsum / size);
          out[first] = value;
          for (; t < k && support[t] < j; ++t) out[support[t]] = value;
          dl += ((j < n ? jump(seg[j]) : 0.0) - left) / size * vsum;
        }
      }
      if (!in_place) lay.store(out, dp + base);
      if (dlp) dlp[r] = dl;
    }
  });
}

std::tuple<Tensor, Tensor> fusedmax_bwd_segments(const Tensor& segments_in, const Tensor& grad_in,
                                                 const Tensor& lam_in, int64_t dim, bool lam_grad) {
  TORCH_CHECK(segments_in.device().is_cpu() && segments_in.scalar_type() == at::kByte,
              "attnkern: fusedmax_bwd_segments: segments must be the uint8 CPU tensor of fusedmax_fwd_segments");
  check_cpu_float(grad_in, "grad");
  check_cpu_float(lam_in, "lam");  // (its shape only: one dλ per row)
  TORCH_CHECK_VALUE(grad_in.sizes() == segments_in.sizes(), "attnkern: fusedmax_bwd_segments: grad of shape ",
                    grad_in.sizes(), " does not match segments of shape ", segments_in.sizes());
  dim = segments_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, segments_in.dim());
  check_row_length(segments_in, dim);
  const Tensor segments = segments_in.contiguous();
  const Tensor grad = grad_in.contiguous();
  Tensor dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  Tensor dl = lam_grad ? at::empty_like(per_row(lam_in, segments, dim, at::kDouble)) : Tensor();
  if (segments.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "attnkern_fusedmax_bwd_segments",
                                    [&] { fusedmax_bwd_segments_impl<scalar_t>(segments, grad, dx, dl, dim); });
  } else if (dl.defined()) {
    dl.zero_();
  }
  if (!dl.defined()) dl = at::empty({0}, grad.options().dtype(at::kDouble));
  return {dx, dl};
}

// oscarmax's backward from its clusters: math::sparsemax_vjp and
// Oscarmax::backward with the flags for y's tests and x's signs and the ranks
// for the sort order, the same operations in the same order, so it equals
// the backward that solves the prox again, bit for bit.
template <typename scalar_t>
void oscarmax_bwd_clusters_impl(const Tensor& flags_t, const Tensor& ranks_t, const Tensor& grad, Tensor& dx,
                                Tensor& dlam, int64_t dim) {
  const RowLayout lay = RowLayout::of(flags_t, dim);
  const uint8_t* fp = flags_t.const_data_ptr<uint8_t>();
  const int32_t* rp = ranks_t.const_data_ptr<int32_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  double* dlp = dlam.defined() ? dlam.mutable_data_ptr<double>() : nullptr;
  const int64_t n = lay.n;
  // x's sign from its flags, by a table: no branch (as sign_of).
  static_assert(kClusterPositive == 4 && kClusterNegative == 8);
  static constexpr double kSign[4] = {0.0, 1.0, -1.0, 0.0};
  auto sign = [](uint8_t f) { return kSign[(f >> 2) & 3]; };
  std::atomic<bool> bad_ranks_seen{false};
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    bool bad_ranks = false;
    // (Rows at stride 1 are read and written in place, others staged.)
    const bool in_place = lay.inner == 1;
    std::unique_ptr<scalar_t[]> staged_rows(in_place ? nullptr : new scalar_t[2 * n]);
    std::unique_ptr<int32_t[]> staged_ranks(in_place ? nullptr : new int32_t[n]);
    std::unique_ptr<uint8_t[]> staged_flags(in_place ? nullptr : new uint8_t[n]);
    std::unique_ptr<double[]> v(new double[n]);
    std::unique_ptr<int64_t[]> ibuf(new int64_t[3 * n]);
    int64_t *pos = ibuf.get(), *order = pos + n, *in_support = order + n;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      const uint8_t* flags = fp + base;
      const int32_t* ranks = rp + base;
      const scalar_t* g = gp + base;
      scalar_t* out = dp + base;
      if (!in_place) {
        lay.load(fp + base, staged_flags.get());
        flags = staged_flags.get();
        out = staged_rows.get() + n;
      }
      double dl = 0.0;
      uint8_t any = 0;
      for (int64_t j = 0; j < n; ++j) any |= flags[j];
      if (any & kClusterNanRow) {
        std::fill(out, out + n, std::numeric_limits<scalar_t>::quiet_NaN());
        dl = std::numeric_limits<double>::quiet_NaN();
      } else if (!(any & kClusterNonzero)) {  // every block clipped (y = 0): no gradient
        std::fill(out, out + n, scalar_t(0));
      } else {
        if (!in_place) {
          lay.load(rp + base, staged_ranks.get());
          lay.load(gp + base, staged_rows.get());
          ranks = staged_ranks.get();
          g = staged_rows.get();
        }
        std::fill(out, out + n, scalar_t(0));
        // Only the unclipped blocks carry a gradient (v is 0 off the support,
        // and a clipped block's entries get 0), and they lead the sort (the
        // fit is non-increasing): their entries' ranks are 0..count-1. One
        // pass over the flags, eight at a time (the support and the unclipped
        // blocks are usually a few entries): the finite entries counted, the
        // unclipped ones listed in index order, and the support's gradient
        // summed in index order as the solving backward sums it.
        static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "flags are read as little-endian words");
        constexpr uint64_t kBytes = 0x0101010101010101ULL, kFiniteBits = kBytes * kClusterFinite,
                           kListedBits = kBytes * (kClusterSupport | kClusterNonzero);
        // (Positions first, gradients after: the gradients' loads, scattered
        // over a row of memory, then overlap instead of waiting one by one
        // behind the scan's branches.)
        int64_t m = 0, count = 0, support = 0, j = 0;
        auto visit = [&](int64_t at, uint8_t f) {
          if (f & kClusterSupport) in_support[support++] = at;
          if (f & kClusterNonzero) pos[count++] = at;
        };
        for (; j + 8 <= n; j += 8) {
          uint64_t word;
          std::memcpy(&word, flags + j, 8);
          m += __builtin_popcountll(word & kFiniteBits);
          uint64_t bits = word & kListedBits;
          while (bits != 0) {
            const int64_t at = j + __builtin_ctzll(bits) / 8;
            visit(at, flags[at]);
            bits &= ~(uint64_t(0xff) << (8 * (at - j)));  // (the byte's other bit too)
          }
        }
        for (; j < n; ++j) {
          m += (flags[j] & kClusterFinite) != 0;
          visit(j, flags[j]);
        }
        double gsum = 0.0;
        for (int64_t t = 0; t < support; ++t) gsum += static_cast<double>(g[in_support[t]]);
        const double gmean = support > 0 ? gsum / double(support) : 0.0;
        // Their ranks must be a permutation of 0..count-1 (they index order):
        // anything else did not come from oscarmax_fwd_clusters.
        std::fill(order, order + count, int64_t(-1));
        for (int64_t i = 0; i < count; ++i) {
          const int64_t at = pos[i];
          v[i] = (flags[at] & kClusterSupport) ? static_cast<double>(g[at]) - gmean : 0.0;
          const int64_t k = ranks[at];
          if (k < 0 || k >= count || order[k] >= 0) {
            bad_ranks = true;
            break;
          }
          order[k] = i;
        }
        if (bad_ranks) break;
        int64_t start = 0;
        while (start < count) {
          int64_t stop = start + 1;
          while (stop < count && !(flags[pos[order[stop]]] & kClusterBlockStart)) ++stop;
          dl -= cluster_vjp(
              start, stop, m, [&](int64_t k) { return order[k]; }, [&](int64_t i) { return sign(flags[pos[i]]); },
              v.get(), [&](int64_t i, double d) { out[pos[i]] = static_cast<scalar_t>(d); });
          start = stop;
        }
      }
      if (!in_place) lay.store(out, dp + base);
      if (dlp) dlp[r] = dl;
    }
    if (bad_ranks) bad_ranks_seen = true;
  });
  TORCH_CHECK_VALUE(!bad_ranks_seen, "attnkern: oscarmax_bwd_clusters: ranks must be those of oscarmax_fwd_clusters ",
                    "(in each row, the entries of unclipped clusters ranked 0, 1, ... without repeats)");
}

std::tuple<Tensor, Tensor> oscarmax_bwd_clusters(const Tensor& flags_in, const Tensor& ranks_in,
                                                 const Tensor& grad_in, const Tensor& lam_in, int64_t dim,
                                                 bool lam_grad) {
  TORCH_CHECK(flags_in.device().is_cpu() && flags_in.scalar_type() == at::kByte,
              "attnkern: oscarmax_bwd_clusters: flags must be the uint8 CPU tensor of oscarmax_fwd_clusters");
  TORCH_CHECK(ranks_in.device().is_cpu() && ranks_in.scalar_type() == at::kInt,
              "attnkern: oscarmax_bwd_clusters: ranks must be the int32 CPU tensor of oscarmax_fwd_clusters");
  check_cpu_float(grad_in, "grad");
  check_cpu_float(lam_in, "lam");  // (its shape only: one dλ per row)
  TORCH_CHECK_VALUE(grad_in.sizes() == flags_in.sizes() && ranks_in.sizes() == flags_in.sizes(),
                    "attnkern: oscarmax_bwd_clusters: flags of shape ", flags_in.sizes(), ", ranks of shape ",
                    ranks_in.sizes(), " and grad of shape ", grad_in.sizes(), " must match");
  dim = flags_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, flags_in.dim());
  check_row_length(flags_in, dim);
  const Tensor flags = flags_in.contiguous();
  const Tensor ranks = ranks_in.contiguous();
  const Tensor grad = grad_in.contiguous();
  Tensor dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  Tensor dl = lam_grad ? at::empty_like(per_row(lam_in, flags, dim, at::kDouble)) : Tensor();
  if (flags.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "attnkern_oscarmax_bwd_clusters",
                                    [&] { oscarmax_bwd_clusters_impl<scalar_t>(flags, ranks, grad, dx, dl, dim); });
  } else if (dl.defined()) {
    dl.zero_();
  }
  if (!dl.defined()) dl = at::empty({0}, grad.options().dtype(at::kDouble));
  return {dx, dl};
}

template <typename Op, typename scalar_t>
void structured_bwd_impl(const Tensor& x, const Tensor& grad, const Tensor& lam, Tensor& dx, Tensor& dlam,
                         int64_t dim) {
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  const double* lp = lam.const_data_ptr<double>();
  double* dlp = dlam.defined() ? dlam.mutable_data_ptr<double>() : nullptr;
  const int64_t n = lay.n;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    ProxScratch s(n);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      lay.load(xp + base, s.row);
      lay.load(gp + base, s.g);
      int64_t m = 0;
      double dl = 0.0;
      if (!finite_entries(s.row, n, s.xs, s.pos, m)) {
        std::fill(s.out, s.out + n, std::numeric_limits<double>::quiet_NaN());
        dl = std::numeric_limits<double>::quiet_NaN();
      } else {
        std::fill(s.out, s.out + n, 0.0);
        if (m > 0) {
          for (int64_t i = 0; i < m; ++i) s.gs[i] = s.g[s.pos[i]];
          Op::prox(s, m, lp[r]);
          const double tau = threshold(s, m);
          sparsemax_vjp_rows(s.y, tau, s.gs, m, s.gs);
          dl = Op::backward(s, m, tau);
          for (int64_t i = 0; i < m; ++i) s.out[s.pos[i]] = s.dxs[i];
        }
      }
      lay.store(s.out, dp + base);
      if (dlp) dlp[r] = dl;
    }
  });
}

template <typename Op>
std::tuple<Tensor, Tensor> structured_bwd(const Tensor& x_in, const Tensor& grad_in, const Tensor& lam_in,
                                          int64_t dim, bool lam_grad) {
  check_cpu_float(x_in, "x");
  check_cpu_float(grad_in, "grad");
  TORCH_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), "attnkern: ", Op::kName, "_bwd: grad of shape ",
                    grad_in.sizes(), " does not match x of shape ", x_in.sizes());
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor grad = grad_in.to(x.scalar_type()).contiguous();
  const Tensor lam = checked_lam(lam_in, x, dim, Op::kName);
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dl = lam_grad ? at::empty_like(lam) : Tensor();
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_structured_bwd",
                                    [&] { structured_bwd_impl<Op, scalar_t>(x, grad, lam, dx, dl, dim); });
  } else if (dl.defined()) {
    dl.zero_();
  }
  if (!dl.defined()) dl = at::empty({0}, x.options().dtype(at::kDouble));
  return {dx, dl};
}

}  // namespace

ProxRow::ProxRow() = default;
ProxRow::~ProxRow() = default;

template <typename acc_t>
float ProxRow::solve(Prox prox, acc_t* row, int64_t n, double lam, float tau_hint) {
  if (n > capacity_) {
    s_ = std::make_unique<ProxScratch>(n);
    capacity_ = n;
  }
  ProxScratch& s = *s_;
  if (!finite_entries(row, n, s.xs, s.pos, m_)) {
    m_ = -1;
    std::fill(row, row + n, std::numeric_limits<acc_t>::quiet_NaN());
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (m_ == 0) {
    std::fill(row, row + n, acc_t(0));
    return std::numeric_limits<float>::infinity();
  }
  if (prox == Prox::kFusedmax) {
    Fusedmax::prox(s, m_, lam, tau_hint);
  } else {
    Oscarmax::prox(s, m_, lam);
  }
  tau_ = threshold(s, m_);
  if (s.local >= 0) {  // (0 off y's finite regions)
    std::fill(row, row + n, acc_t(0));
    for (int64_t r = 0; r < s.regions; ++r) {
      for (int64_t i = s.order_tmp[2 * r]; i <= s.order_tmp[2 * r + 1]; ++i)
        row[s.pos[i]] = static_cast<acc_t>(std::max(s.y[i] - tau_, 0.0));
    }
  } else if (m_ == n) {  // (no entry removed: pos is the identity)
    clip_below(s.y, tau_, n, s.out);
    for (int64_t i = 0; i < n; ++i) row[i] = static_cast<acc_t>(s.out[i]);
  } else {
    std::fill(row, row + n, acc_t(0));
    for (int64_t i = 0; i < m_; ++i) row[s.pos[i]] = static_cast<acc_t>(std::max(s.y[i] - tau_, 0.0));
  }
  return static_cast<float>(tau_);
}

template <typename acc_t>
double ProxRow::vjp(Prox prox, acc_t* d, int64_t n, acc_t scale) {
  if (m_ < 0) {
    std::fill(d, d + n, std::numeric_limits<acc_t>::quiet_NaN());
    return std::numeric_limits<double>::quiet_NaN();
  }
  ProxScratch& s = *s_;
  const bool dense = m_ == n;  // (pos is the identity)
  if (dense) {
    for (int64_t i = 0; i < n; ++i) s.gs[i] = static_cast<double>(d[i]);
  } else {
    for (int64_t i = 0; i < m_; ++i) s.gs[i] = static_cast<double>(d[s.pos[i]]);
    std::fill(d, d + n, acc_t(0));
  }
  if (m_ == 0) return 0.0;
  sparsemax_vjp_rows(s.y, tau_, s.gs, m_, s.gs);
  const double dlam = prox == Prox::kFusedmax ? Fusedmax::backward(s, m_, tau_) : Oscarmax::backward(s, m_, tau_);
  if (dense) {
    for (int64_t i = 0; i < n; ++i) d[i] = scale * static_cast<acc_t>(s.dxs[i]);
  } else {
    for (int64_t i = 0; i < m_; ++i) d[s.pos[i]] = scale * static_cast<acc_t>(s.dxs[i]);
  }
  return dlam;  // (λ applies to the scaled scores: no factor of scale)
}

template float ProxRow::solve<float>(Prox, float*, int64_t, double, float);
template float ProxRow::solve<double>(Prox, double*, int64_t, double, float);
template double ProxRow::vjp<float>(Prox, float*, int64_t, float);
template double ProxRow::vjp<double>(Prox, double*, int64_t, double);

void add_structured_kernels(KernelTable& t) {
  t.fusedmax_fwd = &structured_fwd<Fusedmax>;
  t.fusedmax_bwd = &structured_bwd<Fusedmax>;
  t.fusedmax_fwd_segments = &fusedmax_fwd_segments;
  t.fusedmax_bwd_segments = &fusedmax_bwd_segments;
  t.oscarmax_fwd = &structured_fwd<Oscarmax>;
  t.oscarmax_bwd = &structured_bwd<Oscarmax>;
  t.oscarmax_fwd_clusters = &oscarmax_fwd_clusters;
  t.oscarmax_bwd_clusters = &oscarmax_bwd_clusters;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

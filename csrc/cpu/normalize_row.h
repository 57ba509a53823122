// One row of a normalizer of the α-entmax family, forward: the row max, the
// special rows (NaN, +inf, all -inf) and the threshold from entmax_row.h.
// Shared by the row-wise normalizers (normalizers.cpp) and the fused losses
// (losses.cpp).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#include "attnkern/entmax_math.h"
#include "entmax_row.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

// Fills a row whose max m is NaN or infinite and returns true; false for an
// ordinary row.
template <typename acc_t>
inline bool special_row(acc_t m, acc_t* out, int64_t n) {
  if (m != m || m == std::numeric_limits<acc_t>::infinity()) {
    // NaN stays in its row; +inf scores make the row undefined (as torch.softmax).
    std::fill(out, out + n, std::numeric_limits<acc_t>::quiet_NaN());
    return true;
  }
  if (m == -std::numeric_limits<acc_t>::infinity()) {
    // Every entry masked: no support, zeros (never NaN).
    std::fill(out, out + n, acc_t(0));
    return true;
  }
  return false;
}

// Scratch of one thread: rows in the accumulation type (row and y: n
// entries each; work: 2n, as backward_row_sparse needs) and one of indices.
template <typename acc_t>
//
// The scratch is placed per row (place()) away from the row's own buffers
// modulo 4 KiB. A load whose address matches an earlier, still pending store
// in its low 12 bits waits for that store (4K aliasing), and the passes that
// compact a row store into the scratch (left-packed candidates, support
// entries, indices) at a few slowly moving addresses while they stream the
// row: a scratch at the row's offset modulo 4 KiB stalls those loads, and
// which offset a process gets depends on where its allocations land.
struct RowScratch {
  static constexpr int64_t kSlackBytes = 4096;
  static constexpr int64_t kPlaceFrom = 4096;  // row length from which place() moves the scratch
  int64_t n;
  std::vector<acc_t> buf;
  std::vector<int32_t> ibuf;
  int64_t off = 0, ioff = 0;  // the placement, in entries
  explicit RowScratch(int64_t n_)
      : n(n_), buf(4 * n_ + kSlackBytes / sizeof(acc_t)), ibuf(n_ + kSlackBytes / sizeof(int32_t)) {}
  acc_t* row() { return buf.data() + off; }
  acc_t* y() { return buf.data() + off + n; }
  acc_t* work() { return buf.data() + off + 2 * n; }
  int32_t* idx() { return ibuf.data() + ioff; }
  // Places the scratch for a row whose inputs (the buffers its passes load
  // while they store into the scratch) start at `rows` (at most four): the
  // starts of work() (the support entries and candidates) and idx() go to
  // the middle of the largest gap, modulo 4 KiB, between those inputs'
  // offsets. O(1) a row.
  void place(std::initializer_list<const void*> rows) {
    // Short rows keep the scratch where it is: a row's passes are over in a
    // few hundred loads, too few for the placement to pay for itself.
    if (n < kPlaceFrom) return;
    uint32_t res[4];
    int k = 0;
    for (const void* r : rows)
      if (r && k < 4) res[k++] = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(r) & 4095u);
    if (k == 0) return;
    // Insertion sort of at most four (std::sort here drew GCC 12 -Warray-bounds
    // false positives in every build).
    for (int i = 1; i < k; ++i)
      for (int j = i; j > 0 && res[j - 1] > res[j]; --j) std::swap(res[j - 1], res[j]);
    uint32_t gap = res[0] + 4096u - res[k - 1], mid = (res[k - 1] + gap / 2) & 4095u;
    for (int i = 1; i < k; ++i)
      if (res[i] - res[i - 1] > gap) gap = res[i] - res[i - 1], mid = res[i - 1] + gap / 2;
    const int64_t e = static_cast<int64_t>(sizeof(acc_t));
    auto shift = [&](uintptr_t start, int64_t elem) {
      return static_cast<int64_t>((mid - (start & 4095u)) & 4095u) / elem;
    };
    off = shift(reinterpret_cast<uintptr_t>(buf.data() + 2 * n), e);
    ioff = shift(reinterpret_cast<uintptr_t>(ibuf.data()), static_cast<int64_t>(sizeof(int32_t)));
  }
};

// normalize_row given x's max m and, where start_lanes<acc_t, FAM> asks for
// them, row_max's lanes (else nullptr).
template <typename acc_t, Family FAM>
inline void normalize_row_from_max(const acc_t* x, int64_t n, acc_t m, const acc_t* lanes, acc_t b, acc_t* out,
                                   acc_t* y, acc_t* work, int32_t* idx) {
  if (special_row(m, out, n)) return;
  if constexpr (FAM == Family::kSoftmax) {
    acc_t inv = acc_t(1) / exp_shifted(x, n, m, out);
    at::vec::map([inv](Vec<acc_t> v) { return v * Vec<acc_t>(inv); }, out, out, n);
  } else {
    solve_row<acc_t, FAM>(x, n, m, b, out, y, work, idx, lanes);
  }
}

// One row: x (contiguous, acc type, may alias out) -> out. y, work, idx: scratch.
template <typename acc_t, Family FAM>
inline void normalize_row(const acc_t* x, int64_t n, acc_t b, acc_t* out, acc_t* y, acc_t* work, int32_t* idx) {
  acc_t lanes_buf[kStartLanes<acc_t>];
  acc_t* lanes = start_lanes<acc_t, FAM>(lanes_buf, n);
  normalize_row_from_max<acc_t, FAM>(x, n, row_max(x, n, lanes), lanes, b, out, y, work, idx);
}

// normalize_row of a bfloat16 / half row src[0:n], widened into row[0:n]
// (float) as its max is taken (widen_row_max); the result in row.
template <typename scalar_t, Family FAM>
inline void normalize_row_widened(const scalar_t* src, int64_t n, float b, float* row, float* y, float* work,
                                  int32_t* idx) {
  float lanes_buf[kStartLanes<float>];
  float* lanes = start_lanes<float, FAM>(lanes_buf, n);
  normalize_row_from_max<float, FAM>(row, n, widen_row_max(src, n, row, lanes), lanes, b, row, y, work, idx);
}

// α > 2 (b > 1) in float32: p = d^(1/b) has an infinite slope where
// d = 1 + b(y - c) reaches 0, so d formed in float32 (an error of ~b·eps)
// moves the probabilities at the edge of the support by up to ~eps^(1/b).
// Such rows are solved in double (threshold and powers) and rounded once.
inline void normalize_row_wide(const float* x, int64_t n, float b, float* out, int32_t* idx) {
  thread_local std::vector<double> wide;
  if (static_cast<int64_t>(wide.size()) < 3 * n) wide.resize(3 * n);
  double* row = wide.data();
  for (int64_t i = 0; i < n; ++i) row[i] = x[i];
  normalize_row<double, Family::kGeneric>(row, n, static_cast<double>(b), row, row + n, row + 2 * n, idx);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(row[i]);
}

// α so far below 1 that n^(1 - α) overflows double (the bracket of the shift,
// (1 - n^(-b)) / b, is infinite): the weights are then uniform over the
// entries above -inf to far below double's resolution (with the shift c of
// order n^(-b), p_i ∝ (1 - b(c - y_i))^(1/b) spreads by ~|y_i| / c).
template <typename acc_t>
inline bool uniform_far_below_one(const acc_t* x, int64_t n, acc_t b, acc_t* out) {
  if (!(b < acc_t(0)) || std::isfinite(math::entmax_shift_upper<double>(n, static_cast<double>(b)))) return false;
  const acc_t m = row_max(x, n);
  if (special_row(m, out, n)) return true;
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) k += x[i] > ninf;
  const acc_t each = acc_t(1) / static_cast<acc_t>(k);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] > ninf ? each : acc_t(0);
  return true;
}

template <typename acc_t, Family FAM>
inline void normalize_row_alpha(const acc_t* x, int64_t n, acc_t b, acc_t* out, acc_t* y, acc_t* work,
                                int32_t* idx) {
  if constexpr (FAM == Family::kGeneric) {
    if (uniform_far_below_one(x, n, b, out)) return;
    math::with_family(math::family_of<acc_t>(b), [&](auto tag) {
      constexpr Family F = decltype(tag)::value;
      if constexpr (F == Family::kGeneric) {
        if constexpr (std::is_same_v<acc_t, float>) {
          if (b > 1.0f) return normalize_row_wide(x, n, b, out, idx);
          // α < 1 with n^(1 - α) beyond float32's range: the bracket of the
          // shift, (1 - n^(-b)) / b, overflows, and the search lost up to 10%
          // in the weights (α = -15 at n = 1000). Such rows run in double.
          if (b < 0.0f && !std::isfinite(math::entmax_shift_upper<float>(n, b)))
            return normalize_row_wide(x, n, b, out, idx);
        }
        normalize_row<acc_t, F>(x, n, b, out, y, work, idx);
      } else {
        normalize_row<acc_t, F>(x, n, math::fixed_b<F, acc_t>(), out, y, work, idx);
      }
    });
  } else {
    normalize_row<acc_t, FAM>(x, n, b, out, y, work, idx);
  }
}

// Two rows of the generic family: when both have 0 < b < 1 and both
// searches run on a list (solve_listed), the lists are gathered for both and
// the two searches advance in lockstep. A row's search is a few rounds, each
// a chain of dependent operations (powers, sums, a scalar update) with little
// work beside it; two independent chains overlap in the core. Any other pair
// goes one row at a time. Each row's result is the single-row one, bit for
// bit (the same operations per row), so the pairing does not depend on how
// rows are split among threads. out_i may alias x_i.
//
// next / next_out (bytes each; null: none) are the next pair's input and
// output in memory: once both lists are gathered, the rows themselves are
// not read again, and the searches that follow touch only the lists, so
// their cache lines are asked for then, to arrive while the searches run
// (at the start of a row they would compete with its own reads), a piece
// before each round (SpreadPrefetch: in one burst, the core would wait on
// them).
template <typename acc_t>
inline void normalize_generic_pair(const acc_t* x0, const acc_t* x1, int64_t n, acc_t b0, acc_t b1, acc_t* out0,
                                   acc_t* out1, RowScratch<acc_t>& s0, RowScratch<acc_t>& s1,
                                   const void* next = nullptr, void* next_out = nullptr, int64_t next_bytes = 0) {
  constexpr int64_t kLanes = kStartLanes<acc_t>;
  auto convex = [](acc_t b) {
    return math::family_of<acc_t>(b) == Family::kGeneric && b > acc_t(0) && b < acc_t(1);
  };
  auto one_by_one = [&] {
    normalize_row_alpha<acc_t, Family::kGeneric>(x0, n, b0, out0, s0.y(), s0.work(), s0.idx());
    normalize_row_alpha<acc_t, Family::kGeneric>(x1, n, b1, out1, s1.y(), s1.work(), s1.idx());
  };
  if (n < kLanes || !convex(b0) || !convex(b1)) return one_by_one();
  acc_t lanes0[kLanes], lanes1[kLanes];
  const acc_t m0 = row_max(x0, n, lanes0), m1 = row_max(x1, n, lanes1);
  if (!std::isfinite(m0) || !std::isfinite(m1)) return one_by_one();
  acc_t c0, c1;
  const int64_t k0 = listed_candidates<acc_t>(x0, n, m0, b0, lanes0, s0.y(), s0.idx(), c0);
  const int64_t k1 = listed_candidates<acc_t>(x1, n, m1, b1, lanes1, s1.y(), s1.idx(), c1);
  if (4 * k0 > n || 4 * k1 > n) return one_by_one();
  // The next pair's lines, a sixth of them before each search round (a
  // pair's searches take three rounds on most rows).
  SpreadPrefetch ahead(next, next_bytes, 6, false), ahead_out(next_out, next_bytes, 6, true);
  ListedSearch<acc_t> first(s0.y(), s0.idx(), k0, n, c0, b0, shift_upper_memo<acc_t>(n, b0), s0.work(), out0);
  ListedSearch<acc_t> second(s1.y(), s1.idx(), k1, n, c1, b1, shift_upper_memo<acc_t>(n, b1), s1.work(),
                             out1);
  auto ask_ahead = [&] {
    ahead.step();
    ahead_out.step();
  };
  bool on0 = true, on1 = true;
  while (on0 || on1) {
    ask_ahead();
    if (on0) on0 = first.advance();
    ask_ahead();
    if (on1) on1 = second.advance();
  }
  ahead.rest();
  ahead_out.rest();
  // A refused start (nothing written): that row from c = 0, as alone.
  if (first.refused) solve_generic_convex<acc_t>(x0, n, m0, b0, out0, s0.y(), s0.work(), s0.idx(), nullptr);
  if (second.refused) solve_generic_convex<acc_t>(x1, n, m1, b1, out1, s1.y(), s1.work(), s1.idx(), nullptr);
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

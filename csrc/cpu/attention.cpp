// Fused softmax / sparsemax / entmax15 / α-entmax attention on the CPU,
// forward and backward (the op contract is in csrc/attnkern.cpp).
//
// Softmax (tiled, as FlashAttention): a block of query rows meets the keys
// tile by tile; the forward keeps a running max and sum and rescales the
// output, the backward recomputes P from the saved log-sum-exp and uses
// δ = dO·O per row, so no row is ever held whole. Every product runs on the
// register-blocked kernel of tile_gemm.h over K and V packed once per head,
// not on BLAS calls that would repack their operands at every tile.
//
// Sparse normalizers: the scores of a block of BM query rows against every
// allowed key are computed with one GEMM into a buffer of BM x S floats that
// stays in L2, since the shift needs the whole row (find_shift in
// entmax_row.h). Probabilities are written in place, and P·V runs only over
// the key blocks (kBlockN keys) where some probability of the block is
// non-zero, or entry by entry over the support when it is small: sparsity
// turns into skipped work. The backward recomputes the scores from q and k
// and the saved shift, and skips the same key blocks in all of its GEMMs.
//
// Parallelism: the forward over batch x heads x query blocks. The backward
// over batch x kv-heads x chunks of query blocks; when batch x kv-heads is
// smaller than the thread count, the query blocks of a head are split into
// chunks with their own dK/dV accumulators, summed at the end, so both cores
// work even for a single head.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "attnkern/entmax_math.h"
#include "blas.h"
#include "dropout.h"
#include "entmax_row.h"
#include "tile_gemm.h"

namespace attnkern {
namespace cpu {
namespace {

using at::Tensor;

// Granularity of the zero-probability skipping, in keys.
constexpr int64_t kBlockN = 64;
// Below this fraction of non-zero probabilities in a block of rows, P·V and
// the backward run entry by entry over the support (gathering rows of k and
// v) instead of GEMMs over key blocks: a GEMM costs about 2·Ev flops per
// (query, key) pair whatever p is, a support entry a few dozen vector ops.
constexpr double kSparseDensity = 1.0 / 16;
// The backward's work per call is split into at least this many tasks
// (kv-heads x chunks of query blocks), whatever the thread count.
constexpr int64_t kBackwardTasks = 8;
// Target size of one score buffer (BM x S accumulation-type entries).
constexpr int64_t kScoreBufferBytes = 512 * 1024;

int64_t env_int(const char* name, int64_t fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  return std::max<int64_t>(1, std::atoll(s));
}

// Query rows per block: as many as keep the score buffer near
// kScoreBufferBytes, between 8 and 64 (GEMM efficiency drops below 8 rows).
// ATTNKERN_ATTN_BLOCK_M overrides it (for tuning).
int64_t block_rows(int64_t S, int64_t L, size_t elem) {
  int64_t bm = kScoreBufferBytes / (std::max<int64_t>(S, 1) * static_cast<int64_t>(elem));
  bm = std::clamp<int64_t>(bm, 8, 64);
  bm = env_int("ATTNKERN_ATTN_BLOCK_M", bm);
  return std::max<int64_t>(1, std::min(bm, std::max<int64_t>(L, 1)));
}

// Block index of the t-th task of a head, in an order that interleaves the
// early (cheap under a causal mask) and late blocks, so that at::parallel_for's
// contiguous split hands every thread a similar amount of work.
inline int64_t zigzag(int64_t t, int64_t nb) { return (t % 2 == 0) ? t / 2 : nb - 1 - t / 2; }

template <typename acc_t>
struct Problem {
  const acc_t* q;  // (B, H, L, E) contiguous
  const acc_t* k;  // (B, Hk, S, E) contiguous
  const acc_t* v;  // (B, Hk, S, Ev) contiguous
  const acc_t* mask = nullptr;  // (B, H, L, S) view with the strides below
  int64_t msb = 0, msh = 0, msl = 0, mss = 0;
  // E and Ev are multiples of kPanel<acc_t> (the op pads q, k, v with zeros).
  int64_t B, H, Hk, L, S, E, Ev;
  // K (and for the softmax backward V) of every (batch, kv-head) in key
  // panels (pack_panels), round_up_panel(S) keys per head; null when unused.
  const acc_t* kp = nullptr;
  const acc_t* vp = nullptr;
  acc_t scale;
  bool causal;
  // Per head: b = α - 1 and its family.
  std::vector<acc_t> b;
  std::vector<Family> fam;
  // Dropout on the weights (off when dropout_p = 0).
  Dropout drop;

  int64_t group() const { return H / Hk; }
  // The global index of query row i of (batch bi, head h): the dropout counter.
  int64_t row_id(int64_t bi, int64_t h, int64_t i) const { return (bi * H + h) * L + i; }
  // Keys a block of rows [i0, i0 + m) can see.
  int64_t keys_for(int64_t i0, int64_t m) const { return causal ? std::min(S, i0 + m) : S; }
  const acc_t* q_rows(int64_t bi, int64_t h, int64_t i0) const { return q + ((bi * H + h) * L + i0) * E; }
  const acc_t* k_head(int64_t bi, int64_t hk) const { return k + (bi * Hk + hk) * S * E; }
  const acc_t* v_head(int64_t bi, int64_t hk) const { return v + (bi * Hk + hk) * S * Ev; }
  const acc_t* kp_head(int64_t bi, int64_t hk) const { return kp + (bi * Hk + hk) * round_up_panel<acc_t>(S) * E; }
  const acc_t* vp_head(int64_t bi, int64_t hk) const { return vp + (bi * Hk + hk) * round_up_panel<acc_t>(S) * Ev; }
};

template <typename acc_t>
void add_row(acc_t* y, int64_t n, const acc_t* m, int64_t ms) {
  using V = Vec<acc_t>;
  if (ms == 1) {
    int64_t j = 0;
    for (; j + V::size() <= n; j += V::size()) (V::loadu(y + j) + V::loadu(m + j)).store(y + j);
    for (; j < n; ++j) y[j] += m[j];
  } else {
    for (int64_t j = 0; j < n; ++j) y[j] += m[j * ms];
  }
}

// y (m x n, row stride n) = scale · q_rows · kᵀ + mask, -inf above the causal
// diagonal.
template <typename acc_t>
void score_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, acc_t* y) {
  gemm<acc_t>(false, true, m, n, P.E, P.scale, P.q_rows(bi, h, i0), P.E, P.k_head(bi, h / P.group()), P.E,
              acc_t(0), y, n);
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * n;
    if (P.mask) add_row(row, n, P.mask + bi * P.msb + h * P.msh + (i0 + r) * P.msl, P.mss);
    if (P.causal) {
      for (int64_t j = i0 + r + 1; j < n; ++j) row[j] = -std::numeric_limits<acc_t>::infinity();
    }
  }
}

// Scores of one row in, probabilities out (sparse families; softmax goes
// through softmax_forward_block); returns the shift c with p = φ_b(s - c).
// No allowed key: zeros and c = +inf.
template <typename acc_t, Family FAM>
acc_t normalize_scores(acc_t* y, int64_t n, acc_t b, acc_t* work, int32_t* idx) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t m = row_max(y, n);
  if (m == -inf) {
    std::fill(y, y + n, acc_t(0));
    return inf;
  }
  if (m != m || m == inf) {
    std::fill(y, y + n, std::numeric_limits<acc_t>::quiet_NaN());
    return std::numeric_limits<acc_t>::quiet_NaN();
  }
  subtract(y, n, m);
  {
    acc_t norm;
    const acc_t c = find_shift<acc_t, FAM>(y, n, b, work, &norm);
    if constexpr (FAM == Family::kGeneric) {
      // Powers only over the support (work and idx are free again).
      write_probs_sparse<acc_t>(y, n, c, b, norm, y, work, idx);
    } else {
      write_probs<acc_t, FAM>(y, n, c, b, norm, y);
    }
    return m + c;
  }
}

// Whether x[0 .. w) holds anything but zeros (NaN counts as non-zero).
template <typename acc_t>
inline bool any_nonzero(const acc_t* x, int64_t w) {
  using V = Vec<acc_t>;
  constexpr int kAll = (1 << V::size()) - 1;
  int64_t j = 0;
  for (; j + V::size() <= w; j += V::size())
    if ((V::loadu(x + j).zero_mask() & kAll) != kAll) return true;
  for (; j < w; ++j)
    if (!(x[j] == acc_t(0))) return true;
  return false;
}

// Dropout on rows [0, m) of y (m x n, row stride ld) of one block whose
// first query row has global index row0: each weight times keep / (1 - p).
// Chunks of kBlockN keys where y holds only zeros are skipped (sparse rows):
// only kept weights matter. `also`, when given (row stride ld), gets the same
// factors on the same chunks (the backward's dP, whose entries outside the
// support multiply g = 0).
template <typename acc_t>
void apply_dropout(const Dropout& d, acc_t* y, int64_t m, int64_t n, int64_t ld, int64_t row0, int64_t j_base,
                   acc_t* also = nullptr) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < kBlockN) scratch.resize(kBlockN);
  float* kp = scratch.data();
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * ld;
    for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
      const int64_t w = std::min(kBlockN, n - j0);
      if (!any_nonzero(row + j0, w)) continue;
      dropout_keeps(d, row0 + r, j_base + j0, w, kp);
      apply_keep(row + j0, kp, w, d);
      if (also) apply_keep(also + r * ld + j0, kp, w, d);
    }
  }
}

// Runs of consecutive key blocks of y (m x n) holding any non-zero (or NaN)
// entry, as [start, end) key ranges.
template <typename acc_t>
void nonzero_runs(const acc_t* y, int64_t m, int64_t n, std::vector<std::pair<int64_t, int64_t>>& runs) {
  using V = Vec<acc_t>;
  runs.clear();
  for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
    const int64_t j1 = std::min(n, j0 + kBlockN);
    bool any = false;
    for (int64_t r = 0; r < m && !any; ++r) {
      const acc_t* row = y + r * n;
      int64_t j = j0;
      if (j1 - j0 >= V::size()) {
        V vm = V::loadu(row + j);
        for (j += V::size(); j + V::size() <= j1; j += V::size()) vm = at::vec::maximum(vm, V::loadu(row + j));
        const acc_t mx =
            at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); }, vm);
        any = !(mx == acc_t(0));
      }
      for (; j < j1 && !any; ++j) any = !(row[j] == acc_t(0));
    }
    if (!any) continue;
    if (!runs.empty() && runs.back().second == j0) {
      runs.back().second = j1;
    } else {
      runs.emplace_back(j0, j1);
    }
  }
}

// The support of each row of y (m x n) as CSR: the indices of the non-zero
// (or NaN) entries of row r are idx[ptr[r]:ptr[r+1]]. Gives up (returns
// false) once there are more than `limit` entries.
template <typename acc_t>
bool collect_support(const acc_t* y, int64_t m, int64_t n, int64_t limit, std::vector<int32_t>& idx,
                     std::vector<int64_t>& ptr) {
  idx.clear();
  ptr.assign(m + 1, 0);
  for (int64_t r = 0; r < m; ++r) {
    const acc_t* row = y + r * n;
    int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<acc_t, float> && Vec<float>::size() == 8) {
      const Vec<float> zero(0.f);
      for (; j + 8 <= n; j += 8) {
        int bits = _mm256_movemask_ps(static_cast<__m256>(Vec<float>::loadu(row + j) != zero));
        while (bits) {
          idx.push_back(static_cast<int32_t>(j + __builtin_ctz(bits)));
          bits &= bits - 1;
        }
      }
    }
#endif
    for (; j < n; ++j)
      if (!(row[j] == acc_t(0))) idx.push_back(static_cast<int32_t>(j));
    ptr[r + 1] = static_cast<int64_t>(idx.size());
    if (ptr[r + 1] > limit) return false;
  }
  return true;
}

template <typename acc_t>
inline void axpy(acc_t* y, const acc_t* x, acc_t a, int64_t n) {
  using V = Vec<acc_t>;
  const V va(a);
  int64_t e = 0;
  for (; e + V::size() <= n; e += V::size()) (V::loadu(y + e) + va * V::loadu(x + e)).store(y + e);
  for (; e < n; ++e) y[e] += a * x[e];
}

template <typename acc_t>
inline acc_t dot(const acc_t* x, const acc_t* y, int64_t n) {
  using V = Vec<acc_t>;
  V s(0);
  int64_t e = 0;
  for (; e + V::size() <= n; e += V::size()) s += V::loadu(x + e) * V::loadu(y + e);
  acc_t r = hsum(s);
  for (; e < n; ++e) r += x[e] * y[e];
  return r;
}

// ---------------------------------------------------------------- forward

// Keys per tile of the softmax forward and backward (a multiple of
// kPanel). ATTNKERN_ATTN_SOFTMAX_BLOCK_N overrides it (for tuning).
// Query rows per softmax block, forward and backward.
// ATTNKERN_ATTN_SOFTMAX_BLOCK_M overrides it (for tuning).
int64_t softmax_block_rows(int64_t L) {
  static const int64_t bm = env_int("ATTNKERN_ATTN_SOFTMAX_BLOCK_M", 128);
  return std::max<int64_t>(1, std::min(bm, L));
}

int64_t softmax_block_keys() {
  // A float panel is a whole number of double panels.
  static const int64_t bn = round_up_panel<float>(env_int("ATTNKERN_ATTN_SOFTMAX_BLOCK_N", 256));
  return bn;
}

// Scores of a tile: y (m x w, row stride ldy) = scale · q_rows · kᵀ over keys
// [j0, j0 + w) through the packed key panels, plus the mask, -inf above the
// causal diagonal. Columns [w, ldy) hold scores against zero padding keys.
template <typename acc_t>
void score_tile(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t w,
                acc_t* y, int64_t ldy) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  tile_gemm<acc_t>(m, ldy, P.E, P.scale, P.q_rows(bi, h, i0), P.E, 1, P.kp_head(bi, h / P.group()) + j0 * P.E,
                   kPanel<acc_t>, P.E * kPanel<acc_t>, y, ldy, false);
  if (!P.mask && !P.causal) return;
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * ldy;
    if (P.mask) add_row(row, w, P.mask + bi * P.msb + h * P.msh + (i0 + r) * P.msl + j0 * P.mss, P.mss);
    if (P.causal) {
      for (int64_t j = std::max<int64_t>(0, i0 + r + 1 - j0); j < w; ++j) row[j] = -inf;
    }
  }
}

// Softmax forward of one block of query rows, online over key tiles (as
// FlashAttention): the scores of a tile stay in L2 and the output is
// rescaled when the running max grows; o (m x Ev) accumulates P·V in place.
// y: m x softmax_block_keys() scratch; mrow, lrow: m entries.
template <typename acc_t>
void softmax_forward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                           acc_t* y, acc_t* o, float* c, acc_t* mrow, acc_t* lrow) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  const acc_t* vh = P.v_head(bi, h / P.group());
  const int64_t BN = softmax_block_keys();
  std::fill(mrow, mrow + m, -inf);
  std::fill(lrow, lrow + m, acc_t(0));
  for (int64_t j0 = 0; j0 < n; j0 += BN) {
    const int64_t w = std::min(BN, n - j0), ldy = round_up_panel<acc_t>(w);
    score_tile(P, bi, h, i0, m, j0, w, y, ldy);
    for (int64_t r = 0; r < m; ++r) {
      acc_t* row = y + r * ldy;
      const acc_t bm = row_max(row, w);
      const acc_t old = mrow[r];
      if (bm != bm || old != old) {
        std::fill(row, row + w, nan);
        mrow[r] = nan;
        continue;
      }
      const acc_t mx = std::max(old, bm);
      if (mx == -inf) {  // nothing allowed yet in this row
        std::fill(row, row + w, acc_t(0));
        continue;
      }
      const acc_t sum = exp_shifted(row, w, mx, row);  // exp_u20, in place
      if (mx != old) {
        const acc_t corr = std::exp(old - mx);  // 0 when old = -inf
        lrow[r] *= corr;
        if (old != -inf) {
          acc_t* orow = o + r * P.Ev;
          for (int64_t e = 0; e < P.Ev; ++e) orow[e] *= corr;
        }
        mrow[r] = mx;
      }
      lrow[r] += sum;
    }
    if (P.drop.on) apply_dropout(P.drop, y, m, w, ldy, P.row_id(bi, h, i0), j0);
    // The first tile writes o (rows with nothing allowed yet get 0 · V = 0).
    tile_gemm<acc_t>(m, P.Ev, w, acc_t(1), y, ldy, 1, vh + j0 * P.Ev, P.Ev, kPanel<acc_t>, o, P.Ev, j0 > 0);
  }
  for (int64_t r = 0; r < m; ++r) {
    acc_t* orow = o + r * P.Ev;
    if (mrow[r] != mrow[r]) {
      std::fill(orow, orow + P.Ev, nan);
      c[r] = std::numeric_limits<float>::quiet_NaN();
    } else if (mrow[r] == -inf || !(lrow[r] > acc_t(0))) {
      std::fill(orow, orow + P.Ev, acc_t(0));
      c[r] = std::numeric_limits<float>::infinity();
    } else {
      const acc_t f = acc_t(1) / lrow[r];
      for (int64_t e = 0; e < P.Ev; ++e) orow[e] *= f;
      c[r] = static_cast<float>(mrow[r] + std::log(lrow[r]));
    }
  }
}

template <typename acc_t>
void forward_kernel(const Problem<acc_t>& P, acc_t* out, float* shift) {
  // Softmax heads run online over key tiles and need only BM x
  // softmax_block_keys() of scores; the sparse normalizers need whole rows.
  const bool all_softmax = std::all_of(P.fam.begin(), P.fam.end(), [](Family f) { return f == Family::kSoftmax; });
  const int64_t BM = all_softmax ? softmax_block_rows(P.L) : block_rows(P.S, P.L, sizeof(acc_t));
  const int64_t tile = std::min(softmax_block_keys(), round_up_panel<acc_t>(P.S));
  const int64_t nb = (P.L + BM - 1) / BM;
  const int64_t tasks = P.B * P.H * nb;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> ybuf(BM * std::max<int64_t>({all_softmax ? 0 : P.S, tile, 1})),
        work(std::max<int64_t>(P.S, 1)), mrow(BM), lsum(BM);
    std::vector<int32_t> pidx(std::max<int64_t>(P.S, 1));
    FlushDenormals ftz;
    std::vector<std::pair<int64_t, int64_t>> runs;
    std::vector<int32_t> idx;
    std::vector<int64_t> ptr;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nb, bi = bh / P.H, h = bh % P.H;
      const int64_t i0 = zigzag(t % nb, nb) * BM, m = std::min(BM, P.L - i0);
      const int64_t n = P.keys_for(i0, m);
      acc_t* o = out + (bh * P.L + i0) * P.Ev;
      float* c = shift + bh * P.L + i0;
      if (n == 0) {
        std::fill(o, o + m * P.Ev, acc_t(0));
        std::fill(c, c + m, std::numeric_limits<float>::infinity());
        continue;
      }
      acc_t* y = ybuf.data();
      if (P.fam[h] == Family::kSoftmax) {
        softmax_forward_block(P, bi, h, i0, m, n, y, o, c, mrow.data(), lsum.data());
        continue;
      }
      score_block(P, bi, h, i0, m, n, y);
      const acc_t b = P.b[h];
      for (int64_t r = 0; r < m; ++r) {
        acc_t* row = y + r * n;
        acc_t cr;
        switch (P.fam[h]) {
          case Family::kSparsemax:
            cr = normalize_scores<acc_t, Family::kSparsemax>(row, n, b, work.data(), pidx.data());
            break;
          case Family::kEntmax15:
            cr = normalize_scores<acc_t, Family::kEntmax15>(row, n, b, work.data(), pidx.data());
            break;
          default:
            cr = normalize_scores<acc_t, Family::kGeneric>(row, n, b, work.data(), pidx.data());
        }
        c[r] = static_cast<float>(cr);
      }
      if (P.drop.on) apply_dropout(P.drop, y, m, n, n, P.row_id(bi, h, i0), 0);
      const acc_t* vh = P.v_head(bi, h / P.group());
      if (collect_support(y, m, n, static_cast<int64_t>(kSparseDensity * m * n), idx, ptr)) {
        std::fill(o, o + m * P.Ev, acc_t(0));
        for (int64_t r = 0; r < m; ++r) {
          const acc_t* prow = y + r * n;
          for (int64_t t = ptr[r]; t < ptr[r + 1]; ++t) axpy(o + r * P.Ev, vh + idx[t] * P.Ev, prow[idx[t]], P.Ev);
        }
        continue;
      }
      nonzero_runs(y, m, n, runs);
      if (runs.empty()) {
        std::fill(o, o + m * P.Ev, acc_t(0));
        continue;
      }
      bool first = true;
      for (auto [j0, j1] : runs) {
        gemm<acc_t>(false, false, m, P.Ev, j1 - j0, acc_t(1), y + j0, n, vh + j0 * P.Ev, P.Ev,
                    first ? acc_t(0) : acc_t(1), o, P.Ev);
        first = false;
      }
    }
  });
}

// --------------------------------------------------------------- backward

// p = φ_b(s - c) for one row of scores (in place). In double, the float32
// shift is refined by one Newton step so that p matches the forward to
// double precision (c is stored in float32 by the contract).
template <typename acc_t, Family FAM>
void recompute_probs(acc_t* y, int64_t n, acc_t c, acc_t b, acc_t* vals, int32_t* idx) {
  if (!(c < std::numeric_limits<acc_t>::infinity())) {
    if (c != c) {
      std::fill(y, y + n, std::numeric_limits<acc_t>::quiet_NaN());
    } else {
      std::fill(y, y + n, acc_t(0));
    }
    return;
  }
  if constexpr (FAM == Family::kSoftmax && std::is_same_v<acc_t, float>) {
    exp_shifted(y, n, c, y);
    return;
  }
  if constexpr (FAM == Family::kGeneric) {
    if (b > acc_t(1)) {
      // α > 2: a Newton step from the float32 shift is not enough near the
      // edge of the support (infinite slope there); solve the row again.
      normalize_scores<acc_t, Family::kGeneric>(y, n, b, vals, idx);
      return;
    }
  }
  if constexpr (std::is_same_v<acc_t, double>) {
    if constexpr (FAM == Family::kSoftmax) {
      acc_t sum_p = 0;
      for (int64_t j = 0; j < n; ++j) sum_p += std::exp(y[j] - c);
      if (sum_p > 0) c += std::log(sum_p);
    } else {
      acc_t sum_p = 0, sum_g = 0;
      eval_shift<acc_t, FAM>(y, n, c, b, sum_p, sum_g);
      if (sum_g > 0) c += (sum_p - acc_t(1)) / sum_g;
    }
  }
  if constexpr (FAM == Family::kGeneric) {
    write_probs_sparse<acc_t>(y, n, c, b, acc_t(1), y, vals, idx);
  } else {
    write_probs<acc_t, FAM>(y, n, c, b, acc_t(1), y);
  }
}

// Σ g and Σ g·dp over [j0, j1) of one row (g = p^(2-α) on the support).
template <typename acc_t, Family FAM>
inline Vec<acc_t> g_of(const Vec<acc_t>& p, acc_t b) {
  using V = Vec<acc_t>;
  if constexpr (FAM == Family::kSoftmax) {
    return p;
  } else if constexpr (FAM == Family::kSparsemax) {
    return V::blendv(V(acc_t(0)), V(acc_t(1)), p > V(acc_t(0)));
  } else if constexpr (FAM == Family::kEntmax15) {
    return p.sqrt();
  } else {
    // g = p^(1-b), p in (0, 1] on the support.
    V g = b < acc_t(1) ? pow_unit<acc_t>(p, acc_t(1) - b) : (V(acc_t(1) - b) * p.log()).exp();
    return V::blendv(V(acc_t(0)), g, p > V(acc_t(0)));
  }
}

template <typename acc_t, Family FAM>
void reduce_g(const acc_t* p, const acc_t* dp, int64_t n, acc_t b, acc_t& gsum, acc_t& gdp) {
  using V = Vec<acc_t>;
  V vs(0), vd(0);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V g = g_of<acc_t, FAM>(V::loadu(p + j), b);
    vs += g;
    vd += g * V::loadu(dp + j);
  }
  acc_t s = hsum(vs), d = hsum(vd);
  for (; j < n; ++j) {
    acc_t g = math::entmax_g_from_p<acc_t>(p[j], b, FAM);
    s += g;
    d += g * dp[j];
  }
  gsum += s;
  gdp += d;
}

// dp ← scale · g · (dp - mean), in place.
template <typename acc_t, Family FAM>
void apply_g(const acc_t* p, acc_t* dp, int64_t n, acc_t b, acc_t mean, acc_t scale) {
  using V = Vec<acc_t>;
  const V vmean(mean), vscale(scale);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V g = g_of<acc_t, FAM>(V::loadu(p + j), b);
    (vscale * g * (V::loadu(dp + j) - vmean)).store(dp + j);
  }
  for (; j < n; ++j) dp[j] = scale * math::entmax_g_from_p<acc_t>(p[j], b, FAM) * (dp[j] - mean);
}

// One row's contribution to dα (AlphaGradSums: every sum in double).
template <typename acc_t>
double alpha_grad_row(const acc_t* p, const acc_t* dp, const std::vector<std::pair<int64_t, int64_t>>& runs,
                      acc_t b) {
  math::AlphaGradSums sums;
  for (auto [j0, j1] : runs)
    for (int64_t j = j0; j < j1; ++j) sums.add(static_cast<double>(p[j]), static_cast<double>(dp[j]), b);
  return sums.grad(static_cast<double>(b));
}

template <typename acc_t, Family FAM>
void backward_rows(acc_t* y, acc_t* d, int64_t m, int64_t n, const std::vector<std::pair<int64_t, int64_t>>& runs,
                   acc_t b, acc_t scale, double* dalpha) {
  for (int64_t r = 0; r < m; ++r) {
    const acc_t* p = y + r * n;
    acc_t* dp = d + r * n;
    acc_t gsum = 0, gdp = 0;
    for (auto [j0, j1] : runs) reduce_g<acc_t, FAM>(p + j0, dp + j0, j1 - j0, b, gsum, gdp);
    if (dalpha) *dalpha += alpha_grad_row<acc_t>(p, dp, runs, b);
    const acc_t mean = gsum > acc_t(0) ? gdp / gsum : acc_t(0);
    for (auto [j0, j1] : runs) apply_g<acc_t, FAM>(p + j0, dp + j0, j1 - j0, b, mean, scale);
  }
}

// Backward of a block of rows over their supports (CSR idx/ptr), entry by
// entry: dp = dO·v_j, ds = scale·g·(dp - Σg dp/Σg), dq = Σ ds k_j,
// dk_j += ds q, dv_j += p dO.
template <typename acc_t, Family FAM>
void backward_sparse_rows(const Problem<acc_t>& P, const acc_t* y, int64_t m, int64_t n,
                          const std::vector<int32_t>& idx, const std::vector<int64_t>& ptr, acc_t b,
                          const acc_t* qb, const acc_t* dob, const acc_t* kh, const acc_t* vh, acc_t* dqb,
                          acc_t* dk, acc_t* dv, double* dalpha, std::vector<acc_t>& dps, int64_t row0,
                          std::vector<acc_t>& kept) {
  const Dropout& drop = P.drop;
  const acc_t dscale = static_cast<acc_t>(drop.scale);
  std::vector<acc_t> gs;
  for (int64_t r = 0; r < m; ++r) {
    const acc_t* prow = y + r * n;
    const acc_t* qr = qb + r * P.E;
    const acc_t* dor = dob + r * P.Ev;
    acc_t* dqr = dqb + r * P.E;
    std::fill(dqr, dqr + P.E, acc_t(0));
    const int64_t t0 = ptr[r], t1 = ptr[r + 1];
    if (t0 == t1) continue;
    dps.resize(t1 - t0);
    kept.resize(t1 - t0);
    acc_t gsum = 0, gdp = 0;
    math::AlphaGradSums asums;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j = idx[t];
      // With dropout, dp_j = dO·v_j · keep_j / (1 - p).
      const acc_t kj = drop.on ? static_cast<acc_t>(dropout_keep(drop, row0 + r, j)) * dscale : acc_t(1);
      kept[t - t0] = kj;
      const acc_t dpj = kj == acc_t(0) ? acc_t(0) : kj * dot(dor, vh + j * P.Ev, P.Ev);
      dps[t - t0] = dpj;
      const acc_t g = math::entmax_g_from_p<acc_t>(prow[j], b, FAM);
      gsum += g;
      gdp += g * dpj;
      if (dalpha) asums.add(static_cast<double>(prow[j]), static_cast<double>(dpj), b);
    }
    if (dalpha) *dalpha += asums.grad(static_cast<double>(b));
    acc_t pivot = 0, mean = gsum > acc_t(0) ? gdp / gsum : acc_t(0);
    if (FAM == Family::kGeneric && b > acc_t(1)) {
      // α > 2: the mean measured from a pivot (entmax_pivoted_mean says why).
      gs.resize(t1 - t0);
      for (int64_t t = t0; t < t1; ++t) gs[t - t0] = math::entmax_g_from_p<acc_t>(prow[idx[t]], b, FAM);
      const auto pm = math::entmax_pivoted_mean<acc_t>(gs.data(), dps.data(), t1 - t0);
      pivot = pm.pivot;
      mean = pm.shift;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j = idx[t];
      const acc_t pj = prow[j];
      const acc_t ds = P.scale * math::entmax_g_from_p<acc_t>(pj, b, FAM) * ((dps[t - t0] - pivot) - mean);
      axpy(dqr, kh + j * P.E, ds, P.E);
      axpy(dk + j * P.E, qr, ds, P.E);
      if (kept[t - t0] != acc_t(0)) axpy(dv + j * P.Ev, dor, pj * kept[t - t0], P.Ev);
    }
  }
}

// Softmax backward of one block of query rows over its key tiles, as
// FlashAttention: P is recomputed from the saved log-sum-exp c, δ = dO·O per
// row (delta) replaces Σ_j p_j dp_j, and dS = scale · P ⊙ (dO·Vᵀ − δ).
// dQ (dqb, m x E) = Σ over tiles of dS·K; dK += dSᵀ·Q and dV += Pᵀ·dO go
// into the chunk's accumulators dk, dv (S x E, S x Ev of this kv-head).
// y, d: m x softmax_block_keys() scratch; lse: m entries.
template <typename acc_t>
void softmax_backward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                            const float* c, const acc_t* delta, const acc_t* dob, acc_t* dqb, acc_t* dk,
                            acc_t* dv, acc_t* y, acc_t* d, acc_t* lse, std::vector<float>& keep) {
  using V = Vec<acc_t>;
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const int64_t hk = h / P.group();
  const acc_t* qb = P.q_rows(bi, h, i0);
  const acc_t* kh = P.k_head(bi, hk);
  const acc_t* vp = P.vp_head(bi, hk);
  const int64_t BN = softmax_block_keys();
  for (int64_t r = 0; r < m; ++r) lse[r] = static_cast<acc_t>(c[r]);
  if constexpr (std::is_same_v<acc_t, double>) {
    // The shift is stored in float32: one pass over the row's tiles sums
    // exp(s - c) and corrects c to double precision.
    std::vector<acc_t> sums(m, acc_t(0));
    for (int64_t j0 = 0; j0 < n; j0 += BN) {
      const int64_t w = std::min(BN, n - j0), ldy = round_up_panel<acc_t>(w);
      score_tile(P, bi, h, i0, m, j0, w, y, ldy);
      for (int64_t r = 0; r < m; ++r)
        if (std::isfinite(lse[r])) sums[r] += exp_shifted(y + r * ldy, w, lse[r], y + r * ldy);
    }
    for (int64_t r = 0; r < m; ++r)
      if (std::isfinite(lse[r]) && sums[r] > 0) lse[r] += std::log(sums[r]);
  }
  for (int64_t j0 = 0; j0 < n; j0 += BN) {
    const int64_t w = std::min(BN, n - j0), ldy = round_up_panel<acc_t>(w);
    score_tile(P, bi, h, i0, m, j0, w, y, ldy);
    for (int64_t r = 0; r < m; ++r) {
      acc_t* row = y + r * ldy;
      if (lse[r] != lse[r]) {
        std::fill(row, row + w, std::numeric_limits<acc_t>::quiet_NaN());
      } else if (lse[r] == inf) {  // no allowed key
        std::fill(row, row + w, acc_t(0));
      } else {
        exp_shifted(row, w, lse[r], row);
      }
    }
    // dP = dO·Vᵀ, then dS in place.
    tile_gemm<acc_t>(m, ldy, P.Ev, acc_t(1), dob, P.Ev, 1, vp + j0 * P.Ev, kPanel<acc_t>, P.Ev * kPanel<acc_t>, d,
                     ldy, false);
    if (P.drop.on) {
      // dP of the kept weights, times 1 / (1 - p); the same flags drop P for dV below.
      keep.resize(static_cast<size_t>(m * w));
      for (int64_t r = 0; r < m; ++r) {
        dropout_keeps(P.drop, P.row_id(bi, h, i0) + r, j0, w, keep.data() + r * w);
        apply_keep(d + r * ldy, keep.data() + r * w, w, P.drop);
      }
    }
    const V vscale(P.scale);
    for (int64_t r = 0; r < m; ++r) {
      const acc_t* prow = y + r * ldy;
      acc_t* drow = d + r * ldy;
      const V vdelta(delta[r]);
      int64_t j = 0;
      for (; j + V::size() <= w; j += V::size())
        (vscale * V::loadu(prow + j) * (V::loadu(drow + j) - vdelta)).store(drow + j);
      for (; j < w; ++j) drow[j] = P.scale * prow[j] * (drow[j] - delta[r]);
    }
    if (P.drop.on)
      for (int64_t r = 0; r < m; ++r) apply_keep(y + r * ldy, keep.data() + r * w, w, P.drop);
    // dV += Pᵀ·dO, dK += dSᵀ·Q (A read transposed), dQ (+)= dS·K.
    tile_gemm<acc_t>(w, P.Ev, m, acc_t(1), y, 1, ldy, dob, P.Ev, kPanel<acc_t>, dv + j0 * P.Ev, P.Ev, true);
    tile_gemm<acc_t>(w, P.E, m, acc_t(1), d, 1, ldy, qb, P.E, kPanel<acc_t>, dk + j0 * P.E, P.E, true);
    tile_gemm<acc_t>(m, P.E, w, acc_t(1), d, ldy, 1, kh + j0 * P.E, P.E, kPanel<acc_t>, dqb, P.E, j0 > 0);
  }
}

template <typename acc_t>
void backward_kernel(const Problem<acc_t>& P, const acc_t* dout, const float* shift, const acc_t* delta, acc_t* dq,
                     acc_t* dk_acc, acc_t* dv_acc, int64_t nchunks, double* dalpha_acc) {
  const int64_t BM = block_rows(P.S, P.L, sizeof(acc_t));
  const int64_t nb = (P.L + BM - 1) / BM;
  const int64_t BMs = softmax_block_rows(P.L);
  const int64_t nbs = (P.L + BMs - 1) / BMs;
  const int64_t G = P.group();
  const int64_t tasks = P.B * P.Hk * nchunks;
  const int64_t kv_head_k = P.S * P.E, kv_head_v = P.S * P.Ev;
  // Softmax heads take the tiled path unless dα is wanted (α-entmax heads in
  // the softmax limit): the row-buffer path below reduces it.
  auto tiled = [&](int64_t h) { return P.fam[h] == Family::kSoftmax && dalpha_acc == nullptr; };
  bool any_tiled = false, any_rows = false;
  for (int64_t h = 0; h < P.H; ++h) (tiled(h) ? any_tiled : any_rows) = true;
  const int64_t buf = std::max<int64_t>(
      {any_rows ? BM * P.S : 0, any_tiled ? BMs * std::min(softmax_block_keys(), round_up_panel<acc_t>(P.S)) : 0, 1});
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int64_t Sb = std::max<int64_t>(P.S, 1);
    std::vector<acc_t> ybuf(buf), dbuf(buf), dps, kept, pvals(std::max<int64_t>(Sb, 1)), lse(BMs), pvals_block;
    std::vector<float> keep;
    std::vector<int32_t> pidx(std::max<int64_t>(Sb, 1));
    FlushDenormals ftz;
    std::vector<std::pair<int64_t, int64_t>> runs;
    std::vector<int32_t> idx;
    std::vector<int64_t> ptr;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunk = t % nchunks, bk = t / nchunks, bi = bk / P.Hk, hk = bk % P.Hk;
      acc_t* dk = dk_acc + (chunk * P.B * P.Hk + bk) * kv_head_k;
      acc_t* dv = dv_acc + (chunk * P.B * P.Hk + bk) * kv_head_v;
      const acc_t* kh = P.k_head(bi, hk);
      const acc_t* vh = P.v_head(bi, hk);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        const int64_t bh = bi * P.H + h;
        double* da = dalpha_acc ? dalpha_acc + (chunk * P.B + bi) * P.H + h : nullptr;
        const bool tiled_h = tiled(h);
        const int64_t bm = tiled_h ? BMs : BM, nbh = tiled_h ? nbs : nb;
        for (int64_t u = chunk; u < nbh; u += nchunks) {
          const int64_t i0 = zigzag(u, nbh) * bm, m = std::min(bm, P.L - i0);
          const int64_t n = P.keys_for(i0, m);
          acc_t* dqb = dq + (bh * P.L + i0) * P.E;
          if (n == 0) {
            std::fill(dqb, dqb + m * P.E, acc_t(0));
            continue;
          }
          if (tiled_h) {
            softmax_backward_block(P, bi, h, i0, m, n, shift + bh * P.L + i0, delta + bh * P.L + i0,
                                   dout + (bh * P.L + i0) * P.Ev, dqb, dk, dv, ybuf.data(), dbuf.data(), lse.data(),
                                   keep);
            continue;
          }
          acc_t* y = ybuf.data();
          acc_t* d = dbuf.data();
          score_block(P, bi, h, i0, m, n, y);
          const acc_t b = P.b[h];
          const float* c = shift + bh * P.L + i0;
          const acc_t* qb = P.q_rows(bi, h, i0);
          const acc_t* dob = dout + (bh * P.L + i0) * P.Ev;
          for (int64_t r = 0; r < m; ++r) {
            acc_t* row = y + r * n;
            const acc_t cr = static_cast<acc_t>(c[r]);
            switch (P.fam[h]) {
              case Family::kSoftmax:
                recompute_probs<acc_t, Family::kSoftmax>(row, n, cr, b, pvals.data(), pidx.data());
                break;
              case Family::kSparsemax:
                recompute_probs<acc_t, Family::kSparsemax>(row, n, cr, b, pvals.data(), pidx.data());
                break;
              case Family::kEntmax15:
                recompute_probs<acc_t, Family::kEntmax15>(row, n, cr, b, pvals.data(), pidx.data());
                break;
              default:
                recompute_probs<acc_t, Family::kGeneric>(row, n, cr, b, pvals.data(), pidx.data());
            }
          }
          // α > 2 always goes entry by entry, where its mean is pivoted.
          const int64_t max_entries = P.b[h] > acc_t(1) ? m * n : static_cast<int64_t>(kSparseDensity * m * n);
          if (P.fam[h] != Family::kSoftmax && collect_support(y, m, n, max_entries, idx, ptr)) {
            switch (P.fam[h]) {
              case Family::kSparsemax:
                backward_sparse_rows<acc_t, Family::kSparsemax>(P, y, m, n, idx, ptr, b, qb, dob, kh, vh, dqb, dk,
                                                                dv, da, dps, P.row_id(bi, h, i0), kept);
                break;
              case Family::kEntmax15:
                backward_sparse_rows<acc_t, Family::kEntmax15>(P, y, m, n, idx, ptr, b, qb, dob, kh, vh, dqb, dk,
                                                               dv, da, dps, P.row_id(bi, h, i0), kept);
                break;
              default:
                backward_sparse_rows<acc_t, Family::kGeneric>(P, y, m, n, idx, ptr, b, qb, dob, kh, vh, dqb, dk,
                                                              dv, da, dps, P.row_id(bi, h, i0), kept);
            }
            continue;
          }
          if (P.fam[h] == Family::kSoftmax && !P.mask) {
            runs.assign(1, {0, n});
          } else {
            nonzero_runs(y, m, n, runs);
          }
          if (runs.empty()) {
            std::fill(dqb, dqb + m * P.E, acc_t(0));
            continue;
          }
          // dP = dO · Vᵀ on the runs.
          for (auto [j0, j1] : runs)
            gemm<acc_t>(false, true, m, j1 - j0, P.Ev, acc_t(1), dob, P.Ev, vh + j0 * P.Ev, P.Ev, acc_t(0), d + j0,
                        n);
          // With dropout: dP of the kept weights, times 1 / (1 - p), and P
          // dropped for dV, on the support's key chunks (elsewhere g = 0 and
          // p = 0); the normalizer's backward needs P whole, so it runs on a copy.
          std::vector<acc_t>& pkept = pvals_block;
          if (P.drop.on) {
            pkept.assign(y, y + m * n);
            apply_dropout(P.drop, pkept.data(), m, n, n, P.row_id(bi, h, i0), 0, d);
          }
          switch (P.fam[h]) {
            case Family::kSoftmax:
              backward_rows<acc_t, Family::kSoftmax>(y, d, m, n, runs, b, P.scale, da);
              break;
            case Family::kSparsemax:
              backward_rows<acc_t, Family::kSparsemax>(y, d, m, n, runs, b, P.scale, da);
              break;
            case Family::kEntmax15:
              backward_rows<acc_t, Family::kEntmax15>(y, d, m, n, runs, b, P.scale, da);
              break;
            default:
              backward_rows<acc_t, Family::kGeneric>(y, d, m, n, runs, b, P.scale, da);
          }
          if (P.drop.on) std::copy(pkept.begin(), pkept.end(), y);
          bool first = true;
          for (auto [j0, j1] : runs) {
            const int64_t w = j1 - j0;
            // dQ = dS · K, dK += dSᵀ · Q, dV += Pᵀ · dO.
            gemm<acc_t>(false, false, m, P.E, w, acc_t(1), d + j0, n, kh + j0 * P.E, P.E,
                        first ? acc_t(0) : acc_t(1), dqb, P.E);
            gemm<acc_t>(true, false, w, P.E, m, acc_t(1), d + j0, n, qb, P.E, acc_t(1), dk + j0 * P.E, P.E);
            gemm<acc_t>(true, false, w, P.Ev, m, acc_t(1), y + j0, n, dob, P.Ev, acc_t(1), dv + j0 * P.Ev, P.Ev);
            first = false;
          }
        }
      }
    }
  });
}

// ------------------------------------------------------------------- ops

Family normalizer_family(c10::string_view name) {
  if (name == "softmax") return Family::kSoftmax;
  if (name == "sparsemax") return Family::kSparsemax;
  if (name == "entmax15") return Family::kEntmax15;
  if (name == "entmax") return Family::kGeneric;
  TORCH_CHECK(false, "attnkern.attention: normalizer must be one of softmax, sparsemax, entmax15, entmax; got '",
              std::string(name), "'");
}

struct Checked {
  int64_t B, H, Hk, L, S, E, Ev;
  at::ScalarType acc;
};

Checked check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  for (auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), "attnkern.attention: expected CPU tensors");
    TORCH_CHECK(at::isFloatingType(t->scalar_type()), "attnkern.attention: q, k, v must be floating point");
    TORCH_CHECK(t->dim() == 4, "attnkern.attention: q, k, v must be 4-d (B, H, L, E), got ", t->dim(), "-d");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attnkern.attention: q, k, v must have one dtype");
  Checked c;
  c.B = q.size(0), c.H = q.size(1), c.L = q.size(2), c.E = q.size(3);
  c.Hk = k.size(1), c.S = k.size(2), c.Ev = v.size(3);
  TORCH_CHECK(k.size(0) == c.B && v.size(0) == c.B, "attnkern.attention: batch sizes differ");
  TORCH_CHECK(k.size(3) == c.E, "attnkern.attention: q and k head dims differ");
  TORCH_CHECK(v.size(1) == c.Hk && v.size(2) == c.S, "attnkern.attention: k and v shapes differ");
  TORCH_CHECK(c.Hk > 0 && c.H % c.Hk == 0, "attnkern.attention: query heads (", c.H,
              ") must be a multiple of key/value heads (", c.Hk, ")");
  c.acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return c;
}

template <typename acc_t>
Problem<acc_t> make_problem(const Checked& c, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& mask, bool is_causal, double scale, Family fam, const Tensor& alpha) {
  Problem<acc_t> P;
  P.q = q.const_data_ptr<acc_t>();
  P.k = k.const_data_ptr<acc_t>();
  P.v = v.const_data_ptr<acc_t>();
  P.B = c.B, P.H = c.H, P.Hk = c.Hk, P.L = c.L, P.S = c.S, P.E = q.size(3), P.Ev = v.size(3);
  P.scale = static_cast<acc_t>(scale);
  P.causal = is_causal;
  if (mask.defined()) {
    P.mask = mask.const_data_ptr<acc_t>();
    P.msb = mask.stride(0), P.msh = mask.stride(1), P.msl = mask.stride(2), P.mss = mask.stride(3);
  }
  P.b.resize(c.H);
  P.fam.resize(c.H);
  for (int64_t h = 0; h < c.H; ++h) {
    if (fam == Family::kGeneric) {
      const acc_t b = static_cast<acc_t>(alpha.const_data_ptr<float>()[h]) - acc_t(1);
      P.b[h] = b;
      P.fam[h] = math::family_of<acc_t>(b);
    } else {
      P.fam[h] = fam;
      P.b[h] = fam == Family::kSparsemax ? acc_t(1) : fam == Family::kEntmax15 ? acc_t(0.5) : acc_t(0);
    }
  }
  return P;
}

Tensor prepare_mask(const c10::optional<Tensor>& mask, const Checked& c) {
  if (!mask.has_value() || !mask->defined()) return Tensor();
  TORCH_CHECK(mask->device().is_cpu(), "attnkern.attention: mask must be a CPU tensor");
  TORCH_CHECK(at::isFloatingType(mask->scalar_type()),
              "attnkern.attention: mask must be a float tensor (-inf = not allowed), got ", mask->scalar_type());
  // Keeps broadcast dimensions as stride-0 views; only the last dim is made
  // unit-stride when it is neither 1 nor 0.
  Tensor m = mask->to(c.acc).expand({c.B, c.H, c.L, c.S});
  if (m.stride(3) != 1 && m.stride(3) != 0 && c.S > 1) m = m.contiguous();
  return m;
}

Dropout prepare_dropout(double dropout_p, const c10::optional<Tensor>& seed, int64_t S) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "attnkern.attention: dropout_p must be in [0, 1), got ",
              dropout_p);
  if (dropout_p == 0.0) return Dropout();
  TORCH_CHECK(seed.has_value() && seed->defined() && seed->numel() == 1 && seed->scalar_type() == at::kLong,
              "attnkern.attention: dropout_p > 0 needs dropout_seed, an int64 tensor of one element");
  return Dropout::make(dropout_p, static_cast<uint64_t>(seed->item<int64_t>()), S);
}

// Sums acc (n, count) over its first dim into out (count), in chunk order
// whatever the thread count (each entry is summed by one thread).
template <typename scalar_t>
void sum_chunks(const Tensor& acc, Tensor& out) {
  const int64_t n = acc.size(0), count = out.numel();
  const scalar_t* a = acc.const_data_ptr<scalar_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scalar_t t = a[i];
      for (int64_t c = 1; c < n; ++c) t += a[c * count + i];
      o[i] = t;
    }
  });
}

// α > 2 with float32 (or half) inputs runs in double, from those inputs, and
// rounds once: the weights have an infinite slope at the edge of the support,
// so the rounding of float32 scores moves them by far more than float32's
// resolution, and in the backward g = p^(2-α), unbounded there, multiplies the
// rounding of dp = dO·v_j.
void widen_for_alpha_above_two(Checked& c, const Tensor& alpha) {
  if (alpha.defined() && c.acc == at::kFloat && (alpha > 2.0f).any().item<bool>()) c.acc = at::kDouble;
}

Tensor prepare_alpha(const c10::optional<Tensor>& alpha, Family fam, const Checked& c) {
  if (fam != Family::kGeneric) return Tensor();
  TORCH_CHECK(alpha.has_value() && alpha->defined(), "attnkern.attention: normalizer 'entmax' needs alpha");
  TORCH_CHECK(alpha->numel() == c.H, "attnkern.attention: alpha must have one value per query head (", c.H,
              "), got shape ", alpha->sizes());
  Tensor a = alpha->to(at::kFloat).contiguous().view({c.H});
  auto ac = a.accessor<float, 1>();
  for (int64_t h = 0; h < c.H; ++h) TORCH_CHECK(ac[h] > 0, "attnkern.attention: alpha must be > 0, got ", ac[h]);
  return a;
}

// t (..., d) contiguous in the accumulation type, zero-padded to `width`
// columns (no copy when it already has them).
Tensor padded(const Tensor& t, at::ScalarType acc, int64_t width) {
  Tensor x = t.to(acc).contiguous();
  if (x.size(-1) == width) return x;
  return at::constant_pad_nd(x, {0, width - x.size(-1)}, 0).contiguous();
}

// One packed copy (pack_panels) of each (batch, kv-head) of x (B, Hk, S, d).
template <typename acc_t>
Tensor pack_heads(const Tensor& x) {
  const int64_t heads = x.size(0) * x.size(1), S = x.size(2), d = x.size(3), Sp = round_up_panel<acc_t>(S);
  Tensor packed = at::empty({heads * Sp * d}, x.options());
  const acc_t* src = x.const_data_ptr<acc_t>();
  acc_t* dst = packed.mutable_data_ptr<acc_t>();
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack_panels(src + i * S * d, S, d, d, dst + i * Sp * d);
  });
  return packed;
}

template <typename acc_t>
bool has_softmax_head(const Problem<acc_t>& P) {
  return std::any_of(P.fam.begin(), P.fam.end(), [](Family f) { return f == Family::kSoftmax; });
}

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                         const c10::optional<Tensor>& mask_in, bool is_causal, double scale,
                                         c10::string_view normalizer, const c10::optional<Tensor>& alpha_in,
                                         double dropout_p, const c10::optional<Tensor>& dropout_seed) {
  Checked c = check_inputs(q_in, k_in, v_in);
  const Family fam = normalizer_family(normalizer);
  const Dropout drop = prepare_dropout(dropout_p, dropout_seed, c.S);
  Tensor alpha = prepare_alpha(alpha_in, fam, c);
  widen_for_alpha_above_two(c, alpha);
  Tensor mask = prepare_mask(mask_in, c);
  Tensor out;
  Tensor shift = at::empty({c.B, c.H, c.L}, q_in.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES(c.acc, "attnkern_attention_fwd", [&] {
    const int64_t Ep = round_up_panel<scalar_t>(c.E), Evp = round_up_panel<scalar_t>(c.Ev);
    Tensor q = padded(q_in, c.acc, Ep), k = padded(k_in, c.acc, Ep), v = padded(v_in, c.acc, Evp);
    Tensor out_p = at::empty({c.B, c.H, c.L, Evp}, q.options());
    if (out_p.numel() > 0 || shift.numel() > 0) {
      auto P = make_problem<scalar_t>(c, q, k, v, mask, is_causal, scale, fam, alpha);
      P.drop = drop;
      Tensor kpack = has_softmax_head(P) ? pack_heads<scalar_t>(k) : Tensor();
      if (kpack.defined()) P.kp = kpack.const_data_ptr<scalar_t>();
      forward_kernel<scalar_t>(P, out_p.mutable_data_ptr<scalar_t>(), shift.mutable_data_ptr<float>());
    }
    out = Evp == c.Ev ? out_p : out_p.narrow(3, 0, c.Ev).contiguous();
  });
  return {out.to(q_in.scalar_type()), shift};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_bwd(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const c10::optional<Tensor>& mask_in, bool is_causal, double scale, c10::string_view normalizer,
    const c10::optional<Tensor>& alpha_in, const Tensor& out, const Tensor& shift_in, bool alpha_grad,
    double dropout_p, const c10::optional<Tensor>& dropout_seed) {
  Checked c = check_inputs(q_in, k_in, v_in);
  const Family fam = normalizer_family(normalizer);
  const Dropout drop = prepare_dropout(dropout_p, dropout_seed, c.S);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef({c.B, c.H, c.L, c.Ev}),
              "attnkern.attention_bwd: grad_out must have shape (B, H, L, Ev)");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({c.B, c.H, c.L, c.Ev}),
              "attnkern.attention_bwd: out must have shape (B, H, L, Ev)");
  TORCH_CHECK(shift_in.sizes() == at::IntArrayRef({c.B, c.H, c.L}),
              "attnkern.attention_bwd: shift must have shape (B, H, L)");
  Tensor shift = shift_in.to(at::kFloat).contiguous();
  Tensor alpha = prepare_alpha(alpha_in, fam, c);
  const bool want_alpha = alpha_grad && fam == Family::kGeneric;
  widen_for_alpha_above_two(c, alpha);
  Tensor mask = prepare_mask(mask_in, c);

  // The query blocks of each kv-head are split into chunks with dK/dV
  // accumulators of their own, so that a call with fewer kv-heads than cores
  // still uses every core. The split is fixed (not the thread count's), and the
  // chunks are summed in order, so results do not depend on the thread count.
  const int64_t bhk = c.B * c.Hk;
  const int64_t BM = block_rows(c.S, c.L, c.acc == at::kDouble ? 8 : 4);
  const int64_t nb = (c.L + BM - 1) / BM;
  const int64_t nchunks = std::clamp<int64_t>((kBackwardTasks + bhk - 1) / std::max<int64_t>(bhk, 1), 1,
                                              std::max<int64_t>(nb, 1));

  Tensor dq, dk, dv;
  Tensor dalpha_acc = want_alpha ? at::zeros({nchunks, c.B, c.H}, q_in.options().dtype(at::kDouble)) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(c.acc, "attnkern_attention_bwd", [&] {
    const int64_t Ep = round_up_panel<scalar_t>(c.E), Evp = round_up_panel<scalar_t>(c.Ev);
    Tensor q = padded(q_in, c.acc, Ep), k = padded(k_in, c.acc, Ep), v = padded(v_in, c.acc, Evp);
    Tensor dout = padded(grad_out, c.acc, Evp);
    Tensor dq_p = at::empty({c.B, c.H, c.L, Ep}, q.options());
    Tensor dk_acc = at::zeros({nchunks, c.B, c.Hk, c.S, Ep}, q.options());
    Tensor dv_acc = at::zeros({nchunks, c.B, c.Hk, c.S, Evp}, q.options());
    if (dq_p.numel() > 0 || dk_acc.numel() > 0 || dv_acc.numel() > 0) {
      auto P = make_problem<scalar_t>(c, q, k, v, mask, is_causal, scale, fam, alpha);
      P.drop = drop;
      Tensor kpack, vpack, delta;
      if (has_softmax_head(P) && !want_alpha) {  // the tiled softmax backward runs
        // δ = dO·O per query row (its Σ_j p_j dp_j).
        delta = (grad_out.to(c.acc) * out.to(c.acc)).sum(-1).contiguous();
        kpack = pack_heads<scalar_t>(k);
        vpack = pack_heads<scalar_t>(v);
        P.kp = kpack.const_data_ptr<scalar_t>();
        P.vp = vpack.const_data_ptr<scalar_t>();
      }
      backward_kernel<scalar_t>(P, dout.const_data_ptr<scalar_t>(), shift.const_data_ptr<float>(),
                                delta.defined() ? delta.const_data_ptr<scalar_t>() : nullptr,
                                dq_p.mutable_data_ptr<scalar_t>(),
                                dk_acc.mutable_data_ptr<scalar_t>(), dv_acc.mutable_data_ptr<scalar_t>(), nchunks,
                                want_alpha ? dalpha_acc.mutable_data_ptr<double>() : nullptr);
    }
    Tensor dk_p = dk_acc[0], dv_p = dv_acc[0];
    if (nchunks > 1) {
      dk_p = at::empty_like(dk_p);
      dv_p = at::empty_like(dv_p);
      sum_chunks<scalar_t>(dk_acc, dk_p);
      sum_chunks<scalar_t>(dv_acc, dv_p);
    }
    dq = Ep == c.E ? dq_p : dq_p.narrow(3, 0, c.E);
    dk = Ep == c.E ? dk_p : dk_p.narrow(3, 0, c.E);
    dv = Evp == c.Ev ? dv_p : dv_p.narrow(3, 0, c.Ev);
  });
  // (H,) whenever asked for (zeros for the normalizers without α), else empty.
  Tensor dalpha_h;
  if (want_alpha) {
    dalpha_h = at::empty({c.H}, dalpha_acc.options());
    sum_chunks<double>(dalpha_acc.view({nchunks * c.B, c.H}), dalpha_h);
  }
  Tensor dalpha = want_alpha   ? dalpha_h.to(at::kFloat)
                  : alpha_grad ? at::zeros({c.H}, q_in.options().dtype(at::kFloat))
                               : at::empty({0}, q_in.options().dtype(at::kFloat));
  return {dq.to(q_in.scalar_type()).contiguous(), dk.to(k_in.scalar_type()).contiguous(),
          dv.to(v_in.scalar_type()).contiguous(), dalpha};
}

Tensor attention_dropout_mask(int64_t B, int64_t H, int64_t L, int64_t S, double dropout_p,
                              const Tensor& dropout_seed) {
  TORCH_CHECK(B >= 0 && H >= 0 && L >= 0 && S >= 0, "attnkern.attention_dropout_mask: negative size");
  const Dropout d = prepare_dropout(dropout_p, dropout_seed, S);
  Tensor keep = at::empty({B, H, L, S}, dropout_seed.options().dtype(at::kBool).device(at::kCPU));
  bool* kp = keep.mutable_data_ptr<bool>();
  at::parallel_for(0, B * H * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> f(std::max<int64_t>(S, 1), 1.0f);
    for (int64_t r = begin; r < end; ++r) {
      if (d.on) dropout_keeps(d, r, 0, S, f.data());
      for (int64_t j = 0; j < S; ++j) kp[r * S + j] = f[j] != 0.0f;
    }
  });
  return keep;
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkern, CPU, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_dropout_mask", &attention_dropout_mask);
}

}  // namespace cpu
}  // namespace attnkern

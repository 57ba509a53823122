// The fused attention on the CPU: what its algorithms share. The problem
// (Problem: pointers, shapes, per-head b and family, dropout), the block
// sizes, the score GEMM of a block of query rows, the scans for non-zero key
// blocks and supports, and the entry points of the two algorithms:
//   attention_softmax.cpp  tiled softmax, forward and backward (FlashAttention)
//   attention_rows.cpp     whole rows of scores: sparsemax, entmax15, α-entmax
//                          (and softmax heads whose dα is wanted)
// attention.cpp schedules the blocks over threads and holds the op glue.
#pragma once

#include "attnkern/isa_features.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#include "attnkern/entmax_math.h"
#include "blas.h"
#include "dropout.h"
#include "entmax_row.h"
#include "half_gemm.h"
#include "structured_row.h"
#include "tile_gemm.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace attn {

using at::Tensor;
using math::Family;

// Granularity of the zero-probability skipping, in keys.
constexpr int64_t kBlockN = 64;
// Below this fraction of non-zero probabilities in a block of rows, P·V and
// the backward run entry by entry over the support (gathering rows of k and
// v) instead of GEMMs over key blocks: a GEMM costs about 2·Ev flops per
// (query, key) pair whatever p is, a support entry a few dozen vector ops,
// so entry by entry wins only on sparse blocks (the crossover lies between
// 11% and 17% density).
constexpr double kSparseDensity = 1.0 / 8;
// The backward's work per call is split into at least this many tasks
// (kv-heads x chunks of query blocks), whatever the thread count.
constexpr int64_t kBackwardTasks = 8;
// Target size of one score buffer (BM x S accumulation-type entries).
constexpr int64_t kScoreBufferBytes = 512 * 1024;

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  return std::max<int64_t>(1, std::atoll(s));
}

// Query rows per block: as many as keep the score buffer near
// kScoreBufferBytes, between 8 and 64 (GEMM efficiency drops below 8 rows).
// ATTNKERN_ATTN_BLOCK_M overrides it (for tuning).
inline int64_t block_rows(int64_t S, int64_t L, size_t elem) {
  int64_t bm = kScoreBufferBytes / (std::max<int64_t>(S, 1) * static_cast<int64_t>(elem));
  bm = std::clamp<int64_t>(bm, 8, 64);
  bm = env_int("ATTNKERN_ATTN_BLOCK_M", bm);
  return std::max<int64_t>(1, std::min(bm, std::max<int64_t>(L, 1)));
}

// The most keys a block of m query rows can run over (Problem::block_keys'
// n) under a window of win_left / win_right keys (-1: unbounded): the band's
// width plus the block's rows and the rounding of its first key down to
// kBlockN. With a window the row blocks and their score buffers are sized
// by it, not by S.
inline int64_t band_keys_bound(int64_t S, int64_t win_left, int64_t win_right, int64_t m) {
  if (win_left < 0 || win_right < 0) return S;
  return std::min(S, win_left + win_right + m + kBlockN);
}

// Query rows per block of the row-buffer path (block_rows) for a problem
// whose keys may be cut by a window.
inline int64_t band_block_rows(int64_t S, int64_t win_left, int64_t win_right, int64_t L, size_t elem) {
  return block_rows(band_keys_bound(S, win_left, win_right, 64), L, elem);
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
  // Which keys each query row may see besides the mask (the key band): row
  // i of batch bi sees keys [key_lo(bi, i), key_hi(bi, i)). causal: j <= i
  // (SDPA's top-left alignment). A window of win_left / win_right keys (-1:
  // unbounded) around i + S_b - L (bottom-right alignment, as
  // FlashAttention's window_size). key_len: per batch the valid keys
  // [0, S_b) (a padded cache: cache_seqlens), null for S_b = S.
  // row_bounds: per (batch, row) [lo, hi) of the keys the row may see besides
  // the above (B x L pairs, a BlockMask's rows), null when unused; its ends
  // need not grow with i.
  bool causal;
  int64_t win_left = -1, win_right = -1;
  const int64_t* key_len = nullptr;
  const int64_t* row_bounds = nullptr;
  // The key the block functions' key 0 is: the first of the block's range
  // (a multiple of kBlockN), set in the schedulers' per-thread copies. Key
  // indices inside the block functions are relative to it; the head accessors
  // and the dropout counters add it.
  int64_t key0 = 0;
  // Per head: b = α - 1 and its family.
  std::vector<acc_t> b;
  std::vector<Family> fam;
  // fusedmax / oscarmax (every head then of family sparsemax, taking the
  // row-buffer path, with λ per head in lam): rows solved by ProxRow.
  Prox prox = Prox::kNone;
  std::vector<double> lam;
  // Dropout on the weights (off when dropout_p = 0).
  Dropout drop;
  // The softmax backward takes δ = Σ P dP from its own P and dP, in a pass over
  // the keys before the tiles, instead of δ = dO·O from the forward's output
  // (set for bfloat16 / float16 with E != Ev: see attention.cpp).
  bool own_delta = false;
  // Decoding with bfloat16 / float16 inputs: K and V are read in their own
  // dtype (rows of e_half and ev_half values, unpadded), not from widened
  // copies, which would cost more than the decoding itself; k and v are null.
  const void* k_half = nullptr;
  const void* v_half = nullptr;
  bool half_is_bf16 = true;
  int64_t e_half = 0, ev_half = 0;
  // Decoding from float32 / float64 K and V laid out otherwise than (B, Hk,
  // S, E) contiguous (a token-major cache, varlen documents): read where
  // they are, key j of (batch bi, kv-head hk) at k + bi·k_stride[0] +
  // hk·k_stride[1] + j·k_stride[2] (likewise v), E and Ev values a row.
  bool kv_strided = false;
  int64_t k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0};
  // Decoding from a paged cache (attention_decode_paged): K and V are pools
  // of pages (float32 / float64 from k and v, the half types from k_half and
  // v_half), key j of (batch bi, kv-head hk) in page kv_pages[bi·kv_max_pages
  // + j / kv_page] at row j % kv_page, that is at page·k_stride[0] +
  // hk·k_stride[1] + row·k_stride[2] (likewise v); kv_e and kv_ev values a
  // row. Each decoding chunk reads its rows where they are. Null when K and V
  // are not paged.
  const int64_t* kv_pages = nullptr;
  int64_t kv_page = 0, kv_max_pages = 0, kv_e = 0, kv_ev = 0;
  // The forward of the heads that are not softmax, with bfloat16 / float16
  // inputs: V as it is (rows of ev_half values, of the type half_is_bf16
  // says), which their P·V over the support lists reads directly, gathering
  // half the cache lines of widened rows; their dense P·V widens the key
  // runs it needs. v is then null unless a softmax head reads it.
  const void* v_rows_half = nullptr;
  // bfloat16 / float16 inputs whose GEMMs run in their own type (half_gemm.h;
  // hg says which and how): q as rows of E values, K and V of every
  // (batch, kv-head) packed by pack_keys (round_up_vnni(S) · E entries
  // a head) and pack_values (round_up_vnni(S) · Ev; null when no head is
  // softmax); null otherwise.
  // The forward of bfloat16 / float16 inputs whose GEMMs run in float32 (no
  // half-type unit): q as it is (rows of e_half values, of the type
  // half_is_bf16 says), which forward_kernel widens a block of rows at a time
  // into its thread's scratch, and V (v_rows_half) widened a head at a time
  // for the softmax heads (widen_v_heads), instead of float copies of the
  // whole of q and V (a pass more, and fresh pages on every call). q and v
  // then hold the rows from q_row0 and the heads from v_head0.
  const void* q_half = nullptr;
  bool widen_v_heads = false;
  int64_t q_row0 = 0, v_head0 = 0;
  // The forward's K as it is (rows of k_src_e values of k_src_type), which
  // forward_kernel packs a head at a time into its thread's scratch (kp then
  // holds the panels of the heads from kp_head0), instead of a packed copy of
  // every head made before (fresh pages on every call).
  const void* k_src = nullptr;
  at::ScalarType k_src_type = at::kFloat;
  int64_t k_src_e = 0, kp_head0 = 0;
  // The backward's operands made a task (one kv-head) at a time in the
  // thread's workspace (backward_kernel): with bfloat16 / float16 inputs and
  // float32 GEMMs (widen_kv), K and V widened from k_src and v_rows_half, and
  // q and dO (do_half: rows of ev_half values) a block of rows at a time;
  // K's and V's panels (pack_k_task, pack_v_task) packed from the rows.
  // k, v, kp, vp then hold the heads from k_head0, v_head0, kp_head0, vp_head0.
  bool widen_kv = false, pack_k_task = false, pack_v_task = false;
  const void* do_half = nullptr;
  int64_t k_head0 = 0, vp_head0 = 0;
  HalfGemm hg;
  const h16* q16 = nullptr;
  const h16* k16 = nullptr;
  const h16* v16 = nullptr;
  // The softmax backward's half-type GEMMs (set with q16 and k16): dO as rows
  // of Ev values, V packed by pack_keys (for dO·Vᵀ) and K by
  // pack_values (for dS·K); its dK and dV accumulators are then
  // transposed, E x round_up_vnni(S) and Ev x round_up_vnni(S) a head.
  const h16* do16 = nullptr;
  const h16* vk16 = nullptr;
  const h16* kv16 = nullptr;

  int64_t group() const { return H / Hk; }
  // The global index of query row i of (batch bi, head h): the dropout counter.
  int64_t row_id(int64_t bi, int64_t h, int64_t i) const { return (bi * H + h) * L + i; }
  bool banded() const {
    return causal || win_left >= 0 || win_right >= 0 || key_len != nullptr || row_bounds != nullptr;
  }
  int64_t keys_valid(int64_t bi) const { return key_len ? key_len[bi] : S; }
  // The band of query row i of batch bi, in absolute keys. Without row_bounds
  // both ends are non-decreasing in i, so a block's rows see keys within
  // [lo(first), hi(last)); block_keys takes the extremes over the rows.
  int64_t key_lo(int64_t bi, int64_t i) const {
    const int64_t sb = keys_valid(bi);
    const int64_t lo = win_left < 0 ? 0 : std::clamp<int64_t>(i + sb - L - win_left, 0, sb);
    return row_bounds ? std::max(lo, row_bounds[2 * (bi * L + i)]) : lo;
  }
  int64_t key_hi(int64_t bi, int64_t i) const {
    const int64_t sb = keys_valid(bi);
    int64_t hi = sb;
    if (causal) hi = std::min(hi, i + 1);
    if (win_right >= 0) hi = std::min(hi, std::max<int64_t>(0, i + sb - L + win_right + 1));
    if (row_bounds) hi = std::min(hi, row_bounds[2 * (bi * L + i) + 1]);
    return hi;
  }
  // The keys [lo, hi) that some row of [i0, i0 + m) of batch bi sees, in
  // absolute keys (hi <= lo: none); banded problems only.
  std::pair<int64_t, int64_t> band_span(int64_t bi, int64_t i0, int64_t m) const;
  // The keys a block of rows [i0, i0 + m) of batch bi runs over: from the
  // returned first key (a multiple of kBlockN, the block's key0), n of them
  // (0: no row of the block sees a key).
  std::pair<int64_t, int64_t> block_keys(int64_t bi, int64_t i0, int64_t m) const;
  // How many of the tile's keys [j0, j0 + w) (relative to key0) query row i
  // of batch bi may see, counted from the tile's first key: the keys past
  // the band's end are cut (those before its start are -inf: mask_scores).
  int64_t keys_seen(int64_t bi, int64_t i, int64_t j0, int64_t w) const {
    return banded() ? std::clamp<int64_t>(key_hi(bi, i) - key0 - j0, 0, w) : w;
  }
  const acc_t* q_rows(int64_t bi, int64_t h, int64_t i0) const { return q + ((bi * H + h) * L + i0 - q_row0) * E; }
  // (From key key0 on: the block's keys.)
  const acc_t* k_head(int64_t bi, int64_t hk) const { return k + ((bi * Hk + hk - k_head0) * S + key0) * E; }
  const acc_t* v_head(int64_t bi, int64_t hk) const { return v + ((bi * Hk + hk - v_head0) * S + key0) * Ev; }
  // Where (batch bi, kv-head hk)'s rows of v_rows_half start, from key key0,
  // in half-type values.
  int64_t v_half_offset(int64_t bi, int64_t hk) const { return ((bi * Hk + hk) * S + key0) * ev_half; }
  const acc_t* kp_head(int64_t bi, int64_t hk) const {
    return kp + ((bi * Hk + hk - kp_head0) * round_up_panel<acc_t>(S) + key0) * E;
  }
  const acc_t* vp_head(int64_t bi, int64_t hk) const {
    return vp + ((bi * Hk + hk - vp_head0) * round_up_panel<acc_t>(S) + key0) * Ev;
  }
  const h16* q16_rows(int64_t bi, int64_t h, int64_t i0) const { return q16 + ((bi * H + h) * L + i0) * E; }
  // (The whole head: their layouts take key offsets j0 + key0, as scores_half
  // and pv_half do.)
  const h16* k16_head(int64_t bi, int64_t hk) const { return k16 + (bi * Hk + hk) * round_up_vnni(S) * E; }
  const h16* v16_head(int64_t bi, int64_t hk) const { return v16 + (bi * Hk + hk) * round_up_vnni(S) * Ev; }
  const h16* vk16_head(int64_t bi, int64_t hk) const { return vk16 + (bi * Hk + hk) * round_up_vnni(S) * Ev; }
  const h16* kv16_head(int64_t bi, int64_t hk) const { return kv16 + (bi * Hk + hk) * round_up_vnni(S) * E; }
};

template <typename acc_t>
std::pair<int64_t, int64_t> Problem<acc_t>::band_span(int64_t bi, int64_t i0, int64_t m) const {
  if (!row_bounds) return {key_lo(bi, i0), key_hi(bi, i0 + m - 1)};
  int64_t lo = S, hi = 0;
  for (int64_t i = i0; i < i0 + m; ++i) {  // (rows with no key take no part)
    const int64_t a = key_lo(bi, i), b = key_hi(bi, i);
    if (a < b) lo = std::min(lo, a), hi = std::max(hi, b);
  }
  return {lo, hi};
}

template <typename acc_t>
std::pair<int64_t, int64_t> Problem<acc_t>::block_keys(int64_t bi, int64_t i0, int64_t m) const {
  if (!banded()) return {0, S};
  const auto [lo, hi] = band_span(bi, i0, m);
  if (hi <= lo) return {0, 0};
  const int64_t first = lo - lo % kBlockN;
  return {first, hi - first};
}

template <typename acc_t>
inline void add_row(acc_t* y, int64_t n, const acc_t* m, int64_t ms) {
  using V = Vec<acc_t>;
  if (ms == 1) {
    int64_t j = 0;
    for (; j + V::size() <= n; j += V::size()) (V::loadu(y + j) + V::loadu(m + j)).store(y + j);
    for (; j < n; ++j) y[j] += m[j];
  } else {
    for (int64_t j = 0; j < n; ++j) y[j] += m[j * ms];
  }
}

// Adds the mask to the scores y (m x w, row stride ldy) of query rows
// [i0, i0 + m) against keys [j0, j0 + w) (relative to key0), and sets -inf
// outside each row's key band.
template <typename acc_t>
inline void mask_scores(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t w,
                        acc_t* y, int64_t ldy) {
  if (!P.mask && !P.banded()) return;
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const int64_t a0 = P.key0 + j0;  // the tile's first key, absolute
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * ldy;
    if (P.mask) add_row(row, w, P.mask + bi * P.msb + h * P.msh + (i0 + r) * P.msl + a0 * P.mss, P.mss);
    if (P.banded()) {
      const int64_t lo = std::clamp<int64_t>(P.key_lo(bi, i0 + r) - a0, 0, w);
      const int64_t hi = std::clamp<int64_t>(P.key_hi(bi, i0 + r) - a0, lo, w);
      std::fill(row, row + lo, -inf);
      std::fill(row + hi, row + w, -inf);
    }
  }
}

// Sets -inf before each row's key band in the raw (unscaled, unmasked)
// scores of a half-type tile, whose ends past the band the caller cuts
// (keys_seen).
template <typename acc_t>
inline void mask_band_start(const Problem<acc_t>& P, int64_t bi, int64_t i0, int64_t m, int64_t j0, int64_t w,
                            acc_t* y, int64_t ldy) {
  if (P.win_left < 0 && !P.row_bounds) return;  // (the band then starts at key 0)
  const int64_t a0 = P.key0 + j0;
  for (int64_t r = 0; r < m; ++r) {
    const int64_t lo = std::clamp<int64_t>(P.key_lo(bi, i0 + r) - a0, 0, w);
    std::fill(y + r * ldy, y + r * ldy + lo, -std::numeric_limits<acc_t>::infinity());
  }
}

// y (m x w, row stride ldy) *= scale.
template <typename acc_t>
inline void scale_scores(acc_t* y, int64_t m, int64_t w, int64_t ldy, acc_t scale) {
  using V = Vec<acc_t>;
  const V vs(scale);
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * ldy;
    int64_t j = 0;
    for (; j + V::size() <= w; j += V::size()) (V::loadu(row + j) * vs).store(row + j);
    for (; j < w; ++j) row[j] *= scale;
  }
}

// Columns [j0, j1) of C (m x n, row stride n) = alpha · A · Bᵀ, with A
// (m x K, row stride K) and B (n x K) as packed panels (pack_panels), through
// tile_gemm: the whole panels straight into C, a last partial one through a
// small scratch (its columns past n are products with padding rows). The
// columns from j0 rounded down to a panel boundary are written too.
template <typename acc_t>
inline void gemm_packed_cols(int64_t m, int64_t n, int64_t j0, int64_t j1, int64_t K, acc_t alpha, const acc_t* A,
                             const acc_t* packed, acc_t* C) {
  constexpr int64_t NR = kPanel<acc_t>;
  const int64_t lo = j0 - j0 % NR, whole = n - n % NR, hi = std::min(j1, whole);
  if (hi > lo) {
    const int64_t w = round_up_panel<acc_t>(hi - lo);
    tile_gemm<acc_t>(m, w, K, alpha, A, K, 1, packed + lo * K, NR, K * NR, C + lo, n, false);
  }
  if (j1 > whole) {
    thread_local std::vector<acc_t> tail;
    tail.resize(m * NR);
    tile_gemm<acc_t>(m, NR, K, alpha, A, K, 1, packed + whole * K, NR, K * NR, tail.data(), NR, false);
    for (int64_t r = 0; r < m; ++r) std::copy_n(tail.data() + r * NR, n - whole, C + r * n + whole);
  }
}

// y (m x w, row stride ldy) = scale · q_rows · kᵀ over keys [j0, j0 + w) plus
// the mask, -inf above the causal diagonal, from half-type q and K (P.q16;
// j0 a multiple of 64). Returns false (nothing done) without them.
// With scale_later given, a caller that scales each row itself (scale_row_max)
// may be left to: where no additive mask follows the scale and the scale is
// positive (the causal -inf stays -inf), *scale_later is set and the rows are
// left unscaled.
template <typename acc_t>
inline bool scores_half_masked(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0,
                               int64_t w, acc_t* y, int64_t ldy, bool* scale_later = nullptr) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (P.q16) {
      scores_half(P.hg, m, w, P.key0 + j0, P.E, P.q16_rows(bi, h, i0), P.k16_head(bi, h / P.group()), y, ldy);
      if (scale_later && !P.mask && P.scale > acc_t(0) && P.scale < std::numeric_limits<acc_t>::infinity()) {
        *scale_later = true;
      } else {
        scale_scores(y, m, w, ldy, P.scale);
      }
      mask_scores(P, bi, h, i0, m, j0, w, y, ldy);
      return true;
    }
  }
  return false;
}

// y (m x w, row stride ldy) = alpha · a · bᵀ for a (m x K) and keys b (w x K)
// as they are, both of row stride K (BLAS), columns [w, ldy) zero: a tile's
// product with unpacked K or V (a few query rows, kPackRows).
template <typename acc_t>
inline void gemm_unpacked_keys(int64_t m, int64_t w, int64_t K, acc_t alpha, const acc_t* a, const acc_t* b, acc_t* y,
                               int64_t ldy) {
  gemm<acc_t>(false, true, m, w, K, alpha, a, K, b, K, acc_t(0), y, ldy);
  for (int64_t r = 0; r < m; ++r) std::fill(y + r * ldy + w, y + (r + 1) * ldy, acc_t(0));
}

// y (m x n, row stride ld) = scale · q_rows · kᵀ + mask, -inf above the causal
// diagonal: in the half type (P.q16), over the packed key panels (P.kp) when there
// are, else BLAS. ld may exceed n only with P.q16 (rows_ld).
// (scale_later: as scores_half_masked's.)
template <typename acc_t>
inline void score_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, acc_t* y,
                        int64_t ld, bool* scale_later = nullptr) {
  if (scores_half_masked(P, bi, h, i0, m, 0, n, y, ld, scale_later)) return;
  TORCH_INTERNAL_ASSERT(ld == n, "score rows of stride ld > n come only from half-type GEMMs");
  const acc_t* q = P.q_rows(bi, h, i0);
  if (P.kp && P.banded()) {
    // Each strip of a micro-kernel's rows over the panels its rows' bands
    // meet: a window's band moves by a key a row, so a strip skips panels
    // the whole block spans; mask_scores sets every entry outside a row's
    // band, formed or not.
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m - r0);
      const auto [first, end] = P.band_span(bi, i0 + r0, rows);
      const int64_t lo = std::clamp<int64_t>(first - P.key0, 0, n), hi = std::clamp<int64_t>(end - P.key0, lo, n);
      if (lo < hi)
        gemm_packed_cols<acc_t>(rows, n, lo, hi, P.E, P.scale, q + r0 * P.E, P.kp_head(bi, h / P.group()),
                                y + r0 * n);
    }
  } else if (P.kp) {
    gemm_packed_cols<acc_t>(m, n, 0, n, P.E, P.scale, q, P.kp_head(bi, h / P.group()), y);
  } else {
    gemm<acc_t>(false, true, m, n, P.E, P.scale, q, P.E, P.k_head(bi, h / P.group()), P.E, acc_t(0), y, n);
  }
  mask_scores(P, bi, h, i0, m, 0, n, y, n);
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
inline void apply_dropout(const Dropout& d, acc_t* y, int64_t m, int64_t n, int64_t ld, int64_t row0, int64_t j_base,
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

// Runs of consecutive key blocks of y (m x n, row stride ld) holding any
// non-zero (or NaN) entry, as [start, end) key ranges.
template <typename acc_t>
inline void nonzero_runs(const acc_t* y, int64_t m, int64_t n, int64_t ld,
                         std::vector<std::pair<int64_t, int64_t>>& runs) {
  using V = Vec<acc_t>;
  runs.clear();
  for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
    const int64_t j1 = std::min(n, j0 + kBlockN);
    bool any = false;
    for (int64_t r = 0; r < m && !any; ++r) {
      const acc_t* row = y + r * ld;
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

// Writes the indices of the non-zero (or NaN) entries of row[0:n] to out (room
// for n plus a whole vector) and returns their count.
template <typename acc_t>
inline int64_t append_support(const acc_t* row, int64_t n, int32_t* out) {
  using V = Vec<acc_t>;
  constexpr int kLanes = V::size();
  const V zero(0);
  int32_t* const first = out;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    out += left_pack_index<kLanes>(out, static_cast<int32_t>(j), lane_mask<acc_t>(V::loadu(row + j) != zero));
  for (; j < n; ++j)
    if (!(row[j] == acc_t(0))) *out++ = static_cast<int32_t>(j);
  return out - first;
}

// The support of each row of y (m x n, row stride ld) as CSR: the indices of the non-zero
// (or NaN) entries of row r are idx[ptr[r]:ptr[r+1]] (idx may be longer than
// ptr[m]). Gives up (returns
// false) once there are more than `limit` entries. One pass, by vector
// compaction of the lane masks, so that the block's scores are read once (a
// counting pass first would read them twice).
template <typename acc_t>
inline bool collect_support(const acc_t* y, int64_t m, int64_t n, int64_t ld, int64_t limit,
                            std::vector<int32_t>& idx, std::vector<int64_t>& ptr) {
  constexpr int kLanes = Vec<acc_t>::size();
  ptr.assign(m + 1, 0);
  // Room for the row that crosses the limit and the last whole-vector store
  // (grown only: a resize up would zero-fill the new part at every block).
  const size_t room = static_cast<size_t>(limit + n + kLanes);
  if (idx.size() < room) idx.resize(room);
  int32_t* const first = idx.data();
  int32_t* out = first;
  for (int64_t r = 0; r < m; ++r) {
    out += append_support(y + r * ld, n, out);
    ptr[r + 1] = out - first;
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

// A vector of acc_t from v (acc_t itself, or bfloat16 / float16 widened to float).
template <typename acc_t, typename src_t>
inline Vec<acc_t> load_widened(const src_t* v) {
  if constexpr (std::is_same_v<src_t, acc_t>) {
    return Vec<acc_t>::loadu(v);
  } else {
    Vec<float> out;
    at::vec::load_to_float(v, out);
    return out;
  }
}

#if ATTNKERN_HAS(AVX512)
// accumulate_listed_cols for bfloat16 rows of V (NV even). A bfloat16 is
// the high half of its float, so interleaving its words with zeros (one
// shuffle per 16 values) widens them, where a zero-extension and a shift
// take two vector operations, which beside one FMA each would be most of the
// P·V's work. The interleave leaves each 32 columns in the
// order {0-3, 8-11, 16-19, 24-27}, {4-7, 12-15, 20-23, 28-31}; the
// accumulators keep it and the stores undo it.
template <int NV>
inline void accumulate_listed_cols_bf16(const float* x, const int32_t* idx, int64_t cnt, const c10::BFloat16* v,
                                        int64_t ldv, int64_t c, float* o, bool accumulate) {
  static_assert(NV % 2 == 0, "32 columns at a time");
  const __m512i zero = _mm512_setzero_si512();
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i from_0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i from_1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 a[NV], b[NV];
  for (int i = 0; i < NV; i += 2) {
    b[i] = b[i + 1] = _mm512_setzero_ps();
    if (accumulate) {
      const __m512 o0 = _mm512_loadu_ps(o + c + 16 * i), o1 = _mm512_loadu_ps(o + c + 16 * i + 16);
      a[i] = _mm512_permutex2var_ps(o0, to_lo, o1), a[i + 1] = _mm512_permutex2var_ps(o0, to_hi, o1);
    } else {
      a[i] = a[i + 1] = _mm512_setzero_ps();
    }
  }
  auto row = [&](int64_t t) { return reinterpret_cast<const char*>(v + static_cast<int64_t>(idx[t]) * ldv + c); };
  auto add_row = [&](__m512* acc, __m512 xt, const char* r) {
    for (int i = 0; i < NV; i += 2) {
      const __m512i w = _mm512_loadu_si512(r + 32 * i);
      acc[i] = _mm512_fmadd_ps(xt, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w)), acc[i]);
      acc[i + 1] = _mm512_fmadd_ps(xt, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w)), acc[i + 1]);
    }
  };
  int64_t t = 0;
  for (; t + 2 <= cnt; t += 2) {
    add_row(a, _mm512_set1_ps(x[t]), row(t));
    add_row(b, _mm512_set1_ps(x[t + 1]), row(t + 1));
  }
  if (t < cnt) add_row(a, _mm512_set1_ps(x[t]), row(t));
  for (int i = 0; i < NV; i += 2) {
    const __m512 lo = _mm512_add_ps(a[i], b[i]), hi = _mm512_add_ps(a[i + 1], b[i + 1]);
    _mm512_storeu_ps(o + c + 16 * i, _mm512_permutex2var_ps(lo, from_0, hi));
    _mm512_storeu_ps(o + c + 16 * i + 16, _mm512_permutex2var_ps(lo, from_1, hi));
  }
}
#endif

// accumulate_listed's columns [c, c + NV vectors): the even and the odd
// entries go to two sets of accumulators, added at the end (one set would
// be a chain of dependent FMAs, which halves the FMA rate).
template <int NV, typename acc_t, typename src_t>
inline void accumulate_listed_cols(const acc_t* x, const int32_t* idx, int64_t cnt, const src_t* v, int64_t ldv,
                                   int64_t c, acc_t* o, bool accumulate) {
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<src_t, c10::BFloat16> && NV % 2 == 0) {
    return accumulate_listed_cols_bf16<NV>(x, idx, cnt, v, ldv, c, o, accumulate);
  }
#endif
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  V a[NV], b[NV];
  for (int i = 0; i < NV; ++i) a[i] = accumulate ? V::loadu(o + c + i * W) : V(acc_t(0)), b[i] = V(acc_t(0));
  auto row = [&](int64_t t) { return v + static_cast<int64_t>(idx[t]) * ldv + c; };
  int64_t t = 0;
  for (; t + 2 <= cnt; t += 2) {
    const V xa(x[t]), xb(x[t + 1]);
    const src_t *va = row(t), *vb = row(t + 1);
    for (int i = 0; i < NV; ++i) {
      a[i] = at::vec::fmadd(xa, load_widened<acc_t>(va + i * W), a[i]);
      b[i] = at::vec::fmadd(xb, load_widened<acc_t>(vb + i * W), b[i]);
    }
  }
  if (t < cnt) {
    const V xa(x[t]);
    for (int i = 0; i < NV; ++i) a[i] = at::vec::fmadd(xa, load_widened<acc_t>(row(t) + i * W), a[i]);
  }
  for (int i = 0; i < NV; ++i) (a[i] + b[i]).store(o + c + i * W);
}

// o[0:ev] = Σ_t x[t] · v[idx[t], 0:ev] (row stride ldv) over a list of cnt
// entries, o overwritten, or added to with `accumulate`; v in acc_t, or
// bfloat16 / float16 for float (widened as read: half the cache lines to
// gather). The columns run in register blocks of four vectors, which keep o
// in registers across the entries, where an axpy per entry would carry o
// through a store and a reload each time.
template <typename acc_t, typename src_t>
inline void accumulate_listed(const acc_t* x, const int32_t* idx, int64_t cnt, const src_t* v, int64_t ldv,
                              int64_t ev, acc_t* o, bool accumulate = false) {
  constexpr int64_t W = Vec<acc_t>::size();
  int64_t c = 0;
  for (; c + 4 * W <= ev; c += 4 * W) accumulate_listed_cols<4>(x, idx, cnt, v, ldv, c, o, accumulate);
  if (c + 2 * W <= ev) accumulate_listed_cols<2>(x, idx, cnt, v, ldv, c, o, accumulate), c += 2 * W;
  if (c + W <= ev) accumulate_listed_cols<1>(x, idx, cnt, v, ldv, c, o, accumulate), c += W;
  for (; c < ev; ++c) {
    acc_t a = accumulate ? o[c] : acc_t(0);
    for (int64_t t = 0; t < cnt; ++t) a += x[t] * static_cast<acc_t>(v[static_cast<int64_t>(idx[t]) * ldv + c]);
    o[c] = a;
  }
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

#if ATTNKERN_HAS(AVX2)
// Lane i of the result = the sum of a[i]'s lanes: a transposed horizontal sum
// (six hadds, two permutes and an add for all eight), where eight separate
// horizontal sums cost more than the dots they end when rows are short.
inline __m256 hsum8(const __m256* a) {
  // hadd pairs within each 128-bit half: u0 = [Σa0..Σa3 of the low halves |
  // the same of the high halves], u1 likewise for a4..a7.
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#if ATTNKERN_HAS(AVX512)
// 16 values of a float, bfloat16 or float16 row from p, widened to float32.
template <typename kv_t>
inline __m512 load16_float(const kv_t* p) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<kv_t, c10::Half>) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}
#endif

// 8 values of a float, bfloat16 or float16 row from p, widened to float32.
template <typename kv_t>
inline __m256 load8_float(const kv_t* p) {
  if constexpr (std::is_same_v<kv_t, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<kv_t, c10::Half>) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

// out[i] = x[0:n] · rows[i][0:n] for the eight rows (float, or bfloat16 /
// float16 widened as they are read), reduced together (hsum8): with E = 64
// separate sums were a third of a decoding's score work. Each row's block of
// four vectors is read before the next row's, so the loads run along memory
// (a vector of all eight rows at a time, a row apart, left decoding's scores
// waiting on L3 and DRAM). Every row takes its products in order of e,
// whatever the loop order.
template <typename kv_t>
inline void dot8_rows(const float* x, const kv_t* const* rows, int64_t n, float* out) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  int64_t e = 0;
#if ATTNKERN_HAS(AVX512)
  if (n >= 16) {
    __m512 w[8];
    for (int i = 0; i < 8; ++i) w[i] = _mm512_setzero_ps();
    for (; e + 64 <= n; e += 64) {
      const __m512 x0 = _mm512_loadu_ps(x + e), x1 = _mm512_loadu_ps(x + e + 16), x2 = _mm512_loadu_ps(x + e + 32),
                   x3 = _mm512_loadu_ps(x + e + 48);
      for (int i = 0; i < 8; ++i) {
        const kv_t* r = rows[i] + e;
        w[i] = _mm512_fmadd_ps(x0, load16_float(r), w[i]);
        w[i] = _mm512_fmadd_ps(x1, load16_float(r + 16), w[i]);
        w[i] = _mm512_fmadd_ps(x2, load16_float(r + 32), w[i]);
        w[i] = _mm512_fmadd_ps(x3, load16_float(r + 48), w[i]);
      }
    }
    for (; e + 16 <= n; e += 16) {
      const __m512 xv = _mm512_loadu_ps(x + e);
      for (int i = 0; i < 8; ++i) w[i] = _mm512_fmadd_ps(xv, load16_float(rows[i] + e), w[i]);
    }
    for (int i = 0; i < 8; ++i)
      a[i] = _mm256_add_ps(_mm512_castps512_ps256(w[i]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[i]), 1)));
  }
#endif
  for (; e + 32 <= n; e += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + e), x1 = _mm256_loadu_ps(x + e + 8), x2 = _mm256_loadu_ps(x + e + 16),
                 x3 = _mm256_loadu_ps(x + e + 24);
    for (int i = 0; i < 8; ++i) {
      const kv_t* r = rows[i] + e;
      a[i] = _mm256_fmadd_ps(x0, load8_float(r), a[i]);
      a[i] = _mm256_fmadd_ps(x1, load8_float(r + 8), a[i]);
      a[i] = _mm256_fmadd_ps(x2, load8_float(r + 16), a[i]);
      a[i] = _mm256_fmadd_ps(x3, load8_float(r + 24), a[i]);
    }
  }
  for (; e + 8 <= n; e += 8) {
    const __m256 xv = _mm256_loadu_ps(x + e);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(xv, load8_float(rows[i] + e), a[i]);
  }
  _mm256_storeu_ps(out, hsum8(a));
  for (; e < n; ++e)
    for (int i = 0; i < 8; ++i) out[i] += x[e] * static_cast<float>(rows[i][e]);
}

#endif

// out[t] = x[0:n] · v[idx[t], 0:n] (row stride ldv) for t < cnt: the sparse
// backward's dP, eight entries at a time where dot8_rows applies.
template <typename acc_t>
inline void dots_listed(const acc_t* x, const int32_t* idx, int64_t cnt, const acc_t* v, int64_t ldv, int64_t n,
                        acc_t* out) {
  int64_t t = 0;
#if ATTNKERN_HAS(AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    for (; t + 8 <= cnt; t += 8) {
      const float* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = v + static_cast<int64_t>(idx[t + i]) * ldv;
      dot8_rows(x, rows, n, out + t);
    }
  }
#endif
  for (; t < cnt; ++t) out[t] = dot(x, v + static_cast<int64_t>(idx[t]) * ldv, n);
}

// dot against a row of bfloat16 / float16 values, widened a vector at a time.
template <typename half_t, std::enable_if_t<at::is_reduced_floating_point_v<half_t>, int> = 0>
inline float dot(const float* x, const half_t* y, int64_t n) {
  using Vf = Vec<float>;
  using Vh = Vec<half_t>;
  Vf s0(0), s1(0);
  int64_t e = 0;
  for (; e + Vh::size() <= n; e += Vh::size()) {
    auto [lo, hi] = at::vec::convert_to_float<half_t>(Vh::loadu(y + e));
    s0 += Vf::loadu(x + e) * lo;
    s1 += Vf::loadu(x + e + Vf::size()) * hi;
  }
  float r = hsum(s0 + s1);
  for (; e < n; ++e) r += x[e] * static_cast<float>(y[e]);
  return r;
}

// Query rows per softmax block and keys per tile (a multiple of kPanel),
// forward and backward. With half-type GEMMs (half) both are larger: on AMX
// tiles the products are fast enough that oneDNN's cost per brgemm call
// (kernel look-up, tile configuration) matters, and fewer, larger calls pay
// it less often (docs/benchmarks.md has the measurements).
// ATTNKERN_ATTN_SOFTMAX_BLOCK_M / _N and ATTNKERN_ATTN_HALF_BLOCK_M / _N
// override them (for tuning).
inline int64_t softmax_block_rows(int64_t L, bool half) {
  static const int64_t bm = env_int("ATTNKERN_ATTN_SOFTMAX_BLOCK_M", 128);
  static const int64_t bm_half = env_int("ATTNKERN_ATTN_HALF_BLOCK_M", 256);
  return std::max<int64_t>(1, std::min(half ? bm_half : bm, L));
}

inline int64_t softmax_block_keys(bool half) {
  // A float panel is a whole number of double panels.
  static const int64_t bn = round_up_panel<float>(env_int("ATTNKERN_ATTN_SOFTMAX_BLOCK_N", 256));
  static const int64_t bn_half = round_up_panel<float>(env_int("ATTNKERN_ATTN_HALF_BLOCK_N", 512));
  return half ? bn_half : bn;
}

// Row stride of a tile's scores with half-type GEMMs (w keys): w rounded up
// to a panel, plus 16 floats, so that the rows of a tile are not a power of
// two apart (1, 2 or 4 KiB strides put a tile's 16 rows in a few L1 sets).
inline int64_t half_tile_ld(int64_t w) { return round_up_panel<float>(w) + 16; }

// Row stride of the sparse rows' block of scores over n keys: with half-type
// GEMMs (half), half_tile_ld's, for the same reason (S = 2048 put rows 8 KiB
// apart); else n (the float32 GEMMs write rows of stride n).
inline int64_t rows_ld(int64_t n, bool half) { return half ? half_tile_ld(n) : n; }

// Decoding: softmax problems with at most kDecodeRows query rows
// (cpu_kernels.h) run split over chunks of kDecodeKeys keys (a fixed
// partition: results do not depend on the thread count), so that even one
// head keeps every core busy.
constexpr int64_t kDecodeKeys = 512;

// K (and in the backward V) are packed into key panels only for problems with
// more query rows than this: each head's panels are a copy of S·E values (and
// fresh memory), which a few query rows do not repay; those run their GEMMs
// on K and V as they are (BLAS).
constexpr int64_t kPackRows = 16;

using Runs = std::vector<std::pair<int64_t, int64_t>>;

// Storage on 64-byte boundaries, so that the speed of the compaction passes
// over the scores does not depend on the offset the heap happens to give
// (a heap that never maps, as a long-running process's).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

// rows x width bfloat16 (bf16) or float16 values from src, rows width apart,
// widened into dst as rows of ld accumulation-type values (columns width..
// zero); returns dst's data.
template <typename Buf>
const typename Buf::value_type* widen_half_rows(const h16* src, bool bf16, int64_t rows, int64_t width, int64_t ld,
                                                Buf& dst) {
  dst.assign(rows * ld, typename Buf::value_type(0));
  auto widen = [&](auto tag) {
    const auto* s = reinterpret_cast<const decltype(tag)*>(src);
    for (int64_t r = 0; r < rows; ++r) convert_row(s + r * width, dst.data() + r * ld, width);
  };
  if (bf16) {
    widen(c10::BFloat16());
  } else {
    widen(c10::Half());
  }
  return dst.data();
}

// Per-thread scratch of the block functions (sized by the schedulers in
// attention.cpp).
template <typename acc_t>
struct Workspace {
  LineVector<acc_t> y, d;           // scores / probabilities and dP of a block
  LineVector<acc_t> work;           // two rows: shift candidates and search scratch, support values
  std::vector<acc_t> mrow, lsum;    // softmax forward: running max and sum per row
  std::vector<acc_t> lse;           // softmax backward: the shift per row
  std::vector<acc_t> dps, kept, pkept;
  std::vector<acc_t> gk;            // the sparse backward's g = p^(2-α) of one row's entries
  std::vector<float> keep;
  LineVector<int32_t> pidx;
  std::vector<int32_t> idx;
  std::vector<int64_t> ptr;
  std::vector<acc_t> pvals;         // the probabilities at idx (CSR with idx and ptr)
  std::vector<double> rshift;       // per row of a block: the shift found (support_list's)
  std::vector<acc_t> rmax, rnorm;   // and the row's max and normalizing factor
  Runs runs;
  // The sparse backward's entries regrouped by key (CSC): starts, rows, ds, p·keep.
  std::vector<int64_t> cstart;
  std::vector<int32_t> crow;
  std::vector<acc_t> cds, cpk;
  std::vector<acc_t> vwide;         // V's rows widened from P.v_rows_half, for a dense P·V
  std::vector<acc_t> out_rows;      // a block's output rows, when the output takes them converted
  LineVector<acc_t> q_wide, v_wide;  // a block's q rows and a head's V, widened (Problem::q_half)
  LineVector<acc_t> k_panels, keys;  // a head's key panels (Problem::k_src), and one panel's keys
  LineVector<acc_t> k_wide, v_panels, do_wide;  // the backward's (Problem::widen_kv, pack_v_task)
  ProxRow prox;                      // the structured rows' solver (Problem::prox)
};

// attention_softmax.cpp: one block of m query rows from i0 of (batch bi, head
// h) against its n allowed keys. Forward: o (m x Ev) and the log-sum-exp c.
// Backward: dQ of the block (dqb), dK/dV into the chunk's accumulators.
template <typename acc_t>
void softmax_forward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                           acc_t* y, acc_t* o, float* c, acc_t* mrow, acc_t* lrow);
template <typename acc_t>
void softmax_backward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                            const float* c, const acc_t* delta, const acc_t* dob, acc_t* dqb, acc_t* dk,
                            acc_t* dv, acc_t* y, acc_t* d, acc_t* lse, std::vector<float>& keep);
// The addresses of one decoding chunk's K and V rows in a paged cache (a
// thread's, up to kDecodeKeys rows each) and which chunk they are: the query
// heads of a kv-head read them in turn.
struct PagedRows {
  const char* k_rows[kDecodeKeys];
  const char* v_rows[kDecodeKeys];
  int64_t bi = -1, hk = -1, j = -1, w = -1;
};

// Decoding (a few query rows, softmax): the rows against one chunk of keys,
// and the merge of a head's chunks into its output and log-sum-exp.
template <typename acc_t>
void softmax_decode_chunk(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t j0,
                          int64_t w, acc_t* y, acc_t* o, acc_t* mx, acc_t* l, PagedRows& paged);
template <typename acc_t>
void softmax_merge_chunks(int64_t m, int64_t Ev, int64_t nchunks, const acc_t* o, const acc_t* mx, const acc_t* l,
                          acc_t* out, float* c);

// attention_rows.cpp: the same for a head of a sparse family (whole rows of
// scores in ws.y); the backward adds the head's dα into *da when da is given.
template <typename acc_t>
void rows_forward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, acc_t* o,
                        float* c, Workspace<acc_t>& ws);
template <typename acc_t>
void rows_backward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                         const float* c, const acc_t* dob, acc_t* dqb, acc_t* dk, acc_t* dv, double* da,
                         Workspace<acc_t>& ws);

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

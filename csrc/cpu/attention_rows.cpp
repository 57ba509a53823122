// Attention over whole rows of scores on the CPU: sparsemax, entmax15 and
// α-entmax (and softmax heads whose gradient in α is wanted).
//
// The scores of a block of BM query rows against every allowed key are
// computed with one GEMM into a buffer of BM x S floats that stays in L2,
// since the shift needs the whole row (find_shift in entmax_row.h).
// Probabilities are written in place, and P·V runs only over the key blocks
// (kBlockN keys) where some probability of the block is non-zero, or entry
// by entry over the support when it is small: sparsity turns into skipped
// work. The backward recomputes the scores from q and k and the saved shift,
// and skips the same key blocks in all of its GEMMs.
#include "attention_problem.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace attn {
namespace {

// Scores of one row in, probabilities out (sparse families; softmax goes
// through softmax_forward_block); returns the shift c with p = φ_b(s - c),
// for sparsemax its threshold θ with p = [s - θ]_+ (solve_row).
// No allowed key: zeros and c = +inf.
template <typename acc_t, Family FAM>
acc_t normalize_scores(acc_t* y, int64_t n, acc_t b, acc_t* work, int32_t* idx) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  acc_t lanes_buf[kStartLanes<acc_t>];
  acc_t* lanes = start_lanes<acc_t, FAM>(lanes_buf, n);
  const acc_t m = row_max(y, n, lanes);
  if (m == -inf) {
    std::fill(y, y + n, acc_t(0));
    return inf;
  }
  if (m != m || m == inf) {
    std::fill(y, y + n, std::numeric_limits<acc_t>::quiet_NaN());
    return std::numeric_limits<acc_t>::quiet_NaN();
  }
  // work: 2n entries (the shift candidates, then find_shift's scratch).
  return m + solve_row<acc_t, FAM>(y, n, m, b, y, work, work + n, idx, lanes);
}

// The families whose supports are gathered straight from the scores
// (support_list) instead of from rows of probabilities written whole and
// scanned again: two passes over each row of scores and its write saved.
template <typename acc_t, Family FAM>
constexpr bool kListed = FAM == Family::kSparsemax || FAM == Family::kEntmax15;

// Room for CSR lists of up to `limit` entries plus the row that crosses it
// and a whole-vector store past its end (collect_support, support_list).
template <typename acc_t>
void reserve_lists(Workspace<acc_t>& ws, int64_t limit, int64_t n) {
  const size_t room = static_cast<size_t>(limit + n + Vec<acc_t>::size());
  if (ws.idx.size() < room) ws.idx.resize(room);
  if (ws.pvals.size() < room) ws.pvals.resize(room);
}

// ws.pvals = the entries of y (m rows of stride ld) at the CSR positions
// ws.idx / ws.ptr.
template <typename acc_t>
void gather_listed(const acc_t* y, int64_t m, int64_t ld, Workspace<acc_t>& ws) {
  if (ws.pvals.size() < ws.idx.size()) ws.pvals.resize(ws.idx.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t t = ws.ptr[r]; t < ws.ptr[r + 1]; ++t) ws.pvals[t] = y[r * ld + ws.idx[t]];
}

// The forward's rows of a listed family: solves each row of scores y (m x n,
// row stride ld) for its shift (c[r], as normalize_scores returns it) and gathers its
// support as CSR lists (ws.idx, ws.pvals, ws.ptr) without writing the row.
// Returns false, with every row's probabilities written in place as
// normalize_scores writes them, once the lists pass `limit` entries or a row
// is NaN: then the block's P·V runs over the rows.
// With scale_rows, y's rows are scaled by `scale` in their max pass first.
template <typename acc_t, Family FAM>
bool solve_listed(acc_t* y, int64_t m, int64_t n, int64_t ld, acc_t b, int64_t limit, float* c,
                  Workspace<acc_t>& ws, bool scale_rows, acc_t scale) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  reserve_lists(ws, limit, n);
  ws.ptr.assign(m + 1, 0);
  ws.rshift.resize(m), ws.rmax.resize(m), ws.rnorm.resize(m);
  acc_t* work = ws.work.data();
  bool listed = true;
  int64_t raw_rows = 0;  // rows [0, raw_rows) may be left unscaled (with scale_rows)
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * ld;
    acc_t lanes_buf[kStartLanes<acc_t>];
    acc_t* lanes = n >= kStartLanes<acc_t> ? lanes_buf : nullptr;  // (both families start from them)
    // A row whose support is listed from its candidates is not scaled: its
    // max and lanes are (exactly as the scaled row's), and the candidates
    // as they are gathered (positions_above_scaled).
    const acc_t raw_scale = scale_rows && lanes && listed ? scale : acc_t(0);
    if (raw_scale > acc_t(0)) raw_rows = r + 1;
    const acc_t mx = raw_scale > acc_t(0) ? scaled_max_of(row, n, scale, lanes)
                     : scale_rows          ? scale_row_max(row, n, scale, lanes)
                                           : row_max(row, n, lanes);
    ws.rmax[r] = mx;
    ws.ptr[r + 1] = ws.ptr[r];
    if (mx == -inf) {  // no allowed key: zeros
      c[r] = std::numeric_limits<float>::infinity();
      continue;
    }
    if (mx != mx || mx == inf) {
      c[r] = std::numeric_limits<float>::quiet_NaN();
      listed = false;
      continue;
    }
    acc_t norm = 1;
    double shift;
    // With lanes, the candidates are gathered with their positions, and they
    // hold the support: no further pass over the row.
    int64_t candidates = -1;
    if constexpr (FAM == Family::kSparsemax) {
      if (lanes) {
        const acc_t cut = sparsemax_subset_cut<acc_t>(lanes, mx);
        const int64_t k = raw_scale > acc_t(0)
                              ? positions_above_scaled(row, n, acc_t(0), raw_scale, cut, work, ws.pidx.data())
                              : few_above(row, n, cut, work, ws.pidx.data());
        if (listed) {  // (the solve compacts work in place)
          const int64_t t0 = ws.ptr[r];
          std::copy_n(work, k, ws.pvals.data() + t0);
          std::copy_n(ws.pidx.data(), k, ws.idx.data() + t0);
          candidates = k;
        }
        shift = sparsemax_threshold_listed<acc_t>(work, k, mx);
      } else {
        shift = sparsemax_threshold<acc_t>(row, n, mx, work);
      }
      c[r] = static_cast<float>(mx + static_cast<acc_t>(shift - static_cast<double>(mx)));
    } else {
      int32_t* pos = listed && lanes ? ws.pidx.data() : nullptr;
      const acc_t cr = lanes ? solve_entmax15_from_lanes<acc_t>(row, n, mx, nullptr, work, work + n, lanes, &norm,
                                                                pos, &candidates, raw_scale)
                             : solve_row<acc_t, FAM>(row, n, mx, b, nullptr, work, work + n, ws.pidx.data(),
                                                     nullptr, &norm);
      if (!pos) candidates = -1;
      shift = static_cast<double>(cr);
      c[r] = static_cast<float>(mx + cr);
    }
    ws.rshift[r] = shift, ws.rnorm[r] = norm;
    if (!listed) continue;
    const int64_t t0 = ws.ptr[r];
    acc_t* pv = ws.pvals.data() + t0;
    int32_t* ix = ws.idx.data() + t0;
    if (candidates >= 0) {
      if constexpr (FAM != Family::kSparsemax) {  // (sparsemax copied them before its solve)
        std::copy_n(work, candidates, pv);
        std::copy_n(ws.pidx.data(), candidates, ix);
      }
      ws.ptr[r + 1] = t0 + listed_probs<acc_t, FAM>(pv, ix, candidates, shift, b, norm);
    } else {
      ws.ptr[r + 1] = t0 + support_list<acc_t, FAM>(row, n, mx, shift, b, norm, pv, ix);
    }
    listed = ws.ptr[r + 1] <= limit;
  }
  if (listed) return true;
  for (int64_t r = 0; r < m; ++r) {
    acc_t* row = y + r * ld;
    const acc_t mx = ws.rmax[r];
    if (r < raw_rows) scale_rows_in_place(row, 0, 1, n, ld, scale);
    if (mx == -inf) {
      std::fill(row, row + n, acc_t(0));
    } else if (mx != mx || mx == inf) {
      std::fill(row, row + n, std::numeric_limits<acc_t>::quiet_NaN());
    } else if constexpr (FAM == Family::kSparsemax) {
      write_sparsemax<acc_t>(row, n, ws.rshift[r], row);
    } else {
      write_probs<acc_t, FAM>(row, n, mx, static_cast<acc_t>(ws.rshift[r]), b, ws.rnorm[r], row);
    }
  }
  return false;
}

// solve_listed for α-entmax with 0 < b < 1 (1 < α < 2), whose start and
// candidates come from the row's strided maxima (listed_candidates): a row
// whose candidates ListedSearch can search is listed from them; any other
// (its start refused, or the list over a quarter of the row) is solved and
// written whole, and its support read back from the written row. Once the
// lists pass `limit` or a row is NaN, the rows listed so far are written
// from their lists, the rest solved in place (normalize_scores), and false
// is returned. With scale_rows, y's rows are scores still to be scaled by
// `scale` (> 0).
template <typename acc_t>
bool solve_listed_generic(acc_t* y, int64_t m, int64_t n, int64_t ld, acc_t b, int64_t limit, float* c,
                          Workspace<acc_t>& ws, bool scale_rows, acc_t scale) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  reserve_lists(ws, limit, n);
  ws.ptr.assign(m + 1, 0);
  acc_t* cand = ws.work.data();  // n entries, then the search's scratch
  acc_t* p = cand + n;
  bool gave_up = false;
  int64_t r = 0;
  for (; r < m; ++r) {
    acc_t* row = y + r * ld;
    acc_t lanes_buf[kStartLanes<acc_t>];
    acc_t* lanes = n >= kStartLanes<acc_t> ? lanes_buf : nullptr;
    // With scale_rows the row stays unscaled unless solved whole: its max
    // and lanes are scaled (exactly the scaled row's), and the candidates
    // picked and scaled as they are gathered.
    const acc_t mx = scale_rows ? scaled_max_of(row, n, scale, lanes) : row_max(row, n, lanes);
    const int64_t t0 = ws.ptr[r];
    ws.ptr[r + 1] = t0;
    if (mx == -inf) {  // no allowed key: zeros
      c[r] = std::numeric_limits<float>::infinity();
      continue;
    }
    if (mx != mx || mx == inf) {
      gave_up = true;
      break;
    }
    acc_t* pv = ws.pvals.data() + t0;
    int32_t* ix = ws.idx.data() + t0;
    int64_t kept = -1;
    if (lanes) {
      acc_t start;
      const int64_t k =
          listed_candidates<acc_t>(row, n, mx, b, lanes, cand, ix, start, scale_rows ? scale : acc_t(0));
      if (4 * k <= n) {
        ListedSearch<acc_t> search(cand, ix, k, n, start, b, shift_upper_memo<acc_t>(n, b), p, nullptr);
        while (search.advance()) {
        }
        if (!search.refused) {
          c[r] = static_cast<float>(mx + search.c);
          // The candidates' probabilities, those outside the support (0) dropped.
          kept = drop_zeros<acc_t>(p, ix, k, search.norm, pv);
        }
      }
    }
    if (kept < 0) {
      if (scale_rows) scale_rows_in_place(row, 0, 1, n, ld, scale);
      c[r] = static_cast<float>(mx + solve_generic_convex<acc_t>(row, n, mx, b, row, cand, p, ws.pidx.data(), nullptr));
      kept = positions_above(row, n, acc_t(0), acc_t(0), pv, ix);
    }
    ws.ptr[r + 1] = t0 + kept;
    if (ws.ptr[r + 1] > limit) {
      gave_up = true;
      ++r;
      break;
    }
  }
  if (!gave_up) return true;
  // (Rows before r are written whole from their lists; the others are unscaled.)
  if (scale_rows) scale_rows_in_place(y, r, m, n, ld, scale);
  for (int64_t t = 0; t < r; ++t)
    scatter_row<acc_t>(ws.pvals.data() + ws.ptr[t], ws.idx.data() + ws.ptr[t], ws.ptr[t + 1] - ws.ptr[t], acc_t(1),
                       n, y + t * ld);
  for (; r < m; ++r)
    c[r] = static_cast<float>(normalize_scores<acc_t, Family::kGeneric>(y + r * ld, n, b, ws.work.data(),
                                                                          ws.pidx.data()));
  return false;
}

// p = φ_b(s - c) (sparsemax: [s - θ]_+) for one row of scores (in place). In
// double, the float32 shift is refined by one Newton step so that p matches
// the forward to double precision (c is stored in float32 by the contract).
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
  if constexpr (FAM == Family::kSparsemax) {
    // c is sparsemax's threshold θ (solve_row). In double, one step of
    // Michelot's iteration from the float32 θ gives it to double precision.
    double theta = static_cast<double>(c);
    if constexpr (std::is_same_v<acc_t, double>) {
      double sum = 0;
      int64_t k = 0;
      for (int64_t j = 0; j < n; ++j)
        if (y[j] > theta) sum += y[j], ++k;
      if (k > 0) theta = (sum - 1.0) / static_cast<double>(k);
    }
    write_sparsemax<acc_t>(y, n, theta, y);
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
      const ShiftSums<acc_t> s = shift_sums<acc_t, FAM>(y, n, c, b);
      if (s.g > 0) c += (s.p - acc_t(1)) / s.g;
    }
  }
  if constexpr (FAM == Family::kGeneric) {
    write_probs_sparse<acc_t>(y, n, acc_t(0), c, b, acc_t(1), y, vals, idx);
  } else {
    write_probs<acc_t, FAM>(y, n, acc_t(0), c, b, acc_t(1), y);
  }
}

// The backward's rows gather their supports from the scores (support_list)
// where the recomputed probabilities are the forward's formula at the saved
// float32 shift: float32 rows of the listed families and of α-entmax with
// 1 < α <= 2 (double refines the shift on the whole row first; α > 2 solves
// the row again).
template <typename acc_t, Family FAM>
bool recompute_listed_applies(acc_t b) {
  if constexpr (!std::is_same_v<acc_t, float>) {
    return false;
  } else {
    return kListed<acc_t, FAM> || (b > acc_t(0) && b <= acc_t(1));
  }
}

// The supports of the block's rows of scores y (m x n) at their saved shifts
// c, as CSR lists (ws.idx, ws.pvals, ws.ptr) holding what recompute_probs and
// collect_support would give. Returns false (nothing written to y) when the
// lists pass `limit` entries or a row is NaN.
template <typename acc_t, Family FAM>
bool recompute_listed(const acc_t* y, int64_t m, int64_t n, const float* c, acc_t b, int64_t limit,
                      Workspace<acc_t>& ws) {
  reserve_lists(ws, limit, n);
  ws.ptr.assign(m + 1, 0);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t0 = ws.ptr[r];
    ws.ptr[r + 1] = t0;
    const acc_t cr = static_cast<acc_t>(c[r]);
    if (cr != cr) return false;
    if (!(cr < std::numeric_limits<acc_t>::infinity())) continue;  // no allowed key: zeros
    ws.ptr[r + 1] = t0 + support_list<acc_t, FAM>(y + r * n, n, acc_t(0), static_cast<double>(cr), b, acc_t(1),
                                                  ws.pvals.data() + t0, ws.idx.data() + t0);
    if (ws.ptr[r + 1] > limit) return false;
  }
  return true;
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

// dS = scale · g ⊙ (dP - Σ g dP / Σ g) over the runs of each row, in place
// in d. For the generic family (g a power) a row whose support is sparse
// takes its powers on the support only (backward_row_sparse; d outside the
// runs is not read there, only overwritten); gbuf: 2n, idx: n.
template <typename acc_t, Family FAM>
void backward_rows(acc_t* y, acc_t* d, int64_t m, int64_t n, const std::vector<std::pair<int64_t, int64_t>>& runs,
                   acc_t b, acc_t scale, double* dalpha, acc_t* gbuf, int32_t* idx) {
  for (int64_t r = 0; r < m; ++r) {
    const acc_t* p = y + r * n;
    acc_t* dp = d + r * n;
    if (dalpha) *dalpha += alpha_grad_row<acc_t>(p, dp, runs, b);
    if constexpr (FAM == Family::kGeneric) {
      if (b > acc_t(0) && backward_row_sparse<acc_t, FAM>(p, dp, dp, gbuf, idx, n, b, scale)) continue;
    }
    acc_t gsum = 0, gdp = 0;
    for (auto [j0, j1] : runs) reduce_g<acc_t, FAM>(p + j0, dp + j0, j1 - j0, b, gsum, gdp);
    const acc_t mean = gsum > acc_t(0) ? gdp / gsum : acc_t(0);
    for (auto [j0, j1] : runs) apply_g<acc_t, FAM>(p + j0, dp + j0, j1 - j0, b, mean, scale);
  }
}

// ds = scale · g · (dp - Σ g dp / Σ g) over one row's listed entries p[0:k]
// (all in the support), in place in dp; g = p^(2-α) is taken once per entry,
// a vector at a time (g_of), into gk.
template <typename acc_t, Family FAM>
void listed_vjp(const acc_t* p, acc_t* dp, int64_t k, acc_t b, acc_t scale, std::vector<acc_t>& gk) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  if (static_cast<int64_t>(gk.size()) < k) gk.resize(k);
  acc_t* g = gk.data();
  V vs(0), vd(0);
  int64_t t = 0;
  for (; t + W <= k; t += W) {
    const V gv = g_of<acc_t, FAM>(V::loadu(p + t), b);
    gv.store(g + t);
    vs += gv;
    vd += gv * V::loadu(dp + t);
  }
  if (t < k) {
    const int rest = static_cast<int>(k - t);
    const V gv = g_of<acc_t, FAM>(load_tail(p + t, rest, acc_t(0)), b);  // (g = 0 past the list)
    gv.store(g + t, rest);
    vs += gv;
    vd += gv * load_tail(dp + t, rest, acc_t(0));
  }
  const acc_t gsum = hsum(vs), gdp = hsum(vd);
  const V vmean(gsum > acc_t(0) ? gdp / gsum : acc_t(0)), vscale(scale);
  for (t = 0; t + W <= k; t += W) (vscale * V::loadu(g + t) * (V::loadu(dp + t) - vmean)).store(dp + t);
  if (t < k) {
    const int rest = static_cast<int>(k - t);
    (vscale * V::loadu(g + t, rest) * (V::loadu(dp + t, rest) - vmean)).store(dp + t, rest);
  }
}

// dk_j += ds q_r and dv_j += p·keep dO_r over a block's listed entries (CSR
// ws.idx / ws.ptr, with ds in ws.dps and p·keep in ws.kept).
template <typename acc_t>
void listed_key_grads(const Problem<acc_t>& P, int64_t m, int64_t n, const acc_t* qb, const acc_t* dob, acc_t* dk,
                      acc_t* dv, Workspace<acc_t>& ws) {
  const std::vector<int32_t>& idx = ws.idx;
  const std::vector<int64_t>& ptr = ws.ptr;
  const std::vector<acc_t>& dps = ws.dps;
  const std::vector<acc_t>& pk = ws.kept;
  const int64_t total = ptr[m];
  // With few entries per key (the regrouping below costs a few passes over
  // the n keys), entry by entry.
  if (2 * total < n) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t t = ptr[r]; t < ptr[r + 1]; ++t) {
        const int64_t j = idx[t];
        axpy(dk + j * P.E, qb + r * P.E, dps[t], P.E);
        axpy(dv + j * P.Ev, dob + r * P.Ev, pk[t], P.Ev);
      }
    return;
  }
  // Else the entries regrouped by key (CSC; each key's rows in increasing
  // order): dk_j and dv_j take all of the block's terms in registers, read
  // and written once per block instead of once per entry (with scattered
  // axpys, their stores would dominate the backward). Which way a block goes
  // depends on its entries alone, never on the thread count. A dropped entry
  // (keep 0) adds 0·dO_r.
  std::vector<int64_t>& start = ws.cstart;
  std::vector<int32_t>& rows = ws.crow;
  std::vector<acc_t>& cds = ws.cds;
  std::vector<acc_t>& cpk = ws.cpk;
  start.assign(n + 1, 0);
  rows.resize(total), cds.resize(total), cpk.resize(total);
  for (int64_t t = 0; t < total; ++t) ++start[idx[t] + 1];
  for (int64_t j = 0; j < n; ++j) start[j + 1] += start[j];
  for (int64_t r = 0; r < m; ++r)
    for (int64_t t = ptr[r]; t < ptr[r + 1]; ++t) {
      const int64_t at = start[idx[t]]++;
      rows[at] = static_cast<int32_t>(r), cds[at] = dps[t], cpk[at] = pk[t];
    }
  // (start[j] now holds key j's end, the next key's start.)
  int64_t a = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t e = start[j];
    if (e == a) continue;
    accumulate_listed(cds.data() + a, rows.data() + a, e - a, qb, P.E, P.E, dk + j * P.E, true);
    accumulate_listed(cpk.data() + a, rows.data() + a, e - a, dob, P.Ev, P.Ev, dv + j * P.Ev, true);
    a = e;
  }
}

// Backward of a block of rows over their supports (CSR idx/pvals/ptr), entry by
// entry: dp = dO·v_j, ds = scale·g·(dp - Σg dp/Σg), dq = Σ ds k_j, then key by
// key dk_j += Σ ds q and dv_j += Σ p·keep dO.
template <typename acc_t, Family FAM>
void backward_sparse_rows(const Problem<acc_t>& P, int64_t m, int64_t n, acc_t b, const acc_t* qb,
                          const acc_t* dob, const acc_t* kh, const acc_t* vh, acc_t* dqb, acc_t* dk, acc_t* dv,
                          double* dalpha, int64_t row0, Workspace<acc_t>& ws) {
  const Dropout& drop = P.drop;
  const acc_t dscale = static_cast<acc_t>(drop.scale);
  const std::vector<int32_t>& idx = ws.idx;
  const std::vector<int64_t>& ptr = ws.ptr;
  const acc_t* pv = ws.pvals.data();
  const int64_t total = ptr[m];
  // By entry (CSR order): dp, then ds in its place; dV's weight p·keep.
  std::vector<acc_t>& dps = ws.dps;
  std::vector<acc_t>& pk = ws.kept;
  dps.resize(total);
  pk.resize(total);
  std::vector<double> edge_buf;
  const bool edge = FAM == Family::kGeneric && b > acc_t(1);
  for (int64_t r = 0; r < m; ++r) {
    const acc_t* dor = dob + r * P.Ev;
    acc_t* dqr = dqb + r * P.E;
    const int64_t t0 = ptr[r], t1 = ptr[r + 1];
    if (t0 == t1) {
      std::fill(dqr, dqr + P.E, acc_t(0));
      continue;
    }
    const int64_t k = t1 - t0;
    acc_t* dpr = dps.data() + t0;
    acc_t* pkr = pk.data() + t0;
    dots_listed(dor, idx.data() + t0, k, vh, P.Ev, P.Ev, dpr);
    if (drop.on) {
      // dp_j = dO·v_j · keep_j / (1 - p); a dropped entry's dp and weight
      // are 0 whatever v_j holds.
      for (int64_t t = 0; t < k; ++t) {
        const acc_t kj = static_cast<acc_t>(dropout_keep(drop, row0 + r, P.key0 + idx[t0 + t])) * dscale;
        pkr[t] = kj == acc_t(0) ? acc_t(0) : pv[t0 + t] * kj;
        dpr[t] = kj == acc_t(0) ? acc_t(0) : kj * dpr[t];
      }
    } else {
      std::copy(pv + t0, pv + t1, pkr);
    }
    if (dalpha) {
      math::AlphaGradSums asums;
      for (int64_t t = t0; t < t1; ++t) asums.add(static_cast<double>(pv[t]), static_cast<double>(dps[t]), b);
      *dalpha += asums.grad(static_cast<double>(b));
    }
    if (edge) {
      // α > 2: in double, relative to a pivot (math::edge_vjp says why).
      edge_buf.resize(3 * k);
      for (int64_t t = t0; t < t1; ++t) {
        edge_buf[t - t0] = static_cast<double>(pv[t]);
        edge_buf[k + t - t0] = static_cast<double>(dps[t]);
      }
      double* pe = edge_buf.data();
      math::entmax_edge_vjp(pe, pe + k, pe + 2 * k, k, static_cast<double>(b));
      for (int64_t t = t0; t < t1; ++t) dps[t] = P.scale * static_cast<acc_t>(edge_buf[2 * k + t - t0]);
    } else {
      listed_vjp<acc_t, FAM>(pv + t0, dpr, k, b, P.scale, ws.gk);
    }
    // dq = Σ ds k_j, in registers.
    accumulate_listed(dps.data() + t0, idx.data() + t0, t1 - t0, kh, P.E, P.E, dqr);
  }
  listed_key_grads(P, m, n, qb, dob, dk, dv, ws);
}

}  // namespace

// Rows [j0, j1) of V from P.v_rows_half, widened to acc_t into buf (Ev
// columns, the padding zero); returns buf.
template <typename acc_t>
const acc_t* widen_v_rows(const Problem<acc_t>& P, int64_t bi, int64_t hk, int64_t j0, int64_t j1,
                          std::vector<acc_t>& buf) {
  return widen_half_rows(static_cast<const h16*>(P.v_rows_half) + P.v_half_offset(bi, hk) + j0 * P.ev_half,
                         P.half_is_bf16, j1 - j0, P.ev_half, P.Ev, buf);
}

// The key rows [0, n) of a block (rows of row_bytes, contiguous from rows)
// asked for before its score GEMM, so that their cache misses resolve during
// it: the entry-by-entry passes over a sparse block's supports reach rows of
// V (and in the backward K, dK and dV) in no order a hardware prefetcher
// follows, and a window's block meets about a block's worth of keys that no
// earlier block of its thread touched. Spans past kKeyRowsPrefetchBytes are
// left alone (long rows: their supports are a small part of them, and the
// span would push the GEMM's operands out of L2).
constexpr int64_t kKeyRowsPrefetchBytes = 128 * 1024;

inline void prefetch_key_rows(const void* rows, int64_t n, int64_t row_bytes, bool write) {
  if (rows == nullptr || n * row_bytes > kKeyRowsPrefetchBytes) return;
  prefetch_span(static_cast<const char*>(rows), n * row_bytes, write);
}

// Where listed_pv reads the block's V rows, and their size in bytes.
template <typename acc_t>
std::pair<const void*, int64_t> listed_v_rows(const Problem<acc_t>& P, int64_t bi, int64_t hk) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (P.v_rows_half) {
      const int64_t off = P.v_half_offset(bi, hk);
      return {static_cast<const char*>(P.v_rows_half) + off * 2, P.ev_half * 2};
    }
  }
  return {P.v_head(bi, hk), P.Ev * static_cast<int64_t>(sizeof(acc_t))};
}

// O (m x Ev) = the block's rows of probabilities times V, row by row over
// their support lists (ws.idx, ws.pvals, ws.ptr), from V as it is
// (bfloat16 / float16: P.v_rows_half; the padded columns zero).
template <typename acc_t>
void listed_pv(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t m, acc_t* o, Workspace<acc_t>& ws) {
  const int64_t hk = h / P.group();
  auto rows = [&](const auto* v, int64_t ldv, int64_t ev) {
    for (int64_t r = 0; r < m; ++r) {
      const int64_t t0 = ws.ptr[r];
      acc_t* orow = o + r * P.Ev;
      accumulate_listed(ws.pvals.data() + t0, ws.idx.data() + t0, ws.ptr[r + 1] - t0, v, ldv, ev, orow);
      std::fill(orow + ev, orow + P.Ev, acc_t(0));
    }
  };
  if constexpr (std::is_same_v<acc_t, float>) {
    if (P.v_rows_half) {
      const int64_t off = P.v_half_offset(bi, hk);
      if (P.half_is_bf16) return rows(static_cast<const c10::BFloat16*>(P.v_rows_half) + off, P.ev_half, P.ev_half);
      return rows(static_cast<const c10::Half*>(P.v_rows_half) + off, P.ev_half, P.ev_half);
    }
  }
  rows(P.v_head(bi, hk), P.Ev, P.Ev);
}

// O (m x Ev) = P · V for the block's rows of probabilities in ws.y (row
// stride ld), dropout applied first: over support lists when the rows are
// sparse enough, else GEMMs over the key runs holding probability.
template <typename acc_t>
void probs_times_v(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, int64_t ld,
                   acc_t* o, Workspace<acc_t>& ws) {
  acc_t* y = ws.y.data();
  const int64_t hk = h / P.group();
  const int64_t limit = static_cast<int64_t>(kSparseDensity * m * n);
  if (P.drop.on) apply_dropout(P.drop, y, m, n, ld, P.row_id(bi, h, i0), P.key0);
  if (collect_support(y, m, n, ld, limit, ws.idx, ws.ptr)) {
    gather_listed(y, m, ld, ws);
    return listed_pv(P, bi, h, m, o, ws);
  }
  nonzero_runs(y, m, n, ld, ws.runs);
  if (ws.runs.empty()) {
    std::fill(o, o + m * P.Ev, acc_t(0));
    return;
  }
  // O = Σ over the runs of P[:, run] · V[run] (V row-major is its own panel
  // layout: its width Ev is a multiple of the panel).
  bool first = true;
  for (auto [j0, j1] : ws.runs) {
    const acc_t* vrun = P.v ? P.v_head(bi, hk) + j0 * P.Ev : widen_v_rows(P, bi, hk, j0, j1, ws.vwide);
    tile_gemm<acc_t>(m, P.Ev, j1 - j0, acc_t(1), y + j0, ld, 1, vrun, P.Ev, kPanel<acc_t>, o, P.Ev, !first);
    first = false;
  }
}


// Forward of a block of rows of one head, of family FAM (not softmax: its
// heads take the tiled path).
template <typename acc_t, Family FAM>
void rows_forward(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, acc_t* o,
                  float* c, Workspace<acc_t>& ws) {
  acc_t* y = ws.y.data();
  const int64_t ld = rows_ld(n, P.q16 != nullptr);
  bool scale_later = false;
  const acc_t b = P.b[h];
  // (Dropout scales the kept weights of whole rows: those rows are written.)
  const bool generic_listed = FAM == Family::kGeneric && b > acc_t(0) && b < acc_t(1);
  const bool listed_rows = !P.drop.on && (kListed<acc_t, FAM> || generic_listed);
  if (listed_rows) {
    const auto [v_rows, v_row_bytes] = listed_v_rows(P, bi, h / P.group());
    prefetch_key_rows(v_rows, n, v_row_bytes, false);
  }
  score_block(P, bi, h, i0, m, n, y, ld, listed_rows ? &scale_later : nullptr);
  const int64_t limit = static_cast<int64_t>(kSparseDensity * m * n);
  if (listed_rows) {
    bool listed;
    if constexpr (kListed<acc_t, FAM>) {
      listed = solve_listed<acc_t, FAM>(y, m, n, ld, b, limit, c, ws, scale_later, P.scale);
    } else {
      listed = solve_listed_generic<acc_t>(y, m, n, ld, b, limit, c, ws, scale_later, P.scale);
    }
    if (listed) return listed_pv(P, bi, h, m, o, ws);
  } else {
    for (int64_t r = 0; r < m; ++r)
      c[r] = static_cast<float>(normalize_scores<acc_t, FAM>(y + r * ld, n, b, ws.work.data(), ws.pidx.data()));
  }
  probs_times_v(P, bi, h, i0, m, n, ld, o, ws);
}

// Forward of a block of rows of a structured head (Problem::prox): each row
// of scores solved whole by ws.prox, then P·V as for the other families.
template <typename acc_t>
void prox_forward(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, acc_t* o,
                  float* c, Workspace<acc_t>& ws) {
  acc_t* y = ws.y.data();
  const int64_t ld = rows_ld(n, P.q16 != nullptr);
  score_block(P, bi, h, i0, m, n, y, ld);
  for (int64_t r = 0; r < m; ++r) c[r] = ws.prox.solve(P.prox, y + r * ld, n, P.lam[h]);
  probs_times_v(P, bi, h, i0, m, n, ld, o, ws);
}

template <typename acc_t>
void rows_forward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, acc_t* o,
                        float* c, Workspace<acc_t>& ws) {
  // Softmax heads never come here (they are tiled); were one to, it would be
  // solved as α-entmax at b = 0.
  if (P.prox != Prox::kNone) return prox_forward(P, bi, h, i0, m, n, o, c, ws);
  math::with_family(P.fam[h], [&](auto tag) {
    constexpr Family F = decltype(tag)::value;
    rows_forward<acc_t, F == Family::kSoftmax ? Family::kGeneric : F>(P, bi, h, i0, m, n, o, c, ws);
  });
}

// Backward of a block of rows of one head, of family FAM: P recomputed from
// the scores and the saved shift, then entry by entry over the supports when
// they are small, else GEMMs over the key blocks that hold probability.
template <typename acc_t, Family FAM>
void rows_backward(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, const float* c,
                   const acc_t* dob, acc_t* dqb, acc_t* dk, acc_t* dv, double* da, Workspace<acc_t>& ws) {
  const int64_t hk = h / P.group();
  const acc_t* kh = P.k_head(bi, hk);
  const acc_t* vh = P.v_head(bi, hk);
  const acc_t* qb = P.q_rows(bi, h, i0);
  acc_t* y = ws.y.data();
  acc_t* d = ws.d.data();
  if (FAM != Family::kSoftmax) {
    constexpr int64_t elem = sizeof(acc_t);
    const int64_t e_bytes = P.E * elem, ev_bytes = P.Ev * elem;
    prefetch_key_rows(kh, n, e_bytes, false);
    prefetch_key_rows(vh, n, ev_bytes, false);
    if (!P.do16) prefetch_key_rows(dk, n, e_bytes, true), prefetch_key_rows(dv, n, ev_bytes, true);
  }
  score_block(P, bi, h, i0, m, n, y, n);
  const acc_t b = P.b[h];
  // α > 2 always goes entry by entry, where its mean is pivoted.
  const int64_t max_entries = b > acc_t(1) ? m * n : static_cast<int64_t>(kSparseDensity * m * n);
  auto sparse_rows = [&] {
    backward_sparse_rows<acc_t, FAM>(P, m, n, b, qb, dob, kh, vh, dqb, dk, dv, da, P.row_id(bi, h, i0), ws);
  };
  if constexpr (FAM != Family::kSoftmax) {
    if (recompute_listed_applies<acc_t, FAM>(b) && recompute_listed<acc_t, FAM>(y, m, n, c, b, max_entries, ws))
      return sparse_rows();
  }
  for (int64_t r = 0; r < m; ++r)
    recompute_probs<acc_t, FAM>(y + r * n, n, static_cast<acc_t>(c[r]), b, ws.work.data(), ws.pidx.data());
  if constexpr (FAM != Family::kSoftmax) {
    if (collect_support(y, m, n, n, max_entries, ws.idx, ws.ptr)) {
      gather_listed(y, m, n, ws);
      return sparse_rows();
    }
  }
  Runs& runs = ws.runs;
  if (FAM == Family::kSoftmax && !P.mask) {
    runs.assign(1, {0, n});
  } else {
    nonzero_runs(y, m, n, n, runs);
  }
  if (runs.empty()) {
    std::fill(dqb, dqb + m * P.E, acc_t(0));
    return;
  }
  // dP = dO · Vᵀ on the runs (over packed value panels when there are).
  for (auto [j0, j1] : runs) {
    if (P.vp) {
      gemm_packed_cols<acc_t>(m, n, j0, j1, P.Ev, acc_t(1), dob, P.vp_head(bi, h / P.group()), d);
    } else {
      gemm<acc_t>(false, true, m, j1 - j0, P.Ev, acc_t(1), dob, P.Ev, vh + j0 * P.Ev, P.Ev, acc_t(0), d + j0, n);
    }
  }
  // With dropout: dP of the kept weights, times 1 / (1 - p), and P dropped
  // for dV, on the support's key chunks (elsewhere g = 0 and p = 0); the
  // normalizer's backward needs P whole, so it runs on a copy.
  if (P.drop.on) {
    ws.pkept.assign(y, y + m * n);
    apply_dropout(P.drop, ws.pkept.data(), m, n, n, P.row_id(bi, h, i0), P.key0, d);
  }
  backward_rows<acc_t, FAM>(y, d, m, n, runs, b, P.scale, da, ws.work.data(), ws.pidx.data());
  if (P.drop.on) std::copy(ws.pkept.begin(), ws.pkept.end(), y);
  bool first = true;
  for (auto [j0, j1] : runs) {
    const int64_t w = j1 - j0;
    // dQ = dS · K, dK += dSᵀ · Q, dV += Pᵀ · dO (the transposed operands by
    // their strides; K, Q, dO row-major are their own panel layouts).
    constexpr int64_t NR = kPanel<acc_t>;
    tile_gemm<acc_t>(m, P.E, w, acc_t(1), d + j0, n, 1, kh + j0 * P.E, P.E, NR, dqb, P.E, !first);
    tile_gemm<acc_t>(w, P.E, m, acc_t(1), d + j0, 1, n, qb, P.E, NR, dk + j0 * P.E, P.E, true);
    tile_gemm<acc_t>(w, P.Ev, m, acc_t(1), y + j0, 1, n, dob, P.Ev, NR, dv + j0 * P.Ev, P.Ev, true);
    first = false;
  }
}

// nonzero_runs for entries of either sign (its max test suits probabilities
// only): the runs of key blocks where some row of y is non-zero or NaN.
template <typename acc_t>
void signed_nonzero_runs(const acc_t* y, int64_t m, int64_t n, int64_t ld, Runs& runs) {
  runs.clear();
  for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
    const int64_t w = std::min(kBlockN, n - j0);
    bool any = false;
    for (int64_t r = 0; r < m && !any; ++r) any = any_nonzero(y + r * ld + j0, w);
    if (!any) continue;
    if (!runs.empty() && runs.back().second == j0) {
      runs.back().second = j0 + w;
    } else {
      runs.emplace_back(j0, j0 + w);
    }
  }
}

// The backward of a block of fusedmax rows over their supports, when they
// hold at most kSparseDensity of the block's entries: each row of scores (y,
// m x n) solved again, dP taken only on its support (a fused segment of
// prox(s) lies in the support or outside it whole, so dS vanishes off the
// support: sparsemax's gradient does, and the prox's averages it over
// segments), then dQ, dK, dV entry by entry as for sparsemax's rows. Returns
// false, with y overwritten, once the supports pass that share.
template <typename acc_t>
bool fusedmax_backward_listed(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                              acc_t* y, const float* c, const acc_t* dob, acc_t* dqb, acc_t* dk, acc_t* dv,
                              double* dlam, Workspace<acc_t>& ws) {
  const int64_t hk = h / P.group();
  const acc_t* kh = P.k_head(bi, hk);
  const acc_t* vh = P.v_head(bi, hk);
  const int64_t limit = static_cast<int64_t>(kSparseDensity * m * n);
  reserve_lists(ws, limit, n);
  if (ws.dps.size() < ws.idx.size()) ws.dps.resize(ws.idx.size());
  if (ws.kept.size() < ws.idx.size()) ws.kept.resize(ws.idx.size());
  ws.ptr.assign(m + 1, 0);
  const Dropout& drop = P.drop;
  const acc_t dscale = static_cast<acc_t>(drop.scale);
  const int64_t row0 = P.row_id(bi, h, i0);
  double dl = 0.0;
  for (int64_t r = 0; r < m; ++r) {
    acc_t* yr = y + r * n;
    acc_t* dr = ws.d.data() + r * n;
    ws.prox.solve(P.prox, yr, n, P.lam[h], c[r]);
    const int64_t t0 = ws.ptr[r];
    const int32_t* ir = ws.idx.data() + t0;
    const int64_t k = append_support(yr, n, ws.idx.data() + t0);
    ws.ptr[r + 1] = t0 + k;
    if (ws.ptr[r + 1] > limit) return false;
    acc_t* dpr = ws.dps.data() + t0;
    acc_t* pkr = ws.kept.data() + t0;
    dots_listed(dob + r * P.Ev, ir, k, vh, P.Ev, P.Ev, dpr);
    for (int64_t t = 0; t < k; ++t) pkr[t] = yr[ir[t]];
    if (drop.on) {
      // dV takes p·keep and the solver dP·keep, both scaled (a dropped
      // entry's are 0 whatever v_j holds).
      for (int64_t t = 0; t < k; ++t) {
        const acc_t kj = static_cast<acc_t>(dropout_keep(drop, row0 + r, P.key0 + ir[t])) * dscale;
        pkr[t] = kj == acc_t(0) ? acc_t(0) : pkr[t] * kj;
        dpr[t] = kj == acc_t(0) ? acc_t(0) : kj * dpr[t];
      }
    }
    // The solver reads a whole row of dP; off the support it goes unused.
    std::fill(dr, dr + n, acc_t(0));
    for (int64_t t = 0; t < k; ++t) dr[ir[t]] = dpr[t];
    dl += ws.prox.vjp(P.prox, dr, n, P.scale);
    for (int64_t t = 0; t < k; ++t) dpr[t] = dr[ir[t]];
    acc_t* dqr = dqb + r * P.E;
    if (k == 0) {
      std::fill(dqr, dqr + P.E, acc_t(0));
    } else {
      accumulate_listed(dpr, ir, k, kh, P.E, P.E, dqr);
    }
  }
  listed_key_grads(P, m, n, P.q_rows(bi, h, i0), dob, dk, dv, ws);
  if (dlam) *dlam += dl;
  return true;
}

// Backward of a block of rows of a structured head (Problem::prox): dP =
// dO·Vᵀ over all the block's keys first, then each row solved again from its
// scores (its probabilities, for dV, in place in ws.y) and its dS taken from
// the solver's state; *dlam gets the head's dλ. GEMMs over the key runs
// where dS (dQ, dK) and P (dV) are non-zero: oscarmax's dS reaches beyond
// P's support (a cluster's entries below the threshold share its gradient).
template <typename acc_t>
void prox_backward(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n, const float* c,
                   const acc_t* dob, acc_t* dqb, acc_t* dk, acc_t* dv, double* dlam, Workspace<acc_t>& ws) {
  const int64_t hk = h / P.group();
  const acc_t* kh = P.k_head(bi, hk);
  const acc_t* qb = P.q_rows(bi, h, i0);
  acc_t* y = ws.y.data();
  acc_t* d = ws.d.data();
  score_block(P, bi, h, i0, m, n, y, n);
  if (P.prox == Prox::kFusedmax) {
    if (fusedmax_backward_listed(P, bi, h, i0, m, n, y, c, dob, dqb, dk, dv, dlam, ws)) return;
    score_block(P, bi, h, i0, m, n, y, n);
  }
  if (P.vp) {
    gemm_packed_cols<acc_t>(m, n, 0, n, P.Ev, acc_t(1), dob, P.vp_head(bi, hk), d);
  } else {
    gemm<acc_t>(false, true, m, n, P.Ev, acc_t(1), dob, P.Ev, P.v_head(bi, hk), P.Ev, acc_t(0), d, n);
  }
  const int64_t row0 = P.row_id(bi, h, i0);
  double dl = 0.0;
  for (int64_t r = 0; r < m; ++r) {
    acc_t* yr = y + r * n;
    acc_t* dr = d + r * n;
    ws.prox.solve(P.prox, yr, n, P.lam[h], c[r]);
    // (Dropout: dV takes p·keep, the solver's dP the kept dP; both scaled.)
    if (P.drop.on) apply_dropout(P.drop, yr, 1, n, n, row0 + r, P.key0, dr);
    dl += ws.prox.vjp(P.prox, dr, n, P.scale);
  }
  if (dlam) *dlam += dl;
  constexpr int64_t NR = kPanel<acc_t>;
  signed_nonzero_runs(d, m, n, n, ws.runs);
  if (ws.runs.empty()) std::fill(dqb, dqb + m * P.E, acc_t(0));
  bool first = true;
  for (auto [j0, j1] : ws.runs) {
    const int64_t w = j1 - j0;
    tile_gemm<acc_t>(m, P.E, w, acc_t(1), d + j0, n, 1, kh + j0 * P.E, P.E, NR, dqb, P.E, !first);
    tile_gemm<acc_t>(w, P.E, m, acc_t(1), d + j0, 1, n, qb, P.E, NR, dk + j0 * P.E, P.E, true);
    first = false;
  }
  nonzero_runs(y, m, n, n, ws.runs);
  for (auto [j0, j1] : ws.runs)
    tile_gemm<acc_t>(j1 - j0, P.Ev, m, acc_t(1), y + j0, 1, n, dob, P.Ev, NR, dv + j0 * P.Ev, P.Ev, true);
}

template <typename acc_t>
void rows_backward_block(const Problem<acc_t>& P, int64_t bi, int64_t h, int64_t i0, int64_t m, int64_t n,
                         const float* c, const acc_t* dob, acc_t* dqb, acc_t* dk, acc_t* dv, double* da,
                         Workspace<acc_t>& ws) {
  if (P.prox != Prox::kNone) return prox_backward(P, bi, h, i0, m, n, c, dob, dqb, dk, dv, da, ws);
  math::with_family(P.fam[h], [&](auto tag) {
    rows_backward<acc_t, decltype(tag)::value>(P, bi, h, i0, m, n, c, dob, dqb, dk, dv, da, ws);
  });
}

#define AK_INSTANTIATE_ROWS(T)                                                                                  \
  template void rows_forward_block<T>(const Problem<T>&, int64_t, int64_t, int64_t, int64_t, int64_t, T*, float*, \
                                      Workspace<T>&);                                                          \
  template void rows_backward_block<T>(const Problem<T>&, int64_t, int64_t, int64_t, int64_t, int64_t,          \
                                       const float*, const T*, T*, T*, T*, double*, Workspace<T>&);
AK_INSTANTIATE_ROWS(float)
AK_INSTANTIATE_ROWS(double)

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

// The binary linear-chain ops on the CPU: z in {0,1}^m over a row's m finite
// entries, scored Σ_i u_i z_i + Σ_i W[z_i][z_{i+1}].
//
// crf_marginals (Kim, Denton, Hoang & Rush, 2017): μ_i = P(z_i = 1) under
// p(z) ∝ exp(score), by forward-backward in double (in log space, or with
// rescaled linear messages when the scores' range allows); docs/algorithms.md,
// section 11. Its backward needs Jᵀg with J = ∂μ/∂u, the covariance of z,
// which is the Hessian of log Z and so symmetric: Jᵀg = Jg is the derivative
// of μ along g, computed exactly by carrying tangents through a second
// forward-backward (each message's tangent is the weighted mean of its terms'
// tangents, the weights being the terms' shares of the message, kept from the
// forward). The same tangents give ∂(g·μ)/∂W, by the Hessian's symmetry
// between u and W.
//
// The recurrences are sequential along a row, so the CRF runs rows side by
// side, one per vector lane (struct CrfLanes), whenever their entries allow
// the linear sweep and none is masked; other rows go one at a time. The rows
// side by side take a shorter backward, from the chain's covariance
// (CrfLanes::gradient). Float, bfloat16 and float16 rows of weakly coupled
// chains run in float lanes, twice as many a vector (float_lanes_fit).
//
// sparsemap_chain (Niculae, Martins, Blondel & Cardie, 2018): in closed form
// (a clamped total-variation prox, or an order-constrained projection when
// one transition is forbidden), else the active-set method with Viterbi as
// the oracle (struct Sparsemap below; section 12).
//
// Both: entries at -inf take no part (the finite ones are neighbours in their
// order, a removed one gets 0); a row with NaN or +inf gives NaN, and so does
// a row that no labeling can score (possible only with -inf in W).
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "attnkern/chain_math.h"
#include "attnkern/cpu_kernels.h"
#include "attnkern/isa_features.h"
#include "attnkern/row_layout.h"
#include "attnkern/structured_math.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace {

using at::Tensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Scratch of one row of n entries: the row as loaded, the gradient, the
// output, the finite entries u and their gradients g (compacted), their
// positions and μ; then per label t = 0, 1: the forward and backward messages
// (fwd, back), the label factors of the linear sweep (factor), the shares
// (fshare, bshare) and the tangents (ta, tb). Labels in separate arrays keep
// the element-wise passes vector loops. Not zeroed: every entry is written
// before it is read.
struct ChainScratch {
  std::unique_ptr<double[]> buf;
  std::unique_ptr<int64_t[]> pos;
  double *row, *grad, *out, *u, *g, *mu;
  double *fwd[2], *back[2], *factor[2], *fshare[2], *bshare[2], *ta[2], *tb[2];
  explicit ChainScratch(int64_t n) : buf(new double[20 * n]), pos(new int64_t[n]) {
    double* b = buf.get();
    for (double** a : {&row, &grad, &out, &u, &g, &mu, &fwd[0], &fwd[1], &back[0], &back[1], &factor[0],
                       &factor[1], &fshare[0], &fshare[1], &bshare[0], &bshare[1], &ta[0], &ta[1], &tb[0],
                       &tb[1]}) {
      *a = b;
      b += n;
    }
  }
};

// Compacts the row's finite entries into s.u (positions into s.pos, count m);
// false if the row holds a NaN or +inf.
bool chain_entries(ChainScratch& s, int64_t n, int64_t& m) {
  m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double x = s.row[j];
    if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) return false;
    if (x > kNegInf) {
      s.u[m] = x;
      s.pos[m++] = j;
    }
  }
  return true;
}

// Forward-backward on s.u[0..m) (m >= 1) with transition scores w (2×2,
// row-major: w[2a + b] for z_i = a, z_{i+1} = b). Writes μ and, when `shares`
// (the backward needs them), fshare[t][i] (i >= 1), the share of z_{i-1} = 1
// among the labelings of entries 0..i with z_i = t, which is
// P(z_{i-1} = 1 | z_i = t), and bshare[a][i] (i <= m - 2), the share of
// z_{i+1} = 1 among the labelings of entries i+1..m-1 given z_i = a. Returns
// false when no labeling has a score.
//
// Two sweeps compute the same quantities. The log-space one works for any
// scores. The linear one (one exp per entry instead of nine transcendental
// calls, only multiply-adds on the recurrences, the divisions in vector
// passes after them) is used when every W is finite and the spread of W plus
// max |u| is at most kLinearRange: a message then keeps each label at no less
// than 2^-201·e^-kLinearRange of its pair's previous sum, and pairs are
// rescaled by exact powers of two into [2^-200, 2^200], so every product the
// sweeps form stays a normal double.
constexpr double kLinearRange = 200.0;
constexpr double kPairCeiling = 0x1p200, kPairFloor = 0x1p-200;

bool linear_range(const double* u, int64_t m, const double* w) {
  double lo = w[0], hi = w[0];
  for (int k = 1; k < 4; ++k) {
    lo = std::min(lo, w[k]);
    hi = std::max(hi, w[k]);
  }
  if (!(lo > kNegInf)) return false;
  double largest = 0.0;
  for (int64_t i = 0; i < m; ++i) largest = std::max(largest, std::abs(u[i]));
  return hi - lo + largest <= kLinearRange;
}

// Float lanes (CrfLanes<float>, for float, bfloat16 and float16 rows) keep
// each pair's sum in [2^-40, 2^40], which holds every message, reciprocal
// and product of their sweeps within float's normal range when W's spread is
// at most 27 and that spread plus max |u| at most 40 (docs/algorithms.md,
// section 11). Their rounding errors in μ grow with the chain's coupling,
// t = tanh(|log ρ| / 4), ρ = e^{w00 + w11 - w01 - w10}, as about
// 5 + 1 / (1 - t) float ulps: rows coupled by |log ρ| <= 4 stay within 10.
constexpr double kFloatPairCeiling = 0x1p40, kFloatPairFloor = 0x1p-40;
constexpr double kFloatRange = 40.0, kFloatSpread = 27.0, kFloatCoupling = 4.0;

// Whether a row whose largest |u| is `largest` (finite) with transition
// scores w fits the float lanes.
bool float_lanes_fit(double largest, const double* w) {
  double lo = w[0], hi = w[0];
  for (int k = 1; k < 4; ++k) {
    lo = std::min(lo, w[k]);
    hi = std::max(hi, w[k]);
  }
  if (!(lo > kNegInf)) return false;
  const double spread = hi - lo, coupling = std::abs(w[0] + w[3] - w[1] - w[2]);
  return spread <= kFloatSpread && spread + largest <= kFloatRange && coupling <= kFloatCoupling;
}

// Scales a message pair back into [2^-200, 2^200] (exactly: a power of two);
// a branch that is rarely taken, so the recurrence does not wait on it.
inline void rescale_pair(double& a, double& b) {
  const double sum = a + b;
  if (sum > kPairCeiling || sum < kPairFloor) [[unlikely]] {
    const double by = sum > kPairCeiling ? kPairFloor : kPairCeiling;
    a *= by;
    b *= by;
  }
}

bool chain_sweeps_log(ChainScratch& s, int64_t m, const double* w) {
  return math::crf_sweeps_log(s.u, m, w, s.fwd[0], s.fwd[1], s.mu, s.fshare[0], s.fshare[1], s.bshare[0],
                              s.bshare[1]);
}

void chain_sweeps_linear(ChainScratch& s, int64_t m, const double* w, bool shares) {
  using Vec = at::vec::Vectorized<double>;
  const double* u = s.u;
  const double top = std::max(std::max(w[0], w[1]), std::max(w[2], w[3]));
  const double e00 = std::exp(w[0] - top), e01 = std::exp(w[1] - top), e10 = std::exp(w[2] - top),
               e11 = std::exp(w[3] - top);
  // Each entry's label factors (e^0, e^{u_i}) divided by the larger of the
  // two: f0 = e^{-max(u_i, 0)}, f1 = e^{min(u_i, 0)}.
  double *f0 = s.factor[0], *f1 = s.factor[1];
  at::vec::map([](Vec v) { return at::vec::maximum(v, Vec(0.0)).neg().exp(); }, f0, u, m);
  at::vec::map([](Vec v) { return at::vec::minimum(v, Vec(0.0)).exp(); }, f1, u, m);
  double *fa0 = s.fwd[0], *fa1 = s.fwd[1], *bb0 = s.back[0], *bb1 = s.back[1];
  // The forward and backward recurrences are independent: one loop runs both
  // (entry k forward, entry m-1-k backward) so that their latencies overlap.
  // Each carries its last pair in registers and multiplies it by coefficients
  // formed off the dependency chain (one multiply-add deep).
  double a0 = f0[0], a1 = f1[0], b0 = 1.0, b1 = 1.0;
  fa0[0] = a0;
  fa1[0] = a1;
  bb0[m - 1] = bb1[m - 1] = 1.0;
  for (int64_t i = 1, j = m - 2; i < m; ++i, --j) {
    double n0 = (f0[i] * e00) * a0 + (f0[i] * e10) * a1, n1 = (f1[i] * e01) * a0 + (f1[i] * e11) * a1;
    double p0 = (e00 * f0[j + 1]) * b0 + (e01 * f1[j + 1]) * b1, p1 = (e10 * f0[j + 1]) * b0 + (e11 * f1[j + 1]) * b1;
    rescale_pair(n0, n1);
    rescale_pair(p0, p1);
    fa0[i] = a0 = n0;
    fa1[i] = a1 = n1;
    bb0[j] = b0 = p0;
    bb1[j] = b1 = p1;
  }
  for (int64_t i = 0; i < m; ++i) {
    const double one = fa1[i] * bb1[i];
    s.mu[i] = one / (fa0[i] * bb0[i] + one);
  }
  if (!shares) return;
  double *fs0 = s.fshare[0], *fs1 = s.fshare[1], *bs0 = s.bshare[0], *bs1 = s.bshare[1];
  for (int64_t i = 1; i < m; ++i) {
    const double from1_to0 = fa1[i - 1] * e10, from1_to1 = fa1[i - 1] * e11;
    fs0[i] = from1_to0 / (fa0[i - 1] * e00 + from1_to0);
    fs1[i] = from1_to1 / (fa0[i - 1] * e01 + from1_to1);
  }
  for (int64_t i = 0; i + 1 < m; ++i) {
    const double to0 = f0[i + 1] * bb0[i + 1], to1 = f1[i + 1] * bb1[i + 1];
    bs0[i] = e01 * to1 / (e00 * to0 + e01 * to1);
    bs1[i] = e11 * to1 / (e10 * to0 + e11 * to1);
  }
}

bool chain_sweeps(ChainScratch& s, int64_t m, const double* w, bool shares) {
  if (linear_range(s.u, m, w)) {
    chain_sweeps_linear(s, m, w, shares);
    return true;
  }
  return chain_sweeps_log(s, m, w);
}

// Per-row W in double, checked: -inf forbids a transition; NaN and +inf are
// refused.
Tensor checked_pairwise(const Tensor& pairwise, const Tensor& x, int64_t dim, const char* op) {
  check_cpu_float(pairwise, "pairwise");
  auto shape = x.sizes().vec();
  if (!shape.empty()) shape.erase(shape.begin() + dim);
  shape.push_back(2);
  shape.push_back(2);
  TORCH_CHECK_VALUE(pairwise.dim() >= 2 && pairwise.size(-1) == 2 && pairwise.size(-2) == 2 &&
                        at::is_expandable_to(pairwise.sizes(), shape),
                    "attnkern: ", op, " pairwise must have shape (2, 2) or broadcast to ", at::IntArrayRef(shape),
                    " (the unary scores' shape without dim, then 2×2), got ", pairwise.sizes());
  Tensor rows = pairwise.to(at::kDouble).expand(shape).contiguous();
  const double* wp = rows.const_data_ptr<double>();
  for (int64_t k = 0; k < rows.numel(); ++k) {
    TORCH_CHECK_VALUE(!std::isnan(wp[k]) && wp[k] != std::numeric_limits<double>::infinity(),
                      "attnkern: ", op, " pairwise must not hold NaN or +inf (-inf forbids a transition), got ",
                      wp[k]);
  }
  return rows;
}

// The backward of one row after chain_sweeps with shares (feasible, m >= 1),
// with the incoming gradient compacted in s.g: du into s.out's places (by way
// of s.grad, free once s.g is filled), Σ_i dξ_i(a, b) added into dw (2×2)
// when it is not null.
void chain_backward(ChainScratch& s, int64_t m, double* dw) {
  math::crf_backward(s.g, s.mu, s.fshare[0], s.fshare[1], s.bshare[0], s.bshare[1], m, s.ta[0], s.ta[1], s.tb[0],
                     s.tb[1], s.grad, dw);
  for (int64_t i = 0; i < m; ++i) s.out[s.pos[i]] = s.grad[i];
}

// The CRF's per-row steps for the drivers below.
struct CrfMarginals {
  static constexpr const char* kName = "crf_marginals";
  struct Workspace {
    explicit Workspace(int64_t) {}
  };
  static bool forward(ChainScratch& s, Workspace&, int64_t m, const double* w) {
    return chain_sweeps(s, m, w, /*shares=*/false);
  }
  static bool backward(ChainScratch& s, Workspace&, int64_t m, const double* w, double* dw) {
    if (!chain_sweeps(s, m, w, /*shares=*/true)) return false;
    chain_backward(s, m, dw);
    return true;
  }
};

// A vector of lane_t from a row at p (Vec::size() entries, widened): float
// into double lanes in one instruction at AVX2 and AVX512, other widenings
// through memory.
template <typename lane_t, typename scalar_t>
inline at::vec::Vectorized<lane_t> load_widened(const scalar_t* p) {
  using Vec = at::vec::Vectorized<lane_t>;
  if constexpr (std::is_same_v<scalar_t, lane_t>) return Vec::loadu(p);
  [[maybe_unused]] constexpr bool float_to_double = std::is_same_v<scalar_t, float> && std::is_same_v<lane_t, double>;
#if ATTNKERN_HAS(AVX512)
  if constexpr (float_to_double) return _mm512_cvtps_pd(_mm256_loadu_ps(p));
#elif ATTNKERN_HAS(AVX2)
  if constexpr (float_to_double) return _mm256_cvtps_pd(_mm_loadu_ps(p));
#endif
  alignas(64) lane_t wide[Vec::size()];
  for (int k = 0; k < Vec::size(); ++k) wide[k] = static_cast<lane_t>(p[k]);
  return Vec::loadu(wide);
}

// v narrowed to scalar_t into p (Vec::size() entries), as load_widened.
template <typename lane_t, typename scalar_t>
inline void store_narrowed(const at::vec::Vectorized<lane_t>& v, scalar_t* p) {
  using Vec = at::vec::Vectorized<lane_t>;
  if constexpr (std::is_same_v<scalar_t, lane_t>) return v.store(p);
  [[maybe_unused]] constexpr bool double_to_float = std::is_same_v<scalar_t, float> && std::is_same_v<lane_t, double>;
#if ATTNKERN_HAS(AVX512)
  if constexpr (double_to_float) return _mm256_storeu_ps(p, _mm512_cvtpd_ps(v));
#elif ATTNKERN_HAS(AVX2)
  if constexpr (double_to_float) return _mm_storeu_ps(p, _mm256_cvtpd_ps(v));
#endif
  alignas(64) lane_t wide[Vec::size()];
  v.store(wide);
  for (int k = 0; k < Vec::size(); ++k) p[k] = static_cast<scalar_t>(wide[k]);
}

// Transposes the square block v[0..size) (v[l] lane k becomes v[k] lane l)
// through memory.
template <typename lane_t>
inline void transpose_lanes_in_memory(at::vec::Vectorized<lane_t>* v) {
  using Vec = at::vec::Vectorized<lane_t>;
  constexpr int k = Vec::size();
  alignas(64) lane_t block[k * k];
  for (int l = 0; l < k; ++l) v[l].store(block + l * k);
  alignas(64) lane_t column[k];
  for (int c = 0; c < k; ++c) {
    for (int l = 0; l < k; ++l) column[l] = block[l * k + c];
    v[c] = Vec::loadu(column);
  }
}

// The same for double lanes: at AVX512 eight shuffles each of pairs, of
// 128-bit quarters and of 256-bit halves; at AVX2 four of pairs and four of
// halves; through memory at the other levels.
inline void transpose_lanes(at::vec::Vectorized<double>* v) {
#if ATTNKERN_HAS(AVX512)
  __m512d pairs[8], quarters[8];
  for (int l = 0; l < 8; l += 2) {
    pairs[l] = _mm512_unpacklo_pd(v[l], v[l + 1]);  // lanes 0, 2, 4, 6 of rows l, l + 1
    pairs[l + 1] = _mm512_unpackhi_pd(v[l], v[l + 1]);
  }
  // Quarters 0 and 2 (then 1 and 3) of rows 4q..4q+3's pairs: the lanes
  // k, k + 4 of four rows, for k = 0, 2 (then 1, 3).
  const __m512i even_quarters = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i odd_quarters = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int q = 0; q < 2; ++q) {
    const __m512d* p = pairs + 4 * q;
    quarters[4 * q + 0] = _mm512_permutex2var_pd(p[0], even_quarters, p[2]);  // lanes 0, 4
    quarters[4 * q + 1] = _mm512_permutex2var_pd(p[1], even_quarters, p[3]);  // lanes 1, 5
    quarters[4 * q + 2] = _mm512_permutex2var_pd(p[0], odd_quarters, p[2]);   // lanes 2, 6
    quarters[4 * q + 3] = _mm512_permutex2var_pd(p[1], odd_quarters, p[3]);   // lanes 3, 7
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm512_shuffle_f64x2(quarters[k], quarters[4 + k], 0x44);
    v[k + 4] = _mm512_shuffle_f64x2(quarters[k], quarters[4 + k], 0xEE);
  }
#elif ATTNKERN_HAS(AVX2)
  const __m256d t0 = _mm256_unpacklo_pd(v[0], v[1]), t1 = _mm256_unpackhi_pd(v[0], v[1]);
  const __m256d t2 = _mm256_unpacklo_pd(v[2], v[3]), t3 = _mm256_unpackhi_pd(v[2], v[3]);
  v[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
  v[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
  v[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
  v[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
#else
  transpose_lanes_in_memory(v);
#endif
}

// The same for float lanes: at AVX512 sixteen shuffles each of pairs, of
// pairs of pairs, of 256-bit halves and of 128-bit quarters; at AVX2 eight of
// pairs, of pairs of pairs and of halves; through memory at the other levels.
inline void transpose_lanes(at::vec::Vectorized<float>* v) {
#if ATTNKERN_HAS(AVX512)
  __m512 pairs[16], quads[16];
  for (int l = 0; l < 16; l += 2) {
    pairs[l] = _mm512_unpacklo_ps(v[l], v[l + 1]);
    pairs[l + 1] = _mm512_unpackhi_ps(v[l], v[l + 1]);
  }
  // quads[4j + k], quarter q: entry 4q + k of rows 4j..4j+3.
  for (int j = 0; j < 4; ++j) {
    __m512d p[4];
    for (int t = 0; t < 4; ++t) p[t] = _mm512_castps_pd(pairs[4 * j + t]);
    quads[4 * j + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(p[0], p[2]));
    quads[4 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(p[0], p[2]));
    quads[4 * j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(p[1], p[3]));
    quads[4 * j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(p[1], p[3]));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 low8 = _mm512_shuffle_f32x4(quads[k], quads[4 + k], 0x44);    // quarters 0, 1 of rows 0..7
    const __m512 high8 = _mm512_shuffle_f32x4(quads[k], quads[4 + k], 0xEE);   // quarters 2, 3 of rows 0..7
    const __m512 low16 = _mm512_shuffle_f32x4(quads[8 + k], quads[12 + k], 0x44);
    const __m512 high16 = _mm512_shuffle_f32x4(quads[8 + k], quads[12 + k], 0xEE);
    v[k] = _mm512_shuffle_f32x4(low8, low16, 0x88);
    v[4 + k] = _mm512_shuffle_f32x4(low8, low16, 0xDD);
    v[8 + k] = _mm512_shuffle_f32x4(high8, high16, 0x88);
    v[12 + k] = _mm512_shuffle_f32x4(high8, high16, 0xDD);
  }
#elif ATTNKERN_HAS(AVX2)
  __m256 pairs[8], quads[8];
  for (int l = 0; l < 8; l += 2) {
    pairs[l] = _mm256_unpacklo_ps(v[l], v[l + 1]);
    pairs[l + 1] = _mm256_unpackhi_ps(v[l], v[l + 1]);
  }
  for (int j = 0; j < 2; ++j) {
    __m256d p[4];
    for (int t = 0; t < 4; ++t) p[t] = _mm256_castps_pd(pairs[4 * j + t]);
    quads[4 * j + 0] = _mm256_castpd_ps(_mm256_unpacklo_pd(p[0], p[2]));
    quads[4 * j + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(p[0], p[2]));
    quads[4 * j + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(p[1], p[3]));
    quads[4 * j + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(p[1], p[3]));
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_permute2f128_ps(quads[k], quads[4 + k], 0x20);
    v[4 + k] = _mm256_permute2f128_ps(quads[k], quads[4 + k], 0x31);
  }
#else
  transpose_lanes_in_memory(v);
#endif
}

// The CRF on rows side by side: lane l of every vector holds row l of a group
// of up to kLanes rows (entry i of the group's rows in one vector, the rows
// transposed into arrays of kLanes·n), so the forward-backward recurrences,
// sequential along a row, advance kLanes rows per instruction. It runs the
// linear sweep's arithmetic, so it takes the rows whose entries are all finite
// and within kLinearRange (ready()); the others go one at a time as above.
// Lanes never mix: a row's result does not depend on the rows that share its
// group, and unused lanes repeat lane 0. The backward (gradient()) needs only
// one-step conditionals along the chain, not the tangents of every message,
// and no backward messages.
template <typename lane_t>
struct CrfLanes {
  using Vec = at::vec::Vectorized<lane_t>;
  static constexpr bool kFloat = std::is_same_v<lane_t, float>;
  static constexpr int kLanes = Vec::size();
  static constexpr int kAllLanes = (1 << kLanes) - 1;
  // The longest rows taken side by side: a group's arrays hold 9·kLanes
  // lane_t per entry (2.4 MiB per thread at this length at AVX512), and
  // longer rows would cost more memory than one at a time does.
  static constexpr int64_t kMaxEntries = int64_t(1) << 12;
  // Each message pair's sum is kept in [kFloor, kCeiling] by exact powers of
  // two (rescale).
  static constexpr lane_t kCeiling = kFloat ? lane_t(kFloatPairCeiling) : lane_t(kPairCeiling);
  static constexpr lane_t kFloor = kFloat ? lane_t(kFloatPairFloor) : lane_t(kPairFloor);

  int64_t n;
  int count = 0;
  int64_t rows[kLanes];
  std::unique_ptr<lane_t[]> buf;
  // Per entry, lanes side by side: the rows, the forward messages, 1 / d
  // (see forward_messages), μ, the incoming gradient (then the gradient
  // out), the backward's D and φ.
  lane_t *xs, *fa0, *fa1, *r0, *r1, *mu, *g, *ds, *phi;
  lane_t* out;
  const void* x_src[kLanes];  // add_direct's rows
  const void* g_src[kLanes];  // and their gradients
  alignas(64) double w[4][kLanes];   // each lane's transition scores
  alignas(64) lane_t e[4][kLanes];   // e^{w - max w}, rounded once from double
  alignas(64) lane_t det[kLanes];    // e_00·e_11 - e_01·e_10, likewise
  alignas(64) lane_t dw[4][kLanes];  // the gradient in w (gradient<true>())

  // Arrays spaced by whole multiples of 4 KiB put entry i of every array in
  // one L1 set and let loads wait on unrelated stores with the same low
  // address bits (the gradient's passes read and write seven arrays at one
  // index): they are spaced by a few cache lines more.
  static constexpr int64_t kArrayPad = 40;

  explicit CrfLanes(int64_t n_) : n(n_), buf(new lane_t[9 * (kLanes * n_ + kArrayPad)]) {
    lane_t* b = buf.get();
    for (lane_t** a : {&xs, &fa0, &fa1, &r0, &r1, &mu, &g, &ds, &phi}) {
      *a = b;
      b += kLanes * n + kArrayPad;
    }
    out = g;
  }

  // Whether a row (n entries at stride 1) can run in a lane: every entry
  // finite and the linear sweep's range condition met (linear_range; for
  // float lanes float_lanes_fit).
  template <typename scalar_t>
  static bool ready(const scalar_t* row, int64_t n, const double* wr) {
    // The largest |entry|, NaN if any entry is NaN (at::vec::maximum keeps NaN).
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using AVec = at::vec::Vectorized<acc_t>;
    acc_t largest = 0;
    int64_t j = 0;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      AVec big(0);
      for (; j + AVec::size() <= n; j += AVec::size()) big = at::vec::maximum(big, AVec::loadu(row + j).abs());
      largest = at::vec::vec_reduce_all<acc_t>([](AVec& a, AVec& b) { return at::vec::maximum(a, b); }, big);
    }
    for (; j < n; ++j) {
      const acc_t a = std::abs(static_cast<acc_t>(row[j]));
      largest = std::isnan(a) || a > largest ? a : largest;
    }
    const double widest = largest;
    if constexpr (kFloat) {
      return std::isfinite(widest) && float_lanes_fit(widest, wr);
    } else {
      return std::isfinite(widest) && linear_range(&widest, 1, wr);
    }
  }

  bool full() const { return count == kLanes; }

  // Takes row r of the tensor (transition scores wr), loaded into row (and
  // its gradient into grad, unless null), as the next lane: its entries go
  // into the lane's places in xs (and g), where the passes read a vector per
  // entry without gathering.
  void add(int64_t r, const double* wr, const double* row, const double* grad) {
    put(row, xs, count);
    if (grad) put(grad, g, count);
    take(r, wr);
  }

  void put(const double* row, lane_t* soa, int l) const {
    for (int64_t i = 0; i < n; ++i) soa[i * kLanes + l] = static_cast<lane_t>(row[i]);
  }

  // Takes row r (transition scores wr), whose entries (and gradient) lie at
  // stride 1 from x (and gr), as the next lane; read when the group runs
  // (load_direct), transposed a block of kLanes entries at a time.
  void add_direct(int64_t r, const double* wr, const void* x, const void* gr) {
    x_src[count] = x;
    g_src[count] = gr;
    take(r, wr);
  }

  void take(int64_t r, const double* wr) {
    rows[count] = r;
    for (int k = 0; k < 4; ++k) w[k][count] = wr[k];
    ++count;
  }

  // The lanes added by add_direct into xs (and g), unused lanes repeating
  // lane 0 (pad() is then not needed).
  template <typename scalar_t>
  void load_direct(bool with_grad) {
    const scalar_t* from[kLanes];
    for (int l = 0; l < kLanes; ++l) from[l] = static_cast<const scalar_t*>(x_src[l < count ? l : 0]);
    transpose_in(from, xs);
    if (with_grad) {
      for (int l = 0; l < kLanes; ++l) from[l] = static_cast<const scalar_t*>(g_src[l < count ? l : 0]);
      transpose_in(from, g);
    }
    for (int l = count; l < kLanes; ++l) {
      for (int k = 0; k < 4; ++k) w[k][l] = w[k][0];
    }
  }

  template <typename scalar_t>
  void transpose_in(const scalar_t* const* from, lane_t* soa) const {
    Vec block[kLanes];
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) block[l] = load_widened<lane_t>(from[l] + i);
      transpose_lanes(block);
      for (int k = 0; k < kLanes; ++k) block[k].store(soa + (i + k) * kLanes);
    }
    for (; i < n; ++i) {
      for (int l = 0; l < kLanes; ++l) soa[i * kLanes + l] = static_cast<lane_t>(from[l][i]);
    }
  }

  // The used lanes of an array into rows at stride 1 (to[l] for lane l).
  template <typename scalar_t>
  void transpose_out(const lane_t* soa, scalar_t* const* to) const {
    Vec block[kLanes];
    int64_t i = 0;
    if (count == kLanes) {
      for (; i + kLanes <= n; i += kLanes) {
        for (int k = 0; k < kLanes; ++k) block[k] = at(soa, i + k);
        transpose_lanes(block);
        for (int l = 0; l < kLanes; ++l) store_narrowed(block[l], to[l] + i);
      }
    }
    for (; i < n; ++i) {
      for (int l = 0; l < count; ++l) to[l][i] = static_cast<scalar_t>(soa[i * kLanes + l]);
    }
  }

  // Readies the group's rows (and gradients) in the lanes: read from the
  // tensor (direct: add_direct) or from the staged rows (add).
  template <typename scalar_t>
  void stage(bool direct, bool with_grad) {
    if (direct) {
      load_direct<scalar_t>(with_grad);
    } else {
      pad(with_grad);
    }
  }

  // Writes the used lanes of soa to their rows of dst (row r at lay.base(r)):
  // transposed a block at a time (direct), else a lane at a time through
  // scratch (n entries).
  template <typename scalar_t>
  void write_rows(const lane_t* soa, scalar_t* dst, const RowLayout& lay, bool direct, double* scratch) const {
    if (direct) {
      scalar_t* to[kLanes] = {};
      for (int l = 0; l < count; ++l) to[l] = dst + lay.base(rows[l]);
      transpose_out(soa, to);
      return;
    }
    for (int l = 0; l < count; ++l) {
      column(soa, l, scratch);
      lay.store(scratch, dst + lay.base(rows[l]));
    }
  }

  // Fills the unused lanes with lane 0's row.
  void pad(bool with_grad) {
    for (int l = count; l < kLanes; ++l) {
      for (int64_t i = 0; i < n; ++i) xs[i * kLanes + l] = xs[i * kLanes];
      if (with_grad) {
        for (int64_t i = 0; i < n; ++i) g[i * kLanes + l] = g[i * kLanes];
      }
      for (int k = 0; k < 4; ++k) w[k][l] = w[k][0];
    }
  }

  // Lane l of an array into dst (n entries).
  void column(const lane_t* soa, int l, double* dst) const {
    for (int64_t i = 0; i < n; ++i) dst[i] = soa[i * kLanes + l];
  }

  static Vec at(const lane_t* soa, int64_t i) { return Vec::loadu(soa + i * kLanes); }

  // Scales each lane's pair back into [kFloor, kCeiling] (for double lanes
  // [2^-200, 2^200], as rescale_pair does).
  static void rescale(Vec& a, Vec& b) {
    const Vec sum = a + b;
    const Vec high = sum > Vec(kCeiling), low = sum < Vec(kFloor);
    if ((high | low).zero_mask() != kAllLanes) [[unlikely]] {
      const Vec by = Vec::blendv(Vec::blendv(Vec(1.0), Vec(kFloor), high), Vec(kCeiling), low);
      a = a * by;
      b = b * by;
    }
  }

  // e^x for x in [-kLinearRange, 0], the range of the lanes' label factors,
  // cheaper than Sleef's exp, which handles every argument. Below AVX512:
  // x = k·ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial of
  // degree 13 (remainder below 2e-17 relative), 2^k written into the exponent
  // bits.
  static Vec exp_nonpositive(Vec x) {
    if constexpr (kFloat) {
      return exp_nonpositive_float(x);
    } else {
      return exp_nonpositive_double(x);
    }
  }

  // The same in float for x in [-kFloatRange, 0]: x = k·ln 2 + r with
  // |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 7 (remainder
  // below 6e-9 relative), 2^k by scalef at AVX512, into the exponent bits at
  // AVX2; Sleef's exp at the other levels.
  static Vec exp_nonpositive_float(Vec x) {
#if ATTNKERN_HAS(AVX2)
    const Vec k = (x * Vec(1.44269504088896341f)).round();
    const Vec r = at::vec::fmadd(k, Vec(2.12194440e-4f), at::vec::fmadd(k, Vec(-0.693359375f), x));
    const Vec r2 = r * r, r4 = r2 * r2;
    auto pair = [&](float lo, float hi) { return at::vec::fmadd(Vec(hi), r, Vec(lo)); };
    const Vec q0 = pair(1.0f, 1.0f), q1 = pair(1.0f / 2, 1.0f / 6), q2 = pair(1.0f / 24, 1.0f / 120),
              q3 = pair(1.0f / 720, 1.0f / 5040);
    const Vec p = at::vec::fmadd(at::vec::fmadd(q3, r2, q2), r4, at::vec::fmadd(q1, r2, q0));
#if ATTNKERN_HAS(AVX512)
    return _mm512_scalef_ps(p, k);
#else
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
    return p * Vec(_mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
#endif
#else
    return x.exp();
#endif
  }

  static Vec exp_nonpositive_double(Vec x) {
#if ATTNKERN_HAS(AVX512)
    // x = (k / 16)·ln 2 + r with |r| <= ln 2 / 32: e^x = 2^floor(k / 16) ·
    // 2^((k mod 16) / 16) · e^r, the middle factor from a table of 16 held in
    // two registers, e^r by its Taylor polynomial of degree 7 (remainder below
    // 2e-18 relative): fewer multiply-adds than the polynomial below.
    constexpr double kRound = 0x1.8p52;
    constexpr double kLn2By16Hi = 0x1.62e42fefa39efp-5, kLn2By16Lo = 0x1.abc9e3b39803fp-60;
    // t = x·16·log2(e) + 1.5·2^52 rounds x·16·log2(e) to the integer k
    // (t - 1.5·2^52), whose low 4 bits it holds in its own: the table index.
    const Vec t = at::vec::fmadd(x, Vec(0x1.71547652b82fep+4), Vec(kRound)), k = t - Vec(kRound);
    const Vec r = at::vec::fmadd(k, Vec(-kLn2By16Lo), at::vec::fmadd(k, Vec(-kLn2By16Hi), x));
    const Vec r2 = r * r, r4 = r2 * r2;
    auto pair = [&](double lo, double hi) { return at::vec::fmadd(Vec(hi), r, Vec(lo)); };
    const Vec q0 = pair(1.0, 1.0), q1 = pair(1.0 / 2, 1.0 / 6), q2 = pair(1.0 / 24, 1.0 / 120),
              q3 = pair(1.0 / 720, 1.0 / 5040);
    const Vec p = at::vec::fmadd(at::vec::fmadd(q3, r2, q2), r4, at::vec::fmadd(q1, r2, q0));
    // 2^(j / 16), j = 0..15, rounded to double.
    const __m512d low = _mm512_setr_pd(0x1.0000000000000p+0, 0x1.0b5586cf9890fp+0, 0x1.172b83c7d517bp+0,
                                       0x1.2387a6e756238p+0, 0x1.306fe0a31b715p+0, 0x1.3dea64c123422p+0,
                                       0x1.4bfdad5362a27p+0, 0x1.5ab07dd485429p+0);
    const __m512d high = _mm512_setr_pd(0x1.6a09e667f3bcdp+0, 0x1.7a11473eb0187p+0, 0x1.8ace5422aa0dbp+0,
                                        0x1.9c49182a3f090p+0, 0x1.ae89f995ad3adp+0, 0x1.c199bdd85529cp+0,
                                        0x1.d5818dcfba487p+0, 0x1.ea4afa2a490dap+0);
    const Vec fraction = _mm512_permutex2var_pd(low, _mm512_castpd_si512(t), high);
    return _mm512_scalef_pd(fraction * p, k * Vec(1.0 / 16));
#else
    constexpr double kLn2Hi = 0x1.62e42fefa3800p-1, kLn2Lo = 0x1.ef35793c76730p-45;
    // t = x·log2(e) + 1.5·2^52 rounds x·log2(e) to the integer k (t - 1.5·2^52)
    // and holds 2^51 + k in its low mantissa bits.
    constexpr double kRound = 0x1.8p52;
    const Vec t = at::vec::fmadd(x, Vec(1.4426950408889634), Vec(kRound)), k = t - Vec(kRound);
    const Vec r = at::vec::fmadd(k, Vec(-kLn2Lo), at::vec::fmadd(k, Vec(-kLn2Hi), x));
    // Σ_j r^j / j! (j = 0..13) by Estrin's scheme: pairs, then pairs of
    // pairs, so the polynomial is four multiply-adds deep instead of 13.
    const Vec r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    auto pair = [&](double lo, double hi) { return at::vec::fmadd(Vec(hi), r, Vec(lo)); };
    const Vec q0 = pair(1.0, 1.0), q1 = pair(1.0 / 2, 1.0 / 6), q2 = pair(1.0 / 24, 1.0 / 120),
              q3 = pair(1.0 / 720, 1.0 / 5040), q4 = pair(1.0 / 40320, 1.0 / 362880),
              q5 = pair(1.0 / 3628800, 1.0 / 39916800), q6 = pair(1.0 / 479001600, 1.0 / 6227020800);
    const Vec t0 = at::vec::fmadd(at::vec::fmadd(q3, r2, q2), r4, at::vec::fmadd(q1, r2, q0));
    const Vec t1 = at::vec::fmadd(q6, r4, at::vec::fmadd(q5, r2, q4));
    const Vec p = at::vec::fmadd(t1, r8, t0);
    // 2^k: k + 1023 shifted into the exponent field (the bits above it shift
    // out).
    constexpr int64_t kToBiased = 1023 - (int64_t(1) << 51);
#if ATTNKERN_HAS(AVX2) && !ATTNKERN_HAS(AVX512)
    const __m256i biased = _mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(kToBiased));
    return p * Vec(_mm256_castsi256_pd(_mm256_slli_epi64(biased, 52)));
#else
    using IVec = at::vec::Vectorized<int64_t>;
    const IVec biased = at::vec::cast<int64_t>(t) + IVec(kToBiased);
    return p * at::vec::cast<double>(biased << IVec(52));
#endif
#endif
  }

  // The label factors (c0, c1) = (e^{-max(u, 0)}, e^{min(u, 0)}) of the
  // entries u (one of the two is 1).
  static void label_factors(const Vec& u, Vec& c0, Vec& c1) {
    const Vec small = exp_nonpositive(u.abs().neg()), nonneg = u >= Vec(0.0);
    c0 = Vec::blendv(Vec(1.0), small, nonneg);
    c1 = Vec::blendv(small, Vec(1.0), nonneg);
  }

  // Each lane's e^{w - max w} (e).
  void transition_factors() {
    for (int l = 0; l < kLanes; ++l) {
      const double top = std::max(std::max(w[0][l], w[1][l]), std::max(w[2][l], w[3][l]));
      double wide[4];
      for (int k = 0; k < 4; ++k) {
        wide[k] = std::exp(w[k][l] - top);
        e[k][l] = static_cast<lane_t>(wide[k]);
      }
      det[l] = static_cast<lane_t>(wide[0] * wide[3] - wide[1] * wide[2]);
    }
  }

  // e as vectors: e_00, e_01, e_10, e_11.
  std::array<Vec, 4> transitions() const {
    return {Vec::loadu(e[0]), Vec::loadu(e[1]), Vec::loadu(e[2]), Vec::loadu(e[3])};
  }

  // The forward messages on every lane: the pairs a_i (scaled) into fa0, fa1
  // and 1 / d_i(b) into r0, r1 (i >= 1), where d_i(b) = a0·e_0b + a1·e_1b
  // from the pair a at i - 1 (a_i(b) = f_b·d_i(b), f the label factors,
  // computed here as each entry is reached), after transition_factors().
  // step(i, a0, a1, r0, r1) sees that pair and 1 / d_i. Double lanes take
  // both reciprocals from one division, 1 / (d_i(0)·d_i(1)); in float lanes
  // that product could leave float's range.
  template <typename Step>
  void forward_messages(Step&& step) {
    const auto [e00, e01, e10, e11] = transitions();
    // Local copies of the array pointers: stores through them cannot then be
    // taken to change the pointers.
    const lane_t* us = xs;
    lane_t *a0s = fa0, *a1s = fa1, *r0s = r0, *r1s = r1;
    Vec a0, a1;
    label_factors(at(us, 0), a0, a1);
    a0.store(a0s);
    a1.store(a1s);
    for (int64_t i = 1; i < n; ++i) {
      Vec c0, c1;
      label_factors(at(us, i), c0, c1);
      const Vec d0 = at::vec::fmadd(e00, a0, e10 * a1), d1 = at::vec::fmadd(e01, a0, e11 * a1);
      Vec rec0, rec1;
      if constexpr (kFloat) {
        rec0 = Vec(1.0) / d0;
        rec1 = Vec(1.0) / d1;
      } else {
        const Vec inv = Vec(1.0) / (d0 * d1);
        rec0 = d1 * inv;
        rec1 = d0 * inv;
      }
      step(i, a0, a1, rec0, rec1);
      rec0.store(r0s + i * kLanes);
      rec1.store(r1s + i * kLanes);
      a0 = c0 * d0;
      a1 = c1 * d1;
      rescale(a0, a1);
      a0.store(a0s + i * kLanes);
      a1.store(a1s + i * kLanes);
    }
  }

  // The marginal pair (P(z = 0), P(z = 1)) of the last entry, after
  // forward_messages.
  void last_marginals(Vec& p0, Vec& p1) const {
    const Vec a0 = at(fa0, n - 1), a1 = at(fa1, n - 1), norm = Vec(1.0) / (a0 + a1);
    p0 = a0 * norm;
    p1 = a1 * norm;
  }

  // μ on every lane: the forward messages, then the marginals backwards.
  // Given z_j, z_{j-1} depends on the prefix alone: P(z_{j-1} = a | z_j = b)
  // = a(a)·e_ab / d_j(b) (a the forward pair at j - 1), so the pairs
  // p = (P(z_j = 0), P(z_j = 1)) run backwards from the last entry's as
  // ξ_j(a, b) = a(a)·e_ab·P(z_j = b) / d_j(b) summed over b: sums of positive
  // terms, so 1 - μ is as exact as μ, and no backward messages are needed.
  void sweeps() {
    transition_factors();
    forward_messages([](int64_t, const Vec&, const Vec&, const Vec&, const Vec&) {});
    const auto [e00, e01, e10, e11] = transitions();
    const lane_t *a0s = fa0, *a1s = fa1, *r0s = r0, *r1s = r1;
    lane_t* mus = mu;
    Vec p0, p1;
    last_marginals(p0, p1);
    p1.store(mus + (n - 1) * kLanes);
    for (int64_t j = n - 1; j > 0; --j) {
      const Vec y0 = p0 * at(r0s, j), y1 = p1 * at(r1s, j);  // P(z_j = b) / d_j(b)
      p0 = at(a0s, j - 1) * at::vec::fmadd(e00, y0, e01 * y1);
      p1 = at(a1s, j - 1) * at::vec::fmadd(e10, y0, e11 * y1);
      (p1 * drift_removed(p0, p1)).store(mus + (j - 1) * kLanes);
    }
  }

  // The steps backwards keep the pair's sum, so its rounding errors add up
  // in a common factor of the pair (1 + δ, |δ| at most a few ulps per entry)
  // that nothing contracts; the others shrink by |φ| per step. The outputs
  // take the pair times 1 / (p0 + p1) = 1 / (1 + δ), here 2 - (p0 + p1)
  // (within δ² of it), off the recurrence, which goes on unscaled.
  static Vec drift_removed(const Vec& p0, const Vec& p1) { return Vec(2.0) - (p0 + p1); }

  // The gradient on every lane (rows and incoming gradients loaded): du into
  // out and, when with_dw, the gradient in w into dw.
  //
  // du = Cov(z, z)·g. For a binary Markov chain, E[z_j | z_i] is linear in
  // z_i, so Cov(z_i, z_j) (i < j) is Var(z_j)·φ_{i+1}···φ_j, with φ_k the
  // difference P(z_{k-1} = 1 | z_k = 1) - P(z_{k-1} = 1 | z_k = 0), and by
  // symmetry Var(z_i)·ψ_i···ψ_{j-1} looking ahead, with ψ_k·Var(z_k) =
  // Cov(z_k, z_{k+1}) = φ_{k+1}·Var(z_{k+1}). Hence
  //   du_i = Var(z_i)·D_i + R_i,
  //   D_i = g_i + φ_i·D_{i-1} (D_0 = g_0),
  //   R_i = φ_{i+1}·(Var(z_{i+1})·g_{i+1} + R_{i+1}) (R_{n-1} = 0),
  // with φ_i = a0·a1·det(e) / (d_i(0)·d_i(1)), a the forward pair at i - 1:
  // products of positive terms and det(e), so nothing cancels. In w, with
  // ξ_i(a, b) the marginal of (z_{i-1}, z_i) = (a, b),
  //   dw_ab = Σ_i ξ_i(a, b)·((a - μ_{i-1})·D_{i-1} + (b - μ_i)·(g_i + R_i / Var(z_i))),
  // the covariance of the transition count with g·z split at the transition
  // (the prefix and the suffix are independent given it). In a lane's row
  // every odds μ / (1 - μ) lies within e^{±2·kLinearRange}, so Var(z_i) is a
  // normal double. One forward pass (messages, φ, D), then one backward pass
  // (μ as sweeps() runs it, R, the outputs).
  template <bool with_dw>
  void gradient() {
    transition_factors();
    const auto [e00, e01, e10, e11] = transitions();
    const Vec dets = Vec::loadu(det);
    const lane_t* gs = g;
    lane_t *dd = ds, *phis = phi, *outs = out;
    Vec d = at(gs, 0);
    d.store(dd);
    forward_messages([&](int64_t i, const Vec& a0, const Vec& a1, const Vec& rec0, const Vec& rec1) {
      const Vec phi_i = dets * (a0 * rec0) * (a1 * rec1);
      d = at::vec::fmadd(phi_i, d, at(gs, i));
      phi_i.store(phis + i * kLanes);
      d.store(dd + i * kLanes);
    });
    const lane_t *a0s = fa0, *a1s = fa1, *r0s = r0, *r1s = r1;
    Vec p0, p1;  // P(z_j = 0), P(z_j = 1)
    last_marginals(p0, p1);
    Vec r(0.0);
    Vec s00(0.0), s01(0.0), s10(0.0), s11(0.0);
    for (int64_t j = n - 1;; --j) {
      const Vec scale = drift_removed(p0, p1), q0 = p0 * scale, q1 = p1 * scale;  // 1 - μ_j, μ_j
      const Vec gj = at(gs, j), var = q0 * q1;                                      // Var(z_j)
      at::vec::fmadd(var, at(dd, j), r).store(outs + j * kLanes);
      if (j == 0) break;
      const Vec prev0 = at(a0s, j - 1), prev1 = at(a1s, j - 1);
      if constexpr (with_dw) {
        // The sums in w read ξ_j, so here the recurrence takes the rescaled
        // pair.
        p0 = q0;
        p1 = q1;
      }
      const Vec y0 = p0 * at(r0s, j), y1 = p1 * at(r1s, j);  // P(z_j = b) / d_j(b)
      if constexpr (with_dw) {
        const Vec x00 = prev0 * e00 * y0, x01 = prev0 * e01 * y1, x10 = prev1 * e10 * y0, x11 = prev1 * e11 * y1;
        const Vec dprev = at(dd, j - 1), h = gj + r / var;
        const Vec back0 = (x10 + x11).neg() * dprev, back1 = (x00 + x01) * dprev;  // (a - μ_{j-1})·D_{j-1}
        const Vec ahead0 = p1.neg() * h, ahead1 = p0 * h;                          // (b - μ_j)·(g_j + R_j / Var)
        s00 = at::vec::fmadd(x00, back0 + ahead0, s00);
        s01 = at::vec::fmadd(x01, back0 + ahead1, s01);
        s10 = at::vec::fmadd(x10, back1 + ahead0, s10);
        s11 = at::vec::fmadd(x11, back1 + ahead1, s11);
        p0 = x00 + x01;
        p1 = x10 + x11;
      } else {
        p0 = prev0 * at::vec::fmadd(e00, y0, e01 * y1);
        p1 = prev1 * at::vec::fmadd(e10, y0, e11 * y1);
      }
      r = at(phis, j) * at::vec::fmadd(var, gj, r);
    }
    if constexpr (with_dw) {
      s00.store(dw[0]);
      s01.store(dw[1]);
      s10.store(dw[2]);
      s11.store(dw[3]);
    }
  }
};

// Whether an op's rows may run side by side (CrfLanes; rows of up to
// CrfLanes::kMaxEntries entries).
template <typename Op>
constexpr bool kSideBySide = std::is_same_v<Op, CrfMarginals>;

// One thread's groups of rows side by side: float lanes for the float,
// bfloat16 and float16 rows that fit them (float_lanes_fit; not when a
// gradient in W is wanted, whose sums over the row want double), double lanes
// for the other rows within the linear range. offer_* hands a row to a group
// (run(group) when it fills) or returns false: the row then goes alone.
template <typename scalar_t>
struct LaneGroups {
  int64_t n;
  std::unique_ptr<CrfLanes<double>> wide;
  std::unique_ptr<CrfLanes<float>> narrow;

  LaneGroups(int64_t n_, bool side_by_side, bool float_lanes) : n(n_) {
    if (!side_by_side || n > CrfLanes<double>::kMaxEntries) return;
    wide = std::make_unique<CrfLanes<double>>(n);
    if (!std::is_same_v<scalar_t, double> && float_lanes) narrow = std::make_unique<CrfLanes<float>>(n);
  }

  explicit operator bool() const { return wide != nullptr; }

  // Row r (transition scores wr) at stride 1 from x, its gradient from gr
  // (or null).
  template <typename Run>
  bool offer_direct(int64_t r, const double* wr, const scalar_t* x, const scalar_t* gr, Run&& run) {
    return offer([&](auto& lanes) { return lanes.ready(x, n, wr); },
                 [&](auto& lanes) { lanes.add_direct(r, wr, x, gr); }, run);
  }

  // Row r loaded into row, its gradient into grad (or null).
  template <typename Run>
  bool offer_loaded(int64_t r, const double* wr, const double* row, const double* grad, Run&& run) {
    return offer([&](auto& lanes) { return lanes.ready(row, n, wr); },
                 [&](auto& lanes) { lanes.add(r, wr, row, grad); }, run);
  }

  // The first group that takes the row (ready), given it (add), run once full.
  template <typename Ready, typename Add, typename Run>
  bool offer(Ready&& ready, Add&& add, Run&& run) {
    auto give = [&](auto& lanes) {
      add(lanes);
      if (lanes.full()) run(lanes);
      return true;
    };
    if (narrow && ready(*narrow)) return give(*narrow);
    if (ready(*wide)) return give(*wide);
    return false;
  }

  // Runs the groups left partly filled.
  template <typename Run>
  void finish(Run&& run) {
    if (narrow && narrow->count > 0) run(*narrow);
    if (wide && wide->count > 0) run(*wide);
  }
};

// The row loops of the chain ops (CrfMarginals, Sparsemap): rows gathered
// along dim, -inf entries removed, NaN for a row with NaN or +inf or without
// a feasible labeling. Op::forward writes s.mu; Op::backward, given the
// compacted gradient in s.g, writes du into s.out's places and adds dW.
template <typename Op, typename scalar_t>
void chain_fwd_impl(const Tensor& x, const Tensor& w, Tensor& out, int64_t dim) {
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const double* wp = w.const_data_ptr<double>();
  const int64_t n = lay.n;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Rows at stride 1 go into the CRF's lanes straight from the tensor.
  const bool direct = lay.inner == 1;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    ChainScratch s(n);
    typename Op::Workspace ws(n);
    LaneGroups<scalar_t> groups(n, kSideBySide<Op>, /*float_lanes=*/true);
    auto run_lanes = [&](auto& lanes) {
      lanes.template stage<scalar_t>(direct, /*with_grad=*/false);
      lanes.sweeps();
      lanes.write_rows(lanes.mu, op, lay, direct, s.out);
      lanes.count = 0;
    };
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      if (groups && direct) {
        if (groups.offer_direct(r, wp + 4 * r, xp + base, nullptr, run_lanes)) continue;
        lay.load(xp + base, s.row);
      } else {
        lay.load(xp + base, s.row);
        if (groups && groups.offer_loaded(r, wp + 4 * r, s.row, nullptr, run_lanes)) continue;
      }
      int64_t m = 0;
      if (!chain_entries(s, n, m)) {
        std::fill(s.out, s.out + n, nan);
      } else {
        std::fill(s.out, s.out + n, 0.0);
        if (m > 0) {
          const bool feasible = Op::forward(s, ws, m, wp + 4 * r);
          for (int64_t i = 0; i < m; ++i) s.out[s.pos[i]] = feasible ? s.mu[i] : nan;
        }
      }
      lay.store(s.out, op + base);
    }
    groups.finish(run_lanes);
  });
}

template <typename Op>
Tensor chain_fwd(const Tensor& x_in, const Tensor& pairwise, int64_t dim) {
  check_cpu_float(x_in, "unary");
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor w = checked_pairwise(pairwise, x, dim, Op::kName);
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_chain_fwd",
                                    [&] { chain_fwd_impl<Op, scalar_t>(x, w, out, dim); });
  }
  return out;
}

template <typename Op, typename scalar_t>
void chain_bwd_impl(const Tensor& x, const Tensor& grad, const Tensor& w, Tensor& dx, Tensor& dw, int64_t dim) {
  const RowLayout lay = RowLayout::of(x, dim);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* gp = grad.const_data_ptr<scalar_t>();
  scalar_t* dp = dx.mutable_data_ptr<scalar_t>();
  const double* wp = w.const_data_ptr<double>();
  double* dwp = dw.defined() ? dw.mutable_data_ptr<double>() : nullptr;
  const int64_t n = lay.n;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Rows at stride 1 go into the CRF's lanes straight from the tensor.
  const bool direct = lay.inner == 1;
  at::parallel_for(0, lay.rows(), lay.grain(), [&](int64_t begin, int64_t end) {
    ChainScratch s(n);
    typename Op::Workspace ws(n);
    LaneGroups<scalar_t> groups(n, kSideBySide<Op>, /*float_lanes=*/dwp == nullptr);
    auto run_lanes = [&](auto& lanes) {
      lanes.template stage<scalar_t>(direct, /*with_grad=*/true);
      if constexpr (std::remove_reference_t<decltype(lanes)>::kFloat) {
        lanes.template gradient</*with_dw=*/false>();  // (no float lanes when dW is wanted)
      } else if (dwp) {
        lanes.template gradient</*with_dw=*/true>();
      } else {
        lanes.template gradient</*with_dw=*/false>();
      }
      lanes.write_rows(lanes.out, dp, lay, direct, s.out);
      for (int l = 0; l < lanes.count; ++l) {
        const int64_t r = lanes.rows[l];
        if (dwp) {
          for (int k = 0; k < 4; ++k) dwp[4 * r + k] = lanes.dw[k][l];
        }
      }
      lanes.count = 0;
    };
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = lay.base(r);
      if (groups && direct) {
        if (groups.offer_direct(r, wp + 4 * r, xp + base, gp + base, run_lanes)) continue;
        lay.load(xp + base, s.row);
        lay.load(gp + base, s.grad);
      } else {
        lay.load(xp + base, s.row);
        lay.load(gp + base, s.grad);
        if (groups && groups.offer_loaded(r, wp + 4 * r, s.row, s.grad, run_lanes)) continue;
      }
      double* dw_row = dwp ? dwp + 4 * r : nullptr;
      if (dw_row) std::fill(dw_row, dw_row + 4, 0.0);
      int64_t m = 0;
      bool nan_row = !chain_entries(s, n, m);
      if (!nan_row) {
        std::fill(s.out, s.out + n, 0.0);
        if (m > 0) {
          for (int64_t i = 0; i < m; ++i) s.g[i] = s.grad[s.pos[i]];
          nan_row = !Op::backward(s, ws, m, wp + 4 * r, dw_row);
        }
      }
      if (nan_row) {
        std::fill(s.out, s.out + n, nan);
        if (dw_row) std::fill(dw_row, dw_row + 4, nan);
      }
      lay.store(s.out, dp + base);
    }
    groups.finish(run_lanes);
  });
}

template <typename Op>
std::tuple<Tensor, Tensor> chain_bwd(const Tensor& x_in, const Tensor& grad_in, const Tensor& pairwise, int64_t dim,
                                     bool pairwise_grad) {
  check_cpu_float(x_in, "unary");
  check_cpu_float(grad_in, "grad");
  TORCH_CHECK_VALUE(grad_in.sizes() == x_in.sizes(), "attnkern: ", Op::kName, "_bwd: grad of shape ",
                    grad_in.sizes(), " does not match unary of shape ", x_in.sizes());
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor grad = grad_in.to(x.scalar_type()).contiguous();
  const Tensor w = checked_pairwise(pairwise, x, dim, Op::kName);
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dw = pairwise_grad ? at::empty_like(w) : Tensor();
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_chain_bwd",
                                    [&] { chain_bwd_impl<Op, scalar_t>(x, grad, w, dx, dw, dim); });
  } else if (dw.defined()) {
    dw.zero_();
  }
  if (!dw.defined()) dw = at::empty({0}, x.options().dtype(at::kDouble));
  return {dx, dw};
}

// SparseMAP over the chain (Niculae, Martins, Blondel & Cardie, 2018): μ, the
// unary part of the argmax over the chain's marginal polytope of
// uᵀμ + Σ_ab W[a][b]·μ_ab − ½‖μ‖² (the pairwise marginals μ_ab enter
// linearly). The solution is a sparse combination ξ of labelings, its support
// S; the active-set method grows S with Viterbi as the oracle: with
// μ = Σ_s ξ_s z_s, the labeling that most violates optimality maximises
// (u − μ)ᵀz + the W part, Viterbi on scores u − μ. It joins S, and the QP
// restricted to S, max θ_Sᵀξ − ½‖Z_S ξ‖² over the simplex (θ_s the score of
// labeling s), is solved exactly by primal active-set steps on its KKT
// system. S is kept affinely independent (a labeling affinely dependent on S
// replaces one of S instead of joining it), so the KKT matrix
// K = [G 1; 1ᵀ 0], G = Z_SᵀZ_S, stays nonsingular.
//
// Backward: on a fixed support ξ is the first block of K⁻¹[θ_S; 1], so
// dξ = P dθ_S with P that block of K⁻¹; dθ_s/du = z_s and dθ_s/dW[a][b] is the
// number of a→b transitions in s. Hence du = Z_S v and dW[a][b] = Σ_s v_s·#ab(s)
// with v = P Z_Sᵀ g, one more solve with K.
//
// The active set serves only rows with two or more forbidden transitions
// (-inf in W): otherwise μ has a closed form (closed_form below), certified by
// one Viterbi call, with an O(m) backward. The active set alone can need a vast number of
// exchanges when the optimum is interior and W is small, since it then walks
// between nearly equal supports of m + 1 labelings.
struct Sparsemap {
  static constexpr const char* kName = "sparsemap_chain";

  // The support of one row and the work arrays of its solves, grown as the
  // support grows (raw arrays: see ChainScratch).
  struct Workspace {
    int64_t n, cap = 0, k = 0;
    int64_t oracle_calls = 0;  // Viterbi calls of the last solve
    // Whether the last solve's μ is the closed form's (then `runs` holds the
    // TV prox's output before the clip, and `flip` its alternation); else the
    // support below holds it.
    bool closed = false, flip = false;
    double lam = 0.0, lam_sign = 0.0;     // the TV prox's strength |c|/2 and dλ/d(c/2)
    double d_left[4], d_right[4];         // the shifts' derivatives in W (closed_form)
    std::unique_ptr<uint8_t[]> labels;  // cap labelings of n entries
    std::unique_ptr<double[]> theta, xi, counts, gram, kkt, rhs;
    std::unique_ptr<uint8_t[]> cand, back;
    std::unique_ptr<double[]> cost, lambda, runs, levels, knots;

    explicit Workspace(int64_t n_)
        : n(n_), cand(new uint8_t[n_]), back(new uint8_t[2 * n_]), cost(new double[n_]), runs(new double[n_]),
          levels(new double[n_]), knots(new double[7 * n_]) {
      grow(8);
    }
    uint8_t* label(int64_t s) const { return labels.get() + s * n; }
    double& g(int64_t a, int64_t b) const { return gram[a * cap + b]; }

    void grow(int64_t new_cap) {
      std::unique_ptr<uint8_t[]> nl(new uint8_t[new_cap * n]);
      std::unique_ptr<double[]> nt(new double[new_cap]), nx(new double[new_cap]), nc(new double[4 * new_cap]),
          ng(new double[new_cap * new_cap]);
      for (int64_t s = 0; s < k; ++s) {
        std::copy(label(s), label(s) + n, nl.get() + s * n);
        nt[s] = theta[s];
        nx[s] = xi[s];
        std::copy(&counts[4 * s], &counts[4 * s] + 4, &nc[4 * s]);
        for (int64_t t = 0; t < k; ++t) ng[s * new_cap + t] = g(s, t);
      }
      labels = std::move(nl);
      theta = std::move(nt);
      xi = std::move(nx);
      counts = std::move(nc);
      gram = std::move(ng);
      kkt.reset(new double[(new_cap + 1) * (new_cap + 1)]);
      rhs.reset(new double[new_cap + 1]);
      lambda.reset(new double[new_cap + 1]);
      cap = new_cap;
    }

    // Adds the candidate labeling (its score under u and w) with weight 0.
    void add_candidate(const double* u, int64_t m, const double* w) {
      if (k == cap) grow(2 * cap);
      uint8_t* z = label(k);
      std::copy(cand.get(), cand.get() + m, z);
      double score = 0.0, c[4] = {0.0, 0.0, 0.0, 0.0};
      for (int64_t i = 0; i < m; ++i) score += z[i] ? u[i] : 0.0;
      for (int64_t i = 0; i + 1 < m; ++i) c[2 * z[i] + z[i + 1]] += 1.0;
      for (int ab = 0; ab < 4; ++ab) {
        counts[4 * k + ab] = c[ab];
        if (c[ab] > 0.0) score += c[ab] * w[ab];
      }
      theta[k] = score;
      xi[k] = 0.0;
      for (int64_t t = 0; t <= k; ++t) {
        double common = 0.0;
        const uint8_t* y = label(t);
        for (int64_t i = 0; i < m; ++i) common += double(z[i] & y[i]);
        g(k, t) = g(t, k) = common;
      }
      ++k;
    }

    // Removes labeling j from the support (the last one takes its place).
    void remove(int64_t j, int64_t m) {
      const int64_t last = k - 1;
      if (j != last) {
        std::copy(label(last), label(last) + m, label(j));
        theta[j] = theta[last];
        xi[j] = xi[last];
        std::copy(&counts[4 * last], &counts[4 * last] + 4, &counts[4 * j]);
        for (int64_t t = 0; t < k; ++t) g(j, t) = g(last, t);
        for (int64_t t = 0; t < k; ++t) g(t, j) = g(t, last);
        g(j, j) = g(last, last);
      }
      --k;
    }

    bool holds_candidate(int64_t m) const {
      for (int64_t s = 0; s < k; ++s) {
        if (std::equal(cand.get(), cand.get() + m, label(s))) return true;
      }
      return false;
    }

    // Solves K [x; κ] = [rhs; last] for the support's KKT matrix K (x into
    // rhs[0..k)), by Gaussian elimination with partial pivoting.
    void solve_kkt(double last) {
      const int64_t size = k + 1;
      double* a = kkt.get();
      for (int64_t r = 0; r < k; ++r) {
        for (int64_t c = 0; c < k; ++c) a[r * size + c] = g(r, c);
        a[r * size + k] = 1.0;
        a[k * size + r] = 1.0;
      }
      a[k * size + k] = 0.0;
      rhs[k] = last;
      solve_dense(a, rhs.get(), size);
    }

    // Gaussian elimination with partial pivoting on a (size × size, row-major),
    // b overwritten by the solution.
    static void solve_dense(double* a, double* b, int64_t size) {
      for (int64_t c = 0; c < size; ++c) {
        int64_t pivot = c;
        for (int64_t r = c + 1; r < size; ++r) {
          if (std::abs(a[r * size + c]) > std::abs(a[pivot * size + c])) pivot = r;
        }
        TORCH_CHECK(std::abs(a[pivot * size + c]) > 1e-12, "attnkern: sparsemap_chain met a singular active set");
        if (pivot != c) {
          for (int64_t j = 0; j < size; ++j) std::swap(a[c * size + j], a[pivot * size + j]);
          std::swap(b[c], b[pivot]);
        }
        for (int64_t r = c + 1; r < size; ++r) {
          const double f = a[r * size + c] / a[c * size + c];
          if (f == 0.0) continue;
          for (int64_t j = c; j < size; ++j) a[r * size + j] -= f * a[c * size + j];
          b[r] -= f * b[c];
        }
      }
      for (int64_t c = size - 1; c >= 0; --c) {
        double v = b[c];
        for (int64_t j = c + 1; j < size; ++j) v -= a[c * size + j] * b[j];
        b[c] = v / a[c * size + c];
      }
    }

    // Whether the candidate's (z, 1) is a combination Σ λ_s (z_s, 1) of the
    // support's (λ into lambda): the least-squares λ from (G + 11ᵀ)λ = b,
    // b_s = z_s·z + 1 (G + 11ᵀ is positive definite while the support is
    // affinely independent), then the residual ‖z‖² + 1 − λᵀb, exact zero for
    // a dependent candidate up to rounding (labelings are 0/1 vectors).
    bool candidate_depends(int64_t m) {
      if (k == 0) return false;
      double* a = kkt.get();
      double norm = 1.0;
      for (int64_t i = 0; i < m; ++i) norm += double(cand[i]);
      for (int64_t s = 0; s < k; ++s) {
        for (int64_t t = 0; t < k; ++t) a[s * k + t] = g(s, t) + 1.0;
        double common = 1.0;
        const uint8_t* y = label(s);
        for (int64_t i = 0; i < m; ++i) common += double(cand[i] & y[i]);
        lambda[s] = common;
        rhs[s] = common;
      }
      solve_dense(a, lambda.get(), k);
      double explained = 0.0;
      for (int64_t s = 0; s < k; ++s) explained += lambda[s] * rhs[s];
      return norm - explained < 1e-9 * norm;
    }
  };

  // The labeling maximising Σ c_i z_i + Σ w[z_i][z_{i+1}] into ws.cand (ties
  // to the smaller label); returns its value (-inf if none is feasible).
  static double viterbi(Workspace& ws, const double* c, int64_t m, const double* w) {
    uint8_t* back = ws.back.get();
    double s0 = 0.0, s1 = c[0];
    for (int64_t i = 1; i < m; ++i) {
      double next[2];
      for (int t = 0; t < 2; ++t) {
        const double from0 = s0 + w[t], from1 = s1 + w[2 + t];
        back[2 * i + t] = from1 > from0;
        next[t] = std::max(from0, from1) + (t ? c[i] : 0.0);
      }
      s0 = next[0];
      s1 = next[1];
    }
    uint8_t* z = ws.cand.get();
    z[m - 1] = s1 > s0;
    for (int64_t i = m - 1; i >= 1; --i) z[i - 1] = back[2 * i + z[i]];
    return std::max(s0, s1);
  }

  // viterbi's value alone: no back pointers and no branches, for the closed
  // form's certificate.
  static double viterbi_value(const double* c, int64_t m, const double* w) {
    double s0 = 0.0, s1 = c[0];
    for (int64_t i = 1; i < m; ++i) {
      const double next0 = std::max(s0 + w[0], s1 + w[2]);
      s1 = std::max(s0 + w[1], s1 + w[3]) + c[i];
      s0 = next0;
    }
    return std::max(s0, s1);
  }

  // The QP restricted to the support, from the feasible ξ there: primal
  // active-set steps (solve the KKT system; if some weight comes out negative,
  // move towards the solution until the first weight reaches 0 and drop that
  // labeling; repeat). Returns false if the labeling at `fresh` (just added
  // with weight 0) is dropped before anything moved: no progress is possible.
  static bool restricted_qp(Workspace& ws, int64_t fresh) {
    for (bool first = true;; first = false) {
      for (int64_t s = 0; s < ws.k; ++s) ws.rhs[s] = ws.theta[s];
      ws.solve_kkt(1.0);
      int64_t block = -1;
      double step = 1.0;
      for (int64_t s = 0; s < ws.k; ++s) {
        if (ws.rhs[s] < 0.0) {
          const double ratio = ws.xi[s] / (ws.xi[s] - ws.rhs[s]);
          if (ratio < step) {
            step = ratio;
            block = s;
          }
        }
      }
      for (int64_t s = 0; s < ws.k; ++s) ws.xi[s] += step * (ws.rhs[s] - ws.xi[s]);
      if (block < 0) return true;
      if (first && block == fresh && step == 0.0) {
        ws.remove(block, ws.n);
        return false;
      }
      ws.xi[block] = 0.0;
      ws.remove(block, ws.n);
    }
  }

  // The closed forms (docs/algorithms.md, section 12). The best 2×2 table of
  // an edge with margins a = μ_i, b = μ_{i+1} scores W's linear part plus, with
  // every transition allowed, −(|c|/2)·|a − b| (c > 0) or −(|c|/2)·|a + b − 1|
  // (c < 0), c = W00 − W01 − W10 + W11; with exactly one forbidden transition
  // its table is fixed and it constrains a ≤ b, b ≤ a, a + b ≤ 1 or a + b ≥ 1.
  // Mirroring every odd entry (x ↦ 1 − x) turns a + b − 1 into a difference, so
  // μ is the TV prox (Condat's) or the order-constrained projection
  // (ordered_projection) of the shifted scores ũ, clamped to [0, 1] and
  // mirrored back. False with two or more forbidden transitions (left to the
  // active set). μ into s.mu, the prox's output before the clamp into ws.runs,
  // what the backward needs into ws.
  static bool closed_form(ChainScratch& s, Workspace& ws, int64_t m, const double* w) {
    int forbidden = -1, count = 0;
    for (int ab = 0; ab < 4; ++ab) {
      if (!(w[ab] > kNegInf)) {
        forbidden = ab;
        ++count;
      }
    }
    if (count > 1) return false;
    // ũ_i = u_i + shift_left (if i has a right neighbour) + shift_right (if a
    // left one); d_left / d_right: their derivatives in W00, W01, W10, W11.
    static constexpr double kTv[2][4] = {{-0.5, -0.5, 0.5, 0.5}, {-0.5, 0.5, -0.5, 0.5}};
    static constexpr double k11[2][4] = {{-1, 0, 1, 0}, {-1, 1, 0, 0}};  // t = 0: W10 − W00, W01 − W00
    static constexpr double k00[2][4] = {{0, -1, 0, 1}, {0, 0, -1, 1}};  // t = a + b − 1: W11 − W01, W11 − W10
    static constexpr double k10[2][4] = {{0, -1, 0, 1}, {-1, 1, 0, 0}};  // t = a: W11 − W01, W01 − W00
    static constexpr double k01[2][4] = {{-1, 0, 1, 0}, {0, 0, -1, 1}};  // t = b: W10 − W00, W11 − W10
    const double c = count ? 0.0 : w[0] - w[1] - w[2] + w[3];
    const double(*d)[4] = count == 0 ? kTv : forbidden == 3 ? k11 : forbidden == 0 ? k00 : forbidden == 2 ? k10 : k01;
    double shift_left = 0.0, shift_right = 0.0;
    for (int ab = 0; ab < 4; ++ab) {
      ws.d_left[ab] = d[0][ab];
      ws.d_right[ab] = d[1][ab];
      if (d[0][ab] != 0.0) shift_left += d[0][ab] * w[ab];
      if (d[1][ab] != 0.0) shift_right += d[1][ab] * w[ab];
    }
    ws.flip = count ? (forbidden == 0 || forbidden == 3) : c < 0.0;
    ws.lam = 0.5 * std::abs(c);
    // λ = |c|/2 has a kink at c = 0, where the forward takes the unmirrored
    // branch (c ≥ 0): its derivative is that branch's, so that W starting at
    // zeros (the modules' start) still learns c. (No λ with a forbidden
    // transition.)
    ws.lam_sign = count ? 0.0 : c < 0.0 ? -1.0 : 1.0;
    double* x = ws.cost.get();
    for (int64_t i = 0; i < m; ++i) {
      const double shifted = s.u[i] + (i + 1 < m ? shift_left : 0.0) + (i > 0 ? shift_right : 0.0);
      x[i] = mirrored(ws, i) ? 1.0 - shifted : shifted;
    }
    if (count == 0) {
      math::tv_prox(x, m, ws.lam, ws.runs.get());
    } else {
      // Which edges ask ν_i ≤ ν_{i+1}: a ≤ b (10 forbidden) on every edge; a + b ≤ 1
      // (11 forbidden) on the edges from an even entry, mirrored; b ≤ a and a + b ≥ 1
      // the other way round.
      const bool even_rises = forbidden == 3 || forbidden == 2;
      const bool odd_rises = ws.flip ? !even_rises : even_rises;
      ordered_projection(x, m, even_rises, odd_rises, ws.runs.get(), ws.knots.get());
    }
    for (int64_t i = 0; i < m; ++i) s.mu[i] = nu_to_mu(ws, i, nu_at(ws, i));
    return true;
  }

  static bool mirrored(const Workspace& ws, int64_t i) { return ws.flip && (i & 1); }
  // ν_i: the prox's output clamped to [0, 1], exactly (recomputing it from μ
  // through the mirror would round).
  static double nu_at(const Workspace& ws, int64_t i) { return std::min(1.0, std::max(0.0, ws.runs[i])); }
  static double nu_to_mu(const Workspace& ws, int64_t i, double nu) { return mirrored(ws, i) ? 1.0 - nu : nu; }

  // argmin ½‖y − x‖² subject to y_i ≤ y_{i+1} on the edges i where `rises`
  // says so (even_rises for even i, odd_rises for odd i) and y_i ≥ y_{i+1} on
  // the others, into y. Dynamic programming over the derivative δ of the
  // forward message (the best cost of y_0..y_i as a function of y_i): δ is
  // piecewise linear and increasing, kept as knots where its slope and
  // intercept jump, in a deque; an edge y_i ≤ y_{i+1} caps δ at 0 from the
  // right (the message stops falling at its minimum), y_i ≥ y_{i+1} floors it
  // at 0 from the left, and each knot enters and leaves once: O(n). The
  // backtrack then clamps: y_i = min(y_{i+1}, r_i) or max(y_{i+1}, r_i), r_i
  // the message's minimiser. scratch: 7n doubles.
  static void ordered_projection(const double* x, int64_t n, bool even_rises, bool odd_rises, double* y,
                                 double* scratch) {
    double *at = scratch, *da = at + 2 * n, *db = da + 2 * n, *root = db + 2 * n;
    int64_t first = n, last = n;  // the knots: [first, last)
    // δ left of every knot is la·t + lb, right of every knot ra·t + rb.
    double la = 1.0, lb = -x[0], ra = 1.0, rb = -x[0];
    for (int64_t i = 0; i + 1 < n; ++i) {
      if ((i & 1) ? odd_rises : even_rises) {  // δ := min(δ, 0): from the right
        double a = ra, b = rb;
        while (first < last && a * at[last - 1] + b >= 0.0) {
          --last;
          a -= da[last];
          b -= db[last];
        }
        root[i] = -b / a;
        at[last] = root[i], da[last] = -a, db[last] = -b;
        ++last;
        ra = 0.0, rb = 0.0;
      } else {  // δ := max(δ, 0): from the left
        double a = la, b = lb;
        while (first < last && a * at[first] + b <= 0.0) {
          a += da[first];
          b += db[first];
          ++first;
        }
        root[i] = -b / a;
        --first;
        at[first] = root[i], da[first] = a, db[first] = b;
        la = 0.0, lb = 0.0;
      }
      la += 1.0, lb -= x[i + 1], ra += 1.0, rb -= x[i + 1];
    }
    double a = la, b = lb;
    while (first < last && a * at[first] + b <= 0.0) {
      a += da[first];
      b += db[first];
      ++first;
    }
    double v = -b / a;
    y[n - 1] = v;
    for (int64_t i = n - 2; i >= 0; --i) {
      v = ((i & 1) ? odd_rises : even_rises) ? std::min(v, root[i]) : std::max(v, root[i]);
      y[i] = v;
    }
  }

  // A distribution over labelings with unary marginals μ and the best pairwise
  // marginals for W: z_i = [U < ν_i] for U uniform on [0, 1), mirrored back at
  // the odd entries when the closed form mirrors. One labeling per gap between
  // consecutive distinct values of ν ∪ {0, 1}, weighted by the gap: nested,
  // so affinely independent. emit(z, weight) for each; z is ws.cand.
  template <typename Emit>
  static void threshold_labelings(const ChainScratch& s, Workspace& ws, int64_t m, Emit emit) {
    double* nu = ws.levels.get();
    for (int64_t i = 0; i < m; ++i) nu[i] = nu_at(ws, i);
    std::sort(nu, nu + m, [](double a, double b) { return a > b; });
    double upper = 1.0;
    for (int64_t j = 0; j <= m; ++j) {
      const double lower = j < m ? nu[j] : 0.0;
      if (!(lower < upper)) continue;
      for (int64_t i = 0; i < m; ++i) ws.cand[i] = (nu_at(ws, i) >= upper) != mirrored(ws, i);
      emit(ws.cand.get(), upper - lower);
      upper = lower;
    }
  }

  // The excess value of the best labeling over the threshold distribution's
  // common value τ = E[θ_z] − ‖μ‖² (E[θ_z] from that distribution's pairwise
  // marginals: P(1, 1) = min(ν_i, ν_{i+1}) unmirrored, max(0, μ_i + μ_{i+1} − 1)
  // mirrored; forbidden transitions have probability 0 there): the closed
  // form's optimality certificate, one Viterbi pass.
  static double closed_form_excess(ChainScratch& s, Workspace& ws, int64_t m, const double* w) {
    const double* mu = s.mu;
    double expected = 0.0, norm = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      expected += s.u[i] * mu[i];
      norm += mu[i] * mu[i];
      ws.cost[i] = s.u[i] - mu[i];
    }
    for (int64_t i = 0; i + 1 < m; ++i) {
      const double a = mu[i], b = mu[i + 1], nu_a = nu_at(ws, i), nu_b = nu_at(ws, i + 1);
      // (from ν, so that a constraint the projection met exactly gives exact zeros)
      const double both = !ws.flip ? std::min(a, b) : std::max(0.0, (i & 1) ? nu_b - nu_a : nu_a - nu_b);
      const double table[4] = {1.0 - a - b + both, b - both, a - both, both};
      for (int ab = 0; ab < 4; ++ab) {
        if (w[ab] > kNegInf) expected += w[ab] * table[ab];
      }
    }
    return viterbi_value(ws.cost.get(), m, w) - (expected - norm);
  }

  // Violations below a few rounding errors of the scores are not acted on.
  static double tolerance(const double* u, int64_t m, const double* w) {
    double scale = 1.0;
    for (int64_t i = 0; i < m; ++i) scale = std::max(scale, std::abs(u[i]));
    for (int ab = 0; ab < 4; ++ab) {
      if (w[ab] > kNegInf) scale = std::max(scale, std::abs(w[ab]));
    }
    return 64.0 * std::numeric_limits<double>::epsilon() * double(m + 1) * scale;
  }

  // μ into s.mu; false if no labeling is feasible. The closed form when every
  // transition is allowed and Viterbi certifies it; else the active-set
  // search, from the closed form's labelings if there is one.
  static bool solve(ChainScratch& s, Workspace& ws, int64_t m, const double* w) {
    const double* u = s.u;
    const double tol = tolerance(u, m, w);
    ws.k = 0;
    ws.closed = false;
    ws.oracle_calls = 1;
    if (closed_form(s, ws, m, w)) {
      if (closed_form_excess(s, ws, m, w) <= tol) {
        ws.closed = true;
        return true;
      }
      threshold_labelings(s, ws, m, [&](const uint8_t*, double weight) {
        ws.add_candidate(u, m, w);
        ws.xi[ws.k - 1] = weight;
      });
    } else {
      if (!(viterbi(ws, u, m, w) > kNegInf)) return false;
      ws.add_candidate(u, m, w);
      ws.xi[0] = 1.0;
    }
    double* mu = s.mu;
    for (int64_t iter = 0;; ++iter) {
      TORCH_CHECK(iter <= 100 + 20 * m, "attnkern: sparsemap_chain's active set did not converge in ", iter,
                  " steps");
      ++ws.oracle_calls;
      std::fill(mu, mu + m, 0.0);
      for (int64_t t = 0; t < ws.k; ++t) {
        const uint8_t* z = ws.label(t);
        for (int64_t i = 0; i < m; ++i) mu[i] += z[i] ? ws.xi[t] : 0.0;
      }
      double tau = 0.0;  // the support's common value θ_s − μ·z_s (ξ-weighted)
      for (int64_t t = 0; t < ws.k; ++t) {
        double dot = 0.0;
        const uint8_t* z = ws.label(t);
        for (int64_t i = 0; i < m; ++i) dot += z[i] ? mu[i] : 0.0;
        tau += ws.xi[t] * (ws.theta[t] - dot);
      }
      for (int64_t i = 0; i < m; ++i) ws.cost[i] = u[i] - mu[i];
      if (viterbi(ws, ws.cost.get(), m, w) <= tau + tol || ws.holds_candidate(m)) break;
      if (ws.candidate_depends(m)) {
        // Move along (−λ, +1), which keeps Z_S ξ and raises the objective,
        // until a weight with λ_s > 0 reaches 0; that labeling leaves.
        int64_t block = -1;
        double step = std::numeric_limits<double>::infinity();
        for (int64_t t = 0; t < ws.k; ++t) {
          if (ws.lambda[t] > 1e-12 && ws.xi[t] / ws.lambda[t] < step) {
            step = ws.xi[t] / ws.lambda[t];
            block = t;
          }
        }
        TORCH_CHECK(block >= 0, "attnkern: sparsemap_chain met a degenerate active set");
        for (int64_t t = 0; t < ws.k; ++t) ws.xi[t] -= step * ws.lambda[t];
        ws.xi[block] = 0.0;
        ws.add_candidate(u, m, w);
        ws.xi[ws.k - 1] = step;
        ws.remove(block, m);
        if (!restricted_qp(ws, -1)) break;
      } else {
        ws.add_candidate(u, m, w);
        if (!restricted_qp(ws, ws.k - 1)) break;
      }
    }
    std::fill(mu, mu + m, 0.0);
    for (int64_t t = 0; t < ws.k; ++t) {
      const uint8_t* z = ws.label(t);
      for (int64_t i = 0; i < m; ++i) mu[i] += z[i] ? ws.xi[t] : 0.0;
    }
    return true;
  }

  static bool forward(ChainScratch& s, Workspace& ws, int64_t m, const double* w) { return solve(s, ws, m, w); }

  static bool backward(ChainScratch& s, Workspace& ws, int64_t m, const double* w, double* dw) {
    if (!solve(s, ws, m, w)) return false;
    if (ws.closed) {
      closed_form_backward(s, ws, m, w, dw);
      return true;
    }
    for (int64_t t = 0; t < ws.k; ++t) {
      double r = 0.0;
      const uint8_t* z = ws.label(t);
      for (int64_t i = 0; i < m; ++i) r += z[i] ? s.g[i] : 0.0;
      ws.rhs[t] = r;
    }
    ws.solve_kkt(0.0);
    for (int64_t i = 0; i < m; ++i) {
      double du = 0.0;
      for (int64_t t = 0; t < ws.k; ++t) du += ws.label(t)[i] ? ws.rhs[t] : 0.0;
      s.out[s.pos[i]] = du;
    }
    if (dw) {
      for (int64_t t = 0; t < ws.k; ++t) {
        for (int ab = 0; ab < 4; ++ab) dw[ab] += ws.rhs[t] * ws.counts[4 * t + ab];
      }
    }
    return true;
  }

  // The closed form's vector-Jacobian product. Within a run of equal prox
  // values strictly inside (0, 1) the prox (or the projection) averages its
  // inputs, and with TV the run's value moves with λ = |c|/2 by (r − l)/size
  // (r, l: the signs of the jumps to its right and from its left neighbour);
  // a clamped run passes nothing. The mirroring flips the signs of the odd
  // entries both ways, and W reaches μ through the two shifts of u and λ.
  static void closed_form_backward(ChainScratch& s, Workspace& ws, int64_t m, const double* w, double* dw) {
    const double* y = ws.runs.get();
    double d_lam = 0.0, d_left = 0.0, d_right = 0.0;
    for (int64_t first = 0, last; first < m; first = last + 1) {
      last = first;
      while (last + 1 < m && y[last + 1] == y[first]) ++last;
      const double size = double(last - first + 1), value = y[first];
      double sum = 0.0;
      for (int64_t i = first; i <= last; ++i) sum += mirrored(ws, i) ? -s.g[i] : s.g[i];
      const bool inside = value > 0.0 && value < 1.0;
      for (int64_t i = first; i <= last; ++i) {
        const double du = inside ? (mirrored(ws, i) ? -sum : sum) / size : 0.0;
        s.out[s.pos[i]] = du;
        if (i + 1 < m) d_left += du;
        if (i > 0) d_right += du;
      }
      if (inside) {
        const double l = first == 0 ? 0.0 : double((value > y[first - 1]) - (value < y[first - 1]));
        const double r = last + 1 == m ? 0.0 : double((y[last + 1] > value) - (y[last + 1] < value));
        d_lam += sum * (r - l) / size;
      }
    }
    if (!dw) return;
    // λ = |c|/2 (0 for the order-constrained forms, whose runs do not move with W).
    static constexpr double kDc[4] = {1.0, -1.0, -1.0, 1.0};
    const double d_c = 0.5 * ws.lam_sign * d_lam;
    for (int ab = 0; ab < 4; ++ab) dw[ab] += ws.d_left[ab] * d_left + ws.d_right[ab] * d_right + kDc[ab] * d_c;
  }
};

// SparseMAP's solution as its active set: per row the labelings (at the
// row's positions, 0 at removed ones) and their weights, padded to the
// largest support K of any row, and the Viterbi calls the solve made (0 for a
// row with no finite entry, NaN or no feasible labeling, which has no support).
std::tuple<Tensor, Tensor, Tensor> sparsemap_chain_active(const Tensor& x_in, const Tensor& pairwise, int64_t dim) {
  check_cpu_float(x_in, "unary");
  dim = x_in.dim() == 0 ? 0 : at::maybe_wrap_dim(dim, x_in.dim());
  check_row_length(x_in, dim);
  const Tensor x = x_in.contiguous();
  const Tensor w = checked_pairwise(pairwise, x, dim, Sparsemap::kName);
  const RowLayout lay = RowLayout::of(x, dim);
  auto shape = x.sizes().vec();  // the rows' shape: unary's without dim
  if (!shape.empty()) shape.erase(shape.begin() + dim);
  int64_t rows = 1;
  for (int64_t d : shape) rows *= d;
  const int64_t n = x.dim() == 0 ? 1 : x.size(dim);
  std::vector<std::vector<uint8_t>> labels(rows);
  std::vector<std::vector<double>> weights(rows);
  std::vector<int64_t> calls(rows, 0);
  const double* wp = w.const_data_ptr<double>();
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "attnkern_sparsemap_active", [&] {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      at::parallel_for(0, rows, lay.grain(), [&](int64_t begin, int64_t end) {
        ChainScratch s(n);
        Sparsemap::Workspace ws(n);
        for (int64_t r = begin; r < end; ++r) {
          lay.load(xp + lay.base(r), s.row);
          int64_t m = 0;
          if (!chain_entries(s, n, m) || m == 0 || !Sparsemap::solve(s, ws, m, wp + 4 * r)) continue;
          calls[r] = ws.oracle_calls;
          auto keep = [&](const uint8_t* z, double weight) {
            const size_t at = labels[r].size();
            labels[r].resize(at + n, 0);
            for (int64_t i = 0; i < m; ++i) labels[r][at + s.pos[i]] = z[i];
            weights[r].push_back(weight);
          };
          if (ws.closed) {
            Sparsemap::threshold_labelings(s, ws, m, keep);
          } else {
            for (int64_t t = 0; t < ws.k; ++t) keep(ws.label(t), ws.xi[t]);
          }
        }
      });
    });
  }
  int64_t K = 0;
  for (const auto& wr : weights) K = std::max<int64_t>(K, static_cast<int64_t>(wr.size()));
  Tensor structures = at::zeros({rows, K, n}, x.options().dtype(at::kBool));
  Tensor xi = at::zeros({rows, K}, x.options().dtype(at::kDouble));
  Tensor oracle = at::empty({rows}, x.options().dtype(at::kLong));
  bool* sp = structures.mutable_data_ptr<bool>();
  double* wt = xi.mutable_data_ptr<double>();
  int64_t* op = oracle.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = static_cast<int64_t>(weights[r].size());
    for (int64_t j = 0; j < k * n; ++j) sp[r * K * n + j] = labels[r][j] != 0;
    std::copy(weights[r].begin(), weights[r].end(), wt + r * K);
    op[r] = calls[r];
  }
  auto with = [&](std::initializer_list<int64_t> tail) {
    auto s = shape;
    s.insert(s.end(), tail);
    return s;
  };
  return {structures.view(with({K, n})), xi.view(with({K})), oracle.view(shape)};
}

}  // namespace

void add_chain_kernels(KernelTable& t) {
  t.crf_marginals_fwd = &chain_fwd<CrfMarginals>;
  t.crf_marginals_bwd = &chain_bwd<CrfMarginals>;
  t.sparsemap_chain_fwd = &chain_fwd<Sparsemap>;
  t.sparsemap_chain_bwd = &chain_bwd<Sparsemap>;
  t.sparsemap_chain_active = &sparsemap_chain_active;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

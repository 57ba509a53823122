// SIMD building blocks of the CPU kernels (ATen's Vectorized, plus
// hand-written AVX2 and AVX-512 forms where they pay): horizontal sums, stream
// compaction (left-packing), fast reciprocals and powers, the row max and
// shifts, and a scope guard that flushes denormals.
#pragma once

#include "attnkern/isa_features.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

template <typename acc_t>
using Vec = at::vec::Vectorized<acc_t>;

// Flushes denormal results and inputs to zero while in scope (restores the
// thread's mode after). Probabilities below the smallest normal float are
// zeros for every purpose here, and denormal arithmetic costs ~100 cycles an
// operation on the tails of the powers.
struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

template <typename acc_t>
inline acc_t hsum(const Vec<acc_t>& v) {
  return at::vec::vec_reduce_all<acc_t>([](Vec<acc_t>& a, Vec<acc_t>& b) { return a + b; }, v);
}

// The rest < size() entries at x as a vector whose other lanes hold `fill`
// (reads only the rest entries), and the mask of those first `rest` lanes:
// vector tails instead of scalar loops, whose libm calls cost more than the
// vector body once rows are compacted to a few hundred candidates.
template <typename acc_t>
inline Vec<acc_t> load_tail(const acc_t* x, int64_t rest, acc_t fill) {
  return Vec<acc_t>::set(Vec<acc_t>(fill), Vec<acc_t>::loadu(x, rest), rest);
}

template <typename acc_t>
inline Vec<acc_t> tail_lanes(int64_t rest) {
  return Vec<acc_t>::arange(acc_t(0), acc_t(1)) < Vec<acc_t>(static_cast<acc_t>(rest));
}

// Stores the lanes of v selected by `mask` (bit l = lane l) contiguously at
// dst and returns how many: branch-free stream compaction. dst must have
// room for a whole vector (it may alias the lanes just loaded: the store never
// runs ahead of the read position).
template <typename acc_t>
inline int left_pack(acc_t* dst, const Vec<acc_t>& v, int mask) {
  alignas(64) acc_t lanes[Vec<acc_t>::size()];
  v.store(lanes);
  int k = 0;
  for (int l = 0; l < Vec<acc_t>::size(); ++l) {
    dst[k] = lanes[l];
    k += (mask >> l) & 1;
  }
  return k;
}

// left_pack that writes only the selected lanes (for the end of a buffer).
template <typename acc_t>
inline int left_pack_bounded(acc_t* dst, const Vec<acc_t>& v, int mask) {
  alignas(64) acc_t lanes[Vec<acc_t>::size()];
  v.store(lanes);
  int k = 0;
  for (int l = 0; l < Vec<acc_t>::size(); ++l)
    if ((mask >> l) & 1) dst[k++] = lanes[l];
  return k;
}

// The positions j..j+lanes-1 of the lanes selected by mask, stored at dst
// (scalar; the AVX2 and AVX-512 forms below are used where they apply).
template <int lanes>
inline int left_pack_index_scalar(int32_t* dst, int32_t j, int mask) {
  int k = 0;
  for (int l = 0; l < lanes; ++l) {
    dst[k] = j + l;
    k += (mask >> l) & 1;
  }
  return k;
}

#if !ATTNKERN_HAS(AVX2)
template <int lanes>
inline int left_pack_index(int32_t* dst, int32_t j, int mask) {
  return left_pack_index_scalar<lanes>(dst, j, mask);
}
#endif

// Lane-index mask of a comparison result (bit l set where lane l is true).
template <typename acc_t>
inline int lane_mask(const Vec<acc_t>& cmp) {
  return ~cmp.zero_mask() & ((1 << Vec<acc_t>::size()) - 1);
}

#if ATTNKERN_HAS(AVX2) && !ATTNKERN_HAS(AVX512)
struct LeftPackTable {
  alignas(32) int32_t idx[256][8];
  constexpr LeftPackTable() : idx() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int l = 0; l < 8; ++l)
        if ((m >> l) & 1) idx[m][k++] = l;
    }
  }
};
inline constexpr LeftPackTable kLeftPack{};

template <>
inline int left_pack<float>(float* dst, const Vec<float>& v, int mask) {
  __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLeftPack.idx[mask]));
  _mm256_storeu_ps(dst, _mm256_permutevar8x32_ps(__m256(v), perm));
  return __builtin_popcount(mask);
}

template <int lanes>
inline int left_pack_index(int32_t* dst, int32_t j, int mask) {
  if constexpr (lanes != 8) return left_pack_index_scalar<lanes>(dst, j, mask);
  __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLeftPack.idx[mask]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_add_epi32(perm, _mm256_set1_epi32(j)));
  return __builtin_popcount(mask);
}

template <>
inline int lane_mask<float>(const Vec<float>& cmp) {
  return _mm256_movemask_ps(__m256(cmp));
}
#endif

#if ATTNKERN_HAS(AVX512)
// AVX-512: compaction is vcompress into a register, then a plain store (the
// compress-to-memory form is microcoded and slow on AMD Zen 4).
template <>
inline int left_pack<float>(float* dst, const Vec<float>& v, int mask) {
  _mm512_storeu_ps(dst, _mm512_maskz_compress_ps(static_cast<__mmask16>(mask), __m512(v)));
  return __builtin_popcount(mask);
}

template <>
inline int left_pack<double>(double* dst, const Vec<double>& v, int mask) {
  _mm512_storeu_pd(dst, _mm512_maskz_compress_pd(static_cast<__mmask8>(mask), __m512d(v)));
  return __builtin_popcount(mask);
}

template <>
inline int left_pack_bounded<float>(float* dst, const Vec<float>& v, int mask) {
  const int kept = __builtin_popcount(mask);
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << kept) - 1),
                        _mm512_maskz_compress_ps(static_cast<__mmask16>(mask), __m512(v)));
  return kept;
}

template <>
inline int left_pack_bounded<double>(double* dst, const Vec<double>& v, int mask) {
  const int kept = __builtin_popcount(mask);
  _mm512_mask_storeu_pd(dst, static_cast<__mmask8>((1u << kept) - 1),
                        _mm512_maskz_compress_pd(static_cast<__mmask8>(mask), __m512d(v)));
  return kept;
}

template <int lanes>
inline int left_pack_index(int32_t* dst, int32_t j, int mask) {
  if constexpr (lanes != 16 && lanes != 8) return left_pack_index_scalar<lanes>(dst, j, mask);
  const __m512i idx = _mm512_add_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(j));
  const __mmask16 m = static_cast<__mmask16>(lanes == 16 ? mask : mask & 0xff);
  if constexpr (lanes == 16) {
    _mm512_storeu_si512(dst, _mm512_maskz_compress_epi32(m, idx));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_castsi512_si256(_mm512_maskz_compress_epi32(m, idx)));
  }
  return __builtin_popcount(mask);
}

template <>
inline int lane_mask<float>(const Vec<float>& cmp) {
  return _mm512_movepi32_mask(_mm512_castps_si512(__m512(cmp)));
}

template <>
inline int lane_mask<double>(const Vec<double>& cmp) {
  return _mm512_movepi64_mask(_mm512_castpd_si512(__m512d(cmp)));
}
#endif

// lane_mask(a > b): at AVX-512 the comparison's own mask register (at::vec's
// a > b is a vector of lanes, which lane_mask turns back into a mask: two
// more instructions in every compaction loop).
template <typename acc_t>
inline int gt_mask(const Vec<acc_t>& a, const Vec<acc_t>& b) {
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return _mm512_cmp_ps_mask(__m512(a), __m512(b), _CMP_GT_OQ);
  if constexpr (std::is_same_v<acc_t, double>) return _mm512_cmp_pd_mask(__m512d(a), __m512d(b), _CMP_GT_OQ);
#endif
  return lane_mask<acc_t>(a > b);
}

// 1/d: exact division in general; on AVX2 and AVX-512 float, the hardware
// estimate with one Newton-Raphson step (~2 ulp), which keeps the divider (one ymm division
// per 5 cycles) off the critical path of the power passes.
template <typename acc_t>
inline Vec<acc_t> recip(const Vec<acc_t>& d) {
  return Vec<acc_t>(acc_t(1)) / d;
}

#if ATTNKERN_HAS(AVX2) && !ATTNKERN_HAS(AVX512)
template <>
inline Vec<float> recip<float>(const Vec<float>& dv) {
  __m256 d = __m256(dv);
  __m256 r = _mm256_rcp_ps(d);
  return Vec<float>(_mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.0f))));
}
#endif

#if ATTNKERN_HAS(AVX512)
// AVX-512: the 14-bit estimate with one Newton-Raphson step (~1 ulp).
template <>
inline Vec<float> recip<float>(const Vec<float>& dv) {
  __m512 d = __m512(dv);
  __m512 r = _mm512_rcp14_ps(d);
  return Vec<float>(_mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))));
}
#endif

// d^e for 0 < d <= 1 (lanes outside are the caller's to mask), e > 0.
// These powers are the cost of every α-entmax pass; Sleef's u10 log1p/exp
// spend ~250 instructions a vector on them. For float this computes
// 2^(e·log2 d) with short polynomials instead: log via atanh series on the
// mantissa in [1/√2, √2) (|s| <= 0.172, 5 terms, ~1e-9), 2^f via Taylor
// around the nearest integer (|f| <= 1/2, 8 terms, ~1e-7 in float); relative
// error a few float ulps times e.
// Denormal d are flushed to the smallest normal and results below 2^-126 to
// zero (they are below any probability that matters, and denormal arithmetic
// is slow). Written with at::vec operations only, so one source serves every
// vector width (8 lanes on AVX2, 16 on AVX-512) and the DEFAULT copy.
template <typename acc_t>
inline Vec<acc_t> pow_unit(const Vec<acc_t>& d, acc_t e) {
  return (d.log() * Vec<acc_t>(e)).exp();
}

// Smallest b = α - 1 for which pow_unit's error (a few ulps times 1/b) stays
// near float32 resolution; below it the exact log1p/exp path is used.
template <typename acc_t>
constexpr acc_t kFastPowMinB = acc_t(1.0 / 32);

#if ATTNKERN_HAS(AVX512)
// AVX-512: log2 d = k + log2 m with getexp's k and getmant's m in [1, 2);
// the top four bits of m's fraction pick r ≈ 1/m from a table (r = 1 for m
// in [1, 17/16), so that log2 1 is 0 exactly; else the reciprocal of the
// interval's midpoint), and log2 m = log2(1 + u) - log2 r with u = m·r - 1,
// |u| <= 1/16, by a degree-5 polynomial (fitted: error 7e-11). k is added
// last, so that the one rounding of a large |log2 d| is the only large one.
// Then 2^z, z = e·log2 d: f = z - floor(z) by vreduceps, a degree-6
// polynomial of f (fitted, p(0) = 1: relative error 2e-9) and vscalefps,
// which multiplies by 2^floor(z) itself. 22 operations a vector where the
// atanh series and Taylor's polynomial took 32; the largest relative error
// against double pow, on 2^22 inputs at exponents 0.3 to 32, is the same
// or lower (it is the rounding of log2 d for small d, times e).
// pow_unit_masked is the body: d^e on the lanes of `keep`, zero on the
// others, whose d may be anything (callers that mask d <= 0 skip pow_unit's
// clamp). Results below 2^-126 are zero, as in the portable form.
alignas(64) inline constexpr float kPowRecip[16] = {
    1.f,          0.914285719f, 0.864864886f, 0.820512831f, 0.780487776f, 0.744186044f, 0.711111128f, 0.680851042f,
    0.653061211f, 0.627451003f, 0.603773594f, 0.581818163f, 0.561403513f, 0.542372882f, 0.524590135f, 0.507936537f};
// -log2 of kPowRecip's (float) entries, rounded to float.
alignas(64) inline constexpr float kPowLog2[16] = {
    0.f,          0.129283011f, 0.209453329f, 0.285402209f, 0.357552052f, 0.426264763f, 0.491853058f, 0.554588914f,
    0.614709854f, 0.67242527f,  0.727920413f, 0.781359732f, 0.832889974f, 0.882643044f, 0.930737436f, 0.977279842f};

__attribute__((always_inline)) inline __m512 pow_unit_masked(__m512 d, float e, __mmask16 keep) {
  const __m512 m = _mm512_getmant_ps(d, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __m512 k = _mm512_getexp_ps(d);
  const __m512i row = _mm512_srli_epi32(_mm512_castps_si512(m), 19);  // (permutexvar reads its low 4 bits)
  const __m512 r = _mm512_permutexvar_ps(row, _mm512_load_ps(kPowRecip));
  const __m512 u = _mm512_fmsub_ps(m, r, _mm512_set1_ps(1.0f));
  __m512 q = _mm512_fmadd_ps(u, _mm512_set1_ps(0.26670614f), _mm512_set1_ps(-0.36048585f));
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(0.48092213f));
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(-0.72134781f));
  q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(1.44269502f));
  const __m512 l2 = _mm512_add_ps(k, _mm512_fmadd_ps(u, q, _mm512_permutexvar_ps(row, _mm512_load_ps(kPowLog2))));
  const __m512 z = _mm512_mul_ps(l2, _mm512_set1_ps(e));
  const __m512 f = _mm512_reduce_ps(z, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // z - floor(z)
  __m512 t = _mm512_fmadd_ps(f, _mm512_set1_ps(2.1613044e-4f), _mm512_set1_ps(1.2467812e-3f));
  t = _mm512_fmadd_ps(t, f, _mm512_set1_ps(9.6754553e-3f));
  t = _mm512_fmadd_ps(t, f, _mm512_set1_ps(5.5485278e-2f));
  t = _mm512_fmadd_ps(t, f, _mm512_set1_ps(2.4022931e-1f));
  t = _mm512_fmadd_ps(t, f, _mm512_set1_ps(6.9314706e-1f));
  t = _mm512_fmadd_ps(t, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep & _mm512_cmp_ps_mask(z, _mm512_set1_ps(-126.0f), _CMP_GE_OQ), t, z);
}

template <>
__attribute__((always_inline)) inline Vec<float> pow_unit<float>(const Vec<float>& dv, float e) {
  return Vec<float>(pow_unit_masked(_mm512_max_ps(__m512(dv), _mm512_set1_ps(1.17549435e-38f)), e, 0xffff));
}
#else
template <>
__attribute__((always_inline)) inline Vec<float> pow_unit<float>(const Vec<float>& dv, float e) {
  using VF = Vec<float>;
  using VI = at::vec::Vectorized<int32_t>;
  const VF one(1.0f);
  const VF d = at::vec::maximum(dv, VF(1.17549435e-38f));
  const VI bits = at::vec::cast<int32_t>(d);
  const VI ex = (bits >> VI(23)) - VI(127);  // d > 0: the sign bit is clear
  VF m = at::vec::cast<float>((bits & VI(0x007fffff)) | VI(0x3f800000));
  // m in [1, 2): fold to [1/√2, √2).
  const VF big = m > VF(1.41421356f);
  m = VF::blendv(m, m * VF(0.5f), big);
  const VF exf = at::vec::convert_to_fp_of_same_size<float>(ex) + (big & one);
  const VF sv = (m - one) * recip<float>(m + one);
  const VF s2 = sv * sv;
  VF q = at::vec::fmadd(s2, VF(1.0f / 9), VF(1.0f / 7));
  q = at::vec::fmadd(q, s2, VF(1.0f / 5));
  q = at::vec::fmadd(q, s2, VF(1.0f / 3));
  q = at::vec::fmadd(q, s2, one);
  // log2 d = ex + 2 s q / ln 2
  const VF l2 = at::vec::fmadd(sv * q, VF(2.88539008f), exf);
  VF z = l2 * VF(e);
  const VF tiny = z < VF(-126.0f);
  z = at::vec::maximum(z, VF(-126.0f));
  const VF n = z.round();
  const VF f = z - n;  // in [-1/2, 1/2]
  // 2^f = e^(f ln 2) by its Taylor series (coefficients (ln 2)^k / k!).
  VF r = at::vec::fmadd(f, VF(1.5252734e-05f), VF(1.5403530e-04f));
  r = at::vec::fmadd(r, f, VF(1.3333558e-03f));
  r = at::vec::fmadd(r, f, VF(9.6181291e-03f));
  r = at::vec::fmadd(r, f, VF(5.5504109e-02f));
  r = at::vec::fmadd(r, f, VF(2.4022651e-01f));
  r = at::vec::fmadd(r, f, VF(6.9314718e-01f));
  r = at::vec::fmadd(r, f, one);
  // n is an integer in [-126, 0]: 2^n from its exponent bits.
  const VF scale = at::vec::cast<float>((at::vec::convert_to_int_of_same_size<float>(n) + VI(127)) << VI(23));
  return VF::blendv(r * scale, VF(0.0f), tiny);
}
#endif

// Asks for the cache lines of bytes [p, p + bytes), to read (write = false)
// or to write; no fault, no wait.
inline void prefetch_span(const char* p, int64_t bytes, bool write) {
  if (write) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 1, 3);
  } else {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
  }
}

// The cache lines of a span (null: none) asked for a piece at a time
// (step; rest: what is left), spread over work that does not touch memory.
// Issued in one burst, a span of a few kilobytes fills the core's queue of
// outstanding misses and the core waits on its own prefetches
// (normalize_generic_pair's next pair of rows).
class SpreadPrefetch {
 public:
  SpreadPrefetch(const void* p, int64_t bytes, int pieces, bool write)
      : p_(static_cast<const char*>(p)),
        end_(p ? bytes : 0),
        piece_(std::max<int64_t>(64, (bytes / pieces + 63) / 64 * 64)),
        write_(write) {}
  void step() { ask(piece_); }
  void rest() { ask(end_ - off_); }

 private:
  void ask(int64_t len) {
    len = std::min(len, end_ - off_);
    if (len <= 0) return;
    prefetch_span(p_ + off_, len, write_);
    off_ += len;
  }

  const char* p_;
  int64_t end_, piece_, off_ = 0;
  bool write_;
};

// The max of m and y[j:n), entry by entry (NaN if any is NaN).
template <typename acc_t>
inline acc_t max_from(const acc_t* y, int64_t j, int64_t n, acc_t m) {
  for (; j < n; ++j) {
    const acc_t v = y[j];
    m = (v > m || v != v) ? v : m;
  }
  return m;
}

// The end of row_max's four running maxima v0..v3, fed y[0:j) a block of
// four vectors at a time: the whole vectors of y[j:n) join v0, lanes (if
// given) takes the four, and the max of them and of the scalar tail is returned.
template <typename acc_t>
inline acc_t finish_row_max(const acc_t* y, int64_t j, int64_t n, Vec<acc_t> v0, const Vec<acc_t>& v1,
                            const Vec<acc_t>& v2, const Vec<acc_t>& v3, acc_t* lanes) {
  using V = Vec<acc_t>;
  for (; j + V::size() <= n; j += V::size()) v0 = at::vec::maximum(v0, V::loadu(y + j));
  if (lanes) {
    v0.store(lanes);
    v1.store(lanes + V::size());
    v2.store(lanes + 2 * V::size());
    v3.store(lanes + 3 * V::size());
  }
  const acc_t m = at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); },
                                                 at::vec::maximum(at::vec::maximum(v0, v1), at::vec::maximum(v2, v3)));
  return max_from(y, j, n, m);
}

// The max of y[0:n] (NaN if any entry is NaN). With lanes given and
// n >= 4 · V::size(), also the 4 · V::size() running maxima it reduces:
// position j counts in lane j mod 4 · V::size() (the scalar tail in none),
// so they are the maxima of disjoint sets, i.e. distinct entries of y.
template <typename acc_t, typename Load>
inline acc_t row_max_by_blocks(const acc_t* y, int64_t n, acc_t* lanes, Load load);

template <typename acc_t>
inline acc_t row_max(const acc_t* y, int64_t n, acc_t* lanes = nullptr) {
  using V = Vec<acc_t>;
  if (n >= 4 * V::size()) return row_max_by_blocks(y, n, lanes, [&](int64_t j) { return V::loadu(y + j); });
  int64_t j = 0;
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  if (n >= V::size()) {
    V v0 = V::loadu(y);
    for (j = V::size(); j + V::size() <= n; j += V::size()) v0 = at::vec::maximum(v0, V::loadu(y + j));
    m = at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); }, v0);
  }
  return max_from(y, j, n, m);
}

// row_max for n >= 4 · V::size(), with load(j) the vector at y + j (which
// may also write it: scale_row_max). Four running maxima: at::vec::maximum
// propagates NaN (a compare and a blend after the max), a chain too long for
// one accumulator. At AVX-512 float the maxima are plain vmaxps and a NaN is
// remembered in a mask instead (at::vec's form puts two of its four
// operations a vector on the shuffle port).
template <typename acc_t, typename Load>
inline acc_t row_max_by_blocks(const acc_t* y, int64_t n, acc_t* lanes, Load load) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  V v0 = load(0), v1 = load(W), v2 = load(2 * W), v3 = load(3 * W);
  int64_t j = 4 * W;
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    auto unordered = [](const V& v) { return _mm512_cmp_ps_mask(__m512(v), __m512(v), _CMP_UNORD_Q); };
    __mmask16 nan = unordered(v0) | unordered(v1) | unordered(v2) | unordered(v3);
    __m512 a0 = v0, a1 = v1, a2 = v2, a3 = v3;
    for (; j + 4 * W <= n; j += 4 * W) {
      const V w0 = load(j), w1 = load(j + W), w2 = load(j + 2 * W), w3 = load(j + 3 * W);
      nan |= unordered(w0) | unordered(w1) | unordered(w2) | unordered(w3);
      a0 = _mm512_max_ps(a0, w0), a1 = _mm512_max_ps(a1, w1);
      a2 = _mm512_max_ps(a2, w2), a3 = _mm512_max_ps(a3, w3);
    }
    const float m = finish_row_max(y, j, n, V(a0), V(a1), V(a2), V(a3), lanes);
    return nan ? std::numeric_limits<float>::quiet_NaN() : m;
  }
#endif
  for (; j + 4 * W <= n; j += 4 * W) {
    v0 = at::vec::maximum(v0, load(j));
    v1 = at::vec::maximum(v1, load(j + W));
    v2 = at::vec::maximum(v2, load(j + 2 * W));
    v3 = at::vec::maximum(v3, load(j + 3 * W));
  }
  return finish_row_max(y, j, n, v0, v1, v2, v3, lanes);
}

// The max of scale · y[0:n] (scale > 0) without scaling y: row_max's, and
// its lanes, scaled (exactly those of the scaled row).
template <typename acc_t>
inline acc_t scaled_max_of(const acc_t* y, int64_t n, acc_t scale, acc_t* lanes = nullptr) {
  const acc_t m = row_max(y, n, lanes) * scale;
  if (lanes && n >= 4 * Vec<acc_t>::size())
    for (int64_t i = 0; i < 4 * Vec<acc_t>::size(); ++i) lanes[i] *= scale;
  return m;
}

// Rows [r0, r1) of y (n values, row stride ld) times scale, in place.
template <typename acc_t>
inline void scale_rows_in_place(acc_t* y, int64_t r0, int64_t r1, int64_t n, int64_t ld, acc_t scale) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < n; ++j) y[r * ld + j] *= scale;
}

// row_max of y[0:n] scaled in place by `scale` first, in the same pass (the
// scores of a half-type GEMM, which takes no factor, would otherwise be read
// and written once more for it): the same values and lanes as scaling, then
// row_max.
template <typename acc_t>
inline acc_t scale_row_max(acc_t* y, int64_t n, acc_t scale, acc_t* lanes = nullptr) {
  using V = Vec<acc_t>;
  if (n < 4 * V::size()) {
    for (int64_t j = 0; j < n; ++j) y[j] *= scale;
    return row_max(y, n, lanes);
  }
  const V vs(scale);
  // (Entries past the last whole block are scaled here; finish_row_max reads them.)
  for (int64_t t = n - n % (4 * V::size()); t < n; ++t) y[t] *= scale;
  return row_max_by_blocks(y, n, lanes, [&](int64_t j) {
    const V v = V::loadu(y + j) * vs;
    v.store(y + j);
    return v;
  });
}

// 2^t, exactly 0 for t = -inf, 1 for t = 0, NaN for NaN: the exponentials
// of the half-type softmax attention, taken in base 2 so that the scale,
// log2(e) and the shift fold into one fma before it. At AVX512: f = t -
// floor(t) in [0, 1) by vreduceps (0 for infinities), a degree-4 polynomial
// p(f) ≈ 2^f with p(0) = 1 (fitted for the least relative error, 3.0e-6 in
// float32, exp_u20's 20 ulp; P is rounded to 8 bits after it), and
// vscalefps, which multiplies by 2^floor(t) itself: 7 operations where
// exp_u20 takes about 20; elsewhere exp_u20.
inline Vec<float> exp2_fast(const Vec<float>& t) {
#if ATTNKERN_HAS(AVX512)
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.342679e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.224231e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4128028e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304484e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, t);
#else
  return (t * Vec<float>(0.69314718055994531f)).exp_u20();
#endif
}

// dst[0:n] = src[0:n] converted (rounded to nearest even when narrowing):
// whole vectors for float <-> bfloat16 / half, a scalar loop otherwise.
template <typename src_t, typename dst_t>
inline void convert_row(const src_t* src, dst_t* dst, int64_t n) {
  int64_t j = 0;
  if constexpr (std::is_same_v<src_t, float> && at::is_reduced_floating_point_v<dst_t>) {
    using V = Vec<float>;
    for (; j + 2 * V::size() <= n; j += 2 * V::size())
      at::vec::convert_from_float<dst_t>(V::loadu(src + j), V::loadu(src + j + V::size())).store(dst + j);
  } else if constexpr (at::is_reduced_floating_point_v<src_t> && std::is_same_v<dst_t, float>) {
    using Vs = at::vec::Vectorized<src_t>;
    for (; j + Vs::size() <= n; j += Vs::size()) {
      auto [lo, hi] = at::vec::convert_to_float<src_t>(Vs::loadu(src + j));
      lo.store(dst + j);
      hi.store(dst + j + Vec<float>::size());
    }
  }
  for (; j < n; ++j) dst[j] = static_cast<dst_t>(src[j]);
}

// row_max for a bfloat16 / half row: widens src[0:n] into dst[0:n] (float,
// exact) and returns row_max(dst, n, lanes), with the same lanes, in the
// same pass. Widening first and taking the max after would read the row
// twice, and a widening pass of its own is costly (its stores, two vectors
// a load).
template <typename scalar_t>
inline float widen_row_max(const scalar_t* src, int64_t n, float* dst, float* lanes = nullptr) {
  static_assert(at::is_reduced_floating_point_v<scalar_t>, "bfloat16 / half rows");
  using V = Vec<float>;
  using Vs = at::vec::Vectorized<scalar_t>;
  constexpr int64_t W = V::size();
  static_assert(Vs::size() == 2 * W, "a reduced vector widens to two float vectors");
  if (n < 4 * W) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return row_max(dst, n, lanes);
  }
  // row_max's four running maxima (position j in lane j mod 4W), fed as widened.
  auto block = [&](int64_t at, V& a, V& b, V& c, V& d) {
    auto [a0, a1] = at::vec::convert_to_float<scalar_t>(Vs::loadu(src + at));
    auto [b0, b1] = at::vec::convert_to_float<scalar_t>(Vs::loadu(src + at + 2 * W));
    a0.store(dst + at);
    a1.store(dst + at + W);
    b0.store(dst + at + 2 * W);
    b1.store(dst + at + 3 * W);
    a = a0, b = a1, c = b0, d = b1;
  };
  V v0, v1, v2, v3, w0, w1, w2, w3;
  block(0, v0, v1, v2, v3);
  int64_t j = 4 * W;
  for (; j + 4 * W <= n; j += 4 * W) {
    block(j, w0, w1, w2, w3);
    v0 = at::vec::maximum(v0, w0);
    v1 = at::vec::maximum(v1, w1);
    v2 = at::vec::maximum(v2, w2);
    v3 = at::vec::maximum(v3, w3);
  }
  // The rest (under 4W entries) widened, then folded in as row_max does.
  for (int64_t i = j; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  return finish_row_max(dst, j, n, v0, v1, v2, v3, lanes);
}

// dst = src - m.
template <typename acc_t>
inline void subtract_into(const acc_t* src, int64_t n, acc_t m, acc_t* dst) {
  using V = Vec<acc_t>;
  const V vm(m);
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) (V::loadu(src + j) - vm).store(dst + j);
  for (; j < n; ++j) dst[j] = src[j] - m;
}

// Σ φ(y - c), Σ g and Σ g/d over y[0:n] for the family FAM (b = α - 1);
// g = p/d = -∂p/∂c and g/d = ∂²p/∂c² / (1 - b) feed Newton and Halley steps.

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

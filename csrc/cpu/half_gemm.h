// bfloat16 GEMMs of the fused attention (the forward, and the softmax
// backward's: see attention_softmax.cpp): bfloat16 products summed
// in float32, as PyTorch's SDPA computes them, through oneDNN's brgemm
// micro-kernels (at::native::cpublas::brgemm), which run them as AVX512-BF16
// dot products or on AMX tiles, whichever the CPU has.
//
// The B operand of a brgemm is in oneDNN's VNNI layout: the rows of B (the
// reduction dim) in pairs, each pair stored interleaved, [K/2][N][2], at most
// 64 columns to a block (oneDNN's packed kernels take leading dims 16..64).
// K is packed once per head into blocks of 64 keys for Q·Kᵀ, V once per head
// into column blocks over all keys for P·V; P is rounded to bfloat16 once per
// tile for its product with V (as SDPA does); the scores, thresholds and sums
// stay in float32.
//
// Only the AVX512 copy uses this, on CPUs with AVX512-BF16 or AMX-BF16 (on
// the others oneDNN's bfloat16 kernels emulate the dot products and the
// float32 path is faster); ATTNKERN_BF16_GEMM=0 turns it off, and
// torch.backends.mkldnn's flag (oneDNN off) does too.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && !defined(_MSC_VER)
#include <immintrin.h>
#endif

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace attn {

using bf16 = c10::BFloat16;

// Keys per packed block of K; columns per packed block of V.
constexpr int64_t kVnniBlock = 64;

inline int64_t round_up_vnni(int64_t n) { return (n + kVnniBlock - 1) / kVnniBlock * kVnniBlock; }

namespace detail {

// Whether oneDNN's bfloat16 brgemm runs here with B in the layout packed
// below and gives exact products: small integer products (exact in float32)
// in two shapes, one with N below the leading dim and an odd number of row
// pairs, as the attention's last blocks have. A CPU whose kernels expected
// another layout would fail this and keep the float32 GEMMs.
inline bool brgemm_probe_shape(int64_t M, int64_t N, int64_t K, int64_t ldb) {
  std::vector<bf16> a(M * K), b(K * ldb);
  std::vector<float> c(M * ldb, -1.f), want(M * ldb, -1.f);
  auto bval = [](int64_t k, int64_t n) { return static_cast<float>((k * 5 + n * 3) % 7 - 3); };
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>(i % 5 - 2);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < ldb; ++n) b[(k / 2) * ldb * 2 + n * 2 + k % 2] = bval(k, n);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<float>(a[i * K + k]) * bval(k, n);
      want[i * ldb + n] = s;
    }
  try {
    at::native::cpublas::brgemm(M, N, K, K, ldb, ldb, false, a.data(), b.data(), c.data(), true);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    return false;
  }
  return std::memcmp(c.data(), want.data(), c.size() * sizeof(float)) == 0;
}

inline bool brgemm_probe() { return brgemm_probe_shape(3, 16, 4, 16) && brgemm_probe_shape(7, 48, 34, 64); }

inline bool bf16_hardware() {
#if defined(CPU_CAPABILITY_AVX512) && defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__GNUC__) && \
    (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16") && !__builtin_cpu_supports("amx-bf16")) return false;
  return brgemm_probe();
#else
  return false;
#endif
}

}  // namespace detail

// Whether the GEMMs of bfloat16 attention run in bfloat16 here.
inline bool bf16_gemm_enabled() {
  static const bool hardware = detail::bf16_hardware();
  if (!hardware || !at::globalContext().userEnabledMkldnn()) return false;
  const char* s = std::getenv("ATTNKERN_BF16_GEMM");
  return s == nullptr || std::strcmp(s, "0") != 0;
}

// K of one head (S rows of E values, row stride ld; E even) as blocks of 64
// keys in VNNI layout, zero keys past S: block t is the B operand (E x 64) of
// the scores against keys [64t, 64t + 64), dst[t·64·E + (e/2)·128 + jj·2 + e%2]
// = K[64t + jj, e]. dst has round_up_vnni(S) · E entries.
inline void pack_keys_vnni(const bf16* src, int64_t S, int64_t E, int64_t ld, bf16* dst) {
  const int64_t Sk = round_up_vnni(S);
  for (int64_t t = 0; t < Sk / kVnniBlock; ++t) {
    bf16* blk = dst + t * kVnniBlock * E;
    for (int64_t jj = 0; jj < kVnniBlock; ++jj) {
      const int64_t j = t * kVnniBlock + jj;
      for (int64_t e = 0; e < E; ++e) blk[(e / 2) * 2 * kVnniBlock + jj * 2 + e % 2] = j < S ? src[j * ld + e] : bf16(0.f);
    }
  }
}

// V of one head (S rows of Ev values, row stride ld; Ev a multiple of 16) as
// column blocks of up to 64 values, each over all keys in VNNI layout, zero
// keys past S: block u (width bw) holds dst[u·64·Sk + (j/2)·2·bw + c·2 + j%2] =
// V[j, 64u + c], Sk = round_up_vnni(S). Keys [j0, j0 + w) of block u (j0
// even) are the B operand at dst + u·64·Sk + j0·bw, leading dim bw.
inline void pack_values_vnni(const bf16* src, int64_t S, int64_t Ev, int64_t ld, bf16* dst) {
  const int64_t Sk = round_up_vnni(S);
  for (int64_t u = 0; u * kVnniBlock < Ev; ++u) {
    const int64_t c0 = u * kVnniBlock, bw = std::min(kVnniBlock, Ev - c0);
    bf16* blk = dst + c0 * Sk;
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t c = 0; c < bw; ++c) blk[(j / 2) * 2 * bw + c * 2 + j % 2] = j < S ? src[j * ld + c0 + c] : bf16(0.f);
  }
}

// y (m x w, row stride ldy) = q (m x E, row stride E) · Kᵀ over keys
// [j0, j0 + w), j0 a multiple of 64, from the head's packed keys. Columns
// [w, round_up(w, 16)) are written too (products with zero keys) when ldy
// has room for them; otherwise the last block goes through a scratch.
inline void scores_bf16(int64_t m, int64_t w, int64_t j0, int64_t E, const bf16* q, const bf16* kpack, float* y,
                        int64_t ldy) {
  for (int64_t jb = 0; jb < w; jb += kVnniBlock) {
    const int64_t rest = std::min(kVnniBlock, w - jb), nb = (rest + 15) / 16 * 16;
    const bf16* b = kpack + (j0 + jb) * E;
    if (jb + nb <= ldy) {
      at::native::cpublas::brgemm(m, nb, E, E, kVnniBlock, ldy, false, q, b, y + jb, true);
    } else {
      thread_local std::vector<float> tail;
      tail.resize(m * nb);
      at::native::cpublas::brgemm(m, nb, E, E, kVnniBlock, nb, false, q, b, tail.data(), true);
      for (int64_t r = 0; r < m; ++r) std::copy_n(tail.data() + r * nb, rest, y + r * ldy + jb);
    }
  }
}

// The rows of y (m x w floats, row stride ldy) rounded to bfloat16 into dst
// (m x wk, wk = w rounded up to even; the odd column's pad is 0).
inline void rows_to_bf16(const float* y, int64_t m, int64_t w, int64_t ldy, bf16* dst, int64_t wk) {
  using Vf = at::vec::Vectorized<float>;
  using Vh = at::vec::Vectorized<bf16>;
  for (int64_t r = 0; r < m; ++r) {
    const float* src = y + r * ldy;
    bf16* out = dst + r * wk;
    int64_t j = 0;
    for (; j + Vh::size() <= w; j += Vh::size())
      at::vec::convert_from_float<bf16>(Vf::loadu(src + j), Vf::loadu(src + j + Vf::size())).store(out + j);
    for (; j < w; ++j) out[j] = src[j];
    if (wk > w) out[w] = bf16(0.f);
  }
}

// o (m x Ev, row stride Ev; Ev a multiple of 16) = P · V[j0:j0 + w], or +=
// with `accumulate`, for P (m x w floats, row stride ldy) rounded to
// bfloat16, j0 even; vpack: the head's packed values (pack_values_vnni).
inline void pv_bf16(int64_t m, int64_t w, int64_t j0, const float* y, int64_t ldy, const bf16* vpack, int64_t S,
                    int64_t Ev, float* o, bool accumulate) {
  const int64_t wk = w + (w & 1), Sk = round_up_vnni(S);
  thread_local std::vector<bf16> ph;
  ph.resize(m * wk);
  rows_to_bf16(y, m, w, ldy, ph.data(), wk);
  for (int64_t c0 = 0; c0 < Ev; c0 += kVnniBlock) {
    const int64_t bw = std::min(kVnniBlock, Ev - c0);
    at::native::cpublas::brgemm(m, bw, wk, wk, bw, Ev, accumulate, ph.data(), vpack + c0 * Sk + j0 * bw, o + c0,
                                true);
  }
}

// x (m x d bfloat16, row stride ld) transposed into dst (d x mk, mk = m
// rounded up to even; the pad column is 0): the A operand of a product that
// sums over the m rows.
inline void transpose_bf16(const bf16* x, int64_t m, int64_t d, int64_t ld, bf16* dst, int64_t mk) {
  for (int64_t e = 0; e < d; ++e) {
    bf16* row = dst + e * mk;
    for (int64_t i = 0; i < m; ++i) row[i] = x[i * ld + e];
    if (mk > m) row[m] = bf16(0.f);
  }
}

// The bits of x rounded to bfloat16 (to nearest even; NaN stays NaN), in the
// low half of each 32-bit lane.
#if defined(CPU_CAPABILITY_AVX512)
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
}
#endif

// y (m x w floats, row stride ldy) rounded to bfloat16 as the B operand of a
// product that sums over its m rows (VNNI layout over rows), in blocks of 64
// columns: block u (width bw = min(64, round_up(w - 64u, 16))) at
// dst + u·64·mk holds [mk/2][bw][2] (mk = m rounded up to even); zero past
// row m and column w.
inline void pack_rows_vnni(const float* y, int64_t m, int64_t w, int64_t ldy, bf16* dst) {
  const int64_t mk = m + (m & 1);
  for (int64_t c0 = 0; c0 < w; c0 += kVnniBlock) {
    const int64_t rest = std::min(kVnniBlock, w - c0), bw = (rest + 15) / 16 * 16;
    bf16* blk = dst + c0 * mk;
    for (int64_t i = 0; i < mk; i += 2) {
      const float* a = y + i * ldy + c0;
      const float* b = i + 1 < m ? a + ldy : nullptr;
      bf16* out = blk + i * bw;
      int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
      for (; c + 16 <= rest; c += 16) {
        const __m512i lo = bf16_bits(_mm512_loadu_ps(a + c));
        const __m512i hi = b ? bf16_bits(_mm512_loadu_ps(b + c)) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 2 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
#endif
      for (; c < bw; ++c) {
        out[2 * c] = c < rest ? bf16(a[c]) : bf16(0.f);
        out[2 * c + 1] = c < rest && b ? bf16(b[c]) : bf16(0.f);
      }
    }
  }
}

// Cᵀ (d x w, row stride ldc) += Aᵀ · Y for Aᵀ (d x mk bfloat16: a block of m
// rows transposed, transpose_bf16) and Y (m x w, packed by pack_rows_vnni):
// the key-side gradients dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS of a tile, with the
// accumulators transposed (keys along the rows of C). Columns up to
// round_up(w, 16) are added to (zeros past w).
inline void rows_product_bf16(int64_t d, int64_t m, int64_t w, const bf16* at_, const bf16* ypack, float* ct,
                              int64_t ldc) {
  const int64_t mk = m + (m & 1);
  for (int64_t c0 = 0; c0 < w; c0 += kVnniBlock) {
    const int64_t bw = (std::min(kVnniBlock, w - c0) + 15) / 16 * 16;
    at::native::cpublas::brgemm(d, bw, mk, mk, bw, ldc, true, at_, ypack + c0 * mk, ct + c0, true);
  }
}

// Releases the brgemm hardware state (AMX tile configuration) of the calling
// thread at the end of a scope that used the bfloat16 GEMMs.
struct Bf16GemmScope {
  bool used;
  explicit Bf16GemmScope(bool u) : used(u) {}
  ~Bf16GemmScope() {
    if (used) at::native::cpublas::brgemm_release(true);
  }
  Bf16GemmScope(const Bf16GemmScope&) = delete;
  Bf16GemmScope& operator=(const Bf16GemmScope&) = delete;
};

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

// Half-type GEMMs of the fused attention (the forward, and the softmax
// backward's: see attention_softmax.cpp) for bfloat16 and float16 inputs:
// half-type products summed in float32, as PyTorch's SDPA computes them,
// through oneDNN's brgemm micro-kernels (at::native::cpublas::brgemm), which
// run bfloat16 as AVX512-BF16 dot products or on AMX tiles, and float16 with
// AVX512-FP16 or on AMX-FP16 tiles, whichever the CPU has.
//
// The B operand of a brgemm is in the layout oneDNN's kernel for the type
// and CPU expects: the VNNI layout, the rows of B (the reduction dim) in
// pairs, each pair stored interleaved, [K/2][N][2] (bfloat16 everywhere,
// float16 on AMX-FP16), or plain rows, [K][N] (float16 with AVX512-FP16 but
// no AMX-FP16, whose kernels widen each value to float32); at most 64
// columns to a block (oneDNN's packed kernels take leading dims 16..64).
// K is packed once per head into blocks of 64 keys for Q·Kᵀ, V once per head
// into column blocks over all keys for P·V; P is rounded to the half type
// once per tile for its product with V (as SDPA does); the scores,
// thresholds and sums stay in float32.
//
// The operands are held as raw 16-bit patterns (h16): packing and
// transposing move bits, and only the rounding from float32 and the brgemm
// call depend on the type (HalfGemm::fp16); the packers place them by
// HalfGemm::vnni.
//
// Only the AVX512 copy uses this, on CPUs with AVX512-BF16 or AMX-BF16 for
// bfloat16 (on the others oneDNN emulates the bfloat16 dot products, slower
// than the float32 path) and AMX-FP16 for float16 (AVX512-FP16 alone buys
// nothing over float32: see half_hardware); ATTNKERN_BF16_GEMM=0 /
// ATTNKERN_FP16_GEMM=0 turn them off, and torch.backends.mkldnn's flag
// (oneDNN off) does too. half_gemm_enabled names the unit, or why float32.
// ATTNKERN_HALF_GEMM_EMULATE=1 (VNNI layout) or =plain (plain rows) runs the
// path at every level with the products summed by a plain loop instead of
// oneDNN (brgemm_emulated), so the tests check the packing, rounding and
// bookkeeping of both half types and both layouts on CPUs whose oneDNN
// cannot run them; it is slow and only for testing.
#pragma once

#include "attnkern/isa_features.h"

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#if ATTNKERN_HAS(AVX512) && ATTNKERN_HAS(GNU_EXTENSIONS)
#include <immintrin.h>
#endif
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#endif

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace attn {

// A bfloat16 or float16 value's bits.
using h16 = uint16_t;

// How the half-type GEMMs of one call run.
struct HalfGemm {
  bool fp16 = false;      // float16 operands (else bfloat16)
  bool vnni = true;       // B operands in VNNI layout (else plain rows)
  bool emulated = false;  // brgemm_emulated instead of oneDNN
};

// Where B[k][n] of a B operand with leading dim ldb is in either layout.
inline int64_t b_at(bool vnni, int64_t k, int64_t n, int64_t ldb) {
  return vnni ? (k / 2) * 2 * ldb + 2 * n + (k & 1) : k * ldb + n;
}

// Keys per packed block of K; columns per packed block of V.
constexpr int64_t kVnniBlock = 64;

inline int64_t round_up_vnni(int64_t n) { return (n + kVnniBlock - 1) / kVnniBlock * kVnniBlock; }

// The reduction dim of every brgemm here is a multiple of 32, zero-padded,
// so that no AMX tile is loaded with a K tail: oneDNN issue 5717 reports
// bfloat16 NaNs leaking into unrelated rows when K is not a multiple of 32.
constexpr int64_t kHalfK = 32;

inline int64_t round_up_k(int64_t n) { return (n + kHalfK - 1) / kHalfK * kHalfK; }

// Scalar conversions, to nearest even (c10's portable bit arithmetic: no
// instructions of the copy's level in them).
inline float half_to_float(h16 b, bool fp16) {
  return fp16 ? c10::detail::fp16_ieee_to_fp32_value(b)
              : static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
}

inline h16 float_to_half(float x, bool fp16) {
  return fp16 ? c10::detail::fp16_ieee_from_fp32_value(x) : c10::BFloat16(x).x;
}

namespace detail {

// C (M x N, row stride ldc) = A (M x K, row stride lda) · B, or += with
// add_C, B[k][n] at b_at(vnni, k, n, ldb) (K even), the products summed in
// float32 in order of k: what oneDNN's brgemm computes, up to the order of
// the sums.
inline void brgemm_emulated(const HalfGemm& g, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                            int64_t ldc, bool add_C, const h16* A, const h16* B, float* C) {
  // (Not std::vector: its out-of-line members are shared by every copy, and
  // the linker would keep one level's.)
  std::unique_ptr<float[]> a(new float[K]), acc(new float[N]);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; ++k) a[k] = half_to_float(A[i * lda + k], g.fp16);
    for (int64_t n = 0; n < N; ++n) acc[n] = 0.f;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) acc[n] += a[k] * half_to_float(B[b_at(g.vnni, k, n, ldb)], g.fp16);
    float* c = C + i * ldc;
    for (int64_t n = 0; n < N; ++n) c[n] = add_C ? c[n] + acc[n] : acc[n];
  }
}

}  // namespace detail

// One brgemm of the half type g names (detail::brgemm_emulated's contract).
// (cpublas::brgemm's is_vnni = true asks for oneDNN's kernel, false for a
// slow generic fallback; B must be in the layout that kernel takes, which
// the probe found: VNNI pairs, or plain rows for float16 on AVX512-FP16.)
inline void brgemm16(const HalfGemm& g, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                     bool add_C, const h16* A, const h16* B, float* C) {
  if (g.emulated) {
    detail::brgemm_emulated(g, M, N, K, lda, ldb, ldc, add_C, A, B, C);
  } else if (g.fp16) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, reinterpret_cast<const c10::Half*>(A),
                                reinterpret_cast<const c10::Half*>(B), C, true);
  } else {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, reinterpret_cast<const c10::BFloat16*>(A),
                                reinterpret_cast<const c10::BFloat16*>(B), C, true);
  }
}

namespace detail {

// Whether oneDNN's brgemm of the half type runs here with B in g's layout
// and gives exact products: small integer products (exact in float32) in two
// shapes, one with N below the leading dim and an odd number of row pairs,
// as the attention's last blocks have. A kernel that expects the other
// layout fails this.
inline bool brgemm_probe_shape(const HalfGemm& g, int64_t M, int64_t N, int64_t K, int64_t ldb) {
  const bool fp16 = g.fp16;
  std::vector<h16> a(M * K), b(K * ldb);
  std::vector<float> c(M * ldb, -1.f), want(M * ldb, -1.f);
  auto bval = [](int64_t k, int64_t n) { return static_cast<float>((k * 5 + n * 3) % 7 - 3); };
  for (int64_t i = 0; i < M * K; ++i) a[i] = float_to_half(static_cast<float>(i % 5 - 2), fp16);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < ldb; ++n) b[b_at(g.vnni, k, n, ldb)] = float_to_half(bval(k, n), fp16);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += half_to_float(a[i * K + k], fp16) * bval(k, n);
      want[i * ldb + n] = s;
    }
  try {
    brgemm16(g, M, N, K, K, ldb, ldb, false, a.data(), b.data(), c.data());
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    return false;
  }
  return std::memcmp(c.data(), want.data(), c.size() * sizeof(float)) == 0;
}

inline bool brgemm_probe(const HalfGemm& g) {
  return brgemm_probe_shape(g, 3, 16, 4, 16) && brgemm_probe_shape(g, 7, 48, 34, 64);
}

// Whether the CPU has AMX-FP16 tiles (CPUID leaf 7, sub-leaf 1, EAX bit 21).
inline bool cpu_has_amx_fp16() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 1, a, b, c, d);
  return (a >> 21) & 1u;
#else
  return false;
#endif
}

// How the half type's GEMMs can run here: oneDNN's kernels in the layout
// they pass the probe with (how), and the unit that runs them; or none, and
// why float32 GEMMs run instead.
struct HalfHardware {
  std::optional<HalfGemm> how;
  const char* unit;
};

inline HalfHardware half_hardware(bool fp16) {
#if ATTNKERN_HAS(AVX512) && defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32) && \
    defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  // AMX as oneDNN sees it (its ISA detection, ONEDNN_MAX_CPU_ISA included).
  const bool amx = at::native::cpublas::could_pack(at::kBFloat16);
  const char* unit;
  if (fp16) {
    // Without AMX-FP16, oneDNN's float16 kernels (AVX512-FP16) widen every
    // value to float32 and run no faster than the float32 GEMMs, which keep
    // the products exact.
    if (!amx || !cpu_has_amx_fp16()) return {std::nullopt, "float32: no float16 matrix unit (AMX-FP16)"};
    unit = "AMX-FP16";
  } else {
    if (!__builtin_cpu_supports("avx512bf16") && !__builtin_cpu_supports("amx-bf16"))
      return {std::nullopt, "float32: no bfloat16 dot products (AVX512-BF16 or AMX-BF16)"};
    unit = amx ? "AMX-BF16" : "AVX512-BF16";
  }
  for (bool vnni : {true, false})
    if (brgemm_probe(HalfGemm{fp16, vnni, false})) return {HalfGemm{fp16, vnni, false}, unit};
  return {std::nullopt, "float32: oneDNN's half-type kernel failed the start-up probe"};
#else
  (void)fp16;
  return {std::nullopt, "float32: no oneDNN half-type GEMMs at this instruction-set level"};
#endif
}

inline bool env_off(const char* name) {
  const char* s = std::getenv(name);
  return s != nullptr && std::strcmp(s, "0") == 0;
}

}  // namespace detail

// How the GEMMs of attention in dtype run now: in the half type (true, with
// *g set), or in float32 (false: not a half type, no unit for it, or turned
// off). *unit, when given, names the unit, or says why float32.
inline bool half_gemm_enabled(at::ScalarType dtype, HalfGemm* g = nullptr, const char** unit = nullptr) {
  const char* why = "float32: not a half type";
  auto say = [&](const char* u) {
    if (unit != nullptr) *unit = u;
  };
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return say(why), false;
  const bool fp16 = dtype == at::kHalf;
  if (detail::env_off(fp16 ? "ATTNKERN_FP16_GEMM" : "ATTNKERN_BF16_GEMM"))
    return say(fp16 ? "float32: turned off (ATTNKERN_FP16_GEMM=0)" : "float32: turned off (ATTNKERN_BF16_GEMM=0)"),
           false;
  const char* emulate = std::getenv("ATTNKERN_HALF_GEMM_EMULATE");
  const bool plain = emulate != nullptr && std::strcmp(emulate, "plain") == 0;
  HalfGemm how{fp16, !plain, plain || (emulate != nullptr && std::strcmp(emulate, "1") == 0)};
  if (how.emulated) {
    say(plain ? "emulated, plain rows (ATTNKERN_HALF_GEMM_EMULATE=plain)"
              : "emulated, VNNI layout (ATTNKERN_HALF_GEMM_EMULATE=1)");
  } else {
    static const detail::HalfHardware bf16_hw = detail::half_hardware(false);
    static const detail::HalfHardware fp16_hw = detail::half_hardware(true);
    const detail::HalfHardware& hw = fp16 ? fp16_hw : bf16_hw;
    if (!hw.how) return say(hw.unit), false;
    if (!at::globalContext().userEnabledMkldnn())
      return say("float32: oneDNN turned off (torch.backends.mkldnn.enabled = False)"), false;
    how = *hw.how;
    say(hw.unit);
  }
  if (g != nullptr) *g = how;
  return true;
}

#if ATTNKERN_HAS(AVX512)
// dst row i (16 words at byte stride dst_stride) = word i of each of the 16
// rows of src (byte stride src_stride): a 16 x 16 transpose of 32-bit words
// in registers (unpacks of words and pairs, then of 128-bit lanes).
inline void transpose_words16(const void* src, int64_t src_stride, void* dst, int64_t dst_stride) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(s + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(d + i * dst_stride, r[i]);
}
#endif

// K of one head (S rows of E values, row stride ld; E even) as blocks of 64
// keys, zero keys past S: block t is the B operand (E x 64, leading dim 64)
// of the scores against keys [64t, 64t + 64), dst[t·64·E + b_at(vnni, e, jj,
// 64)] = K[64t + jj, e]. dst has round_up_vnni(S) · E entries.
inline void pack_keys(bool vnni, const h16* src, int64_t S, int64_t E, int64_t ld, h16* dst) {
  const int64_t Sk = round_up_vnni(S);
  for (int64_t t = 0; t < Sk / kVnniBlock; ++t) {
    h16* blk = dst + t * kVnniBlock * E;
    if (vnni) {
      // A pair of values of a key row is one 32-bit word of the pair's row:
      // a transpose of 32-bit words (memcpy: h16 rows need not be 4-aligned).
      for (int64_t jj0 = 0; jj0 < kVnniBlock; jj0 += 16) {
        int64_t e2 = 0;
#if ATTNKERN_HAS(AVX512)
        const int64_t j0 = t * kVnniBlock + jj0;
        if (j0 + 16 <= S)
          for (; e2 + 16 <= E / 2; e2 += 16)
            transpose_words16(src + j0 * ld + 2 * e2, 2 * ld, blk + (e2 * kVnniBlock + jj0) * 2, 4 * kVnniBlock);
#endif
        for (int64_t jj = jj0; jj < jj0 + 16; ++jj) {
          const int64_t j = t * kVnniBlock + jj;
          for (int64_t w = e2; w < E / 2; ++w) {
            uint32_t word = 0;
            if (j < S) std::memcpy(&word, src + j * ld + 2 * w, sizeof(word));
            std::memcpy(blk + (w * kVnniBlock + jj) * 2, &word, sizeof(word));
          }
        }
      }
      continue;
    }
    for (int64_t jj = 0; jj < kVnniBlock; ++jj) {
      const int64_t j = t * kVnniBlock + jj;
      for (int64_t e = 0; e < E; ++e) blk[b_at(vnni, e, jj, kVnniBlock)] = j < S ? src[j * ld + e] : 0;
    }
  }
}

// V of one head (S rows of Ev values, row stride ld; Ev a multiple of 16) as
// column blocks of up to 64 values, each over all keys, zero keys past S:
// block u (width bw) holds dst[u·64·Sk + b_at(vnni, j, c, bw)] = V[j, 64u + c],
// Sk = round_up_vnni(S). Keys [j0, j0 + w) of block u (j0 even) are the B
// operand at dst + u·64·Sk + j0·bw, leading dim bw.
inline void pack_values(bool vnni, const h16* src, int64_t S, int64_t Ev, int64_t ld, h16* dst) {
  const int64_t Sk = round_up_vnni(S);
  for (int64_t u = 0; u * kVnniBlock < Ev; ++u) {
    const int64_t c0 = u * kVnniBlock, bw = std::min(kVnniBlock, Ev - c0);
    h16* blk = dst + c0 * Sk;
    if (vnni) {  // rows j and j + 1 interleaved, a pair at a time
      for (int64_t j = 0; j < Sk; j += 2) {
        const h16* a = j < S ? src + j * ld + c0 : nullptr;
        const h16* b = j + 1 < S ? src + (j + 1) * ld + c0 : nullptr;
        h16* out = blk + j * bw;
        int64_t c = 0;
#if ATTNKERN_HAS(AVX512)
        if (a && b)  // sixteen pairs at a time: a's values in the low halves of the words, b's in the high
          for (; c + 16 <= bw; c += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)));
            _mm512_storeu_si512(out + 2 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
          }
#endif
        for (; c < bw; ++c) {
          out[2 * c] = a ? a[c] : 0;
          out[2 * c + 1] = b ? b[c] : 0;
        }
      }
      continue;
    }
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t c = 0; c < bw; ++c) blk[b_at(vnni, j, c, bw)] = j < S ? src[j * ld + c0 + c] : 0;
  }
}

// y (m x w, row stride ldy) = q (m x E, row stride E) · Kᵀ over keys
// [j0, j0 + w), j0 a multiple of 64, from the head's packed keys. Columns
// [w, round_up(w, 16)) are written too (products with zero keys) when ldy
// has room for them; otherwise the last block goes through a scratch.
inline void scores_half(const HalfGemm& g, int64_t m, int64_t w, int64_t j0, int64_t E, const h16* q,
                        const h16* kpack, float* y, int64_t ldy) {
  for (int64_t jb = 0; jb < w; jb += kVnniBlock) {
    const int64_t rest = std::min(kVnniBlock, w - jb), nb = (rest + 15) / 16 * 16;
    const h16* b = kpack + (j0 + jb) * E;
    if (jb + nb <= ldy) {
      brgemm16(g, m, nb, E, E, kVnniBlock, ldy, false, q, b, y + jb);
    } else {
      thread_local std::vector<float> tail;
      tail.resize(m * nb);
      brgemm16(g, m, nb, E, E, kVnniBlock, nb, false, q, b, tail.data());
      for (int64_t r = 0; r < m; ++r) std::copy_n(tail.data() + r * nb, rest, y + r * ldy + jb);
    }
  }
}

// The rows of y (m x w floats, row stride ldy) rounded to the half type into
// dst (m x wk, wk >= w; zeros past w).
template <typename T>
void rows_to_half_as(const float* y, int64_t m, int64_t w, int64_t ldy, h16* dst, int64_t wk) {
  using Vf = at::vec::Vectorized<float>;
  using Vh = at::vec::Vectorized<T>;
  for (int64_t r = 0; r < m; ++r) {
    const float* src = y + r * ldy;
    T* out = reinterpret_cast<T*>(dst + r * wk);
    int64_t j = 0;
    for (; j + Vh::size() <= w; j += Vh::size())
      at::vec::convert_from_float<T>(Vf::loadu(src + j), Vf::loadu(src + j + Vf::size())).store(out + j);
    for (; j < w; ++j) out[j] = src[j];
    for (; j < wk; ++j) out[j] = T(0.f);
  }
}

inline void rows_to_half(bool fp16, const float* y, int64_t m, int64_t w, int64_t ldy, h16* dst, int64_t wk) {
  if (fp16)
    rows_to_half_as<c10::Half>(y, m, w, ldy, dst, wk);
  else
    rows_to_half_as<c10::BFloat16>(y, m, w, ldy, dst, wk);
}

// o (m x Ev, row stride Ev; Ev a multiple of 16) = P · V[j0:j0 + w], or +=
// with `accumulate`, for P (m x w floats, row stride ldy) rounded to the
// half type, j0 even; vpack: the head's packed values (pack_values).
// o (m x Ev, row stride Ev; Ev a multiple of 16) = P · V[j0:j0 + wk], or +=
// with `accumulate`, for P already in the half type (m x wk, row stride wk,
// wk = round_up_k(w) for the tile's w keys, zeros past them; j0 even);
// vpack: the head's packed values (pack_values).
inline void pv_half_rows(const HalfGemm& g, int64_t m, int64_t wk, int64_t j0, const h16* ph, const h16* vpack,
                         int64_t S, int64_t Ev, float* o, bool accumulate) {
  const int64_t Sk = round_up_vnni(S);
  for (int64_t c0 = 0; c0 < Ev; c0 += kVnniBlock) {
    const int64_t bw = std::min(kVnniBlock, Ev - c0);
    brgemm16(g, m, bw, wk, wk, bw, Ev, accumulate, ph, vpack + c0 * Sk + j0 * bw, o + c0);
  }
}

inline void pv_half(const HalfGemm& g, int64_t m, int64_t w, int64_t j0, const float* y, int64_t ldy,
                    const h16* vpack, int64_t S, int64_t Ev, float* o, bool accumulate) {
  const int64_t wk = round_up_k(w);
  thread_local std::vector<h16> ph;
  ph.resize(m * wk);
  rows_to_half(g.fp16, y, m, w, ldy, ph.data(), wk);
  pv_half_rows(g, m, wk, j0, ph.data(), vpack, S, Ev, o, accumulate);
}

// x (m x d half values, row stride ld) transposed into dst (d x mk, mk =
// round_up_k(m); zeros past m): the A operand of a product that sums over
// the m rows.
inline void transpose_half(const h16* x, int64_t m, int64_t d, int64_t ld, h16* dst, int64_t mk) {
  for (int64_t e = 0; e < d; ++e) {
    h16* row = dst + e * mk;
    for (int64_t i = 0; i < m; ++i) row[i] = x[i * ld + e];
    std::fill(row + m, row + mk, h16(0));
  }
}

#if ATTNKERN_HAS(AVX512)
// The bits of x rounded to bfloat16 or float16 (to nearest even; NaN stays
// NaN), in the low half of each 32-bit lane.
inline __m512i half_bits(__m512 x, bool fp16) {
  if (fp16) return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
}
#endif

// y (m x w floats, row stride ldy) rounded to the half type as the B operand
// of a product that sums over its m rows, in blocks of 64 columns: block u
// (width bw = min(64, round_up(w - 64u, 16))) at dst + u·64·mk holds rows
// [0, mk) of it, Y[i][c] at b_at(g.vnni, i, c, bw) (mk = round_up_k(m));
// zero past row m and column w.
inline void pack_rows(const HalfGemm& g, const float* y, int64_t m, int64_t w, int64_t ldy, h16* dst) {
  const bool fp16 = g.fp16;
  const int64_t mk = round_up_k(m);
  for (int64_t c0 = 0; c0 < w; c0 += kVnniBlock) {
    const int64_t rest = std::min(kVnniBlock, w - c0), bw = (rest + 15) / 16 * 16;
    h16* blk = dst + c0 * mk;
    for (int64_t i = 0; i < mk; i += 2) {
      h16* out = blk + i * bw;  // the pair's, or row i's and then row i + 1's
      if (i >= m) {
        std::fill(out, out + 2 * bw, h16(0));
        continue;
      }
      const float* a = y + i * ldy + c0;
      const float* b = i + 1 < m ? a + ldy : nullptr;
      int64_t c = 0;
#if ATTNKERN_HAS(AVX512)
      for (; c + 16 <= rest; c += 16) {
        const __m512i lo = half_bits(_mm512_loadu_ps(a + c), fp16);
        const __m512i hi = b ? half_bits(_mm512_loadu_ps(b + c), fp16) : _mm512_setzero_si512();
        if (g.vnni) {
          _mm512_storeu_si512(out + 2 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm512_cvtepi32_epi16(lo));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + bw + c), _mm512_cvtepi32_epi16(hi));
        }
      }
#endif
      for (; c < bw; ++c) {
        out[b_at(g.vnni, 0, c, bw)] = c < rest ? float_to_half(a[c], fp16) : 0;
        out[b_at(g.vnni, 1, c, bw)] = c < rest && b ? float_to_half(b[c], fp16) : 0;
      }
    }
  }
}

// Cᵀ (d x w, row stride ldc) += Aᵀ · Y for Aᵀ (d x mk half values, mk =
// round_up_k(m): a block of m rows transposed, transpose_half) and Y (m x w, packed by
// pack_rows): the key-side gradients dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS of a
// tile, with the accumulators transposed (keys along the rows of C). Columns
// up to round_up(w, 16) are added to (zeros past w).
inline void rows_product_half(const HalfGemm& g, int64_t d, int64_t m, int64_t w, const h16* at_, const h16* ypack,
                              float* ct, int64_t ldc) {
  const int64_t mk = round_up_k(m);
  for (int64_t c0 = 0; c0 < w; c0 += kVnniBlock) {
    const int64_t bw = (std::min(kVnniBlock, w - c0) + 15) / 16 * 16;
    brgemm16(g, d, bw, mk, mk, bw, ldc, true, at_, ypack + c0 * mk, ct + c0);
  }
}

// Releases the brgemm hardware state (AMX tile configuration) of the calling
// thread at the end of a scope that used oneDNN's half-type GEMMs.
struct HalfGemmScope {
  bool used;
  explicit HalfGemmScope(bool u) : used(u) {}
  ~HalfGemmScope() {
    if (used) at::native::cpublas::brgemm_release(true);
  }
  HalfGemmScope(const HalfGemmScope&) = delete;
  HalfGemmScope& operator=(const HalfGemmScope&) = delete;
};

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

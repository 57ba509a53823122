// bfloat16 GEMMs of the fused attention's forward: bfloat16 products summed
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

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)
namespace attn {

using bf16 = c10::BFloat16;

// Keys per packed block of K; columns per packed block of V.
constexpr int64_t kVnniBlock = 64;

inline int64_t round_up_vnni(int64_t n) { return (n + kVnniBlock - 1) / kVnniBlock * kVnniBlock; }

namespace detail {

// Whether oneDNN's bfloat16 brgemm runs here and gives exact products: a
// 3 x 16 x 4 product of small integers, which must come out exact.
inline bool brgemm_probe() {
  constexpr int64_t M = 3, N = 16, K = 4;
  bf16 a[M * K], b[K * N];
  float c[M * N], want[M * N];
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<float>(i % 5 - 2);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) b[(k / 2) * N * 2 + n * 2 + k % 2] = static_cast<float>((k * N + n) % 7 - 3);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<float>(a[i * K + k]) * static_cast<float>((k * N + n) % 7 - 3);
      want[i * N + n] = s;
    }
  try {
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    return false;
  }
  return std::memcmp(c, want, sizeof(c)) == 0;
}

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

// Whether the forward's GEMMs of bfloat16 attention run in bfloat16 here.
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

// o (m x Ev, row stride Ev; Ev a multiple of 16) = P · V[j0:j0 + w], or +=
// with `accumulate`, for P (m x w floats, row stride ldy) rounded to
// bfloat16, j0 even; vpack: the head's packed values.
inline void pv_bf16(int64_t m, int64_t w, int64_t j0, const float* y, int64_t ldy, const bf16* vpack, int64_t S,
                    int64_t Ev, float* o, bool accumulate) {
  using Vf = at::vec::Vectorized<float>;
  using Vh = at::vec::Vectorized<bf16>;
  const int64_t wk = w + (w & 1), Sk = round_up_vnni(S);
  thread_local std::vector<bf16> ph;
  ph.resize(m * wk);
  for (int64_t r = 0; r < m; ++r) {
    const float* src = y + r * ldy;
    bf16* dst = ph.data() + r * wk;
    int64_t j = 0;
    for (; j + Vh::size() <= w; j += Vh::size())
      at::vec::convert_from_float<bf16>(Vf::loadu(src + j), Vf::loadu(src + j + Vf::size())).store(dst + j);
    for (; j < w; ++j) dst[j] = src[j];
    if (wk > w) dst[w] = bf16(0.f);
  }
  for (int64_t c0 = 0; c0 < Ev; c0 += kVnniBlock) {
    const int64_t bw = std::min(kVnniBlock, Ev - c0);
    at::native::cpublas::brgemm(m, bw, wk, wk, bw, Ev, accumulate, ph.data(), vpack + c0 * Sk + j0 * bw, o + c0,
                                true);
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

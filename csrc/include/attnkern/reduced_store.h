// Float rows stored as bfloat16 / half in the CPU copies (round to nearest
// even, as a scalar cast). bfloat16 has no conversion instruction in the
// AVX-512 level the kernels are built for (F/BW/VL/DQ): ATen's vectors round
// it with integer operations and a NaN blend, several operations a vector.
// CPUs with the AVX512_BF16 extension (checked when the op runs) round 32
// values in one instruction, used where present: vcvtne2ps2bf16, which
// treats denormal floats as zero (the kernels never produce them: they run
// with denormals flushed) and writes NaN as the quiet NaN 0x7fc0. float16 has its
// conversion instruction at AVX2 already.
#pragma once

#include "attnkern/isa_features.h"

#if !defined(__CUDACC__) && !defined(__HIPCC__)
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "attnkern/isa_namespace.h"

namespace attnkern {
namespace cpu {
ATTNKERN_ISA_BEGIN

#if ATTNKERN_HAS(AVX512)
// Whether the CPU has AVX512_BF16 and ATTNKERN_NO_AVX512_BF16 is unset (it
// makes the AVX512 copy round as it does on CPUs without the extension, so
// that tests can run that path on any machine). Read once.
inline bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && !std::getenv("ATTNKERN_NO_AVX512_BF16");
  return has;
}

// dst[0:n] = bfloat16(src[0:n] · scale) by vcvtne2ps2bf16 (only where
// cpu_has_avx512_bf16()).
__attribute__((target("avx512bf16"))) inline void store_bf16_native(const float* src, int64_t n, float scale,
                                                                     c10::BFloat16* dst) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + j + 16), vs),
                                           _mm512_mul_ps(_mm512_loadu_ps(src + j), vs));
    _mm512_storeu_si512(static_cast<void*>(dst + j), reinterpret_cast<__m512i>(v));
  }
  if (j < n) {
    const __mmask16 lo = static_cast<__mmask16>(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1);
    const __mmask16 hi = static_cast<__mmask16>(n - j <= 16 ? 0 : (1u << (n - j - 16)) - 1);
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(hi, src + j + 16), vs),
                                           _mm512_mul_ps(_mm512_maskz_loadu_ps(lo, src + j), vs));
    _mm512_mask_storeu_epi16(static_cast<void*>(dst + j), (static_cast<__mmask32>(hi) << 16) | lo,
                             reinterpret_cast<__m512i>(v));
  }
}
#endif

// dst[0:n] = src[0:n] · scale rounded to scalar_t (bfloat16 / half), a
// vector pair at a time.
template <typename scalar_t>
inline void store_rounded(const float* src, int64_t n, float scale, scalar_t* dst) {
  static_assert(at::is_reduced_floating_point_v<scalar_t>, "bfloat16 / half rows");
#if ATTNKERN_HAS(AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (cpu_has_avx512_bf16()) return store_bf16_native(src, n, scale, dst);
  }
#endif
  using Vf = at::vec::Vectorized<float>;
  const Vf vs(scale);
  int64_t j = 0;
  for (; j + 2 * Vf::size() <= n; j += 2 * Vf::size())
    at::vec::convert_from_float<scalar_t>(Vf::loadu(src + j) * vs, Vf::loadu(src + j + Vf::size()) * vs).store(dst + j);
  for (; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j] * scale);
}

ATTNKERN_ISA_END
}  // namespace cpu
}  // namespace attnkern
#endif

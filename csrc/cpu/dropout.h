// Dropout on the attention weights, regenerated wherever it is needed (the
// forward, the backward, and the testing op that returns the mask), so that
// no L x S mask is ever stored.
//
// The keep decision of weight (row, key j) comes from Philox4x32-10, a
// counter-based generator: one call with key = the 64-bit seed and counter =
// (o_lo, o_hi, 0, 0), o = row·⌈S/4⌉ + j/4, gives four 32-bit words, word j%4
// deciding key j; row = (batch·H + head)·L + query. This is exactly Triton's
// tl.randint4x(seed, o), so the Triton kernels draw the same mask. A weight is
// kept when its word is >= threshold = round(p·2^32), i.e. with probability
// 1 - p to within 2^-32, and a kept weight is scaled by 1 / (1 - p), as
// torch.nn.functional.dropout and scaled_dot_product_attention do.
#pragma once

#include "attnkern/isa_features.h"

#include <cmath>
#include <cstdint>

#if ATTNKERN_HAS(AVX2)
#include <immintrin.h>
#define ATTNKERN_DROPOUT_AVX2 1
#endif

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

struct Dropout {
  bool on = false;
  uint32_t k0 = 0, k1 = 0;      // the seed
  uint32_t threshold = 0;       // keep when word >= threshold
  double scale = 1.0;          // 1 / (1 - p)
  int64_t groups_per_row = 0;   // ⌈S / 4⌉

  static Dropout make(double p, uint64_t seed, int64_t S) {
    Dropout d;
    d.k0 = static_cast<uint32_t>(seed);
    d.k1 = static_cast<uint32_t>(seed >> 32);
    const double t = std::round(p * 4294967296.0);
    d.threshold = t >= 4294967295.0 ? 4294967295u : static_cast<uint32_t>(t);
    d.scale = 1.0 / (1.0 - p);
    d.on = d.threshold > 0;  // p below 2^-33 drops nothing
    d.groups_per_row = (S + 3) / 4;
    return d;
  }
};

constexpr uint32_t kPhiloxRoundA = 0xD2511F53u, kPhiloxRoundB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;

// Philox4x32-10 of counter (c[0], c[1], 0, 0) under key (k0, k1), in place.
inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t pa = static_cast<uint64_t>(kPhiloxRoundA) * c[0];
    const uint64_t pb = static_cast<uint64_t>(kPhiloxRoundB) * c[2];
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = static_cast<uint32_t>(pb);
    c[2] = n2;
    c[3] = static_cast<uint32_t>(pa);
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
}

// 1 if weight (row, j) is kept, else 0.
inline float dropout_keep(const Dropout& d, int64_t row, int64_t j) {
  const uint64_t o = static_cast<uint64_t>(row) * static_cast<uint64_t>(d.groups_per_row) +
                     static_cast<uint64_t>(j >> 2);
  uint32_t c[4] = {static_cast<uint32_t>(o), static_cast<uint32_t>(o >> 32), 0u, 0u};
  philox4x32_10(c, d.k0, d.k1);
  return c[j & 3] >= d.threshold ? 1.0f : 0.0f;
}

#ifdef ATTNKERN_DROPOUT_AVX2
// Keep flags (1 or 0) of the 32 keys of groups o .. o + 7 (8 Philox streams side by side).
inline void dropout_keeps32(const Dropout& d, uint64_t o, float* f) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Counters o + lane as (lo, hi) words; the carry into hi when lo wraps.
  const __m256i lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(o))), lane);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(o)), sign),
                                             _mm256_xor_si256(lo, sign));
  __m256i c0 = lo;
  __m256i c1 = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(o >> 32))), wrapped);
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  const __m256i A = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundA));
  const __m256i B = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundB));
  uint32_t k0 = d.k0, k1 = d.k1;
  auto mulhi = [](__m256i a, __m256i x) {
    const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(a, x), 32);
    const __m256i odd = _mm256_mul_epu32(a, _mm256_srli_epi64(x, 32));
    return _mm256_blend_epi32(even, odd, 0xAA);
  };
  for (int round = 0; round < 10; ++round) {
    const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(mulhi(B, c2), c1), _mm256_set1_epi32(static_cast<int>(k0)));
    const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(mulhi(A, c0), c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = _mm256_mullo_epi32(B, c2);
    c3 = _mm256_mullo_epi32(A, c0);
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  // keep = word >= threshold (unsigned), as 1.0f or 0.0f.
  const __m256i tm1 = _mm256_set1_epi32(static_cast<int>((d.threshold - 1u) ^ 0x80000000u));
  const __m256i one = _mm256_castps_si256(_mm256_set1_ps(1.0f));
  auto keep = [&](__m256i w) { return _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_xor_si256(w, sign), tm1), one); };
  const __m256i w0 = keep(c0), w1 = keep(c1), w2 = keep(c2), w3 = keep(c3);
  // Lane l holds words 0..3 of group o + l: reorder to key order 4l + word.
  const __m256i t0 = _mm256_unpacklo_epi32(w0, w1), t1 = _mm256_unpackhi_epi32(w0, w1);
  const __m256i t2 = _mm256_unpacklo_epi32(w2, w3), t3 = _mm256_unpackhi_epi32(w2, w3);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(f), _mm256_permute2x128_si256(u0, u1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(f + 8), _mm256_permute2x128_si256(u2, u3, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(f + 16), _mm256_permute2x128_si256(u0, u1, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(f + 24), _mm256_permute2x128_si256(u2, u3, 0x31));
}
#endif

// f[0 .. w) = the keep flags of keys j0 .. j0 + w of `row` (d.on).
inline void dropout_keeps(const Dropout& d, int64_t row, int64_t j0, int64_t w, float* f) {
  int64_t j = j0;
  const int64_t end = j0 + w;
#ifdef ATTNKERN_DROPOUT_AVX2
  const uint64_t base = static_cast<uint64_t>(row) * static_cast<uint64_t>(d.groups_per_row);
  for (; j < end && (j & 3); ++j) f[j - j0] = dropout_keep(d, row, j);
  for (; j + 32 <= end; j += 32) dropout_keeps32(d, base + static_cast<uint64_t>(j >> 2), f + (j - j0));
#endif
  for (; j < end; ++j) f[j - j0] = dropout_keep(d, row, j);
}

// x[0 .. w) *= keep[0 .. w) / (1 - p).
template <typename acc_t>
inline void apply_keep(acc_t* x, const float* keep, int64_t w, const Dropout& d) {
  const acc_t s = static_cast<acc_t>(d.scale);
  for (int64_t j = 0; j < w; ++j) x[j] *= static_cast<acc_t>(keep[j]) * s;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

// The α-entmax family members with an algorithm of their own, shared by every
// kernel (CPU and CUDA): their codes and names, b = α - 1 of the fixed ones,
// the classification of a runtime b, and the one switch that turns a runtime
// family into a compile-time one.
//
// The Python side keeps the same table in attnkern/family.py;
// tests/test_family.py checks the two agree through attnkern._C.FAMILIES.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attnkern/isa_namespace.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define AK_HD __host__ __device__ __forceinline__
#else
#define AK_HD inline
#endif

namespace attnkern {
namespace math {
ATTNKERN_ISA_BEGIN

// kGeneric is the op name "entmax": α given per row or per head.
enum class Family : int { kSoftmax = 0, kSparsemax = 1, kEntmax15 = 2, kGeneric = 3 };
constexpr int kNumFamilies = 4;

// The op-level name of each family, indexed by its code.
constexpr const char* kFamilyNames[kNumFamilies] = {"softmax", "sparsemax", "entmax15", "entmax"};

// b = α - 1 of a fixed family (0 for softmax; kGeneric has no fixed b and gets 0).
template <Family FAM, typename acc_t>
AK_HD constexpr acc_t fixed_b() {
  return FAM == Family::kSparsemax ? acc_t(1) : FAM == Family::kEntmax15 ? acc_t(0.5) : acc_t(0);
}

template <typename acc_t>
AK_HD constexpr acc_t fixed_b(Family fam) {
  return fam == Family::kSparsemax ? acc_t(1) : fam == Family::kEntmax15 ? acc_t(0.5) : acc_t(0);
}

// b = α - 1 classified into the family member with an exact algorithm. Only
// α = 1 itself is softmax: the map differs from softmax by O(|α - 1|), which
// float64 resolves at any α ≠ 1, and the generic power φ_b (through log1p)
// stays accurate as b → 0.
template <typename acc_t>
AK_HD Family family_of(acc_t b) {
  if (b == acc_t(1)) return Family::kSparsemax;
  if (b == acc_t(0.5)) return Family::kEntmax15;
  if (b == acc_t(0)) return Family::kSoftmax;
  return Family::kGeneric;
}

template <Family FAM>
using FamilyTag = std::integral_constant<Family, FAM>;

// fn(FamilyTag<FAM>{}) for the runtime family `fam`: the one place a runtime
// family becomes a template argument (read it as `decltype(tag)::value`).
// Switches over Family have no `default:`, so that a family added to the enum
// and not handled is a compile error (-Werror=switch, setup.py); a Family
// value comes only from family_of or from a checked name (never an integer
// from Python).
template <typename F>
AK_HD decltype(auto) with_family(Family fam, F&& fn) {
  switch (fam) {
    case Family::kSoftmax:
      return fn(FamilyTag<Family::kSoftmax>{});
    case Family::kSparsemax:
      return fn(FamilyTag<Family::kSparsemax>{});
    case Family::kEntmax15:
      return fn(FamilyTag<Family::kEntmax15>{});
    case Family::kGeneric:
      return fn(FamilyTag<Family::kGeneric>{});
  }
  __builtin_unreachable();
}

ATTNKERN_ISA_END
}  // namespace math
}  // namespace attnkern

// Runtime choice of the CPU kernels' instruction set, and the CPU op
// registrations that forward to it (see attnkern/cpu_kernels.h).
//
// The level followed is PyTorch's own (at::get_cpu_capability(), which honours
// ATEN_CPU_CAPABILITY), capped at the highest level this build carries and the
// CPU runs. Tests and benchmarks may force any level the CPU runs.
#include <ATen/Version.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {

// The copies' tables. Only the levels this build compiled are defined
// (ATTNKERN_CPU_<LEVEL> says which), and only those are referenced.
namespace DEFAULT {
const KernelTable& kernel_table();
}
namespace AVX2 {
const KernelTable& kernel_table();
}
namespace AVX512 {
const KernelTable& kernel_table();
}

namespace {

Level level_named(const std::string& name) {
  for (int l = 0; l < kNumLevels; ++l)
    if (name == kLevelNames[l]) return static_cast<Level>(l);
  return Level::kDefault;  // every level of another architecture
}

struct Choice {
  Level level;
  std::string reason;
};

Choice default_choice() {
  const std::string torch_name = at::get_cpu_capability();
  const Level wanted = level_named(torch_name);
  Level level = wanted;
  std::string reason = "PyTorch's CPU capability is " + torch_name;
  if (static_cast<int>(level) > static_cast<int>(compiled_level())) {
    level = compiled_level();
    reason += "; this build carries up to " + std::string(kLevelNames[static_cast<int>(level)]);
  }
  if (static_cast<int>(level) > static_cast<int>(machine_level())) {
    level = machine_level();
    reason += "; this CPU runs up to " + std::string(kLevelNames[static_cast<int>(level)]);
  }
  return {level, reason};
}

const Choice& chosen_by_default() {
  static const Choice c = default_choice();
  return c;
}

std::atomic<int> forced{-1};

const KernelTable& table_at(Level level) {
  switch (level) {
#ifdef ATTNKERN_CPU_AVX512
    case Level::kAVX512:
      return AVX512::kernel_table();
#endif
#ifdef ATTNKERN_CPU_AVX2
    case Level::kAVX2:
      return AVX2::kernel_table();
#endif
    default:
      return DEFAULT::kernel_table();
  }
}

const KernelTable& table() { return table_at(active_level()); }

// Forwards an op to the same-named entry of the active table.
template <auto Member>
struct Forward;
template <typename R, typename... A, R (*KernelTable::*Member)(A...)>
struct Forward<Member> {
  static R call(A... args) { return (table().*Member)(std::forward<A>(args)...); }
};

}  // namespace

Level machine_level() {
#if defined(__x86_64__) || defined(__i386__)
  static const Level level = [] {
    __builtin_cpu_init();
    // The features ATen asks of its own AVX2 and AVX512 levels.
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return Level::kAVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Level::kAVX2;
    return Level::kDefault;
  }();
  return level;
#else
  return Level::kDefault;
#endif
}

Level compiled_level() {
#if defined(ATTNKERN_CPU_AVX512)
  return Level::kAVX512;
#elif defined(ATTNKERN_CPU_AVX2)
  return Level::kAVX2;
#else
  return Level::kDefault;
#endif
}

Level active_level() {
  const int f = forced.load(std::memory_order_relaxed);
  return f >= 0 ? static_cast<Level>(f) : chosen_by_default().level;
}

const char* active_reason() {
  return forced.load() >= 0 ? "forced by attnkern.isa.force_level" : chosen_by_default().reason.c_str();
}

bool active_half_gemm(at::ScalarType dtype, const char** unit) { return table().half_gemm(dtype, unit); }

void force_level(int level) {
  if (level < 0) {
    forced.store(-1);
    return;
  }
  TORCH_CHECK_VALUE(level < kNumLevels, "attnkern: unknown CPU level ", level);
  TORCH_CHECK_VALUE(level <= static_cast<int>(compiled_level()), "attnkern: this build does not carry the ",
                    kLevelNames[level], " kernels (built up to ", kLevelNames[static_cast<int>(compiled_level())],
                    ")");
  TORCH_CHECK_VALUE(level <= static_cast<int>(machine_level()), "attnkern: this CPU cannot run ",
                    kLevelNames[level], " code (it runs up to ", kLevelNames[static_cast<int>(machine_level())], ")");
  forced.store(level);
}

TORCH_LIBRARY_IMPL(attnkern, CPU, m) {
  m.impl("softmax_fwd", &Forward<&KernelTable::softmax_fwd>::call);
  m.impl("softmax_bwd", &Forward<&KernelTable::softmax_bwd>::call);
  m.impl("sparsemax_fwd", &Forward<&KernelTable::sparsemax_fwd>::call);
  m.impl("sparsemax_bwd", &Forward<&KernelTable::sparsemax_bwd>::call);
  m.impl("entmax15_fwd", &Forward<&KernelTable::entmax15_fwd>::call);
  m.impl("entmax15_bwd", &Forward<&KernelTable::entmax15_bwd>::call);
  m.impl("entmax_fwd", &Forward<&KernelTable::entmax_fwd>::call);
  m.impl("entmax_bwd", &Forward<&KernelTable::entmax_bwd>::call);
  m.impl("budget_fwd", &Forward<&KernelTable::budget_fwd>::call);
  m.impl("budget_bwd", &Forward<&KernelTable::budget_bwd>::call);
  m.impl("normmax_bwd", &Forward<&KernelTable::normmax_bwd>::call);
  m.impl("entmax_loss_fwd", &Forward<&KernelTable::entmax_loss_fwd>::call);
  m.impl("fusedmax_fwd", &Forward<&KernelTable::fusedmax_fwd>::call);
  m.impl("fusedmax_bwd", &Forward<&KernelTable::fusedmax_bwd>::call);
  m.impl("fusedmax_fwd_segments", &Forward<&KernelTable::fusedmax_fwd_segments>::call);
  m.impl("fusedmax_bwd_segments", &Forward<&KernelTable::fusedmax_bwd_segments>::call);
  m.impl("oscarmax_fwd", &Forward<&KernelTable::oscarmax_fwd>::call);
  m.impl("oscarmax_bwd", &Forward<&KernelTable::oscarmax_bwd>::call);
  m.impl("oscarmax_fwd_clusters", &Forward<&KernelTable::oscarmax_fwd_clusters>::call);
  m.impl("oscarmax_bwd_clusters", &Forward<&KernelTable::oscarmax_bwd_clusters>::call);
  m.impl("crf_marginals_fwd", &Forward<&KernelTable::crf_marginals_fwd>::call);
  m.impl("crf_marginals_bwd", &Forward<&KernelTable::crf_marginals_bwd>::call);
  m.impl("sparsemap_chain_fwd", &Forward<&KernelTable::sparsemap_chain_fwd>::call);
  m.impl("sparsemap_chain_bwd", &Forward<&KernelTable::sparsemap_chain_bwd>::call);
  m.impl("sparsemap_chain_active", &Forward<&KernelTable::sparsemap_chain_active>::call);
  m.impl("attention_fwd", &Forward<&KernelTable::attention_fwd>::call);
  m.impl("attention_bwd", &Forward<&KernelTable::attention_bwd>::call);
  m.impl("attention_decode_paged", &Forward<&KernelTable::attention_decode_paged>::call);
  m.impl("attention_dropout_mask", &Forward<&KernelTable::attention_dropout_mask>::call);
}

}  // namespace cpu
}  // namespace attnkern

// The CPU kernels as one table of function pointers.
//
// setup.py compiles every source in csrc/cpu once per instruction-set level
// (DEFAULT, AVX2, AVX512), each copy in its own namespace
// attnkern::cpu::<CPU_CAPABILITY> (an inline namespace, as ATen's vectorized
// code does), so the copies never merge at link time. Each copy exports one
// function, kernel_table(), that fills this table; csrc/dispatch/cpu_dispatch.cpp
// (compiled once, for the baseline ISA) registers the torch ops and forwards
// every call to the table of the level chosen at run time.
//
// The ISA copies run no code when the library loads (no static registrars):
// a copy is entered only after the dispatcher has checked that the CPU runs it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace attnkern {
namespace cpu {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

struct KernelTable {
  // Row-wise normalizers (csrc/cpu/normalizers.cpp).
  Tensor (*softmax_fwd)(const Tensor& x, int64_t dim);
  Tensor (*softmax_bwd)(const Tensor& p, const Tensor& grad, int64_t dim);
  Tensor (*sparsemax_fwd)(const Tensor& x, int64_t dim);
  Tensor (*sparsemax_bwd)(const Tensor& p, const Tensor& grad, int64_t dim);
  Tensor (*entmax15_fwd)(const Tensor& x, int64_t dim);
  Tensor (*entmax15_bwd)(const Tensor& p, const Tensor& grad, int64_t dim);
  Tensor (*entmax_fwd)(const Tensor& x, const Tensor& alpha, int64_t dim);
  std::tuple<Tensor, Tensor> (*entmax_bwd)(const Tensor& p, const Tensor& grad, const Tensor& alpha, int64_t dim,
                                           bool alpha_grad);
  // csrc/cpu/budget.cpp, normmax.cpp, losses.cpp
  Tensor (*budget_fwd)(const Tensor& x, const Tensor& budget, int64_t dim);
  std::tuple<Tensor, Tensor> (*budget_bwd)(const Tensor& p, const Tensor& grad, int64_t dim, bool budget_grad);
  Tensor (*normmax_bwd)(const Tensor& p, const Tensor& grad, const Tensor& alpha, int64_t dim);
  std::tuple<Tensor, Tensor> (*entmax_loss_fwd)(const Tensor& x, const Tensor& target, const Tensor& alpha);
  // Structured normalizers (csrc/cpu/structured.cpp).
  Tensor (*fusedmax_fwd)(const Tensor& x, const Tensor& lam, int64_t dim);
  std::tuple<Tensor, Tensor> (*fusedmax_bwd)(const Tensor& x, const Tensor& grad, const Tensor& lam, int64_t dim,
                                             bool lam_grad);
  std::tuple<Tensor, Tensor> (*fusedmax_fwd_segments)(const Tensor& x, const Tensor& lam, int64_t dim);
  std::tuple<Tensor, Tensor> (*fusedmax_bwd_segments)(const Tensor& segments, const Tensor& grad,
                                                      const Tensor& lam, int64_t dim, bool lam_grad);
  Tensor (*oscarmax_fwd)(const Tensor& x, const Tensor& lam, int64_t dim);
  std::tuple<Tensor, Tensor> (*oscarmax_bwd)(const Tensor& x, const Tensor& grad, const Tensor& lam, int64_t dim,
                                             bool lam_grad);
  std::tuple<Tensor, Tensor, Tensor> (*oscarmax_fwd_clusters)(const Tensor& x, const Tensor& lam, int64_t dim);
  std::tuple<Tensor, Tensor> (*oscarmax_bwd_clusters)(const Tensor& flags, const Tensor& ranks, const Tensor& grad,
                                                      const Tensor& lam, int64_t dim, bool lam_grad);
  // Binary linear-chain ops (csrc/cpu/chain.cpp): CRF marginals and SparseMAP.
  Tensor (*crf_marginals_fwd)(const Tensor& unary, const Tensor& pairwise, int64_t dim);
  std::tuple<Tensor, Tensor> (*crf_marginals_bwd)(const Tensor& unary, const Tensor& grad, const Tensor& pairwise,
                                                  int64_t dim, bool pairwise_grad);
  Tensor (*sparsemap_chain_fwd)(const Tensor& unary, const Tensor& pairwise, int64_t dim);
  std::tuple<Tensor, Tensor> (*sparsemap_chain_bwd)(const Tensor& unary, const Tensor& grad, const Tensor& pairwise,
                                                    int64_t dim, bool pairwise_grad);
  std::tuple<Tensor, Tensor, Tensor> (*sparsemap_chain_active)(const Tensor& unary, const Tensor& pairwise,
                                                               int64_t dim);
  // Fused attention (csrc/cpu/attention.cpp).
  std::tuple<Tensor, Tensor> (*attention_fwd)(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& mask,
                                              bool is_causal, double scale, c10::string_view normalizer,
                                              const OptTensor& alpha, double dropout_p,
                                              const OptTensor& dropout_seed, int64_t window_left,
                                              int64_t window_right, const OptTensor& key_lengths,
      const OptTensor& row_bounds);
  std::tuple<Tensor, Tensor, Tensor, Tensor> (*attention_bwd)(
      const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& mask,
      bool is_causal, double scale, c10::string_view normalizer, const OptTensor& alpha, const Tensor& out,
      const Tensor& shift, bool alpha_grad, double dropout_p, const OptTensor& dropout_seed, int64_t window_left,
      int64_t window_right, const OptTensor& key_lengths,
      const OptTensor& row_bounds);
  std::tuple<Tensor, Tensor> (*attention_decode_paged)(const Tensor& q, const Tensor& k_pages,
                                                       const Tensor& v_pages, const Tensor& block_table,
                                                       const Tensor& seqused_k, double scale, int64_t window_left,
                                                       int64_t window_right);
  Tensor (*attention_dropout_mask)(int64_t B, int64_t H, int64_t L, int64_t S, double dropout_p,
                                   const Tensor& dropout_seed);
  // Whether attention in dtype (bfloat16 or float16) runs its GEMMs in that
  // type now (csrc/cpu/half_gemm.h); false in the copies that never do.
  // *unit names the unit that runs them, or says why float32 does.
  bool (*half_gemm)(at::ScalarType dtype, const char** unit);
};

// Softmax attention with at most this many query rows takes the decoding
// path (csrc/cpu/attention.cpp: K and V read in place, keys split into
// chunks), which attention_decode_paged's documents take; attnkern._C
// carries it as DECODE_ROWS.
inline constexpr int64_t kDecodeRows = 4;

// The instruction-set levels, lowest first; names as ATen spells them.
enum class Level : int { kDefault = 0, kAVX2 = 1, kAVX512 = 2 };
inline constexpr int kNumLevels = 3;
inline constexpr const char* kLevelNames[kNumLevels] = {"DEFAULT", "AVX2", "AVX512"};

// Each copy's kernel_table() (csrc/cpu/kernel_table.cpp) is
// attnkern::cpu::<LEVEL>::kernel_table(); the add_*_kernels functions below
// are its parts, one per source of the copy.
#ifdef CPU_CAPABILITY
inline namespace CPU_CAPABILITY {
void add_normalizer_kernels(KernelTable& t);
void add_budget_kernels(KernelTable& t);
void add_normmax_kernels(KernelTable& t);
void add_loss_kernels(KernelTable& t);
void add_structured_kernels(KernelTable& t);
void add_chain_kernels(KernelTable& t);
void add_attention_kernels(KernelTable& t);
}  // namespace CPU_CAPABILITY
#endif

// The dispatcher (csrc/dispatch/cpu_dispatch.cpp).
Level machine_level();        // the highest level this CPU (and OS) can run
Level compiled_level();       // the highest level this build carries
Level active_level();         // the level the ops run at now
const char* active_reason();  // why: torch's choice, a cap, or a forced level
bool active_half_gemm(at::ScalarType dtype, const char** unit);  // the active table's half_gemm
// Force a level (tests, benchmarks); a negative value returns to the default.
// Throws if the CPU cannot run it or the build lacks it.
void force_level(int level);

}  // namespace cpu
}  // namespace attnkern

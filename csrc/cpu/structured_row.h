// The structured normalizers (fusedmax, oscarmax: sparsemax after a prox) one
// row at a time, for the fused attention's whole rows of scores
// (attention_rows.cpp). The math is structured.cpp's, shared with the
// row-wise ops, so fused and row-wise attention weights agree.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {  // one copy per instruction set (setup.py)

// Which prox precedes sparsemax; kNone: the head is of the α-entmax family.
enum class Prox : int8_t { kNone = 0, kFusedmax = 1, kOscarmax = 2 };

struct ProxScratch;  // structured.cpp

// One thread's solver of structured rows. solve() turns a row of scores into
// probabilities and keeps what the row's backward needs, so that vjp(), called
// next for the same row, does not solve it again.
class ProxRow {
 public:
  ProxRow();
  ~ProxRow();
  ProxRow(const ProxRow&) = delete;
  ProxRow& operator=(const ProxRow&) = delete;
  // row (n scores, -inf: masked, removed before the prox) in, probabilities
  // out, in place. Returns sparsemax's threshold on prox(row): +inf for a row
  // with no finite score (zeros out), NaN for a row holding NaN or +inf (NaN out).
  // tau_hint: what solve returned for this row before (a backward solving
  // again), which narrows fusedmax's search for its support; NaN: none.
  template <typename acc_t>
  float solve(Prox prox, acc_t* row, int64_t n, double lam,
              float tau_hint = std::numeric_limits<float>::quiet_NaN());
  // d (the n incoming gradients of the row last solved) in, scale times the
  // gradient in its scores out, in place; returns the gradient in λ.
  template <typename acc_t>
  double vjp(Prox prox, acc_t* d, int64_t n, acc_t scale);

 private:
  std::unique_ptr<ProxScratch> s_;
  int64_t capacity_ = 0;
  int64_t m_ = 0;  // the last row's finite entries (-1: NaN row)
  double tau_ = 0.0;
};

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

// This copy's kernel table (see attnkern/cpu_kernels.h). Built on first use,
// never at load time: the dispatcher calls it only on a CPU that runs this
// copy's instruction set.
#include "attnkern/cpu_kernels.h"

namespace attnkern {
namespace cpu {
inline namespace CPU_CAPABILITY {

const KernelTable& kernel_table() {
  static const KernelTable table = [] {
    KernelTable t{};
    add_normalizer_kernels(t);
    add_budget_kernels(t);
    add_normmax_kernels(t);
    add_loss_kernels(t);
    add_structured_kernels(t);
    add_chain_kernels(t);
    add_attention_kernels(t);
    return t;
  }();
  return table;
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace attnkern

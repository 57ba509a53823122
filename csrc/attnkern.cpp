// Every attnkern op schema, in one place. The ops are the non-differentiable
// primitives; attnkern/autograd.py owns the gradients.
//
// Row-wise normalizers along `dim`:
//   <name>_fwd(x, dim) -> p
//   <name>_bwd(p, grad_p, dim) -> grad_x
//   entmax_fwd(x, alpha, dim) -> p            alpha: one value per row, any
//                                             shape broadcastable to x with
//                                             size 1 along dim
//   entmax_bwd(p, grad_p, alpha, dim, alpha_grad) -> (grad_x, grad_alpha)
//                                             grad_alpha: per row (x's shape
//                                             with size 1 along dim), or an
//                                             empty tensor if not asked for
//
// Fused attention (q (B,H,L,E), k (B,Hk,S,E), v (B,Hk,S,Ev), H % Hk == 0):
//   attention_fwd(...) -> (out (B,H,L,Ev) in q's dtype, shift (B,H,L) float32)
//       scores s = scale·q·kᵀ + mask (float, broadcastable to (B,H,L,S),
//       -inf = not allowed), causal: key j <= query i. p = φ_b(s - shift);
//       a row with no allowed key has shift +inf and output 0.
//       normalizer: softmax | sparsemax | entmax15 | entmax (alpha: float32 (H,))
//   attention_bwd(...) -> (dq, dk, dv, dalpha (H,) float32 or empty)
//       recomputes the scores from q, k and the saved shift; `out` must be
//       the forward's output (softmax takes Σ_j p_j dp_j as grad_out·out).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(attnkern, m) {
  m.def("softmax_fwd(Tensor x, int dim) -> Tensor");
  m.def("softmax_bwd(Tensor p, Tensor grad, int dim) -> Tensor");
  m.def("sparsemax_fwd(Tensor x, int dim) -> Tensor");
  m.def("sparsemax_bwd(Tensor p, Tensor grad, int dim) -> Tensor");
  m.def("entmax15_fwd(Tensor x, int dim) -> Tensor");
  m.def("entmax15_bwd(Tensor p, Tensor grad, int dim) -> Tensor");
  m.def("entmax_fwd(Tensor x, Tensor alpha, int dim) -> Tensor");
  m.def("entmax_bwd(Tensor p, Tensor grad, Tensor alpha, int dim, bool alpha_grad) -> (Tensor, Tensor)");

  // --- entmax-package compatibility (attnkern/compat.py, attnkern/losses.py) ---
  // budget_fwd(x, budget, dim) -> p = clip(x - τ, 0, 1), Σ p = budget per row
  //     (budget: one value per row, broadcastable as entmax_fwd's alpha).
  m.def("budget_fwd(Tensor x, Tensor budget, int dim) -> Tensor");
  // budget_bwd(p, grad_p, dim, budget_grad) -> (grad_x, grad_budget per row
  //     (float64, size 1 along dim) or empty)
  m.def("budget_bwd(Tensor p, Tensor grad, int dim, bool budget_grad) -> (Tensor, Tensor)");
  // normmax_bwd(p, grad_p, alpha, dim) -> grad_x (α-normmax; its forward runs on
  //     entmax_fwd with α' = 2 - 1/α)
  m.def("normmax_bwd(Tensor p, Tensor grad, Tensor alpha, int dim) -> Tensor");
  // entmax_loss_fwd(x (rows, n), target (rows,) int, alpha (rows,) or scalar)
  //     -> (loss (rows,) float32/float64, grad = p - onehot (rows, n) in x's dtype)
  //     α-entmax Fenchel-Young loss with its gradient in one pass per row.
  m.def("entmax_loss_fwd(Tensor x, Tensor target, Tensor alpha) -> (Tensor loss, Tensor grad)");
  // --- end entmax-package compatibility ---

  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, str normalizer, "
        "Tensor? alpha) -> (Tensor out, Tensor shift)");
  m.def("attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float scale, "
        "str normalizer, Tensor? alpha, Tensor out, Tensor shift, bool alpha_grad) "
        "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dalpha)");
}

// A Python module so that `import attnkern._C` loads the library and runs the
// registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "attnkern compiled ops", -1, nullptr};
  return PyModule_Create(&module);
}

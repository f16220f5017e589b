// Op schemas of the vllm_dflash2 namespace, defined once; backends register
// their kernels with TORCH_LIBRARY_IMPL (cpu/*.cpp, cuda/*.cu) and the fake
// (meta) kernels live in vllm_dflash2/ops/_native.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(vllm_dflash2, m) {
  // (y [N, H] in x.dtype, coef1 [N, T, G] float32)
  m.def(
      "grouped_conv_prepare(Tensor x, Tensor projection, Tensor base0, int block_size, "
      "int group_size) -> (Tensor, Tensor)");
  // y [N, H] in z.dtype
  m.def(
      "grouped_conv_finish(Tensor z, Tensor coef1, Tensor base1, int block_size, "
      "int group_size) -> Tensor");
  // (tokens [Bq, L] int64, q [Bq, L, k] float32)
  m.def(
      "select_candidates(Tensor candidate_ids, Tensor unary, Tensor hidden, Tensor anchor_ids, "
      "Tensor predecessor_codebook, Tensor successor_codebook, Tensor temperature, "
      "Tensor seeds, Tensor? top_k=None, Tensor? top_p=None) -> (Tensor, Tensor)");
  // CPU only (cpu/packed_linear*.cpp): packed [N / 8, K, 8] float32, or
  // [N / 16, K / 2, 32] bfloat16 (VNNI pairs of K)
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  // y [..., N] = x [..., K] @ weight.T + bias, weight given packed
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

// `import vllm_dflash2._C` only has to run the static registrations above;
// a dummy module avoids pybind11 (pattern from pytorch/extension-cpp).
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "vllm_dflash2 native ops (torch.ops.vllm_dflash2)", -1,
      nullptr};
  return PyModule_Create(&module_def);
}
}

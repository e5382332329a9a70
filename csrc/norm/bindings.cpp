// Python bindings of the unscale_norm op (see zengine/ops/grad.py for the checked wrapper).
#include "py_args.h"
#include "unscale_norm.h"

namespace {

// unscale_sum_squares(grad, n, scale, num_threads, simd_path) -> float sum of squares
PyObject* py_unscale_sum_squares(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  if (!py::expect_args("unscale_sum_squares", nargs, 5)) return nullptr;
  void* grad;
  int64_t n, threads, path;
  double scale;
  if (!py::to_ptr(args[0], &grad) || !py::to_i64(args[1], &n) || !py::to_f64(args[2], &scale) ||
      !py::to_i64(args[3], &threads) || !py::to_i64(args[4], &path)) {
    return nullptr;
  }
  if (n < 0 || path < -1 || path > 2) {
    PyErr_SetString(PyExc_ValueError, "unscale_sum_squares: n or simd_path out of range");
    return nullptr;
  }
  double sum_sq = 0.0;
  const char* err;
  Py_BEGIN_ALLOW_THREADS;
  err = zengine::unscale_sum_squares(static_cast<float*>(grad), n, static_cast<float>(scale),
                                     &sum_sq, static_cast<int>(threads),
                                     static_cast<zengine::SimdPath>(path));
  Py_END_ALLOW_THREADS;
  if (err != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, err);
    return nullptr;
  }
  return PyFloat_FromDouble(sum_sq);
}

PyMethodDef kMethods[] = {
    {"unscale_sum_squares",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_unscale_sum_squares)),
     METH_FASTCALL, "Scale an fp32 gradient in place; return the sum of squares (double)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, ZE_MODULE_NAME, "zengine unscale_norm kernel", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC ZE_MODULE_INIT(void) { return PyModule_Create(&kModule); }

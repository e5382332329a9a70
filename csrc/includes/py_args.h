// Argument helpers for the bindings: plain CPython, METH_FASTCALL, no pybind11 or torch headers.
//
// The kernels take raw pointers and sizes. The Python wrappers in zengine/ops/ check every
// tensor (device, dtype, contiguity, length) and pass `tensor.data_ptr()`; keeping torch's
// headers out of the build is what keeps a cold build of all ops to a few seconds (a binding
// that includes torch/extension.h takes about a minute on a 2-core machine).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace zengine {
namespace py {

inline bool expect_args(const char* fn, Py_ssize_t got, Py_ssize_t want) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, got);
  return false;
}

inline bool to_ptr(PyObject* obj, void** out) {
  *out = PyLong_AsVoidPtr(obj);
  return !(*out == nullptr && PyErr_Occurred());
}

inline bool to_i64(PyObject* obj, int64_t* out) {
  const long long value = PyLong_AsLongLong(obj);
  if (value == -1 && PyErr_Occurred()) return false;
  *out = static_cast<int64_t>(value);
  return true;
}

inline bool to_f64(PyObject* obj, double* out) {
  *out = PyFloat_AsDouble(obj);
  return !(*out == -1.0 && PyErr_Occurred());
}

inline bool to_bool(PyObject* obj, bool* out) {
  const int value = PyObject_IsTrue(obj);
  if (value < 0) return false;
  *out = value != 0;
  return true;
}

}  // namespace py
}  // namespace zengine

// PyInit_<TORCH_EXTENSION_NAME>: torch's JIT and setup.py builds both define the macro.
#define ZE_CONCAT_IMPL(a, b) a##b
#define ZE_CONCAT(a, b) ZE_CONCAT_IMPL(a, b)
#define ZE_STRINGIFY_IMPL(x) #x
#define ZE_STRINGIFY(x) ZE_STRINGIFY_IMPL(x)
#define ZE_MODULE_INIT ZE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)
#define ZE_MODULE_NAME ZE_STRINGIFY(TORCH_EXTENSION_NAME)

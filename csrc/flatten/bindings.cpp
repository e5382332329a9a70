// Python bindings of the flatten op (see zengine/ops/flatten.py for the checked wrapper).
#include <vector>

#include "flatten.h"
#include "py_args.h"

namespace {

// copy_flat(flat, part_ptrs, part_nbytes, direction, num_threads); the two lists are ints.
PyObject* py_copy_flat(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  if (!py::expect_args("copy_flat", nargs, 5)) return nullptr;
  void* flat;
  int64_t direction, threads;
  if (!py::to_ptr(args[0], &flat) || !py::to_i64(args[3], &direction) ||
      !py::to_i64(args[4], &threads)) {
    return nullptr;
  }
  if (!PyList_Check(args[1]) || !PyList_Check(args[2]) ||
      PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[2]) || direction < 0 || direction > 1) {
    PyErr_SetString(PyExc_ValueError,
                    "copy_flat: expected two lists of equal length and direction 0 or 1");
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(args[1]);
  std::vector<char*> parts(static_cast<size_t>(count));
  std::vector<int64_t> nbytes(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    void* ptr;
    if (!py::to_ptr(PyList_GET_ITEM(args[1], i), &ptr) ||
        !py::to_i64(PyList_GET_ITEM(args[2], i), &nbytes[static_cast<size_t>(i)])) {
      return nullptr;
    }
    parts[static_cast<size_t>(i)] = static_cast<char*>(ptr);
  }
  const char* err;
  Py_BEGIN_ALLOW_THREADS;
  err = zengine::copy_flat(static_cast<char*>(flat), parts.data(), nbytes.data(), count,
                           static_cast<zengine::CopyDirection>(direction), static_cast<int>(threads));
  Py_END_ALLOW_THREADS;
  if (err != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"copy_flat", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_copy_flat)),
     METH_FASTCALL, "Copy a list of buffers into (0) or out of (1) one flat buffer."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, ZE_MODULE_NAME, "zengine flatten kernel", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC ZE_MODULE_INIT(void) { return PyModule_Create(&kModule); }

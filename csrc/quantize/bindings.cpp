// Python bindings of the quantize op (see zengine/ops/quantize.py for the checked wrapper).
#include "py_args.h"
#include "quantize.h"

namespace {

namespace py = zengine::py;

// The layout arguments shared by both entry points, in this order:
// rows, n, block, bits, code_stride, scale_stride.
bool to_layout(PyObject* const* args, zengine::QuantLayout* l) {
  int64_t bits;
  if (!py::to_i64(args[0], &l->rows) || !py::to_i64(args[1], &l->n) || !py::to_i64(args[2], &l->block) ||
      !py::to_i64(args[3], &bits) || !py::to_i64(args[4], &l->code_stride) ||
      !py::to_i64(args[5], &l->scale_stride)) {
    return false;
  }
  l->bits = static_cast<int>(bits);
  return true;
}

bool check_codes(int64_t type, int64_t path) {
  if (type < 0 || type > 2 || path < -1 || path > 2) {
    PyErr_SetString(PyExc_ValueError, "quantize: float type or simd_path out of range");
    return false;
  }
  return true;
}

PyObject* finish(const char* err) {
  if (err != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// quantize(x, x_type, x_stride, codes, scales, rows, n, block, bits, code_stride, scale_stride,
//          num_threads, simd_path)
PyObject* py_quantize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!py::expect_args("quantize", nargs, 13)) return nullptr;
  void *x, *codes, *scales;
  int64_t type, x_stride, threads, path;
  zengine::QuantLayout layout;
  if (!py::to_ptr(args[0], &x) || !py::to_i64(args[1], &type) || !py::to_i64(args[2], &x_stride) ||
      !py::to_ptr(args[3], &codes) || !py::to_ptr(args[4], &scales) || !to_layout(args + 5, &layout) ||
      !py::to_i64(args[11], &threads) || !py::to_i64(args[12], &path)) {
    return nullptr;
  }
  if (!check_codes(type, path)) return nullptr;
  const char* err;
  Py_BEGIN_ALLOW_THREADS;
  err = zengine::quantize_blocks(x, static_cast<zengine::FloatType>(type), x_stride, layout, codes,
                                 static_cast<float*>(scales), static_cast<int>(threads),
                                 static_cast<zengine::SimdPath>(path));
  Py_END_ALLOW_THREADS;
  return finish(err);
}

// dequantize(codes, scales, out, out_type, out_stride, sum_rows, rows, n, block, bits, code_stride,
//            scale_stride, num_threads, simd_path)
PyObject* py_dequantize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!py::expect_args("dequantize", nargs, 14)) return nullptr;
  void *codes, *scales, *out;
  int64_t type, out_stride, threads, path;
  bool sum_rows;
  zengine::QuantLayout layout;
  if (!py::to_ptr(args[0], &codes) || !py::to_ptr(args[1], &scales) || !py::to_ptr(args[2], &out) ||
      !py::to_i64(args[3], &type) || !py::to_i64(args[4], &out_stride) || !py::to_bool(args[5], &sum_rows) ||
      !to_layout(args + 6, &layout) || !py::to_i64(args[12], &threads) || !py::to_i64(args[13], &path)) {
    return nullptr;
  }
  if (!check_codes(type, path)) return nullptr;
  const char* err;
  Py_BEGIN_ALLOW_THREADS;
  err = zengine::dequantize_blocks(codes, static_cast<const float*>(scales), layout, out,
                                   static_cast<zengine::FloatType>(type), out_stride, sum_rows,
                                   static_cast<int>(threads), static_cast<zengine::SimdPath>(path));
  Py_END_ALLOW_THREADS;
  return finish(err);
}

PyMethodDef kMethods[] = {
    {"quantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_quantize)), METH_FASTCALL,
     "Blockwise int8/int4 codes and fp32 scales of rows of fp32/bf16/fp16 values."},
    {"dequantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_dequantize)), METH_FASTCALL,
     "Decode blockwise int8/int4 rows into fp32/bf16/fp16 (or their sum in row order into one row)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, ZE_MODULE_NAME, "zengine quantize kernel", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC ZE_MODULE_INIT(void) { return PyModule_Create(&kModule); }

// Python bindings of the cpu_adam op (see zengine/ops/adam.py for the checked wrapper).
#include "cpu_adam.h"
#include "py_args.h"

namespace {

using zengine::SimdPath;

// adam_step(param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, weight_decay, step,
//           bias_correction, adamw_mode, copy_out, copy_out_dtype, num_threads, simd_path)
// Pointers are ints (data_ptr()); copy_out 0 with dtype 0 for none; simd_path -1 for auto.
PyObject* py_adam_step(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  if (!py::expect_args("adam_step", nargs, 17)) return nullptr;
  zengine::AdamShard s{};
  zengine::AdamHyper h{};
  void* param;
  void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  int64_t copy_dtype, threads, path;
  if (!py::to_ptr(args[0], &param) || !py::to_ptr(args[1], &grad) ||
      !py::to_ptr(args[2], &exp_avg) || !py::to_ptr(args[3], &exp_avg_sq) ||
      !py::to_i64(args[4], &s.n) || !py::to_f64(args[5], &h.lr) ||
      !py::to_f64(args[6], &h.beta1) || !py::to_f64(args[7], &h.beta2) ||
      !py::to_f64(args[8], &h.eps) || !py::to_f64(args[9], &h.weight_decay) ||
      !py::to_i64(args[10], &h.step) || !py::to_bool(args[11], &h.bias_correction) ||
      !py::to_bool(args[12], &h.adamw_mode) || !py::to_ptr(args[13], &s.copy_out) ||
      !py::to_i64(args[14], &copy_dtype) || !py::to_i64(args[15], &threads) ||
      !py::to_i64(args[16], &path)) {
    return nullptr;
  }
  if (copy_dtype < 0 || copy_dtype > 3 || path < -1 || path > 2 || s.n < 0) {
    PyErr_SetString(PyExc_ValueError, "adam_step: copy_out_dtype, simd_path or n out of range");
    return nullptr;
  }
  s.param = static_cast<float*>(param);
  s.grad = static_cast<const float*>(grad);
  s.exp_avg = static_cast<float*>(exp_avg);
  s.exp_avg_sq = static_cast<float*>(exp_avg_sq);
  s.copy_out_dtype = static_cast<zengine::CopyOut>(copy_dtype);
  const char* err;
  Py_BEGIN_ALLOW_THREADS;
  err = zengine::adam_step(s, h, static_cast<int>(threads), static_cast<SimdPath>(path));
  Py_END_ALLOW_THREADS;
  if (err != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// adam_step_bf16(param, grad, exp_avg, exp_avg_sq, compensation, n, lr, beta1, beta2, eps,
//                weight_decay, step, bias_correction, adamw_mode, states_bf16, rounding, key,
//                first_index, num_threads, simd_path)
// Pointers are ints (data_ptr()); compensation 0 unless rounding is 1 (Kahan).
// adam_step_fp16(...): the same arguments over an fp16 master and gradient (states fp32,
// rounding 0).
PyObject* adam_step_low(PyObject* const* args, Py_ssize_t nargs, const char* name, bool fp16) {
  namespace py = zengine::py;
  if (!py::expect_args(name, nargs, 20)) return nullptr;
  zengine::AdamBf16Shard s{};
  s.master_fp16 = fp16;
  zengine::AdamHyper h{};
  void* param;
  void* grad;
  void* comp;
  int64_t rounding, key, first, threads, path;
  if (!py::to_ptr(args[0], &param) || !py::to_ptr(args[1], &grad) ||
      !py::to_ptr(args[2], &s.exp_avg) || !py::to_ptr(args[3], &s.exp_avg_sq) ||
      !py::to_ptr(args[4], &comp) || !py::to_i64(args[5], &s.n) ||
      !py::to_f64(args[6], &h.lr) || !py::to_f64(args[7], &h.beta1) ||
      !py::to_f64(args[8], &h.beta2) || !py::to_f64(args[9], &h.eps) ||
      !py::to_f64(args[10], &h.weight_decay) || !py::to_i64(args[11], &h.step) ||
      !py::to_bool(args[12], &h.bias_correction) || !py::to_bool(args[13], &h.adamw_mode) ||
      !py::to_bool(args[14], &s.states_bf16) || !py::to_i64(args[15], &rounding) ||
      !py::to_i64(args[16], &key) || !py::to_i64(args[17], &first) ||
      !py::to_i64(args[18], &threads) || !py::to_i64(args[19], &path)) {
    return nullptr;
  }
  if (rounding < 0 || rounding > 2 || path < -1 || path > 2 || s.n < 0) {
    PyErr_SetString(PyExc_ValueError, "adam_step: rounding, simd_path or n out of range");
    return nullptr;
  }
  s.param = static_cast<uint16_t*>(param);
  s.grad = static_cast<const uint16_t*>(grad);
  s.compensation = static_cast<uint16_t*>(comp);
  s.rounding = static_cast<zengine::Rounding>(rounding);
  s.key = static_cast<uint32_t>(key);
  s.first_index = static_cast<uint32_t>(first);
  const char* err;
  Py_BEGIN_ALLOW_THREADS;
  err = zengine::adam_step_bf16(s, h, static_cast<int>(threads), static_cast<SimdPath>(path));
  Py_END_ALLOW_THREADS;
  if (err != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* py_adam_step_bf16(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return adam_step_low(args, nargs, "adam_step_bf16", false);
}

PyObject* py_adam_step_fp16(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return adam_step_low(args, nargs, "adam_step_fp16", true);
}

// simd_paths() -> list of the paths this CPU can run, widest first.
PyObject* py_simd_paths(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  for (SimdPath p : {SimdPath::kAvx512, SimdPath::kAvx2, SimdPath::kScalar}) {
    if (!zengine::simd_path_supported(p)) continue;
    PyObject* name = PyUnicode_FromString(zengine::simd_path_name(p));
    if (name == nullptr || PyList_Append(out, name) < 0) {
      Py_XDECREF(name);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(name);
  }
  return out;
}

// simd_path() -> the path a call with simd_path=-1 takes now (reads ZENGINE_SIMD).
PyObject* py_simd_path(PyObject*, PyObject*) {
  SimdPath path;
  if (const char* err = zengine::resolve_simd_path(SimdPath::kAuto, &path)) {
    PyErr_SetString(PyExc_RuntimeError, err);
    return nullptr;
  }
  return PyUnicode_FromString(zengine::simd_path_name(path));
}

PyMethodDef kMethods[] = {
    {"adam_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_adam_step)),
     METH_FASTCALL, "One Adam/AdamW step over a flat fp32 shard, in place."},
    {"adam_step_bf16",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_adam_step_bf16)),
     METH_FASTCALL, "One Adam/AdamW step over a flat bf16 master shard, in place."},
    {"adam_step_fp16",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_adam_step_fp16)),
     METH_FASTCALL, "One Adam/AdamW step over a flat fp16 master shard (fp32 moments), in place."},
    {"simd_paths", py_simd_paths, METH_NOARGS, "SIMD paths this CPU supports, widest first."},
    {"simd_path", py_simd_path, METH_NOARGS, "The SIMD path used when none is named."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, ZE_MODULE_NAME, "zengine cpu_adam kernels", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC ZE_MODULE_INIT(void) { return PyModule_Create(&kModule); }

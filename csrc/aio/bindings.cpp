// Python bindings of the async I/O pool (see zengine/ops/aio.py for the checked wrapper).
// Pools are kept in a table and named by an integer handle, so no Python type is needed.
#include <memory>
#include <mutex>
#include <unordered_map>

#include "async_io.h"
#include "py_args.h"

namespace {

std::mutex g_mu;
std::unordered_map<int64_t, std::shared_ptr<zengine::AioPool>> g_pools;
int64_t g_next_handle = 1;

std::shared_ptr<zengine::AioPool> find_pool(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_pools.find(handle);
  if (it == g_pools.end()) {
    PyErr_Format(PyExc_ValueError, "aio: no pool with handle %lld", static_cast<long long>(handle));
    return nullptr;
  }
  return it->second;
}

// pool_new(threads, block_bytes, priority) -> handle
PyObject* py_pool_new(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  int64_t threads, block;
  bool priority;
  if (!py::expect_args("pool_new", nargs, 3) || !py::to_i64(args[0], &threads) ||
      !py::to_i64(args[1], &block) || !py::to_bool(args[2], &priority)) {
    return nullptr;
  }
  std::shared_ptr<zengine::AioPool> pool;
  Py_BEGIN_ALLOW_THREADS;
  pool = std::make_shared<zengine::AioPool>(static_cast<int>(threads), block, priority);
  Py_END_ALLOW_THREADS;
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t handle = g_next_handle++;
  g_pools[handle] = std::move(pool);
  return PyLong_FromLongLong(handle);
}

// pool_free(handle): waits for the workers after the queued blocks are done.
PyObject* py_pool_free(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  int64_t handle;
  if (!py::expect_args("pool_free", nargs, 1) || !py::to_i64(args[0], &handle)) return nullptr;
  std::shared_ptr<zengine::AioPool> pool;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_pools.find(handle);
    if (it != g_pools.end()) {
      pool = std::move(it->second);
      g_pools.erase(it);
    }
  }
  Py_BEGIN_ALLOW_THREADS;
  pool.reset();
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// submit(handle, write, fd, ptr, nbytes, offset) -> request id
PyObject* py_submit(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  int64_t handle, fd, nbytes, offset;
  bool write;
  void* ptr;
  if (!py::expect_args("submit", nargs, 6) || !py::to_i64(args[0], &handle) ||
      !py::to_bool(args[1], &write) || !py::to_i64(args[2], &fd) || !py::to_ptr(args[3], &ptr) ||
      !py::to_i64(args[4], &nbytes) || !py::to_i64(args[5], &offset)) {
    return nullptr;
  }
  auto pool = find_pool(handle);
  if (!pool) return nullptr;
  const int64_t id = pool->submit(write, static_cast<int>(fd), static_cast<char*>(ptr), nbytes, offset);
  return PyLong_FromLongLong(id);
}

// wait(handle, request) -> 0, errno, or -1 (end of file)
PyObject* py_wait(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  int64_t handle, request;
  if (!py::expect_args("wait", nargs, 2) || !py::to_i64(args[0], &handle) ||
      !py::to_i64(args[1], &request)) {
    return nullptr;
  }
  auto pool = find_pool(handle);
  if (!pool) return nullptr;
  int error;
  Py_BEGIN_ALLOW_THREADS;
  error = pool->wait(request);
  Py_END_ALLOW_THREADS;
  return PyLong_FromLong(error);
}

// done(handle, request) -> 1 (done), 0 (not yet), -1 (unknown: already waited for)
PyObject* py_done(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  int64_t handle, request;
  if (!py::expect_args("done", nargs, 2) || !py::to_i64(args[0], &handle) ||
      !py::to_i64(args[1], &request)) {
    return nullptr;
  }
  auto pool = find_pool(handle);
  if (!pool) return nullptr;
  return PyLong_FromLong(pool->done(request));
}

// stats(handle) -> (bytes_read, bytes_written, reads, writes, read_ns, write_ns, busy_ns)
PyObject* py_stats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  namespace py = zengine::py;
  int64_t handle;
  if (!py::expect_args("stats", nargs, 1) || !py::to_i64(args[0], &handle)) return nullptr;
  auto pool = find_pool(handle);
  if (!pool) return nullptr;
  const zengine::AioStats s = pool->stats();
  return Py_BuildValue("(LLLLLLL)", static_cast<long long>(s.bytes_read), static_cast<long long>(s.bytes_written),
                       static_cast<long long>(s.reads), static_cast<long long>(s.writes),
                       static_cast<long long>(s.read_ns), static_cast<long long>(s.write_ns),
                       static_cast<long long>(s.busy_ns));
}

#define ZE_FASTCALL(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)), METH_FASTCALL

PyMethodDef kMethods[] = {
    {"pool_new", ZE_FASTCALL(py_pool_new), "Start a pool of I/O threads; returns its handle."},
    {"pool_free", ZE_FASTCALL(py_pool_free), "Finish the queued blocks and stop a pool."},
    {"submit", ZE_FASTCALL(py_submit), "Queue a read or write of a buffer; returns a request id."},
    {"wait", ZE_FASTCALL(py_wait), "Wait for a request; returns 0, an errno, or -1 at end of file."},
    {"done", ZE_FASTCALL(py_done), "Whether a request is done: 1, 0, or -1 when unknown."},
    {"stats", ZE_FASTCALL(py_stats), "Bytes, requests and busy nanoseconds of a pool so far."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, ZE_MODULE_NAME, "zengine async file I/O", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC ZE_MODULE_INIT(void) { return PyModule_Create(&kModule); }

// A call into Python from torch's allocation path, for a job thread that may wait
// there (the admission gate, waiting at the limit). The thread may arrive with or
// without the GIL (torch's bindings release it before an op allocates) and may hold
// the per-job generators' swap lock (wait_release.h), which it lets go for the call:
// the jobs it waits for may need either. What the callable raises (Ctrl-C reaching
// the job while it waits) is raised by the allocation, as torch's Python bindings
// raise a Python error from C++ (python_error): the script sees it where it would
// under `python`.
#pragma once

#include <Python.h>

#include <torch/csrc/Exceptions.h>

#include "wait_release.h"

namespace wwrun::alloc {

// `call()` runs with the GIL and returns a new reference or null (an error set);
// `convert(result)` reads it, with the GIL. Returns what convert made; throws
// python_error if the call raised.
template <typename Call, typename Convert>
auto call_python_waiting(Call call, Convert convert) {
  auto* held = wwrun::current_wait_release();
  if (held) held->release();
  const PyGILState_STATE state = PyGILState_Ensure();
  bool raised = false;
  decltype(convert(nullptr)) answer{};
  python_error error;
  PyObject* result = call();
  if (result == nullptr) {
    error.persist();  // fetched with the GIL: raised again by the binding that called torch
    raised = true;
  } else {
    answer = convert(result);
    if (PyErr_Occurred()) PyErr_Clear();  // an object convert could not read: its default
    Py_DECREF(result);
  }
  if (held) {  // taken back without the GIL: its next holder may need the GIL while holding it
    PyThreadState* saved = PyEval_SaveThread();
    held->reacquire();
    PyEval_RestoreThread(saved);
  }
  PyGILState_Release(state);
  if (raised) throw std::move(error);
  return answer;
}

// A result's truth (an object without one: false).
inline bool python_truth(PyObject* result) { return PyObject_IsTrue(result) == 1; }

// A Python callable the run registers (the admission gate's, the limit's), called
// from the allocation path through call_python_waiting.
class PythonCallback {
 public:
  // With the GIL held (a binding); null: none.
  void set(PyObject* callback) {
    Py_XINCREF(callback);
    PyObject* previous = callback_;
    callback_ = callback;
    Py_XDECREF(previous);
  }
  // Calls it with Py_BuildValue's `format` and `args` and returns what
  // `convert` reads from its result (python_truth: its truth); `unset` when none is set.
  template <typename Convert, typename... Args>
  auto call(Convert convert, decltype(convert(nullptr)) unset, const char* format, Args... args) {
    if (!Py_IsInitialized()) return unset;
    bool none = false;
    auto answer = call_python_waiting(
        [&]() -> PyObject* {
          PyObject* callback = callback_;
          if (callback == nullptr) {
            none = true;
            Py_RETURN_NONE;
          }
          Py_INCREF(callback);  // set() may drop it while the call runs
          PyObject* result = PyObject_CallFunction(callback, format, args...);
          Py_DECREF(callback);
          return result;
        },
        convert);
    return none ? unset : answer;
  }

 private:
  PyObject* callback_ = nullptr;  // a new reference, or null
};

}  // namespace wwrun::alloc

// Rule f's hooks for an allocator living in a Python process (both builds).
//
// Only job threads wait for other jobs' frees, and they are the ones holding
// the GIL when they allocate (forward code); the shared autograd thread runs
// without it and must never wait (its stall would stop every job's backward,
// see shared/facts.md). A waiting job thread releases the GIL, or the jobs whose
// frees it waits for could not run.
#pragma once

#include <Python.h>

#include "waterwave_allocator.h"

namespace wwrun::alloc {

inline WaitHooks python_wait_hooks() {
  WaitHooks hooks;
  hooks.may_wait = [] { return Py_IsInitialized() && PyGILState_Check(); };
  hooks.before = []() -> void* { return PyEval_SaveThread(); };
  hooks.after = [](void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); };
  return hooks;
}

}  // namespace wwrun::alloc

// Rule f's hooks for an allocator living in a Python process (both builds).
//
// Only job threads wait for other jobs' frees. A job thread is marked as such,
// thread-locally, when its job starts (mark_job_thread); the shared autograd
// thread and every other unmarked thread never wait (a stall there would stop
// every job's backward, see shared/facts.md). torch's bindings release the GIL
// before an op allocates, so a job thread may arrive with or without it: a
// waiting thread releases the GIL only if it holds it, or the jobs whose frees
// it waits for could not run.
#pragma once

#include <Python.h>

#include <string>

#include "admission_gate.h"
#include "wait_release.h"
#include "waterwave_allocator.h"

namespace wwrun::alloc {

// The job this thread runs, or empty for threads that must never wait.
inline std::string& job_thread_mark() {
  thread_local std::string job;
  return job;
}

inline void mark_job_thread(const std::string& job) {
  job_thread_mark() = job;
  bind_admission_gate(job);  // Note [Admission at the first allocation]
}
inline void unmark_job_thread() {
  job_thread_mark().clear();
  bind_admission_gate("");
}
inline bool is_job_thread() { return !job_thread_mark().empty(); }

// A lock the thread holds for another part of wwrun (wait_release.h: the per-job
// generators' swap) is let go for the wait too, and taken back before the GIL: its
// next holder may need the GIL while holding it.
inline WaitHooks python_wait_hooks() {
  WaitHooks hooks;
  hooks.may_wait = [] { return is_job_thread(); };
  hooks.before = []() -> void* {
    if (auto* held = wwrun::current_wait_release()) held->release();
    if (!Py_IsInitialized() || !PyGILState_Check()) return nullptr;
    return PyEval_SaveThread();
  };
  hooks.after = [](void* state) {
    if (auto* held = wwrun::current_wait_release()) held->reacquire();
    if (state != nullptr) PyEval_RestoreThread(static_cast<PyThreadState*>(state));
  };
  return hooks;
}

}  // namespace wwrun::alloc

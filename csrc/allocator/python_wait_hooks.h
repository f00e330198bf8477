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
#include "python_call.h"
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

// Note [Waiting at the limit]
//
// A job that fits alone must not die of running out of memory beside others. When a
// job thread's request would fail at rule g, the allocator calls the run's limit
// callback (a Python callable of the job's name, the request's bytes and how many
// times the request asked before; the engine's: wwrun/memory/engine.py,
// Engine.wait_at_limit) without its lock, with the GIL (python_call.h). It returns
// true once the job may try again: the plan has room for it, and the jobs hold less
// than ever since it came (a backward's progress, a step's end, a job's end). False:
// the request fails: the job could not fit even alone, or no scheduler plans the
// run. A str: it fails, and the str says why, after the allocator's figures: no
// other job can free memory (of jobs waiting here, the newest gives way and the
// others count on its frees; where its backend can, it parks its pages on the host
// and waits on instead, Note [Parking]), or the jobs' memory did not fall for a bound (every
// job stalled, or one held up by a lock inside torch that the waiting thread
// holds). It fails as memory is then: one more try without waiting, so that frees
// made while the scheduler decided are used, and the message's figures are the
// moment's. When every job waits and none
// can go on, the scheduler makes one give way, the job waiting here first (what
// the callback raises, the allocation raises). When rule f found every job it could
// wait for waiting in the allocator, the callback decides too: it sees every job
// (which has trained, which can start again), where rule f alone failed the latest
// to arrive (a makemore MLP in its last evaluation). Only a
// job's own thread waits here: not the autograd thread, not a thread the job
// started, not a forked child's (a DataLoader worker).
inline PythonCallback& limit_callback() {
  static PythonCallback callback;
  return callback;
}

// The callback's answer: true (try again), false (fail), or a str: fail, and why.
inline WaitHooks::LimitAnswer read_limit_answer(PyObject* result) {
  WaitHooks::LimitAnswer answer;
  if (PyUnicode_Check(result)) {
    const char* why = PyUnicode_AsUTF8(result);
    if (why != nullptr) answer.why = why;
  } else {
    answer.retry = python_truth(result);
  }
  return answer;
}

inline WaitHooks::LimitAnswer wait_at_limit(const std::string& job, std::size_t bytes, int attempt) {
  return limit_callback().call(read_limit_answer, WaitHooks::LimitAnswer{}, "sni", job.c_str(),
                               static_cast<Py_ssize_t>(bytes), attempt);
}

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
  hooks.at_limit = wait_at_limit;
  return hooks;
}

}  // namespace wwrun::alloc

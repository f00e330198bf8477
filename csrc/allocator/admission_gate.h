// Note [Admission at the first allocation]
//
// A job waits for the engine's admission (wwrun/memory/engine.py, Engine.admit)
// at its first allocation on the run's device, not before its script starts: its
// imports, argument parsing and data loading run beside the other jobs, and only
// what would take device memory waits until it fits beside them.
//
// Each job has a gate, closed as its session starts (close_admission) and opened
// once it is admitted (open_admission). Every thread marked as the job's
// (mark_job_thread) shares it. A thread whose gate is closed calls the admission
// callback (a Python callable of the job's name, returning once the job is
// admitted) on torch's allocation path, before the allocator's lock, with the GIL taken and the
// per-job generators' swap lock let go (wait_release.h), as a rule-f wait does:
// the jobs it waits for may need either. What the callback raises (Ctrl-C
// reaching the job while it waits) is raised by the allocation, as torch's
// Python bindings raise a Python error from C++ (python_error): the script sees
// its KeyboardInterrupt where it would under `python`. Open, the check is one
// thread-local load and one atomic load.
#pragma once

#include <Python.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <torch/csrc/Exceptions.h>

#include "wait_release.h"

namespace wwrun::alloc {

struct AdmissionGate {
  std::atomic<bool> closed{false};
  std::string job;
};

inline std::mutex& admission_mutex() {
  static std::mutex mutex;
  return mutex;
}

// The gates of jobs not yet admitted (an open gate is dropped: a thread marked
// later gets a fresh, open one).
inline std::unordered_map<std::string, std::shared_ptr<AdmissionGate>>& admission_gates() {
  static auto* gates = new std::unordered_map<std::string, std::shared_ptr<AdmissionGate>>();
  return *gates;
}

inline std::shared_ptr<AdmissionGate>& thread_gate() {
  thread_local std::shared_ptr<AdmissionGate> gate;
  return gate;
}

inline PyObject*& admission_callback() {
  static PyObject* callback = nullptr;  // a new reference, or null
  return callback;
}

inline std::shared_ptr<AdmissionGate> gate_of(const std::string& job) {
  std::lock_guard<std::mutex> lock(admission_mutex());
  auto& gate = admission_gates()[job];
  if (!gate) {
    gate = std::make_shared<AdmissionGate>();
    gate->job = job;
  }
  return gate;
}

inline void bind_admission_gate(const std::string& job) {
  if (job.empty()) {
    thread_gate().reset();
  } else {
    thread_gate() = gate_of(job);
  }
}

inline void close_admission(const std::string& job) { gate_of(job)->closed.store(true, std::memory_order_release); }

inline void open_admission(const std::string& job) {
  std::lock_guard<std::mutex> lock(admission_mutex());
  auto found = admission_gates().find(job);
  if (found == admission_gates().end()) return;
  found->second->closed.store(false, std::memory_order_release);
  admission_gates().erase(found);
}

// Called with the GIL held (a binding).
inline void set_admission_callback(PyObject* callback) {
  Py_XINCREF(callback);
  PyObject* previous = admission_callback();
  admission_callback() = callback;
  Py_XDECREF(previous);
}

inline void await_admission_slow(AdmissionGate& gate) {
  if (!Py_IsInitialized()) return;
  auto* held = wwrun::current_wait_release();
  if (held) held->release();
  const PyGILState_STATE state = PyGILState_Ensure();
  bool raised = false;
  python_error error;
  if (PyObject* callback = admission_callback()) {
    Py_INCREF(callback);
    PyObject* result = PyObject_CallFunction(callback, "s", gate.job.c_str());
    Py_DECREF(callback);
    if (result == nullptr) {
      error.persist();  // fetched with the GIL: raised again by the binding that called torch
      raised = true;
    }
    Py_XDECREF(result);
  }
  if (held) {  // taken back without the GIL: its next holder may need the GIL while holding it
    PyThreadState* saved = PyEval_SaveThread();
    held->reacquire();
    PyEval_RestoreThread(saved);
  }
  PyGILState_Release(state);
  if (raised) throw std::move(error);
}

// On torch's allocation path, before a job thread allocates: returns once its job
// may (Note [Admission at the first allocation]).
inline void await_admission() {
  AdmissionGate* gate = thread_gate().get();
  if (gate == nullptr || !gate->closed.load(std::memory_order_acquire)) return;
  await_admission_slow(*gate);
}

}  // namespace wwrun::alloc

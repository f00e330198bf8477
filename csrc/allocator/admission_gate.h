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
// admitted) on torch's allocation path, before the allocator's lock
// (python_call.h: with the GIL, the per-job generators' swap lock let go; what
// the callback raises, Ctrl-C reaching the job while it waits, the allocation
// raises). Open, the check is one thread-local load and one atomic load.
#pragma once

#include <Python.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "python_call.h"

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

inline PythonCallback& admission_callback() {
  static PythonCallback callback;
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

inline void await_admission_slow(AdmissionGate& gate) { admission_callback().call(python_truth, false, "s", gate.job.c_str()); }

// On torch's allocation path, before a job thread allocates: returns once its job
// may (Note [Admission at the first allocation]).
inline void await_admission() {
  AdmissionGate* gate = thread_gate().get();
  if (gate == nullptr || !gate->closed.load(std::memory_order_acquire)) return;
  await_admission_slow(*gate);
}

}  // namespace wwrun::alloc

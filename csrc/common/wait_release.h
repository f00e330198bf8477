// What a thread holds that others may need while it waits for memory.
//
// A C++ part of wwrun that holds a lock across a call that may allocate (the
// per-job generators' swap, Note [Swapped draws] in csrc/rng/job_generators.cpp)
// puts a WaitRelease in the thread's c10::ThreadLocalDebugInfo for the call. The
// allocator's wait hooks (csrc/allocator/python_wait_hooks.h) let it go before a
// rule-f wait and take it back after, so that one job's wait for memory never
// stalls the other jobs. The two parts are separate libraries: the object and its
// virtual functions are the whole interface, found by the debug-info kind.
#pragma once

#include <c10/util/ThreadLocalDebugInfo.h>

namespace wwrun {

// The slot: torch uses it only in its own tests.
inline c10::DebugInfoKind wait_release_kind() { return c10::DebugInfoKind::TEST_INFO; }

struct WaitRelease : c10::DebugInfoBase {
  // Called by the waiting thread: before waiting (with no GIL released yet) and
  // after (before the GIL is taken back). Each must be a no-op on other threads
  // (debug info is propagated to threads working for this one).
  virtual void release() = 0;
  virtual void reacquire() = 0;
};

inline WaitRelease* current_wait_release() {
  return static_cast<WaitRelease*>(c10::ThreadLocalDebugInfo::get(wait_release_kind()));
}

}  // namespace wwrun

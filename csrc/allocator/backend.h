// The small device interface the allocator core is written against.
//
// Two implementations: cuda_backend.cpp (the real device) and host_backend.cpp
// (host memory with simulated streams and events, so that every rule of the
// policy in waterwave_allocator.h runs and is tested on a CPU-only machine).
//
// Blocking contract: the core calls segment_alloc, segment_free and
// event_synchronize with its lock released (they may block the host for
// milliseconds); every other call must be non-blocking and may be made under the
// lock.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wwrun::alloc {

// An opaque stream identity: a cudaStream_t cast to an integer on CUDA, a small
// integer chosen by the caller on the host backend.
using StreamId = std::uint64_t;
// An opaque event handle owned by the backend (cudaEvent_t on CUDA).
using EventHandle = void*;

class Backend {
 public:
  virtual ~Backend() = default;

  // Device memory of `bytes` bytes, or nullptr when the device has no more.
  virtual void* segment_alloc(std::size_t bytes) = 0;
  virtual void segment_free(void* ptr, std::size_t bytes) = 0;

  virtual EventHandle event_create() = 0;
  virtual void event_destroy(EventHandle event) = 0;
  // Marks the current end of `stream`'s queued work.
  virtual void event_record(EventHandle event, StreamId stream) = 0;
  // True once all work queued before the record has finished.
  virtual bool event_query(EventHandle event) = 0;
  // Blocks the host until the event has completed.
  virtual void event_synchronize(EventHandle event) = 0;
  // Work queued on `stream` after this call waits for `event` on the device;
  // the host does not block.
  virtual void stream_wait_event(StreamId stream, EventHandle event) = 0;
  // Zeroes `bytes` bytes at `ptr`, ordered on `stream`.
  virtual void memset_zero(void* ptr, std::size_t bytes, StreamId stream) = 0;
};

}  // namespace wwrun::alloc

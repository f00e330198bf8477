// The CUDA backend: segments from cudaMalloc, events without timing, device-side
// waits with cudaStreamWaitEvent, zeroing with cudaMemsetAsync. Uses only the CUDA
// runtime API (no torch header), one backend per device.
#pragma once

#include "backend.h"

namespace wwrun::alloc {

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}

  void* segment_alloc(std::size_t bytes) override;
  void segment_free(void* ptr, std::size_t bytes) override;
  EventHandle event_create() override;
  void event_destroy(EventHandle event) override;
  void event_record(EventHandle event, StreamId stream) override;
  bool event_query(EventHandle event) override;
  void event_synchronize(EventHandle event) override;
  void stream_wait_event(StreamId stream, EventHandle event) override;
  void memset_zero(void* ptr, std::size_t bytes, StreamId stream) override;

  int device() const { return device_; }

 private:
  int device_;
};

}  // namespace wwrun::alloc

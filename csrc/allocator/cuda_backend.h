// The CUDA backend: pages through the driver's virtual memory API (cuMemCreate,
// cuMemAddressReserve, cuMemMap, cuMemSetAccess, cuMemUnmap), events without
// timing, device-side waits with cudaStreamWaitEvent, zeroing with
// cudaMemsetAsync. The driver's entry points are looked up through the runtime
// (cudaGetDriverEntryPoint), so nothing links libcuda; no torch header; one
// backend per device.
#pragma once

#include <mutex>
#include <stdexcept>

#include <cuda.h>

#include "backend.h"

namespace wwrun::alloc {

// Thrown by a call made while the CUDA runtime unloads at process exit: the
// memory goes away with the process, so a free that meets it is a no-op.
class CudartUnloading : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The driver's allocation granularity on current GPUs (checked at the first
// pages_create).
constexpr std::size_t kCudaPageBytes = 2 << 20;

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}

  std::size_t page_bytes() const override { return kCudaPageBytes; }
  bool pages_create(std::size_t count, std::vector<PageHandle>* pages) override;
  void page_release(PageHandle page) override;
  // Not promised by the driver: a page may hold what this process last put there.
  bool fresh_pages_zeroed() const override { return false; }
  void* va_reserve(std::size_t bytes) override;
  void va_release(void* base, std::size_t bytes) override;
  // Reservations are driver calls of their own: made in large pieces.
  std::size_t va_arena_bytes() const override { return std::size_t{1} << 30; }
  void page_map(void* address, PageHandle page) override;
  void page_unmap(void* address, std::size_t bytes) override;
  // In pinned host memory mapped at the page's address, where the driver makes
  // it (can_park: a host location for the virtual memory API, CUDA 12.2 on).
  bool page_park(void* address, PageHandle page) override;
  void page_unpark(void* address, PageHandle page) override;
  bool can_park() override;
  EventHandle event_create() override;
  void event_destroy(EventHandle event) override;
  void event_record(EventHandle event, StreamId stream) override;
  bool event_query(EventHandle event) override;
  void event_synchronize(EventHandle event) override;
  void stream_wait_event(StreamId stream, EventHandle event) override;
  void memset_zero(void* ptr, std::size_t bytes, StreamId stream) override;

  int device() const { return device_; }

 private:
  void* scratch();
  void copy_page(void* to, const void* from);

  int device_;
  std::once_flag host_checked_;
  bool host_pages_ = false;
  CUmemLocation host_location_ = {};  // where parked pages go (can_park)
  std::mutex copy_mutex_;     // the scratch page and the copy stream: one copy at a time
  void* scratch_ = nullptr;   // never given back: one page of address space
  StreamId copy_stream_ = 0;
};

// A new non-blocking stream on `device`, for one job at a time: torch's pool
// (torch.cuda.Stream()) recycles its 32 streams per priority, so a sweep's 33rd
// job would get the 1st job's stream, and jobs are told apart by stream.
StreamId create_job_stream(int device);

}  // namespace wwrun::alloc

// The small device interface the allocator core is written against.
//
// Two implementations: cuda_backend.cpp (the real device, through the driver's
// virtual memory API) and host_backend.cpp (host memory from one memfd, with
// simulated streams and events, so that every rule of the policy in
// waterwave_allocator.h runs and is tested on a CPU-only machine).
//
// Memory is physical pages of page_bytes(), mapped into virtual ranges the core
// reserves (Note [Layouts] in waterwave_allocator.h): a page can be unmapped from
// one range and mapped into another, keeping its contents.
//
// Blocking contract: the core calls pages_create and event_synchronize with its
// lock released (they may block the host for milliseconds); every other call
// must not wait for the device and may be made under the lock (page_release,
// page_map/unmap and va_reserve only on pages and ranges no work uses). Two
// exceptions, as parking is rare and all or none: page_park and page_unpark
// wait for their own copies, and the core waits for a stream before a parked
// copy goes with its last block (Note [Parking] in allocator_core.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wwrun::alloc {

// An opaque stream identity: a cudaStream_t cast to an integer on CUDA, a small
// integer chosen by the caller on the host backend.
using StreamId = std::uint64_t;
// An opaque event handle owned by the backend (cudaEvent_t on CUDA).
using EventHandle = void*;
// An opaque physical page (a CUmemGenericAllocationHandle on CUDA, a page of
// the memfd on the host).
using PageHandle = std::uint64_t;


class Backend {
 public:
  virtual ~Backend() = default;

  // The unit in which memory flows between ranges, streams and jobs: the CUDA
  // driver's allocation granularity on a GPU (cuda_backend.h), a quarter of it
  // on the host (host_backend.h). Fixed for the backend's life.
  virtual std::size_t page_bytes() const = 0;

  // `count` pages of physical memory appended to *pages, all or none: false
  // (nothing appended) when the device has not that many (threads making
  // pages at once must not each get some and all fail).
  virtual bool pages_create(std::size_t count, std::vector<PageHandle>* pages) = 0;
  virtual void page_release(PageHandle page) = 0;
  // True when a page pages_create gives holds zeros (the host's, from the kernel).
  virtual bool fresh_pages_zeroed() const = 0;
  // A virtual range of `bytes` (a multiple of page_bytes()) aligned to
  // page_bytes(), with nothing mapped; nullptr when none can be had.
  virtual void* va_reserve(std::size_t bytes) = 0;
  virtual void va_release(void* base, std::size_t bytes) = 0;
  // The least the core reserves at once (it carves ranges out of a reservation).
  virtual std::size_t va_arena_bytes() const = 0;
  // Maps `page` at `address` (page-aligned, reserved, unmapped), readable and
  // writable; unmaps every page in [address, address + bytes). The core unmaps
  // a page only once the work queued on it has completed.
  virtual void page_map(void* address, PageHandle page) = 0;
  virtual void page_unmap(void* address, std::size_t bytes) = 0;
  // Parking (Note [Parking] in allocator_core.cpp). page_park replaces `page`,
  // mapped at `address`, there by a copy of its bytes in host memory outside
  // the budget, and unmaps the page (which keeps its bytes); false, with nothing
  // changed, where the backend cannot. page_unpark puts the parked bytes at
  // `address` in `page` and maps it there, over the copy; page_unmap lets a
  // copy go. Only on pages no work uses.
  virtual bool page_park(void* /*address*/, PageHandle /*page*/) { return false; }
  virtual bool can_park() { return false; }  // false: page_park always is
  virtual void page_unpark(void* /*address*/, PageHandle /*page*/) {}

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

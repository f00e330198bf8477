// A backend on host memory with simulated streams and events, so that every rule
// of the allocator runs on a CPU-only machine.
//
// Pages: one memfd holds every page (page i at offset i * kHostPageBytes), so a page
// can be mapped at any address (mmap MAP_FIXED|MAP_SHARED over a PROT_NONE
// reservation) and keeps its contents when it moves, as a CUDA page does. A
// released page is punched out of the file (fallocate PUNCH_HOLE): its memory
// goes back to the kernel, and the page comes back zeroed when created again.
// `capacity` bytes make capacity / kHostPageBytes pages.
//
// A page is 512 KiB here, a quarter of a GPU's: the CPU runs budgets of tens to
// hundreds of MiB where a GPU has tens of GiB, and a page as coarse as the
// driver's would weigh ~30x more against them (a job's partly used last pages:
// the quickstart's transformer held 24 MiB of pages for 20.6 MiB of blocks, 21
// with these). Each page is one mmap, so smaller ones would cost more calls and
// mappings (vm.max_map_count) for little.
//
// A page cut out of a range is moved, not unmapped: mremap carries its page table
// entries to the page's slot in a shelf, and back out to wherever it is
// mapped next. Unmapping it and mapping it again (MAP_POPULATE) walked its 128
// entries twice, tearing down and rebuilding each: with three jobs taking turns
// under a budget for two (benchmarks/waterwave.py's part (b)) the kernel took 11%
// of the process's CPU that way, 6% with moves. A shelved page is a mapping of its
// own: at most a quarter of vm.max_map_count are shelved, the rest are unmapped.
//
// Simulation: each stream has a count of events recorded on it and a count of
// events completed. A stream is "running" unless a test holds it: events recorded
// on a running stream complete at once; on a held stream they stay pending until
// complete(stream). event_synchronize completes the stream up to the event, as a
// host that waited would observe. Device-side waits and memsets are logged so
// tests can check that no block reached another stream unsafely.
#pragma once

#include <cstdint>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backend.h"

namespace wwrun::alloc {

struct HostEvent {
  StreamId stream = 0;
  std::uint64_t seq = 0;  // 0: never recorded
};

// (waiting stream, stream of the event, seq of the event)
using WaitRecord = std::tuple<StreamId, StreamId, std::uint64_t>;

constexpr std::size_t kHostPageBytes = 512 << 10;

class HostBackend : public Backend {
 public:
  explicit HostBackend(std::size_t capacity_bytes);
  ~HostBackend() override;

  std::size_t page_bytes() const override { return kHostPageBytes; }

  bool pages_create(std::size_t count, std::vector<PageHandle>* pages) override;
  void page_release(PageHandle page) override;
  bool fresh_pages_zeroed() const override { return true; }
  void* va_reserve(std::size_t bytes) override;
  void va_release(void* base, std::size_t bytes) override;
  // Exactly what a range needs, and at most va_budget_ in all (see its note).
  std::size_t va_arena_bytes() const override { return 0; }
  void page_map(void* address, PageHandle page) override;
  void page_unmap(void* address, std::size_t bytes) override;
  bool page_park(void* address, PageHandle page) override;
  bool can_park() override { return !forked_; }
  void page_unpark(void* address, PageHandle page) override;
  EventHandle event_create() override;
  void event_destroy(EventHandle event) override;
  void event_record(EventHandle event, StreamId stream) override;
  bool event_query(EventHandle event) override;
  void event_synchronize(EventHandle event) override;
  void stream_wait_event(StreamId stream, EventHandle event) override;
  void memset_zero(void* ptr, std::size_t bytes, StreamId stream) override;

  // Test controls.
  void hold(StreamId stream);
  void complete(StreamId stream);  // completes its events so far and releases the hold
  std::uint64_t last_seq(StreamId stream);
  std::uint64_t completed_seq(StreamId stream);
  std::vector<WaitRecord> waits();
  std::size_t used_bytes();
  std::size_t capacity() const { return capacity_; }
  // Around fork(), as MemoryFlowAllocator (taken after the allocator's lock).
  void before_fork() { mutex_.lock(); }
  void after_fork_in_parent() { mutex_.unlock(); }
  // In a forked child (Note [Pages after fork] in host_backend.cpp): a lock another
  // parent thread held is remade, every mapped page becomes the child's own
  // copy-on-write view, and pages are no longer punched out of the shared memfd.
  void reset_after_fork();

 private:
  struct SimStream {
    bool held = false;
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
  };
  std::mutex mutex_;
  std::size_t capacity_;
  std::size_t used_ = 0;
  int fd_ = -1;
  std::uint64_t next_page_ = 0;         // pages [0, next_page_) have been handed out once
  std::vector<PageHandle> free_pages_;  // released, punched
  bool forked_ = false;
  std::unordered_map<std::uintptr_t, PageHandle> mapped_;  // page address -> page
  // Page i's slot is shelf_ + i * kHostPageBytes; shelved_[i]: it is mapped there.
  char* shelf_ = nullptr;
  std::vector<bool> shelved_;
  std::size_t shelved_count_ = 0;
  std::size_t max_shelved_ = 0;
  bool shelve(std::uintptr_t address, PageHandle page);
  void unshelve(PageHandle page);
  std::size_t va_reserved_ = 0;
  // Address space the ranges may reserve. Each job's ranges keep their extent and
  // room while their pages are cut out (Note [Layouts]), so they need much more
  // than the capacity: sixteen times it and 64 GiB (reserved PROT_NONE and
  // MAP_NORESERVE, it costs no memory), or, under an RLIMIT_AS (`ulimit -v`,
  // which threads' stacks need too), the capacity and an eighth (at 512 MiB the
  // eighth alone failed a request with 71 pages free).
  std::size_t va_budget_;
  std::unordered_map<StreamId, SimStream> streams_;
  std::vector<WaitRecord> waits_;
};

}  // namespace wwrun::alloc

// Host memory backend; see host_backend.h for the simulation.
#include "host_backend.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "size_classes.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux 5.7, for shared mappings 5.13: older kernels refuse it
#endif

namespace wwrun::alloc {

namespace {

// Moves one page's mapping (and its page table entries) from `from` to `to`,
// replacing the reservation there. The mapping at `from` stays, emptied, so no
// other mmap of the process can land in a hole meanwhile; the caller reserves it
// again (PROT_NONE). False where the kernel cannot.
bool move_page(void* from, void* to) {
  return ::mremap(from, kHostPageBytes, kHostPageBytes, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP,
                  to) != MAP_FAILED;
}

[[noreturn]] void fail(const char* what) {
  throw std::runtime_error(std::string("wwrun allocator: ") + what + ": " + std::strerror(errno));
}

// Address space only again, over a mapping of ours: no page behind it.
void reserve(void* address, std::size_t bytes, const char* what) {
  if (::mmap(address, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) ==
      MAP_FAILED) {
    fail(what);
  }
}

}  // namespace

HostBackend::HostBackend(std::size_t capacity_bytes) : capacity_(capacity_bytes) {
  rlimit address_space{};
  const bool unlimited =
      ::getrlimit(RLIMIT_AS, &address_space) == 0 && address_space.rlim_cur == RLIM_INFINITY;
  va_budget_ = unlimited ? 16 * capacity_ + (std::size_t{64} << 30) : capacity_ + capacity_ / 8;
  fd_ = ::memfd_create("wwrun-pages", MFD_CLOEXEC);
  if (fd_ < 0) fail("memfd_create");
  // Sparse: a page takes memory only once written.
  const std::size_t pages = capacity_ / kHostPageBytes;
  if (::ftruncate(fd_, static_cast<off_t>(pages * kHostPageBytes)) != 0) fail("ftruncate");
  // The shelf: address space only (PROT_NONE, MAP_NORESERVE), but a capacity's worth
  // more, so not under an RLIMIT_AS, where the ranges need it (va_budget_). Without it
  // a page cut out of a range is unmapped, and populated again where it goes next.
  void* shelf = unlimited && pages > 0 ? ::mmap(nullptr, pages * kHostPageBytes, PROT_NONE,
                                                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                                       : MAP_FAILED;
  if (shelf != MAP_FAILED) {
    shelf_ = static_cast<char*>(shelf);
    shelved_.assign(pages, false);
  }
  // A shelved page is a mapping of its own, as each mapped page is: shelving keeps to
  // a quarter of the kernel's limit on a process's mappings (vm.max_map_count).
  std::size_t max_maps = 65530;
  if (std::FILE* limit = std::fopen("/proc/sys/vm/max_map_count", "r")) {
    unsigned long value = 0;
    if (std::fscanf(limit, "%lu", &value) == 1 && value > 0) max_maps = value;
    std::fclose(limit);
  }
  max_shelved_ = max_maps / 4;
}

HostBackend::~HostBackend() {
  if (shelf_ != nullptr) ::munmap(shelf_, shelved_.size() * kHostPageBytes);
  ::close(fd_);
}

// Moves the page mapped at `address` to its shelf slot; `address` is reserved
// again. False where the kernel cannot (the caller then unmaps it).
bool HostBackend::shelve(std::uintptr_t address, PageHandle page) {
  if (shelf_ == nullptr || forked_ || page >= shelved_.size() || shelved_count_ >= max_shelved_) return false;
  if (!move_page(reinterpret_cast<void*>(address), shelf_ + page * kHostPageBytes)) return false;
  shelved_[page] = true;
  ++shelved_count_;
  reserve(reinterpret_cast<void*>(address), kHostPageBytes, "mmap PROT_NONE over a shelved page's place");
  return true;
}

// The page leaves its shelf slot (mapped elsewhere, or released): the slot is
// address space again.
void HostBackend::unshelve(PageHandle page) {
  if (page >= shelved_.size() || !shelved_[page]) return;
  reserve(shelf_ + page * kHostPageBytes, kHostPageBytes, "mmap PROT_NONE over a shelf slot");
  shelved_[page] = false;
  --shelved_count_;
}

bool HostBackend::pages_create(std::size_t count, std::vector<PageHandle>* pages) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (used_ + count * kHostPageBytes > capacity_) return false;
  for (std::size_t i = 0; i < count; ++i) {
    if (!free_pages_.empty()) {
      pages->push_back(free_pages_.back());
      free_pages_.pop_back();
    } else {
      pages->push_back(next_page_++);
    }
  }
  used_ += count * kHostPageBytes;
  return true;
}

void HostBackend::page_release(PageHandle page) {
  // Back to the kernel, and zeroed for its next use. A forked child shares the
  // file with its parent, whose data this page may still hold: only forgotten.
  if (!forked_) {
    std::lock_guard<std::mutex> lock(mutex_);
    unshelve(page);
  }
  if (!forked_ && ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                              static_cast<off_t>(page * kHostPageBytes), kHostPageBytes) != 0) {
    fail("fallocate(PUNCH_HOLE)");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  free_pages_.push_back(page);
  used_ -= kHostPageBytes;
}

void* HostBackend::va_reserve(std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (va_reserved_ + bytes > va_budget_) return nullptr;
    va_reserved_ += bytes;
  }
  // Over-reserved by a page, then trimmed to a page-aligned range.
  const std::size_t span = bytes + kHostPageBytes;
  void* raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    std::lock_guard<std::mutex> lock(mutex_);
    va_reserved_ -= bytes;
    return nullptr;
  }
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t base = (start + kHostPageBytes - 1) / kHostPageBytes * kHostPageBytes;
  if (base > start) ::munmap(raw, base - start);
  const std::uintptr_t tail = start + span - (base + bytes);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(base + bytes), tail);
  return reinterpret_cast<void*>(base);
}

void HostBackend::va_release(void* base, std::size_t bytes) {
  ::munmap(base, bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  va_reserved_ -= bytes;
}

void HostBackend::page_map(void* address, PageHandle page) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!forked_ && page < shelved_.size() && shelved_[page]) {
    // Its page table entries move with it, over the reservation at `address`.
    const bool moved = move_page(shelf_ + page * kHostPageBytes, address);
    unshelve(page);
    if (moved) {
      mapped_[reinterpret_cast<std::uintptr_t>(address)] = page;
      return;
    }
  }
  // A forked child maps fresh anonymous memory: the memfd's pages are its parent's.
  void* got = forked_ ? ::mmap(address, kHostPageBytes, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
                      : ::mmap(address, kHostPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE,
                               fd_, static_cast<off_t>(page * kHostPageBytes));
  if (got == MAP_FAILED) fail("mmap of a page");
  mapped_[reinterpret_cast<std::uintptr_t>(address)] = page;
}

void HostBackend::page_unmap(void* address, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The range stays reserved (PROT_NONE), as a CUDA reservation does; each page
  // goes to its shelf slot, where its next page_map finds it.
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  if (shelf_ == nullptr || forked_) {  // no shelf: the run in one call
    reserve(address, bytes, "mmap PROT_NONE over pages");
    for (std::uintptr_t at = start; at < start + bytes; at += kHostPageBytes) mapped_.erase(at);
    return;
  }
  for (std::uintptr_t at = start; at < start + bytes; at += kHostPageBytes) {
    auto found = mapped_.find(at);
    if (found == mapped_.end() || !shelve(at, found->second)) {
      reserve(reinterpret_cast<void*>(at), kHostPageBytes, "mmap PROT_NONE over pages");
    }
    if (found != mapped_.end()) mapped_.erase(found);
  }
}

// Parking: the copy is anonymous memory, moved over the page's place in one
// mremap, so that the bytes are there at every moment; the page, unmapped, keeps
// its bytes in the memfd. Unparking writes the copy's bytes into the page and maps
// the page over the copy. A forked child (a DataLoader worker) parks nothing.
bool HostBackend::page_park(void* address, PageHandle /*page*/) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (forked_) return false;
  void* copy = ::mmap(nullptr, kHostPageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (copy == MAP_FAILED) return false;
  std::memcpy(copy, address, kHostPageBytes);
  if (::mremap(copy, kHostPageBytes, kHostPageBytes, MREMAP_MAYMOVE | MREMAP_FIXED, address) == MAP_FAILED) {
    ::munmap(copy, kHostPageBytes);
    return false;
  }
  mapped_.erase(reinterpret_cast<std::uintptr_t>(address));
  return true;
}

void HostBackend::page_unpark(void* address, PageHandle page) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto offset = static_cast<off_t>(page * kHostPageBytes);
    if (::pwrite(fd_, address, kHostPageBytes, offset) != static_cast<ssize_t>(kHostPageBytes)) {
      fail("pwrite of a parked page");
    }
  }
  page_map(address, page);
}

// Note [Pages after fork]: fork() copies a process's private memory copy-on-write,
// but MAP_SHARED pages stay shared, so a DataLoader worker's in-place write to a
// tensor made before the fork (a dataset transform) reached the parent's jobs, and
// theirs the worker. In the child every mapped page is mapped again MAP_PRIVATE
// from the same memfd offset: no copy is made, and the first write to a page gives
// the child its own copy, as fork() does for anonymous memory. (A page the child
// has not written still shows later writes by the parent, where fork() would keep
// the content it had: only memory the parent has freed and reused differs, and
// the child's pre-fork tensors are the parent's too, so it keeps them alive.)
// The child allocates from the previous allocator (cpu_allocator.cpp); pages it
// maps anew are anonymous, and none is punched out of the parent's file.
void HostBackend::reset_after_fork() {
  new (&mutex_) std::mutex();
  forked_ = true;
  for (const auto& [address, page] : mapped_) {
    void* got = ::mmap(reinterpret_cast<void*>(address), kHostPageBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_FIXED, fd_, static_cast<off_t>(page * kHostPageBytes));
    if (got == MAP_FAILED) {  // in a child of fork(): say it, as the rest cannot be undone
      std::fprintf(stderr, "wwrun allocator: a page stays shared with the parent after fork: %s\n",
                   std::strerror(errno));
    }
  }
}

EventHandle HostBackend::event_create() { return new HostEvent; }

void HostBackend::event_destroy(EventHandle event) { delete static_cast<HostEvent*>(event); }

void HostBackend::event_record(EventHandle handle, StreamId stream) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  SimStream& sim = streams_[stream];
  event->stream = stream;
  event->seq = ++sim.recorded;
  if (!sim.held) sim.completed = sim.recorded;
}

bool HostBackend::event_query(EventHandle handle) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_[event->stream].completed >= event->seq;
}

void HostBackend::event_synchronize(EventHandle handle) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  SimStream& sim = streams_[event->stream];
  if (sim.completed < event->seq) sim.completed = event->seq;
}

void HostBackend::stream_wait_event(StreamId stream, EventHandle handle) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  waits_.emplace_back(stream, event->stream, event->seq);
}

void HostBackend::memset_zero(void* ptr, std::size_t bytes, StreamId /*stream*/) {
  std::memset(ptr, 0, bytes);
}

void HostBackend::hold(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  streams_[stream].held = true;
}

void HostBackend::complete(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  SimStream& sim = streams_[stream];
  sim.held = false;
  sim.completed = sim.recorded;
}

std::uint64_t HostBackend::last_seq(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_[stream].recorded;
}

std::uint64_t HostBackend::completed_seq(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_[stream].completed;
}

std::vector<WaitRecord> HostBackend::waits() {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_;
}

std::size_t HostBackend::used_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

}  // namespace wwrun::alloc

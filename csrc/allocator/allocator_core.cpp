// The backend-agnostic core of the memory-flow allocator: the policy a-g, split
// and coalesce, events, accounting. See waterwave_allocator.h for the policy and
// the invariants; this file follows it rule by rule.
#include <new>
#include <stdexcept>
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <unordered_set>

#include "waterwave_allocator.h"

namespace wwrun::alloc {

namespace {

JobId combine_owners(JobId a, JobId b) {
  if (a == b || b == kClean) return a;
  if (a == kClean) return b;
  return kMixed;
}

std::string format_bytes(std::int64_t bytes) {
  char text[64];
  const double mib = static_cast<double>(bytes) / (1 << 20);
  std::snprintf(text, sizeof(text), "%.2f MiB", mib);
  return text;
}

}  // namespace

MemoryFlowAllocator::MemoryFlowAllocator(Backend& backend, Options options)
    : backend_(backend), options_(options) {
  JobStats default_job;
  default_job.name = "default";
  jobs_.push_back(default_job);
}

MemoryFlowAllocator::~MemoryFlowAllocator() {
  // Only host allocators are destroyed (the CUDA one lives as long as the
  // process), so the device is idle here: no event needs waiting for.
  for (auto& [base, segment] : segments_) {
    for (Block* block = segment->head; block != nullptr;) {
      Block* next = block->next;
      if (block->event != nullptr) unref(block->event);
      for (EventRef* event : block->deferred_events) unref(event);
      delete block;
      block = next;
    }
    backend_.page_unmap(segment->base, segment->size);
    for (PageHandle page : segment->pages) backend_.page_release(page);
    delete segment;
  }
  for (const FreePage& page : free_pages_) backend_.page_release(page.handle);
  for (auto& [base, bytes] : arenas_) backend_.va_release(base, bytes);
  for (EventRef* event : event_pool_) {
    backend_.event_destroy(event->handle);
    delete event;
  }
}

// ---------------------------------------------------------------------------
// Allocation: rules a-g
// ---------------------------------------------------------------------------

Allocation MemoryFlowAllocator::allocate(std::size_t bytes, StreamId stream) {
  const std::size_t size = round_size(bytes);
  if (size < bytes) throw std::invalid_argument("allocation size overflows");
  Allocation out;
  Lock lock(mutex_);
  note_stream(stream);
  const JobId job = job_for_allocation_locked(stream);
  auto check_limit = [&] {
    if (over_limit(job, size)) {
      out_of_memory(job, bytes, size,
                    "it would exceed the job's memory limit of " +
                        format_bytes(static_cast<std::int64_t>(jobs_[job].limit)));
    }
  };
  check_limit();

  int stage = kRuleA;  // the furthest rule this request has reached
  std::chrono::steady_clock::time_point deadline;
  std::string why_not_wait;  // set when rule f finds a deadlock
  bool waited_for_reserving = false;
  Block* block = nullptr;
  for (;;) {
    block = take_free_block(pool_for(size), size, stream, out);  // rules a, b, c
    if (block != nullptr) break;

    // d. a range grown in place, else a new one of the pages the request needs
    // (Note [Pages]). Idle pages before fresh ones.
    const std::size_t pages = range_bytes(size) / kPageBytes;
    if (free_pages_.size() < pages) cut_idle_pages(pages - free_pages_.size(), job);
    block = grow_range(lock, size, stream, job);
    if (block == nullptr) block = new_range(lock, size, stream, job);
    if (block != nullptr) {
      out.rule = kRuleD;
      break;
    }

    // e. empty pages anywhere back to the budget, then d again (Note [Pages]).
    // Each pass that gains pages loops; one that gains none goes on to f.
    std::size_t room = free_pages_.size();
    if (options_.reserved_limit != 0) {
      const std::size_t held = static_cast<std::size_t>(stats_.reserved_bytes.current) +
                               reserving_bytes_;
      if (held < options_.reserved_limit) room += (options_.reserved_limit - held) / kPageBytes;
    }
    if (stage < kRuleE) {
      stage = kRuleE;
      ++stats_.num_alloc_retries;
    }
    if (harvest_pages(lock, pages > room ? pages - room : 1, job) > 0) continue;
    // Pages another thread is making a range of are neither free nor in a
    // range yet: its range's empty pages may be ours once it is in (bounded).
    if (reserving_bytes_ > 0 && !waited_for_reserving) {
      waited_for_reserving = true;
      freed_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return reserving_bytes_ == 0; });
      continue;
    }
    block = borrow_free_block(size, stream, out);
    if (block != nullptr) break;
    // f. wait, bounded, for the frees of jobs that are about to release memory.
    if (stage < kRuleF) {
      stage = kRuleF;
      ++stats_.num_alloc_retries;
      deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(options_.release_wait_s));
    }
    if (wait_for_releases(lock, job, deadline, why_not_wait)) continue;

    // g. Said as it is now: whole free pages (none can be cut out of a free
    // block here, or e would have), and the limit if that is what stops d.
    if (why_not_wait.empty()) {
      const std::size_t free_pages = free_whole_pages_locked();
      std::ostringstream why;
      if (!within_reserved_limit(pages > free_pages ? (pages - free_pages) * kPageBytes : 0)) {
        why << "the device memory limit of "
            << format_bytes(static_cast<std::int64_t>(options_.reserved_limit)) << " is reached";
      } else {
        why << "the device gave no more pages";
      }
      why << " (it needs " << pages << " pages of " << format_bytes(kPageBytes) << "; "
          << free_pages << " reserved ones are free)";
      why_not_wait = why.str();
    }
    out_of_memory(job, bytes, size, why_not_wait);
  }

  // The lock may have been released above (d, e, f), and another thread of the
  // same job (e.g. the autograd thread) may have allocated meanwhile.
  check_limit();
  out.rule = static_cast<Rule>(std::max<int>(stage, out.rule));
  ++stats_.rule_count[out.rule];
  carve(block, size, bytes, stream, job, out);
  lock.unlock();
  // The block is ours alone now; zero it on our stream, after any wait issued
  // in carve, so the job's first kernel sees zeros. One range: a memset, not a
  // fused launch; ended jobs' blocks come clean already (Note [Batched scrub]).
  if (out.zeroed) backend_.memset_zero(out.ptr, out.size, stream);
  return out;
}

bool MemoryFlowAllocator::within_reserved_limit(std::size_t segment_bytes) const {
  return options_.reserved_limit == 0 ||
         static_cast<std::size_t>(stats_.reserved_bytes.current) + reserving_bytes_ +
                 segment_bytes <=
             options_.reserved_limit;
}

Block* MemoryFlowAllocator::take_free_block(Pool& pool, std::size_t size, StreamId stream,
                                            Allocation& out) {
  // a. last used on this stream: stream order makes it safe at once.
  auto own = pool.pending.find(stream);
  if (own != pool.pending.end()) {
    auto it = own->second.by_size.lower_bound(size);
    if (it != own->second.by_size.end()) {
      out.rule = kRuleA;
      return *it;
    }
  }
  // b. any block whose event completed.
  process_events_locked();
  auto it = pool.ready.lower_bound(size);
  if (it != pool.ready.end()) {
    out.rule = kRuleB;
    return *it;
  }
  // c. pending on another stream: the oldest event first.
  Block* block = take_pending_from_other_streams(pool, size, stream);
  if (block != nullptr) out.rule = kRuleC;
  return block;
}

// Note [Borrowing]. Each size class keeps to its own ranges, so that long-lived
// small blocks do not split the holes large requests need. But when no range
// can be had (the limit is reached, and rule e found no whole page), a request
// that fails while another class's range has a free block for it would fail a
// job for the sake of tidiness: it takes that block (split; the rest stays in
// its class), before any wait (rule f). Larger classes first; then smaller ones,
// whose 2 MiB ranges, partly held by long-lived tiny blocks, may hold the rest
// of the free memory in pieces too small for a page but not for the request.
Block* MemoryFlowAllocator::borrow_free_block(std::size_t size, StreamId stream,
                                              Allocation& out) {
  const int own = pool_index(size);
  for (int step = 1; step < kPoolCount; ++step) {
    const int kind = own + step < kPoolCount ? own + step : kPoolCount - 1 - step;
    if (kind < 0 || kind == own) continue;
    Block* block = take_free_block(pools_[kind], size, stream, out);
    if (block != nullptr) {
      ++stats_.num_borrows;
      return block;
    }
  }
  return nullptr;
}

Block* MemoryFlowAllocator::take_pending_from_other_streams(Pool& pool, std::size_t size,
                                                            StreamId stream) {
  Block* best = nullptr;
  for (auto& [other, stream_pool] : pool.pending) {
    if (other == stream) continue;
    for (Block* block = stream_pool.fifo_head; block != nullptr; block = block->fifo_next) {
      if (block->size < size) continue;
      if (best == nullptr || block->event->serial < best->event->serial) best = block;
      break;  // later blocks of this stream have younger events
    }
  }
  return best;
}

// ---------------------------------------------------------------------------
// Pages (Note [Pages])
// ---------------------------------------------------------------------------

// Whether a page (or block) holding `owner`'s data is zeroed for `job`: unless
// clean or provably the job's (Note [Side streams]: the default job's data may
// be any unregistered stream's).
static bool needs_zeroing(JobId owner, JobId job) {
  return owner != kClean && (owner != job || job == kDefaultJob);
}

// `count` pages for `job`: the budget's free pages first (the job's own and
// clean ones before others'), then fresh ones within the limit, made with the
// lock released (Note [Locking]). False, with nothing changed, when they do not
// suffice.
bool MemoryFlowAllocator::take_pages(Lock& lock, std::size_t count, JobId job,
                                     std::vector<FreePage>& pages) {
  const std::size_t reused = std::min(count, free_pages_.size());
  const std::size_t fresh = count - reused;
  if (fresh > 0 && !within_reserved_limit(fresh * kPageBytes)) return false;
  std::stable_partition(free_pages_.begin(), free_pages_.end(),
                        [&](const FreePage& page) { return needs_zeroing(page.owner, job); });
  pages.assign(free_pages_.end() - static_cast<std::ptrdiff_t>(reused), free_pages_.end());
  free_pages_.resize(free_pages_.size() - reused);
  if (fresh == 0) return true;
  std::vector<PageHandle> made;
  bool complete = false;
  reserving_bytes_ += fresh * kPageBytes;
  lock.unlock();
  try {
    complete = backend_.pages_create(fresh, &made);
  } catch (...) {
    lock.lock();
    reserving_bytes_ -= fresh * kPageBytes;
    free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
    throw;
  }
  lock.lock();
  reserving_bytes_ -= fresh * kPageBytes;
  if (reserving_bytes_ == 0) freed_cv_.notify_all();  // see allocate, before f
  if (!complete) {
    free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
    pages.clear();
    return false;
  }
  const JobId fresh_owner = backend_.fresh_pages_zeroed() ? kClean : kMixed;
  for (PageHandle handle : made) pages.push_back({handle, fresh_owner});
  update_stat(stats_.reserved_bytes, static_cast<std::int64_t>(fresh * kPageBytes));
  return true;
}

// Maps `pages` at consecutive addresses from `at`, for `job`: `owner` becomes
// whose data the mapped memory holds, and `zero_runs` the runs of pages the
// caller zeroes (on its stream, with the lock released) because they held
// another job's data or are fresh pages the device does not zero.
void MemoryFlowAllocator::map_pages(char* at, const std::vector<FreePage>& pages, JobId job,
                                    JobId& owner, ZeroRuns& zero_runs) {
  const JobId fresh_owner = backend_.fresh_pages_zeroed() ? kClean : kMixed;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    char* page = at + i * kPageBytes;
    backend_.page_map(page, pages[i].handle);
    if (!needs_zeroing(pages[i].owner, job)) {
      owner = combine_owners(owner, pages[i].owner);
      continue;
    }
    // Fresh pages a device hands out unzeroed are kMixed: counted apart.
    if (pages[i].owner == fresh_owner) {
      stats_.fresh_scrubbed_bytes += static_cast<std::int64_t>(kPageBytes);
    } else {
      stats_.scrubbed_bytes += static_cast<std::int64_t>(kPageBytes);
      jobs_[job].scrubbed_bytes += static_cast<std::int64_t>(kPageBytes);
    }
    if (!zero_runs.empty() && zero_runs.back().first + zero_runs.back().second == page) {
      zero_runs.back().second += kPageBytes;
    } else {
      zero_runs.emplace_back(page, kPageBytes);
    }
  }
}

// Rule d: a range of the pages a request of `size` needs, for `job` on `stream`
// (take_pages); nullptr, with nothing changed, when the pages do not suffice.
// It gets virtual room to grow into (grow_range): its class's (range_room), at
// least as much again as its pages. Pages holding another job's data are
// zeroed on `stream`, and the range's block is pending behind that zeroing.
Block* MemoryFlowAllocator::new_range(Lock& lock, std::size_t size, StreamId stream, JobId job) {
  const std::size_t bytes = range_bytes(size);
  const PoolIndex kind = pool_index(size);
  std::size_t room = std::max(range_room(size), bytes + std::min(bytes, kGrowBytes));
  char* base = va_take(room);
  if (base == nullptr && room > bytes) base = va_take(room = bytes);  // no room to grow, then
  if (base == nullptr) return nullptr;
  std::vector<FreePage> pages;
  try {
    if (!take_pages(lock, bytes / kPageBytes, job, pages)) {
      va_give(base, room);
      return nullptr;
    }
  } catch (...) {
    va_give(base, room);
    throw;
  }
  JobId owner = kClean;
  ZeroRuns runs;
  map_pages(base, pages, job, owner, runs);
  // Zeroed after the lock is released: the range is in no pool yet, so no
  // other thread can reach it.
  if (!runs.empty()) {
    lock.unlock();
    for (const auto& [at, length] : runs) backend_.memset_zero(at, length, stream);
    lock.lock();
  }
  std::vector<PageHandle> handles;
  for (const FreePage& page : pages) handles.push_back(page.handle);
  auto* segment = new Segment{base, bytes, nullptr, kind, stream, std::move(handles), base + room};
  auto* block = new Block;
  block->ptr = segment->base;
  block->size = bytes;
  block->segment = segment;
  block->stream = stream;
  block->owner = owner;
  segment->head = block;
  segments_.emplace(segment->base, segment);
  update_stat(stats_.segments, 1);
  if (runs.empty()) {
    pool_of(block).ready.insert(block);
    return block;
  }
  // Pending on `stream` behind the zeroing just queued there.
  block->event = new_event(stream);
  StreamPool& pool = pool_of(block).pending[stream];
  pool.by_size.insert(block);
  fifo_push_after(pool, pool.fifo_tail, block);
  count_pending(static_cast<std::int64_t>(bytes));
  return block;
}

// Rule d, first: a range of the request's class whose last block is free and
// safe for `stream` at once (ready, or last used on it) grows in place by the
// pages the request lacks, mapped in its virtual room; the grown block is
// returned in its pool. nullptr when no range can grow or the pages do not
// suffice. While pages are made the block is held apart (marked allocated, in
// no pool), so that nothing takes, merges or cuts it.
Block* MemoryFlowAllocator::grow_range(Lock& lock, std::size_t size, StreamId stream, JobId job) {
  Block* tail = nullptr;
  std::size_t count = 0;
  for (auto& [base, segment] : segments_) {
    if (segment->pool != pool_index(size)) continue;
    Block* last = segment->head;
    while (last->next != nullptr) last = last->next;
    if (!is_idle_free(last) || (last->event != nullptr && last->stream != stream)) continue;
    if (last->size >= size) continue;  // a-c would have found it
    const std::size_t lacking = (size - last->size + kPageBytes - 1) / kPageBytes;
    char* end = segment->base + segment->size;
    if (end + lacking * kPageBytes > segment->va_end) continue;
    if (tail == nullptr || last->size > tail->size) {
      tail = last;
      count = lacking;
    }
  }
  if (tail == nullptr) return nullptr;
  unlink_free(tail);
  tail->allocated = true;  // held apart while the lock is released
  std::vector<FreePage> pages;
  bool got = false;
  try {
    got = take_pages(lock, count, job, pages);
  } catch (...) {
    tail->allocated = false;
    relink_free(tail);
    throw;
  }
  // The range may have been split meanwhile (cut_pages): the tail's is its own.
  Segment* segment = tail->segment;
  ZeroRuns runs;
  if (got) {
    char* end = segment->base + segment->size;
    map_pages(end, pages, job, tail->owner, runs);
    for (const FreePage& page : pages) segment->pages.push_back(page.handle);
    segment->size += count * kPageBytes;
    if (tail->event != nullptr) count_pending(static_cast<std::int64_t>(count * kPageBytes));
    tail->size += count * kPageBytes;
    if (!runs.empty()) {
      lock.unlock();
      for (const auto& [at, length] : runs) backend_.memset_zero(at, length, stream);
      lock.lock();
    }
  }
  tail->allocated = false;
  // Back in its pool, as it was or grown; pending pages zeroed on `stream` are
  // covered: only `stream` takes it at once (it is ready, or pending on it).
  relink_free(tail);
  return got ? tail : nullptr;
}

// The whole pages inside a block of a range.
std::size_t MemoryFlowAllocator::whole_pages(const Block* block) {
  const std::size_t start = static_cast<std::size_t>(block->ptr - block->segment->base);
  const std::size_t first = (start + kPageBytes - 1) / kPageBytes;
  const std::size_t last = (start + block->size) / kPageBytes;
  return last > first ? last - first : 0;
}

// Rule e: at least `wanted` pages back to the budget if free blocks hold them:
// cut out of ready free blocks (cut_idle_pages), then, if short, after waiting
// for the events of pending ones. Returns the pages gained.
std::size_t MemoryFlowAllocator::harvest_pages(Lock& lock, std::size_t wanted, JobId job) {
  std::size_t gained = cut_idle_pages(wanted, job);
  // Recording lazily held events may alone make blocks ready: look again
  // whether or not there was anything to wait for.
  if (gained < wanted) {
    wait_for_pending_pages(lock, std::nullopt);
    gained += cut_idle_pages(wanted - gained, job);
  }
  return gained;
}

// At least `wanted` pages back to the budget, if ready free blocks hold them:
// the job's own first, then clean ones, then others', largest first. Returns
// the pages gained.
std::size_t MemoryFlowAllocator::cut_idle_pages(std::size_t wanted, JobId job) {
  process_events_locked();
  std::vector<Block*> candidates;
  for (Pool& kind : pools_) {
    for (Block* block : kind.ready) {
      if (whole_pages(block) > 0) candidates.push_back(block);
    }
  }
  const auto rank = [job](const Block* block) {
    return block->owner == job ? 0 : block->owner == kClean ? 1 : 2;
  };
  std::stable_sort(candidates.begin(), candidates.end(), [&](const Block* x, const Block* y) {
    return rank(x) != rank(y) ? rank(x) < rank(y) : x->size > y->size;
  });
  std::size_t gained = 0;
  for (Block* block : candidates) {
    if (gained >= wanted) break;
    gained += cut_pages(block);
  }
  if (gained > 0) {
    stats_.num_page_moves += static_cast<std::int64_t>(gained);
    ++free_count_;  // pages came back: rule f's waiters look again
    if (release_waiters_ > 0) freed_cv_.notify_all();
  }
  return gained;
}

// Waits, with the lock released, for the events of pending free blocks that
// hold whole pages (with `job`, only that job's): a page is unmapped only once
// its last use completed. False when there was none to wait for.
bool MemoryFlowAllocator::wait_for_pending_pages(Lock& lock, std::optional<JobId> job) {
  record_lazy_events();  // an event must exist before it can be waited on
  process_events_locked();
  std::vector<EventRef*> events;
  for (Pool& kind : pools_) {
    for (auto& [stream, pool] : kind.pending) {
      for (Block* block = pool.fifo_head; block != nullptr; block = block->fifo_next) {
        if (whole_pages(block) == 0 || (job && block->owner != *job)) continue;
        if (std::find(events.begin(), events.end(), block->event) != events.end()) continue;
        ++block->event->refs;
        events.push_back(block->event);
      }
    }
  }
  if (events.empty()) return false;
  lock.unlock();
  for (EventRef* event : events) backend_.event_synchronize(event->handle);
  lock.lock();
  for (EventRef* event : events) {
    event->complete = true;
    unref(event);
  }
  return true;
}

// Cuts the whole pages out of a ready free block: its range is split around
// them (the slivers either side stay free blocks), they are unmapped and join
// the budget's free pages with the block's owner. Returns the pages cut.
std::size_t MemoryFlowAllocator::cut_pages(Block* block) {
  const std::size_t count = whole_pages(block);
  if (count == 0) return 0;
  Segment* segment = block->segment;
  const std::size_t first = (static_cast<std::size_t>(block->ptr - segment->base) +
                             kPageBytes - 1) / kPageBytes;
  char* const cut_start = segment->base + first * kPageBytes;
  char* const cut_end = cut_start + count * kPageBytes;
  char* const block_end = block->ptr + block->size;
  char* const segment_end = segment->base + segment->size;
  unlink_free(block);
  for (std::size_t i = first; i < first + count; ++i) {
    free_pages_.push_back({segment->pages[i], block->owner});
  }
  backend_.page_unmap(cut_start, count * kPageBytes);

  // What follows the cut becomes a range of its own.
  Block* after = block->next;
  if (cut_end < segment_end) {
    Block* head = after;
    if (cut_end < block_end) {
      head = new Block;
      head->ptr = cut_end;
      head->size = static_cast<std::size_t>(block_end - cut_end);
      head->stream = block->stream;
      head->owner = block->owner;
      head->next = after;
      if (after != nullptr) after->prev = head;
    } else if (after != nullptr) {
      after->prev = nullptr;
    }
    auto* right = new Segment{cut_end, static_cast<std::size_t>(segment_end - cut_end), head,
                              segment->pool, segment->stream,
                              std::vector<PageHandle>(segment->pages.begin() +
                                                          static_cast<std::ptrdiff_t>(first + count),
                                                      segment->pages.end()),
                              segment->va_end};
    segment->va_end = cut_end;  // the cut pages' addresses: room for what precedes them
    for (Block* b = head; b != nullptr; b = b->next) b->segment = right;
    segments_.emplace(right->base, right);
    update_stat(stats_.segments, 1);
    if (head != after) pool_of(head).ready.insert(head);
  }
  // What precedes it stays: the block itself as the sliver, if any.
  segment->pages.resize(first);
  segment->size = static_cast<std::size_t>(cut_start - segment->base);
  if (cut_start > block->ptr) {
    block->size = static_cast<std::size_t>(cut_start - block->ptr);
    block->next = nullptr;
    pool_of(block).ready.insert(block);
  } else {
    if (block->prev != nullptr) block->prev->next = nullptr;
    delete block;
  }
  if (segment->size == 0) {
    va_give(segment->base, static_cast<std::size_t>(segment->va_end - segment->base));
    segments_.erase(segment->base);
    update_stat(stats_.segments, -1);
    delete segment;
  }
  return count;
}

// Whole free pages now: the budget's, and those inside idle free blocks.
std::size_t MemoryFlowAllocator::free_whole_pages_locked() const {
  std::size_t pages = free_pages_.size();
  for (const Pool& kind : pools_) {
    for (const Block* block : kind.ready) pages += whole_pages(block);
    for (const auto& [stream, pool] : kind.pending) {
      for (const Block* block : pool.by_size) pages += whole_pages(block);
    }
  }
  return pages;
}

// Virtual memory for a range: best fit among the unused parts of the
// reservations, else a new reservation. nullptr when none can be had.
char* MemoryFlowAllocator::va_take(std::size_t bytes) {
  auto best = free_va_.end();
  for (auto it = free_va_.begin(); it != free_va_.end(); ++it) {
    if (it->second >= bytes && (best == free_va_.end() || it->second < best->second)) best = it;
  }
  if (best == free_va_.end()) {
    const std::size_t span = std::max(bytes, backend_.va_arena_bytes());
    auto* base = static_cast<char*>(backend_.va_reserve(span));
    if (base == nullptr && (release_free_reservations() | trim_growth_room())) {
      base = static_cast<char*>(backend_.va_reserve(span));
    }
    if (base == nullptr) return nullptr;
    arenas_.emplace(base, span);
    best = free_va_.emplace(base, span).first;
  }
  char* base = best->first;
  const std::size_t rest = best->second - bytes;
  free_va_.erase(best);
  if (rest > 0) free_va_.emplace(base + bytes, rest);
  return base;
}

// Reservations no range uses any more, given back whole: ranges come and go, and
// their freed address space, kept for later ranges, can be in parts too small for
// the next one while the backend's address-space budget is spent. True if any was.
bool MemoryFlowAllocator::release_free_reservations() {
  bool released = false;
  for (auto arena = arenas_.begin(); arena != arenas_.end();) {
    auto free = free_va_.find(arena->first);
    if (free == free_va_.end() || free->second != arena->second) {
      ++arena;
      continue;
    }
    backend_.va_release(arena->first, arena->second);
    free_va_.erase(free);
    arena = arenas_.erase(arena);
    released = true;
  }
  return released;
}

// The virtual room ranges keep to grow into, given back where it ends
// their reservation (the host's: a reservation per range): room is a luxury,
// address space for a range is not. True if any was given back.
bool MemoryFlowAllocator::trim_growth_room() {
  bool trimmed = false;
  if (backend_.va_arena_bytes() != 0) return false;  // shared reservations: not in parts
  for (auto& [start, segment] : segments_) {
    char* end = segment->base + segment->size;
    if (segment->va_end <= end) continue;
    auto arena = arenas_.upper_bound(end);
    if (arena == arenas_.begin()) continue;
    --arena;
    if (arena->first + arena->second != segment->va_end) continue;
    backend_.va_release(end, static_cast<std::size_t>(segment->va_end - end));
    arena->second = static_cast<std::size_t>(end - arena->first);
    segment->va_end = end;
    trimmed = true;
  }
  return trimmed;
}

void MemoryFlowAllocator::va_give(char* base, std::size_t bytes) {
  // Coalesced with its neighbours within one reservation (a CUDA mapping may
  // not span two).
  auto next = free_va_.find(base + bytes);
  if (next != free_va_.end() && arenas_.count(next->first) == 0) {
    bytes += next->second;
    free_va_.erase(next);
  }
  auto after = free_va_.lower_bound(base);
  if (after != free_va_.begin() && arenas_.count(base) == 0) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == base) {
      base = prev->first;
      bytes += prev->second;
      free_va_.erase(prev);
    }
  }
  // A reservation no range uses goes back: on the host, address space counts
  // against the process's limits (threads need some).
  auto arena = arenas_.find(base);
  if (arena != arenas_.end() && arena->second == bytes) {
    backend_.va_release(base, bytes);
    arenas_.erase(arena);
    return;
  }
  free_va_.emplace(base, bytes);
}

Block* MemoryFlowAllocator::carve(Block* block, std::size_t size, std::size_t requested,
                                  StreamId stream, JobId job, Allocation& out) {
  EventRef* event = block->event;
  if (should_split(block->size, size, block->next == nullptr)) {
    auto* rest = new Block;
    rest->ptr = block->ptr + size;
    rest->size = block->size - size;
    rest->segment = block->segment;
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) block->next->prev = rest;
    block->next = rest;
    rest->stream = block->stream;
    rest->owner = block->owner;
    if (event != nullptr) {  // the rest stays pending behind the same event
      rest->event = event;
      ++event->refs;
      StreamPool& pool = pool_of(block).pending[block->stream];
      pool.by_size.insert(rest);
      fifo_push_after(pool, block, rest);
    } else {
      pool_of(block).ready.insert(rest);
    }
    unlink_free(block);
    block->size = size;
  } else {
    unlink_free(block);
  }
  if (event != nullptr) {
    count_pending(-static_cast<std::int64_t>(block->size));
    // A lazy event is never seen here by another stream: note_stream recorded
    // it when that stream first allocated (Note [Lazy events]).
    if (block->stream != stream && !event->complete) {
      backend_.stream_wait_event(stream, event->handle);
      out.waited = true;
    }
    unref(event);
    block->event = nullptr;
  }

  // Zeroed unless provably the same job's: a default-job block moving to another
  // stream, or on a stream two jobs share, may cross jobs (Note [Side streams]).
  out.zeroed = block->owner != kClean &&
               (block->owner != job ||
                (job == kDefaultJob && (block->stream != stream || is_shared_stream(stream))));
  if (out.zeroed) {
    stats_.scrubbed_bytes += static_cast<std::int64_t>(block->size);
    jobs_[job].scrubbed_bytes += static_cast<std::int64_t>(block->size);
  }
  block->allocated = true;
  block->owner = job;
  block->stream = stream;
  block->requested = requested;
  live_.emplace(block->ptr, block);

  const auto bytes = static_cast<std::int64_t>(block->size);
  const auto asked = static_cast<std::int64_t>(requested);
  update_stat(stats_.allocated_bytes, bytes);
  update_stat(stats_.requested_bytes, asked);
  update_stat(stats_.allocations, 1);
  update_stat(jobs_[job].allocated_bytes, bytes);
  jobs_[job].largest_block = std::max(jobs_[job].largest_block, bytes);
  jobs_[job].window_peak = std::max(jobs_[job].window_peak, jobs_[job].allocated_bytes.current);
  update_stat(jobs_[job].requested_bytes, asked);
  update_stat(jobs_[job].allocations, 1);
  out.ptr = block->ptr;
  out.size = block->size;
  return block;
}

// Note [Rule f deadlock]. Jobs that wait here free nothing while they wait. If
// every job the caller could wait for is already waiting (each for the others'
// frees), none will free before the deadline, and all of them would fail when it
// passes. The caller, the latest to arrive, fails at once instead: its frees, as
// its exception unwinds, wake the others. A waiter that a free has woken (it has
// not yet retried) is not stuck. Only job threads wait (WaitHooks), one
// per job, so a waiting job has stopped; frees from its unmarked threads (a
// DataLoader's) still wake a waiter, and the deadline still bounds every wait.
// Waiters whose bounds pass together (all waiting on a job that did not free in
// time) fail one at a time: one whose bound passes after another waiter gave way
// waits anew for the frees that failure brings.
bool MemoryFlowAllocator::wait_for_releases(Lock& lock, JobId job,
                                            std::chrono::steady_clock::time_point& deadline,
                                            std::string& why) {
  bool others_will_free = false, all_others_wait = true;
  for (const std::string& name : expected_releases_) {
    auto other = find_job_locked(name);
    if (!other || *other == job || !jobs_[*other].active) continue;
    others_will_free = true;
    // Stuck: waiting, and no free since, which would have woken it to retry.
    auto waiting = waiting_jobs_.find(*other);
    if (waiting == waiting_jobs_.end() || waiting->second.threads == 0 ||
        waiting->second.since != free_count_) {
      all_others_wait = false;
    }
  }
  const WaitHooks& hooks = options_.wait_hooks;
  if (!others_will_free || (hooks.may_wait && !hooks.may_wait())) return false;
  if (all_others_wait) {
    ++gave_way_;
    ++stats_.num_release_deadlocks;
    why = "every job it could wait for is waiting for memory too; it gives way so that they "
          "can go on";
    return false;
  }
  const std::uint64_t seen = free_count_, gave_way = gave_way_;
  ++release_waiters_;
  Waiting& waiting = waiting_jobs_[job];
  ++waiting.threads;
  waiting.since = seen;
  ++stats_.num_release_waits;
  void* token = hooks.before ? hooks.before() : nullptr;
  // wait_until releases the lock while it waits (Note [Locking]).
  const bool freed =
      freed_cv_.wait_until(lock, deadline, [&] { return free_count_ != seen; });
  --release_waiters_;
  --waiting_jobs_[job].threads;
  // Decided before the lock is let go below, so that of two waiters whose bounds
  // pass together only one gives way.
  bool retry = freed;
  if (!freed && gave_way_ != gave_way) {  // another waiter failed meanwhile: its frees are coming
    deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(options_.release_wait_s));
    retry = true;
  } else if (!freed) {
    ++gave_way_;
  }
  if (hooks.after) {
    // Taken back without our lock held: a thread holding what `before` released
    // (the GIL) may be waiting for our lock.
    lock.unlock();
    hooks.after(token);
    lock.lock();
  }
  return retry;
}

void MemoryFlowAllocator::out_of_memory(JobId job, std::size_t bytes, std::size_t rounded,
                                        const std::string& why) {
  ++stats_.num_ooms;
  ++stats_.rule_count[kRuleG];
  ++jobs_[job].num_ooms;
  std::ostringstream message;
  message << "wwrun: job '" << jobs_[job].name << "' is out of memory: tried to allocate "
          << format_bytes(static_cast<std::int64_t>(rounded)) << " (" << bytes
          << " bytes requested), but " << why << ". Job '" << jobs_[job].name << "' has "
          << format_bytes(jobs_[job].allocated_bytes.current) << " allocated";
  if (jobs_[job].limit != 0) {
    message << " of its " << format_bytes(static_cast<std::int64_t>(jobs_[job].limit))
            << " limit";
  }
  message << ". Device: " << format_bytes(stats_.reserved_bytes.current) << " reserved, "
          << format_bytes(stats_.allocated_bytes.current) << " allocated; by job:";
  const char* separator = " ";
  for (const JobStats& other : jobs_) {
    if (other.allocated_bytes.current == 0 && &other != &jobs_[job]) continue;
    message << separator << other.name << " " << format_bytes(other.allocated_bytes.current);
    separator = ", ";
  }
  // Free as whole pages (any range can take them), in pieces smaller than a
  // page, or only behind another stream's work.
  const std::size_t free_pages = free_whole_pages_locked();
  message << "; " << format_bytes(stats_.reserved_bytes.current - stats_.allocated_bytes.current)
          << " reserved but free: " << free_pages << " whole pages ("
          << format_bytes(static_cast<std::int64_t>(free_pages * kPageBytes))
          << "), the largest free block "
          << format_bytes(static_cast<std::int64_t>(largest_free_block_locked())) << "; "
          << format_bytes(stats_.pending_event_bytes) << " free behind pending events.";
  throw OutOfMemory(message.str());
}

// ---------------------------------------------------------------------------
// Free path, events, coalescing
// ---------------------------------------------------------------------------

void MemoryFlowAllocator::free(void* ptr) {
  if (!free_if_owned(ptr)) {
    throw std::invalid_argument("wwrun allocator: free of a pointer it did not allocate");
  }
}

bool MemoryFlowAllocator::free_if_owned(void* ptr) {
  Lock lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block* block = it->second;
  live_.erase(it);
  const auto bytes = static_cast<std::int64_t>(block->size);
  const auto asked = static_cast<std::int64_t>(block->requested);
  JobStats& job = jobs_[block->owner];
  update_stat(stats_.allocated_bytes, -bytes);
  update_stat(stats_.requested_bytes, -asked);
  update_stat(stats_.allocations, -1);
  update_stat(job.allocated_bytes, -bytes);
  update_stat(job.requested_bytes, -asked);
  update_stat(job.allocations, -1);
  block->allocated = false;

  if (block->extra_streams.empty()) {
    block->event = free_event(block->stream);
    insert_free(block);
  } else {
    block->deferred = true;
    block->deferred_events.push_back(new_event(block->stream));
    for (StreamId other : block->extra_streams) {
      block->deferred_events.push_back(new_event(other));
    }
    block->extra_streams.clear();
    deferred_.push_back(block);
    count_pending(bytes);
  }
  ++free_count_;
  const bool wake = release_waiters_ > 0;
  lock.unlock();
  if (wake) freed_cv_.notify_all();
  return true;
}

void MemoryFlowAllocator::record_stream(void* ptr, StreamId stream) {
  Lock lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw std::invalid_argument("wwrun allocator: record_stream on a pointer it did not allocate");
  }
  Block* block = it->second;
  if (stream == block->stream) return;
  note_stream(stream);
  auto& extra = block->extra_streams;
  if (std::find(extra.begin(), extra.end(), stream) == extra.end()) extra.push_back(stream);
}

// A freshly freed block, pending behind its new event, absorbs free neighbours
// that are ready or pending on the same stream (its event is younger, so it
// covers theirs), then joins its stream's pool.
void MemoryFlowAllocator::insert_free(Block* block) {
  for (Block* neighbour : {block->prev, block->next}) {
    if (neighbour != nullptr && is_idle_free(neighbour) &&
        (neighbour->event == nullptr || neighbour->stream == block->stream)) {
      merge_into(block, neighbour);
    }
  }
  StreamPool& pool = pool_of(block).pending[block->stream];
  pool.by_size.insert(block);
  fifo_push_after(pool, pool.fifo_tail, block);
  count_pending(static_cast<std::int64_t>(block->size));
}

// A block with no pending event absorbs its ready neighbours and joins the ready set.
void MemoryFlowAllocator::insert_ready(Block* block) {
  for (Block* neighbour : {block->prev, block->next}) {
    if (neighbour != nullptr && is_idle_free(neighbour) && neighbour->event == nullptr) {
      merge_into(block, neighbour);
    }
  }
  pool_of(block).ready.insert(block);
}

void MemoryFlowAllocator::merge_into(Block* survivor, Block* absorbed) {
  unlink_free(absorbed);
  if (absorbed->event != nullptr) {
    count_pending(-static_cast<std::int64_t>(absorbed->size));
    unref(absorbed->event);
  }
  if (absorbed == survivor->prev) {
    survivor->ptr = absorbed->ptr;
    survivor->prev = absorbed->prev;
    if (absorbed->prev != nullptr) {
      absorbed->prev->next = survivor;
    } else {
      survivor->segment->head = survivor;
    }
  } else {
    survivor->next = absorbed->next;
    if (absorbed->next != nullptr) absorbed->next->prev = survivor;
  }
  survivor->size += absorbed->size;
  // The default job gathers every unregistered stream, which may belong to
  // different jobs (a script's own torch.cuda.Stream()): its data from two
  // streams is not provably one job's.
  const bool default_across_streams = survivor->owner == kDefaultJob &&
                                      absorbed->owner == kDefaultJob &&
                                      survivor->stream != absorbed->stream;
  survivor->owner =
      default_across_streams ? kMixed : combine_owners(survivor->owner, absorbed->owner);
  delete absorbed;
}

void MemoryFlowAllocator::unlink_free(Block* block) {
  if (block->event != nullptr) {
    StreamPool& pool = pool_of(block).pending[block->stream];
    pool.by_size.erase(block);
    fifo_remove(pool, block);
  } else {
    pool_of(block).ready.erase(block);
  }
}

// unlink_free's inverse: the block back in its pool as it was (no merge, no count).
void MemoryFlowAllocator::relink_free(Block* block) {
  if (block->event != nullptr) {
    StreamPool& pool = pool_of(block).pending[block->stream];
    pool.by_size.insert(block);
    fifo_push_after(pool, pool.fifo_tail, block);
  } else {
    pool_of(block).ready.insert(block);
  }
}

void MemoryFlowAllocator::fifo_push_after(StreamPool& pool, Block* after, Block* block) {
  block->fifo_prev = after;
  block->fifo_next = after != nullptr ? after->fifo_next : pool.fifo_head;
  if (block->fifo_next != nullptr) {
    block->fifo_next->fifo_prev = block;
  } else {
    pool.fifo_tail = block;
  }
  if (after != nullptr) {
    after->fifo_next = block;
  } else {
    pool.fifo_head = block;
  }
}

void MemoryFlowAllocator::fifo_remove(StreamPool& pool, Block* block) {
  if (block->fifo_prev != nullptr) {
    block->fifo_prev->fifo_next = block->fifo_next;
  } else {
    pool.fifo_head = block->fifo_next;
  }
  if (block->fifo_next != nullptr) {
    block->fifo_next->fifo_prev = block->fifo_prev;
  } else {
    pool.fifo_tail = block->fifo_prev;
  }
  block->fifo_prev = block->fifo_next = nullptr;
}

void MemoryFlowAllocator::process_events() {
  Lock lock(mutex_);
  record_lazy_events();
  process_events_locked();
}

void MemoryFlowAllocator::process_events_locked() {
  for (Pool& kind : pools_) {
    for (auto& [stream, pool] : kind.pending) {
      // Events on one stream complete in the order they were recorded.
      while (pool.fifo_head != nullptr && is_complete(pool.fifo_head->event)) {
        Block* block = pool.fifo_head;
        pool.by_size.erase(block);
        fifo_remove(pool, block);
        count_pending(-static_cast<std::int64_t>(block->size));
        unref(block->event);
        block->event = nullptr;
        insert_ready(block);
      }
    }
  }
  poll_deferred();
}

void MemoryFlowAllocator::poll_deferred() {
  for (std::size_t i = 0; i < deferred_.size();) {
    Block* block = deferred_[i];
    bool done = true;
    for (EventRef* event : block->deferred_events) done = done && is_complete(event);
    if (!done) {
      ++i;
      continue;
    }
    for (EventRef* event : block->deferred_events) unref(event);
    block->deferred_events.clear();
    block->deferred = false;
    count_pending(-static_cast<std::int64_t>(block->size));
    deferred_[i] = deferred_.back();
    deferred_.pop_back();
    insert_ready(block);
  }
}

EventRef* MemoryFlowAllocator::new_event(StreamId stream) {
  EventRef* event;
  if (event_pool_.empty()) {
    event = new EventRef;
    event->handle = backend_.event_create();
  } else {
    event = event_pool_.back();
    event_pool_.pop_back();
  }
  backend_.event_record(event->handle, stream);
  event->stream = stream;
  event->serial = ++event_serial_;
  event->refs = 1;
  event->recorded = true;
  event->complete = false;
  return event;
}

// A free's event: its own, recorded now, once several streams are in use;
// before that, the stream's shared lazy one (Note [Lazy events]).
EventRef* MemoryFlowAllocator::free_event(StreamId stream) {
  if (eager_events_) return new_event(stream);
  EventRef*& lazy = lazy_events_[stream];
  if (lazy == nullptr) {
    if (event_pool_.empty()) {
      lazy = new EventRef;
      lazy->handle = backend_.event_create();
    } else {
      lazy = event_pool_.back();
      event_pool_.pop_back();
    }
    lazy->stream = stream;
    lazy->refs = 0;
    lazy->recorded = false;
    lazy->complete = false;
  }
  ++lazy->refs;
  return lazy;
}

void MemoryFlowAllocator::note_stream(StreamId stream) {
  if (eager_events_) return;
  if (!only_stream_) {
    only_stream_ = stream;
  } else if (*only_stream_ != stream) {
    eager_events_ = true;
    record_lazy_events();
  }
}

void MemoryFlowAllocator::record_lazy_events() {
  for (auto& [stream, event] : lazy_events_) {
    backend_.event_record(event->handle, stream);
    event->serial = ++event_serial_;
    event->recorded = true;
  }
  lazy_events_.clear();
}

void MemoryFlowAllocator::unref(EventRef* event) {
  if (--event->refs > 0) return;
  if (!event->recorded) lazy_events_.erase(event->stream);
  event_pool_.push_back(event);
}

bool MemoryFlowAllocator::is_complete(EventRef* event) {
  if (!event->recorded) return false;
  if (!event->complete && backend_.event_query(event->handle)) event->complete = true;
  return event->complete;
}

void MemoryFlowAllocator::count_pending(std::int64_t delta) {
  stats_.pending_event_bytes += delta;
}

// ---------------------------------------------------------------------------
// Batched scrub (Note [Batched scrub])
// ---------------------------------------------------------------------------

std::vector<ScrubRange> MemoryFlowAllocator::take_dirty_blocks(const std::string& name,
                                                               StreamId scrub_stream) {
  Lock lock(mutex_);
  std::vector<ScrubRange> ranges;
  const std::optional<JobId> job = find_job_locked(name);
  if (!job) return ranges;
  std::vector<Block*> dirty;
  for (auto& [base, segment] : segments_) {
    for (Block* block = segment->head; block != nullptr; block = block->next) {
      if (is_idle_free(block) && block->owner == *job) dirty.push_back(block);
    }
  }
  if (dirty.empty()) return ranges;
  // The scrub stream is one more stream: lazily held events must be recorded
  // before it can wait on them (Note [Lazy events]).
  note_stream(scrub_stream);
  for (Block* block : dirty) {
    unlink_free(block);
    if (block->event != nullptr) {
      // Still counted in pending_event_bytes: now behind the scrub instead.
      if (block->stream != scrub_stream && !is_complete(block->event)) {
        backend_.stream_wait_event(scrub_stream, block->event->handle);
      }
      unref(block->event);
      block->event = nullptr;
    } else {
      count_pending(static_cast<std::int64_t>(block->size));
    }
    block->in_scrub = true;
    in_scrub_.emplace(block->ptr, block);
    ranges.push_back({block->ptr, block->size});
  }
  return ranges;
}

void MemoryFlowAllocator::finish_scrub(const std::vector<void*>& ptrs, StreamId scrub_stream,
                                       bool zeroed) {
  Lock lock(mutex_);
  // All checked before any is touched; a block named twice is not in scrub twice.
  const char* const not_in_scrub = "wwrun allocator: finish_scrub of a block not in scrub";
  if (std::unordered_set<void*>(ptrs.begin(), ptrs.end()).size() != ptrs.size()) {
    throw std::invalid_argument(not_in_scrub);
  }
  std::vector<Block*> blocks;
  for (void* ptr : ptrs) {
    auto it = in_scrub_.find(ptr);
    if (it == in_scrub_.end()) throw std::invalid_argument(not_in_scrub);
    blocks.push_back(it->second);
  }
  if (blocks.empty()) return;
  for (Block* block : blocks) in_scrub_.erase(block->ptr);
  // One event after the zeroing covers every block of the batch.
  note_stream(scrub_stream);
  EventRef* event = new_event(scrub_stream);
  event->refs = 0;
  for (Block* block : blocks) {
    const auto bytes = static_cast<std::int64_t>(block->size);
    if (zeroed) {
      stats_.batch_scrubbed_bytes += bytes;
      jobs_[block->owner].batch_scrubbed_bytes += bytes;
      block->owner = kClean;
    }
    block->in_scrub = false;
    block->stream = scrub_stream;
    block->event = event;
    ++event->refs;
    count_pending(-bytes);  // insert_free counts it again, as pending behind the scrub
    insert_free(block);
  }
  if (zeroed) ++stats_.scrub_batches;
  ++free_count_;  // memory came back: wake rule f's waiters
  const bool wake = release_waiters_ > 0;
  lock.unlock();
  if (wake) freed_cv_.notify_all();
}

// ---------------------------------------------------------------------------
// Rule e: releasing wholly free segments
// ---------------------------------------------------------------------------

std::size_t MemoryFlowAllocator::release_free_segments(std::optional<JobId> job) {
  Lock lock(mutex_);
  return release_free_segments_locked(lock, job);
}

std::size_t MemoryFlowAllocator::release_free_segments_locked(Lock& lock,
                                                              std::optional<JobId> job) {
  // A job's own: its data alone, so the wait is on that job's work only.
  wait_for_pending_pages(lock, job);
  process_events_locked();
  std::vector<Block*> victims;
  for (Pool& kind : pools_) {
    for (Block* block : kind.ready) {
      if (whole_pages(block) > 0 && (!job || block->owner == *job)) victims.push_back(block);
    }
  }
  for (Block* block : victims) cut_pages(block);
  std::vector<PageHandle> released;
  auto kept = std::stable_partition(free_pages_.begin(), free_pages_.end(), [&](const FreePage& page) {
    return job && page.owner != *job;
  });
  for (auto it = kept; it != free_pages_.end(); ++it) released.push_back(it->handle);
  free_pages_.erase(kept, free_pages_.end());
  if (released.empty()) return 0;
  // Released under the lock: until the device has them back they still count
  // as held, or a request meanwhile would find neither them nor room for fresh
  // ones. Unmapped and idle, a page goes back at once (Note [Locking]).
  for (PageHandle page : released) backend_.page_release(page);
  const std::size_t bytes = released.size() * kPageBytes;
  update_stat(stats_.reserved_bytes, -static_cast<std::int64_t>(bytes));
  return bytes;
}

// ---------------------------------------------------------------------------
// Jobs, stats, introspection
// ---------------------------------------------------------------------------

JobId MemoryFlowAllocator::register_stream(StreamId stream, const std::string& name,
                                           std::size_t limit) {
  Lock lock(mutex_);
  // A stream a live job holds is that job's owner: rebinding it would let the
  // two jobs pass memory between them unzeroed (torch's stream pool recycles
  // streams after 32, so a sweep's 33rd job can be handed the 1st job's).
  // A live job's side stream (Note [Side streams]) is held by it just the same.
  auto bound = stream_jobs_.find(stream);
  auto side = side_streams_.find(stream);
  std::string holder;  // as the message names it
  if (bound != stream_jobs_.end() && jobs_[bound->second].active) {
    holder = "live job '" + jobs_[bound->second].name + "'";
  } else if (side != side_streams_.end()) {
    holder = side->second == kSharedStream ? "several live jobs"
                                           : "live job '" + jobs_[side->second].name + "'";
  }
  if (!holder.empty() && holder != "live job '" + name + "'") {
    throw std::invalid_argument("wwrun allocator: stream is held by " + holder +
                                "; cannot bind it to '" + name + "'");
  }
  if (side != side_streams_.end()) side_streams_.erase(side);  // its own side stream
  JobId job = find_job_locked(name).value_or(static_cast<JobId>(jobs_.size()));
  if (job == static_cast<JobId>(jobs_.size())) {
    JobStats stats;
    stats.name = name;
    jobs_.push_back(stats);
  }
  jobs_[job].active = true;
  jobs_[job].limit = limit;
  stream_jobs_[stream] = job;
  return job;
}

void MemoryFlowAllocator::reset_after_fork() {
  new (&mutex_) std::mutex();
  new (&freed_cv_) std::condition_variable();
  release_waiters_ = 0;
  waiting_jobs_.clear();
  expected_releases_.clear();
}

bool MemoryFlowAllocator::unregister_job(const std::string& name) {
  Lock lock(mutex_);
  auto job = find_job_locked(name);
  if (!job || *job == kDefaultJob) return false;
  jobs_[*job].active = false;
  for (auto* bindings : {&stream_jobs_, &side_streams_}) {
    for (auto it = bindings->begin(); it != bindings->end();) {
      it = it->second == *job ? bindings->erase(it) : std::next(it);
    }
  }
  return true;
}

JobId MemoryFlowAllocator::job_of_stream(StreamId stream) const {
  Lock lock(mutex_);
  return job_of_stream_locked(stream);
}

JobId MemoryFlowAllocator::job_of_stream_locked(StreamId stream) const {
  auto registered = stream_jobs_.find(stream);
  if (registered != stream_jobs_.end()) return registered->second;
  const JobId thread = thread_job_locked();
  if (thread != kDefaultJob) return thread;
  auto side = side_streams_.find(stream);
  return side == side_streams_.end() || side->second == kSharedStream ? kDefaultJob
                                                                       : side->second;
}

// The calling thread's job when it is marked as a live job's thread.
JobId MemoryFlowAllocator::thread_job_locked() const {
  if (!options_.thread_job) return kDefaultJob;
  const std::string name = options_.thread_job();
  if (name.empty()) return kDefaultJob;
  const std::optional<JobId> job = find_job_locked(name);
  return job && jobs_[*job].active ? *job : kDefaultJob;
}

// Note [Side streams]. Registered streams are dedicated to their job, whichever
// thread allocates (the autograd thread does, for every job).
JobId MemoryFlowAllocator::job_for_allocation_locked(StreamId stream) {
  auto registered = stream_jobs_.find(stream);
  if (registered != stream_jobs_.end()) return registered->second;
  const JobId thread = thread_job_locked();
  auto side = side_streams_.find(stream);
  if (side == side_streams_.end()) {
    if (thread != kDefaultJob) side_streams_.emplace(stream, thread);
    return thread;
  }
  if (side->second == kSharedStream) return thread;
  // An unmarked thread (autograd) works for the job whose thread runs there.
  if (thread == kDefaultJob || thread == side->second) return side->second;
  side->second = kSharedStream;
  return thread;
}

bool MemoryFlowAllocator::is_shared_stream(StreamId stream) const {
  auto side = side_streams_.find(stream);
  return side != side_streams_.end() && side->second == kSharedStream;
}

std::optional<JobId> MemoryFlowAllocator::find_job(const std::string& name) const {
  Lock lock(mutex_);
  return find_job_locked(name);
}

bool MemoryFlowAllocator::over_limit(JobId job, std::size_t size) const {
  const std::size_t limit = jobs_[job].limit;
  return limit != 0 && static_cast<std::size_t>(jobs_[job].allocated_bytes.current) + size > limit;
}

std::optional<JobId> MemoryFlowAllocator::find_job_locked(const std::string& name) const {
  for (JobId i = 0; i < static_cast<JobId>(jobs_.size()); ++i) {
    if (jobs_[i].name == name) return i;
  }
  return std::nullopt;
}

void MemoryFlowAllocator::set_expected_releases(const std::vector<std::string>& jobs,
                                                double wait_s) {
  Lock lock(mutex_);
  expected_releases_ = jobs;
  options_.release_wait_s = wait_s;
}

Snapshot MemoryFlowAllocator::snapshot() const {
  Lock lock(mutex_);
  Snapshot snap;
  snap.device = stats_;
  snap.jobs = jobs_;
  snap.fragmentation_bytes = stats_.reserved_bytes.current - stats_.allocated_bytes.current;
  snap.free_page_bytes = static_cast<std::int64_t>(free_whole_pages_locked() * kPageBytes);
  lock.unlock();
  snap.largest_free_block = static_cast<std::int64_t>(largest_free_block());
  return snap;
}

std::size_t MemoryFlowAllocator::largest_block_for(StreamId stream, std::size_t device_free,
                                                   std::size_t device_total) const {
  Lock lock(mutex_);
  // A range stitched from the budget's free pages and fresh ones, or a cached block.
  const std::size_t largest =
      std::max(largest_free_block_locked(), device_free + free_pages_.size() * kPageBytes);
  const JobStats& job = jobs_[job_of_stream_locked(stream)];
  const auto held_by = [](const Stat& stat) { return static_cast<std::size_t>(stat.current); };
  const std::size_t capacity =
      options_.reserved_limit != 0 ? options_.reserved_limit : device_total;
  const std::size_t all_held = held_by(stats_.allocated_bytes);
  std::size_t headroom = capacity > all_held ? capacity - all_held : 0;
  if (job.limit != 0) {
    const std::size_t mine = held_by(job.allocated_bytes);
    headroom = std::min(headroom, job.limit > mine ? job.limit - mine : 0);
  }
  return std::min(largest, headroom);
}

std::size_t MemoryFlowAllocator::largest_free_block() const {
  Lock lock(mutex_);
  return largest_free_block_locked();
}

std::size_t MemoryFlowAllocator::largest_free_block_locked() const {
  std::size_t largest = 0;
  for (const Pool& kind : pools_) {
    if (!kind.ready.empty()) largest = std::max(largest, (*kind.ready.rbegin())->size);
    for (const auto& [stream, pool] : kind.pending) {
      if (!pool.by_size.empty()) largest = std::max(largest, (*pool.by_size.rbegin())->size);
    }
  }
  return largest;
}

std::vector<SegmentInfo> MemoryFlowAllocator::segments() const {
  Lock lock(mutex_);
  std::vector<SegmentInfo> result;
  for (const auto& [base, segment] : segments_) {
    SegmentInfo info{reinterpret_cast<std::uintptr_t>(segment->base), segment->size,
                     segment->stream, segment->small(), {}};
    for (const Block* block = segment->head; block != nullptr; block = block->next) {
      info.blocks.push_back({reinterpret_cast<std::uintptr_t>(block->ptr), block->size,
                             block->allocated, block->event != nullptr || block->deferred,
                             block->in_scrub, block->deferred, block->stream, block->owner,
                             block->allocated ? block->requested : 0});
    }
    result.push_back(std::move(info));
  }
  return result;
}

MemoryFlowAllocator::Window MemoryFlowAllocator::job_window(JobId job, bool restart) {
  Lock lock(mutex_);
  JobStats& stats = jobs_.at(job);
  const std::int64_t current = stats.allocated_bytes.current;
  const Window window{current, std::max(stats.window_peak, current)};
  if (restart) stats.window_peak = current;
  return window;
}

void MemoryFlowAllocator::reset_peak(std::optional<JobId> job) {
  Lock lock(mutex_);
  auto reset_job = [](JobStats& stats) {
    wwrun::alloc::reset_peak(stats.allocated_bytes);
    wwrun::alloc::reset_peak(stats.requested_bytes);
    wwrun::alloc::reset_peak(stats.allocations);
  };
  if (job) {
    reset_job(jobs_.at(*job));
    return;
  }
  for (Stat* stat : {&stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.requested_bytes,
                     &stats_.allocations, &stats_.segments}) {
    wwrun::alloc::reset_peak(*stat);
  }
  for (JobStats& stats : jobs_) reset_job(stats);
}

void MemoryFlowAllocator::reset_accumulated(std::optional<JobId> job) {
  Lock lock(mutex_);
  auto reset_job = [](JobStats& stats) {
    wwrun::alloc::reset_accumulated(stats.allocated_bytes);
    wwrun::alloc::reset_accumulated(stats.requested_bytes);
    wwrun::alloc::reset_accumulated(stats.allocations);
    stats.num_ooms = 0;
  };
  if (job) {
    reset_job(jobs_.at(*job));
    return;
  }
  for (Stat* stat : {&stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.requested_bytes,
                     &stats_.allocations, &stats_.segments}) {
    wwrun::alloc::reset_accumulated(*stat);
  }
  stats_.num_ooms = 0;
  stats_.num_alloc_retries = 0;
  stats_.num_release_waits = 0;
  for (JobStats& stats : jobs_) reset_job(stats);
}

void MemoryFlowAllocator::set_reserved_limit(std::size_t bytes) {
  Lock lock(mutex_);
  options_.reserved_limit = bytes;
}

std::size_t MemoryFlowAllocator::reserved_limit() const {
  Lock lock(mutex_);
  return options_.reserved_limit;
}

void* MemoryFlowAllocator::segment_base(void* ptr, std::size_t* size) const {
  Lock lock(mutex_);
  auto it = segments_.upper_bound(static_cast<char*>(ptr));
  if (it == segments_.begin()) return nullptr;
  --it;
  Segment* segment = it->second;
  if (static_cast<char*>(ptr) >= segment->base + segment->size) return nullptr;
  if (size != nullptr) *size = segment->size;
  return segment->base;
}

}  // namespace wwrun::alloc


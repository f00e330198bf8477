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
    backend_.segment_free(segment->base, segment->size);
    delete segment;
  }
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
  Block* block = nullptr;
  for (;;) {
    block = take_free_block(pool_for(size), size, stream, out);  // rules a, b, c
    if (block != nullptr) break;

    // d. a new segment, the usual size first, then the tightest one.
    const std::size_t usual = segment_size(size), tight = tight_segment_size(size);
    for (std::size_t bytes_of_segment : {usual, tight}) {
      if (within_reserved_limit(bytes_of_segment)) {
        void* base = obtain_segment(lock, bytes_of_segment, stream);
        if (base != nullptr) {
          block = add_segment(base, bytes_of_segment, pool_index(size), stream);
          break;
        }
      }
      if (tight == usual) break;
    }
    if (block != nullptr) {
      out.rule = kRuleD;
      break;
    }

    // e. release wholly free segments, then retry from a.
    if (stage < kRuleE) {
      stage = kRuleE;
      ++stats_.num_alloc_retries;
      if (release_free_segments_locked(lock) > 0) continue;
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

    // g.
    if (why_not_wait.empty()) {
      why_not_wait = within_reserved_limit(tight)
                         ? "the device has no free memory left"
                         : "the device memory limit of " +
                               format_bytes(static_cast<std::int64_t>(options_.reserved_limit)) +
                               " is reached";
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

// Device memory for a new segment, zeroed on `stream`: fresh memory may hold what
// another job freed to the driver. Obtained with the lock released, since the
// call can block (Note [Locking]); nullptr when the device has none.
void* MemoryFlowAllocator::obtain_segment(Lock& lock, std::size_t bytes, StreamId stream) {
  reserving_bytes_ += bytes;
  lock.unlock();
  void* base = nullptr;
  try {
    base = backend_.segment_alloc(bytes);
    if (base != nullptr) backend_.memset_zero(base, bytes, stream);
  } catch (...) {
    lock.lock();
    reserving_bytes_ -= bytes;
    throw;
  }
  lock.lock();
  reserving_bytes_ -= bytes;
  return base;
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

// Note [Borrowing]. Each size class keeps to its own segments, so that long-lived
// small blocks do not split the holes large requests need. But when no segment
// can be had (the limit is reached, and rule e freed none), a small request that
// fails while a larger class's segment has a free block for it would fail a job
// for the sake of tidiness: it takes that block (split; the rest stays in its
// class), before any wait (rule f). Never the other way: a larger request cannot
// use a smaller class's segments.
Block* MemoryFlowAllocator::borrow_free_block(std::size_t size, StreamId stream,
                                              Allocation& out) {
  for (int kind = pool_index(size) + 1; kind < kPoolCount; ++kind) {
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

Block* MemoryFlowAllocator::add_segment(void* base, std::size_t bytes, PoolIndex kind,
                                        StreamId stream) {
  auto* segment = new Segment{static_cast<char*>(base), bytes, nullptr, kind, stream};
  auto* block = new Block;
  block->ptr = segment->base;
  block->size = bytes;
  block->segment = segment;
  block->stream = stream;
  block->owner = kClean;
  segment->head = block;
  segments_.emplace(segment->base, segment);
  update_stat(stats_.reserved_bytes, static_cast<std::int64_t>(bytes));
  update_stat(stats_.segments, 1);
  stats_.fresh_scrubbed_bytes += static_cast<std::int64_t>(bytes);
  // Pending on `stream` behind the zeroing just queued there.
  block->event = new_event(stream);
  StreamPool& pool = pool_of(block).pending[stream];
  pool.by_size.insert(block);
  fifo_push_after(pool, pool.fifo_tail, block);
  count_pending(static_cast<std::int64_t>(bytes));
  return block;
}

Block* MemoryFlowAllocator::carve(Block* block, std::size_t size, std::size_t requested,
                                  StreamId stream, JobId job, Allocation& out) {
  EventRef* event = block->event;
  if (should_split(block->size, size)) {
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
  // Free but not in one piece (fragmentation), or free only behind another stream's work.
  message << "; " << format_bytes(stats_.reserved_bytes.current - stats_.allocated_bytes.current)
          << " reserved but free, the largest piece "
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
  record_lazy_events();  // a victim's event must exist before it can be waited on
  process_events_locked();
  std::vector<Block*> victims;
  for (auto& [base, segment] : segments_) {
    Block* block = segment->head;
    // A job's own: its data alone, last used on its stream, so the wait below
    // is on that job's work only.
    if (block->next == nullptr && is_idle_free(block) && (!job || block->owner == *job)) {
      victims.push_back(block);
    }
  }
  if (victims.empty()) return 0;
  std::size_t released = 0;
  for (Block* block : victims) {
    unlink_free(block);
    if (block->event != nullptr) count_pending(-static_cast<std::int64_t>(block->size));
    segments_.erase(block->segment->base);
    update_stat(stats_.reserved_bytes, -static_cast<std::int64_t>(block->size));
    update_stat(stats_.segments, -1);
    released += block->size;
  }
  // The victims are unreachable now; wait on their own events and free them
  // with the lock released (Note [Locking]).
  lock.unlock();
  for (Block* block : victims) {
    if (block->event != nullptr && !block->event->complete) {
      backend_.event_synchronize(block->event->handle);
    }
    backend_.segment_free(block->segment->base, block->segment->size);
  }
  lock.lock();
  for (Block* block : victims) {
    if (block->event != nullptr) unref(block->event);
    delete block->segment;
    delete block;
  }
  return released;
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
  lock.unlock();
  snap.largest_free_block = static_cast<std::int64_t>(largest_free_block());
  return snap;
}

std::size_t MemoryFlowAllocator::largest_block_for(StreamId stream, std::size_t device_free,
                                                   std::size_t device_total) const {
  const std::size_t largest = std::max(largest_free_block(), device_free);
  Lock lock(mutex_);
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

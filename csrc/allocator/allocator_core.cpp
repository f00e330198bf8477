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
    : backend_(backend), options_(options), page_(backend.page_bytes()) {
  JobStats default_job;
  default_job.name = "default";
  jobs_.push_back(default_job);
  pools_.emplace_back();
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
    for (std::size_t i = 0; i < segment->pages.size(); ++i) {
      if (!segment->pages[i].mapped) continue;
      backend_.page_unmap(segment->base + i * page_, page_);
      if (!segment->pages[i].parked) backend_.page_release(segment->pages[i].handle);
    }
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
  int limit_waits = 0;       // times g asked the run's scheduler (Note [Waiting at the limit])
  bool last_try = false;     // the scheduler said no: one more try as memory is now, then fail
  Block* block = nullptr;
  // At the latest try: pages missing under the request, mapped there, and free elsewhere.
  std::size_t lacking = 0, there = 0, spare = 0;
  std::string scheduler_said;  // why the run's scheduler let it fail (g), if it said
  const auto fail = [&] {  // as it was at the latest try, unless f found a deadlock
    if (!scheduler_said.empty()) {
      out_of_memory(job, bytes, size, limit_reached(lacking, there, spare) + "; " + scheduler_said);
    }
    out_of_memory(job, bytes, size, why_not_wait.empty() ? limit_reached(lacking, there, spare) : why_not_wait);
  };
  for (;;) {
    block = take_free_block(pools_[job][pool_index(size)], size, stream, out);  // a, b, c
    if (block == nullptr) {  // d. a range of the job's own (Note [Layouts])
      block = new_range(size, stream, job);
      if (block == nullptr) {
        out_of_memory(job, bytes, size, "no virtual address space is left for a new range");
      }
      out.rule = kRuleD;
    }
    // d, e. the pages under it, then it is held apart for this request. One
    // block at a time has pages mapped under it (map_under): another waits its
    // turn, then looks again, as blocks may have come and gone.
    // The pages under every byte handed out: the whole block when carve keeps
    // no rest (a live block is never over an unmapped page).
    const std::size_t extent = should_split(block->size, size, block->next == nullptr) ? size : block->size;
    if (mapping_ && lacks_pages(block, extent)) {
      freed_cv_.wait(lock, [&] { return !mapping_; });  // bounded: map_under's waits are
      continue;
    }
    if (map_under(lock, block, extent, stream, job, stage, lacking, there, spare, out)) break;
    if (last_try) fail();

    // f. wait, bounded, for the frees of jobs that are about to release memory.
    if (stage < kRuleF) {
      stage = kRuleF;
      ++stats_.num_alloc_retries;
      deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(options_.release_wait_s));
    }
    if (wait_for_releases(lock, job, deadline, why_not_wait)) continue;

    // g. The run's scheduler first (Note [Waiting at the limit]): a job that fits
    // alone waits there, without our lock, for other jobs' frees, and tries again.
    // Also when f found every job it could wait for waiting here: the scheduler sees
    // every job (who has trained, who can start again) and chooses who gives way.
    const WaitHooks& hooks = options_.wait_hooks;
    if (hooks.at_limit && (!hooks.may_wait || hooks.may_wait())) {
      const std::string name = jobs_[job].name;
      lock.unlock();
      WaitHooks::LimitAnswer answer = hooks.at_limit(name, size, limit_waits++);  // may throw: unlocked
      lock.lock();
      if (answer.retry) {
        stage = kRuleA;
        why_not_wait.clear();
        continue;
      }
      // It fails as memory is when the scheduler said so, not as it was before:
      // meanwhile another job may have given way (its frees are here now), and the
      // message's figures would contradict each other. One more try, no wait.
      // Its reason replaces f's: the scheduler saw every job.
      last_try = true;
      scheduler_said = std::move(answer.why);
      continue;
    }
    fail();
  }

  // The lock may have been released above (d, e, f), and another thread of the
  // same job (e.g. the autograd thread) may have allocated meanwhile.
  if (over_limit(job, size)) {
    release_held(block);
    check_limit();
  }
  out.rule = static_cast<Rule>(std::max<int>(stage, out.rule));
  ++stats_.rule_count[out.rule];
  carve(block, size, bytes, stream, job, out);
  lock.unlock();
  // The block is ours alone now; zero it on our stream, after any wait issued
  // in carve, so the job's first kernel sees zeros. One range: a memset, not a
  // fused launch. Only where the job is not provably one (Note [Side streams]).
  if (out.zeroed) backend_.memset_zero(out.ptr, out.size, stream);
  return out;
}

bool MemoryFlowAllocator::within_reserved_limit(std::size_t segment_bytes) const {
  return options_.reserved_limit == 0 ||
         static_cast<std::size_t>(stats_.reserved_bytes.current) + reserving_bytes_ +
                 segment_bytes <=
             options_.reserved_limit;
}

// a, b: the tighter of the best-fitting block last used on `stream` and the
// best-fitting ready one; then c.
Block* MemoryFlowAllocator::take_free_block(Pool& pool, std::size_t size, StreamId stream,
                                            Allocation& out) {
  process_pool_events(pool);
  poll_deferred();
  Block* own = nullptr;
  auto pending = pool.pending.find(stream);
  if (pending != pool.pending.end()) {
    auto it = pending->second.by_size.lower_bound(size);
    if (it != pending->second.by_size.end()) own = *it;
  }
  auto it = pool.ready.lower_bound(size);
  Block* ready = it != pool.ready.end() ? *it : nullptr;
  if (own != nullptr && (ready == nullptr || BlockBySize()(own, ready))) {
    out.rule = kRuleA;
    return own;
  }
  if (ready != nullptr) {
    out.rule = kRuleB;
    return ready;
  }
  Block* block = take_pending_from_other_streams(pool, size, stream);
  if (block != nullptr) out.rule = kRuleC;
  return block;
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
// Ranges and pages (Note [Layouts])
// ---------------------------------------------------------------------------

// Whether a page (or block) holding `owner`'s data is zeroed for `job`: unless
// clean or provably the job's (Note [Side streams]: the default job's data may
// be any unregistered stream's).
static bool needs_zeroing(JobId owner, JobId job) {
  return owner != kClean && (owner != job || job == kDefaultJob);
}

// Rule d: a new range of `job`'s for a request of `size`: virtual memory only,
// one free block in the job's pool (its pages are mapped as blocks are handed
// out). nullptr when no address space can be had.
Block* MemoryFlowAllocator::new_range(std::size_t size, StreamId stream, JobId job) {
  const std::size_t bytes = range_bytes(size, page_);
  std::size_t room = std::max(range_room(size, page_), bytes + std::min(bytes, kGrowBytes));
  char* base = va_take(room);
  if (base == nullptr && room > bytes) base = va_take(room = bytes);
  if (base == nullptr) {  // ranges nobody uses go first: a job's layout is kept while it can be
    drop_unused_segments(true);
    base = va_take(room);
  }
  if (base == nullptr) return nullptr;
  auto* segment = new Segment;
  segment->base = base;
  segment->size = room;
  segment->job = job;
  segment->pool = pool_index(size);
  segment->stream = stream;
  segment->pages.resize(room / page_);
  auto* block = new Block;
  block->ptr = base;
  block->size = room;
  block->segment = segment;
  block->stream = stream;
  segment->head = block;
  segments_.emplace(base, segment);
  update_stat(stats_.segments, 1);
  pool_of(block).ready.insert(block);
  return block;
}

// Whether a page under the first `size` bytes of `block` is not mapped.
bool MemoryFlowAllocator::lacks_pages(const Block* block, std::size_t size) const {
  const Segment* segment = block->segment;
  const std::size_t start = static_cast<std::size_t>(block->ptr - segment->base);
  for (std::size_t i = start / page_; i <= (start + size - 1) / page_; ++i) {
    if (!segment->pages[i].mapped) return true;
  }
  return false;
}

// The slots of the pages under the first `size` bytes of `block` not mapped.
std::vector<std::size_t> MemoryFlowAllocator::unmapped_slots(const Block* block,
                                                             std::size_t size) const {
  const Segment* segment = block->segment;
  const std::size_t start = static_cast<std::size_t>(block->ptr - segment->base);
  std::vector<std::size_t> slots;
  for (std::size_t i = start / page_; i <= (start + size - 1) / page_; ++i) {
    if (!segment->pages[i].mapped) slots.push_back(i);
  }
  return slots;
}

// d, e: takes `block` out of its pool for a request of `size` (held apart:
// marked allocated, so that nothing takes, merges or cuts it while the lock is
// released) and maps the pages under the request's bytes that are not mapped.
// True with the block held; false, with it back in its pool, `lacking` the
// pages it needed, `there` those mapped under the request already and `spare` the
// whole free pages not under the request, when they cannot be had. Pages are mapped under one block
// at a time (`mapping_`, Note [Locking]): two held blocks sharing a page would
// each map it, and each zero the other's bytes.
bool MemoryFlowAllocator::map_under(Lock& lock, Block* block, std::size_t size, StreamId stream,
                                    JobId job, int& stage, std::size_t& lacking,
                                    std::size_t& there, std::size_t& spare, Allocation& out) {
  const std::vector<std::size_t> slots = unmapped_slots(block, size);
  lacking = slots.size();
  const std::size_t start = static_cast<std::size_t>(block->ptr - block->segment->base);
  there = (start + size - 1) / page_ - start / page_ + 1 - lacking;
  unlink_free(block);
  block->allocated = true;
  if (slots.empty()) return true;
  stage = std::max<int>(stage, kRuleD);
  mapping_ = true;
  std::vector<FreePage> pages;
  bool got = false;
  const auto short_by = [&] { return std::max<std::size_t>(1, pages_beyond_room(lacking)); };
  try {
    // Pages that are no running job's cache first: the budget's free ones and an
    // ended job's idle ones; then fresh ones while the limit has room. Only then do
    // a running job's idle pages move (Note [Layouts]): the block's own past the
    // request, its job's, then others'; then e.
    if (free_pages_.size() < lacking) cut_idle_pages(lacking - free_pages_.size(), job, /*ended_only=*/true);
    bool moved = false;
    while (!(got = take_pages(lock, lacking, job, pages))) {
      if (!moved) {
        moved = true;
        cut_pages_past(block, size, nullptr, short_by());
        if (free_pages_.size() < lacking) cut_idle_pages(short_by(), job);
        continue;
      }
      // e. idle pages behind pending events too (the host waits), then d again.
      if (stage < kRuleE) {
        stage = kRuleE;
        ++stats_.num_alloc_retries;
      }
      if (harvest_pages(lock, short_by(), job) == 0) break;
    }
  } catch (...) {
    end_mapping(block, false);
    throw;
  }
  if (!got) {
    spare = takeable_pages_locked();  // the request's own block is held: not among them
    end_mapping(block, false);
    return false;
  }
  ZeroRuns runs;
  map_pages(block, slots, pages, job, runs);
  if (!runs.empty()) {
    // The zeroed pages are written on `stream`: the blocks over them (the block,
    // and free neighbours sharing a page with it) are held apart meanwhile and
    // then pending there, behind it. Their bytes under a pending event on
    // another stream are in other pages (these were unmapped), but that event
    // is waited for, on the device, before the one recorded after the zeroing
    // stands for both.
    // (A block in scrub over such a page, of an ended job, is in no pool: its
    // bytes there are only marked as not provably anyone's.)
    std::vector<Block*> sharers;
    const auto share = [&](Block* b) {
      if (!is_idle_free(b)) {
        b->owner = kMixed;
      } else if (std::find(sharers.begin(), sharers.end(), b) == sharers.end()) {
        sharers.push_back(b);
      }
    };
    for (const auto& [at, length] : runs) {
      for (Block* b = block->prev; b != nullptr && b->ptr + b->size > at; b = b->prev) share(b);
      for (Block* b = block->next; b != nullptr && b->ptr < at + length; b = b->next) share(b);
    }
    for (Block* b : sharers) {
      unlink_free(b);
      b->allocated = true;
    }
    sharers.push_back(block);
    for (Block* b : sharers) {
      if (b->event == nullptr) {
        count_pending(static_cast<std::int64_t>(b->size));
        continue;
      }
      if (b->stream != stream && !is_complete(b->event)) {
        backend_.stream_wait_event(stream, b->event->handle);
        if (b == block) out.waited = true;
      }
      unref(b->event);
      b->event = nullptr;
    }
    lock.unlock();
    for (const auto& [at, length] : runs) backend_.memset_zero(at, length, stream);
    lock.lock();
    EventRef* event = new_event(stream);
    event->refs = 0;
    for (Block* b : sharers) {
      b->event = event;
      ++event->refs;
      b->stream = stream;
      if (b == block) continue;
      b->allocated = false;
      relink_free(b);
    }
  }
  end_mapping(block, true);
  return true;
}

// map_under is done: others may map pages; the block stays held, or goes back.
void MemoryFlowAllocator::end_mapping(Block* block, bool keep) {
  mapping_ = false;
  freed_cv_.notify_all();
  if (!keep) release_held(block);
}

// A block map_under held apart goes back to its pool as it was.
void MemoryFlowAllocator::release_held(Block* block) {
  block->allocated = false;
  relink_free(block);
}

// `count` pages for `job`: the budget's free pages first (the job's own and
// clean ones before others'), then fresh ones within the limit, made with the
// lock released (Note [Locking]). False, with nothing changed, when they do not
// suffice.
bool MemoryFlowAllocator::take_pages(Lock& lock, std::size_t count, JobId job,
                                     std::vector<FreePage>& pages) {
  const std::size_t reused = std::min(count, free_pages_.size());
  const std::size_t fresh = count - reused;
  if (fresh > 0 && !within_reserved_limit(fresh * page_)) return false;
  std::stable_partition(free_pages_.begin(), free_pages_.end(),
                        [&](const FreePage& page) { return needs_zeroing(page.owner, job); });
  pages.assign(free_pages_.end() - static_cast<std::ptrdiff_t>(reused), free_pages_.end());
  free_pages_.resize(free_pages_.size() - reused);
  if (fresh == 0) return true;
  std::vector<PageHandle> made;
  bool complete = false;
  reserving_bytes_ += fresh * page_;
  lock.unlock();
  try {
    complete = backend_.pages_create(fresh, &made);
  } catch (...) {
    lock.lock();
    reserving_bytes_ -= fresh * page_;
    free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
    pages.clear();
    throw;
  }
  lock.lock();
  reserving_bytes_ -= fresh * page_;
  if (!complete) {
    free_pages_.insert(free_pages_.end(), pages.begin(), pages.end());
    pages.clear();
    return false;
  }
  const JobId fresh_owner = backend_.fresh_pages_zeroed() ? kClean : kMixed;
  for (PageHandle handle : made) pages.push_back({handle, fresh_owner});
  update_stat(stats_.reserved_bytes, static_cast<std::int64_t>(fresh * page_));
  return true;
}

// Maps `pages` at `slots` of a held block's segment, for `job`. A page holding
// the job's data or clean memory joins the owners of the blocks over it (Note
// [Owners]); any other is zeroed whole, on the caller's stream with the lock
// released: `zero_runs`.
void MemoryFlowAllocator::map_pages(Block* block, const std::vector<std::size_t>& slots,
                                    const std::vector<FreePage>& pages, JobId job,
                                    ZeroRuns& zero_runs) {
  Segment* segment = block->segment;
  const JobId fresh_owner = backend_.fresh_pages_zeroed() ? kClean : kMixed;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    char* page = segment->base + slots[i] * page_;
    PageSlot& slot = segment->pages[slots[i]];
    backend_.page_map(page, pages[i].handle);
    slot.handle = pages[i].handle;
    slot.mapped = true;
    ++segment->mapped;
    ++segment->idle;  // under no live block yet (carve counts the block's use)
    ++idle_pages_;
    if (!needs_zeroing(pages[i].owner, job)) {
      block->owner = combine_owners(block->owner, pages[i].owner);
      for (Block* b = block->prev; b != nullptr && b->ptr + b->size > page; b = b->prev) {
        b->owner = combine_owners(b->owner, pages[i].owner);
      }
      for (Block* b = block->next; b != nullptr && b->ptr < page + page_; b = b->next) {
        b->owner = combine_owners(b->owner, pages[i].owner);
      }
      continue;
    }
    // Fresh pages a device hands out unzeroed are kMixed: counted apart.
    if (pages[i].owner == fresh_owner) {
      stats_.fresh_scrubbed_bytes += static_cast<std::int64_t>(page_);
    } else {
      stats_.scrubbed_bytes += static_cast<std::int64_t>(page_);
      jobs_[job].scrubbed_bytes += static_cast<std::int64_t>(page_);
    }
    if (!zero_runs.empty() && zero_runs.back().first + zero_runs.back().second == page) {
      zero_runs.back().second += page_;
    } else {
      zero_runs.emplace_back(page, page_);
    }
  }
}

// Counts a block's use of the pages under it (+1 handed out, -1 freed): a page
// under no live block is idle. Keeps each job's held bytes and their window peak.
void MemoryFlowAllocator::use_pages(const Block* block, int delta) {
  Segment* segment = block->segment;
  const std::size_t start = static_cast<std::size_t>(block->ptr - segment->base);
  std::int64_t changed = 0;
  bool finished = false;
  for (std::size_t i = start / page_; i <= (start + block->size - 1) / page_; ++i) {
    PageSlot& slot = segment->pages[i];
    if (delta > 0 ? slot.uses++ != 0 : --slot.uses != 0) continue;
    if (slot.parked) {  // its last live block went: the copy goes (Note [Parking]) ...
      // ... once no kernel of it still runs: waited for with the lock held (rare: a
      // block freed by a thread of the job that is not the one parked), as a kernel
      // reading an unmapped copy would end every job's context.
      if (!finished) wait_for_streams({block->stream}, nullptr);
      finished = true;
      backend_.page_unmap(segment->base + i * page_, page_);
      slot.parked = slot.mapped = false;
      --segment->mapped;
      update_stat(jobs_[segment->job].parked_bytes, -static_cast<std::int64_t>(page_));
      continue;
    }
    changed += delta;
    if (slot.mapped) {
      segment->idle -= static_cast<std::size_t>(delta > 0);
      segment->idle += static_cast<std::size_t>(delta < 0);
      idle_pages_ = delta > 0 ? idle_pages_ - 1 : idle_pages_ + 1;
    }
  }
  if (changed == 0) return;
  JobStats& stats = jobs_[segment->job];
  update_stat(stats.held_bytes, changed * static_cast<std::int64_t>(page_));
  stats.window_peak = std::max(stats.window_peak, stats.held_bytes.current);
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

// At least `wanted` pages back to the budget, if ready free blocks hold idle
// ones: ended jobs' ranges first (no one's cache), then the job's own (no
// zeroing), then other running jobs', those with the most idle pages first;
// with `ended_only`, ended jobs' alone. Returns the pages gained.
std::size_t MemoryFlowAllocator::cut_idle_pages(std::size_t wanted, JobId job, bool ended_only) {
  process_events_locked();
  const auto rank = [&](const Segment* segment) {
    return !jobs_[segment->job].active ? 0 : segment->job == job ? 1 : 2;
  };
  std::vector<Segment*> candidates;
  for (auto& [base, segment] : segments_) {
    if (segment->idle > 0 && (!ended_only || rank(segment) == 0)) candidates.push_back(segment);
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](const Segment* x, const Segment* y) {
    return rank(x) != rank(y) ? rank(x) < rank(y) : x->idle > y->idle;
  });
  std::size_t gained = 0;
  for (Segment* segment : candidates) {
    // An ended job's pages all go (its range can then be given back); a running
    // job's cache loses only the pages wanted.
    const bool whole = rank(segment) == 0;
    for (Block* block = segment->head; block != nullptr && gained < wanted; block = block->next) {
      if (is_idle_free(block) && block->event == nullptr) {
        gained += cut_pages_past(block, 0, nullptr, whole ? SIZE_MAX : wanted - gained);
      }
    }
    if (gained >= wanted) break;
  }
  if (gained > 0) {
    stats_.num_page_moves += static_cast<std::int64_t>(gained);
    drop_unused_segments(false);
    ++free_count_;  // pages came back: rule f's waiters look again
    if (release_waiters_ > 0) freed_cv_.notify_all();
  }
  return gained;
}

// Waits, with the lock released, for the events of pending free blocks over
// idle pages (with `job`, only that job's ranges): a page is unmapped only once
// its last use completed. False when there was none to wait for.
bool MemoryFlowAllocator::wait_for_pending_pages(Lock& lock, std::optional<JobId> job) {
  record_lazy_events();  // an event must exist before it can be waited on
  process_events_locked();
  std::vector<EventRef*> events;
  for (JobId owner = 0; owner < static_cast<JobId>(pools_.size()); ++owner) {
    if (job && owner != *job) continue;
    for (Pool& kind : pools_[owner]) {
      for (auto& [stream, pool] : kind.pending) {
        for (Block* block = pool.fifo_head; block != nullptr; block = block->fifo_next) {
          if (block->segment->idle == 0) continue;
          if (std::find(events.begin(), events.end(), block->event) != events.end()) continue;
          ++block->event->refs;
          events.push_back(block->event);
        }
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

// Cuts the mapped pages wholly inside a ready free block out of its range, in
// place: they are unmapped, the block stays as it was (Note [Layouts]), and
// they join the budget's free pages (or `into`) with the block's owner.
// Returns the pages cut.
std::size_t MemoryFlowAllocator::cut_pages(Block* block, std::vector<FreePage>* into) {
  return cut_pages_past(block, 0, into);
}

// The same, past the first `keep` bytes of the block, and at most `most` pages:
// the last ones, so that the block's front, where its job's next request of
// the kind starts, stays mapped.
std::size_t MemoryFlowAllocator::cut_pages_past(Block* block, std::size_t keep,
                                                std::vector<FreePage>* into, std::size_t most) {
  Segment* segment = block->segment;
  const std::size_t start = static_cast<std::size_t>(block->ptr - segment->base);
  std::size_t first = (start + keep + page_ - 1) / page_;
  const std::size_t last = (start + block->size) / page_;  // one past
  for (std::size_t i = last, seen = 0; i > first && seen < most;) {
    seen += segment->pages[--i].mapped;
    if (seen == most) first = i;
  }
  std::size_t count = 0;
  for (std::size_t i = first; i < last; ++i) {
    PageSlot& slot = segment->pages[i];
    if (!slot.mapped) continue;
    std::size_t run = i;  // unmapped as one call per run of mapped pages
    while (run < last && segment->pages[run].mapped) {
      PageSlot& page = segment->pages[run];
      (into != nullptr ? *into : free_pages_).push_back({page.handle, block->owner});
      page.mapped = false;
      ++run;
    }
    backend_.page_unmap(segment->base + i * page_, (run - i) * page_);
    count += run - i;
    i = run;
  }
  segment->mapped -= count;
  segment->idle -= count;
  idle_pages_ -= count;
  return count;
}

// Note [Parking]. When two jobs at the limit each hold what the other needs (both
// outgrew their plans at once), one must let go, and a job that fits alone must
// not die of it. The engine parks the one that gives way: the pages under its
// live blocks are copied to host memory, mapped at the same addresses (its
// tensors stay where they are, readable and writable: a thread of the job still
// running sees its bytes), and the pages go to the budget, with the job as their
// owner (zeroed before another job sees them). It waits, its thread blocked in its
// request, until the other job has freed them, and unpark_job brings them back,
// copying the bytes into pages of the budget, before its request is tried again.
// A parked page is mapped and held by a live block but not counted in the job's
// held bytes; when its last block is freed meanwhile, its copy goes at once, so
// a parked page is never idle and no rule that cuts idle pages meets one; nor is
// its copy scrubbed, listed in segments() or counted in a free run (it may go
// with its last block while a scrub writes there). A page is copied only once
// the work queued on it is done (a GPU's kernels may still be writing it): park
// and unpark first wait for every stream the job's ranges were used on
// (wait_for_job_work), and a copy that goes with its last block goes once that
// block's stream is done. Where the backend cannot park (a
// GPU whose driver maps no host memory), the job gives way as before: its
// request fails. Writes by
// the job's other threads between a copy and its mapping are lost: only the
// job's own thread waits, and it is the one parked.
std::size_t MemoryFlowAllocator::park_job(const std::string& name) {
  Lock lock(mutex_);
  const std::optional<JobId> job = find_job_locked(name);
  if (!job) return 0;
  do {  // both at once: each wait lets the lock go
    freed_cv_.wait(lock, [&] { return !mapping_; });  // pages being mapped under a block: bounded, as in allocate
    wait_for_job_work(lock, *job);
  } while (mapping_);
  std::size_t count = 0;
  const auto page = static_cast<std::int64_t>(page_);
  bool can = true;
  for (auto it = segments_.begin(); can && it != segments_.end(); ++it) {
    Segment* segment = it->second;
    if (segment->job != *job) continue;
    for (std::size_t i = 0; i < segment->pages.size(); ++i) {
      PageSlot& slot = segment->pages[i];
      if (!slot.mapped || slot.parked || slot.uses == 0) continue;
      if (!(can = backend_.page_park(segment->base + i * page_, slot.handle))) break;
      free_pages_.push_back({slot.handle, *job});
      slot.handle = 0;
      slot.parked = true;
      update_stat(jobs_[*job].held_bytes, -page);  // page by page: a backend that throws leaves them true
      update_stat(jobs_[*job].parked_bytes, page);
      ++count;
    }
  }
  if (count == 0) return 0;
  ++free_count_;  // pages came back: rule f's waiters look again
  if (release_waiters_ > 0) freed_cv_.notify_all();
  return count * page_;
}

// Waits, with the lock let go, for the work queued so far on every stream that
// may use the job's pages (Note [Parking]): its registered and side streams, its
// live blocks' streams and record_stream's, and those of its blocks freed behind
// a pending event. An event recorded now on a stream covers all of it. (Not the
// streams of idle cached blocks: nothing of theirs runs, and such a stream may be
// gone.)
void MemoryFlowAllocator::wait_for_job_work(Lock& lock, JobId job) {
  std::vector<StreamId> streams;
  const auto add = [&](StreamId stream) {
    if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
  };
  for (const auto* streams_of : {&stream_jobs_, &side_streams_}) {
    for (const auto& [stream, owner] : *streams_of) {
      if (owner == job) add(stream);
    }
  }
  for (const auto& [base, segment] : segments_) {
    if (segment->job != job) continue;
    for (const Block* block = segment->head; block != nullptr; block = block->next) {
      if (block->allocated || block->event != nullptr) add(block->stream);
      for (StreamId stream : block->extra_streams) add(stream);
      for (const EventRef* event : block->deferred_events) add(event->stream);
    }
  }
  wait_for_streams(streams, &lock);
}

// Blocks the host until the work queued so far on `streams` is done: with `lock`
// let go meanwhile, or, without, held (Note [Parking]).
void MemoryFlowAllocator::wait_for_streams(const std::vector<StreamId>& streams, Lock* lock) {
  std::vector<EventHandle> events;
  const auto destroy = [&] {
    for (EventHandle event : events) backend_.event_destroy(event);
  };
  try {
    for (StreamId stream : streams) {
      events.push_back(backend_.event_create());
      backend_.event_record(events.back(), stream);
    }
    if (lock != nullptr) lock->unlock();
    for (EventHandle event : events) backend_.event_synchronize(event);
    if (lock != nullptr) lock->lock();
  } catch (...) {
    if (lock != nullptr && !lock->owns_lock()) lock->lock();
    destroy();
    throw;
  }
  destroy();
}

bool MemoryFlowAllocator::unpark_job(const std::string& name) {
  Lock lock(mutex_);
  const std::optional<JobId> job = find_job_locked(name);
  if (!job) return true;
  wait_for_job_work(lock, *job);  // its kernels may still read or write the copies
  const auto parked_slots = [&] {
    std::vector<std::pair<Segment*, std::size_t>> slots;
    for (auto& [base, segment] : segments_) {
      if (segment->job != *job) continue;
      for (std::size_t i = 0; i < segment->pages.size(); ++i) {
        if (segment->pages[i].parked) slots.emplace_back(segment, i);
      }
    }
    return slots;
  };
  const std::size_t wanted = parked_slots().size();
  if (wanted == 0) return true;
  // The budget's free pages first, then fresh ones within the limit, then idle
  // pages cut out of ready free blocks (other jobs' caches).
  if (const std::size_t short_by = pages_beyond_room(wanted)) cut_idle_pages(short_by, *job);
  std::vector<FreePage> pages;
  if (!take_pages(lock, wanted, *job, pages)) return false;
  // The lock may have been let go: a block the job's other thread freed meanwhile
  // took its copy with it (use_pages); the pages left over go back to the budget.
  const auto slots = parked_slots();  // no more than before: only the engine parks, one job at a time
  std::size_t k = 0;
  const auto page = static_cast<std::int64_t>(page_);
  try {
    for (; k < slots.size() && k < pages.size(); ++k) {
      auto [segment, i] = slots[k];
      PageSlot& slot = segment->pages[i];
      backend_.page_unpark(segment->base + i * page_, pages[k].handle);
      slot.handle = pages[k].handle;
      slot.parked = false;
      update_stat(jobs_[*job].parked_bytes, -page);
      update_stat(jobs_[*job].held_bytes, page);
    }
  } catch (...) {  // the pages not mapped go back; the slots not unparked stay parked
    free_pages_.insert(free_pages_.end(), pages.begin() + static_cast<std::ptrdiff_t>(k), pages.end());
    throw;
  }
  free_pages_.insert(free_pages_.end(), pages.begin() + static_cast<std::ptrdiff_t>(k), pages.end());
  jobs_[*job].window_peak = std::max(jobs_[*job].window_peak, jobs_[*job].held_bytes.current);
  return k == slots.size();
}

// Ranges with no page mapped and no live block, given back: ended jobs' (their
// layout is no one's any more), and with `active_too` any job's (when address
// space runs out).
void MemoryFlowAllocator::drop_unused_segments(bool active_too) {
  for (auto it = segments_.begin(); it != segments_.end();) {
    Segment* segment = it->second;
    bool unused = segment->mapped == 0 && (active_too || !jobs_[segment->job].active);
    for (Block* block = segment->head; unused && block != nullptr; block = block->next) {
      unused = is_idle_free(block);
    }
    if (!unused) {
      ++it;
      continue;
    }
    for (Block* block = segment->head; block != nullptr;) {
      Block* next = block->next;
      unlink_free(block);
      if (block->event != nullptr) {
        count_pending(-static_cast<std::int64_t>(block->size));
        unref(block->event);
      }
      delete block;
      block = next;
    }
    va_give(segment->base, segment->size);
    it = segments_.erase(it);
    update_stat(stats_.segments, -1);
    delete segment;
  }
}

bool MemoryFlowAllocator::can_park() const { return backend_.can_park(); }

// Bytes of the jobs' pages parked in host memory (Note [Parking]): allocated, not reserved.
std::int64_t MemoryFlowAllocator::parked_bytes_locked() const {
  std::int64_t parked = 0;
  for (const JobStats& job : jobs_) parked += job.parked_bytes.current;
  return parked;
}

// How many of `wanted` pages neither the budget's free ones nor fresh ones the
// limit has room for would give (without a limit, beyond the free ones): what
// idle pages must make up.
std::size_t MemoryFlowAllocator::pages_beyond_room(std::size_t wanted) const {
  std::size_t room = free_pages_.size();
  if (options_.reserved_limit != 0) {
    const auto held = static_cast<std::size_t>(stats_.reserved_bytes.current);
    if (held < options_.reserved_limit) room += (options_.reserved_limit - held) / page_;
  }
  return wanted > room ? wanted - room : 0;
}

// Idle pages: mapped, under no live block, in any range.
std::size_t MemoryFlowAllocator::idle_pages_locked() const { return idle_pages_; }

// Whole free pages now: the budget's, and the idle ones of the ranges.
std::size_t MemoryFlowAllocator::free_whole_pages_locked() const {
  return free_pages_.size() + idle_pages_locked();
}

// Whole free pages a request could take now, without waiting: the budget's, and
// the mapped pages wholly inside ready free blocks (what cut_pages cuts). Idle
// pages behind a pending event, in a scrub or deferred are not, nor those that
// a free block shares with another block.
std::size_t MemoryFlowAllocator::takeable_pages_locked() const {
  std::size_t count = free_pages_.size();
  for (const auto& [base, segment] : segments_) {
    if (segment->idle == 0) continue;
    for (const Block* block = segment->head; block != nullptr; block = block->next) {
      if (!is_idle_free(block) || block->event != nullptr) continue;
      const auto start = static_cast<std::size_t>(block->ptr - segment->base);
      for (std::size_t i = (start + page_ - 1) / page_; i < (start + block->size) / page_; ++i) {
        count += segment->pages[i].mapped;
      }
    }
  }
  return count;
}

// The longest run of mapped bytes inside a block, in the budget's pages (a parked
// page's copy is the job's until its last block goes: never scrubbed nor handed out).
std::size_t MemoryFlowAllocator::mapped_run(const Block* block) const {
  const Segment* segment = block->segment;
  const char* end = block->ptr + block->size;
  std::size_t best = 0, run = 0;
  for (const char* at = block->ptr; at < end;) {
    const std::size_t i = static_cast<std::size_t>(at - segment->base) / page_;
    const char* page_end = std::min<const char*>(end, segment->base + (i + 1) * page_);
    run = segment->pages[i].in_budget() ? run + static_cast<std::size_t>(page_end - at) : 0;
    best = std::max(best, run);
    at = page_end;
  }
  return best;
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
    if (base == nullptr && release_free_reservations()) {
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

// Hands out the first `size` bytes of a block map_under holds (its pages
// mapped): the rest, if worth keeping, stays free in its pool.
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
    block->size = size;
    if (event != nullptr) {  // the rest stays pending behind the same event
      rest->event = event;
      ++event->refs;
      relink_free(rest);
    } else {
      insert_ready(rest);  // a ready neighbour freed while the block was held joins it
    }
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
  use_pages(block, +1);

  const auto bytes = static_cast<std::int64_t>(block->size);
  const auto asked = static_cast<std::int64_t>(requested);
  update_stat(stats_.allocated_bytes, bytes);
  update_stat(stats_.requested_bytes, asked);
  update_stat(stats_.allocations, 1);
  update_stat(jobs_[job].allocated_bytes, bytes);
  jobs_[job].largest_block = std::max(jobs_[job].largest_block, bytes);
  update_stat(jobs_[job].requested_bytes, asked);
  update_stat(jobs_[job].allocations, 1);
  out.ptr = block->ptr;
  out.size = block->size;
  return block;
}

// Note [Rule f deadlock]. Jobs that wait here free nothing while they wait. If
// every job the caller could wait for is already waiting (each for the others'
// frees), none will free before the deadline, and all of them would fail when it
// passes. The caller, the latest to arrive, stops waiting at once instead: the
// run's scheduler (rule g) chooses who gives way, and with none it fails: its
// frees, as its exception unwinds, wake the others. A waiter that a free has woken (it has
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

// Said as it was at the latest try: the pages the request lacked, those mapped
// where it goes, the whole free pages elsewhere (the budget's and idle ones: the
// report's free pages count those under the request too), the pages the limit
// leaves room for, and the limit if that is what stopped d.
std::string MemoryFlowAllocator::limit_reached(std::size_t lacking, std::size_t there, std::size_t spare) const {
  std::size_t under_limit = 0;
  if (options_.reserved_limit != 0) {
    const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current) + reserving_bytes_;
    if (reserved < options_.reserved_limit) under_limit = (options_.reserved_limit - reserved) / page_;
  }
  std::ostringstream why;
  if (!within_reserved_limit(lacking > spare ? (lacking - spare) * page_ : 0)) {
    why << "the device memory limit of " << format_bytes(static_cast<std::int64_t>(options_.reserved_limit))
        << " is reached";
  } else {
    why << "the device gave no more pages";
  }
  why << " (it needs " << lacking << " pages of " << format_bytes(page_) << " besides the " << there
      << " mapped where it goes; " << spare << " other reserved ones are free";
  if (options_.reserved_limit != 0) why << ", and the limit has room for " << under_limit << " more";
  why << ")";
  return why.str();
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
          << format_bytes(stats_.allocated_bytes.current) << " allocated";
  const std::int64_t parked = parked_bytes_locked();
  if (parked != 0) message << " (" << format_bytes(parked) << " of it parked in host memory)";
  message << "; by job:";
  const char* separator = " ";
  for (const JobStats& other : jobs_) {
    if (other.allocated_bytes.current == 0 && &other != &jobs_[job]) continue;
    message << separator << other.name << " " << format_bytes(other.allocated_bytes.current);
    separator = ", ";
  }
  // Free as whole pages (any range can take them), in pieces smaller than a
  // page, or only behind another stream's work.
  const std::size_t free_pages = free_whole_pages_locked();
  message << "; " << format_bytes(stats_.reserved_bytes.current - stats_.allocated_bytes.current + parked)
          << " reserved but free: " << free_pages << " whole pages ("
          << format_bytes(static_cast<std::int64_t>(free_pages * page_)) << "), "
          << takeable_pages_locked() << " of them takeable now, the largest free run "
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
    use_pages(block, -1);
    block->event = free_event(block->stream);
    insert_free(block);
  } else {  // still in use on other streams: its pages stay held until they are done
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

// unlink_free's inverse: the block back in its pool as it was (no merge, no
// count), a pending one in its event's place in its stream's free order.
void MemoryFlowAllocator::relink_free(Block* block) {
  if (block->event == nullptr) {
    pool_of(block).ready.insert(block);
    return;
  }
  StreamPool& pool = pool_of(block).pending[block->stream];
  pool.by_size.insert(block);
  Block* after = pool.fifo_tail;
  while (after != nullptr && after->event->serial > block->event->serial) after = after->fifo_prev;
  fifo_push_after(pool, after, block);
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

// Free blocks whose events completed move to the ready pool: every job's, or
// only `job`'s.
void MemoryFlowAllocator::process_events_locked(std::optional<JobId> job) {
  for (JobId owner = 0; owner < static_cast<JobId>(pools_.size()); ++owner) {
    if (job && owner != *job) continue;
    for (Pool& kind : pools_[owner]) process_pool_events(kind);
  }
  poll_deferred();
}

void MemoryFlowAllocator::process_pool_events(Pool& kind) {
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
    use_pages(block, -1);
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
    if (segment->job != *job || segment->mapped == 0) continue;
    for (Block* block = segment->head; block != nullptr; block = block->next) {
      if (is_idle_free(block) && block->owner == *job && mapped_run(block) > 0) {
        dirty.push_back(block);
      }
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
    // Its mapped runs: unmapped pages hold nothing, and cannot be written.
    const Segment* segment = block->segment;
    char* const end = block->ptr + block->size;
    for (char* at = block->ptr; at < end;) {
      const std::size_t i = static_cast<std::size_t>(at - segment->base) / page_;
      char* run_end = at;
      // Not a parked copy: it may go with its last block while the scrub writes.
      for (std::size_t j = i; j < segment->pages.size() && segment->pages[j].in_budget(); ++j) {
        run_end = std::min(end, segment->base + (j + 1) * page_);
        if (run_end == end) break;
      }
      if (run_end > at) {
        in_scrub_.emplace(at, std::make_pair(block, static_cast<std::size_t>(run_end - at)));
        ranges.push_back({at, static_cast<std::size_t>(run_end - at)});
        at = run_end;
      } else {
        at = std::min(end, segment->base + (i + 1) * page_);
      }
    }
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
  std::vector<Block*> blocks;  // each once: a block's runs come apart
  std::unordered_map<Block*, std::int64_t> zeroed_bytes;
  for (void* ptr : ptrs) {
    auto it = in_scrub_.find(ptr);
    if (it == in_scrub_.end()) throw std::invalid_argument(not_in_scrub);
    auto [block, run] = it->second;
    if (zeroed_bytes.count(block) == 0) blocks.push_back(block);
    zeroed_bytes[block] += static_cast<std::int64_t>(run);
  }
  if (blocks.empty()) return;
  for (void* ptr : ptrs) in_scrub_.erase(ptr);
  // One event after the zeroing covers every block of the batch.
  note_stream(scrub_stream);
  EventRef* event = new_event(scrub_stream);
  event->refs = 0;
  for (Block* block : blocks) {
    const auto bytes = static_cast<std::int64_t>(block->size);
    if (zeroed) {
      stats_.batch_scrubbed_bytes += zeroed_bytes[block];
      if (block->owner >= 0) jobs_[block->owner].batch_scrubbed_bytes += zeroed_bytes[block];
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
// empty_cache: idle pages back to the device
// ---------------------------------------------------------------------------

std::size_t MemoryFlowAllocator::release_free_segments(std::optional<JobId> job) {
  Lock lock(mutex_);
  return release_free_segments_locked(lock, job);
}

std::size_t MemoryFlowAllocator::release_free_segments_locked(Lock& lock,
                                                              std::optional<JobId> job) {
  // A job's own: its ranges alone, so the wait is on that job's work only.
  wait_for_pending_pages(lock, job);
  process_events_locked();
  std::vector<FreePage> cut;
  for (auto& [base, segment] : segments_) {
    if ((job && segment->job != *job) || segment->idle == 0) continue;
    for (Block* block = segment->head; block != nullptr; block = block->next) {
      if (is_idle_free(block) && block->event == nullptr) cut_pages(block, &cut);
    }
  }
  drop_unused_segments(false);
  auto kept = std::stable_partition(free_pages_.begin(), free_pages_.end(), [&](const FreePage& page) {
    return job && page.owner != *job;
  });
  cut.insert(cut.end(), kept, free_pages_.end());
  free_pages_.erase(kept, free_pages_.end());
  std::vector<PageHandle> released;
  for (const FreePage& page : cut) released.push_back(page.handle);
  if (released.empty()) return 0;
  // Released under the lock: until the device has them back they still count
  // as held, or a request meanwhile would find neither them nor room for fresh
  // ones. Unmapped and idle, a page goes back at once (Note [Locking]).
  for (PageHandle page : released) backend_.page_release(page);
  const std::size_t bytes = released.size() * page_;
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
    pools_.emplace_back();
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
  snap.fragmentation_bytes = stats_.reserved_bytes.current - stats_.allocated_bytes.current + parked_bytes_locked();
  snap.free_page_bytes = static_cast<std::int64_t>(free_whole_pages_locked() * page_);
  snap.page_bytes = static_cast<std::int64_t>(page_);
  lock.unlock();
  snap.largest_free_block = static_cast<std::int64_t>(largest_free_block());
  return snap;
}

std::size_t MemoryFlowAllocator::largest_block_for(StreamId stream, std::size_t device_free,
                                                   std::size_t device_total) const {
  Lock lock(mutex_);
  // A block over pages mapped for it (free, idle anywhere, or fresh), or a
  // mapped free run of its own job's ranges.
  const JobId job_id = job_of_stream_locked(stream);
  const std::size_t free_pages = free_whole_pages_locked() * page_;
  std::size_t largest = device_free + free_pages;
  for (const Pool& kind : pools_[job_id]) {
    for (const Block* block : kind.ready) largest = std::max(largest, mapped_run(block));
  }
  const JobStats& job = jobs_[job_id];
  const std::size_t capacity =
      options_.reserved_limit != 0 ? options_.reserved_limit : device_total;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current);
  const std::size_t held = reserved > free_pages ? reserved - free_pages : 0;  // pages under live blocks
  std::size_t headroom = capacity > held ? capacity - held : 0;
  if (job.limit != 0) {
    const auto mine = static_cast<std::size_t>(job.allocated_bytes.current);
    headroom = std::min(headroom, job.limit > mine ? job.limit - mine : 0);
  }
  return std::min(largest, headroom);
}

std::size_t MemoryFlowAllocator::largest_free_block() const {
  Lock lock(mutex_);
  return largest_free_block_locked();
}

// The longest mapped run of free bytes in one block, over every range.
std::size_t MemoryFlowAllocator::largest_free_block_locked() const {
  std::size_t largest = 0;
  for (const Pools& pools : pools_) {
    for (const Pool& kind : pools) {
      for (const Block* block : kind.ready) largest = std::max(largest, mapped_run(block));
      for (const auto& [stream, pool] : kind.pending) {
        for (const Block* block : pool.by_size) largest = std::max(largest, mapped_run(block));
      }
    }
  }
  return largest;
}

// Each range's mapped runs, as torch reports segments (memory it holds): the
// blocks over a run, free ones cut to it.
std::vector<SegmentInfo> MemoryFlowAllocator::segments() const {
  Lock lock(mutex_);
  std::vector<SegmentInfo> result;
  for (const auto& [base, segment] : segments_) {
    const Block* block = segment->head;
    for (std::size_t i = 0; i < segment->pages.size();) {
      if (!segment->pages[i].in_budget()) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < segment->pages.size() && segment->pages[j].in_budget()) ++j;
      char* const start = segment->base + i * page_;
      char* const end = segment->base + j * page_;
      SegmentInfo info{reinterpret_cast<std::uintptr_t>(start), static_cast<std::size_t>(end - start),
                       segment->stream, segment->small(), {}};
      while (block != nullptr && block->ptr + block->size <= start) block = block->next;
      for (const Block* b = block; b != nullptr && b->ptr < end; b = b->next) {
        char* const from = std::max(b->ptr, start);
        char* const to = std::min(b->ptr + b->size, end);
        info.blocks.push_back({reinterpret_cast<std::uintptr_t>(from), static_cast<std::size_t>(to - from),
                               b->allocated, b->event != nullptr || b->deferred, b->in_scrub,
                               b->deferred, b->stream, b->owner, b->allocated ? b->requested : 0});
      }
      result.push_back(std::move(info));
      i = j;
    }
  }
  return result;
}

// The invariants of waterwave_allocator.h, checked over every range, block and
// page: "" when they hold, else the first one broken. For tests; O(everything).
std::string MemoryFlowAllocator::check_invariants() const {
  Lock lock(mutex_);
  std::ostringstream broken;
  std::size_t mapped_total = 0, idle_total = 0;
  std::vector<std::int64_t> held(jobs_.size(), 0), parked(jobs_.size(), 0);
  for (const auto& [base, segment] : segments_) {
    if (segment->pages.size() * page_ != segment->size) return "a range's pages do not cover it";
    std::vector<std::uint32_t> uses(segment->pages.size(), 0);
    char* at = segment->base;
    for (const Block* block = segment->head; block != nullptr; block = block->next) {
      if (block->ptr != at || block->segment != segment) return "blocks do not tile their range";
      if (block->next != nullptr && block->next->prev != block) return "a block's links disagree";
      at += block->size;
      const std::size_t start = static_cast<std::size_t>(block->ptr - segment->base);
      if (block->allocated || block->deferred) {
        for (std::size_t i = start / page_; i <= (start + block->size - 1) / page_; ++i) {
          ++uses[i];
          if (!segment->pages[i].mapped) return "a live block is over an unmapped page";
        }
      }
      if (is_idle_free(block)) {
        const Pool& pool = pools_[segment->job][segment->pool];
        bool found = false;
        if (block->event == nullptr) {
          found = pool.ready.count(const_cast<Block*>(block)) != 0;
        } else {
          auto stream_pool = pool.pending.find(block->stream);
          found = stream_pool != pool.pending.end() &&
                  stream_pool->second.by_size.count(const_cast<Block*>(block)) != 0;
        }
        if (!found) return "a free block is not in its pool";
      }
    }
    if (at != segment->base + segment->size) return "blocks do not tile their range";
    std::size_t mapped = 0, idle = 0;
    for (std::size_t i = 0; i < segment->pages.size(); ++i) {
      const PageSlot& slot = segment->pages[i];
      if (slot.uses != uses[i]) {
        broken << "page " << i << " of a range counts " << slot.uses << " uses, not " << uses[i];
        return broken.str();
      }
      if (slot.parked && (!slot.mapped || slot.uses == 0)) return "a parked page is under no live block";
      mapped += slot.mapped;
      idle += slot.mapped && slot.uses == 0;
      parked[segment->job] += slot.parked ? static_cast<std::int64_t>(page_) : 0;
      if (slot.uses > 0 && !slot.parked) held[segment->job] += static_cast<std::int64_t>(page_);
      mapped_total += slot.in_budget();  // a parked page's is in the budget's free ones
    }
    if (mapped != segment->mapped || idle != segment->idle) return "a range's page counts drifted";
    idle_total += idle;
  }
  if (idle_total != idle_pages_) return "the idle page count drifted";
  for (std::size_t job = 0; job < jobs_.size(); ++job) {
    if (held[job] != jobs_[job].held_bytes.current) {
      broken << "job '" << jobs_[job].name << "' holds " << held[job] << " bytes of pages, not "
             << jobs_[job].held_bytes.current;
      return broken.str();
    }
    if (parked[job] != jobs_[job].parked_bytes.current) return "a job's parked bytes drifted";
  }
  if ((mapped_total + free_pages_.size()) * page_ + reserving_bytes_ !=
      static_cast<std::size_t>(stats_.reserved_bytes.current)) {
    return "reserved bytes are not the pages mapped and free";
  }
  return "";
}

MemoryFlowAllocator::Window MemoryFlowAllocator::job_window(JobId job, bool restart) {
  Lock lock(mutex_);
  JobStats& stats = jobs_.at(job);
  const std::int64_t current = stats.held_bytes.current;
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
    wwrun::alloc::reset_peak(stats.held_bytes);
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
    wwrun::alloc::reset_accumulated(stats.held_bytes);
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
  const Segment* segment = it->second;
  if (static_cast<char*>(ptr) >= segment->base + segment->size) return nullptr;
  const std::size_t at = static_cast<std::size_t>(static_cast<char*>(ptr) - segment->base) / page_;
  if (!segment->pages[at].mapped) return nullptr;
  std::size_t first = at, last = at + 1;
  while (first > 0 && segment->pages[first - 1].mapped) --first;
  while (last < segment->pages.size() && segment->pages[last].mapped) ++last;
  if (size != nullptr) *size = (last - first) * page_;
  return segment->base + first * page_;
}

}  // namespace wwrun::alloc


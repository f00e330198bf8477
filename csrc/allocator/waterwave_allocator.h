// The memory-flow allocator: a stream-aware caching allocator that lets memory
// freed by one job flow to another job's stream at once.
//
// Reference: Waterwave ("Waterwave: A GPU Memory Flow Engine for Concurrent DNN
// Training", IEEE Transactions on Computers 72(10), 2023), section on the
// synchronization-state-aware allocator; c10's CUDACachingAllocator for size
// classes and split/coalesce; mimalloc for the layout of this header.
//
// ---------------------------------------------------------------------------
// Policy
// ---------------------------------------------------------------------------
// The budget is physical pages (page_: 2 MiB on a GPU, the driver's granularity;
// 512 KiB on the host, host_backend.h). Each job's blocks live in
// ranges (segments) of its own: virtual memory in which pages are mapped under
// live blocks on demand, and from which idle pages are cut out in place when
// another request needs them (Note [Layouts]). Blocks come from the ranges,
// rounded into size classes, found best-fit, split and coalesced. Small requests
// (<= 1 MiB) and large ones use separate ranges and pools, as in c10, so
// long-lived small tensors do not pin large ranges; tiny ones (<= 256 KiB) have
// their own too (size_classes.h). A freed block remembers its stream and an
// event recorded at free time on that stream (Note [Lazy events]). An
// allocation of size n on stream S, for job J, takes in priority order:
//   a./b. the best-fitting free block of J's ranges that S may use at once: one
//      last used on S (stream order makes it safe), or one whose event has
//      completed, whichever is tighter (so that a job's layout does not depend
//      on when its events complete);
//   c. a free block of J's from another of its streams whose event is still
//      pending: S is made to wait for that event on the device
//      (cudaStreamWaitEvent; the host never blocks); among several, the oldest
//      event first;
//   d. no free block of J's fits: a new range of J's, virtual memory only, with
//      its class's room (size_classes.h: c10's segment sizes, or the request's
//      pages and as much again). Whichever block a-d gives, the pages under the
//      bytes handed out that are not mapped are mapped now: the budget's free
//      pages, then idle pages (mapped, under no live block, ready) cut out of
//      any range (ended jobs' first, then the job's own, then the other running
//      jobs'), then fresh ones from the device;
//   e. at the limit, idle pages behind pending events too (the host waits for
//      their events); then d is tried again;
//   f. when other jobs are running and will free memory (set_expected_releases),
//      wait a bounded time for their frees, then retry. When every such job is
//      itself waiting here, none will free: the latest to arrive goes to g at
//      once instead (with no scheduler it fails), and one failing gives the
//      other waiters a new bound (Note [Rule f deadlock]);
//   g. the run's scheduler decides (WaitHooks::at_limit, Note [Waiting at the
//      limit] in python_wait_hooks.h): a job that fits alone waits there for
//      another job's frees and tries again from a (one that gives way to another
//      waiting there may park its pages on the host meanwhile, Note [Parking]);
//      otherwise it tries a-e once more, as memory is now, and then
//      fails: that job alone gets OutOfMemory, with a message naming the job, the
//      request, the job's usage, the device's usage by job, and what was free at
//      the moment of the decision: whole pages, and the largest free run.
// A job's own limit is checked first: beyond it the job goes straight to g.
//
// Isolation: blocks never pass between jobs, only pages do, and a page mapped
// for J is zeroed (the part under J's block, on J's stream; a free neighbour
// sharing the page is marked to be zeroed when it is handed out) unless it held
// J's data or is clean; fresh pages are zeroed once unless the backend's come
// zeroed (the host's do). Within a job, a block is zeroed at hand-out only where
// the job is not provably one (Note [Side streams]). Zeroing goes through
// Backend::memset_zero, issued with the allocator lock released and the block
// held apart. When a job ends, its dirty free memory is scrubbed ahead of time in
// one batch (Note [Batched scrub]), so that its pages move clean later.
//
// ---------------------------------------------------------------------------
// Glossary
// ---------------------------------------------------------------------------
//   Page      page_ bytes of physical memory (Backend::pages_create); mapped in a
//             range, or free in the budget (free_pages_), unmapped, remembering
//             whose data it holds.
//   Segment   a range: virtual memory of one job and one size class, split into
//             Blocks; its pages are mapped or not, each (PageSlot).
//   Block     a contiguous range of a segment, allocated or free; neighbours in
//             address order are linked, so coalescing is O(1). An allocated
//             block's pages are all mapped; a free one's may not be.
//   held      a page under at least one live block: what a job holds (its held
//             bytes, which the engine plans with); the other mapped pages of a
//             range are idle, anyone's once their blocks are ready.
//   EventRef  a pooled, reference-counted backend event; the blocks split from
//             one freed block share its event.
//   pending   a free block whose event has not been seen complete: only its own
//             stream may take it at once (rule a), others must wait (rule c).
//   ready     a free block with no pending event: any stream may take it (b).
//   deferred  a freed block also used on other streams (record_stream): it joins
//             the free blocks once the events on all those streams complete.
//   in scrub  a free block of an ended job being zeroed by a batched scrub: in no
//             pool, never handed out, coalesced or cut until finish_scrub.
//   Job       a named user of the allocator; streams are bound to jobs, and an
//             unbound stream belongs to job 0, "default" (Note [Side streams]).
//
// Note [Layouts]. Jobs that share one budget take turns with memory whose shape
// changes. When blocks flowed between jobs, one job's frees left holes among the
// others' blocks, and whether a request fitted depended on how the jobs' blocks
// had interleaved: a scheduler could only keep a margin and hope. So blocks stay
// in their job's ranges, and pages flow instead:
//   - a job's ranges, blocks and best-fit choices depend on its own requests
//     alone, never on other jobs or on memory pressure: cutting an idle page out
//     unmaps it in place (the block over it stays free, the range keeps its
//     shape), and a block handed out later over it gets a page mapped there
//     again (PyTorch's expandable segments map pages on demand the same way);
//   - so the pages a job holds (held bytes: pages under its live blocks) follow
//     the same course beside other jobs as alone, and a request succeeds
//     whenever the pages all jobs hold leave room for the ones it adds: the
//     engine plans in held bytes, exactly, with no margin for fragmentation;
//   - idle pages stay mapped while the limit has room: a request that lacks
//     pages gets the budget's free ones and ended jobs' idle ones, then fresh
//     ones. At the limit, ready idle pages of running jobs' ranges go to it,
//     its own job's before others' (with no zeroing): there the device holds
//     what the jobs use (reserved follows their summed allocation, as
//     Waterwave's flow means it), not each job's cache of its own peak. A move
//     costs a remap (three driver calls a page on a GPU; on the host, a
//     page-table move) and, between jobs, a zeroing: moved before fresh pages
//     were made, pages went back and forth between a job's own ranges at every
//     training step;
//   - a page is unmapped only once its last use completed: a ready block's at
//     once, a pending block's after the host waited for its event (e; unmapping
//     memory the device still uses is undefined). Within a job, blocks still
//     pass between its streams behind device-side waits (c).
// Every idle page is usable by any job's request before it waits (f) or fails
// (g); what no other job can use is the free bytes of partly held pages, which
// its own owner's layout keeps and the engine counts as held.
//
// Note [Owners]: a free block's owner is the job whose data its mapped bytes
// hold, kClean for zeroed memory, or kMixed when they may hold several jobs'
// (a page shared with a block that was zeroed only in part, the default job's
// data from two streams, fresh pages a device hands out unzeroed). Mixed blocks
// are zeroed for every job: conservative, never leaking. A free page remembers
// its owner the same way.
//
// Note [Lazy events]: while the allocator has seen a single stream, no other
// stream can take a freed block, so frees share one event that is recorded only
// when it is needed: when a second stream first allocates (or record_stream
// names one), or before rule e waits on it. Recording later than the free is
// safe (the event then covers more work); it only takes event recording off a
// single job's hot path. From the second stream on, every free records its own
// event, as the policy says.
//
// Note [Batched scrub]: a page that moves to another job is zeroed on the
// receiving job's stream, at the moment it wants the memory. When a job ends
// (wwrun.memory.allocator.unregister_job, from the job's thread once its script ended),
// the free memory still holding its data is scrubbed at once instead, in ONE
// launch of the Triton zero_ranges_ kernel on a dedicated scrub stream, so that
// its pages move clean later:
//   1. take_dirty_blocks(job, scrub): each free block of the job's ranges holding
//      its data (not clean, not deferred) leaves its pool and is marked in scrub;
//      the scrub stream is made to wait on the block's pending event, so the
//      kernel runs after the job's last use of it. Returns the block's mapped
//      runs (unmapped pages hold nothing).
//   2. Python launches zero_ranges_ over them on the scrub stream, with no
//      allocator lock held: the launch itself allocates its range table through
//      the allocator (on the scrub stream, job "default").
//   3. finish_scrub(ranges, scrub, zeroed): one event is recorded on the scrub
//      stream and the blocks return to the free pool as clean, pending behind it
//      on the scrub stream. Their pages go to another job without a memset, once
//      the host has seen that event (rule e waits for it if need be).
// In-scrub blocks are in no pool and no neighbour absorbs them, so they are
// never handed out, coalesced or cut. Should the launch fail,
// finish_scrub(zeroed=false) returns them still dirty, and the pages are zeroed
// as they move. Bytes are counted by kind: scrubbed_bytes (memset as memory
// moves to a job) and batch_scrubbed_bytes (batched, charged to the ended job).
//
// Note [Side streams]: a job's own extra streams (a script's torch.cuda.Stream())
// are never registered. Such a stream belongs to the job whose marked thread
// (mark_job_thread) first allocates on it, so its memory counts to that job and
// flows unzeroed within it; the job's end unbinds it, and until then no other
// job may register it. torch recycles its pool
// streams, so two live jobs may both use one: the first allocation on it from
// another job's thread makes it shared, and from then on each allocation counts
// to the calling thread's job, and an unmarked thread's (the autograd thread's)
// to "default", whose hand-overs on a shared stream are always zeroed. The
// default job's hand-overs between streams are zeroed too: unregistered streams
// are not provably one job's.
//
// Note [Locking]: one mutex per allocator. It is never held across a call that
// can block (pages_create, event_synchronize, memset of host memory), nor while
// waiting for other jobs' frees (rule f waits on a condition variable).
// Mapping, unmapping and releasing idle pages, and reserving virtual memory,
// are quick calls made under it, so that no page is ever in no one's count.
// Pages are mapped under one block at a time (mapping_): the blocks held apart
// meanwhile (the one handed out, neighbours sharing a page being zeroed) are
// then never two threads' at once. Requests that need no new page go on.
#pragma once

#include <chrono>
#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "size_classes.h"
#include "stats.h"

namespace wwrun::alloc {

using JobId = std::int32_t;
constexpr JobId kDefaultJob = 0;
constexpr JobId kClean = -1;  // owner of zeroed memory
constexpr JobId kMixed = -2;  // owner of a coalesced block holding several jobs' data

// The rules of the policy, in order; counters are indexed by them.
enum Rule : int { kRuleA = 0, kRuleB, kRuleC, kRuleD, kRuleE, kRuleF, kRuleG, kNumRules };
constexpr char kRuleNames[kNumRules + 1] = "abcdefg";

// Thrown by allocate() under rule g; what() is the message shown to the job.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct EventRef {
  EventHandle handle = nullptr;
  StreamId stream = 0;
  std::uint64_t serial = 0;  // global record order: smaller is older (rule c)
  int refs = 0;
  bool recorded = false;  // false: shared by frees on one stream, see Note [Lazy events]
  bool complete = false;  // cached once the backend said so
};

struct Segment;

// Invariants, for a block B inside segment G:
//   B.ptr + B.size == B.next->ptr              (when B.next != nullptr)
//   sum of sizes over G's blocks == G.size
//   B.ptr % kBlockAlignBytes == 0, B.size % kBlockAlignBytes == 0
//   B.allocated => B.event == nullptr
//   free and B.event != nullptr && !deferred  <=>  B is pending (in pending_[B.stream])
struct Block {
  char* ptr = nullptr;
  std::size_t size = 0;
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address-order neighbours within the segment
  Block* next = nullptr;
  bool allocated = false;
  bool deferred = false;
  bool in_scrub = false;     // free, taken by a batched scrub (Note [Batched scrub])
  StreamId stream = 0;       // allocated: its stream; free: the stream it was last used on
  JobId owner = kClean;      // allocated: its job; free: whose data it holds
  std::size_t requested = 0; // allocated: bytes asked for
  EventRef* event = nullptr; // free and pending: the event recorded when freed
  std::vector<StreamId> extra_streams;      // record_stream uses while allocated
  std::vector<EventRef*> deferred_events;   // deferred: one per stream it was used on
  Block* fifo_prev = nullptr;  // pending: free order on its stream
  Block* fifo_next = nullptr;
};

// One page of a segment's virtual memory.
struct PageSlot {
  PageHandle handle = 0;
  bool mapped = false;
  // Its bytes are a host copy outside the budget (Note [Parking]): mapped, under
  // a live block (uses > 0), not held; handle unset.
  bool parked = false;
  std::uint32_t uses = 0;  // live (or deferred, or in-scrub) blocks over it: held while > 0
  // Mapped with a page of the budget: not a parked copy, which only its blocks use.
  bool in_budget() const { return mapped && !parked; }
};

// Invariants, for a segment G:
//   G.pages.size() * page_ == G.size
//   G.mapped == count of mapped slots;  G.idle == count of mapped slots with uses == 0
//   every page under an allocated block is mapped
struct Segment {
  char* base = nullptr;  // page-aligned
  std::size_t size = 0;  // its virtual memory, a multiple of the page; fixed
  Block* head = nullptr;
  JobId job = kDefaultJob;  // whose blocks it holds (Note [Layouts])
  PoolIndex pool = kLargePool;  // the requests it serves (size_classes.h)
  StreamId stream = 0;  // the stream it was created for (memory snapshots)
  std::vector<PageSlot> pages;  // pages[i] at base + i * page
  std::size_t mapped = 0;
  std::size_t idle = 0;
  bool small() const { return pool != kLargePool; }  // serves requests <= kSmallRequestBytes
};

// A page of the budget that no range maps (Note [Layouts]).
struct FreePage {
  PageHandle handle = 0;
  JobId owner = kClean;  // whose data it holds (Note [Owners])
};

// Best-fit order; lower_bound(n) with a size finds the smallest block >= n.
struct BlockBySize {
  using is_transparent = void;
  bool operator()(const Block* x, const Block* y) const {
    return x->size != y->size ? x->size < y->size : x->ptr < y->ptr;
  }
  bool operator()(const Block* x, std::size_t size) const { return x->size < size; }
  bool operator()(std::size_t size, const Block* y) const { return size < y->size; }
};
using BlockSet = std::set<Block*, BlockBySize>;

// Free blocks last used on one stream whose events have not been seen complete:
// a best-fit index and the free order (events on one stream complete in order).
struct StreamPool {
  BlockSet by_size;
  Block* fifo_head = nullptr;
  Block* fifo_tail = nullptr;
};

// All free blocks of one job's ranges of one size kind (tiny, small or large:
// pool_index).
struct Pool {
  std::unordered_map<StreamId, StreamPool> pending;  // by the stream last used on
  BlockSet ready;
};

struct JobStats {
  std::string name;
  bool active = true;
  std::size_t limit = 0;  // bytes; 0: no limit
  Stat allocated_bytes;
  Stat requested_bytes;
  Stat allocations;       // live blocks
  // The pages under its live blocks (Note [Layouts]): what it holds of the budget.
  Stat held_bytes;
  Stat parked_bytes;  // its pages parked in host memory (Note [Parking]): not held
  // The most held since the engine last looked (take_window): a NodeGroup's or an
  // iteration's peak, without disturbing the job's lifetime peak above.
  std::int64_t window_peak = 0;
  std::int64_t num_ooms = 0;
  std::int64_t largest_block = 0;  // its largest block, for the report
  std::int64_t scrubbed_bytes = 0;  // zeroed at hand-out to this job: another job's data was there
  std::int64_t batch_scrubbed_bytes = 0;  // this job's data zeroed by batched scrubs
};

struct DeviceStats {
  Stat allocated_bytes;  // invariant: allocated_bytes.current == sum over jobs
  Stat reserved_bytes;   // invariant: reserved_bytes.current >= allocated_bytes.current - parked bytes
  Stat requested_bytes;
  Stat allocations;
  Stat segments;          // ranges
  std::int64_t num_ooms = 0;
  std::int64_t num_alloc_retries = 0;  // times rule e or f was tried
  std::int64_t num_release_waits = 0;  // times rule f waited for other jobs' frees
  std::int64_t num_release_deadlocks = 0;  // jobs failed because all they waited for waited too
  std::int64_t rule_count[kNumRules] = {};
  std::int64_t scrubbed_bytes = 0;        // cross-job zeroing at hand-out (one memset per block)
  std::int64_t batch_scrubbed_bytes = 0;  // cross-job zeroing by batched scrubs
  std::int64_t scrub_batches = 0;         // batched scrubs finished (one launch each)
  std::int64_t fresh_scrubbed_bytes = 0;  // fresh pages zeroed once (not the host's)
  std::int64_t num_page_moves = 0;        // idle pages cut out of a range to serve a request (d, e)
  std::int64_t pending_event_bytes = 0;   // free, deferred or in-scrub bytes behind pending events
};

struct Snapshot {
  DeviceStats device;
  std::vector<JobStats> jobs;
  std::int64_t fragmentation_bytes = 0;  // reserved - allocated, parked bytes aside (Note [Parking])
  std::int64_t largest_free_block = 0;  // the longest mapped run of free bytes in one block
  std::int64_t free_page_bytes = 0;  // whole free pages: the budget's, and idle ones in ranges
  std::int64_t page_bytes = 0;  // the backend's page
};

struct BlockInfo {
  std::uintptr_t ptr;
  std::size_t size;
  bool allocated;
  bool pending;
  bool in_scrub;
  bool deferred;  // freed, waiting for record_stream uses on other streams
  StreamId stream;
  JobId owner;
  std::size_t requested;  // allocated: bytes asked for
};
struct SegmentInfo {
  std::uintptr_t base;
  std::size_t size;
  StreamId stream;  // the stream it was created for
  bool small;
  std::vector<BlockInfo> blocks;
};

// A range handed to a batched scrub (Note [Batched scrub]).
struct ScrubRange {
  void* ptr;
  std::size_t size;
};

// What allocate() did, for the caller and for tests.
struct Allocation {
  void* ptr = nullptr;
  std::size_t size = 0;    // rounded
  Rule rule = kRuleA;      // the last rule reached
  bool zeroed = false;     // scrubbed before hand-out (cross-job)
  bool waited = false;     // the stream was made to wait on another stream's event
};

// Rule f's hooks into the host. `may_wait` says whether the calling thread may
// wait at all (unset: yes); `before` runs under the allocator lock and returns a
// token, `after` gets it back with the lock released. In Python processes only
// threads marked as job threads wait (never the shared autograd thread, whose
// stall would stop every job's backward), and a waiting thread releases the GIL
// if it holds it, or the jobs whose frees it waits for could not run
// (python_wait_hooks.h).
struct WaitHooks {
  std::function<bool()> may_wait;
  std::function<void*()> before;
  std::function<void(void*)> after;
  // Rule g's last word (Note [Waiting at the limit]): called without the lock for
  // a job thread's request that would fail, with the job's name, the request's
  // bytes and how many times this request has been here before; `retry` once there
  // may be room for it (it is tried again from a), else it fails, and `why`, when
  // set, says why the scheduler let it (the message's last clause). May throw (an
  // error the allocation raises).
  struct LimitAnswer {
    bool retry = false;
    std::string why;
  };
  std::function<LimitAnswer(const std::string&, std::size_t, int)> at_limit;
};

struct Options {
  std::size_t reserved_limit = 0;  // bytes of pages the allocator may hold; 0: none
  double release_wait_s = 2.0;     // rule f's bound
  WaitHooks wait_hooks;
  // The job the calling thread runs (mark_job_thread), or empty; unset: threads
  // are not told apart (Note [Side streams]).
  std::function<std::string()> thread_job;
};

class MemoryFlowAllocator {
 public:
  MemoryFlowAllocator(Backend& backend, Options options = {});
  ~MemoryFlowAllocator();
  MemoryFlowAllocator(const MemoryFlowAllocator&) = delete;
  MemoryFlowAllocator& operator=(const MemoryFlowAllocator&) = delete;

  // Throws OutOfMemory (rule g) or std::invalid_argument.
  Allocation allocate(std::size_t bytes, StreamId stream);
  // Throws std::invalid_argument for a pointer this allocator does not own.
  void free(void* ptr);
  // False (and nothing done) for a pointer this allocator does not own.
  bool free_if_owned(void* ptr);
  // The block at `ptr` is also used on `stream`: it is not reused until the
  // work queued there before its free completes (Tensor.record_stream).
  void record_stream(void* ptr, StreamId stream);

  // Binds `stream` to job `name`, creating or re-activating the job; `limit`
  // (bytes, 0: none) replaces the job's limit. Returns the job's id. Throws
  // std::invalid_argument for a stream another live job holds.
  JobId register_stream(StreamId stream, const std::string& name, std::size_t limit);
  // Unbinds the job's streams; its figures stay in the stats. False if unknown.
  bool unregister_job(const std::string& name);
  // The job whose figures a thread on `stream` sees: the stream's registered
  // job, else the calling thread's job, else its side-stream job, else default.
  JobId job_of_stream(StreamId stream) const;
  std::optional<JobId> find_job(const std::string& name) const;
  // A job's held bytes (the pages under its live blocks, Note [Layouts]) now and
  // at most since its window last restarted; `restart` starts a new window. One
  // lock, no copy: the engine calls it at NodeGroup boundaries.
  struct Window {
    std::int64_t current;
    std::int64_t peak;
  };
  Window job_window(JobId job, bool restart);

  // Note [Batched scrub]. take_dirty_blocks marks the job's dirty free blocks in
  // scrub, orders `scrub_stream` after their last use, and returns them (empty
  // for an unknown job). finish_scrub, once their zeroing is queued on
  // `scrub_stream`, returns them to the free pool, clean when `zeroed`.
  // Throws std::invalid_argument for a pointer not in scrub.
  std::vector<ScrubRange> take_dirty_blocks(const std::string& job, StreamId scrub_stream);
  void finish_scrub(const std::vector<void*>& ptrs, StreamId scrub_stream, bool zeroed);

  // Note [Parking]. park_job moves the pages under the job's live blocks to host
  // memory, at the same addresses, and gives them to the budget; returns the
  // bytes parked (0 where the backend cannot, or for an unknown job). unpark_job
  // brings them back, all or none: false when the budget has not the pages.
  std::size_t park_job(const std::string& job);
  bool can_park() const;  // whether the backend can park at all
  bool unpark_job(const std::string& job);

  // Rule f: jobs expected to free memory soon. An empty list disables rule f.
  void set_expected_releases(const std::vector<std::string>& jobs, double wait_s);

  // Records lazily held events (Note [Lazy events]), then moves free blocks
  // whose events completed to the ready pool.
  void process_events();
  // empty_cache: returns to the device the idle pages of every range and the
  // budget's free pages, or with `job` only the idle pages of that job's ranges
  // (a job's empty_cache must not take other jobs' cache away, nor wait on
  // their streams). Returns bytes.
  std::size_t release_free_segments(std::optional<JobId> job = std::nullopt);
  // cacheInfo for a thread on `stream` (cuDNN sizes benchmark workspaces by it):
  // the largest block it could get, cached or fresh (`device_free`), capped at
  // its job's headroom: the job's limit less what it holds, and the capacity
  // (the reserved limit, else `device_total`) less what all jobs hold.
  std::size_t largest_block_for(StreamId stream, std::size_t device_free,
                                std::size_t device_total) const;

  std::size_t page_bytes() const { return page_; }
  Snapshot snapshot() const;
  // "" when the invariants hold, else the first one found broken (tests).
  std::string check_invariants() const;
  std::vector<SegmentInfo> segments() const;
  void reset_peak(std::optional<JobId> job);        // nullopt: the device and all jobs
  void reset_accumulated(std::optional<JobId> job);
  void set_reserved_limit(std::size_t bytes);
  std::size_t reserved_limit() const;
  // The mapped run of the segment containing ptr: its base, and its size in
  // *size. nullptr if none.
  void* segment_base(void* ptr, std::size_t* size) const;
  std::size_t largest_free_block() const;

  // Around fork() (pthread_atfork, registered by the bindings): before_fork takes
  // the lock, so that the child copies pools no thread is changing, and the
  // parent lets it go again. The lock is never held across a wait (Note
  // [Locking]), so taking it cannot deadlock with the forking thread.
  void before_fork() { mutex_.lock(); }
  void after_fork_in_parent() { mutex_.unlock(); }
  // In a forked child (pthread_atfork): the parent's other threads do not exist
  // here, so a lock one of them held is remade, and no waiter or expected
  // release survives. Only the forking thread runs, with no lock held by it.
  void reset_after_fork();

 private:
  using Lock = std::unique_lock<std::mutex>;

  using Pools = std::array<Pool, kPoolCount>;  // one job's, by PoolIndex
  Block* take_free_block(Pool& pool, std::size_t size, StreamId stream, Allocation& out);
  Block* take_pending_from_other_streams(Pool& pool, std::size_t size, StreamId stream);
  Block* new_range(std::size_t size, StreamId stream, JobId job);
  // Runs of bytes zeroed on their way from one job to another: (start, bytes).
  using ZeroRuns = std::vector<std::pair<char*, std::size_t>>;
  bool map_under(Lock& lock, Block* block, std::size_t size, StreamId stream, JobId job,
                 int& stage, std::size_t& lacking, std::size_t& there, std::size_t& spare,
                 Allocation& out);
  bool take_pages(Lock& lock, std::size_t count, JobId job, std::vector<FreePage>& pages);
  void map_pages(Block* block, const std::vector<std::size_t>& slots,
                 const std::vector<FreePage>& pages, JobId job, ZeroRuns& zero_runs);
  std::size_t harvest_pages(Lock& lock, std::size_t wanted, JobId job);
  std::size_t cut_idle_pages(std::size_t wanted, JobId job, bool ended_only = false);
  bool wait_for_pending_pages(Lock& lock, std::optional<JobId> job);
  void wait_for_job_work(Lock& lock, JobId job);
  void wait_for_streams(const std::vector<StreamId>& streams, Lock* lock);
  std::size_t cut_pages(Block* block, std::vector<FreePage>* into = nullptr);
  std::size_t cut_pages_past(Block* block, std::size_t keep, std::vector<FreePage>* into = nullptr,
                             std::size_t most = SIZE_MAX);
  bool lacks_pages(const Block* block, std::size_t size) const;
  std::vector<std::size_t> unmapped_slots(const Block* block, std::size_t size) const;
  void end_mapping(Block* block, bool keep);
  void release_held(Block* block);
  void use_pages(const Block* block, int delta);
  void drop_unused_segments(bool active_too);
  std::size_t idle_pages_locked() const;
  std::size_t pages_beyond_room(std::size_t wanted) const;
  std::int64_t parked_bytes_locked() const;
  std::size_t free_whole_pages_locked() const;
  std::size_t takeable_pages_locked() const;
  std::size_t mapped_run(const Block* block) const;
  char* va_take(std::size_t bytes);
  void va_give(char* base, std::size_t bytes);
  bool release_free_reservations();
  Pool& pool_of(const Block* block) { return pools_[block->segment->job][block->segment->pool]; }
  bool over_limit(JobId job, std::size_t size) const;
  bool within_reserved_limit(std::size_t segment_bytes) const;
  std::optional<JobId> find_job_locked(const std::string& name) const;
  Block* carve(Block* block, std::size_t size, std::size_t requested, StreamId stream,
               JobId job, Allocation& out);
  void process_events_locked(std::optional<JobId> job = std::nullopt);
  void process_pool_events(Pool& pool);
  JobId job_of_stream_locked(StreamId stream) const;
  static bool is_idle_free(const Block* block) {
    return !block->allocated && !block->deferred && !block->in_scrub;
  }
  void insert_free(Block* block);
  void insert_ready(Block* block);
  void unlink_free(Block* block);
  void relink_free(Block* block);
  void merge_into(Block* survivor, Block* absorbed);
  void fifo_push_after(StreamPool& pool, Block* after, Block* block);
  void fifo_remove(StreamPool& pool, Block* block);
  std::size_t release_free_segments_locked(Lock& lock,
                                           std::optional<JobId> job = std::nullopt);
  JobId thread_job_locked() const;
  JobId job_for_allocation_locked(StreamId stream);
  std::size_t largest_free_block_locked() const;
  bool is_shared_stream(StreamId stream) const;
  bool wait_for_releases(Lock& lock, JobId job,
                         std::chrono::steady_clock::time_point& deadline, std::string& why);
  std::string limit_reached(std::size_t lacking, std::size_t there, std::size_t spare) const;
  [[noreturn]] void out_of_memory(JobId job, std::size_t bytes, std::size_t rounded,
                                  const std::string& why);
  void poll_deferred();

  EventRef* new_event(StreamId stream);
  EventRef* free_event(StreamId stream);
  void note_stream(StreamId stream);
  void record_lazy_events();
  void unref(EventRef* event);
  bool is_complete(EventRef* event);
  void count_pending(std::int64_t delta);

  Backend& backend_;
  Options options_;
  const std::size_t page_;  // the backend's page: the unit memory flows in
  mutable std::mutex mutex_;
  std::condition_variable freed_cv_;  // rule f: signalled on every free
  std::uint64_t free_count_ = 0;
  int release_waiters_ = 0;
  struct Waiting {
    int threads = 0;          // the job's threads waiting in rule f
    std::uint64_t since = 0;  // free_count_ when the latest began: stuck while unchanged
  };
  std::unordered_map<JobId, Waiting> waiting_jobs_;
  std::uint64_t gave_way_ = 0;  // jobs that failed in rule f (Note [Rule f deadlock])
  std::vector<std::string> expected_releases_;

  std::map<char*, Segment*> segments_;  // by base address
  std::unordered_map<void*, Block*> live_;
  std::vector<Pools> pools_;  // by JobId: each job's free blocks (Note [Layouts])
  std::vector<Block*> deferred_;
  std::unordered_map<void*, std::pair<Block*, std::size_t>> in_scrub_;  // by run: (block, run bytes)
  std::vector<EventRef*> event_pool_;
  std::optional<StreamId> only_stream_;  // the single stream seen so far
  bool eager_events_ = false;            // a second stream was seen
  std::unordered_map<StreamId, EventRef*> lazy_events_;  // not yet recorded
  std::uint64_t event_serial_ = 0;
  std::size_t reserving_bytes_ = 0;  // fresh pages being created with the lock released
  bool mapping_ = false;  // a thread is mapping pages under a block it holds (map_under)
  std::vector<FreePage> free_pages_;  // the budget's unmapped pages (Note [Layouts])
  std::size_t idle_pages_ = 0;  // mapped pages under no live block, over all ranges
  // Virtual memory: reservations (at least Backend::va_arena_bytes each) by
  // base, and their unused parts by address (coalesced within a reservation,
  // never across two). A reservation wholly unused goes back to the backend.
  // A new range's virtual memory: its class's room (range_room), at least as
  // much again as its request's pages, at most kGrowBytes more.
  static constexpr std::size_t kGrowBytes = std::size_t{1} << 30;
  std::map<char*, std::size_t> arenas_;
  std::map<char*, std::size_t> free_va_;

  std::vector<JobStats> jobs_;
  std::unordered_map<StreamId, JobId> stream_jobs_;  // registered streams
  // Note [Side streams]: unregistered streams a job's thread allocated on.
  static constexpr JobId kSharedStream = -3;  // used by threads of two live jobs
  std::unordered_map<StreamId, JobId> side_streams_;
  DeviceStats stats_;
};

}  // namespace wwrun::alloc

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
// The budget is physical pages (kPageBytes, 2 MiB), mapped into virtual ranges
// (segments) that are stitched from free pages wherever they are and give their
// empty pages back when another request needs them (Note [Pages]). Blocks come
// from the ranges, rounded into size classes, found best-fit, split and
// coalesced. Small requests (<= 1 MiB) and large ones use separate ranges and
// pools, as in c10, so long-lived small tensors do not pin large ranges; tiny
// ones (<= 256 KiB) have their own too (size_classes.h). A freed
// block remembers its stream, the job it belonged to, and an event recorded at
// free time on that stream (Note [Lazy events]). An allocation
// of size n on stream S takes, in priority order:
//   a. a free block last used on S (stream order makes it safe at once);
//   b. a free block whose event has completed, from any stream;
//   c. a free block from another stream whose event is still pending: S is made
//      to wait for that event on the device (cudaStreamWaitEvent; the host never
//      blocks); among several, the oldest event first;
//   d. a range of the request's class whose last block is free (and safe for S
//      at once) grows in place by the pages it lacks; else a new range of the
//      pages the request needs, with its class's room to grow (size_classes.h:
//      c10's expandable segments). Pages come from the budget's free pages first,
//      then the whole pages of ready free blocks anywhere, then fresh from
//      the device;
//   e. the whole empty pages of free blocks in any job's ranges go back to the
//      budget: waiting on the host for the events of pending ones (and any
//      block that became ready since d); then d is tried again. Last, a free
//      block in the ranges of another size class, taken as in a-c (Note
//      [Borrowing]);
//   f. when other jobs are running and will free memory (set_expected_releases),
//      wait a bounded time for their frees, then retry. When every such job is
//      itself waiting here, none will free: the latest to arrive fails at once
//      instead, and one failing gives the other waiters a new bound (Note
//      [Rule f deadlock]);
//   g. fail: that job alone gets OutOfMemory, with a message naming the job, the
//      request, the job's usage, the device's usage by job, and what was free at
//      the moment of the decision: whole pages, and the largest free block.
// A job's own limit is checked first: beyond it the job goes straight to g.
//
// Isolation: a block handed to job J is zeroed on J's stream unless every byte of
// it was last owned by J or is clean (see Note [Owners]). A page that moves into
// a new range for J is zeroed unless it held J's data or is clean; fresh pages
// are zeroed once unless the backend's come zeroed (the host's do).
// Zeroing at hand-out goes through Backend::memset_zero, one call per block,
// issued after the allocator lock is released (allocate() in allocator_core.cpp).
// When a job ends, its dirty free blocks are scrubbed ahead of time in one batch
// (Note [Batched scrub]), so that later hand-outs of them need no memset.
//
// ---------------------------------------------------------------------------
// Glossary
// ---------------------------------------------------------------------------
//   Page      kPageBytes of physical memory (Backend::pages_create); mapped in a
//             range, or free in the budget (free_pages_), unmapped, remembering
//             whose data it holds.
//   Segment   a range: pages mapped at consecutive addresses of reserved virtual
//             memory; split into Blocks.
//   Block     a contiguous range of a segment, allocated or free; neighbours in
//             address order are linked, so coalescing is O(1).
//   EventRef  a pooled, reference-counted backend event; the blocks split from
//             one freed block share its event.
//   pending   a free block whose event has not been seen complete: only its own
//             stream may take it at once (rule a), others must wait (rule c).
//   ready     a free block with no pending event: any stream may take it (b).
//   deferred  a freed block also used on other streams (record_stream): it joins
//             the free blocks once the events on all those streams complete.
//   in scrub  a free block of an ended job being zeroed by a batched scrub: in no
//             pool, never handed out, coalesced or released until finish_scrub.
//   Job       a named user of the allocator; streams are bound to jobs, and an
//             unbound stream belongs to job 0, "default" (Note [Side streams]).
//
// Note [Pages]. Jobs that share one budget take turns with memory whose shape
// changes: blocks cached in one job's ranges must reach the next job whatever
// their size. So the budget is pages, and ranges are made of them:
//   - rule d maps a range's pages at a virtual range of its own (va_take, from
//     reservations the core makes): free pages of the budget
//     first, wherever they came from, then fresh ones within the limit. A range
//     is thus stitched from scattered pages, and a request fails only when the
//     budget lacks pages, never because free memory is scattered. A range maps
//     only the pages its request needs and keeps virtual room behind it: when
//     its last block is free, it grows there (grow_range), so a request a little
//     larger than that block takes it whole and adds only the pages it lacks,
//     and blocks run on across page boundaries (three 0.56 MiB activations
//     once held a 2 MiB page each, a third of a MiB left at its end).
//   - rule e cuts the whole pages out of free blocks (cut_pages): the range is
//     split around them, they are unmapped, and join the budget's free pages
//     with their owner. Only once their last use completed: a ready block's at
//     once, a pending block's after the host waited for its event (unmapping
//     memory the device still uses is undefined). The slivers either side stay.
//   - empty pages stay mapped while nobody needs them (remapping is a driver
//     call per page and, on the host, page faults), but a new range takes them
//     before fresh ones (cut_idle_pages, in d): memory grows only when what is
//     cached cannot serve, so reserved tracks what the jobs hold (it once rose
//     to the limit with half of it idle in other ranges). Rule e adds
//     pending blocks' pages, and empty_cache returns idle ones to the device.
// Every byte of a ready free block's whole pages is usable by any job's
// request before it waits (f) or fails (g); what no request can use is the
// slivers smaller than a page at a range's free edges, and memory behind
// pending events, record_stream uses, or a batched scrub.
//
// Note [Owners]: a free block's owner is the job whose data it holds, kClean for
// zeroed memory, or kMixed after coalescing blocks of different jobs. Mixed blocks
// are zeroed for every job: conservative, never leaking.
//
// Note [Lazy events]: while the allocator has seen a single stream, no other
// stream can take a freed block, so frees share one event that is recorded only
// when it is needed: when a second stream first allocates (or record_stream
// names one), or before rule e waits on it. Recording later than the free is
// safe (the event then covers more work); it only takes event recording off a
// single job's hot path. From the second stream on, every free records its own
// event, as the policy says.
//
// Note [Batched scrub]: zeroing at hand-out costs one memset per block, on the
// receiving job's stream, at the moment it wants the memory (a fused launch
// would gain nothing there: it is one range). When a job ends
// (wwrun.memory.allocator.unregister_job, from the job's thread once its script ended),
// the free blocks still holding its data are scrubbed at once instead, in ONE
// launch of the Triton zero_ranges_ kernel on a dedicated scrub stream:
//   1. take_dirty_blocks(job, scrub): each free block owned by the job alone
//      (not clean, not kMixed, not deferred) leaves its pool and is marked in
//      scrub; the scrub stream is made to wait on the block's pending event, so
//      the kernel runs after the job's last use of it. Returns the ranges.
//   2. Python launches zero_ranges_ over them on the scrub stream, with no
//      allocator lock held: the launch itself allocates its range table through
//      the allocator (on the scrub stream, job "default").
//   3. finish_scrub(ranges, scrub, zeroed): one event is recorded on the scrub
//      stream and the blocks return to the free pool as clean, pending behind it
//      on the scrub stream. A job taking one later needs no memset; while the
//      event is pending it gets the block by rule c (its stream waits on the
//      scrub on the device), so the host never blocks.
// A whole free block is zeroed, clean bytes coalesced into it included: device
// bandwidth is cheap next to a memset on a job's critical path. Returning, a
// clean block may absorb a ready neighbour holding another job's data; the merged
// block is then that job's again (Note [Owners]): conservative, never leaking.
// In-scrub blocks are in no pool and no neighbour absorbs them, so they are
// never handed out, coalesced or released (rule e cuts no page out of them). Should
// the launch fail, finish_scrub(zeroed=false) returns them still dirty, and
// hand-out zeroing covers them as before. Blocks the job frees after its end
// (module globals dropped later), or that were mixed with another job's data,
// are zeroed at hand-out. Bytes are counted by kind: scrubbed_bytes (memset at
// hand-out) and batch_scrubbed_bytes (batched, charged to the ended job).
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
#pragma once

#include <chrono>
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

struct Segment {
  char* base = nullptr;  // page-aligned
  std::size_t size = 0;  // a multiple of kPageBytes
  Block* head = nullptr;
  PoolIndex pool = kLargePool;  // the requests it serves (size_classes.h)
  StreamId stream = 0;  // the stream it was created for (memory snapshots)
  std::vector<PageHandle> pages;  // pages[i] is mapped at base + i * kPageBytes
  char* va_end = nullptr;  // its virtual memory, mapped or not, ends here: room to grow
  bool small() const { return pool != kLargePool; }  // serves requests <= kSmallRequestBytes
};

// A page of the budget that no range maps (Note [Pages]).
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

// All free blocks of one size kind (tiny, small or large: pool_index).
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
  // The most allocated since the engine last looked (take_window): a NodeGroup's or
  // an iteration's peak, without disturbing the job's lifetime peak above.
  std::int64_t window_peak = 0;
  std::int64_t num_ooms = 0;
  // Its largest block: the contiguous room its next request may need, which free
  // bytes scattered in others' segments cannot give (the engine's sharing headroom).
  std::int64_t largest_block = 0;
  std::int64_t scrubbed_bytes = 0;  // zeroed at hand-out to this job: another job's data was there
  std::int64_t batch_scrubbed_bytes = 0;  // this job's data zeroed by batched scrubs
};

struct DeviceStats {
  Stat allocated_bytes;  // invariant: allocated_bytes.current == sum over jobs
  Stat reserved_bytes;   // invariant: reserved_bytes.current >= allocated_bytes.current
  Stat requested_bytes;
  Stat allocations;
  Stat segments;          // ranges
  std::int64_t num_ooms = 0;
  std::int64_t num_alloc_retries = 0;  // times rule e or f was tried
  std::int64_t num_release_waits = 0;  // times rule f waited for other jobs' frees
  std::int64_t num_release_deadlocks = 0;  // jobs failed because all they waited for waited too
  std::int64_t num_borrows = 0;  // requests served from another size class's range (Note [Borrowing])
  std::int64_t rule_count[kNumRules] = {};
  std::int64_t scrubbed_bytes = 0;        // cross-job zeroing at hand-out (one memset per block)
  std::int64_t batch_scrubbed_bytes = 0;  // cross-job zeroing by batched scrubs
  std::int64_t scrub_batches = 0;         // batched scrubs finished (one launch each)
  std::int64_t fresh_scrubbed_bytes = 0;  // fresh pages zeroed once (not the host's)
  std::int64_t num_page_moves = 0;        // pages cut out of a range to serve another (rule e)
  std::int64_t pending_event_bytes = 0;   // free, deferred or in-scrub bytes behind pending events
};

struct Snapshot {
  DeviceStats device;
  std::vector<JobStats> jobs;
  std::int64_t fragmentation_bytes = 0;  // reserved - allocated
  std::int64_t largest_free_block = 0;
  std::int64_t free_page_bytes = 0;  // whole free pages: the budget's, and inside free blocks
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
  // A job's allocated bytes now and at most since its window last restarted;
  // `restart` starts a new window. One lock, no copy: the engine calls it at
  // NodeGroup boundaries.
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

  // Rule f: jobs expected to free memory soon. An empty list disables rule f.
  void set_expected_releases(const std::vector<std::string>& jobs, double wait_s);

  // Records lazily held events (Note [Lazy events]), then moves free blocks
  // whose events completed to the ready pool.
  void process_events();
  // Rule e on demand (empty_cache): returns to the device the whole pages of
  // free blocks and the budget's free pages, or with `job` only those holding
  // that job's data alone (a job's empty_cache must not take other jobs' cache
  // away, nor wait on their streams). Returns bytes.
  std::size_t release_free_segments(std::optional<JobId> job = std::nullopt);
  // cacheInfo for a thread on `stream` (cuDNN sizes benchmark workspaces by it):
  // the largest block it could get, cached or fresh (`device_free`), capped at
  // its job's headroom: the job's limit less what it holds, and the capacity
  // (the reserved limit, else `device_total`) less what all jobs hold.
  std::size_t largest_block_for(StreamId stream, std::size_t device_free,
                                std::size_t device_total) const;

  Snapshot snapshot() const;
  std::vector<SegmentInfo> segments() const;
  void reset_peak(std::optional<JobId> job);        // nullopt: the device and all jobs
  void reset_accumulated(std::optional<JobId> job);
  void set_reserved_limit(std::size_t bytes);
  std::size_t reserved_limit() const;
  // The segment containing ptr: its base, and its size in *size. nullptr if none.
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

  Block* take_free_block(Pool& pool, std::size_t size, StreamId stream, Allocation& out);
  Block* borrow_free_block(std::size_t size, StreamId stream, Allocation& out);
  Block* take_pending_from_other_streams(Pool& pool, std::size_t size, StreamId stream);
  // Runs of pages zeroed on their way from one job to another: (start, bytes).
  using ZeroRuns = std::vector<std::pair<char*, std::size_t>>;
  Block* new_range(Lock& lock, std::size_t size, StreamId stream, JobId job);
  Block* grow_range(Lock& lock, std::size_t size, StreamId stream, JobId job);
  bool take_pages(Lock& lock, std::size_t count, JobId job, std::vector<FreePage>& pages);
  void map_pages(char* at, const std::vector<FreePage>& pages, JobId job, JobId& owner,
                 ZeroRuns& zero_runs);
  std::size_t harvest_pages(Lock& lock, std::size_t wanted, JobId job);
  std::size_t cut_idle_pages(std::size_t wanted, JobId job);
  bool wait_for_pending_pages(Lock& lock, std::optional<JobId> job);
  std::size_t cut_pages(Block* block);
  static std::size_t whole_pages(const Block* block);
  std::size_t free_whole_pages_locked() const;
  char* va_take(std::size_t bytes);
  void va_give(char* base, std::size_t bytes);
  bool trim_growth_room();
  bool release_free_reservations();
  Pool& pool_of(const Block* block) { return pools_[block->segment->pool]; }
  Pool& pool_for(std::size_t size) { return pools_[pool_index(size)]; }
  bool over_limit(JobId job, std::size_t size) const;
  bool within_reserved_limit(std::size_t segment_bytes) const;
  std::optional<JobId> find_job_locked(const std::string& name) const;
  Block* carve(Block* block, std::size_t size, std::size_t requested, StreamId stream,
               JobId job, Allocation& out);
  void process_events_locked();
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
  Pool pools_[kPoolCount];  // by PoolIndex
  std::vector<Block*> deferred_;
  std::unordered_map<void*, Block*> in_scrub_;  // by address
  std::vector<EventRef*> event_pool_;
  std::optional<StreamId> only_stream_;  // the single stream seen so far
  bool eager_events_ = false;            // a second stream was seen
  std::unordered_map<StreamId, EventRef*> lazy_events_;  // not yet recorded
  std::uint64_t event_serial_ = 0;
  std::size_t reserving_bytes_ = 0;  // fresh pages being created with the lock released
  std::vector<FreePage> free_pages_;  // the budget's unmapped pages (Note [Pages])
  // Virtual memory: reservations (at least Backend::va_arena_bytes each) by
  // base, and their unused parts by address (coalesced within a reservation,
  // never across two). A reservation wholly unused goes back to the backend.
  // A range's virtual room beyond its pages, to grow into (rule d): its
  // class's (range_room), at least as much again as its pages, at most kGrowBytes.
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

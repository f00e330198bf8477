// PyTorch's CUDAAllocator interface implemented on the memory-flow allocator.
//
// Installed in place of c10's CUDACachingAllocator (before CUDA is initialised),
// every torch.cuda memory function keeps working: memory_allocated,
// max_memory_allocated, memory_reserved, memory_stats, reset_peak_memory_stats,
// empty_cache, Tensor.record_stream, memory_snapshot, and cacheInfo (used by
// cuDNN benchmark mode). Called from a job's thread, the stats report that
// job's own figures, empty_cache releases only that job's idle segments, and
// cacheInfo is capped at the job's headroom: the job is found from the
// thread's current stream, else from the thread's mark (Note [Side streams]);
// the launcher's own thread sees the device. CUDA graphs and private memory
// pools are refused at once, in the job that asks (Note [No private pools]).
//
// Reference: c10/cuda/CUDACachingAllocator.h of the installed torch; the
// interface changes between versions, so differences are guarded with
// WWRUN_TORCH_AT_LEAST. Compiled against the headers of torch 2.11, 2.12 and
// 2.13: 2.12 added attachOomRejectionObserver (pure virtual); 2.13 added only
// virtuals with defaults (markCaptureBegin/End, getContextForPointer,
// allocateWithAddress).
#include <cstdio>
#include "torch_cuda_allocator.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <pthread.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <new>

#include "cuda_backend.h"
#include "python_wait_hooks.h"

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

#define WWRUN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||        \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace wwrun::alloc::torch_cuda {

namespace c10alloc = c10::cuda::CUDACachingAllocator;
using c10::DataPtr;
using c10::DeviceIndex;
using c10::MempoolId_t;

namespace {

void delete_ptr(void* ptr) noexcept;
static_assert(noexcept(delete_ptr(nullptr)), "a DataPtr deleter must never throw");

// Copies our figures into c10's shape; every pool slot gets the aggregate.
c10::CachingDeviceAllocator::StatArray stat_array(const Stat& stat) {
  c10::CachingDeviceAllocator::StatArray array;
  for (auto& entry : array) {
    entry.current = stat.current;
    entry.peak = stat.peak;
    entry.allocated = stat.allocated;
    entry.freed = stat.freed;
  }
  return array;
}

constexpr int kMaxDevices = 64;  // as c10's C10_COMPILE_TIME_MAX_GPUS

// One segment in c10's snapshot shape. c10 gives a block's address as the
// segment's plus the sizes before it, so blocks go in address order. "active"
// is c10's allocated-or-pending-free: a freed block still in use on other
// streams (record_stream) is active_pending_free.
c10::CachingDeviceAllocator::SegmentInfo segment_info(DeviceIndex device,
                                                      const SegmentInfo& segment) {
  c10::CachingDeviceAllocator::SegmentInfo info;
  info.device = device;
  info.address = segment.base;
  info.total_size = segment.size;
  info.stream = reinterpret_cast<void*>(segment.stream);
  info.is_large = !segment.small;
  for (const BlockInfo& block : segment.blocks) {
    c10::CachingDeviceAllocator::BlockInfo out;
    out.size = block.size;
    out.requested_size = block.requested;
    out.allocated = block.allocated;
    out.active = block.allocated || block.deferred;
    if (out.allocated) {
      info.allocated_size += block.size;
      info.requested_size += block.requested;
    }
    if (out.active) info.active_size += block.size;
    info.blocks.push_back(std::move(out));
  }
  return info;
}

class WaterwaveCUDAAllocator final : public c10alloc::CUDAAllocator {
 public:
  // One allocator core per device, created at first use and never destroyed,
  // so the free path can read the table without a lock.
  MemoryFlowAllocator& core(DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "wwrun allocator: invalid CUDA device ",
                static_cast<int>(device));
    MemoryFlowAllocator* existing = cores_[device].load(std::memory_order_acquire);
    if (existing != nullptr) return *existing;
    std::lock_guard<std::mutex> lock(cores_mutex_);
    existing = cores_[device].load(std::memory_order_acquire);
    if (existing == nullptr) {
      auto* backend = new CudaBackend(device);
      Options options;
      options.wait_hooks = python_wait_hooks();
      options.thread_job = [] { return job_thread_mark(); };
      existing = new MemoryFlowAllocator(*backend, options);
      cores_[device].store(existing, std::memory_order_release);
    }
    return *existing;
  }

  void* allocate_on(DeviceIndex device, std::size_t bytes, cudaStream_t stream) {
    await_admission();
    try {
      return core(device).allocate(bytes, reinterpret_cast<StreamId>(stream)).ptr;
    } catch (const OutOfMemory& oom) {
      std::size_t device_free = 0, device_total = 0;
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
      const auto allocated = core(device).snapshot().device.allocated_bytes.current;
      for (const auto& observer : oom_observers_) {
        observer(device, static_cast<std::size_t>(allocated), device_total, device_free);
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, oom.what());
    }
  }

  void free_ptr(void* ptr) {
    if (ptr == nullptr) return;
    for (auto& slot : cores_) {
      MemoryFlowAllocator* core = slot.load(std::memory_order_acquire);
      if (core != nullptr && core->free_if_owned(ptr)) return;
    }
    TORCH_CHECK(false, "wwrun allocator: free of a pointer it did not allocate");
  }

  template <typename Fn>
  void for_each_core(Fn fn) {
    for (auto& slot : cores_) {
      if (MemoryFlowAllocator* core = slot.load(std::memory_order_acquire)) fn(*core);
    }
  }

  static StreamId current_stream(DeviceIndex device) {
    return reinterpret_cast<StreamId>(c10::cuda::getCurrentCUDAStream(device).stream());
  }

  // The job whose figures the calling thread sees: its current stream's, or its
  // mark's (MemoryFlowAllocator::job_of_stream); none for the launcher's thread.
  std::optional<JobId> calling_job(DeviceIndex device) {
    const JobId job = core(device).job_of_stream(current_stream(device));
    if (job == kDefaultJob) return std::nullopt;
    return job;
  }

  // c10::Allocator
  DataPtr allocate(std::size_t bytes) override {
    const DeviceIndex device = c10::cuda::current_device();
    const c10::Device where(c10::DeviceType::CUDA, device);
    if (bytes == 0) return {nullptr, nullptr, &delete_ptr, where};
    void* ptr = allocate_on(device, bytes, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, ptr, &delete_ptr, where};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_ptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // c10::DeviceAllocator
  bool initialized() override { return initialized_; }
  void emptyCache(MempoolId_t /*mempool_id*/) override {
    // A job releases only the segments it left idle: other jobs keep their
    // cache, and the release waits on no other job's stream.
    for (int device = 0; device < kMaxDevices; ++device) {
      MemoryFlowAllocator* core = cores_[device].load(std::memory_order_acquire);
      if (core != nullptr) core->release_free_segments(calling_job(device));
    }
  }
  void recordStream(const DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Memory not from us (from_blob, another allocator) is not ours to track.
    if (ptr.get() == nullptr || ptr.get_deleter() != &delete_ptr) return;
    core(stream.device_index())
        .record_stream(ptr.get(), reinterpret_cast<StreamId>(stream.stream()));
  }
  // The device-generic overload (DeviceAllocator) that torch's generic code
  // calls; declaring the CUDAStream one above hides it, so it is restated.
  void recordStream(const DataPtr& ptr, c10::Stream stream) override {
    recordStream(ptr, c10::cuda::CUDAStream(stream));
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    const Snapshot snap = core(device).snapshot();
    const std::optional<JobId> job = calling_job(device);
    c10::CachingDeviceAllocator::DeviceStats stats;
    const DeviceStats& dev = snap.device;
    // Reserved memory is one shared cache: every job sees the device's.
    stats.reserved_bytes = stat_array(dev.reserved_bytes);
    stats.segment = stat_array(dev.segments);
    if (job) {
      const JobStats& mine = snap.jobs.at(*job);
      stats.allocated_bytes = stat_array(mine.allocated_bytes);
      stats.active_bytes = stat_array(mine.allocated_bytes);
      stats.requested_bytes = stat_array(mine.requested_bytes);
      stats.allocation = stat_array(mine.allocations);
      stats.active = stat_array(mine.allocations);
      stats.num_ooms = mine.num_ooms;
    } else {
      stats.allocated_bytes = stat_array(dev.allocated_bytes);
      stats.active_bytes = stat_array(dev.allocated_bytes);
      stats.requested_bytes = stat_array(dev.requested_bytes);
      stats.allocation = stat_array(dev.allocations);
      stats.active = stat_array(dev.allocations);
      stats.num_ooms = dev.num_ooms;
    }
    stats.num_alloc_retries = dev.num_alloc_retries;
    return stats;
  }
  void resetAccumulatedStats(DeviceIndex device) override {
    core(device).reset_accumulated(calling_job(device));
  }
  void resetPeakStats(DeviceIndex device) override {
    core(device).reset_peak(calling_job(device));
  }

  // c10::cuda::CUDACachingAllocator::CUDAAllocator
  void* raw_alloc(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    const DeviceIndex device = c10::cuda::current_device();
    return allocate_on(device, bytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t bytes, cudaStream_t stream) override {
    if (bytes == 0) return nullptr;
    return allocate_on(c10::cuda::current_device(), bytes, stream);
  }
  void raw_delete(void* ptr) override { free_ptr(ptr); }
  void init(int device_count) override {
    TORCH_CHECK(device_count <= kMaxDevices, "wwrun allocator: more than ", kMaxDevices,
                " devices");
    initialized_ = true;
  }
  double getMemoryFraction(DeviceIndex device) override {
    const std::size_t limit = core(device).reserved_limit();
    if (limit == 0) return 1.0;
    return static_cast<double>(limit) / static_cast<double>(getMemoryInfo(device).second);
  }
  void setMemoryFraction(double fraction, DeviceIndex device) override {
    TORCH_CHECK(fraction > 0 && fraction <= 1, "memory fraction must be in (0, 1], got ",
                fraction);
    const std::size_t total = getMemoryInfo(device).second;
    core(device).set_reserved_limit(
        fraction >= 1 ? 0 : static_cast<std::size_t>(fraction * static_cast<double>(total)));
  }
  std::vector<c10alloc::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    return {};
  }
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  void cacheInfo(DeviceIndex device, std::size_t* largest_block) override {
    // cuDNN sizes its benchmark workspace from this: the largest block the
    // calling job could get, capped at its headroom, so that one job's
    // benchmark cannot starve the others or stall waiting for their frees.
    const auto [device_free, device_total] = getMemoryInfo(device);
    *largest_block =
        core(device).largest_block_for(current_stream(device), device_free, device_total);
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    void* base = nullptr;
    for_each_core([&](MemoryFlowAllocator& core) {
      if (base == nullptr) base = core.segment_base(ptr, size);
    });
    TORCH_CHECK(base != nullptr, "wwrun allocator: pointer not allocated by it");
    return base;
  }
  // Segments and blocks in c10's shape, so torch.cuda.memory_snapshot() and the
  // memory visualizer read them; no traces (history is not recorded).
  c10alloc::SnapshotInfo snapshot(MempoolId_t mempool_id, bool /*include_traces*/) override {
    c10alloc::SnapshotInfo info{};
    if (mempool_id != MempoolId_t{0, 0}) return info;  // no private pools
    for (int device = 0; device < kMaxDevices; ++device) {
      MemoryFlowAllocator* core = cores_[device].load(std::memory_order_acquire);
      if (core == nullptr) continue;
      for (const SegmentInfo& segment : core->segments()) {
        info.segments.push_back(segment_info(static_cast<DeviceIndex>(device), segment));
      }
    }
    return info;
  }
  bool isHistoryEnabled() override { return false; }
  // Note [No private pools]: CUDA graphs (torch.cuda.graph, torch.compile(mode=
  // "reduce-overhead")) and torch.cuda.MemPool route allocations into private
  // pools, which this allocator does not have. Both enter through
  // beginAllocateToPool or createOrIncrefPool, before any stream capture
  // begins, so refusing there fails the calling job alone, with its stream
  // still usable. No pool ever exists, so ending or releasing one has nothing
  // to do (and releasePool may run in a destructor, where throwing would abort).
  void beginAllocateToPool(DeviceIndex, MempoolId_t, std::function<bool(cudaStream_t)>) override {
    TORCH_CHECK(false, no_private_pools());
  }
  void endAllocateToPool(DeviceIndex, MempoolId_t) override {}
  void releasePool(DeviceIndex, MempoolId_t) override {}
  // These three have the same signatures in the headers of torch 2.11 and 2.13.
  void createOrIncrefPool(DeviceIndex, MempoolId_t,
                          std::shared_ptr<c10alloc::CUDAAllocator>) override {
    TORCH_CHECK(false, no_private_pools());
  }
  void setUseOnOOM(DeviceIndex, MempoolId_t, bool) override {
    TORCH_CHECK(false, no_private_pools());
  }
  void setNoSplit(DeviceIndex, MempoolId_t) override { TORCH_CHECK(false, no_private_pools()); }
  c10alloc::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false, unsupported("sharing CUDA tensors between processes"));
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false, unsupported("sharing CUDA tensors between processes"));
  }
  void recordHistory(bool enabled, c10alloc::CreateContextFn, std::size_t, c10alloc::RecordContext,
                     bool, const std::vector<std::string>&) override {
    if (enabled) {
      TORCH_WARN_ONCE(unsupported("memory history recording"), "; ignored.");
    }
  }
  void attachOutOfMemoryObserver(c10alloc::OutOfMemoryObserver observer) override {
    oom_observers_.push_back(std::move(observer));
  }
#if WWRUN_TORCH_AT_LEAST(2, 12)
  void attachOomRejectionObserver(c10alloc::OomRejectionObserver) override {
    // We never reject an allocation preemptively; nothing to report.
  }
#endif
  void attachAllocatorTraceTracker(c10alloc::AllocatorTraceTracker) override {}
  void enablePeerAccess(DeviceIndex device, DeviceIndex peer) override {
    c10::cuda::CUDAGuard guard(device);
    cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
    if (status == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(status);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  std::shared_ptr<c10alloc::AllocatorState> getCheckpointState(DeviceIndex, MempoolId_t) override {
    TORCH_CHECK(false, unsupported("CUDA graph checkpoints"));
  }
  c10alloc::CheckpointDelta setCheckpointPoolState(
      DeviceIndex, std::shared_ptr<c10alloc::AllocatorState>) override {
    TORCH_CHECK(false, unsupported("CUDA graph checkpoints"));
  }
  std::string name() override { return "wwrun"; }

  // fork() (a DataLoader worker) copies only the forking thread: every core's
  // lock is taken before it, so that the child copies consistent pools and can
  // free the blocks its inherited tensors hold; let go in the parent, remade in
  // the child (which cannot use CUDA, but may free).
  void before_fork() {
    cores_mutex_.lock();
    for (auto& slot : cores_) {
      if (auto* core = slot.load()) core->before_fork();
    }
  }
  void after_fork_in_parent() {
    for (auto& slot : cores_) {
      if (auto* core = slot.load()) core->after_fork_in_parent();
    }
    cores_mutex_.unlock();
  }
  void after_fork_in_child() {
    for (auto& slot : cores_) {
      if (auto* core = slot.load()) core->reset_after_fork();
    }
    new (&cores_mutex_) std::mutex();
  }

 private:
  static std::string unsupported(const char* what) {
    return std::string("wwrun allocator: ") + what + " are not supported";
  }
  // Names the job and says the ways out (Note [No private pools]).
  static std::string no_private_pools() {
    const std::string& job = job_thread_mark();
    return std::string("wwrun: CUDA graphs and private memory pools (torch.cuda.graph, "
                       "torch.compile(mode=\"reduce-overhead\"), torch.cuda.MemPool) are not "
                       "supported under wwrun's memory-flow allocator") +
           (job.empty() ? "" : "; job '" + job + "' stops here") +
           ". Ways out: torch.compile(mode=\"max-autotune-no-cudagraphs\") or the default "
           "mode (compiled kernels without graphs); or launch the run with "
           "PYTORCH_ALLOC_CONF=backend:cudaMallocAsync (wwrun then keeps PyTorch's allocator, "
           "which captures graphs); or run this script alone with python";
  }

  std::mutex cores_mutex_;  // serialises creating a core
  std::array<std::atomic<MemoryFlowAllocator*>, kMaxDevices> cores_{};
  std::atomic<bool> initialized_{false};
  bool enabled_ = true;
  std::vector<c10alloc::OutOfMemoryObserver> oom_observers_;
};

// Never destroyed: tensors may be freed during interpreter shutdown, after
// static destructors would have run.
WaterwaveCUDAAllocator* the_allocator = nullptr;

// A DataPtr deleter runs inside destructors: it must never throw. On an error
// the block is logged and leaked; at process exit the CUDA runtime may already
// be unloading, and then there is nothing left to free.
void delete_ptr(void* ptr) noexcept {
  try {
    the_allocator->free_ptr(ptr);
  } catch (const CudartUnloading&) {
    // Process exit: nothing to free, nothing to report.
  } catch (const std::exception& error) {
    std::fprintf(stderr, "wwrun allocator: leaking a block that could not be freed: %s\n",
                 error.what());
  } catch (...) {
    std::fprintf(stderr, "wwrun allocator: leaking a block that could not be freed\n");
  }
}

}  // namespace

void install() {
  c10alloc::CUDAAllocator* current = c10alloc::allocator.load();
  if (the_allocator != nullptr && current == the_allocator) return;
  TORCH_CHECK(current == nullptr || !current->initialized(),
              "wwrun allocator: CUDA is already initialised in this process; install the "
              "allocator (wwrun.memory.allocator.install()) before any CUDA work");
  the_allocator = new WaterwaveCUDAAllocator();
  static std::once_flag atfork;
  std::call_once(atfork, [] {
    pthread_atfork([] { if (the_allocator) the_allocator->before_fork(); },
                   [] { if (the_allocator) the_allocator->after_fork_in_parent(); },
                   [] { if (the_allocator) the_allocator->after_fork_in_child(); });
  });
  c10alloc::allocator.store(the_allocator);
  // Code that asks c10's registry for the CUDA allocator must get ours too.
  c10::SetAllocator(c10::DeviceType::CUDA, the_allocator, /*priority=*/UINT8_MAX);
}

bool installed() {
  return the_allocator != nullptr && c10alloc::allocator.load() == the_allocator;
}

MemoryFlowAllocator& core(int device) {
  TORCH_CHECK(installed(), "wwrun allocator: not installed; call wwrun.memory.allocator.install()");
  return the_allocator->core(static_cast<DeviceIndex>(device));
}

}  // namespace wwrun::alloc::torch_cuda

// The CPU build: the allocator on host memory installed as PyTorch's CPU
// allocator for a run, so every byte a job's CPU tensors take (parameters,
// activations, temporaries, gradients, optimizer state) passes through rules
// a-g and counts to the job. A job thread binds itself to its job's owner
// ("stream", thread-local); backward on the CPU runs on the calling thread, so
// it counts to the same job. Unbound threads allocate as the default job.
//
// Not counted: memory torch does not allocate (numpy-backed tensors through
// torch.from_numpy, from_blob, mmap'd storages), and tensors allocated before
// install, which keep the previous allocator's deleter in their DataPtr and are
// freed through it.
#include <pthread.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "bindings_common.h"
#include "host_backend.h"
#include "python_wait_hooks.h"

namespace wwrun::alloc::cpu {
namespace {

// A backend and an allocator on it. Never destroyed: tensors allocated while it
// was installed may outlive the run and still free through it.
// The capacity is also the allocator's reserved limit, as the run's limit is on a
// GPU (set_per_process_memory_fraction): the policy and its out-of-memory message
// meet the limit where CUDA's do ("the device memory limit of ... is reached"), not
// the backend running out of pages.
struct Core {
  Core(std::size_t capacity) : backend(capacity), allocator(backend, options(capacity)) {}
  static Options options(std::size_t capacity) {
    Options o;
    o.reserved_limit = capacity;
    o.wait_hooks = python_wait_hooks();
    return o;
  }
  HostBackend backend;
  MemoryFlowAllocator allocator;
};

std::atomic<Core*> current_core{nullptr};
std::mutex cores_mutex;                 // guards the list below, not the hot path
std::vector<Core*> all_cores;           // every core ever made, for frees
std::atomic<StreamId> next_stream{1};
thread_local StreamId thread_stream = 0;  // 0: the default job
c10::Allocator* previous_allocator = nullptr;

void delete_ptr(void* ptr) noexcept;

class WaterwaveCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t bytes) override {
    const c10::Device where(c10::DeviceType::CPU);
    Core* core = current_core.load(std::memory_order_acquire);
    if (core == nullptr) {  // uninstalled meanwhile: the previous allocator serves
      return previous_allocator->allocate(bytes);
    }
    if (bytes == 0) return {nullptr, nullptr, &delete_ptr, where};
    await_admission();
    void* ptr = nullptr;
    try {
      ptr = core->allocator.allocate(bytes, thread_stream).ptr;
    } catch (const OutOfMemory& oom) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, oom.what());
    }
    return {ptr, ptr, &delete_ptr, where};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_ptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

WaterwaveCPUAllocator the_allocator;

void delete_ptr(void* ptr) noexcept {
  if (ptr == nullptr) return;
  Core* core = current_core.load(std::memory_order_acquire);
  if (core != nullptr && core->allocator.free_if_owned(ptr)) return;
  std::lock_guard<std::mutex> lock(cores_mutex);
  for (Core* other : all_cores) {
    if (other != core && other->allocator.free_if_owned(ptr)) return;
  }
  std::fprintf(stderr, "wwrun allocator: leaking a CPU block it did not allocate\n");
}

Core& core() {
  Core* core = current_core.load(std::memory_order_acquire);
  TORCH_CHECK(core != nullptr, "wwrun allocator: the CPU allocator is not installed");
  return *core;
}

// fork() (a DataLoader worker) copies only the forking thread. Before it, every
// lock is taken (in the order the free path takes them: the list, an
// allocator, its backend), so that the child copies consistent pools and can
// free the tensors it inherited; the parent lets them go after.
void before_fork() {
  cores_mutex.lock();
  for (Core* core : all_cores) {
    core->allocator.before_fork();
    core->backend.before_fork();
  }
}

void after_fork_in_parent() {
  for (Core* core : all_cores) {
    core->backend.after_fork_in_parent();
    core->allocator.after_fork_in_parent();
  }
  cores_mutex.unlock();
}

// In the child the locks are remade, and the child goes back to the previous
// allocator, since its memory is its own process's, not the run's.
void after_fork_in_child() {
  for (Core* core : all_cores) {
    core->backend.reset_after_fork();
    core->allocator.reset_after_fork();
  }
  new (&cores_mutex) std::mutex();
  unmark_job_thread();
  if (current_core.exchange(nullptr) != nullptr && previous_allocator != nullptr) {
    c10::SetCPUAllocator(previous_allocator, UINT8_MAX);
  }
}

void install(std::size_t capacity) {
  if (current_core.load() != nullptr) return;
  static std::once_flag atfork;
  std::call_once(atfork, [] { pthread_atfork(&before_fork, &after_fork_in_parent, &after_fork_in_child); });
  Core* core = new Core(capacity);
  {
    std::lock_guard<std::mutex> lock(cores_mutex);
    all_cores.push_back(core);
  }
  c10::Allocator* before = c10::GetCPUAllocator();
  if (before != &the_allocator) previous_allocator = before;
  current_core.store(core, std::memory_order_release);
  // The highest priority: torch's own registrations use lower ones.
  c10::SetCPUAllocator(&the_allocator, UINT8_MAX);
}

void uninstall() {
  if (current_core.exchange(nullptr) == nullptr) return;
  c10::SetCPUAllocator(previous_allocator, UINT8_MAX);
}

}  // namespace
}  // namespace wwrun::alloc::cpu

namespace py = pybind11;
namespace cpu = wwrun::alloc::cpu;
using wwrun::alloc::StreamId;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  wwrun::alloc::register_out_of_memory(m);
  wwrun::alloc::register_scheduler_callbacks(m);
  m.def("install", &cpu::install);
  m.def("uninstall", &cpu::uninstall);
  m.def("installed", [] { return cpu::current_core.load() != nullptr; });
  m.def("mark_job_thread", &wwrun::alloc::mark_job_thread);
  m.def("unmark_job_thread", &wwrun::alloc::unmark_job_thread);
  m.def("is_job_thread", &wwrun::alloc::is_job_thread);
  // Binds the calling thread to `job` (made on first use, with its limit).
  m.def("bind_thread", [](const std::string& job, std::size_t limit) {
    auto& allocator = cpu::core().allocator;
    const StreamId stream = cpu::next_stream.fetch_add(1);
    allocator.register_stream(stream, job, limit);
    cpu::thread_stream = stream;
  });
  m.def("unbind_thread", [] { cpu::thread_stream = 0; });
  m.def("unregister_job", [](const std::string& job) {
    return cpu::core().allocator.unregister_job(job);
  });
  m.def("set_expected_releases", [](const std::vector<std::string>& jobs, double wait_s) {
    cpu::core().allocator.set_expected_releases(jobs, wait_s);
  });
  m.def("empty_cache", [](std::optional<wwrun::alloc::JobId> job) {
    py::gil_scoped_release released;
    return cpu::core().allocator.release_free_segments(job);
  }, py::arg("job") = py::none());
  m.def("snapshot", [] { return wwrun::alloc::snapshot_dict(cpu::core().allocator.snapshot()); });
  m.def("segments", [] { return wwrun::alloc::segments_list(cpu::core().allocator.segments()); });
  m.def("reset_peak", [](std::optional<int> job) { cpu::core().allocator.reset_peak(job); });
  m.def("find_job", [](const std::string& job) { return cpu::core().allocator.find_job(job); });
  m.def("can_park", [] { return cpu::core().allocator.can_park(); });
  m.def("park_job", [](const std::string& job) {
    py::gil_scoped_release released;
    return cpu::core().allocator.park_job(job);
  });
  m.def("unpark_job", [](const std::string& job) {
    py::gil_scoped_release released;
    return cpu::core().allocator.unpark_job(job);
  });
  m.def("job_window", [](wwrun::alloc::JobId job, bool restart) {
    const auto window = cpu::core().allocator.job_window(job, restart);
    return std::make_pair(window.current, window.peak);
  });
}

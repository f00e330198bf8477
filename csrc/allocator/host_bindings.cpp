// Python module for the host backend: the allocator on host memory, for tests and
// the host benchmark. Deliberately includes no torch header, so it builds fast.
#include <chrono>
#include <cstring>

#include "bindings_common.h"
#include "host_backend.h"
#include "python_wait_hooks.h"

namespace wwrun::alloc {

// A host backend and an allocator on it, owned together.
class HostAllocator {
 public:
  HostAllocator(std::size_t capacity, std::size_t reserved_limit)
      : backend_(capacity),
        allocator_(backend_, Options{reserved_limit, 2.0, python_wait_hooks(),
                                     [] { return job_thread_mark(); }}) {}

  HostBackend& backend() { return backend_; }
  MemoryFlowAllocator& allocator() { return allocator_; }

  // Seconds for `repeats` passes over `sizes`: each step allocates one block and,
  // once `window` blocks are live, frees the oldest. Runs entirely in C++, so it
  // measures the allocator, not Python.
  double benchmark_trace(const std::vector<std::size_t>& sizes, std::size_t window,
                         std::size_t repeats, StreamId stream) {
    std::vector<void*> live(window, nullptr);
    std::size_t slot = 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t r = 0; r < repeats; ++r) {
      for (std::size_t size : sizes) {
        if (live[slot] != nullptr) allocator_.free(live[slot]);
        live[slot] = allocator_.allocate(size, stream).ptr;
        slot = slot + 1 == window ? 0 : slot + 1;
      }
    }
    const auto stop = std::chrono::steady_clock::now();
    for (void* ptr : live) {
      if (ptr != nullptr) allocator_.free(ptr);
    }
    return std::chrono::duration<double>(stop - start).count();
  }

 private:
  HostBackend backend_;
  MemoryFlowAllocator allocator_;
};

}  // namespace wwrun::alloc

namespace py = pybind11;
using wwrun::alloc::Allocation;
using wwrun::alloc::HostAllocator;
using wwrun::alloc::StreamId;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  wwrun::alloc::register_out_of_memory(m);
  m.attr("RULES") = py::str(wwrun::alloc::kRuleNames);
  m.def("mark_job_thread", &wwrun::alloc::mark_job_thread);
  m.def("unmark_job_thread", &wwrun::alloc::unmark_job_thread);
  m.def("is_job_thread", &wwrun::alloc::is_job_thread);

  py::class_<HostAllocator>(m, "HostAllocator")
      .def(py::init<std::size_t, std::size_t>(), py::arg("capacity"),
           py::arg("reserved_limit") = 0)
      .def("allocate",
           [](HostAllocator& self, std::size_t bytes, StreamId stream, bool hold_gil) {
             // With the GIL held (pybind's default), or without it, as torch's
             // ops call their allocator; rule f's hooks release it if held.
             Allocation a;
             if (hold_gil) {
               a = self.allocator().allocate(bytes, stream);
             } else {
               py::gil_scoped_release released;
               a = self.allocator().allocate(bytes, stream);
             }
             return py::make_tuple(reinterpret_cast<std::uintptr_t>(a.ptr), a.size,
                                   std::string(1, wwrun::alloc::kRuleNames[a.rule]),
                                   a.zeroed, a.waited);
           },
           py::arg("bytes"), py::arg("stream"), py::arg("hold_gil") = true)
      .def("free",
           [](HostAllocator& self, std::uintptr_t ptr) {
             py::gil_scoped_release released;
             self.allocator().free(reinterpret_cast<void*>(ptr));
           })
      .def("record_stream",
           [](HostAllocator& self, std::uintptr_t ptr, StreamId stream) {
             self.allocator().record_stream(reinterpret_cast<void*>(ptr), stream);
           })
      .def("register_stream",
           [](HostAllocator& self, StreamId stream, const std::string& job, std::size_t limit) {
             return self.allocator().register_stream(stream, job, limit);
           })
      .def("unregister_job",
           [](HostAllocator& self, const std::string& job) {
             return self.allocator().unregister_job(job);
           })
      .def("take_dirty_blocks",
           [](HostAllocator& self, const std::string& job, StreamId scrub_stream) {
             return wwrun::alloc::scrub_ranges(
                 self.allocator().take_dirty_blocks(job, scrub_stream));
           })
      .def("finish_scrub",
           [](HostAllocator& self, const std::vector<std::uintptr_t>& ptrs,
              StreamId scrub_stream, bool zeroed) {
             self.allocator().finish_scrub(wwrun::alloc::as_pointers(ptrs), scrub_stream,
                                           zeroed);
           })
      .def("set_expected_releases",
           [](HostAllocator& self, const std::vector<std::string>& jobs, double wait_s) {
             self.allocator().set_expected_releases(jobs, wait_s);
           })
      .def("process_events", [](HostAllocator& self) { self.allocator().process_events(); })
      .def("empty_cache",
           [](HostAllocator& self, std::optional<int> job) {
             py::gil_scoped_release released;
             return self.allocator().release_free_segments(job);
           },
           py::arg("job") = py::none())
      .def("cache_info",
           [](HostAllocator& self, StreamId stream) {
             const std::size_t capacity = self.backend().capacity();
             const std::size_t used = self.backend().used_bytes();
             return self.allocator().largest_block_for(stream, capacity - used, capacity);
           })
      .def("snapshot",
           [](HostAllocator& self) {
             return wwrun::alloc::snapshot_dict(self.allocator().snapshot());
           })
      .def("check_invariants",
           [](HostAllocator& self) { return self.allocator().check_invariants(); })
      .def("segments",
           [](HostAllocator& self) {
             return wwrun::alloc::segments_list(self.allocator().segments());
           })
      .def("reset_peak",
           [](HostAllocator& self, std::optional<int> job) { self.allocator().reset_peak(job); })
      .def("find_job",
           [](HostAllocator& self, const std::string& name) {
             return self.allocator().find_job(name);
           })
      .def("can_park", [](HostAllocator& self) { return self.allocator().can_park(); })
      .def("park_job",
           [](HostAllocator& self, const std::string& name) { return self.allocator().park_job(name); })
      .def("unpark_job",
           [](HostAllocator& self, const std::string& name) { return self.allocator().unpark_job(name); })
      .def("hold", [](HostAllocator& self, StreamId s) { self.backend().hold(s); })
      .def("complete", [](HostAllocator& self, StreamId s) { self.backend().complete(s); })
      .def("last_seq", [](HostAllocator& self, StreamId s) { return self.backend().last_seq(s); })
      .def("completed_seq",
           [](HostAllocator& self, StreamId s) { return self.backend().completed_seq(s); })
      .def("waits", [](HostAllocator& self) { return self.backend().waits(); })
      .def("backend_used_bytes", [](HostAllocator& self) { return self.backend().used_bytes(); })
      .def("write",
           [](HostAllocator&, std::uintptr_t ptr, py::bytes data) {
             std::string bytes = data;
             std::memcpy(reinterpret_cast<void*>(ptr), bytes.data(), bytes.size());
           })
      .def("read",
           [](HostAllocator&, std::uintptr_t ptr, std::size_t n) {
             return py::bytes(reinterpret_cast<const char*>(ptr), n);
           })
      .def("benchmark_trace",
           [](HostAllocator& self, const std::vector<std::size_t>& sizes, std::size_t window,
              std::size_t repeats, StreamId stream) {
             py::gil_scoped_release released;
             return self.benchmark_trace(sizes, window, repeats, stream);
           });
}

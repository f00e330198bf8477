// Python module for the CUDA build: install the allocator into PyTorch, bind
// job streams, read the figures. Streams are passed as integers (cuda_stream).
#include "bindings_common.h"
#include "cuda_backend.h"
#include "python_wait_hooks.h"
#include "torch_cuda_allocator.h"

namespace py = pybind11;
namespace tc = wwrun::alloc::torch_cuda;
using wwrun::alloc::StreamId;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  wwrun::alloc::register_out_of_memory(m);
  wwrun::alloc::register_scheduler_callbacks(m);
  m.def("install", &tc::install);
  m.def("installed", &tc::installed);
  m.def("mark_job_thread", &wwrun::alloc::mark_job_thread);
  m.def("unmark_job_thread", &wwrun::alloc::unmark_job_thread);
  m.def("is_job_thread", &wwrun::alloc::is_job_thread);
  m.def("register_stream", [](int device, StreamId stream, const std::string& job,
                              std::size_t limit) {
    return tc::core(device).register_stream(stream, job, limit);
  });
  m.def("create_job_stream", &wwrun::alloc::create_job_stream);
  m.def("unregister_job", [](int device, const std::string& job) {
    return tc::core(device).unregister_job(job);
  });
  m.def("take_dirty_blocks", [](int device, const std::string& job, StreamId scrub_stream) {
    return wwrun::alloc::scrub_ranges(tc::core(device).take_dirty_blocks(job, scrub_stream));
  });
  m.def("finish_scrub", [](int device, const std::vector<std::uintptr_t>& ptrs,
                           StreamId scrub_stream, bool zeroed) {
    tc::core(device).finish_scrub(wwrun::alloc::as_pointers(ptrs), scrub_stream, zeroed);
  });
  m.def("set_expected_releases", [](int device, const std::vector<std::string>& jobs,
                                    double wait_s) {
    tc::core(device).set_expected_releases(jobs, wait_s);
  });
  m.def("find_job", [](int device, const std::string& job) { return tc::core(device).find_job(job); });
  m.def("can_park", [](int device) { return tc::core(device).can_park(); });
  m.def("park_job", [](int device, const std::string& job) {  // 0: the driver maps no host memory (Note [Parking])
    py::gil_scoped_release released;
    return tc::core(device).park_job(job);
  });
  m.def("unpark_job", [](int device, const std::string& job) {
    py::gil_scoped_release released;
    return tc::core(device).unpark_job(job);
  });
  m.def("job_window", [](int device, wwrun::alloc::JobId job, bool restart) {
    const auto window = tc::core(device).job_window(job, restart);
    return std::make_pair(window.current, window.peak);
  });
  m.def("snapshot", [](int device) { return wwrun::alloc::snapshot_dict(tc::core(device).snapshot()); });
  m.def("segments", [](int device) { return wwrun::alloc::segments_list(tc::core(device).segments()); });
}

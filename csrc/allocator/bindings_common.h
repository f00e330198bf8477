// Python views of the allocator's figures, shared by the host and CUDA modules:
// stats() as a plain dict, and OutOfMemory raised as torch.OutOfMemoryError.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "admission_gate.h"
#include "python_wait_hooks.h"
#include "waterwave_allocator.h"

namespace wwrun::alloc {

namespace py = pybind11;

inline py::dict stat_dict(const Stat& stat) {
  py::dict d;
  d["current"] = stat.current;
  d["peak"] = stat.peak;
  d["allocated"] = stat.allocated;
  d["freed"] = stat.freed;
  return d;
}

inline py::dict job_dict(const JobStats& job) {
  py::dict d;
  d["active"] = job.active;
  d["limit"] = job.limit == 0 ? py::object(py::none()) : py::object(py::int_(job.limit));
  d["allocated_bytes"] = stat_dict(job.allocated_bytes);
  d["requested_bytes"] = stat_dict(job.requested_bytes);
  d["allocations"] = stat_dict(job.allocations);
  d["held_bytes"] = stat_dict(job.held_bytes);
  d["parked_bytes"] = stat_dict(job.parked_bytes);
  d["num_ooms"] = job.num_ooms;
  d["largest_block_bytes"] = job.largest_block;
  d["scrubbed_bytes"] = job.scrubbed_bytes;
  d["batch_scrubbed_bytes"] = job.batch_scrubbed_bytes;
  return d;
}

inline py::dict snapshot_dict(const Snapshot& snap) {
  const DeviceStats& dev = snap.device;
  py::dict device;
  device["allocated_bytes"] = stat_dict(dev.allocated_bytes);
  device["reserved_bytes"] = stat_dict(dev.reserved_bytes);
  device["requested_bytes"] = stat_dict(dev.requested_bytes);
  device["allocations"] = stat_dict(dev.allocations);
  device["segments"] = stat_dict(dev.segments);
  device["num_ooms"] = dev.num_ooms;
  device["num_alloc_retries"] = dev.num_alloc_retries;
  device["num_release_waits"] = dev.num_release_waits;
  device["num_release_deadlocks"] = dev.num_release_deadlocks;
  device["scrubbed_bytes"] = dev.scrubbed_bytes;
  device["batch_scrubbed_bytes"] = dev.batch_scrubbed_bytes;
  device["scrub_batches"] = dev.scrub_batches;
  device["fresh_scrubbed_bytes"] = dev.fresh_scrubbed_bytes;
  device["num_page_moves"] = dev.num_page_moves;
  device["page_bytes"] = snap.page_bytes;
  device["free_page_bytes"] = snap.free_page_bytes;
  device["pending_event_bytes"] = dev.pending_event_bytes;
  device["fragmentation_bytes"] = snap.fragmentation_bytes;
  device["largest_free_block"] = snap.largest_free_block;
  py::dict rules;
  for (int rule = 0; rule < kNumRules; ++rule) {
    rules[py::str(std::string(1, kRuleNames[rule]))] = dev.rule_count[rule];
  }
  py::dict jobs;
  for (const JobStats& job : snap.jobs) jobs[py::str(job.name)] = job_dict(job);
  py::dict d;
  d["device"] = device;
  d["rules"] = rules;
  d["jobs"] = jobs;
  return d;
}

inline py::list segments_list(const std::vector<SegmentInfo>& segments) {
  py::list result;
  for (const SegmentInfo& segment : segments) {
    py::list blocks;
    for (const BlockInfo& block : segment.blocks) {
      py::dict b;
      b["ptr"] = block.ptr;
      b["size"] = block.size;
      b["allocated"] = block.allocated;
      b["pending"] = block.pending;
      b["in_scrub"] = block.in_scrub;
      b["deferred"] = block.deferred;
      b["stream"] = block.stream;
      b["owner"] = block.owner;
      b["requested"] = block.requested;
      blocks.append(b);
    }
    py::dict s;
    s["base"] = segment.base;
    s["size"] = segment.size;
    s["stream"] = segment.stream;
    s["small"] = segment.small;
    s["blocks"] = blocks;
    result.append(s);
  }
  return result;
}

// take_dirty_blocks' ranges as two lists, (addresses, byte counts): the shape
// triton_kernels.zero_ranges_ takes.
inline py::tuple scrub_ranges(const std::vector<ScrubRange>& ranges) {
  py::list ptrs, sizes;
  for (const ScrubRange& range : ranges) {
    ptrs.append(reinterpret_cast<std::uintptr_t>(range.ptr));
    sizes.append(range.size);
  }
  return py::make_tuple(ptrs, sizes);
}

inline std::vector<void*> as_pointers(const std::vector<std::uintptr_t>& addresses) {
  std::vector<void*> ptrs;
  ptrs.reserve(addresses.size());
  for (std::uintptr_t address : addresses) ptrs.push_back(reinterpret_cast<void*>(address));
  return ptrs;
}

// The scheduler's callbacks' Python face: the admission gate (Note [Admission at the
// first allocation]) and the wait at the limit (Note [Waiting at the limit]).
inline void register_scheduler_callbacks(py::module_& m) {
  m.def("close_admission", &close_admission);
  m.def("open_admission", &open_admission);
  m.def("set_admission_callback", [](py::object callback) {
    admission_callback().set(callback.is_none() ? nullptr : callback.ptr());
  });
  // Note [Waiting at the limit]
  m.def("set_limit_callback", [](py::object callback) {
    limit_callback().set(callback.is_none() ? nullptr : callback.ptr());
  });
}

// OutOfMemory -> torch.OutOfMemoryError, so a job's handler for the native
// allocator's error catches ours too.
inline void register_out_of_memory(py::module_& m) {
  // Module-local, and torch's class looked up when raised (translators run with the
  // GIL): a static here is one object shared by every wwrun extension of the
  // process (an inline function's static is a unique symbol), and with the CPU
  // allocator's extension loaded first the host allocator's errors came out as
  // "SystemError: ... returned NULL without setting an exception".
  py::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const OutOfMemory& oom) {
      PyErr_SetString(py::module_::import("torch").attr("OutOfMemoryError").ptr(), oom.what());
    }
  });
  (void)m;
}

}  // namespace wwrun::alloc

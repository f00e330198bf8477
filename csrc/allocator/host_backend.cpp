// Host memory backend; see host_backend.h for the simulation.
#include "host_backend.h"

#include <cstdlib>
#include <cstring>

#include "size_classes.h"

namespace wwrun::alloc {

void* HostBackend::segment_alloc(std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (used_ + bytes > capacity_) return nullptr;
    used_ += bytes;
  }
  void* ptr = std::aligned_alloc(kBlockAlignBytes, bytes);
  if (ptr == nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    used_ -= bytes;
  }
  return ptr;
}

void HostBackend::segment_free(void* ptr, std::size_t bytes) {
  std::free(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  used_ -= bytes;
}

EventHandle HostBackend::event_create() { return new HostEvent; }

void HostBackend::event_destroy(EventHandle event) { delete static_cast<HostEvent*>(event); }

void HostBackend::event_record(EventHandle handle, StreamId stream) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  SimStream& sim = streams_[stream];
  event->stream = stream;
  event->seq = ++sim.recorded;
  if (!sim.held) sim.completed = sim.recorded;
}

bool HostBackend::event_query(EventHandle handle) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_[event->stream].completed >= event->seq;
}

void HostBackend::event_synchronize(EventHandle handle) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  SimStream& sim = streams_[event->stream];
  if (sim.completed < event->seq) sim.completed = event->seq;
}

void HostBackend::stream_wait_event(StreamId stream, EventHandle handle) {
  auto* event = static_cast<HostEvent*>(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  waits_.emplace_back(stream, event->stream, event->seq);
}

void HostBackend::memset_zero(void* ptr, std::size_t bytes, StreamId /*stream*/) {
  std::memset(ptr, 0, bytes);
}

void HostBackend::hold(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  streams_[stream].held = true;
}

void HostBackend::complete(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  SimStream& sim = streams_[stream];
  sim.held = false;
  sim.completed = sim.recorded;
}

std::uint64_t HostBackend::last_seq(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_[stream].recorded;
}

std::uint64_t HostBackend::completed_seq(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return streams_[stream].completed;
}

std::vector<WaitRecord> HostBackend::waits() {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_;
}

std::size_t HostBackend::used_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

}  // namespace wwrun::alloc

// CUDA backend; see cuda_backend.h.
#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace wwrun::alloc {

namespace {

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // not left for torch's next launch check to report
  if (status == cudaErrorCudartUnloading) throw CudartUnloading(what);
  throw std::runtime_error(std::string("wwrun allocator: ") + what + ": " +
                           cudaGetErrorString(status));
}

cudaStream_t as_stream(StreamId stream) { return reinterpret_cast<cudaStream_t>(stream); }
cudaEvent_t as_event(EventHandle event) { return static_cast<cudaEvent_t>(event); }

// Makes `device` current for the scope of a call (allocations may be freed from
// a thread whose current device is another one).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    switched_ = previous_ != device;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace

void* CudaBackend::segment_alloc(std::size_t bytes) {
  DeviceScope scope(device_);
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls succeed
    return nullptr;
  }
  check(status, "cudaMalloc");
  return ptr;
}

void CudaBackend::segment_free(void* ptr, std::size_t /*bytes*/) {
  // At process exit the runtime may unload before the last tensors die: then
  // the memory is going away with the process, not an error.
  int current = 0;
  if (cudaGetDevice(&current) == cudaErrorCudartUnloading) return;
  DeviceScope scope(device_);
  const cudaError_t status = cudaFree(ptr);
  if (status == cudaErrorCudartUnloading) return;
  check(status, "cudaFree");
}

EventHandle CudaBackend::event_create() {
  DeviceScope scope(device_);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  return event;
}

void CudaBackend::event_destroy(EventHandle event) { cudaEventDestroy(as_event(event)); }

void CudaBackend::event_record(EventHandle event, StreamId stream) {
  DeviceScope scope(device_);
  check(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
}

bool CudaBackend::event_query(EventHandle event) {
  cudaError_t status = cudaEventQuery(as_event(event));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void CudaBackend::event_synchronize(EventHandle event) {
  check(cudaEventSynchronize(as_event(event)), "cudaEventSynchronize");
}

void CudaBackend::stream_wait_event(StreamId stream, EventHandle event) {
  DeviceScope scope(device_);
  check(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
}

StreamId create_job_stream(int device) {
  DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return reinterpret_cast<StreamId>(stream);
}

void CudaBackend::memset_zero(void* ptr, std::size_t bytes, StreamId stream) {
  DeviceScope scope(device_);
  check(cudaMemsetAsync(ptr, 0, bytes, as_stream(stream)), "cudaMemsetAsync");
}

}  // namespace wwrun::alloc

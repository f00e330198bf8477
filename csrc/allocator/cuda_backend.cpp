// CUDA backend; see cuda_backend.h.
#include "cuda_backend.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <mutex>
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

// The driver's virtual memory calls, looked up once through the runtime.
struct Driver {
  decltype(&cuMemCreate) mem_create = nullptr;
  decltype(&cuMemRelease) mem_release = nullptr;
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetAttribute) device_attribute = nullptr;
  decltype(&cuMemRetainAllocationHandle) retain_handle = nullptr;
  decltype(&cuMemcpyDtoDAsync) copy_async = nullptr;
};

template <typename Fn>
void look_up(const char* symbol, Fn* fn) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  check(cudaGetDriverEntryPointByVersion(symbol, &address, 12000, cudaEnableDefault, &found),
        "cudaGetDriverEntryPointByVersion");
#else
  check(cudaGetDriverEntryPoint(symbol, &address, cudaEnableDefault, &found),
        "cudaGetDriverEntryPoint");
#endif
  if (found != cudaDriverEntryPointSuccess || address == nullptr) {
    throw std::runtime_error(std::string("wwrun allocator: the CUDA driver lacks ") + symbol);
  }
  *fn = reinterpret_cast<Fn>(address);
}

const Driver& driver() {
  static const Driver loaded = [] {
    Driver d;
    look_up("cuMemCreate", &d.mem_create);
    look_up("cuMemRelease", &d.mem_release);
    look_up("cuMemAddressReserve", &d.address_reserve);
    look_up("cuMemAddressFree", &d.address_free);
    look_up("cuMemMap", &d.map);
    look_up("cuMemUnmap", &d.unmap);
    look_up("cuMemSetAccess", &d.set_access);
    look_up("cuMemGetAllocationGranularity", &d.granularity);
    look_up("cuGetErrorString", &d.error_string);
    look_up("cuDeviceGet", &d.device_get);
    look_up("cuDeviceGetAttribute", &d.device_attribute);
    look_up("cuMemRetainAllocationHandle", &d.retain_handle);
    look_up("cuMemcpyDtoDAsync", &d.copy_async);
    return d;
  }();
  return loaded;
}

void check_driver(CUresult status, const char* what) {
  if (status == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().error_string(status, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown error";
  throw std::runtime_error(std::string("wwrun allocator: ") + what + ": " + text);
}

CUmemAllocationProp page_properties(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

CUdeviceptr as_address(void* ptr) { return reinterpret_cast<CUdeviceptr>(ptr); }

// Maps `handle` (one page) at `address`, readable and writable by `device`.
void map_page(void* address, CUmemGenericAllocationHandle handle, int device) {
  const Driver& d = driver();
  check_driver(d.map(as_address(address), kCudaPageBytes, 0, handle, 0), "cuMemMap");
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult status = d.set_access(as_address(address), kCudaPageBytes, &access, 1);
  if (status != CUDA_SUCCESS) d.unmap(as_address(address), kCudaPageBytes);
  check_driver(status, "cuMemSetAccess");
}

}  // namespace

bool CudaBackend::pages_create(std::size_t count, std::vector<PageHandle>* pages) {
  DeviceScope scope(device_);
  const Driver& d = driver();
  const CUmemAllocationProp prop = page_properties(device_);
  static std::once_flag checked;
  std::call_once(checked, [&] {
    std::size_t granularity = 0;
    check_driver(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 "cuMemGetAllocationGranularity");
    if (granularity == 0 || kCudaPageBytes % granularity != 0) {
      throw std::runtime_error("wwrun allocator: the device's allocation granularity (" +
                               std::to_string(granularity) + " bytes) does not divide a page");
    }
  });
  const std::size_t before = pages->size();
  const auto undo = [&] {
    for (std::size_t i = before; i < pages->size(); ++i) {
      d.mem_release(static_cast<CUmemGenericAllocationHandle>((*pages)[i]));
    }
    pages->resize(before);
  };
  for (std::size_t i = 0; i < count; ++i) {
    CUmemGenericAllocationHandle handle = 0;
    const CUresult status = d.mem_create(&handle, kCudaPageBytes, &prop, 0);
    if (status == CUDA_ERROR_OUT_OF_MEMORY) {
      undo();
      return false;
    }
    if (status != CUDA_SUCCESS) undo();
    check_driver(status, "cuMemCreate");
    pages->push_back(static_cast<PageHandle>(handle));
  }
  return true;
}

void CudaBackend::page_release(PageHandle page) {
  // At process exit the runtime may unload before the last tensors die: then
  // the memory is going away with the process, not an error.
  int current = 0;
  if (cudaGetDevice(&current) == cudaErrorCudartUnloading) return;
  check_driver(driver().mem_release(static_cast<CUmemGenericAllocationHandle>(page)),
               "cuMemRelease");
}

void* CudaBackend::va_reserve(std::size_t bytes) {
  CUdeviceptr base = 0;
  const CUresult status = driver().address_reserve(&base, bytes, kCudaPageBytes, 0, 0);
  if (status == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  check_driver(status, "cuMemAddressReserve");
  return reinterpret_cast<void*>(base);
}

void CudaBackend::va_release(void* base, std::size_t bytes) {
  int current = 0;
  if (cudaGetDevice(&current) == cudaErrorCudartUnloading) return;
  check_driver(driver().address_free(as_address(base), bytes), "cuMemAddressFree");
}

void CudaBackend::page_map(void* address, PageHandle page) {
  DeviceScope scope(device_);
  map_page(address, static_cast<CUmemGenericAllocationHandle>(page), device_);
}

void CudaBackend::page_unmap(void* address, std::size_t bytes) {
  int current = 0;
  if (cudaGetDevice(&current) == cudaErrorCudartUnloading) return;
  DeviceScope scope(device_);
  // The core unmaps only pages whose last use has completed (Note [Layouts]).
  check_driver(driver().unmap(as_address(address), bytes), "cuMemUnmap");
}

// Parking (Note [Parking] in allocator_core.cpp): the page's bytes move to pinned
// host memory that the driver maps at the page's own address (cuMemCreate at a
// host location), so the job's tensors stay where they are and its kernels still
// reach them, over the bus. The copies go through a page of address space of the
// backend's own (`scratch_`), on a stream of its own, the host waiting for each;
// the core calls this only on pages no work uses. (Pointer queries, Triton's
// among them, see a parked tensor as host memory.)
bool CudaBackend::page_park(void* address, PageHandle page) {
  if (!can_park()) return false;
  DeviceScope scope(device_);
  const Driver& d = driver();
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location = host_location_;
  CUmemGenericAllocationHandle host = 0;
  if (d.mem_create(&host, kCudaPageBytes, &prop, 0) != CUDA_SUCCESS) {
    return false;  // no host memory for it: the job gives way, as where none can be had
  }
  std::lock_guard<std::mutex> lock(copy_mutex_);
  bool page_unmapped = false;
  try {
    map_page(scratch(), host, device_);
    copy_page(scratch(), address);
    check_driver(d.unmap(as_address(scratch_), kCudaPageBytes), "cuMemUnmap");
    check_driver(d.unmap(as_address(address), kCudaPageBytes), "cuMemUnmap");
    page_unmapped = true;
    map_page(address, host, device_);
  } catch (const std::exception&) {  // as it was: the page at its address, with its bytes
    if (scratch_ != nullptr) d.unmap(as_address(scratch_), kCudaPageBytes);  // (an error where not mapped)
    if (page_unmapped) {
      try {
        map_page(address, static_cast<CUmemGenericAllocationHandle>(page), device_);
      } catch (...) {
        d.mem_release(host);
        throw;
      }
    }
    d.mem_release(host);
    return false;
  }
  d.mem_release(host);  // mapped, it lives until page_unmap or page_unpark unmaps it
  return true;
}

void CudaBackend::page_unpark(void* address, PageHandle page) {
  DeviceScope scope(device_);
  const Driver& d = driver();
  const auto handle = static_cast<CUmemGenericAllocationHandle>(page);
  std::lock_guard<std::mutex> lock(copy_mutex_);
  map_page(scratch(), handle, device_);
  try {
    copy_page(scratch(), address);
  } catch (...) {
    d.unmap(as_address(scratch_), kCudaPageBytes);
    throw;
  }
  check_driver(d.unmap(as_address(scratch_), kCudaPageBytes), "cuMemUnmap");
  // The host copy, held while it is unmapped: mapped back should the page fail to map.
  CUmemGenericAllocationHandle host = 0;
  check_driver(d.retain_handle(&host, address), "cuMemRetainAllocationHandle");
  const CUresult unmapped = d.unmap(as_address(address), kCudaPageBytes);
  if (unmapped != CUDA_SUCCESS) d.mem_release(host);
  check_driver(unmapped, "cuMemUnmap");
  try {
    map_page(address, handle, device_);
  } catch (...) {
    map_page(address, host, device_);  // still parked, as the core counts it
    d.mem_release(host);
    throw;
  }
  d.mem_release(host);  // unmapped: the copy goes
}

// Whether the driver makes pinned host memory for the virtual memory API on this
// device: at CU_MEM_LOCATION_TYPE_HOST (CUDA 13), else on the device's host NUMA
// node (CUDA 12.2 on, where the driver says so), in pieces that divide a page.
bool CudaBackend::can_park() {
#if CUDA_VERSION >= 12020
  std::call_once(host_checked_, [&] {
    // The attributes by number: CUDA 12's headers name only some of them.
    constexpr auto kHostVmm = static_cast<CUdevice_attribute>(145);      // ..._HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    constexpr auto kHostNumaVmm = static_cast<CUdevice_attribute>(141);  // ..._HOST_NUMA_VIRTUAL_MEMORY_...
    constexpr auto kHostNumaId = static_cast<CUdevice_attribute>(134);   // ..._HOST_NUMA_ID
    const Driver& d = driver();
    CUdevice device = 0;
    if (d.device_get(&device, device_) != CUDA_SUCCESS) return;
    const auto attribute = [&](CUdevice_attribute which) {
      int value = 0;
      return d.device_attribute(&value, which, device) == CUDA_SUCCESS ? value : 0;
    };
    if (attribute(kHostVmm) != 0) {
      host_location_.type = static_cast<CUmemLocationType>(0x2);  // CU_MEM_LOCATION_TYPE_HOST
      host_location_.id = 0;
    } else if (attribute(kHostNumaVmm) != 0) {
      int node = -1;
      if (d.device_attribute(&node, kHostNumaId, device) != CUDA_SUCCESS) node = -1;
      host_location_.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      host_location_.id = node < 0 ? 0 : node;  // 0 where the host has no NUMA
    } else {
      return;
    }
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = host_location_;
    std::size_t granularity = 0;
    host_pages_ = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS &&
                  granularity != 0 && kCudaPageBytes % granularity == 0;
  });
#endif
  return host_pages_;
}

// Under copy_mutex_: a page of address space, nothing mapped between copies.
void* CudaBackend::scratch() {
  if (scratch_ == nullptr) {
    scratch_ = va_reserve(kCudaPageBytes);
    if (scratch_ == nullptr) throw std::runtime_error("wwrun allocator: no address space for a page's copy");
  }
  return scratch_;
}

// Under copy_mutex_: one page's bytes from `from` to `to`, both device addresses
// (one of them mapping host memory), the host waiting.
void CudaBackend::copy_page(void* to, const void* from) {
  if (copy_stream_ == 0) copy_stream_ = create_job_stream(device_);
  check_driver(driver().copy_async(as_address(to), as_address(const_cast<void*>(from)), kCudaPageBytes,
                                   reinterpret_cast<CUstream>(copy_stream_)),
               "cuMemcpyDtoDAsync");
  check(cudaStreamSynchronize(as_stream(copy_stream_)), "cudaStreamSynchronize");
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

// Per-job default generators for wwrun's job threads.
//
// A job thread carries kJobKey in its thread-local included dispatch keys.
// Every operator with a `Generator?` argument has a boxed kernel at that key which,
// when the argument is None or torch's own default generator, puts the calling
// thread's job generator (CPU, or CUDA of the op's device) in its place, then
// redispatches below the key. All other operators fall through, so threads of no
// job, and ops that draw nothing, run exactly as before.
//
// The job's generators live in the thread's c10::ThreadLocalDebugInfo, which torch
// hands, with the dispatch keys, to the threads that work for it: the autograd
// thread running the job's backward on CUDA draws from them too, so a checkpointed
// block recomputed there gets forward's dropout masks (Note [Work for a job]).
//
// A few CUDA kernels draw from the default generator without taking one as an
// argument (native_dropout, the fused attention kernels). For those the job's state
// is swapped into the default generator around the call, under one process-wide
// lock that the thread lets go while it waits for memory (Note [Swapped draws]).
//
// Note [Which key]
// CustomRNGKeyId, made for custom generators, sits among the backend keys, and
// composite kernels fill its slot in the dispatch table: `add` in a job thread
// then ran CompositeExplicitAutogradNonFunctional's kernel instead of the CPU one.
// Per-op fallthroughs are not allowed. TESTING_ONLY_GenericMode is a mode key above
// autograd that no alias fills and torch itself never registers: a fallthrough
// fallback makes it free for every op but the random ones.
//
// Being above the Python key, the kernel also runs while torch.compile or export
// traces: then (a fake or proxy mode active, or a tensor subclass among the
// arguments) it leaves the op alone, so that no generator is baked into a graph;
// the compiled code draws at run time, through this kernel again. It must not wait
// for the Python key to pass, though: inside a TorchDispatchMode's
// __torch_dispatch__ every key above Python is excluded (AOTAutograd runs compiled
// code's first call under one), so draws there would go to torch's generator.
//
// Reference: c10/core/DispatchKey.h, aten/src/ATen/core/dispatch/OperatorEntry.cpp
// (computeDispatchTableEntryWithDebug).

#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <pthread.h>

#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "wait_release.h"

namespace {

constexpr c10::DispatchKey kJobKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// Note [Work for a job]
// A job's generators, in the debug info of its threads (enter) and of the threads
// torch runs their work on: at::ThreadLocalState carries debug info and dispatch
// keys to the autograd engine's device threads for each backward, so a job's
// backward (checkpoint recompute included) draws from them, as under `python`.
// The slot is one torch uses only in its tests, as kJobKey is.
struct JobGenerators final : c10::DebugInfoBase {
  std::optional<at::Generator> cpu;
  std::vector<at::Generator> cuda;  // by device index
  std::int64_t job = 0;             // the Python side's key for the job's state
};
c10::DebugInfoKind job_info_kind() { return c10::DebugInfoKind::TEST_INFO_2; }

// Inside a swap the thread draws from the default generator (not propagated).
thread_local bool swapping = false;
// The debug info the thread had before enter(), put back by leave().
thread_local std::shared_ptr<c10::ThreadLocalDebugInfo> before_enter;
// The job's own threads keep theirs at hand (the debug info's lookup, a call into
// c10, made `rand` 0.5 us slower); torch's threads look it up.
thread_local std::shared_ptr<const JobGenerators> own;

const JobGenerators* job_generators() {
  if (swapping || !c10::impl::tls_is_dispatch_key_included(kJobKey)) return nullptr;
  if (own) return own.get();
  return static_cast<const JobGenerators*>(c10::ThreadLocalDebugInfo::get(job_info_kind()));
}

const c10::DispatchKeySet kBelowJobKey(c10::DispatchKeySet::FULL_AFTER, kJobKey);

bool is_optional_generator(const c10::Argument& arg) {
  auto optional = arg.type()->cast<c10::OptionalType>();
  return optional && optional->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

bool has_generator_argument(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments()) {
    if (is_optional_generator(arg)) return true;
  }
  return false;
}

// The device whose default generator the op would draw from: its first tensor's,
// else its `device=` argument's, else the CPU.
at::Device op_device(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  const size_t n = schema.arguments().size();
  const size_t base = stack.size() - n;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& value = stack[base + i];
    if (value.isTensor()) {
      const at::Tensor& tensor = value.toTensor();
      if (tensor.defined()) return tensor.device();
    } else if (value.isDevice()) {
      at::Device device = value.toDevice();
      if (device.is_cuda() && !device.has_index()) {
        device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
      }
      return device;
    }
  }
  return at::Device(at::kCPU);
}

const at::Generator* job_generator(const at::Device& device) {
  const JobGenerators* job = job_generators();
  if (job == nullptr) return nullptr;
  if (device.is_cpu()) return job->cpu ? &*job->cpu : nullptr;
  if (device.is_cuda() && device.has_index() && device.index() < static_cast<int>(job->cuda.size())) {
    return &job->cuda[device.index()];
  }
  return nullptr;
}

at::Generator default_generator(const at::Device& device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

bool tracing(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  if (TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::FAKE) ||
      TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::PROXY)) {
    return true;
  }
  const size_t n = schema.arguments().size();
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    if (stack[i].isTensor() && stack[i].toTensor().key_set().has(c10::DispatchKey::Python)) {
      return true;
    }
  }
  return false;
}

void substitute_generator(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                          torch::jit::Stack* stack) {
  if (!swapping && !(keys.has(c10::DispatchKey::Python) && tracing(op.schema(), *stack))) {
    const auto& schema = op.schema();
    const auto& args = schema.arguments();
    const size_t base = stack->size() - args.size();
    for (size_t i = 0; i < args.size(); ++i) {
      if (!is_optional_generator(args[i])) continue;
      c10::IValue& given = (*stack)[base + i];
      const at::Device device = op_device(schema, *stack);
      const at::Generator* mine = job_generator(device);
      if (mine != nullptr &&
          (given.isNone() || given.toGenerator() == default_generator(device))) {
        given = c10::IValue(*mine);
      }
      break;
    }
  }
  op.redispatchBoxed(keys & kBelowJobKey, stack);
}

// Note [Swapped draws]
// Some ops draw from the default generator without taking one: native_dropout and
// the fused attention kernels on CUDA, and, inside a TorchDispatchMode (where the
// job key is excluded, see Note [Which key]), the overloads without a generator
// (`randint.low_out` calls `random_` below the mode). For those the job's state is
// copied into the default generator for the call and copied back after, under
// swap_lock so that two jobs never interleave there; substitution is off meanwhile,
// so that every draw of the call lands in the default generator. CUDA launches are
// asynchronous; the philox seed and offset are read on the host at launch.
//
// The call may allocate, and an allocation may wait for other jobs' frees (rule
// f): the lock is let go for that wait (SwappedCall::release), or every other
// job's dropout would stall behind it, and a job whose frees the waiter needs
// could not free. Whoever takes the lock next must find the process's state in
// the default generator, so the job's state goes out with the lock and comes back
// in with it: saved into the job's generator as the call has left it (an op may
// have drawn before it allocates: native_dropout's mask before its output, an
// attention kernel's philox offset before its workspace), and the process's put
// back. Two jobs' waits then resume in any order, each with its own state.
// It never blocks on the lock holding the GIL: a call inside a TorchDispatchMode
// runs Python while holding the lock.
std::mutex swap_lock;

void lock_swap() {
  if (swap_lock.try_lock()) return;
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* saved = PyEval_SaveThread();
    swap_lock.lock();
    PyEval_RestoreThread(saved);
  } else {
    swap_lock.lock();
  }
}

// A generator's whole state, copied without a tensor: get_state() allocates one,
// and release() runs inside the allocator, under its lock.
struct GeneratorState {
  std::optional<at::mt19937> engine;  // CPU: the engine and the second of a pair of normal samples
  std::optional<float> next_float_normal;
  std::optional<double> next_double_normal;
  std::uint64_t seed = 0, offset = 0;  // CUDA: philox (what get_state holds)
};

GeneratorState read_state(at::Generator& generator) {
  GeneratorState state;
  if (generator.device().is_cpu()) {
    auto* cpu = at::check_generator<at::CPUGeneratorImpl>(generator);
    state.engine = cpu->engine();
    state.next_float_normal = cpu->next_float_normal_sample();
    state.next_double_normal = cpu->next_double_normal_sample();
  } else {
    state.seed = generator.current_seed();
    state.offset = generator.get_offset();
  }
  return state;
}

void write_state(at::Generator& generator, const GeneratorState& state) {
  if (generator.device().is_cpu()) {
    auto* cpu = at::check_generator<at::CPUGeneratorImpl>(generator);
    cpu->set_engine(*state.engine);
    cpu->set_next_float_normal_sample(state.next_float_normal);
    cpu->set_next_double_normal_sample(state.next_double_normal);
  } else {
    generator.set_current_seed(state.seed);  // resets the offset: set it after
    generator.set_offset(state.offset);
  }
}

// One thread's swapped call. While `in`, the thread holds swap_lock and the job's
// state is in the default generator (`shared`), the process's kept in `process`.
struct SwappedCall final : wwrun::WaitRelease {
  SwappedCall(at::Generator shared, at::Generator mine)
      : shared(std::move(shared)), mine(std::move(mine)) {}

  void swap_in() {
    lock_swap();
    std::scoped_lock both(shared.mutex(), mine.mutex());
    process = read_state(shared);
    write_state(shared, read_state(mine));
    in = true;
  }

  void swap_out() {
    {
      std::scoped_lock both(shared.mutex(), mine.mutex());
      put_back();
    }
    in = false;
    swap_lock.unlock();
  }

  void release() override {
    if (!in || std::this_thread::get_id() != owner) return;
    {
      // A kernel may allocate while it holds the generator's mutex (CPU multinomial
      // does), in the middle of a draw: then the state must stay, and so the lock.
      // try_lock fails there (glibc's, on a mutex this thread holds) and never
      // blocks; it fails too while another thread holds one, briefly: this wait
      // then keeps the lock, as every wait did before the lock was let go.
      std::unique_lock a(shared.mutex(), std::defer_lock), b(mine.mutex(), std::defer_lock);
      if (std::try_lock(a, b) != -1) return;
      put_back();
    }
    in = false;
    swap_lock.unlock();
  }

  void reacquire() override {  // called without the GIL (python_wait_hooks.h)
    if (!in && std::this_thread::get_id() == owner) swap_in();
  }

  const std::thread::id owner = std::this_thread::get_id();
  at::Generator shared, mine;
  GeneratorState process;
  bool in = false;

 private:
  void put_back() {  // with both generators' mutexes held
    write_state(mine, read_state(shared));
    write_state(shared, process);
  }
};

void swap_default_state(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                        torch::jit::Stack* stack) {
  if (!swapping && !(keys.has(c10::DispatchKey::Python) && tracing(op.schema(), *stack))) {
    const at::Device device = op_device(op.schema(), *stack);
    const at::Generator* found = job_generator(device);
    if (found != nullptr) {
      auto call = std::make_shared<SwappedCall>(default_generator(device), *found);
      c10::DebugInfoGuard section(wwrun::wait_release_kind(), call);
      call->swap_in();
      // Inner ops draw from the shared generator too, not from the job's directly.
      swapping = true;
      auto finish = [&] {
        swapping = false;
        call->reacquire();  // in already, unless a wait's hook failed to take it back
        call->swap_out();
      };
      try {
        op.redispatchBoxed(keys & kBelowJobKey, stack);
      } catch (...) {
        finish();
        throw;
      }
      finish();
      return;
    }
  }
  op.redispatchBoxed(keys & kBelowJobKey, stack);
}

// The overloads without a generator reach a generator-taking op through the
// dispatcher, where substitution works, except inside a TorchDispatchMode: swap
// only there (measured on the CPU: the swap adds ~0.9 us to `rand`, substitution
// ~0.25 us; benchmarks/rng.py).
void swap_in_modes(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                   torch::jit::Stack* stack) {
  if (keys.has(c10::DispatchKey::Python)) {
    swap_default_state(op, keys, stack);
  } else {
    op.redispatchBoxed(keys & kBelowJobKey, stack);
  }
}

std::mutex registration_lock;
std::vector<std::unique_ptr<torch::Library>> libraries;  // kept alive: registrations last
std::map<std::string, torch::Library*> library_by_namespace;

torch::Library& library_for(const std::string& ns) {
  auto found = library_by_namespace.find(ns);
  if (found != library_by_namespace.end()) return *found->second;
  libraries.push_back(std::make_unique<torch::Library>(
      torch::Library::IMPL, ns, kJobKey, __FILE__, __LINE__));
  library_by_namespace[ns] = libraries.back().get();
  return *libraries.back();
}

std::string qualified(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

// Registers the job key's kernels for every operator known now: the substitution
// for ops with a `Generator?` argument; the swap for `swap_ops` (qualified names,
// those missing from this torch are skipped) and for the overloads without a
// generator of ops that have one (`randn.out` beside `randn.generator_out`);
// every other op falls through.
// Returns the names given the substitution. Idempotent per operator.
std::vector<std::string> register_kernels(const std::vector<std::string>& swap_ops) {
  std::lock_guard<std::mutex> guard(registration_lock);
  static std::set<std::string> done;
  std::set<std::string> swap(swap_ops.begin(), swap_ops.end());
  std::vector<std::string> substituted;
  auto& dispatcher = c10::Dispatcher::singleton();
  // Once per process, not per copy of this library: a second copy (a build in
  // another folder, loaded beside the first) registering it again is an error.
  if (!dispatcher.hasBackendFallbackForDispatchKey(kJobKey)) {
    libraries.push_back(std::make_unique<torch::Library>(
        torch::Library::IMPL, "_", kJobKey, __FILE__, __LINE__));
    libraries.back()->fallback(torch::CppFunction::makeFallthrough());
  }
  const auto names = dispatcher.getAllOpNames();
  std::set<std::string> drawing;  // ops (without overload) with a generator overload
  for (const auto& name : names) {
    auto handle = dispatcher.findOp(name);
    if (handle && handle->hasSchema() && has_generator_argument(handle->schema())) {
      drawing.insert(name.name);
    }
  }
  for (const auto& name : names) {
    const std::string full = qualified(name);
    if (done.count(full)) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    const auto split = name.name.find("::");
    if (split == std::string::npos) continue;
    const std::string ns = name.name.substr(0, split);
    const std::string local = full.substr(split + 2);
    auto& lib = library_for(ns);
    const bool takes_generator = has_generator_argument(handle->schema());
    if (swap.count(full)) {
      lib.impl(local.c_str(), torch::CppFunction::makeFromBoxedFunction<&swap_default_state>());
    } else if (!takes_generator && drawing.count(name.name)) {
      lib.impl(local.c_str(), torch::CppFunction::makeFromBoxedFunction<&swap_in_modes>());
    } else if (takes_generator) {
      lib.impl(local.c_str(), torch::CppFunction::makeFromBoxedFunction<&substitute_generator>());
      substituted.push_back(full);
    }
    done.insert(full);
  }
  return substituted;
}

void leave();

// Makes the calling thread, and the threads working for it, draw from these
// generators (cpu None: from torch's own); `job` is the Python side's key.
void enter(std::optional<at::Generator> cpu, std::vector<at::Generator> cuda, std::int64_t job) {
  leave();
  auto info = std::make_shared<JobGenerators>();
  info->cpu = std::move(cpu);
  info->cuda = std::move(cuda);
  info->job = job;
  before_enter = c10::ThreadLocalDebugInfo::current();
  c10::ThreadLocalDebugInfo::_push(job_info_kind(), info);
  own = std::move(info);
  c10::impl::tls_set_dispatch_key_included(kJobKey, true);
}

void leave() {
  c10::impl::tls_set_dispatch_key_included(kJobKey, false);
  if (own) {
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(std::move(before_enter));
    before_enter.reset();
    own.reset();
  }
}

bool entered() { return own && job_generators() != nullptr; }

// The key of the job the calling thread works for (its own, or the job whose
// backward it runs), 0 for none.
std::int64_t current_job() {
  const JobGenerators* job = job_generators();
  return job == nullptr ? 0 : job->job;
}

// fork() copies only the forking thread (a DataLoader worker of a job): a lock
// another job's thread held is remade in the child.
void after_fork_in_child() {
  new (&swap_lock) std::mutex();
  new (&registration_lock) std::mutex();
}

// For tests: runs `fn` on a new thread under the calling thread's
// at::ThreadLocalState, as torch's autograd engine runs a backward on its device
// thread (CUDA), and returns its result.
py::object run_as_worker(py::function fn) {
  const at::ThreadLocalState state;
  py::object result;
  std::exception_ptr error;
  {
    py::gil_scoped_release released;
    std::thread worker([&] {
      at::ThreadLocalStateGuard guard(state);
      py::gil_scoped_acquire gil;
      try {
        result = fn();
      } catch (...) {
        error = std::current_exception();
      }
    });
    worker.join();
  }
  if (error) std::rethrow_exception(error);
  return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "wwrun: per-job default generators (see job_generators.cpp)";
  m.def("register_kernels", &register_kernels, py::arg("swap_ops"));
  m.def("enter", &enter, py::arg("cpu"), py::arg("cuda"), py::arg("job"));
  m.def("leave", &leave);
  m.def("entered", &entered);
  m.def("current_job", &current_job);
  m.def("run_as_worker", &run_as_worker, py::arg("fn"));
  pthread_atfork(nullptr, nullptr, &after_fork_in_child);
}

// Per-job default generators for wwrun's job threads.
//
// A job thread carries kJobKey in its thread-local included dispatch keys.
// Every operator with a `Generator?` argument has a boxed kernel at that key which,
// when the argument is None or torch's own default generator, puts the calling
// thread's job generator (CPU, or CUDA of the op's device) in its place, then
// redispatches below the key. All other operators fall through, so threads of no
// job, and ops that draw nothing, run exactly as before.
//
// A few CUDA kernels draw from the default generator without taking one as an
// argument (native_dropout, the fused attention kernels). For those the job's state
// is swapped into the default generator around the call, under one process-wide
// lock (Note [Swapped draws]).
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
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr c10::DispatchKey kJobKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// The calling thread's job generators; empty outside job threads.
struct ThreadGenerators {
  bool active = false;
  std::optional<at::Generator> cpu;
  std::vector<at::Generator> cuda;  // by device index
};
thread_local ThreadGenerators tls;

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

at::Generator* job_generator(const at::Device& device) {
  if (device.is_cpu()) return tls.cpu ? &*tls.cpu : nullptr;
  if (device.is_cuda() && device.has_index() && device.index() < static_cast<int>(tls.cuda.size())) {
    return &tls.cuda[device.index()];
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
  if (tls.active && !(keys.has(c10::DispatchKey::Python) && tracing(op.schema(), *stack))) {
    const auto& schema = op.schema();
    const auto& args = schema.arguments();
    const size_t base = stack->size() - args.size();
    for (size_t i = 0; i < args.size(); ++i) {
      if (!is_optional_generator(args[i])) continue;
      c10::IValue& given = (*stack)[base + i];
      const at::Device device = op_device(schema, *stack);
      at::Generator* mine = job_generator(device);
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
std::mutex swap_lock;

void swap_default_state(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                        torch::jit::Stack* stack) {
  if (tls.active && !(keys.has(c10::DispatchKey::Python) && tracing(op.schema(), *stack))) {
    const at::Device device = op_device(op.schema(), *stack);
    at::Generator* mine = job_generator(device);
    if (mine != nullptr) {
      std::lock_guard<std::mutex> serial(swap_lock);
      at::Generator shared = default_generator(device);
      at::Tensor saved;
      {
        std::scoped_lock both(shared.mutex(), mine->mutex());
        saved = shared.get_state();
        shared.set_state(mine->get_state());
      }
      // Inner ops draw from the shared generator too, not from `mine` directly.
      tls.active = false;
      auto restore = [&] {
        tls.active = true;
        std::scoped_lock both(shared.mutex(), mine->mutex());
        mine->set_state(shared.get_state());
        shared.set_state(saved);
      };
      try {
        op.redispatchBoxed(keys & kBelowJobKey, stack);
      } catch (...) {
        restore();
        throw;
      }
      restore();
      return;
    }
  }
  op.redispatchBoxed(keys & kBelowJobKey, stack);
}

// The overloads without a generator reach a generator-taking op through the
// dispatcher, where substitution works, except inside a TorchDispatchMode: swap
// only there (measured on the CPU: the swap adds ~8 us to `rand`, substitution
// ~0.4 us; benchmarks/rng.py).
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
  if (done.empty()) {
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

// Makes the calling thread draw from these generators (cpu None: from torch's own).
void enter(std::optional<at::Generator> cpu, std::vector<at::Generator> cuda) {
  tls.cpu = std::move(cpu);
  tls.cuda = std::move(cuda);
  tls.active = true;
  c10::impl::tls_set_dispatch_key_included(kJobKey, true);
}

void leave() {
  c10::impl::tls_set_dispatch_key_included(kJobKey, false);
  tls = ThreadGenerators{};
}

bool entered() {
  return tls.active && c10::impl::tls_is_dispatch_key_included(kJobKey);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "wwrun: per-job default generators (see job_generators.cpp)";
  m.def("register_kernels", &register_kernels, py::arg("swap_ops"));
  m.def("enter", &enter, py::arg("cpu"), py::arg("cuda"));
  m.def("leave", &leave);
  m.def("entered", &entered);
}

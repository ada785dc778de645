#include "aten/FusedKernels.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/bit_cast.h>

namespace at::kiln {

// Note [Generated kernels for fusion groups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Issue 16's second increment of adaptive eager (Note [Adaptive eager
// fusion] in AdaptiveEager.cc). A fusion group first ran each op as its own
// ATen CPU kernel, tile by tile: one boxed dispatch and one TensorIterator
// per op and tile, which cost more than fusing saved. Now a run of
// consecutive ops of a group whose forms are in FusedForm (add, sub, mul,
// div, neg, relu, sigmoid) is one generated loop that keeps every
// intermediate in a SIMD register: per vector of elements it loads each
// buffer the run reads before writing it, computes the ops in order, and
// stores each written buffer's last value (every op's output is still in
// memory afterwards, as Python may hold any of them).
//
// Same bits as unfused. The loop computes with at::vec::Vectorized<float>,
// the very functions ATen's kernels call in their vectorised bodies (Sleef's
// exp for sigmoid, fmadd for add, …), built with the instruction set ATen runs
// on this machine (torch_kiln.kernels.build.simd_flags) and with
// -ffp-contract=off, so no multiply-add of two ops is contracted into an FMA.
// It covers only the vectorised body of each intra-op thread's range:
// AdaptiveEager.cc runs the last (range length mod 2 x vector size) elements,
// where ATen's loop runs its scalar lambda (std::exp, not Sleef), through the
// ATen kernels as before. One thing the instruction order decides and IEEE
// 754 leaves open is which NaN comes out when both operands of an add, mul or
// div are NaN; ATen's compiler picked an order, this build might pick
// another. So each binary op's result takes, where both operands are NaN, the
// (quieted) NaN of the operand ATen's kernel returns, found by running ATen's
// kernel once on two NaNs (nanWinnerOf); an op for which ATen returns
// neither is not generated. tests/test_adaptive_eager.py runs every op both
// ways over NaN payloads, ±inf, ±0, denormals and extremes.
//
// Not Inductor's generator: its C++ kernels run loop tails vectorised with
// masked loads, use their own exp/sigmoid forms and may contract FMAs, so
// their bits are not ATen's; the issue requires the fused bits to be the
// unfused ones. The build goes through torch_kiln.kernels (the custom-kernel
// interface's builder: compiler flags, on-disk cache keyed by source, flags
// and compiler, file lock), called from Python.
//
// Nothing waits for a compiler. The first group run with a new signature
// queues a build and runs that segment unfused; a thread started at the
// first build request (one per process, leaked at exit) builds queued
// signatures one at a time through the builder Python registered, holding
// the GIL only inside it. Later runs find the kernel. A build that fails is
// recorded (fusedKernelBuildFailures) and its segment stays unfused. In a
// forked child the thread does not exist: the registry keeps built kernels,
// forgets queued ones, and starts a new thread on the next request. At
// exit Python stops the builds (stopFusedKernelBuilds, from atexit) before
// the interpreter finalizes, so the thread never takes the GIL after that.

namespace {

// ------------------------------------------------------------- sources

const char* formName(FusedForm form) {
  switch (form) {
    case FusedForm::Add: return "add";
    case FusedForm::Mul: return "mul";
    case FusedForm::Div: return "div";
    case FusedForm::Neg: return "neg";
    case FusedForm::ClampMin: return "clamp_min";
    case FusedForm::Sigmoid: return "sigmoid";
  }
  return "?";
}

bool isBinary(FusedForm form) {
  return form == FusedForm::Add || form == FusedForm::Mul || form == FusedForm::Div ||
         form == FusedForm::ClampMin;
}

std::string valueName(const FusedValue& v) {
  return (v.is_scalar ? "s" : "b") + std::to_string(v.index);
}

} // namespace

std::string SegmentPlan::signature() const {
  std::string text = "v1 b" + std::to_string(buffer_count) + " s" + std::to_string(scalar_count);
  for (const auto& op : ops) {
    text += ";" + std::string(formName(op.form)) + "(" + valueName(op.a);
    if (isBinary(op.form)) {
      text += "," + valueName(op.b);
    }
    if (op.form == FusedForm::Add) {
      text += "," + valueName(op.alpha);
    }
    text += ")->b" + std::to_string(op.out);
    if (isBinary(op.form) && op.form != FusedForm::ClampMin) {
      text += op.nan_winner == 0 ? "^a" : "^b";
    }
  }
  return text;
}

std::string SegmentPlan::source() const {
  std::string s;
  s += "// A kiln adaptive eager fusion kernel (Note [Generated kernels for fusion groups]).\n";
  s += "// " + signature() + "\n";
  s += R"(#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>
#include <cstdint>

namespace {
using Vec = at::vec::Vectorized<float>;
// r, but where a and b are both NaN the quieted NaN `winner` (one of them).
inline Vec both_nan(Vec r, Vec a, Vec b, Vec winner) {
  const Vec quiet(c10::bit_cast<float>(uint32_t{0x00400000}));
  return Vec::blendv(r, winner | quiet, a.isnan() & b.isnan());
}
} // namespace

extern "C" __attribute__((visibility("default"))) int64_t kiln_fused_vector_size() {
  return Vec::size();
}

extern "C" __attribute__((visibility("default"))) void kiln_fused_kernel(
    float* const* buffers, const float* scalars, int64_t n) {
)";
  for (uint32_t k = 0; k < buffer_count; ++k) {
    s += "  float* const b" + std::to_string(k) + "_data = buffers[" + std::to_string(k) + "];\n";
  }
  for (uint32_t k = 0; k < scalar_count; ++k) {
    s += "  const Vec s" + std::to_string(k) + "(scalars[" + std::to_string(k) + "]);\n";
  }
  s += "  for (int64_t i = 0; i < n; i += Vec::size()) {\n";
  std::vector<std::string> current(buffer_count); // the register holding each buffer
  std::vector<char> written(buffer_count, 0);
  int temp = 0;
  auto read = [&](const FusedValue& v) -> std::string {
    if (v.is_scalar) {
      return "s" + std::to_string(v.index);
    }
    auto& name = current[v.index];
    if (name.empty()) {
      name = "t" + std::to_string(temp++);
      s += "    const Vec " + name + " = Vec::loadu(b" + std::to_string(v.index) + "_data + i);\n";
    }
    return name;
  };
  for (const auto& op : ops) {
    const std::string a = read(op.a);
    const std::string b = isBinary(op.form) ? read(op.b) : std::string();
    const std::string alpha = op.form == FusedForm::Add ? read(op.alpha) : std::string();
    std::string expr;
    switch (op.form) {
      case FusedForm::Add: expr = "at::vec::fmadd(" + b + ", " + alpha + ", " + a + ")"; break;
      case FusedForm::Mul: expr = a + " * " + b; break;
      case FusedForm::Div: expr = a + " / " + b; break;
      case FusedForm::Neg: expr = a + ".neg()"; break;
      case FusedForm::ClampMin: expr = "at::vec::clamp_min(" + a + ", " + b + ")"; break;
      case FusedForm::Sigmoid: expr = "(Vec(1.0f) + " + a + ".neg().exp()).reciprocal()"; break;
    }
    if (isBinary(op.form) && op.form != FusedForm::ClampMin) {
      expr = "both_nan(" + expr + ", " + a + ", " + b + ", " + (op.nan_winner == 0 ? a : b) + ")";
    }
    const std::string name = "t" + std::to_string(temp++);
    s += "    const Vec " + name + " = " + expr + ";  // " + formName(op.form) + "\n";
    current[op.out] = name;
    written[op.out] = 1;
  }
  for (uint32_t k = 0; k < buffer_count; ++k) {
    if (written[k]) {
      s += "    " + current[k] + ".store(b" + std::to_string(k) + "_data + i);\n";
    }
  }
  s += "  }\n}\n";
  return s;
}

// ------------------------------------------------------------- NaN probe

int nanWinnerOf(FusedForm form, bool a_is_scalar, bool b_is_scalar) {
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<int, int>(); // leaked
  const int key = static_cast<int>(form) * 4 + (a_is_scalar ? 2 : 0) + (b_is_scalar ? 1 : 0);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache->find(key); it != cache->end()) {
    return it->second;
  }
  // Two quiet NaNs of different sign and payload, over 64 elements (ATen's
  // vectorised body; a 0-dim operand is a host scalar as the executor gives).
  const uint32_t bits_a = 0x7FC00011u, bits_b = 0xFFC00022u;
  auto operand = [](uint32_t bits, bool scalar) {
    const float value = c10::bit_cast<float>(bits);
    return scalar ? at::scalar_tensor(value, at::kFloat) : at::full({64}, value, at::kFloat);
  };
  const at::Tensor a = operand(bits_a, a_is_scalar), b = operand(bits_b, b_is_scalar);
  at::Tensor out = at::empty({64}, at::kFloat);
  switch (form) {
    case FusedForm::Add: at::add_out(out, a, b); break;
    case FusedForm::Mul: at::mul_out(out, a, b); break;
    case FusedForm::Div: at::div_out(out, a, b); break;
    default: return 0; // unary, or clamp_min (whose bound is never NaN here)
  }
  uint32_t got = 0;
  const float first = out.data_ptr<float>()[0];
  std::memcpy(&got, &first, sizeof(got));
  int winner = -1;
  if (got == bits_a) {
    winner = 0;
  } else if (got == bits_b) {
    winner = 1;
  }
  // Every element of the body must agree, or the order is not one rule.
  for (int64_t i = 0; i < 64 && winner >= 0; ++i) {
    uint32_t bits = 0;
    const float v = out.data_ptr<float>()[i];
    std::memcpy(&bits, &v, sizeof(bits));
    if (bits != got) {
      winner = -1;
    }
  }
  cache->emplace(key, winner);
  return winner;
}

// ------------------------------------------------------------- registry

namespace {

struct Entry {
  enum class State { Queued, Built, Failed } state = State::Queued;
  FusedKernel kernel;
};

struct Registry {
  std::mutex mutex;
  std::condition_variable changed;
  std::unordered_map<std::string, Entry> entries;
  std::deque<std::pair<std::string, std::string>> queue; // (signature, source)
  int64_t building = 0;
  bool thread_started = false;
  bool stopped = false; // stopFusedKernelBuilds: no builder call starts again
  FusedKernelBuilder builder;
  std::vector<std::string> failures;
};

Registry*& registryPointer() {
  static Registry* registry = new Registry(); // leaked: the build thread outlives main
  return registry;
}

void resetInForkedChild() {
  // Single-threaded here: the old registry's mutex may be held by a thread
  // that no longer exists, so it is left behind (leaked) and copied.
  Registry* old = registryPointer();
  auto* fresh = new Registry();
  for (auto& [signature, entry] : old->entries) {
    if (entry.state != Entry::State::Queued) {
      fresh->entries.emplace(signature, entry);
    }
  }
  fresh->builder = old->builder;
  fresh->failures = old->failures;
  registryPointer() = fresh;
}

Registry& registry() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, resetInForkedChild);
    return true;
  }();
  (void)registered;
  return *registryPointer();
}

void buildLoop(Registry* r) {
  while (true) {
    std::pair<std::string, std::string> job;
    FusedKernelBuilder builder;
    {
      std::unique_lock<std::mutex> lock(r->mutex);
      r->changed.wait(lock, [&] { return !r->queue.empty() && !r->stopped; });
      job = std::move(r->queue.front());
      r->queue.pop_front();
      ++r->building;
      builder = r->builder;
    }
    Entry result;
    std::string failure;
    try {
      TORCH_CHECK(builder, "no fused kernel builder is registered (torch_kiln not imported?)");
      result.kernel = builder(job.first, job.second);
      TORCH_CHECK(result.kernel.fn != nullptr && result.kernel.vector_size > 0,
                  "the builder returned no kernel");
      result.state = Entry::State::Built;
    } catch (const std::exception& e) {
      result.state = Entry::State::Failed;
      failure = "kiln adaptive eager: building the fused kernel for '" + job.first +
          "' failed; that run of ops stays unfused: " + e.what();
    }
    std::lock_guard<std::mutex> lock(r->mutex);
    r->entries[job.first] = result;
    if (!failure.empty()) {
      r->failures.push_back(std::move(failure));
    }
    --r->building;
    r->changed.notify_all();
  }
}

std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_runs{0};

} // namespace

std::optional<FusedKernel> findFusedKernel(const SegmentPlan& plan) {
  Registry& r = registry();
  std::string signature = plan.signature();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.entries.find(signature);
  if (it != r.entries.end()) {
    if (it->second.state == Entry::State::Built) {
      return it->second.kernel;
    }
    return std::nullopt;
  }
  if (r.stopped) {
    return std::nullopt;
  }
  r.entries.emplace(signature, Entry{});
  r.queue.emplace_back(std::move(signature), plan.source());
  if (!r.thread_started) {
    r.thread_started = true;
    std::thread(buildLoop, &r).detach();
  }
  r.changed.notify_all();
  return std::nullopt;
}

void setFusedKernelBuilder(FusedKernelBuilder builder) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.builder = std::move(builder);
}

void stopFusedKernelBuilds() {
  Registry& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  r.stopped = true;
  for (const auto& job : r.queue) {
    r.entries.erase(job.first); // never built in this process
  }
  r.queue.clear();
  r.changed.notify_all();
  r.changed.wait(lock, [&] { return r.building == 0; });
}

bool fusedKernelsEnabled() {
  return g_enabled.load(std::memory_order_relaxed);
}

void setFusedKernelsEnabled(bool enabled) {
  g_enabled.store(enabled, std::memory_order_relaxed);
}

int64_t pendingFusedKernelBuilds() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int64_t>(r.queue.size()) + r.building;
}

bool waitForFusedKernelBuilds(double timeout_s) {
  Registry& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  return r.changed.wait_for(lock, std::chrono::duration<double>(timeout_s),
                            [&] { return r.queue.empty() && r.building == 0; });
}

std::vector<std::string> fusedKernelBuildFailures() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.failures;
}

int64_t builtFusedKernelCount() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  int64_t count = 0;
  for (const auto& [signature, entry] : r.entries) {
    count += entry.state == Entry::State::Built ? 1 : 0;
  }
  return count;
}

int64_t fusedKernelRuns() {
  return g_runs.load(std::memory_order_relaxed);
}

void recordFusedKernelRun() {
  g_runs.fetch_add(1, std::memory_order_relaxed);
}

} // namespace at::kiln

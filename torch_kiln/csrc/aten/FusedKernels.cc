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
// Two kinds of kernel. A plan's own kernel (SegmentPlan::source) is the
// fastest, but a plan's signature records where the group began and ended,
// and that depends on how far Python ran ahead: a chain of eight ops
// queued behind one another forms dozens of signatures, and building each
// (a compiler run of seconds, on one of this machine's two cores) cost more
// than fusing saved on small tensors. So every plan can also run on the
// interpreter (kInterpreterSource), one source for all plans and so one
// build per machine (cached on disk): it runs the plan's program
// (SegmentPlan::program) op by op over blocks that stay in L1, with the
// same Vectorized<float> expression per op, so the same bits. In the
// default mode (FusedKernelMode::Adaptive) a plan runs on the interpreter
// until it has run kHotPlanRuns times, then its own kernel is queued and
// used once built. Measured in bench/fusion.py (docs/performance.md).
//
// Nothing waits for a compiler. A group run whose kernel is not built
// queues the build its mode asks for and runs that segment as ATen
// kernels per tile; a thread started at the
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

// What every generated source starts with: the vector type, the NaN-winner
// blend and the vector size the kernel was built for.
constexpr const char* kSourcePrelude = R"(#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>
#include <algorithm>
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

)";

// The interpreter (Note [Generated kernels for fusion groups]): one source
// for every plan, so one build per machine. It runs the program op by op
// over blocks of kBlock elements small enough that a block of every buffer
// stays in L1 between ops; each op computes what the plan's own kernel
// computes for it (the same Vectorized<float> expressions), so the two give
// the same bits. The words per op are SegmentPlan::program()'s.
constexpr const char* kInterpreterSource = R"(
namespace {
constexpr int64_t kBlock = 512; // floats; a multiple of every 2 x vector size

// out[i] = f(a[i], b[i]) over one block, an operand a buffer or a scalar.
template <bool AScalar, bool BScalar, class F>
void binary_block(F f, const float* a, Vec a_value, const float* b, Vec b_value, float* out,
                  int64_t count) {
  for (int64_t i = 0; i < count; i += Vec::size()) {
    const Vec x = AScalar ? a_value : Vec::loadu(a + i);
    const Vec y = BScalar ? b_value : Vec::loadu(b + i);
    f(x, y).store(out + i);
  }
}

template <class F>
void binary(F f, const int32_t* op, float* const* buffers, const float* scalars, int64_t start,
            int64_t count) {
  float* out = buffers[op[6]] + start;
  const bool a_scalar = op[1] != 0, b_scalar = op[3] != 0;
  const float* a = a_scalar ? nullptr : buffers[op[2]] + start;
  const float* b = b_scalar ? nullptr : buffers[op[4]] + start;
  const Vec a_value(a_scalar ? scalars[op[2]] : 0.0f), b_value(b_scalar ? scalars[op[4]] : 0.0f);
  if (a_scalar) {
    binary_block<true, false>(f, a, a_value, b, b_value, out, count);
  } else if (b_scalar) {
    binary_block<false, true>(f, a, a_value, b, b_value, out, count);
  } else {
    binary_block<false, false>(f, a, a_value, b, b_value, out, count);
  }
}

template <class F>
void unary(F f, const int32_t* op, float* const* buffers, int64_t start, int64_t count) {
  const float* a = buffers[op[2]] + start;
  float* out = buffers[op[6]] + start;
  for (int64_t i = 0; i < count; i += Vec::size()) {
    f(Vec::loadu(a + i)).store(out + i);
  }
}
} // namespace

// Forms as FusedForm numbers them: Add, Mul, Div, Neg, ClampMin, Sigmoid.
extern "C" __attribute__((visibility("default"))) void kiln_fused_kernel(
    const int32_t* program, int64_t op_count, float* const* buffers, const float* scalars,
    int64_t n) {
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t count = std::min(kBlock, n - start);
    for (int64_t k = 0; k < op_count; ++k) {
      const int32_t* op = program + 8 * k;
      const bool b_wins = op[7] != 0;
      auto nan = [b_wins](Vec r, Vec a, Vec b) { return both_nan(r, a, b, b_wins ? b : a); };
      switch (op[0]) {
        case 0: {
          const Vec alpha(scalars[op[5]]);
          binary([&](Vec a, Vec b) { return nan(at::vec::fmadd(b, alpha, a), a, b); },
                 op, buffers, scalars, start, count);
          break;
        }
        case 1:
          binary([&](Vec a, Vec b) { return nan(a * b, a, b); }, op, buffers, scalars, start,
                 count);
          break;
        case 2:
          binary([&](Vec a, Vec b) { return nan(a / b, a, b); }, op, buffers, scalars, start,
                 count);
          break;
        case 3:
          unary([](Vec a) { return a.neg(); }, op, buffers, start, count);
          break;
        case 4:
          binary([](Vec a, Vec b) { return at::vec::clamp_min(a, b); }, op, buffers, scalars,
                 start, count);
          break;
        case 5:
          unary([](Vec a) { return (Vec(1.0f) + a.neg().exp()).reciprocal(); }, op, buffers,
                start, count);
          break;
      }
    }
  }
}
)";

// The registry's key for the interpreter (no plan's signature starts so).
constexpr const char* kInterpreterSignature = "interpreter v1";

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

static_assert(static_cast<int>(FusedForm::Add) == 0 && static_cast<int>(FusedForm::Mul) == 1 &&
                  static_cast<int>(FusedForm::Div) == 2 && static_cast<int>(FusedForm::Neg) == 3 &&
                  static_cast<int>(FusedForm::ClampMin) == 4 &&
                  static_cast<int>(FusedForm::Sigmoid) == 5,
              "kInterpreterSource numbers the forms so");
static_assert(kProgramWords == 8, "kInterpreterSource reads 8 words per op");

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

std::vector<int32_t> SegmentPlan::program() const {
  std::vector<int32_t> words;
  words.reserve(ops.size() * kProgramWords);
  for (const auto& op : ops) {
    const int32_t encoded[kProgramWords] = {
        static_cast<int32_t>(op.form), op.a.is_scalar, static_cast<int32_t>(op.a.index),
        op.b.is_scalar, static_cast<int32_t>(op.b.index), static_cast<int32_t>(op.alpha.index),
        static_cast<int32_t>(op.out), op.nan_winner};
    words.insert(words.end(), encoded, encoded + kProgramWords);
  }
  return words;
}

std::string SegmentPlan::source() const {
  std::string s;
  s += "// A kiln adaptive eager fusion kernel (Note [Generated kernels for fusion groups]).\n";
  s += "// " + signature() + "\n";
  s += kSourcePrelude;
  s += R"(extern "C" __attribute__((visibility("default"))) void kiln_fused_kernel(
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
  // Seen: runs counted, no build asked for yet (Adaptive mode, not hot).
  enum class State { Seen, Queued, Built, Failed } state = State::Seen;
  BuiltLibrary library;
  int64_t runs = 0; // findFusedKernel calls for the signature
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
  // The interpreter's entry, once built (read without the mutex).
  std::atomic<FusedInterpreterFn> interpreter{nullptr};
  std::atomic<int64_t> interpreter_vector_size{0};
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
    if (entry.state == Entry::State::Queued) {
      entry.state = Entry::State::Seen; // asked for again at its next run
    }
    fresh->entries.emplace(signature, entry);
  }
  fresh->interpreter.store(old->interpreter.load());
  fresh->interpreter_vector_size.store(old->interpreter_vector_size.load());
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
      result.library = builder(job.first, job.second);
      TORCH_CHECK(result.library.kernel != nullptr && result.library.vector_size > 0,
                  "the builder returned no kernel");
      result.state = Entry::State::Built;
    } catch (const std::exception& e) {
      result.state = Entry::State::Failed;
      failure = "kiln adaptive eager: building the fused kernel for '" + job.first +
          "' failed; that run of ops stays unfused: " + e.what();
    }
    std::lock_guard<std::mutex> lock(r->mutex);
    Entry& entry = r->entries[job.first];
    entry.state = result.state;
    entry.library = result.library;
    if (job.first == kInterpreterSignature && result.state == Entry::State::Built) {
      r->interpreter_vector_size.store(result.library.vector_size);
      r->interpreter.store(reinterpret_cast<FusedInterpreterFn>(result.library.kernel));
    }
    if (!failure.empty()) {
      r->failures.push_back(std::move(failure));
    }
    --r->building;
    r->changed.notify_all();
  }
}

std::atomic<FusedKernelMode> g_mode{FusedKernelMode::Adaptive};

// Queues the build of `signature` (r.mutex held; not after stopFusedKernelBuilds),
// first in the queue if `first`, and starts the build thread if need be.
void queueBuild(Registry& r, Entry& entry, std::string signature, std::string source,
                bool first) {
  entry.state = Entry::State::Queued;
  if (first) {
    r.queue.emplace_front(std::move(signature), std::move(source));
  } else {
    r.queue.emplace_back(std::move(signature), std::move(source));
  }
  if (!r.thread_started) {
    r.thread_started = true;
    std::thread(buildLoop, &r).detach();
  }
  r.changed.notify_all();
}
std::atomic<int64_t> g_runs{0};
std::atomic<int64_t> g_interpreted_runs{0};

} // namespace

std::optional<FusedKernel> findFusedKernel(const SegmentPlan& plan) {
  const FusedKernelMode mode = g_mode.load(std::memory_order_relaxed);
  if (mode == FusedKernelMode::Aten) {
    return std::nullopt;
  }
  Registry& r = registry();
  const bool own_kernel = mode != FusedKernelMode::Interpreted;
  const bool interpreter = mode != FusedKernelMode::Specialized;
  std::string signature = plan.signature();
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry& entry = r.entries[signature];
  if (own_kernel && entry.state == Entry::State::Built) {
    return FusedKernel{reinterpret_cast<FusedKernelFn>(entry.library.kernel), nullptr,
                       entry.library.vector_size};
  }
  ++entry.runs;
  if (r.stopped) {
    return std::nullopt;
  }
  const int64_t hot = mode == FusedKernelMode::Adaptive ? kHotPlanRuns : 1;
  if (own_kernel && entry.state == Entry::State::Seen && entry.runs >= hot) {
    queueBuild(r, entry, std::move(signature), plan.source(), /*first=*/false);
  }
  if (!interpreter) {
    return std::nullopt;
  }
  if (FusedInterpreterFn fn = r.interpreter.load()) {
    return FusedKernel{nullptr, fn, r.interpreter_vector_size.load()};
  }
  Entry& interpreter_entry = r.entries[kInterpreterSignature];
  if (interpreter_entry.state == Entry::State::Seen) {
    queueBuild(r, interpreter_entry, kInterpreterSignature,
               std::string(kSourcePrelude) + kInterpreterSource, /*first=*/true);
  }
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
    r.entries[job.first].state = Entry::State::Seen; // never built in this process
  }
  r.queue.clear();
  r.changed.notify_all();
  r.changed.wait(lock, [&] { return r.building == 0; });
}

FusedKernelMode fusedKernelMode() {
  return g_mode.load(std::memory_order_relaxed);
}

void setFusedKernelMode(FusedKernelMode mode) {
  g_mode.store(mode, std::memory_order_relaxed);
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
    count += entry.state == Entry::State::Built && signature != kInterpreterSignature ? 1 : 0;
  }
  return count;
}

bool fusedInterpreterBuilt() {
  return registry().interpreter.load() != nullptr;
}

int64_t fusedKernelRuns() {
  return g_runs.load(std::memory_order_relaxed);
}

int64_t interpretedFusedKernelRuns() {
  return g_interpreted_runs.load(std::memory_order_relaxed);
}

void recordFusedKernelRun(const FusedKernel& kernel) {
  g_runs.fetch_add(1, std::memory_order_relaxed);
  if (kernel.interpret != nullptr) {
    g_interpreted_runs.fetch_add(1, std::memory_order_relaxed);
  }
}

} // namespace at::kiln

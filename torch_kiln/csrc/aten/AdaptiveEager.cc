#include "aten/AdaptiveEager.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include "aten/ArgumentTensors.h"
#include "aten/FusedKernels.h"
#include "aten/KernelLaunch.h"
#include "aten/KilnTask.h"
#include "core/FailedResults.h"
#include "core/KilnException.h"
#include "core/KilnGraph.h"

namespace at::kiln {

// Note [Adaptive eager fusion]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Issue 16's adaptive eager, first increment (KILN_ADAPTIVE_EAGER=1; off by
// default). While Python runs ahead of a stream's worker, consecutive
// elementwise float32 ops on that stream are gathered into one *fusion group*,
// a single task on the stream (the one launch mechanism, KilnTask.h), which
// runs them tile by tile so each tile's intermediates are still in cache when
// the next op reads them.
//
// Forming a group (calling thread, enqueueFusible). Each thread keeps, per
// stream, the group it launched last and the stream's submitted count
// (kilnStreamGetSubmittedCount) that group's entry got. A fusible op joins that
// group if, under the group's mutex, the worker has not started it and the
// stream's count still equals the group's: nothing at all was enqueued on the
// stream after the group, by any thread or path — no event record, no wait
// on another stream's event, no copy (host reads and .item() are copies), no
// graph launch, no other kernel. Anything else starts a new group. A
// synchronization (stream, device, event, a host read, a data-dependent op,
// which runs synchronously) waits for the group to run, and the worker marks a
// group started before it runs it, so no op ever joins a group across one.
// record_stream enqueues nothing on the stream, so it closes the calling
// thread's groups explicitly (closeFusionGroups): an op issued after it never
// joins work issued before it. No fusion while a
// graph is being captured or with KILN_LAUNCH_BLOCKING=1, and an op reading a
// storage marked as holding a failed result launches unfused (KernelLaunch
// passes the mark on at the call).
//
// What may join (the whitelist, by full ATen name): add.out, sub.out (any
// alpha), mul.out, div.out (true division), neg.out, relu and relu_ (run as
// clamp_min(self, 0), which is what ATen's CPU relu calls), exp.out, tanh.out,
// sigmoid.out, gelu.out (on at most one tile, kTileElements). In-place forms reach kiln as the .out op with
// out=self. Every kiln tensor of the group is float32, contiguous, of the
// group's sizes (no broadcasting), with no conj/neg bit; other tensor
// arguments are 0-dim CPU scalars (Python numbers, snapshot at the call).
// Every pair of tensors of a group is either the same memory (same first
// element: in-place ops, one op reading another's output) or disjoint, so
// element i of every op depends only on element i of earlier ops and running
// the group tile by tile gives each element the same sequence of operations
// as running the ops one after another. Every op's output is written (Python
// may hold any of them).
//
// Why results are bit-identical. The fused run calls, for each tile, the
// same ATen CPU kernel the op runs unfused (a boxed redispatch to CPU, as
// KernelLaunch::run does), over 1-D host views of the tile; TensorIterator
// coalesces the unfused op's contiguous tensors to 1-D too. ATen's
// elementwise loops are not position-independent: elements in a loop's
// scalar tail may round differently from the vectorised body (gelu; the NaN
// payload of NaN*NaN), and each thread of the op's parallel_for has its own
// tail. So the fused run splits the elements exactly as TensorIterator does
// (at::parallel_for(0, numel, GRAIN_SIZE) at the issuing thread's intra-op
// thread count) and cuts each thread's range into tiles of kTileElements, a
// multiple of every vector width's unroll (2 × 16 floats), measured from
// the range's start: every tile but the range's last is wholly vectorised,
// and the last has the same tail as the unfused loop. tests/
// test_adaptive_eager.py checks every whitelisted op over NaN, -NaN, NaN
// payloads, ±inf, ±0.0, denormals and extremes, in sizes that exercise the
// tail, several tiles and several threads.
//
// Generated kernels. Runs of ops with a generated form (add, sub, mul, div,
// neg, relu, sigmoid) run as one kernel over each tile's vector body once it
// is built; the rest, and the tails, as ATen's kernels (Note [Generated
// kernels for fusion groups] in FusedKernels.cc, which also says why it is
// not Inductor's generator).
//
// Errors. An op that fails inside a fused run makes the group's task fail
// with "kiln::fused_elementwise: <op> (op k of n of a fused run of <ops>):
// inputs (...): <message>", keeping the exception's class (Note [Kernel
// errors keep their type]); the outputs of every op of the group are marked
// as holding no valid result (the ops before it may have run for some tiles
// only). A group skipped after an earlier failure on its stream marks its
// outputs as skipped kernels do (Note [Results of failed kernels]). A group
// that runs sets and ends its operands' marks op by op, as the unfused
// kernels would (Note [Failed-result marks in a fused run]).
//
// Profiler: the group's activity record is named "kiln::fused(aten::add,
// aten::mul, ...)" (kilnTaskSetActivityName; the ops' kernel names, as
// unfused kernels are named), a group of one op by that op's kernel name.
// torch.kiln.get_fused_ops() counts the runs of each fused sequence.

namespace {

using c10::kiln::KilnStream;

constexpr int64_t kTileElements = 16384; // 64 KiB of float32; a multiple of 32
constexpr size_t kMaxGroupOps = 32;
constexpr const char* kTaskName = "kiln::fused_elementwise";

// ------------------------------------------------------------- the switch

// -1: not read yet; else 0 or 1. KILN_ADAPTIVE_EAGER sets it at the first
// call; setAdaptiveEager (tests) at any time.
std::atomic<int> g_adaptive{-1};

int readSwitch() {
  const char* text = std::getenv("KILN_ADAPTIVE_EAGER");
  const std::string_view v = text == nullptr ? std::string_view() : std::string_view(text);
  TORCH_CHECK_VALUE(v.empty() || v == "0" || v == "1", "KILN_ADAPTIVE_EAGER='", v,
                    "' is invalid: expected 0 (off, the default) or 1 (fuse queued elementwise "
                    "ops, Note [Adaptive eager fusion])");
  return v == "1" ? 1 : 0;
}

// ------------------------------------------------------------- whitelist

// How one whitelisted op runs per tile.
struct FusibleSpec {
  bool fusible = false;
  std::string name;                          // the op's full ATen name ("aten::add.out")
  std::string kernel_name;                   // its kernels' profiler name ("aten::add")
  std::optional<c10::OperatorHandle> runs;   // what runs per tile (the op itself unless set)
  int out_arg = -1;                          // the written argument, or -1: a fresh return
  bool prepend_zero = false;                 // relu: clamp_min(self, 0)
  // Its form in a generated kernel (Note [Generated kernels for fusion
  // groups]), or none: it always runs as its ATen kernel per tile.
  std::optional<FusedForm> form;
  bool negate_alpha = false;                 // sub: ATen runs add with -alpha
};

FusibleSpec makeSpec(const c10::OperatorHandle& op, const OpSchemaInfo& info) {
  FusibleSpec spec;
  spec.name = opName(info);
  spec.kernel_name = info.schema->name(); // as KernelLaunch names an unfused kernel
  static const char* const kOutOps[] = {"aten::add.out",  "aten::sub.out",  "aten::mul.out",
                                        "aten::div.out",  "aten::neg.out",  "aten::exp.out",
                                        "aten::tanh.out", "aten::sigmoid.out", "aten::gelu.out"};
  for (const char* name : kOutOps) {
    if (spec.name == name) {
      for (size_t i = 0; i < info.arg_is_out.size(); ++i) {
        if (info.arg_is_out[i]) {
          spec.out_arg = static_cast<int>(i);
        }
      }
      spec.fusible = spec.out_arg >= 0 && info.returns.size() == 1;
      spec.runs = op;
      if (spec.name == "aten::add.out" || spec.name == "aten::sub.out") {
        spec.form = FusedForm::Add;
        spec.negate_alpha = spec.name == "aten::sub.out";
      } else if (spec.name == "aten::mul.out") {
        spec.form = FusedForm::Mul;
      } else if (spec.name == "aten::div.out") {
        spec.form = FusedForm::Div;
      } else if (spec.name == "aten::neg.out") {
        spec.form = FusedForm::Neg;
      } else if (spec.name == "aten::sigmoid.out") {
        spec.form = FusedForm::Sigmoid;
      } // exp, tanh: MKL's VML (not Sleef) computes them in ATen; gelu: its own split
      return spec;
    }
  }
  if (spec.name == "aten::relu" || spec.name == "aten::relu_") {
    spec.runs = c10::Dispatcher::singleton().findSchemaOrThrow("aten::clamp_min", "out");
    spec.prepend_zero = true;
    spec.out_arg = spec.name == "aten::relu_" ? 0 : -1;
    spec.fusible = true;
    spec.form = FusedForm::ClampMin;
  }
  return spec;
}

const FusibleSpec& specOf(const c10::OperatorHandle& op, const OpSchemaInfo& info) {
  static std::mutex mutex;
  static auto* specs = new std::unordered_map<const OpSchemaInfo*, FusibleSpec>(); // leaked
  std::lock_guard<std::mutex> lock(mutex);
  auto it = specs->find(&info);
  if (it == specs->end()) {
    it = specs->emplace(&info, makeSpec(op, info)).first;
  }
  return it->second; // node-based map: stable
}

// ------------------------------------------------------------- groups

// A distinct kiln buffer of a group (the memory of one or more tensors).
struct Operand {
  float* data = nullptr;          // the tensor's first element
  const void* storage = nullptr;  // its storage's first byte (failed-result marks)
};

struct FusedOp {
  const FusibleSpec* spec = nullptr;
  std::vector<c10::IValue> args;  // the per-tile stack; kiln tensor slots hold None
  c10::SmallVector<std::pair<uint32_t, uint32_t>, 3> tensor_args; // (stack slot, operand)
  c10::SmallVector<uint32_t, 2> reads;  // operands read
  uint32_t written = 0;                 // the operand written (an out= argument per tile)
  // The op writes all of `written`'s storage without reading it (out= or a
  // fresh output; not relu_): once it has run, the storage's failed-result
  // mark ends, as KernelLaunch::clearOverwrittenFailedResults does unfused.
  bool ends_mark = false;
  std::string inputs;                   // "inputs (Float[4], Double[])", for errors
};

struct FusionGroup {
  std::mutex mutex;
  bool started = false;                 // guarded by mutex; the worker sets it
  std::vector<int64_t> sizes;
  int64_t numel = 0;
  int threads = 1;                      // the issuing thread's intra-op threads (all ops')
  std::vector<Operand> operands;
  std::vector<FusedOp> ops;             // appended under mutex while !started
};

// The group each thread launched last on each stream (see the Note).
struct OpenGroup {
  kilnStream_t stream = nullptr;
  std::shared_ptr<FusionGroup> group;
  unsigned long long seq = 0;
};
thread_local c10::SmallVector<OpenGroup, 4> open_groups;

OpenGroup& openGroupOf(kilnStream_t stream) {
  for (auto& open : open_groups) {
    if (open.stream == stream) {
      return open;
    }
  }
  open_groups.emplace_back();
  open_groups.back().stream = stream;
  return open_groups.back();
}

unsigned long long submittedCount(kilnStream_t stream) {
  unsigned long long count = 0;
  KILN_CHECK(kilnStreamGetSubmittedCount(stream, &count));
  return count;
}

bool launchBlocking() {
  static const bool blocking = [] {
    int value = 0;
    return kilnGetLaunchBlocking(&value) == kilnSuccess && value != 0;
  }();
  return blocking;
}

// Whether `op` reads a storage marked as holding a failed result: such an op
// launches unfused, so KernelLaunch passes the mark on at the call (Note
// [Results of failed kernels]).
bool readsFailedResult(const FusedOp& op, const std::vector<Operand>& operands) {
  if (!c10::kiln::anyFailedResults()) {
    return false;
  }
  for (uint32_t r : op.reads) {
    if (c10::kiln::failedResultReason(operands[r].storage)) {
      return true;
    }
  }
  return false;
}

// The op as a FusedOp over `group`'s operands (added as needed), or nullopt
// if it does not qualify. Operands are added only on success.
std::optional<FusedOp> describeOp(const FusibleSpec& spec, const OpSchemaInfo& info,
                                  c10::ArrayRef<c10::IValue> args, c10::ArrayRef<at::Tensor> fresh,
                                  c10::IntArrayRef sizes, std::vector<Operand>& operands,
                                  c10::Device device) {
  const size_t first_new = operands.size();
  auto fail = [&]() -> std::optional<FusedOp> {
    operands.resize(first_new);
    return std::nullopt;
  };
  const int64_t nbytes = c10::multiply_integers(sizes) * static_cast<int64_t>(sizeof(float));
  // The operand index of kiln tensor `t`, or -1 if it does not qualify.
  auto operandOf = [&](const at::Tensor& t) -> int {
    if (t.device() != device || t.scalar_type() != at::kFloat || !t.sizes().equals(sizes) ||
        !t.is_contiguous() || t.is_neg() || t.is_conj()) {
      return -1;
    }
    auto* data = static_cast<float*>(t.storage().unsafeGetStorageImpl()->mutable_data()) +
        t.storage_offset();
    for (size_t k = 0; k < operands.size(); ++k) {
      const auto distance = reinterpret_cast<const char*>(data) -
          reinterpret_cast<const char*>(operands[k].data);
      if (distance == 0) {
        return static_cast<int>(k);
      }
      if (distance > -nbytes && distance < nbytes) {
        return -1; // partial overlap: element i would depend on another element
      }
    }
    operands.push_back(Operand{data, t.storage().data()});
    return static_cast<int>(operands.size() - 1);
  };

  FusedOp fused;
  fused.spec = &spec;
  std::string inputs;
  if (spec.prepend_zero) {
    // relu(self) / relu_(self) -> clamp_min.out(self, 0, out)
    if (args.size() != 1 || !args[0].isTensor()) {
      return fail();
    }
    const int self = operandOf(args[0].toTensor());
    if (self < 0) {
      return fail();
    }
    int out = self;
    if (spec.out_arg < 0) {
      if (fresh.size() != 1 || (out = operandOf(fresh[0])) < 0) {
        return fail();
      }
      fused.ends_mark = true; // a fresh output (relu_ reads what it writes)
    }
    fused.args = {c10::IValue(), c10::IValue(c10::Scalar(int64_t{0})), c10::IValue()};
    fused.tensor_args = {{0u, static_cast<uint32_t>(self)}, {2u, static_cast<uint32_t>(out)}};
    fused.reads = {static_cast<uint32_t>(self)};
    fused.written = static_cast<uint32_t>(out);
    appendInputDescription(inputs, at::kFloat, sizes);
    fused.inputs = finishInputDescription(std::move(inputs));
    return readsFailedResult(fused, operands) ? fail() : std::optional<FusedOp>(std::move(fused));
  }
  if (!fresh.empty()) {
    return fail();
  }
  fused.args.assign(args.begin(), args.end());
  for (size_t i = 0; i < args.size(); ++i) {
    const ArgKind kind = info.arg_kinds[i];
    if (kind == ArgKind::Other) {
      continue;
    }
    if (kind != ArgKind::Tensor || !args[i].isTensor()) {
      return fail();
    }
    const at::Tensor& t = args[i].toTensor();
    if (!t.defined()) {
      return fail();
    }
    if (t.device().is_cpu()) {
      // A 0-dim host scalar (the executor snapshot it); never written.
      if (t.dim() != 0 || static_cast<int>(i) == spec.out_arg) {
        return fail();
      }
      appendInputDescription(inputs, t.scalar_type(), t.sizes());
      continue;
    }
    const int operand = operandOf(t);
    if (operand < 0) {
      return fail();
    }
    fused.args[i] = c10::IValue();
    fused.tensor_args.emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(operand));
    if (static_cast<int>(i) == spec.out_arg) {
      fused.written = static_cast<uint32_t>(operand);
      // As unfused (TensorDescriptor::coversStorage): an out= argument ends
      // the mark only if it is all of its (contiguous) storage.
      fused.ends_mark = t.storage_offset() == 0 &&
          t.storage().nbytes() == static_cast<size_t>(nbytes);
    } else {
      fused.reads.push_back(static_cast<uint32_t>(operand));
      appendInputDescription(inputs, at::kFloat, sizes);
    }
  }
  fused.inputs = finishInputDescription(std::move(inputs));
  return readsFailedResult(fused, operands) ? fail() : std::optional<FusedOp>(std::move(fused));
}

// ------------------------------------------------------------- tracking

struct FusedCounts {
  std::mutex mutex;
  std::unordered_map<std::string, int64_t> counts;
  std::string fail_op; // failNextFusedOp
  std::atomic<bool> fail_armed{false};
};

FusedCounts& fusedCounts() {
  static auto* instance = new FusedCounts(); // leaked: workers may count at exit
  return *instance;
}

// Whether the armed test failure is for `name` (disarming it).
bool takeInjectedFailure(const std::string& name) {
  auto& c = fusedCounts();
  if (!c.fail_armed.load(std::memory_order_relaxed)) {
    return false;
  }
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.fail_op != name) {
    return false;
  }
  c.fail_op.clear();
  c.fail_armed.store(false, std::memory_order_relaxed);
  return true;
}

// ------------------------------------------------------------- running

// A 1-D host view of `count` floats of `operand` from element `start`.
at::Tensor tileOf(const Operand& operand, int64_t start, int64_t count) {
  return at::from_blob(operand.data + start, {count}, at::TensorOptions().dtype(at::kFloat));
}

void runTile(const FusionGroup& group, const FusedOp& op, int64_t start, int64_t count) {
  torch::jit::Stack stack(op.args.begin(), op.args.end());
  for (const auto& [slot, operand] : op.tensor_args) {
    stack[slot] = tileOf(group.operands[operand], start, count);
  }
  op.spec->runs->redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
}

// ------------------------------------------------------------- segments

// A run of consecutive ops of a group that executes one way: one generated
// kernel over its vectorised body (Note [Generated kernels for fusion
// groups]), or each op's ATen kernel per tile (`kernel` empty).
struct Segment {
  size_t first = 0, last = 0;          // ops [first, last)
  std::optional<FusedKernel> kernel;
  std::vector<uint32_t> buffers;       // the kernel's buffer k: group operand buffers[k]
  std::vector<float> scalars;          // the kernel's scalar slots, this run's values
  std::vector<int32_t> program;        // for the interpreter (kernel->interpret)
};

// A host scalar argument as ATen's kernel sees it: converted to float (the
// TensorIterator casts a CPU scalar to the common dtype), or nullopt.
std::optional<float> hostScalarValue(const c10::IValue& value) {
  if (value.isScalar()) {
    const c10::Scalar scalar = value.toScalar();
    if (scalar.isFloatingPoint()) {
      const double v = scalar.toDouble();
      // Outside float's range Scalar::to<float> raises: leave it to ATen.
      if (!std::isfinite(v) || std::abs(v) > std::numeric_limits<float>::max()) {
        return std::nullopt;
      }
      return static_cast<float>(v);
    }
    if (scalar.isIntegral(/*includeBool=*/false)) {
      return static_cast<float>(scalar.toLong());
    }
    return std::nullopt;
  }
  if (!value.isTensor()) {
    return std::nullopt;
  }
  const at::Tensor& t = value.toTensor();
  if (!t.defined() || !t.device().is_cpu() || t.dim() != 0) {
    return std::nullopt;
  }
  switch (t.scalar_type()) {
    case at::kFloat: return *t.const_data_ptr<float>();
    case at::kDouble: return static_cast<float>(*t.const_data_ptr<double>());
    case at::kLong: return static_cast<float>(*t.const_data_ptr<int64_t>());
    case at::kInt: return static_cast<float>(*t.const_data_ptr<int32_t>());
    default: return std::nullopt;
  }
}

// Adds op `fused` to `plan` (its buffers and scalars to `segment`), or
// returns false (nothing added) if it has no generated form this time.
bool planOp(const FusedOp& fused, const FusionGroup& group, SegmentPlan& plan, Segment& segment) {
  const FusibleSpec& spec = *fused.spec;
  if (!spec.form.has_value()) {
    return false;
  }
  const FusedForm form = *spec.form;
  const size_t buffers_before = segment.buffers.size(), scalars_before = segment.scalars.size();
  auto fail = [&] {
    segment.buffers.resize(buffers_before);
    segment.scalars.resize(scalars_before);
    return false;
  };
  auto bufferOf = [&](uint32_t operand) {
    for (size_t k = 0; k < segment.buffers.size(); ++k) {
      if (segment.buffers[k] == operand) {
        return static_cast<uint32_t>(k);
      }
    }
    segment.buffers.push_back(operand);
    return static_cast<uint32_t>(segment.buffers.size() - 1);
  };
  auto scalarSlot = [&](float value) {
    segment.scalars.push_back(value);
    return FusedValue{true, static_cast<uint32_t>(segment.scalars.size() - 1)};
  };
  // Stack slot `slot` as a value: a buffer, a host scalar, or nullopt.
  auto valueAt = [&](uint32_t slot) -> std::optional<FusedValue> {
    for (const auto& [s, operand] : fused.tensor_args) {
      if (s == slot) {
        return FusedValue{false, bufferOf(operand)};
      }
    }
    if (slot >= fused.args.size()) {
      return std::nullopt;
    }
    const auto value = hostScalarValue(fused.args[slot]);
    if (!value.has_value()) {
      return std::nullopt;
    }
    return scalarSlot(*value);
  };
  GeneratedOp op;
  op.form = form;
  const bool binary = form == FusedForm::Add || form == FusedForm::Mul ||
      form == FusedForm::Div || form == FusedForm::ClampMin;
  auto a = valueAt(0);
  std::optional<FusedValue> b;
  if (binary) {
    b = valueAt(1);
  }
  if (!a.has_value() || (binary && !b.has_value()) || (a->is_scalar && (!b || b->is_scalar))) {
    return fail();
  }
  op.a = *a;
  if (binary) {
    op.b = *b;
  }
  if (form == FusedForm::Add) {
    if (fused.args.size() < 3) {
      return fail();
    }
    // sub runs ATen's add kernel with -alpha negated as a Scalar, before any
    // conversion to float: an integer alpha stays an integer (-0 is +0.0f,
    // and -INT64_MIN wraps to INT64_MIN), so negate the same way here.
    c10::IValue alpha_arg = fused.args[2];
    if (spec.negate_alpha) {
      if (!alpha_arg.isScalar()) {
        return fail();
      }
      const c10::Scalar given = alpha_arg.toScalar();
      if (!given.isFloatingPoint() && !given.isIntegral(/*includeBool=*/false)) {
        return fail();
      }
      alpha_arg = c10::IValue(-given);
    }
    auto alpha = hostScalarValue(alpha_arg);
    if (!alpha.has_value()) {
      return fail();
    }
    op.alpha = scalarSlot(*alpha);
  }
  if (binary && form != FusedForm::ClampMin) {
    op.nan_winner = nanWinnerOf(form, op.a.is_scalar, op.b.is_scalar);
    if (op.nan_winner < 0) {
      return fail();
    }
  }
  op.out = bufferOf(fused.written);
  plan.ops.push_back(op);
  return true;
}

// The group's ops cut into segments; with generated kernels off, or ops to
// skip or fail, one ATen segment per op.
std::vector<Segment> planSegments(const FusionGroup& group, bool generate) {
  std::vector<Segment> segments;
  const auto& ops = group.ops;
  for (size_t k = 0; k < ops.size();) {
    Segment segment;
    segment.first = k;
    SegmentPlan plan;
    while (generate && k < ops.size() && planOp(ops[k], group, plan, segment)) {
      ++k;
    }
    if (!plan.ops.empty()) {
      plan.buffer_count = static_cast<uint32_t>(segment.buffers.size());
      plan.scalar_count = static_cast<uint32_t>(segment.scalars.size());
      segment.kernel = findFusedKernel(plan);
      if (segment.kernel.has_value() && segment.kernel->interpret != nullptr) {
        segment.program = plan.program();
      }
    } else {
      ++k; // an op with no generated form: on its own, as its ATen kernel
    }
    segment.last = k;
    segments.push_back(std::move(segment));
  }
  return segments;
}

struct FusionGroupTask final : TaskBody {
  explicit FusionGroupTask(std::shared_ptr<FusionGroup> g) : group(std::move(g)) {}

  // The group's ops by name: "aten::add.out, aten::mul.out".
  std::string sequence() const {
    std::string text;
    for (const auto& op : group->ops) {
      text += (text.empty() ? "" : ", ") + op.spec->name;
    }
    return text;
  }

  void run() override {
    {
      std::lock_guard<std::mutex> lock(group->mutex);
      group->started = true;
    }
    const auto& ops = group->ops;
    const std::string seq = sequence();
    if (ops.size() == 1) {
      kilnTaskSetActivityName(ops[0].spec->kernel_name.c_str());
    } else {
      std::string label = "kiln::fused(";
      for (size_t k = 0; k < ops.size(); ++k) {
        label += (k ? ", " : "") + ops[k].spec->kernel_name;
      }
      kilnTaskSetActivityName((label + ")").c_str());
      auto& c = fusedCounts();
      std::lock_guard<std::mutex> lock(c.mutex);
      c.counts[seq]++;
    }

    // Failed-result marks, op by op, as the unfused kernels would leave them
    // (see Note [Failed-result marks in a fused run] below).
    std::vector<char> skip(ops.size(), 0);
    std::vector<const void*> ended; // marks to end once every op has run
    if (c10::kiln::anyFailedResults()) {
      ended = settleFailedResults(skip);
    }
    std::vector<char> inject(ops.size(), 0);
    if (C10_UNLIKELY(fusedCounts().fail_armed.load(std::memory_order_relaxed))) {
      for (size_t k = 0; k < ops.size(); ++k) {
        inject[k] = takeInjectedFailure(ops[k].spec->name) ? 1 : 0;
      }
    }

    const bool generate = fusedKernelMode() != FusedKernelMode::Aten &&
        std::find(skip.begin(), skip.end(), 1) == skip.end() &&
        std::find(inject.begin(), inject.end(), 1) == inject.end();
    const std::vector<Segment> segments = planSegments(*group, generate);
    for (const Segment& segment : segments) {
      if (segment.kernel.has_value()) {
        recordFusedKernelRun(*segment.kernel);
      }
    }

    std::atomic<int64_t> failed_op{-1};
    try {
      at::parallel_for(0, group->numel, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        size_t k = 0;
        c10::SmallVector<float*, 16> pointers;
        try {
          for (int64_t start = begin; start < end; start += kTileElements) {
            const int64_t count = std::min(kTileElements, end - start);
            for (const Segment& segment : segments) {
              int64_t body = 0; // elements the generated kernel computes
              if (segment.kernel.has_value()) {
                // ATen's loop runs the last (range mod 2 x vector) elements
                // of the range scalar: those stay with the ATen kernels.
                const int64_t step = 2 * segment.kernel->vector_size;
                body = start + count == end ? count / step * step : count;
                if (body > 0) {
                  pointers.clear();
                  for (uint32_t operand : segment.buffers) {
                    pointers.push_back(group->operands[operand].data + start);
                  }
                  if (segment.kernel->fn != nullptr) {
                    segment.kernel->fn(pointers.data(), segment.scalars.data(), body);
                  } else {
                    segment.kernel->interpret(
                        segment.program.data(),
                        static_cast<int64_t>(segment.program.size()) / kProgramWords,
                        pointers.data(), segment.scalars.data(), body);
                  }
                }
              }
              if (body == count) {
                continue;
              }
              for (k = segment.first; k < segment.last; ++k) {
                if (skip[k]) {
                  continue;
                }
                TORCH_CHECK(!inject[k], "injected failure (torch.kiln._fusion_fail_op)");
                runTile(*group, ops[k], start + body, count - body);
              }
            }
          }
        } catch (...) {
          int64_t expected = -1;
          failed_op.compare_exchange_strong(expected, static_cast<int64_t>(k));
          throw;
        }
      });
    } catch (const std::exception& e) {
      failed = failed_op.load();
      if (failed < 0) {
        failed = 0;
      }
      const std::string reason =
          describe() + ": " + c10::kiln::kernelErrorMessageOf(e);
      for (const void* storage : ended) {
        c10::kiln::clearFailedResult(storage); // the group's failure replaces them
      }
      for (const auto& op : ops) {
        c10::kiln::markFailedResult(group->operands[op.written].storage,
                                    std::string(kTaskName) + ": " + reason);
      }
      lastKernelFailureOnThread() = std::string(kTaskName) + ": " + reason;
      throw;
    }
    for (const void* storage : ended) {
      c10::kiln::clearFailedResult(storage);
    }
  }

  // Note [Failed-result marks in a fused run]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Unfused, each kernel, when it runs, first passes a mark on its inputs to
  // what it writes and does not compute, else computes and then ends the mark
  // of every storage it wrote whole without reading it (Note [Results of
  // failed kernels]). A group is one task, so it replays that per op, in
  // order, over the marks as they are when the group starts: marks set since
  // the launch by another stream (ordered before the group by an event), and
  // marks an earlier task on this stream set on memory the allocator had
  // meanwhile handed to a tensor of the group (a kernel that read a failed
  // result marks its output when it runs, after its block was freed and
  // reused). An op that ends a mark thus lets a later op of the group read
  // that storage, as the unfused kernel after it would; an op skipped marks
  // its output, so the ops reading it are skipped too. Marks to set are set
  // now (those ops do not run); marks to end are returned and ended once
  // every op has run (on failure the group's outputs are marked instead).
  // Marks are per storage (the registry's key), so this works per storage.
  std::vector<const void*> settleFailedResults(std::vector<char>& skip) const {
    const auto& operands = group->operands;
    std::vector<const void*> storages;                     // distinct, in first-use order
    std::vector<std::optional<std::string>> before, marks; // per storage
    std::vector<size_t> storage_of(operands.size());
    for (size_t i = 0; i < operands.size(); ++i) {
      const auto found = std::find(storages.begin(), storages.end(), operands[i].storage);
      storage_of[i] = static_cast<size_t>(found - storages.begin());
      if (found == storages.end()) {
        storages.push_back(operands[i].storage);
        before.push_back(c10::kiln::failedResultReason(operands[i].storage));
      }
    }
    marks = before;
    for (size_t k = 0; k < group->ops.size(); ++k) {
      const FusedOp& op = group->ops[k];
      auto& written = marks[storage_of[op.written]];
      for (uint32_t r : op.reads) {
        if (const auto& reason = marks[storage_of[r]]) {
          skip[k] = 1;
          if (!written) {
            written = *reason; // the first (root) reason wins, as markFailedResult keeps it
          }
          break;
        }
      }
      if (!skip[k] && op.ends_mark) {
        written.reset();
      }
    }
    std::vector<const void*> ended;
    for (size_t s = 0; s < storages.size(); ++s) {
      if (marks[s] == before[s]) {
        continue;
      }
      if (marks[s]) {
        c10::kiln::clearFailedResult(storages[s]); // a mark ended, then set again
        c10::kiln::markFailedResult(storages[s], *marks[s]);
      } else {
        ended.push_back(storages[s]);
      }
    }
    return ended;
  }

  std::string describe() const override {
    if (failed < 0) {
      return sequence();
    }
    const auto& ops = group->ops;
    const FusedOp& op = ops[static_cast<size_t>(failed)];
    return op.spec->name + " (op " + std::to_string(failed + 1) + " of " +
        std::to_string(ops.size()) + " of a fused run of " + sequence() + "): " + op.inputs;
  }

  void skipped() override {
    const std::string& cause = lastKernelFailureOnThread();
    for (const auto& op : group->ops) {
      c10::kiln::markFailedResult(
          group->operands[op.written].storage,
          op.spec->name + " was skipped after an earlier kernel on its stream failed" +
              (cause.empty() ? std::string() : ": " + cause));
    }
  }

  std::shared_ptr<FusionGroup> group;
  int64_t failed = -1;
};

} // namespace

bool adaptiveEagerEnabled() {
  int state = g_adaptive.load(std::memory_order_relaxed);
  if (C10_UNLIKELY(state < 0)) {
    state = readSwitch(); // raises for an invalid value, at every call
    int expected = -1;
    g_adaptive.compare_exchange_strong(expected, state);
    state = g_adaptive.load(std::memory_order_relaxed);
  }
  return state == 1;
}

void setAdaptiveEager(bool enabled) {
  g_adaptive.store(enabled ? 1 : 0, std::memory_order_relaxed);
}

bool mayFuse(const c10::OperatorHandle& op, const OpSchemaInfo& info) {
  return specOf(op, info).fusible;
}

bool enqueueFusible(const c10::OperatorHandle& op, const OpSchemaInfo& info,
                    c10::ArrayRef<c10::IValue> args, c10::ArrayRef<at::Tensor> fresh,
                    const KilnStream& stream) {
  const FusibleSpec& spec = specOf(op, info);
  if (!spec.fusible || launchBlocking()) {
    return false;
  }
  if (C10_UNLIKELY(c10::kiln::anyCaptureUnderway())) {
    // Captured work is not enqueued (the stream's count does not move), so
    // a group from before the capture is closed here instead.
    closeFusionGroups();
    return false;
  }
  // The group's shape: the written tensor's sizes.
  const at::Tensor* written = nullptr;
  if (spec.out_arg >= 0 && static_cast<size_t>(spec.out_arg) < args.size() &&
      args[spec.out_arg].isTensor()) {
    written = &args[spec.out_arg].toTensor();
  } else if (spec.out_arg < 0 && fresh.size() == 1) {
    written = &fresh[0];
  }
  if (written == nullptr || !written->defined() || written->numel() == 0 ||
      !written->device().is_privateuseone()) {
    return false;
  }
  if (spec.name == "aten::gelu.out" && written->numel() > kTileElements) {
    // ATen's gelu splits its range itself (numel / threads above 16384
    // elements) and runs a lone trailing element otherwise than at the end
    // of a longer loop, so only a group of one tile (where the fused run's
    // one range is gelu's own) is bit-identical.
    return false;
  }
  const c10::Device device = written->device();
  const kilnStream_t handle = stream.stream();
  OpenGroup& open = openGroupOf(handle);

  if (open.group != nullptr) {
    FusionGroup& group = *open.group;
    if (group.ops.size() < kMaxGroupOps && written->sizes().equals(group.sizes) &&
        group.threads == issuingThreadCount()) {
      std::lock_guard<std::mutex> lock(group.mutex);
      if (!group.started && submittedCount(handle) == open.seq) {
        auto fused = describeOp(spec, info, args, fresh, group.sizes, group.operands, device);
        if (fused.has_value()) {
          group.ops.push_back(std::move(*fused));
          return true;
        }
      }
    }
    open.group.reset();
  }

  auto group = std::make_shared<FusionGroup>();
  group->sizes.assign(written->sizes().begin(), written->sizes().end());
  group->numel = written->numel();
  group->threads = issuingThreadCount();
  auto fused = describeOp(spec, info, args, fresh, group->sizes, group->operands, device);
  if (!fused.has_value()) {
    return false;
  }
  group->ops.push_back(std::move(*fused));
  const unsigned long long before = submittedCount(handle);
  launchTaskBody(stream, kTaskName, std::make_unique<FusionGroupTask>(group));
  const unsigned long long after = submittedCount(handle);
  if (after == before + 1) {
    // Only this launch was enqueued in between: the group's entry is `after`.
    open.group = std::move(group);
    open.seq = after;
  }
  return true;
}

void closeFusionGroups() {
  for (auto& open : open_groups) {
    open.group.reset();
  }
}

std::unordered_map<std::string, int64_t> fusedOps() {
  auto& c = fusedCounts();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.counts;
}

void clearFusedOps() {
  auto& c = fusedCounts();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.counts.clear();
}

void failNextFusedOp(const std::string& op_name) {
  auto& c = fusedCounts();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.fail_op = op_name;
  c.fail_armed.store(!op_name.empty(), std::memory_order_relaxed);
}

} // namespace at::kiln

// FusedKernels.h — generated kernels for adaptive eager fusion groups: C++
// source for a run of queued elementwise ops, built in the background, and
// a registry of the built kernels by signature (Note [Generated kernels for
// fusion groups] in FusedKernels.cc).
//
// Ownership: the registry and its build thread live for the process (leaked
// at exit; rebuilt empty of pending work in a forked child). A built kernel's
// shared library is never unloaded.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace at::kiln {

// What a generated kernel computes for one op, elementwise on float32.
// Each mirrors the vectorised lambda of ATen's CPU kernel for the op:
//   Add      out = fmadd(b, alpha, a)       (ufunc add; sub is add with -alpha)
//   Mul      out = a * b                    (mul_kernel)
//   Div      out = a / b                    (div_true_kernel)
//   Neg      out = a.neg()                  (neg_kernel)
//   ClampMin out = clamp_min(a, b)          (relu runs as clamp_min(a, 0))
//   Sigmoid  out = (1 + a.neg().exp()).reciprocal()   (sigmoid_kernel)
enum class FusedForm : uint8_t { Add, Mul, Div, Neg, ClampMin, Sigmoid };

// An operand of a generated op: a buffer of the segment or a scalar slot.
struct FusedValue {
  bool is_scalar = false;
  uint32_t index = 0;
};

struct GeneratedOp {
  FusedForm form = FusedForm::Add;
  FusedValue a, b, alpha;  // b: binary forms; alpha: Add
  uint32_t out = 0;        // the buffer written
  // Binary forms: which operand's NaN the result carries when both are NaN
  // (0: a, 1: b), as ATen's compiled kernel does on this machine (probed).
  int nan_winner = 0;
};

// Words per op of SegmentPlan::program(): form, a is scalar, a's index, b is
// scalar, b's index, alpha's scalar index, out, nan_winner.
constexpr int64_t kProgramWords = 8;

// A run of generated ops over `buffer_count` float32 buffers and
// `scalar_count` float scalars (values passed at each call).
struct SegmentPlan {
  std::vector<GeneratedOp> ops;
  uint32_t buffer_count = 0;
  uint32_t scalar_count = 0;

  // What decides the generated source: equal signatures, equal kernels.
  std::string signature() const;
  // The ops as the interpreter reads them: kProgramWords int32 per op.
  std::vector<int32_t> program() const;
  // The kernel's C++ source (extern "C" kiln_fused_kernel and
  // kiln_fused_vector_size), built with ATen's SIMD flags.
  std::string source() const;
};

// out[k][i] for i in [0, n): n a multiple of the kernel's vector size.
using FusedKernelFn = void (*)(float* const* buffers, const float* scalars, int64_t n);
// The shared interpreter: runs `op_count` ops encoded by
// SegmentPlan::program() over the same buffers and scalars.
using FusedInterpreterFn = void (*)(const int32_t* program, int64_t op_count,
                                    float* const* buffers, const float* scalars, int64_t n);

// A kernel for one plan: its own generated kernel (fn), or the interpreter
// every plan can run on (interpret, with the plan's program).
struct FusedKernel {
  FusedKernelFn fn = nullptr;
  FusedInterpreterFn interpret = nullptr;
  int64_t vector_size = 0; // floats per at::vec::Vectorized<float> of the build
};

// How fusion groups run their ops with a generated form (torch_kiln._C.
// _set_fused_kernels(name), for tests and the bench):
//   Aten         each op as its ATen kernel per tile (no generated code);
//   Interpreted  the shared interpreter (one build per machine) only;
//   Specialized  each plan's own kernel only, queued at its first run;
//   Adaptive     (default) the interpreter until a plan has run
//                kHotPlanRuns times, then the plan's own kernel.
// Until the kernel a mode wants is built, the ops run as in Aten.
enum class FusedKernelMode : uint8_t { Aten, Interpreted, Specialized, Adaptive };
constexpr int64_t kHotPlanRuns = 64;

// The kernel `plan` runs with in the current mode, or nullopt if none is
// built yet (or ever: its build failed). Queues the builds the mode asks
// for (the build thread starts at the first) and returns at once.
std::optional<FusedKernel> findFusedKernel(const SegmentPlan& plan);

// Builds one kernel: (signature, source) -> the kernel, or throws. Set once,
// from Python (torch_kiln/kiln/_fused_kernels.py: build_library + dlopen).
// The builder returns the address of the source's kiln_fused_kernel and the
// value of its kiln_fused_vector_size().
struct BuiltLibrary {
  void* kernel = nullptr;
  int64_t vector_size = 0;
};
using FusedKernelBuilder = std::function<BuiltLibrary(const std::string&, const std::string&)>;
void setFusedKernelBuilder(FusedKernelBuilder builder);

// Stops building for good: forgets queued builds and waits for the one the
// builder is running, if any. Python calls it at exit (atexit, before the
// interpreter finalizes): a builder call that took the GIL after that would
// end its thread inside pybind11 and crash the exiting process. Runs of ops
// without a built kernel then stay unfused.
void stopFusedKernelBuilds();

FusedKernelMode fusedKernelMode();
void setFusedKernelMode(FusedKernelMode mode);

// Builds queued or running; waits until none is left or `timeout_s` passes
// (returns whether none is left). Failed builds: their messages, in order.
int64_t pendingFusedKernelBuilds();
bool waitForFusedKernelBuilds(double timeout_s);
std::vector<std::string> fusedKernelBuildFailures();
// Signatures with a built kernel of their own; whether the interpreter is built.
int64_t builtFusedKernelCount();
bool fusedInterpreterBuilt();
// Calls of generated kernels by fusion groups (one per segment and group
// run), since the process started, and how many of them were the
// interpreter's; recordFusedKernelRun counts one.
int64_t fusedKernelRuns();
int64_t interpretedFusedKernelRuns();
void recordFusedKernelRun(const FusedKernel& kernel);

// Which operand's NaN ATen's kernel for `form` returns when both operands
// are NaN (0: a, 1: b), with b a 0-dim host scalar if `b_is_scalar` and a
// one if `a_is_scalar`; -1 if it returns neither (the op is then not
// generated). Probed once per case by running the ATen CPU op.
int nanWinnerOf(FusedForm form, bool a_is_scalar, bool b_is_scalar);

} // namespace at::kiln

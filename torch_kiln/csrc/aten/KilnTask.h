// KilnTask.h — running C++ work as a task on a kiln stream.
//
// launchTask(stream, name, work) enqueues `work()` on the stream's in-order
// queue; it runs on the stream's worker thread after all earlier work there
// (or at once on the calling thread with KILN_LAUNCH_BLOCKING=1). `work` is
// moved into the task and destroyed after it ran, on the thread that ran it.
//
// Ownership rule: `work` must own (capture by value) everything it reads that
// the caller might change or free before the task runs: host tensors,
// generators, scalars. Kiln device memory is the exception: the stream order
// and the caching allocator (Note [Kiln caching allocator]) keep it valid, so
// tasks capture host aliases of kiln tensors, never the kiln tensors.
//
// Errors: an exception thrown by `work` becomes the stream's sticky error,
// described as "<name>: <what>" plus `describe()` when given; it is raised at
// the next synchronization of the stream (Note [Sticky stream errors] in the
// runtime). With KILN_LAUNCH_BLOCKING=1 it is raised by launchTask itself.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "core/KilnStream.h"

namespace at::kiln {

// Type-erased work item; see launchTask.
struct TaskBody {
  virtual ~TaskBody() = default;
  virtual void run() = 0;
  // Extra context for an error message (e.g. the op's argument shapes).
  virtual std::string describe() const { return {}; }
  // Called instead of run() when the task is skipped because an earlier
  // task on its stream failed (Note [Sticky stream errors] in the runtime).
  virtual void skipped() {}
};

// Note [Intra-op threads of kiln kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On CPU an op's kernel runs with the calling thread's intra-op thread count
// (torch.set_num_threads). A kiln kernel runs on a stream worker instead, so
// every task records the issuing thread's at::get_num_threads() when it is
// launched, and the worker applies it before running the task, changing its
// own OpenMP setting only when the count differs from the last task's. So
// torch.set_num_threads(n) reaches kiln kernels issued after it, as it
// reaches CPU kernels.
//
// Backward kernels are the exception to "the issuing thread's count": on CPU
// they run on the thread that called backward(), with its count; on kiln
// autograd's device thread ("pt_autograd_<index>") issues them, and its
// OpenMP count is the one in force when that thread started (PyTorch sets it
// once, in at::init_num_threads). After a later torch.set_num_threads(n),
// kiln's backward kernels ran with the old count, and kernels whose
// reductions split by thread count (a convolution's weight gradient) gave
// other bits than CPU's. So on an autograd device thread the count is
// refreshed from PyTorch's process-wide setting (at::init_num_threads, about
// 10 ns) at every launch.

// Note [Kiln tasks run in the issuer's inference and grad mode]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Host tensors a kiln op makes for its CPU kernel under
// torch.inference_mode() are inference tensors, which ATen lets a kernel
// update in place only inside inference mode (arange, eye and other
// factories resize and fill their out= tensor). The mode is thread-local,
// so every task records whether its issuing thread was in inference mode
// and runs inside InferenceMode if it was, as the CPU kernel would have.
// Grad mode (torch.no_grad) likewise, for these tasks and for eager ops'
// kernel launches (KernelLaunch.cc): some CPU kernels choose their
// algorithm by it, and the stream worker's own grad mode is always on.
// oneDNN's LSTM layer (aten::mkldnn_rnn_layer) runs its inference primitive
// without grad mode and its training one with it, which round differently:
// a 2-layer nn.LSTM under no_grad gave CPU's grad-mode bits on kiln (3e-8
// off CPU's no_grad result), and its workspace result exists only in grad
// mode, so the layout cache keys on grad mode too (Note [Layout cache]).

// The intra-op thread count a task launched now should run with: the
// calling thread's at::get_num_threads(), refreshed from the process-wide
// setting first on autograd's device threads.
int issuingThreadCount();

// Gives the stream worker `threads` intra-op threads (once per change); every
// task that runs ATen kernels calls it first.
void prepareWorkerThread(int threads);

// `name` must outlive the task (use a string literal or an operator name).
void launchTaskBody(const c10::kiln::KilnStream& stream, const char* name,
                    std::unique_ptr<TaskBody> body);

template <typename F>
void launchTask(const c10::kiln::KilnStream& stream, const char* name, F&& work) {
  struct Body final : TaskBody {
    explicit Body(F&& f) : fn(std::forward<F>(f)) {}
    void run() override { fn(); }
    std::decay_t<F> fn;
  };
  launchTaskBody(stream, name, std::make_unique<Body>(std::forward<F>(work)));
}

} // namespace at::kiln

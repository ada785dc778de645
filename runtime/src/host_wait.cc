// host_wait.cc — the host-wait callback and shutdown at process exit.
//
// Note [Interruptible host waits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A host thread blocked on the device (synchronize, a blocking copy, a launch
// onto a full queue) sleeps on a condition variable, where no signal handler
// of the program's language runs: Ctrl-C during torch.kiln.synchronize()
// used to take effect only after all queued work ran (20-38 s in tests). So
// every host wait (HostWait in runtime_internal.h) sleeps in slices of the
// callback's interval and calls the callback between slices, without holding
// the waited-on mutex; the callback decides whether to abandon the wait (the
// PyTorch layer runs Python's pending signal handlers there, on the main
// thread only). Abandoning is safe because only waits that nothing refers to
// are interruptible: a synchronous copy waits interruptibly for the work
// queued before it and only then enqueues itself and waits, uninterruptibly,
// for its own bytes (its outcome lives on the waiter's stack). Worker threads
// never call the callback. The fast paths (spinning, a wait that ends within
// one interval) never call it.
//
// Note [Shutdown at exit]
// ~~~~~~~~~~~~~~~~~~~~~~~
// At interpreter exit, PyTorch's layer used to synchronize every device; with
// daemon threads still launching, that wait kept growing and never ended.
// kilnRuntimeShutdown instead sets g_unloading: Submit refuses new work
// entries (FailUnloading, also waking launches that wait for room), so the
// queues can only shrink. It lets them drain for a short grace period (a
// program that ends with a few kernels queued should still run them, and
// learn of their errors), then sets g_dropping: the runners skip every work
// entry they pop (ShouldSkip counts it in the stream's dropped_), still
// running its release function and freeing its staging buffer. Event records
// and waits keep taking effect so no stream waits forever. Then it waits,
// with a deadline, for each stream to reach the work submitted so far — the
// entries running finish, the rest are skipped at memory speed. The runtime itself stays alive (Note [Leaked
// singletons]); queries, frees and synchronizations keep working, except
// that frees no longer wait for the devices: the interpreter frees tensors
// while it finalizes, and a task still running at the deadline (a long
// kernel) would hold every one of them; memory freed while some stream is
// busy is left to the OS instead of being released under that task.
// Synchronizing still waits, so the exit path checks for unraised errors
// only when nothing was left running.
#include "runtime_internal.h"

namespace kiln {

std::atomic<bool> g_unloading{false};
std::atomic<bool> g_dropping{false};

namespace {

struct HostWaitCallback {
  std::atomic<kilnHostWaitCallback_t> fn{nullptr};
  std::atomic<void*> user{nullptr};
  std::atomic<int64_t> interval_ns{0};
};
HostWaitCallback g_callback;

}  // namespace

kilnError_t FailUnloading() {
  return Fail(kilnErrorRuntimeUnloading,
              "the process is exiting (kilnRuntimeShutdown was called): no more device work is "
              "accepted");
}

int64_t HostWaitIntervalNs() { return g_callback.interval_ns.load(std::memory_order_acquire); }

kilnError_t CallHostWaitCallback() {
  const kilnHostWaitCallback_t fn = g_callback.fn.load(std::memory_order_acquire);
  if (fn == nullptr) return kilnSuccess;
  if (fn(g_callback.user.load(std::memory_order_acquire)) == 0) return kilnSuccess;
  return Fail(kilnErrorInterrupted,
              "the wait for the device was abandoned by the host-wait callback (for example on "
              "Ctrl-C); the device work already queued goes on");
}

}  // namespace kiln

using kiln::ApiCall;
using kiln::Fail;
using kiln::Runtime;

extern "C" {

KILN_API kilnError_t kilnSetHostWaitCallback(kilnHostWaitCallback_t callback, void* userData,
                                             unsigned int intervalMs) {
  // Needs no devices, so it does not initialise the runtime (a host layer
  // installs its callback at import, before any device is used).
  kiln::t_api = "kilnSetHostWaitCallback";
  if (kiln::g_forked_child.load(std::memory_order_relaxed)) return kiln::FailForkedChild();
  if (callback != nullptr && (intervalMs < 1 || intervalMs > 60000))
    return Fail(kilnErrorInvalidValue, "intervalMs must be 1..60000 (got %u)", intervalMs);
  kiln::g_callback.interval_ns.store(0, std::memory_order_release);  // off while changing
  kiln::g_callback.user.store(userData, std::memory_order_release);
  kiln::g_callback.fn.store(callback, std::memory_order_release);
  if (callback != nullptr)
    kiln::g_callback.interval_ns.store(int64_t{intervalMs} * 1'000'000, std::memory_order_release);
  return kilnSuccess;
}

KILN_API kilnError_t kilnRuntimeShutdown(unsigned int drainMs, unsigned int timeoutMs,
                                        unsigned long long* dropped) {
  return ApiCall("kilnRuntimeShutdown", [&](Runtime& rt) {
    if (kilnError_t err = kiln::CheckNotInsideTaskOf(-1)) return err;
    kiln::g_unloading.store(true, std::memory_order_seq_cst);
    const int64_t start = kiln::NowNs();
    const int64_t drain_deadline = start + int64_t{drainMs} * 1'000'000;
    const int64_t deadline = drain_deadline + int64_t{timeoutMs} * 1'000'000;
    std::vector<kiln::Stream*> streams;
    for (int d = 0; d < rt.device_count; ++d) {
      kiln::Device& dev = rt.devices[d];
      std::lock_guard<std::mutex> lock(dev.mu);
      streams.insert(streams.end(), dev.streams.begin(), dev.streams.end());
    }
    for (kiln::Stream* s : streams) s->WakeLaunchWaiters();
    for (kiln::Stream* s : streams) s->WaitForUntil(s->submitted(), drain_deadline);
    kiln::g_dropping.store(true, std::memory_order_seq_cst);
    bool all_done = true;
    for (kiln::Stream* s : streams) all_done = s->WaitForUntil(s->submitted(), deadline) && all_done;
    if (dropped != nullptr) {
      unsigned long long total = 0;
      // Dropped already, and still queued behind a running task (those will
      // be dropped when the task ends).
      for (kiln::Stream* s : streams) total += s->dropped() + s->Queued();
      *dropped = total;
    }
    if (!all_done)
      return Fail(kilnErrorNotReady,
                  "a device task was still running %u ms after shutdown began; it was left "
                  "running", drainMs + timeoutMs);
    return kilnSuccess;
  });
}

}  // extern "C"

// init.cc — creating the runtime on first use, and refusing forked children.
//
// Note [Leaked singletons]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The Runtime (devices, allocation tables, stream and event pools) is created
// with `new` on the first API call and never destroyed. Worker threads are
// detached and run until the process ends. Destroying the runtime from a
// static destructor would race with those threads (a worker finishing a task
// while exit() tears down the queue it pops from) and with other libraries'
// static destructors that still free tensors (PyTorch's caching allocator
// calls kilnFree during interpreter shutdown). Leaking is safe: the OS reclaims
// everything, and the leak checkers see the runtime as still reachable through
// a global, not as lost.
//
// Note [Fork safety]
// ~~~~~~~~~~~~~~~~~~
// fork() copies only the calling thread. A child forked after initialisation
// would inherit queues whose worker threads do not exist and mutexes that
// another thread may have held at the moment of the fork, so any call could
// hang. We register a pthread_atfork child handler at initialisation that sets
// g_forked_child; ApiCall checks it before touching any state and fails with
// kilnErrorInitializationError telling the user to use the 'spawn' start
// method (what CUDA users get as "Cannot re-initialize CUDA in forked
// subprocess"). A process forked before the first call is unaffected: the
// handler is not registered yet and the child initialises its own runtime.
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <thread>

#include "runtime_internal.h"

namespace kiln {

std::atomic<bool> g_forked_child{false};

namespace {

void OnForkChild() { g_forked_child.store(true, std::memory_order_relaxed); }

int CountHostCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

Runtime* CreateRuntime() {
  auto* rt = new Runtime();
  rt->config = ReadConfig();
  rt->host_cores = CountHostCores();
  if (rt->config.error.empty()) {
    rt->device_count = rt->config.device_count;
    rt->devices.reset(new Device[static_cast<size_t>(rt->device_count)]);
    for (int i = 0; i < rt->device_count; ++i) {
      rt->devices[i].index = i;
      rt->devices[i].physical_index = rt->config.visible_devices[static_cast<size_t>(i)];
      rt->devices[i].capacity = rt->config.device_memory;
    }
  }
  pthread_atfork(nullptr, nullptr, &OnForkChild);
  return rt;
}

}  // namespace

Runtime& GetRuntime() {
  // Thread-safe one-time construction; see Note [Leaked singletons].
  static Runtime* const runtime = CreateRuntime();
  return *runtime;
}

}  // namespace kiln

// The version needs no devices, so it answers even when the environment is
// invalid (a tool can print it next to the environment error).
extern "C" KILN_API kilnError_t kilnRuntimeGetVersion(int* version) {
  kiln::t_api = "kilnRuntimeGetVersion";
  if (kiln::g_forked_child.load(std::memory_order_relaxed)) return kiln::FailForkedChild();
  if (version == nullptr) return kiln::Fail(kilnErrorInvalidValue, "version is NULL");
  *version = KILN_RUNTIME_VERSION;
  return kilnSuccess;
}

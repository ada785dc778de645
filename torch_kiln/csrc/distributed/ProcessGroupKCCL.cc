#include "distributed/ProcessGroupKCCL.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <sstream>
#include <thread>

#include <pthread.h>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "aten/KernelLaunch.h"
#include "aten/KilnTask.h"
#include "aten/TensorAliases.h"
#include "core/FailedResults.h"
#include "core/KilnCachingAllocator.h"
#include "core/KilnEvent.h"
#include "core/KilnException.h"
#include "core/KilnStream.h"
#include "distributed/CrossHost.h"
#include "distributed/Reductions.h"
#include "distributed/ShmCollectives.h"
#include "distributed/ShmGroup.h"
#include "distributed/WorkKCCL.h"

namespace c10d::kiln {

using Clock = std::chrono::steady_clock;

// Note [kccl issue order]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Every rank must run the group's collectives in the same order, the order
// its program issued them. Operations on one device share one in-order
// communication stream, but a group used with kiln:0 and kiln:1 has two
// streams whose workers could start tasks in either order. So each task first
// waits for its turn: until every operation this rank issued on the group
// before it (a local issue counter, apart from the sequence numbers, which
// count collectives and point-to-point operations separately) has finished,
// failed or been skipped, within the operation's deadline. This cannot deadlock: a task only waits for
// tasks issued before it, and those never wait for anything issued later.

// The state shared by the process group and its in-flight tasks (tasks may
// outlive a Python reference to the group; the destructor waits for them).
struct KcclShared {
  KcclShared(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout, const std::string& tag)
      : group(store, rank, size, timeout, tag, slotBytesFromEnvironment()) {}

  ShmGroup group;

  // Note [kccl issue order]
  std::mutex order_mutex;
  std::condition_variable order_cv;
  uint64_t finished_order = 0;

  void waitTurn(uint64_t order, Clock::time_point deadline, const char* name) {
    std::unique_lock<std::mutex> lock(order_mutex);
    const bool ok = order_cv.wait_until(lock, deadline, [&] { return finished_order + 1 >= order; });
    TORCH_CHECK_WITH(DistBackendError, ok, "kccl: ", name,
                     " timed out waiting for an operation this rank issued before it to finish");
  }
  void finishTurn(uint64_t seq) {
    {
      std::lock_guard<std::mutex> lock(order_mutex);
      finished_order = std::max(finished_order, seq);
    }
    order_cv.notify_all();
  }

  // Kiln communication streams, by device (created on first use).
  std::mutex streams_mutex;
  std::unordered_map<c10::DeviceIndex, kilnStream_t> streams;

  c10::kiln::KilnStream commStream(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(streams_mutex);
    auto it = streams.find(device);
    if (it == streams.end()) {
      c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, device));
      kilnStream_t handle = nullptr;
      KILN_CHECK(kilnStreamCreateWithPriority(&handle, 0, 0));
      it = streams.emplace(device, handle).first;
    }
    return c10::kiln::getStreamFromExternal(it->second, device);
  }

  // Completes Works' Futures once their tasks ran, off the stream workers
  // (Note [kccl completion thread]).
  std::mutex completion_mutex;
  std::condition_variable completion_cv;
  std::deque<c10::intrusive_ptr<WorkKCCL>> completion_queue;
  bool stopping = false;   // shutdown(): complete what is queued, then end
  bool abandoning = false; // exit: end now, leaving unfinished Works
  std::thread completion_thread;

  void startCompletionThread() {
    completion_thread = std::thread([this] { completionLoop(); });
  }
  void push(c10::intrusive_ptr<WorkKCCL> work) {
    {
      std::lock_guard<std::mutex> lock(completion_mutex);
      completion_queue.push_back(std::move(work));
    }
    completion_cv.notify_one();
  }
  bool abandoned() {
    std::lock_guard<std::mutex> lock(completion_mutex);
    return abandoning;
  }
  void completionLoop() {
    pthread_setname_np(pthread_self(), "kccl-complete");
    for (;;) {
      c10::intrusive_ptr<WorkKCCL> work;
      {
        std::unique_lock<std::mutex> lock(completion_mutex);
        completion_cv.wait(lock,
                           [&] { return stopping || abandoning || !completion_queue.empty(); });
        if (abandoning || completion_queue.empty()) {
          return;
        }
        work = std::move(completion_queue.front());
        completion_queue.pop_front();
      }
      while (!work->state()->waitFinished(std::chrono::milliseconds(100))) {
        if (abandoned()) {
          leaveAtExit(std::move(work));
          return;
        }
      }
      if (auto error = work->state()->error()) {
        work->future()->setErrorIfNeeded(error);
      } else {
        work->future()->markCompleted(c10::IValue(work->outputs()));
      }
    }
  }
  void joinCompletionThread() {
    completion_cv.notify_all();
    if (completion_thread.joinable() &&
        completion_thread.get_id() != std::this_thread::get_id()) {
      completion_thread.join();
    }
  }

  // shutdown(): the completion thread completes every queued Work, waiting
  // for each to finish (within its deadline), then ends. The communication
  // streams are not synchronized here: that would clear their sticky errors,
  // which the program's next torch.kiln.synchronize() must still raise.
  void finishAndStop() {
    {
      std::lock_guard<std::mutex> lock(completion_mutex);
      stopping = true;
    }
    joinCompletionThread();
  }

  // At interpreter exit: ends the completion thread without waiting for
  // unfinished Works; they and the queue are left to process exit
  // (Note [kccl completion thread]).
  void abandonAtExit() {
    std::deque<c10::intrusive_ptr<WorkKCCL>> left;
    {
      std::lock_guard<std::mutex> lock(completion_mutex);
      abandoning = true;
      left.swap(completion_queue);
    }
    joinCompletionThread();
    for (auto& work : left) {
      leaveAtExit(std::move(work));
    }
  }
  // Keeps `work` (and the user's tensors it holds) alive until process exit.
  static void leaveAtExit(c10::intrusive_ptr<WorkKCCL> work) {
    static std::mutex mutex;
    static auto* kept = new std::vector<c10::intrusive_ptr<WorkKCCL>>(); // never freed
    std::lock_guard<std::mutex> lock(mutex);
    kept->push_back(std::move(work));
  }

  ~KcclShared() {
    // Tasks still queued finish (at the latest at their deadline) before
    // their streams are destroyed; then the remaining Futures complete.
    for (auto& [device, handle] : streams) {
      (void)kilnStreamDestroy(handle); // errors were reported by the Works
    }
    {
      std::lock_guard<std::mutex> lock(completion_mutex);
      stopping = true;
    }
    joinCompletionThread();
  }

  // Every KcclShared made, for abandonAllKcclCompletionsAtExit().
  static std::mutex& registryMutex() {
    static std::mutex mutex;
    return mutex;
  }
  static std::vector<std::weak_ptr<KcclShared>>& registry() {
    static auto* made = new std::vector<std::weak_ptr<KcclShared>>(); // outlives static destructors
    return *made;
  }
  static void registerShared(const std::shared_ptr<KcclShared>& shared) {
    std::lock_guard<std::mutex> lock(registryMutex());
    auto& made = registry();
    made.erase(std::remove_if(made.begin(), made.end(), [](const auto& w) { return w.expired(); }),
               made.end());
    made.push_back(shared);
  }
};

// Note [kccl completion thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each group has one thread that completes its Works' Futures (get_future())
// once their tasks ran, so no stream worker waits on user callbacks. Those
// callbacks, and the user's tensors a finished Work holds, may need the GIL
// (a Python callback of Future.then(); a tensor whose Python object outlives
// its last Python reference is freed with a decref). A thread that asks for
// the GIL while CPython finalizes is ended with pthread_exit, whose forced
// unwind through a destructor is std::terminate: a program that finished
// aborted at exit. So the thread never outlives the interpreter:
//   * shutdown() (destroy_process_group calls it, with the GIL released)
//     waits for the issued tasks, completes their Futures and joins it;
//     later collectives on the group raise.
//   * An atexit handler (torch_kiln/distributed/__init__.py) calls
//     abandonAllKcclCompletionsAtExit() before finalization: each thread
//     ends after the Work it is completing, and Works not finished yet are
//     kept, never completed, until the process ends.

void abandonAllKcclCompletionsAtExit() {
  std::vector<std::shared_ptr<KcclShared>> live;
  {
    std::lock_guard<std::mutex> lock(KcclShared::registryMutex());
    for (const auto& weak : KcclShared::registry()) {
      if (auto shared = weak.lock()) {
        live.push_back(std::move(shared));
      }
    }
  }
  for (const auto& shared : live) {
    shared->abandonAtExit();
  }
  // Not released here: the last reference would destroy the group on this
  // thread, waiting for its streams' unfinished tasks.
  static auto* kept = new std::vector<std::shared_ptr<KcclShared>>();
  kept->insert(kept->end(), live.begin(), live.end());
}

// One collective: what the task reads and writes, and what it does with them.
struct CollectiveCall {
  const char* name = "";
  c10d::OpType type = c10d::OpType::UNKNOWN;
  c10::Device device{c10::DeviceType::PrivateUse1, 0};
  std::vector<at::Tensor> inputs;  // read by the task
  std::vector<at::Tensor> outputs; // written by the task
  CollectiveDescription what;
  std::chrono::milliseconds timeout{0};
  bool p2p = false;   // send/recv: numbered apart from collectives, as in NCCL
  uint64_t order = 0; // issue order on this rank (Note [kccl issue order])
  // Runs inside the task on flat, contiguous host tensors (inputs, outputs).
  using Body = std::function<void(ShmGroup&, const CollectiveDescription&, Clock::time_point,
                                  std::vector<at::Tensor>&, std::vector<at::Tensor>&)>;
  Body body;
};

namespace {

std::string describeTensor(const at::Tensor& t) {
  std::ostringstream text;
  text << c10::toString(t.scalar_type()) << t.sizes();
  return text.str();
}

// The task of one collective on the communication stream.
struct CollectiveTask final : at::kiln::TaskBody {
  CollectiveTask(std::shared_ptr<KcclShared> s, CollectiveCall c, std::shared_ptr<WorkState> st)
      : shared(std::move(s)), call(std::move(c)), state(std::move(st)) {
    for (const auto& t : call.inputs) {
      inputs.emplace_back();
      inputs.back().assign(t);
    }
    for (const auto& t : call.outputs) {
      outputs.emplace_back();
      outputs.back().assign(t);
      outputs.back().written = true;
    }
    // The task must not own kiln tensors (KilnTask.h); descriptors suffice.
    call.inputs.clear();
    call.outputs.clear();
  }

  void run() override {
    const auto deadline = Clock::now() + call.timeout;
    try {
      shared->waitTurn(call.order, deadline, call.name);
    } catch (...) {
      fail(std::current_exception());
      shared->finishTurn(call.order);
      throw;
    }
    try {
      execute(deadline);
      state->finish(nullptr);
    } catch (...) {
      fail(std::current_exception());
      shared->finishTurn(call.order);
      throw;
    }
    shared->finishTurn(call.order);
  }

  void execute(Clock::time_point deadline) {
    if (c10::kiln::anyFailedResults()) {
      for (const auto& d : inputs) {
        if (auto reason = c10::kiln::failedResultReason(d.data)) {
          // This rank cannot contribute; the other ranks would wait for it
          // (and time out), and the group's steps no longer line up.
          shared->group.fail(std::string("kccl: ") + call.name + " (sequence number " +
                             std::to_string(call.what.seq) + ") on rank " +
                             std::to_string(shared->group.rank()) +
                             ": an input holds no valid result, so this rank cannot take part "
                             "(the other ranks will time out): " + *reason);
        }
      }
    }
    if (!call.p2p) {
      shared->group.enter(call.what); // for the other ranks' timeout messages
    }
    at::kiln::TensorAliaser aliaser(c10::DeviceType::CPU);
    std::vector<at::Tensor> in;
    std::vector<at::Tensor> out;
    std::vector<at::Tensor> out_alias;
    for (const auto& d : inputs) {
      at::Tensor alias = aliaser.alias(d);
      in.push_back(alias.is_contiguous() ? alias.view({-1}) : alias.contiguous().view({-1}));
    }
    for (const auto& d : outputs) {
      at::Tensor alias = aliaser.alias(d);
      out_alias.push_back(alias);
      out.push_back(alias.is_contiguous() ? alias.view({-1})
                                          : at::empty({alias.numel()}, alias.options()));
    }
    call.body(shared->group, call.what, deadline, in, out);
    for (size_t k = 0; k < out.size(); ++k) {
      if (!out_alias[k].is_contiguous()) {
        out_alias[k].copy_(out[k].view(out_alias[k].sizes()));
      }
    }
  }

  void fail(std::exception_ptr error) {
    // Errors from ShmGroup name the collective already; others get its name.
    std::string reason;
    try {
      std::rethrow_exception(error);
    } catch (const c10::Error& e) {
      reason = e.what_without_backtrace();
    } catch (const std::exception& e) {
      reason = e.what();
    } catch (...) {
      reason = "unknown error";
    }
    if (reason.rfind("kccl:", 0) != 0) {
      reason = std::string("kccl: ") + call.name + " (sequence number " +
               std::to_string(call.what.seq) + ") failed: " + reason;
    }
    for (const auto& d : outputs) {
      c10::kiln::markFailedResult(d.data, reason);
    }
    // The Work raises c10::DistBackendError whatever failed inside the task.
    try {
      std::rethrow_exception(error);
    } catch (const c10::DistBackendError&) {
      state->finish(error);
    } catch (const std::exception&) {
      state->finish(std::make_exception_ptr(c10::DistBackendError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, reason)));
    } catch (...) {
      state->finish(error);
    }
  }

  void skipped() override {
    // Runs on the release path of the runtime: must not throw.
    try {
      const std::string reason = std::string("kccl: ") + call.name + " (sequence number " +
                                 std::to_string(call.what.seq) +
                                 ") was skipped because an earlier task on its communication "
                                 "stream failed";
      for (const auto& d : outputs) {
        c10::kiln::markFailedResult(d.data, reason);
      }
      state->finish(std::make_exception_ptr(
          c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, reason)));
      shared->waitTurn(call.order, Clock::now() + call.timeout, call.name);
    } catch (...) {
      if (!state->completed()) {
        state->finish(std::current_exception());
      }
    }
    shared->finishTurn(call.order);
  }

  // No describe(): every failure message of a collective already names it,
  // its sequence number and its shape.

  std::shared_ptr<KcclShared> shared;
  CollectiveCall call;
  std::shared_ptr<WorkState> state;
  std::vector<at::kiln::TensorDescriptor> inputs;
  std::vector<at::kiln::TensorDescriptor> outputs;
};

// ---------------------------------------------------------------- checks

void checkTensor(const at::Tensor& t, const char* collective, const char* role) {
  TORCH_CHECK_VALUE(t.defined(), "kccl: ", collective, ": the ", role, " tensor is undefined");
  TORCH_CHECK_VALUE(t.device().type() == c10::DeviceType::PrivateUse1, "kccl: ", collective,
                    ": expected a kiln tensor as ", role, ", got a tensor on ", t.device(),
                    " (kccl handles kiln tensors; use backend=\"cpu:gloo,kiln:kccl\" for CPU "
                    "tensors)");
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, "kccl: ", collective,
                    ": expected a dense (strided) tensor as ", role, ", got layout ", t.layout());
}

c10::Device commonDevice(const std::vector<at::Tensor>& tensors, const char* collective) {
  const c10::Device device = tensors.front().device();
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(t.device() == device, "kccl: ", collective,
                      ": all tensors of a collective must be on one kiln device, got ", device,
                      " and ", t.device());
  }
  return device;
}

void checkSingle(const std::vector<at::Tensor>& tensors, const char* collective) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "kccl: ", collective,
                    " takes exactly one tensor per rank (one kiln device per process), got ",
                    tensors.size());
}

void checkRoot(int64_t root, int size, const char* collective) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "kccl: ", collective, ": invalid root rank ", root,
                    " (the group has ranks 0 to ", size - 1, ")");
}

void checkSameDtype(const at::Tensor& a, const at::Tensor& b, const char* collective) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "kccl: ", collective,
                    ": input and output must have the same dtype, got ", a.scalar_type(), " and ",
                    b.scalar_type());
}

// The root's list of one tensor per rank (gather's outputs, scatter's
// inputs; `role`), each checked against this rank's tensor `t`; empty on the
// other ranks, which must not pass one. Throws c10::ValueError.
std::vector<at::Tensor> rootList(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& t,
                                 bool is_root, int root, int size, const char* collective,
                                 const char* list_name, const char* role, const char* t_role) {
  if (!is_root) {
    TORCH_CHECK_VALUE(lists.empty() || (lists.size() == 1 && lists[0].empty()), "kccl: ",
                      collective, ": only the root (rank ", root, ") takes a ", list_name);
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1 && static_cast<int>(lists[0].size()) == size, "kccl: ",
                    collective, ": the root needs a ", list_name, " of ", size,
                    " tensors (one per rank)");
  for (const auto& x : lists[0]) {
    checkTensor(x, collective, role);
    checkSameDtype(t, x, collective);
    TORCH_CHECK_VALUE(x.numel() == t.numel(), "kccl: ", collective, ": every ", role,
                      " tensor must have the ", t_role, "'s number of elements (", t.numel(),
                      "), got ", describeTensor(x));
  }
  return lists[0];
}

// A collective of `name` and `type` on `device`, reading `inputs` and
// writing `outputs`, described to the other ranks by `described`'s dtype and
// shape, `numel` (-1: not compared), `root` and `reduce_op` (-1: none).
CollectiveCall makeCall(const char* name, c10d::OpType type, c10::Device device,
                        std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                        const at::Tensor& described, int64_t numel, int root, int32_t reduce_op,
                        std::chrono::milliseconds timeout) {
  // Checked before anything is issued, as NCCL does (a stride-0 output
  // failed only when the result was read back).
  for (const at::Tensor& out : outputs) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(out) != at::MemOverlap::Yes, "kccl: ", name,
                      ": the tensor it writes, ", describeTensor(out), " with strides ",
                      out.strides(), ", has elements that share memory (an expanded view); "
                      "pass a tensor without overlap, such as its .clone()");
  }
  CollectiveCall call;
  call.name = name;
  call.type = type;
  call.device = device;
  call.inputs = std::move(inputs);
  call.outputs = std::move(outputs);
  call.what = {name, 0, static_cast<int32_t>(type), static_cast<int32_t>(described.scalar_type()),
               numel, root, reduce_op, describeTensor(described)};
  call.timeout = timeout;
  return call;
}

// The task body of a group that spans hosts: runs `member` of its
// CrossHost with `args` (Note [kccl across hosts]).
template <typename... Params, typename... Args>
CollectiveCall::Body crossHostBody(std::shared_ptr<CrossHost> x,
                                   void (CrossHost::*member)(ShmGroup&, const CollectiveDescription&,
                                                             Clock::time_point, CrossHost::Tensors&,
                                                             CrossHost::Tensors&, Params...),
                                   Args... args) {
  return [x = std::move(x), member, args...](ShmGroup& g, const CollectiveDescription& what,
                                             Clock::time_point deadline, std::vector<at::Tensor>& in,
                                             std::vector<at::Tensor>& out) {
    ((*x).*member)(g, what, deadline, in, out, args...);
  };
}

// Note [kccl PREMUL_SUM]
// ~~~~~~~~~~~~~~~~~~~~~~
// PREMUL_SUM multiplies each rank's input by that rank's own factor and sums
// the products, as NCCL's ncclRedOpCreatePreMulSum ("pre-multiplies input
// values by a given scalar locally"); ranks may pass different factors. The
// reducing rank only sees the other ranks' data, so every rank scales its
// own input before the data moves and the collective itself is a SUM:
// ((x0 * f0) + (x1 * f1)) + ..., each product rounded to the dtype, in rank
// order (Reductions.h). Before this, each rank applied its own factor to
// every rank's input, so ranks with different factors got different results.
// `reducingOp` is the op the body reduces with; `premultiplying` wraps the
// body. For reduce, `root` is the rank that gets the result: the others keep
// their unscaled input.
c10d::ReduceOp reducingOp(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::PREMUL_SUM ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
}

CollectiveCall::Body premultiplying(const c10d::ReduceOp& op, CollectiveCall::Body body,
                                    int root = -1) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return body;
  }
  const double factor = premulFactor(op);
  return [factor, root, body = std::move(body)](ShmGroup& g, const CollectiveDescription& what,
                                                Clock::time_point deadline,
                                                std::vector<at::Tensor>& in,
                                                std::vector<at::Tensor>& out) {
    std::vector<at::Tensor> scaled;
    scaled.reserve(in.size());
    for (const at::Tensor& t : in) {
      scaled.push_back(at::mul(t, factor));
    }
    if (root < 0 || g.groupRank(g.rank()) == root) {
      body(g, what, deadline, scaled, out);
      return;
    }
    std::vector<at::Tensor> discarded = {at::empty_like(out[0])};
    body(g, what, deadline, scaled, discarded);
    if (in[0].data_ptr() != out[0].data_ptr()) {
      out[0].copy_(in[0]); // non-roots keep their input
    }
  };
}

at::Tensor slotTensor(ShmGroup& g, int r, size_t byte_offset, int64_t n, const at::Tensor& like) {
  return at::from_blob(g.slot(r) + byte_offset, {n}, like.options());
}

char* bytes(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

} // namespace

// ---------------------------------------------------------------- the group

ProcessGroupKCCL::ProcessGroupKCCL(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   std::chrono::milliseconds timeout, const std::string& group_name,
                                   std::vector<std::vector<int>> hosts,
                                   c10::intrusive_ptr<c10d::Backend> gloo_leaders,
                                   c10::intrusive_ptr<c10d::Backend> gloo_all)
    : Backend(rank, size), timeout_(timeout), group_name_(group_name) {
  if (hosts.empty()) {
    std::vector<int> everyone(size);
    for (int r = 0; r < size; ++r) {
      everyone[r] = r;
    }
    hosts.push_back(std::move(everyone));
  }
  HostLayout layout(std::move(hosts), rank, size);
  // Groups made with one store get distinct keys: every rank creates the
  // kccl groups of a store in the same order.
  static std::mutex counter_mutex;
  static std::unordered_map<std::string, int> counters;
  int generation = 0;
  {
    std::lock_guard<std::mutex> lock(counter_mutex);
    generation = counters[group_name]++;
  }
  const std::string tag = "kccl/" + std::to_string(generation);
  store_ = store;
  store_tag_ = tag;
  if (layout.hosts.size() == 1) {
    shared_ = std::make_shared<KcclShared>(store, rank, size, timeout, tag);
  } else {
    // Note [kccl across hosts]: shared memory among this host's ranks only.
    auto host_store = c10::make_intrusive<c10d::PrefixStore>(
        "kccl-host" + std::to_string(layout.host()), store);
    shared_ = std::make_shared<KcclShared>(host_store, layout.localRank(), layout.localSize(),
                                           timeout, tag);
    shared_->group.setGroupRanks(layout.hosts[layout.host()]); // messages name group ranks
    cross_ = std::make_shared<CrossHost>(std::move(layout), std::move(gloo_leaders),
                                         std::move(gloo_all));
  }
  KcclShared::registerShared(shared_);
  shared_->startCompletionThread();
}

// Does not wait for queued operations: they hold the shared state and end
// within their deadlines; the last one to end frees it (if that happens on
// a stream worker, its own stream cannot be destroyed from there and is left
// to process exit).
ProcessGroupKCCL::~ProcessGroupKCCL() = default;

std::chrono::milliseconds ProcessGroupKCCL::timeoutFor(std::chrono::milliseconds requested) const {
  return requested == kUnsetTimeout || requested.count() <= 0 ? timeout_ : requested;
}

void ProcessGroupKCCL::shutdown() {
  if (!shut_down_.exchange(true)) {
    shared_->finishAndStop();
  }
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::enqueue(CollectiveCall call, bool blocking) {
  TORCH_CHECK_WITH(DistBackendError, !shut_down_.load(), "kccl: ", call.name,
                   ": the process group was shut down (destroy_process_group); create a new "
                   "one with init_process_group or new_group");
  shared_->group.checkNotBroken(); // fail fast, on the calling thread
  std::lock_guard<std::mutex> issue(issue_mutex_);
  const c10::Device device = call.device;
  last_device_ = device.index();
  c10::DeviceGuard guard(device);
  const c10::kiln::KilnStream comm = shared_->commStream(device.index());
  {
    // The collective runs after the work already issued on the caller's stream.
    c10::kiln::KilnEvent ready;
    ready.record(c10::kiln::getCurrentKilnStream(device.index()));
    ready.block(comm);
  }
  for (const auto* list : {&call.inputs, &call.outputs}) {
    for (const auto& t : *list) {
      c10::kiln::KilnCachingAllocator::recordStream(t.storage().data_ptr(), comm);
    }
  }
  call.what.seq = call.p2p ? ++p2p_seq_ : ++seq_;
  call.what.timeout_ms = call.timeout.count();
  call.order = ++order_;
  auto work = c10::make_intrusive<WorkKCCL>(rank_, call.type, call.name, call.what.seq, device,
                                            call.outputs, blocking);
  auto task = std::make_unique<CollectiveTask>(shared_, std::move(call), work->state());
  const char* name = task->call.name;
  try {
    at::kiln::launchTaskBody(comm, name, std::move(task));
  } catch (...) {
    // KILN_LAUNCH_BLOCKING=1 ran the task here and it failed.
    shared_->push(work);
    throw;
  }
  work->doneEvent().record(comm);
  shared_->push(work);
  {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    if (coalescing_) {
      coalesced_last_ = work;
    }
  }
  return work;
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::allreduce(std::vector<at::Tensor>& tensors,
                                                     const AllreduceOptions& opts) {
  constexpr const char* kName = "all_reduce";
  checkSingle(tensors, kName);
  const at::Tensor& t = tensors[0];
  checkTensor(t, kName, "input");
  checkReduceOp(opts.reduceOp, t.scalar_type(), kName);
  CollectiveCall call = makeCall(kName, OpType::ALLREDUCE, t.device(), {t}, {t}, t, t.numel(), -1,
                                 static_cast<int32_t>(opts.reduceOp.op_), timeoutFor(opts.timeout));
  const c10d::ReduceOp op = reducingOp(opts.reduceOp); // Note [kccl PREMUL_SUM]
  call.body = [op](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                   std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    const int64_t es = static_cast<int64_t>(in[0].element_size());
    forEachChunk(in[0].numel(), static_cast<int64_t>(g.slotBytes()) / es, [&](int64_t o, int64_t n) {
      g.step(
          what, deadline, [&] { std::memcpy(g.slot(g.rank()), bytes(in[0]) + o * es, n * es); },
          [&] {
            std::vector<at::Tensor> parts;
            for (int r = 0; r < g.size(); ++r) {
              parts.push_back(slotTensor(g, r, 0, n, in[0]));
            }
            at::Tensor chunk = out[0].narrow(0, o, n);
            reduceInto(chunk, parts, op, g.size());
          });
    });
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::allReduce, op);
  }
  call.body = premultiplying(opts.reduceOp, std::move(call.body));
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::broadcast(std::vector<at::Tensor>& tensors,
                                                     const BroadcastOptions& opts) {
  constexpr const char* kName = "broadcast";
  checkSingle(tensors, kName);
  const at::Tensor& t = tensors[0];
  checkTensor(t, kName, "input");
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(opts.rootRank, size_, kName);
  CollectiveCall call = makeCall(kName, OpType::BROADCAST, t.device(), {t}, {t}, t, t.numel(), root,
                                 -1, timeoutFor(opts.timeout));
  call.body = [root](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                     std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    // The root's output is its input: a non-contiguous one was staged
    // through a copy, which the task writes back.
    if (g.rank() == root && in[0].data_ptr() != out[0].data_ptr()) {
      out[0].copy_(in[0]);
    }
    shmBroadcast(g, what, deadline, bytes(out[0]), out[0].numel() * out[0].element_size(), root);
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::broadcast, root);
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::reduce(std::vector<at::Tensor>& tensors,
                                                  const ReduceOptions& opts) {
  constexpr const char* kName = "reduce";
  checkSingle(tensors, kName);
  const at::Tensor& t = tensors[0];
  checkTensor(t, kName, "input");
  checkReduceOp(opts.reduceOp, t.scalar_type(), kName);
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(opts.rootRank, size_, kName);
  CollectiveCall call = makeCall(kName, OpType::REDUCE, t.device(), {t}, {t}, t, t.numel(), root,
                                 static_cast<int32_t>(opts.reduceOp.op_), timeoutFor(opts.timeout));
  const c10d::ReduceOp op = reducingOp(opts.reduceOp); // Note [kccl PREMUL_SUM]
  call.body = [op, root](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                         std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    const int64_t es = static_cast<int64_t>(in[0].element_size());
    forEachChunk(in[0].numel(), static_cast<int64_t>(g.slotBytes()) / es, [&](int64_t o, int64_t n) {
      g.step(
          what, deadline, [&] { std::memcpy(g.slot(g.rank()), bytes(in[0]) + o * es, n * es); },
          [&] {
            if (g.rank() != root) {
              return;
            }
            std::vector<at::Tensor> parts;
            for (int r = 0; r < g.size(); ++r) {
              parts.push_back(slotTensor(g, r, 0, n, in[0]));
            }
            at::Tensor chunk = out[0].narrow(0, o, n);
            reduceInto(chunk, parts, op, g.size());
          });
    });
    // Non-roots keep their input (NCCL leaves it unspecified; kccl keeps it).
    if (g.rank() != root && in[0].data_ptr() != out[0].data_ptr()) {
      out[0].copy_(in[0]);
    }
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::reduce, op, root);
  }
  call.body = premultiplying(opts.reduceOp, std::move(call.body), root);
  return enqueue(std::move(call), /*blocking=*/false);
}

namespace {

// all_gather's body: `in[0]` (N elements) of every rank into `out[r]`.
void allgatherBody(ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                   std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
  const int64_t es = static_cast<int64_t>(in[0].element_size());
  forEachChunk(in[0].numel(), static_cast<int64_t>(g.slotBytes()) / es, [&](int64_t o, int64_t n) {
    g.step(
        what, deadline, [&] { std::memcpy(g.slot(g.rank()), bytes(in[0]) + o * es, n * es); },
        [&] {
          for (int r = 0; r < g.size(); ++r) {
            std::memcpy(bytes(out[r]) + o * es, g.slot(r), n * es);
          }
        });
  });
}

// reduce_scatter's body: out[0] (N elements) = reduction over ranks of their
// in[rank] (N elements each).
void reduceScatterBody(const c10d::ReduceOp& op, ShmGroup& g, const CollectiveDescription& what,
                       Clock::time_point deadline, std::vector<at::Tensor>& in,
                       std::vector<at::Tensor>& out) {
  const int64_t es = static_cast<int64_t>(out[0].element_size());
  const int w = g.size();
  forEachChunk(out[0].numel(), static_cast<int64_t>(g.slotBytes()) / (es * w), [&](int64_t o, int64_t n) {
    g.step(
        what, deadline,
        [&] {
          for (int j = 0; j < w; ++j) {
            std::memcpy(g.slot(g.rank()) + j * n * es, bytes(in[j]) + o * es, n * es);
          }
        },
        [&] {
          std::vector<at::Tensor> parts;
          for (int r = 0; r < w; ++r) {
            parts.push_back(slotTensor(g, r, static_cast<size_t>(g.rank() * n * es), n, out[0]));
          }
          at::Tensor chunk = out[0].narrow(0, o, n);
          reduceInto(chunk, parts, op, w);
        });
  });
}

} // namespace

c10::intrusive_ptr<Work> ProcessGroupKCCL::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const AllgatherOptions& opts) {
  constexpr const char* kName = "all_gather";
  checkSingle(inputs, kName);
  TORCH_CHECK_VALUE(outputs.size() == 1, "kccl: all_gather takes one list of output tensors, got ",
                    outputs.size());
  const at::Tensor& t = inputs[0];
  checkTensor(t, kName, "input");
  auto& outs = outputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_, "kccl: all_gather: the output list has ",
                    outs.size(), " tensors, but the group has ", size_,
                    " ranks (one output tensor per rank)");
  std::vector<at::Tensor> all = {t};
  for (const auto& o : outs) {
    checkTensor(o, kName, "output");
    checkSameDtype(t, o, kName);
    TORCH_CHECK_VALUE(o.numel() == t.numel(), "kccl: all_gather: every output tensor must have the "
                      "input's number of elements (", t.numel(), "), got ", describeTensor(o));
    all.push_back(o);
  }
  CollectiveCall call = makeCall(kName, OpType::ALLGATHER, commonDevice(all, kName), {t}, outs, t,
                                 t.numel(), -1, -1, timeoutFor(opts.timeout));
  call.body = allgatherBody;
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::allGather);
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const AllgatherOptions& opts) {
  constexpr const char* kName = "all_gather_into_tensor";
  checkTensor(input, kName, "input");
  checkTensor(output, kName, "output");
  checkSameDtype(input, output, kName);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "kccl: all_gather_into_tensor: the "
                    "output must have world_size (", size_, ") times the input's elements (",
                    input.numel(), "), got ", describeTensor(output));
  TORCH_CHECK_VALUE(output.is_contiguous(), "kccl: all_gather_into_tensor: the output tensor must "
                    "be contiguous (as with NCCL), got ", describeTensor(output), " with strides ",
                    output.strides());
  CollectiveCall call = makeCall(kName, OpType::_ALLGATHER_BASE,
                                 commonDevice({input, output}, kName), {input}, {output}, input,
                                 input.numel(), -1, -1, timeoutFor(opts.timeout));
  call.body = [](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                 std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    std::vector<at::Tensor> pieces = out[0].chunk(g.size());
    if (in[0].numel() == 0) {
      pieces.assign(g.size(), out[0]);
    }
    allgatherBody(g, what, deadline, in, pieces);
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::allGather);
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const ReduceScatterOptions& opts) {
  constexpr const char* kName = "reduce_scatter";
  checkSingle(outputs, kName);
  TORCH_CHECK_VALUE(inputs.size() == 1, "kccl: reduce_scatter takes one list of input tensors, got ",
                    inputs.size());
  const at::Tensor& t = outputs[0];
  checkTensor(t, kName, "output");
  checkReduceOp(opts.reduceOp, t.scalar_type(), kName);
  auto& ins = inputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == size_, "kccl: reduce_scatter: the input list has ",
                    ins.size(), " tensors, but the group has ", size_, " ranks (one per rank)");
  std::vector<at::Tensor> all = {t};
  for (const auto& i : ins) {
    checkTensor(i, kName, "input");
    checkSameDtype(i, t, kName);
    TORCH_CHECK_VALUE(i.numel() == t.numel(), "kccl: reduce_scatter: every input tensor must have "
                      "the output's number of elements (", t.numel(), "), got ", describeTensor(i));
    all.push_back(i);
  }
  CollectiveCall call = makeCall(kName, OpType::REDUCE_SCATTER, commonDevice(all, kName), ins, {t},
                                 t, t.numel(), -1, static_cast<int32_t>(opts.reduceOp.op_),
                                 timeoutFor(opts.timeout));
  const c10d::ReduceOp op = reducingOp(opts.reduceOp); // Note [kccl PREMUL_SUM]
  call.body = [op](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                   std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    reduceScatterBody(op, g, what, deadline, in, out);
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::reduceScatter, op);
  }
  call.body = premultiplying(opts.reduceOp, std::move(call.body));
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const ReduceScatterOptions& opts) {
  constexpr const char* kName = "reduce_scatter_tensor";
  checkTensor(input, kName, "input");
  checkTensor(output, kName, "output");
  checkSameDtype(input, output, kName);
  checkReduceOp(opts.reduceOp, output.scalar_type(), kName);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "kccl: reduce_scatter_tensor: the "
                    "input must have world_size (", size_, ") times the output's elements (",
                    output.numel(), "), got ", describeTensor(input));
  TORCH_CHECK_VALUE(input.is_contiguous(), "kccl: reduce_scatter_tensor: the input tensor must be "
                    "contiguous (as with NCCL), got ", describeTensor(input), " with strides ",
                    input.strides());
  CollectiveCall call = makeCall(kName, OpType::_REDUCE_SCATTER_BASE,
                                 commonDevice({input, output}, kName), {input}, {output}, output,
                                 output.numel(), -1, static_cast<int32_t>(opts.reduceOp.op_),
                                 timeoutFor(opts.timeout));
  const c10d::ReduceOp op = reducingOp(opts.reduceOp); // Note [kccl PREMUL_SUM]
  call.body = [op](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                   std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    std::vector<at::Tensor> pieces = in[0].chunk(g.size());
    if (out[0].numel() == 0) {
      pieces.assign(g.size(), in[0]);
    }
    reduceScatterBody(op, g, what, deadline, pieces, out);
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::reduceScatter, op);
  }
  call.body = premultiplying(opts.reduceOp, std::move(call.body));
  return enqueue(std::move(call), /*blocking=*/false);
}

namespace {

// all_to_all's body: piece j of this rank's input goes to rank j, piece r of
// its output comes from rank r; pieces may differ in size (uneven splits).
// A first step exchanges the pieces' sizes: every rank checks every pair's
// sizes, and all agree on the step count.
void alltoallBody(ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                  std::vector<at::Tensor>& ins, std::vector<at::Tensor>& outs) {
  const int w = g.size();
  const int me = g.rank();
  const int64_t es = static_cast<int64_t>(outs[0].element_size());
  const int64_t per_piece = static_cast<int64_t>(g.slotBytes()) / (es * w);
  TORCH_CHECK(per_piece > 0 && 2 * static_cast<size_t>(w) * sizeof(int64_t) <= g.slotBytes(),
              "kccl: all_to_all: the shared-memory slot (KCCL_SHM_SLOT_BYTES) is too small for ", w,
              " ranks");
  // Every rank publishes what it sends to and expects from each rank, so
  // every rank finds a disagreement (and all fail alike, at once).
  int64_t largest = 0;
  g.step(
      what, deadline,
      [&] {
        auto* sizes = reinterpret_cast<int64_t*>(g.slot(me));
        for (int j = 0; j < w; ++j) {
          sizes[j] = ins[j].numel();
          sizes[w + j] = outs[j].numel();
        }
      },
      [&] {
        for (int r = 0; r < w; ++r) {
          const auto* sends = reinterpret_cast<const int64_t*>(g.slot(r));
          for (int j = 0; j < w; ++j) {
            const int64_t expected = reinterpret_cast<const int64_t*>(g.slot(j))[w + r];
            TORCH_CHECK_VALUE(sends[j] == expected, "all_to_all: rank ", r, " sends ", sends[j],
                              " elements to rank ", j, ", which expects ", expected,
                              " from it; the split sizes must agree between ranks");
            largest = std::max(largest, sends[j]);
          }
        }
      });
  const int64_t steps = std::max<int64_t>(1, (largest + per_piece - 1) / per_piece);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t o = k * per_piece;
    auto count = [&](const at::Tensor& t) {
      return std::clamp<int64_t>(t.numel() - o, 0, per_piece);
    };
    g.step(
        what, deadline,
        [&] {
          for (int j = 0; j < w; ++j) {
            std::memcpy(g.slot(me) + j * per_piece * es, bytes(ins[j]) + o * es, count(ins[j]) * es);
          }
        },
        [&] {
          for (int r = 0; r < w; ++r) {
            std::memcpy(bytes(outs[r]) + o * es, g.slot(r) + me * per_piece * es, count(outs[r]) * es);
          }
        });
  }
}

// Pieces of a flat tensor: `splits` rows of `row` elements each, or equal parts.
std::vector<at::Tensor> splitPieces(const at::Tensor& flat, const std::vector<int64_t>& splits,
                                    int64_t row, int w) {
  std::vector<at::Tensor> pieces;
  int64_t offset = 0;
  for (int j = 0; j < w; ++j) {
    const int64_t n = splits.empty() ? flat.numel() / w : splits[j] * row;
    pieces.push_back(flat.narrow(0, offset, n));
    offset += n;
  }
  return pieces;
}

void checkSplits(const std::vector<int64_t>& splits, const at::Tensor& t, int w, const char* which) {
  if (splits.empty()) {
    TORCH_CHECK_VALUE(t.dim() > 0 && t.size(0) % w == 0, "kccl: all_to_all_single: without ",
                      which, "_split_sizes the ", which, "'s first dimension (",
                      t.dim() > 0 ? t.size(0) : 0, ") must divide by the world size (", w, ")");
    return;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == w, "kccl: all_to_all_single: ", which,
                    "_split_sizes has ", splits.size(), " entries, the group has ", w, " ranks");
  int64_t total = 0;
  for (int64_t s : splits) {
    TORCH_CHECK_VALUE(s >= 0, "kccl: all_to_all_single: negative split size ", s);
    total += s;
  }
  TORCH_CHECK_VALUE(t.dim() > 0 && total == t.size(0), "kccl: all_to_all_single: ", which,
                    "_split_sizes add up to ", total, " rows but the ", which, " has ",
                    t.dim() > 0 ? t.size(0) : 0);
}

} // namespace

c10::intrusive_ptr<Work> ProcessGroupKCCL::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const GatherOptions& opts) {
  constexpr const char* kName = "gather";
  checkSingle(inputs, kName);
  const at::Tensor& t = inputs[0];
  checkTensor(t, kName, "input");
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(opts.rootRank, size_, kName);
  std::vector<at::Tensor> outs =
      rootList(outputs, t, rank_ == root, root, size_, kName, "gather_list", "output", "input");
  std::vector<at::Tensor> all = outs;
  all.push_back(t);
  CollectiveCall call = makeCall(kName, OpType::GATHER, commonDevice(all, kName), {t}, outs, t,
                                 t.numel(), root, -1, timeoutFor(opts.timeout));
  call.body = [root](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                     std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    std::vector<char*> dst;
    for (const auto& o : out) {
      dst.push_back(bytes(o));
    }
    shmGather(g, what, deadline, bytes(in[0]), in[0].numel() * in[0].element_size(), dst, root);
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::gather, root);
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const ScatterOptions& opts) {
  constexpr const char* kName = "scatter";
  checkSingle(outputs, kName);
  const at::Tensor& t = outputs[0];
  checkTensor(t, kName, "output");
  const int root = static_cast<int>(opts.rootRank);
  checkRoot(opts.rootRank, size_, kName);
  std::vector<at::Tensor> ins =
      rootList(inputs, t, rank_ == root, root, size_, kName, "scatter_list", "input", "output");
  std::vector<at::Tensor> all = ins;
  all.push_back(t);
  CollectiveCall call = makeCall(kName, OpType::SCATTER, commonDevice(all, kName), ins, {t}, t,
                                 t.numel(), root, -1, timeoutFor(opts.timeout));
  call.body = [root](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                     std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    const int64_t es = static_cast<int64_t>(out[0].element_size());
    const int w = g.size();
    forEachChunk(out[0].numel(), static_cast<int64_t>(g.slotBytes()) / (es * w), [&](int64_t o, int64_t n) {
      g.step(
          what, deadline,
          [&] {
            if (g.rank() == root) {
              for (int j = 0; j < w; ++j) {
                std::memcpy(g.slot(root) + j * n * es, bytes(in[j]) + o * es, n * es);
              }
            }
          },
          [&] { std::memcpy(bytes(out[0]) + o * es, g.slot(root) + g.rank() * n * es, n * es); });
    });
  };
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::scatter, root);
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_splits,
                                                         std::vector<int64_t>& input_splits,
                                                         const AllToAllOptions& opts) {
  constexpr const char* kName = "all_to_all_single";
  checkTensor(input, kName, "input");
  checkTensor(output, kName, "output");
  checkSameDtype(input, output, kName);
  checkSplits(input_splits, input, size_, "input");
  checkSplits(output_splits, output, size_, "output");
  if (input_splits.empty() && output_splits.empty()) {
    TORCH_CHECK_VALUE(input.numel() == output.numel(), "kccl: all_to_all_single: without split "
                      "sizes the input and output must have the same number of elements, got ",
                      describeTensor(input), " and ", describeTensor(output));
  }
  const int64_t in_row = input.dim() > 0 && input.size(0) > 0 ? input.numel() / input.size(0) : 0;
  const int64_t out_row = output.dim() > 0 && output.size(0) > 0 ? output.numel() / output.size(0) : 0;
  // Element counts may differ between ranks (uneven splits): the first step
  // checks the pieces instead (alltoallBody).
  CollectiveCall call = makeCall(kName, OpType::ALLTOALL_BASE, commonDevice({input, output}, kName),
                                 {input}, {output}, input, -1, -1, -1, timeoutFor(opts.timeout));
  call.body = [in_splits = input_splits, out_splits = output_splits, in_row, out_row](
                  ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                  std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    std::vector<at::Tensor> ins = splitPieces(in[0], in_splits, in_row, g.size());
    std::vector<at::Tensor> outs = splitPieces(out[0], out_splits, out_row, g.size());
    alltoallBody(g, what, deadline, ins, outs);
  };
  if (cross_) { // Note [kccl across hosts]
    call.body = [x = cross_, in_splits = input_splits, out_splits = output_splits, in_row, out_row](ShmGroup& g,
                                                                                                    const CollectiveDescription& what,
                                                                                                    Clock::time_point deadline,
                                                                                                    std::vector<at::Tensor>& in,
                                                                                                    std::vector<at::Tensor>& out) {
      std::vector<at::Tensor> ins = splitPieces(in[0], in_splits, in_row, x->layout().size());
      std::vector<at::Tensor> outs = splitPieces(out[0], out_splits, out_row, x->layout().size());
      x->allToAll(g, what, deadline, ins, outs);
    };
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const AllToAllOptions& opts) {
  constexpr const char* kName = "all_to_all";
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                    "kccl: all_to_all takes one input and one output tensor per rank (", size_,
                    " each), got ", inputs.size(), " inputs and ", outputs.size(), " outputs");
  std::vector<at::Tensor> all;
  for (const auto& t : inputs) {
    checkTensor(t, kName, "input");
    all.push_back(t);
  }
  for (const auto& t : outputs) {
    checkTensor(t, kName, "output");
    checkSameDtype(inputs[0], t, kName);
    all.push_back(t);
  }
  for (const auto& t : inputs) {
    checkSameDtype(t, outputs[0], kName);
  }
  CollectiveCall call = makeCall(kName, OpType::ALLTOALL, commonDevice(all, kName), inputs, outputs,
                                 inputs[0], -1, -1, -1, timeoutFor(opts.timeout));
  call.body = alltoallBody;
  if (cross_) {
    call.body = crossHostBody(cross_, &CrossHost::allToAll);
  }
  return enqueue(std::move(call), /*blocking=*/false);
}

// The coalesced forms issue one collective per tensor, in order, on the
// same communication stream; the last one's Work stands for all of them (its
// event follows every earlier one, and an earlier failure breaks the group,
// which fails the later ones too).
c10::intrusive_ptr<Work> ProcessGroupKCCL::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "kccl: all_reduce_coalesced needs at least one tensor");
  for (const auto& t : tensors) {
    checkTensor(t, "all_reduce_coalesced", "input");
    checkReduceOp(opts.reduceOp, t.scalar_type(), "all_reduce_coalesced");
  }
  commonDevice(tensors, "all_reduce_coalesced");
  c10::intrusive_ptr<Work> last;
  for (auto& t : tensors) {
    std::vector<at::Tensor> one = {t};
    last = allreduce(one, opts);
  }
  return last;
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(!inputs.empty() && inputs.size() == outputs.size(),
                    "kccl: all_gather_into_tensor_coalesced needs as many outputs as inputs (at "
                    "least one), got ", outputs.size(), " and ", inputs.size());
  c10::intrusive_ptr<Work> last;
  for (size_t k = 0; k < inputs.size(); ++k) {
    last = _allgather_base(outputs[k], inputs[k], opts);
  }
  return last;
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(!inputs.empty() && inputs.size() == outputs.size(),
                    "kccl: reduce_scatter_tensor_coalesced needs as many outputs as inputs (at "
                    "least one), got ", outputs.size(), " and ", inputs.size());
  c10::intrusive_ptr<Work> last;
  for (size_t k = 0; k < inputs.size(); ++k) {
    last = _reduce_scatter_base(outputs[k], inputs[k], opts);
  }
  return last;
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::barrier(const BarrierOptions& opts) {
  constexpr const char* kName = "barrier";
  c10::DeviceIndex device = last_device_;
  if (!opts.device_ids.empty()) {
    device = static_cast<c10::DeviceIndex>(opts.device_ids.front());
  } else if (opts.device.has_value() && opts.device->type() == c10::DeviceType::PrivateUse1 &&
             opts.device->has_index()) {
    device = opts.device->index();
  }
  CollectiveCall call;
  call.name = kName;
  call.type = OpType::BARRIER;
  call.device = c10::Device(c10::DeviceType::PrivateUse1, device);
  call.what = {kName, 0, static_cast<int32_t>(call.type), -1, 0, -1, -1, ""};
  call.timeout = timeoutFor(opts.timeout);
  call.body = [](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                 std::vector<at::Tensor>&, std::vector<at::Tensor>&) {
    g.step(what, deadline, nullptr, nullptr);
  };
  // dist.barrier() blocks the host, as NCCL's barrier does.
  if (cross_) { // Note [kccl across hosts]
    call.body = [x = cross_](ShmGroup& g, const CollectiveDescription& what,
                             Clock::time_point deadline, std::vector<at::Tensor>&,
                             std::vector<at::Tensor>&) {
      x->barrier(g, what, deadline);
    };
  }
  return enqueue(std::move(call), /*blocking=*/true);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::completedWork(c10d::OpType type, const char* name) {
  auto work = c10::make_intrusive<WorkKCCL>(rank_, type, name, 0,
                                            c10::Device(c10::DeviceType::PrivateUse1, last_device_),
                                            std::vector<at::Tensor>{}, /*blocking=*/false);
  work->state()->finish(nullptr);
  work->future()->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
  return work;
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::pointToPoint(bool is_send, std::vector<at::Tensor>& tensors,
                                                        int peer) {
  const char* name = is_send ? "send" : "recv";
  checkSingle(tensors, name);
  checkTensor(tensors[0], name, is_send ? "input" : "output");
  if (cross_) {
    TORCH_CHECK_VALUE(peer >= 0 && peer < size_ && peer != rank_, "kccl: ", name, ": invalid peer rank ",
                      peer, " on rank ", rank_, " (the group has ranks 0 to ", size_ - 1,
                      "; a rank cannot send to or receive from itself)");
  } else {
    shared_->group.checkPeer(peer, name);
  }
  {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    if (coalescing_) {
      // Runs with the rest of the group at endCoalescing().
      pending_p2p_.push_back({is_send, peer, tensors[0]});
      return completedWork(is_send ? OpType::SEND : OpType::RECV, name);
    }
  }
  return launchPointToPoint({{is_send, peer, tensors[0]}});
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::launchPointToPoint(std::vector<PendingP2P> ops) {
  const bool single = ops.size() == 1;
  const char* name = single ? (ops[0].send ? "send" : "recv") : "batch_isend_irecv";
  std::vector<at::Tensor> all;
  CollectiveCall call;
  std::vector<std::pair<bool, int>> plan; // (send, peer), in issue order
  int64_t total = 0;
  for (const auto& op : ops) {
    all.push_back(op.tensor);
    (op.send ? call.inputs : call.outputs).push_back(op.tensor);
    plan.emplace_back(op.send, op.peer);
    total += op.tensor.numel();
  }
  call.name = name;
  call.type = single ? (ops[0].send ? OpType::SEND : OpType::RECV) : OpType::COALESCED;
  call.device = commonDevice(all, name);
  call.what = {name, 0, static_cast<int32_t>(call.type),
               single ? static_cast<int32_t>(ops[0].tensor.scalar_type()) : -1, total,
               single ? ops[0].peer : -1, -1,
               single ? describeTensor(ops[0].tensor) : std::to_string(ops.size()) + " transfers"};
  call.timeout = timeout_;
  call.p2p = true;
  call.body = [plan, x = cross_](ShmGroup& g, const CollectiveDescription& what, Clock::time_point deadline,
                     std::vector<at::Tensor>& in, std::vector<at::Tensor>& out) {
    std::vector<P2PTransfer> transfers;
    size_t next_in = 0;
    size_t next_out = 0;
    for (const auto& [is_send, peer] : plan) {
      const at::Tensor& t = is_send ? in[next_in++] : out[next_out++];
      transfers.push_back({is_send, peer, bytes(t), t.numel(), static_cast<int64_t>(t.element_size()),
                           static_cast<int32_t>(t.scalar_type()), describeTensor(t)});
    }
    if (x) { // Note [kccl across hosts]
      x->exchange(g, what, transfers, deadline);
    } else {
      g.exchange(what, transfers, deadline);
    }
  };
  return enqueue(std::move(call), /*blocking=*/false);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                int /*tag: ignored, as by NCCL*/) {
  return pointToPoint(/*is_send=*/true, tensors, dst_rank);
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                int /*tag: ignored, as by NCCL*/) {
  return pointToPoint(/*is_send=*/false, tensors, src_rank);
}

void ProcessGroupKCCL::startCoalescing() {
  std::lock_guard<std::mutex> lock(p2p_mutex_);
  TORCH_CHECK_VALUE(!coalescing_, "kccl: startCoalescing() called twice without endCoalescing()");
  coalescing_ = true;
  coalesced_last_.reset();
}

c10::intrusive_ptr<Work> ProcessGroupKCCL::endCoalescing() {
  std::vector<PendingP2P> ops;
  c10::intrusive_ptr<Work> last;
  {
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    TORCH_CHECK_VALUE(coalescing_, "kccl: endCoalescing() without startCoalescing()");
    coalescing_ = false;
    ops = std::move(pending_p2p_);
    pending_p2p_.clear();
    last = std::move(coalesced_last_);
    coalesced_last_.reset();
  }
  if (!ops.empty()) {
    return launchPointToPoint(std::move(ops));
  }
  // Collectives inside the block ran as issued; the last one's Work stands
  // for all (they share the in-order communication stream).
  return last ? last : completedWork(OpType::COALESCED, "coalesced");
}

} // namespace c10d::kiln

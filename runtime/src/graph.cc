// graph.cc — stream capture and graphs: kilnStreamBeginCapture,
// kilnStreamEndCapture, kilnStreamIsCapturing, kilnGraphLaunch,
// kilnGraphDestroy, kilnGraphGetNodeCount.
//
// Note [Stream capture]
// ~~~~~~~~~~~~~~~~~~~~~
// CUDA Graphs' model on kiln streams. While a stream captures, Stream::Submit
// records each work entry (task, copy, memset) into the capture's Graph
// instead of queueing it: nothing runs, the launch returns kilnSuccess, and
// the entry's release (for a task) now belongs to the graph. Ending the
// capture hands the graph to the caller. kilnGraphLaunch queues ONE entry of
// kind kGraph that holds a reference to the graph; the stream's runner
// (Stream::Run -> RunGraph) runs the nodes back to back on the worker, in
// capture order, with the same userData each launch. So a replay of n
// captured ops costs the launching thread one launch, not n, and it is
// ordered on its stream like any other work (events, sticky errors, skipping
// after an earlier failure, the launch-queue bound and shutdown all see one
// entry). There is no second execution path: a captured task runs through
// RunTaskFn exactly as a queued one does.
//
// Why these refusals (kilnErrorStreamCaptureUnsupported, which also
// invalidates the capture, as CUDA's cudaErrorStreamCaptureUnsupported
// invalidates with cudaErrorStreamCaptureInvalidated):
//   * waiting for the capturing stream (synchronize, query, destroy, a
//     device synchronize of its device, a synchronous copy): the work has not
//     run and will not, so the wait could only lie or hang;
//   * an asynchronous copy from pageable memory: it is staged at the call,
//     so every launch would copy the capture-time bytes, not the memory's
//     contents at launch as CUDA does;
//   * event records on, and waits for pending records from, the capturing
//     stream: cross-stream dependencies are not recorded (this first
//     increment has no fork/join of side streams into one graph). A wait for
//     a completed record is a no-op, kept because host-side code (the kiln
//     generator's cross-stream ordering) issues such waits.
// Invalidation is sticky for the capture: later launches fail with
// kilnErrorStreamCaptureInvalidated until kilnStreamEndCapture reports it
// and ends the capture, so a half-recorded graph can never be launched.
//
// Lifetime: a graph is reference counted (its handle, each queued launch);
// the last reference runs the release functions of the captured tasks, on
// whichever thread drops it. Destroying a graph with launches still queued is
// therefore safe (cudaGraphExecDestroy's rule).
#include <cstring>
#include <new>
#include <set>

#include "runtime_internal.h"

namespace kiln {
namespace {

// Live graph handles, so a destroyed or made-up handle is an error, not a
// crash.
std::mutex g_graphs_mu;
std::set<Graph*>* g_graphs = new std::set<Graph*>();  // leaked: see Note [Leaked singletons]

kilnError_t ResolveGraph(kilnGraph_t handle, Graph** out) {
  auto* graph = reinterpret_cast<Graph*>(handle);
  std::lock_guard<std::mutex> lock(g_graphs_mu);
  if (handle == nullptr || g_graphs->count(graph) == 0)
    return Fail(kilnErrorInvalidResourceHandle,
                "%p is not a live graph (use a handle from kilnStreamEndCapture that has not "
                "been destroyed)",
                static_cast<void*>(handle));
  *out = graph;
  return kilnSuccess;
}

}  // namespace

void GraphRef(Graph* graph) { graph->refs.fetch_add(1, std::memory_order_relaxed); }

void GraphUnref(Graph* graph) {
  if (graph->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  for (Entry& node : graph->nodes) {
    if (node.kind == EntryKind::kTask && node.release != nullptr) node.release(node.user);
  }
  delete graph;
}

kilnError_t Stream::BeginCapture() {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_default())
    return Fail(kilnErrorStreamCaptureUnsupported,
                "operation not permitted when stream is capturing: the default stream of kiln "
                "device %d cannot capture; capture on a stream from kilnStreamCreate (graphs may "
                "be launched on the default stream afterwards)",
                device());
  if (capture_ != nullptr)
    return Fail(kilnErrorIllegalState,
                "the stream is already capturing; end that capture (kilnStreamEndCapture) before "
                "beginning another");
  try {
    capture_ = new Graph();
  } catch (const std::bad_alloc&) {
    return Fail(kilnErrorMemoryAllocation, "out of host memory for a new graph");
  }
  capture_->device = device();
  capture_error_.clear();
  capturing_.store(true, std::memory_order_release);
  return kilnSuccess;
}

kilnError_t Stream::EndCapture(Graph** out) {
  *out = nullptr;
  Graph* graph = nullptr;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (capture_ == nullptr)
      return Fail(kilnErrorIllegalState,
                  "the stream is not capturing (kilnStreamBeginCapture was not called, or the "
                  "capture has already ended)");
    graph = capture_;
    capture_ = nullptr;
    error.swap(capture_error_);
    capturing_.store(false, std::memory_order_release);
  }
  if (!error.empty()) {
    GraphUnref(graph);  // releases what was recorded before the invalidation
    return Fail(kilnErrorStreamCaptureInvalidated,
                "the capture was invalidated by an earlier operation, so no graph was made: %s",
                error.c_str());
  }
  try {
    graph->name = StrFormat("kiln graph (%zu nodes)", graph->nodes.size());
    std::lock_guard<std::mutex> lock(g_graphs_mu);
    g_graphs->insert(graph);
  } catch (const std::bad_alloc&) {
    GraphUnref(graph);
    return Fail(kilnErrorMemoryAllocation, "out of host memory for the captured graph");
  }
  *out = graph;
  return kilnSuccess;
}

kilnStreamCaptureStatus Stream::CaptureStatus() {
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ == nullptr) return kilnStreamCaptureStatusNone;
  return capture_error_.empty() ? kilnStreamCaptureStatusActive : kilnStreamCaptureStatusInvalidated;
}

kilnError_t Stream::InvalidateCaptureLocked(const char* what) {
  if (capture_error_.empty()) {
    try {
      capture_error_ = what;
    } catch (...) {
      capture_error_ = "?";
    }
  }
  return Fail(kilnErrorStreamCaptureUnsupported,
              "operation not permitted when stream is capturing: %s; the capture is now "
              "invalidated (end it, then capture again without this operation)",
              what);
}

kilnError_t Stream::RefuseIfCapturing(const char* what) {
  if (!capturing_.load(std::memory_order_acquire)) return kilnSuccess;
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ == nullptr) return kilnSuccess;
  return InvalidateCaptureLocked(what);
}

kilnError_t Stream::SubmitCaptured(Entry& e, uint64_t* seq, bool* consumed, bool* captured) {
  std::lock_guard<std::mutex> lock(mu_);
  if (capture_ == nullptr) return kilnSuccess;  // ended meanwhile: submit normally
  *captured = true;
  if (!alive_.load(std::memory_order_relaxed))
    return Fail(kilnErrorInvalidResourceHandle, "the stream was destroyed");
  if (!capture_error_.empty())
    return Fail(kilnErrorStreamCaptureInvalidated,
                "the capture of this stream was invalidated by %s; end the capture "
                "(kilnStreamEndCapture) and capture again",
                capture_error_.c_str());
  const bool recordable = e.kind == EntryKind::kTask || e.kind == EntryKind::kMemset ||
                          (e.kind == EntryKind::kCopy && e.outcome == nullptr && e.staging == nullptr);
  if (!recordable) {
    return InvalidateCaptureLocked(e.kind == EntryKind::kGraph
                                       ? "kilnGraphLaunch onto the capturing stream"
                                       : "this kind of work on the capturing stream");
  }
  try {
    capture_->nodes.push_back(e);
  } catch (const std::bad_alloc&) {
    return Fail(kilnErrorMemoryAllocation, "out of host memory while capturing (%zu nodes)",
                capture_->nodes.size());
  }
  Entry& node = capture_->nodes.back();
  if (node.trace != nullptr) {  // work of the launch, not of the capture
    GetRuntime().tracer.Discard(node.trace);
    node.trace = nullptr;
  }
  e.trace = nullptr;
  if (seq != nullptr) *seq = submitted_.load(std::memory_order_relaxed);
  if (consumed != nullptr) *consumed = true;
  return kilnSuccess;
}

kilnError_t RefuseIfDeviceCapturing(Runtime& rt, int device, const char* what) {
  std::vector<Stream*> streams;
  {
    Device& dev = rt.devices[device];
    std::lock_guard<std::mutex> lock(dev.mu);
    streams = dev.streams;
  }
  kilnError_t result = kilnSuccess;
  for (Stream* s : streams) {
    if (!s->capturing()) continue;
    const kilnError_t err = s->RefuseIfCapturing(what);
    if (result == kilnSuccess) result = err;
  }
  return result;
}

}  // namespace kiln

using kiln::ApiCall;
using kiln::Fail;
using kiln::Graph;
using kiln::Runtime;
using kiln::Stream;

extern "C" {

KILN_API kilnError_t kilnStreamBeginCapture(kilnStream_t stream, unsigned int flags) {
  return ApiCall("kilnStreamBeginCapture", [&](Runtime& rt) {
    if (flags != 0) return Fail(kilnErrorInvalidValue, "flags must be 0 (got %u)", flags);
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    return s->BeginCapture();
  });
}

KILN_API kilnError_t kilnStreamEndCapture(kilnStream_t stream, kilnGraph_t* graph) {
  return ApiCall("kilnStreamEndCapture", [&](Runtime& rt) {
    if (graph == nullptr) return Fail(kilnErrorInvalidValue, "graph is NULL");
    *graph = nullptr;
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    Graph* g = nullptr;
    if (kilnError_t err = s->EndCapture(&g)) return err;
    *graph = reinterpret_cast<kilnGraph_t>(g);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnStreamIsCapturing(kilnStream_t stream, kilnStreamCaptureStatus* status) {
  return ApiCall("kilnStreamIsCapturing", [&](Runtime& rt) {
    if (status == nullptr) return Fail(kilnErrorInvalidValue, "status is NULL");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    *status = s->CaptureStatus();
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnGraphLaunch(kilnGraph_t graph, kilnStream_t stream) {
  return ApiCall("kilnGraphLaunch", [&](Runtime& rt) {
    kiln::ApiActivity activity(rt, "kilnGraphLaunch");
    Graph* g = nullptr;
    if (kilnError_t err = kiln::ResolveGraph(graph, &g)) return err;
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    if (s->device() != g->device)
      return Fail(kilnErrorInvalidValue,
                  "the graph was captured on kiln device %d and cannot be launched on a stream of "
                  "kiln device %d",
                  g->device, s->device());
    kiln::Entry e;
    e.kind = kiln::EntryKind::kGraph;
    e.graph = g;
    e.name = g->name.c_str();
    kiln::GraphRef(g);
    activity.Attach(e, s, kilnActivityKindTask, e.name);
    bool consumed = false;
    const kilnError_t err = s->Submit(e, nullptr, &consumed);
    if (!consumed) {
      activity.Detach(e);
      kiln::GraphUnref(g);
    }
    return err;
  });
}

KILN_API kilnError_t kilnGraphDestroy(kilnGraph_t graph) {
  return ApiCall("kilnGraphDestroy", [&](Runtime&) {
    if (graph == nullptr) return kilnSuccess;
    auto* g = reinterpret_cast<Graph*>(graph);
    {
      std::lock_guard<std::mutex> lock(kiln::g_graphs_mu);
      if (kiln::g_graphs->erase(g) == 0)
        return Fail(kilnErrorInvalidResourceHandle,
                    "%p is not a live graph (destroyed twice, or not from kilnStreamEndCapture)",
                    static_cast<void*>(graph));
    }
    kiln::GraphUnref(g);
    return kilnSuccess;
  });
}

KILN_API kilnError_t kilnGraphGetNodeCount(kilnGraph_t graph, size_t* count) {
  return ApiCall("kilnGraphGetNodeCount", [&](Runtime&) {
    if (count == nullptr) return Fail(kilnErrorInvalidValue, "count is NULL");
    Graph* g = nullptr;
    if (kilnError_t err = kiln::ResolveGraph(graph, &g)) return err;
    *count = g->nodes.size();
    return kilnSuccess;
  });
}

}  // extern "C"

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
//   * waiting for a capturing stream (synchronize, query, destroy, a device
//     synchronize of its device, a synchronous copy): the work has not run
//     and will not, so the wait could only lie or hang;
//   * an asynchronous copy from pageable memory: it is staged at the call,
//     so every launch would copy the capture-time bytes, not the memory's
//     contents at launch as CUDA does;
//   * a wait for a pending record made outside any capture: a graph has no
//     way to wait for uncaptured work at each launch. A wait for a completed
//     record is a no-op, kept because host-side code (the kiln generator's
//     cross-stream ordering) issues such waits.
// Invalidation is sticky for the capture: later launches fail with
// kilnErrorStreamCaptureInvalidated until kilnStreamEndCapture reports it
// and ends the capture, so a half-recorded graph can never be launched.
//
// Note [Cross-stream capture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CUDA's fork and join: an event recorded on a capturing stream, waited for
// by another stream, brings that stream into the capture (PyTorch's
// `side.wait_stream(capturing)` inside `torch.cuda.graph`), and the capture
// may only end once the stream that began it waits, through events, for all
// the work the others captured. A Capture is therefore shared: the origin
// and every stream that joined point at it (capture_), and their launches
// append to its one Graph under g_capture_mu. Appending in the order the
// launches happen is a valid order to run them in: a node can only depend,
// through a wait, on work captured before the wait was made. So a graph
// stays one list run back to back on the launching stream; what it gives up
// is only the side streams' concurrency.
//
// Whether every joined stream was joined back is decided with vector clocks
// rather than a graph search: each member i keeps clocks[i][j], how many
// operations of member j its next work is ordered after (its own entry
// counts its nodes, plus one for the join itself, so joining and doing
// nothing still needs a join back, as in CUDA). A captured event record
// carries a copy of the recording member's clock (CapturedRecord, in the
// Event); a wait by a member merges it (element-wise max); a wait by a
// stream outside any capture joins with it. At kilnStreamEndCapture the
// origin must know each member's whole count, else the capture fails with
// kilnErrorStreamCaptureUnjoined, naming the streams.
//
// Lifetime: a graph is reference counted (its handle, each queued launch);
// the last reference runs the release functions of the captured tasks, on
// whichever thread drops it. Destroying a graph with launches still queued is
// therefore safe (cudaGraphExecDestroy's rule).
#include <algorithm>
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

// A capture in progress, shared by the stream that began it (members[0], the
// origin) and every stream that joined it. Guarded by g_capture_mu.
struct Capture {
  uint64_t id = 0;
  int device = 0;
  Graph* graph = nullptr;      // the nodes of every member, in capture order
  std::string error;           // non-empty once invalidated: what did it
  std::vector<Stream*> members;
  // clocks[i][j]: how many operations of member j member i's next work is
  // ordered after (missing entries are 0); clocks[i][i] counts member i's
  // own: its nodes, plus 1 for joining. Note [Cross-stream capture].
  std::vector<std::vector<uint64_t>> clocks;
};

namespace {

// Guards every Capture and every stream's capture_ / capture_member_. Taken
// alone (never together with Stream::mu_ or Event::mu), except that the
// tracer's lock may be taken under it.
std::mutex g_capture_mu;
std::vector<Capture*>* g_live_captures = new std::vector<Capture*>();  // leaked: see Note [Leaked singletons]
uint64_t g_next_capture_id = 0;

Capture* FindLiveCapture(uint64_t id) {
  for (Capture* c : *g_live_captures)
    if (c->id == id) return c;
  return nullptr;
}

// g_capture_mu held. Marks `c` invalidated by `what` (the first reason wins).
void InvalidateLocked(Capture* c, const char* what) {
  if (!c->error.empty()) return;
  try {
    c->error = what;
  } catch (...) {
    c->error = "?";
  }
}

kilnError_t FailRefused(const char* what) {
  return Fail(kilnErrorStreamCaptureUnsupported,
              "operation not permitted when stream is capturing: %s; the capture is now "
              "invalidated (end it, then capture again without this operation)",
              what);
}

void MergeClock(std::vector<uint64_t>& into, const std::vector<uint64_t>& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t j = 0; j < from.size(); ++j) into[j] = std::max(into[j], from[j]);
}

}  // namespace

kilnError_t Stream::BeginCapture() {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  if (is_default())
    return Fail(kilnErrorStreamCaptureUnsupported,
                "operation not permitted when stream is capturing: the default stream of kiln "
                "device %d cannot capture; capture on a stream from kilnStreamCreate (graphs may "
                "be launched on the default stream afterwards)",
                device());
  if (capture_ != nullptr)
    return Fail(kilnErrorIllegalState,
                "the stream is already capturing (it began or joined a capture); end that capture "
                "(kilnStreamEndCapture on the stream that began it) before beginning another");
  auto* c = new (std::nothrow) Capture();
  Graph* graph = new (std::nothrow) Graph();
  if (c == nullptr || graph == nullptr) {
    delete c;
    delete graph;
    return Fail(kilnErrorMemoryAllocation, "out of host memory for a new capture");
  }
  try {
    c->members.push_back(this);
    c->clocks.emplace_back(1, 0);
    g_live_captures->push_back(c);
  } catch (const std::bad_alloc&) {
    delete c;
    delete graph;
    return Fail(kilnErrorMemoryAllocation, "out of host memory for a new capture");
  }
  c->id = ++g_next_capture_id;
  c->device = device();
  c->graph = graph;
  graph->device = device();
  capture_ = c;
  capture_member_ = 0;
  capturing_.store(true, std::memory_order_release);
  return kilnSuccess;
}

kilnError_t Stream::EndCapture(Graph** out) {
  *out = nullptr;
  Capture* c = nullptr;
  std::string unjoined;
  {
    std::lock_guard<std::mutex> lock(g_capture_mu);
    c = capture_;
    if (c == nullptr)
      return Fail(kilnErrorIllegalState,
                  "the stream is not capturing (kilnStreamBeginCapture was not called, or the "
                  "capture has already ended)");
    if (c->members[0] != this) {
      InvalidateLocked(c, "kilnStreamEndCapture on a stream that joined the capture");
      return Fail(kilnErrorStreamCaptureUnmatched,
                  "this stream joined a capture that another stream (id %llu) began; end the "
                  "capture on that stream. The capture is now invalidated",
                  static_cast<unsigned long long>(c->members[0]->id()));
    }
    const std::vector<uint64_t>& origin = c->clocks[0];
    for (size_t j = 1; j < c->members.size(); ++j) {
      const uint64_t known = j < origin.size() ? origin[j] : 0;
      if (known < c->clocks[j][j])
        unjoined += StrFormat("%s%llu", unjoined.empty() ? "" : ", ",
                              static_cast<unsigned long long>(c->members[j]->id()));
    }
    for (Stream* member : c->members) {
      member->capture_ = nullptr;
      member->capturing_.store(false, std::memory_order_release);
    }
    auto& live = *g_live_captures;
    live.erase(std::remove(live.begin(), live.end(), c), live.end());
  }
  Graph* graph = c->graph;
  const std::string error = std::move(c->error);
  delete c;
  if (!error.empty()) {
    GraphUnref(graph);  // releases what was recorded before the invalidation
    return Fail(kilnErrorStreamCaptureInvalidated,
                "the capture was invalidated by an earlier operation, so no graph was made: %s",
                error.c_str());
  }
  if (!unjoined.empty()) {
    GraphUnref(graph);
    return Fail(kilnErrorStreamCaptureUnjoined,
                "streams that joined the capture (ids %s) have captured work that this stream "
                "does not wait for; before ending the capture, record an event on each after its "
                "last work and make this stream wait for it (kilnStreamWaitEvent). No graph was "
                "made",
                unjoined.c_str());
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

kilnStreamCaptureStatus Stream::CaptureStatus(uint64_t* id) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  if (id != nullptr) *id = capture_ != nullptr ? capture_->id : 0;
  if (capture_ == nullptr) return kilnStreamCaptureStatusNone;
  return capture_->error.empty() ? kilnStreamCaptureStatusActive
                                 : kilnStreamCaptureStatusInvalidated;
}

kilnError_t Stream::RefuseIfCapturing(const char* what) {
  if (!capturing_.load(std::memory_order_acquire)) return kilnSuccess;
  std::lock_guard<std::mutex> lock(g_capture_mu);
  if (capture_ == nullptr) return kilnSuccess;
  InvalidateLocked(capture_, what);
  return FailRefused(what);
}

kilnError_t Stream::SubmitCaptured(Entry& e, uint64_t* seq, bool* consumed, bool* captured) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  Capture* c = capture_;
  if (c == nullptr) return kilnSuccess;  // ended meanwhile: submit normally
  *captured = true;
  if (!alive_.load(std::memory_order_acquire))
    return Fail(kilnErrorInvalidResourceHandle, "the stream was destroyed");
  if (!c->error.empty())
    return Fail(kilnErrorStreamCaptureInvalidated,
                "the capture of this stream was invalidated by %s; end the capture "
                "(kilnStreamEndCapture) and capture again",
                c->error.c_str());
  const bool recordable = e.kind == EntryKind::kTask || e.kind == EntryKind::kMemset ||
                          (e.kind == EntryKind::kCopy && e.outcome == nullptr && e.staging == nullptr);
  if (!recordable) {
    const char* what = e.kind == EntryKind::kGraph ? "kilnGraphLaunch onto the capturing stream"
                                                   : "this kind of work on the capturing stream";
    InvalidateLocked(c, what);
    return FailRefused(what);
  }
  try {
    c->graph->nodes.push_back(e);
  } catch (const std::bad_alloc&) {
    return Fail(kilnErrorMemoryAllocation, "out of host memory while capturing (%zu nodes)",
                c->graph->nodes.size());
  }
  ++c->clocks[capture_member_][capture_member_];
  Entry& node = c->graph->nodes.back();
  if (node.trace != nullptr) {  // work of the launch, not of the capture
    GetRuntime().tracer.Discard(node.trace);
    node.trace = nullptr;
  }
  e.trace = nullptr;
  if (seq != nullptr) *seq = submitted_.load(std::memory_order_relaxed);
  if (consumed != nullptr) *consumed = true;
  return kilnSuccess;
}

kilnError_t Stream::MarkCapturedRecord(CapturedRecord* record, bool* captured) {
  *captured = false;
  if (!capturing_.load(std::memory_order_acquire)) return kilnSuccess;
  std::lock_guard<std::mutex> lock(g_capture_mu);
  Capture* c = capture_;
  if (c == nullptr) return kilnSuccess;  // ended meanwhile: record normally
  if (!c->error.empty())
    return Fail(kilnErrorStreamCaptureInvalidated,
                "the capture of this stream was invalidated by %s; end the capture "
                "(kilnStreamEndCapture) and capture again",
                c->error.c_str());
  record->capture_id = c->id;
  record->clock = c->clocks[capture_member_];  // may throw bad_alloc: ApiCall reports it
  *captured = true;
  return kilnSuccess;
}

kilnError_t Stream::WaitCapturedRecord(const CapturedRecord& record) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  Capture* c = FindLiveCapture(record.capture_id);
  Capture* mine = capture_;
  if (c == nullptr) {
    if (mine != nullptr) InvalidateLocked(mine, "a wait for an event recorded in an ended capture");
    return Fail(kilnErrorCapturedEvent,
                "the event's latest record was made during a capture that has ended, so there "
                "is nothing to wait for; record the event again outside a capture first");
  }
  if (mine == c) {  // a member waits for another member: only the ordering
    MergeClock(c->clocks[capture_member_], record.clock);
    return kilnSuccess;
  }
  if (mine != nullptr) {
    InvalidateLocked(mine, "a wait for an event recorded in another capture");
    InvalidateLocked(c, "a wait from a stream of another capture for an event of this one");
    return Fail(kilnErrorStreamCaptureMerge,
                "the stream is capturing (capture %llu) and the event was recorded in another "
                "capture (%llu): two captures cannot be merged. Both are now invalidated",
                static_cast<unsigned long long>(mine->id),
                static_cast<unsigned long long>(c->id));
  }
  if (is_default()) {
    InvalidateLocked(c, "the default stream waited for an event of the capture");
    return Fail(kilnErrorStreamCaptureImplicit,
                "the default stream of kiln device %d would join a capture by waiting for an "
                "event recorded in it, and a default stream cannot capture; use a stream from "
                "kilnStreamCreate. The capture is now invalidated",
                device());
  }
  if (device() != c->device) {
    InvalidateLocked(c, "a stream of another device waited for an event of the capture");
    return Fail(kilnErrorInvalidValue,
                "a stream of kiln device %d cannot join a capture of kiln device %d (a graph "
                "runs on one device). The capture is now invalidated",
                device(), c->device);
  }
  if (!c->error.empty())
    return Fail(kilnErrorStreamCaptureInvalidated,
                "the capture this wait would join was invalidated by %s", c->error.c_str());
  std::vector<uint64_t> clock = record.clock;
  const size_t index = c->members.size();
  clock.resize(index + 1, 0);
  clock[index] = 1;  // joining is an operation the origin must be ordered after
  c->clocks.push_back(std::move(clock));
  try {
    c->members.push_back(this);
  } catch (...) {
    c->clocks.pop_back();
    throw;
  }
  capture_ = c;
  capture_member_ = index;
  capturing_.store(true, std::memory_order_release);
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

KILN_API kilnError_t kilnStreamGetCaptureInfo(kilnStream_t stream, kilnStreamCaptureStatus* status,
                                              unsigned long long* id) {
  return ApiCall("kilnStreamGetCaptureInfo", [&](Runtime& rt) {
    if (status == nullptr) return Fail(kilnErrorInvalidValue, "status is NULL");
    Stream* s = nullptr;
    if (kilnError_t err = kiln::ResolveStream(rt, stream, &s)) return err;
    uint64_t capture = 0;
    *status = s->CaptureStatus(&capture);
    if (id != nullptr) *id = capture;
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

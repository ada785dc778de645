#include "core/KilnGraph.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>

#include <c10/util/Exception.h>

#include "core/KilnCachingAllocator.h"
#include "core/KilnException.h"
#include "core/KilnFunctions.h"
#include "core/KilnGenerator.h"

namespace c10::kiln {

// Note [Kiln graphs]
// ~~~~~~~~~~~~~~~~~~
// torch.kiln.KilnGraph is CUDA's CUDAGraph on kiln streams, built on the
// runtime's stream capture (Note [Stream capture] in runtime/src/graph.cc):
//  * Capture. capture_begin starts a runtime capture of the current stream
//    (never the default stream, as CUDA) and routes that stream's
//    allocations to the graph's private memory pool (Note [Graph memory
//    pools] in KilnCachingAllocator.cc). Eager ops then run exactly as
//    always — outputs allocated on the calling thread, a KernelLaunch or
//    task handed to kilnLaunchTask — but the runtime records the task
//    instead of queueing it. So capture does not run the work, and replay
//    runs the very launch records eager would have run: same kernels, same
//    results, no second launch mechanism. Captured launch records are
//    marked (isStreamCapturing at launch) so their release at graph
//    destruction is not mistaken for a skipped kernel.
//  * Replay. One kilnGraphLaunch on the current stream: one queue entry that
//    runs every captured task on the worker, with no per-op work on the
//    calling thread. Inputs and outputs are the capture's tensors (static
//    addresses); the user refills inputs with copy_.
//  * Side streams join a capture as on CUDA (`side.wait_stream(capturing)`,
//    work on `side`, `capturing.wait_stream(side)`): the runtime records
//    their work into the same graph (Note [Cross-stream capture] in
//    runtime/src/graph.cc), their allocations come from the graph's pool
//    (the allocator matches the runtime's capture id), and their random
//    ops order the graph's generators like the capturing stream's.
//  * Refused during capture (RuntimeError "operation not permitted when
//    stream is capturing", and the capture is invalidated): anything that
//    waits for a stream of the capture — host reads (item(), printing,
//    nonzero, blocking copies to the host), synchronize() of the stream or
//    its device, an op's first-call layout check (warm up first, as CUDA's
//    docs require) — and waits for pending work of streams outside the
//    capture, and host copies other than asynchronous ones with pinned
//    memory (Note [Host copies in a capture] in aten/Copy.cc: those are
//    recorded). A side stream not joined back before capture_end fails the
//    capture (CUDA's "capturing stream has unjoined work"). Streams outside
//    the capture keep working, in every capture_error_mode.
//  * Random numbers. Kiln random kernels draw from the device generator's
//    engine when they *run* (Note [Kiln random numbers]), so a captured
//    dropout or randn draws new numbers at every replay, and the sequence of
//    replays draws exactly what running the captured ops eagerly, in the
//    same order, would draw from the same generator state (CUDA advances a
//    Philox offset per replay for the same effect). Each replay orders the
//    generators the capture used on the replay stream (engineForLaunch), so
//    manual_seed and get_state after a replay wait for it. A random op
//    captured after random work on another stream makes the host wait for
//    that work (a capture cannot wait for another stream); random ops on
//    other streams during a capture are not ordered against the capture.

namespace detail {
std::atomic<int> captures_underway{0};
} // namespace detail

namespace {

// The graphs capturing now, by the runtime's capture id (the same for the
// capture's stream and every stream that joined it).
std::mutex g_registry_mutex;
std::vector<std::pair<unsigned long long, KilnGraph*>>& capturingGraphs() {
  static auto* graphs = new std::vector<std::pair<unsigned long long, KilnGraph*>>(); // leaked
  return *graphs;
}

// The runtime's id of the capture `stream` is part of, 0 if none.
unsigned long long captureIdOf(const KilnStream& stream) {
  kilnStreamCaptureStatus status = kilnStreamCaptureStatusNone;
  unsigned long long id = 0;
  KILN_CHECK(kilnStreamGetCaptureInfo(stream.stream(), &status, &id));
  return id;
}

} // namespace

MempoolId_t graphPoolHandle() {
  return KilnCachingAllocator::newPoolId(/*user_created=*/false);
}

bool isStreamCapturing(const KilnStream& stream) {
  if (C10_LIKELY(!anyCaptureUnderway())) {
    return false;
  }
  kilnStreamCaptureStatus status = kilnStreamCaptureStatusNone;
  KILN_CHECK(kilnStreamIsCapturing(stream.stream(), &status));
  return status != kilnStreamCaptureStatusNone;
}

void refuseWhileCapturing(const char* op, CaptureRefusal reason) {
  if (C10_LIKELY(!anyCaptureUnderway())) {
    return;
  }
  const KilnStream stream = getCurrentKilnStream(current_device());
  if (!isStreamCapturing(stream)) {
    return;
  }
  const char* why = "";
  switch (reason) {
    case CaptureRefusal::HostRead:
      why = "it waits for the device to read device data on the host (item(), printing, "
            "nonzero, a blocking copy to the host, ...), and captured work does not run until "
            "the graph is replayed";
      break;
    case CaptureRefusal::LayoutCheck:
      why = "kiln checks an op's meta kernel against its CPU kernel on its first call with each "
            "layout class, which waits for the device. Run the captured code once before "
            "capturing it (warm-up, as torch.cuda.graph requires)";
      break;
    case CaptureRefusal::HostCopy:
      why = "a capture records only asynchronous copies (non_blocking=True) between kiln "
            "tensors and dense pinned host tensors (each replay reads or writes that memory "
            "anew); this copy is blocking, uses pageable memory, or needs a conversion on the "
            "host. Use a pinned tensor (pin_memory()) of the kiln tensor's dtype and layout "
            "with non_blocking=True, or fill a static kiln tensor with copy_ before replay() "
            "and read results after it";
      break;
  }
  // The runtime refuses a query of the capturing stream and invalidates the
  // capture, so the graph can never be replayed without this op.
  const kilnError_t status = kilnStreamQuery(stream.stream());
  const std::string detail = status == kilnSuccess || status == kilnErrorNotReady
      ? std::string("the capture could not be invalidated")
      : std::string(kilnGetLastErrorMessage());
  TORCH_CHECK(false, op, ": operation not permitted when stream is capturing: ", why,
              ". The capture is invalidated (", detail, ").");
}

void noteCapturedGenerator(const KilnStream& stream, const at::Generator& generator) {
  if (C10_LIKELY(!anyCaptureUnderway())) {
    return;
  }
  const unsigned long long capture = captureIdOf(stream);
  if (capture == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  for (auto& [id, graph] : capturingGraphs()) {
    if (id == capture) {
      graph->noteGenerator(generator);
    }
  }
}

void KilnGraph::noteGenerator(const at::Generator& generator) {
  for (const at::Generator& known : generators_) {
    if (known == generator) {
      return;
    }
  }
  generators_.push_back(generator);
}

KilnGraph::~KilnGraph() {
  try {
    if (capturing_) {
      // Destroyed mid-capture (an exception left the capture): end it and
      // drop whatever was recorded.
      kilnGraph_t discarded = nullptr;
      {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        auto& graphs = capturingGraphs();
        graphs.erase(std::remove_if(graphs.begin(), graphs.end(),
                                    [this](const auto& entry) { return entry.second == this; }),
                     graphs.end());
      }
      if (kilnStreamEndCapture(capture_stream_->stream(), &discarded) == kilnSuccess) {
        KILN_WARN(kilnGraphDestroy(discarded));
      }
      detail::captures_underway.fetch_sub(1);
      capturing_ = false;
      KilnCachingAllocator::endAllocateToPool(device_, mempool_id_);
      KilnCachingAllocator::releasePool(device_, mempool_id_);
    }
    reset();
  } catch (const std::exception& e) {
    TORCH_WARN("KilnGraph destructor: ", e.what());
  }
}

void KilnGraph::capture_begin(MempoolId_t pool, const std::string& capture_error_mode) {
  TORCH_CHECK(!has_graph_ && !capturing_,
              "This KilnGraph instance already owns a captured graph (or is capturing). To "
              "capture a new graph, create a new instance or call reset() first.");
  TORCH_CHECK(capture_error_mode == "global" || capture_error_mode == "thread_local" ||
                  capture_error_mode == "relaxed",
              "Unknown capture_error_mode '", capture_error_mode,
              "': expected 'global', 'thread_local' or 'relaxed'");
  const DeviceIndex device = current_device();
  const KilnStream stream = getCurrentKilnStream(device);
  TORCH_CHECK(stream != getDefaultKilnStream(device),
              "Kiln graphs must be captured on a non-default stream. (However, after capture, "
              "it's ok to replay them on the default stream.) Capture inside `with "
              "torch.kiln.graph(g):`, or `with torch.kiln.stream(torch.kiln.Stream()):`.");
  TORCH_CHECK(!isStreamCapturing(stream), "Cannot begin a kiln graph capture on kiln:",
              static_cast<int>(device), " stream ", stream.id(),
              ": the stream is already capturing (nested captures on one stream are not "
              "allowed; end the outer capture first).");
  // A pool token must be one kiln handed out: a made-up one would silently
  // share (or create) a pool nobody else can name.
  TORCH_CHECK_VALUE(
      (pool.first == 0 && pool.second == 0) || KilnCachingAllocator::isIssuedPoolId(pool),
      "kiln graph capture: pool (", pool.first, ", ", pool.second, ") is not a memory pool "
      "kiln made. Pass None (a private pool for this graph), "
      "torch.kiln.graph_pool_handle(), another graph's pool() or a torch.kiln.MemPool's id.");
  const MempoolId_t id = pool.first != 0 || pool.second != 0
      ? pool
      : KilnCachingAllocator::newPoolId(/*user_created=*/false);
  KILN_CHECK(kilnStreamBeginCapture(stream.stream(), 0));
  bool routed = false;
  try {
    const unsigned long long capture = captureIdOf(stream);
    KilnCachingAllocator::beginAllocateToPool(device, id, stream.id(), capture);
    routed = true;
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    capturingGraphs().emplace_back(capture, this);
  } catch (...) {
    if (routed) {
      KilnCachingAllocator::endAllocateToPool(device, id);
      KilnCachingAllocator::releasePool(device, id);
    }
    kilnGraph_t discarded = nullptr;
    if (kilnStreamEndCapture(stream.stream(), &discarded) == kilnSuccess) {
      KILN_WARN(kilnGraphDestroy(discarded));
    }
    throw;
  }
  detail::captures_underway.fetch_add(1);
  capturing_ = true;
  device_ = device;
  mempool_id_ = id;
  capture_stream_ = stream;
  generators_.clear();
}

void KilnGraph::capture_end() {
  TORCH_CHECK(capturing_, "Called KilnGraph::capture_end without a preceding capture_begin.");
  TORCH_CHECK(getCurrentKilnStream(device_) == *capture_stream_,
              "Capture must end on the same stream it began on.");
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto& graphs = capturingGraphs();
    graphs.erase(std::remove_if(graphs.begin(), graphs.end(),
                                [this](const auto& entry) { return entry.second == this; }),
                 graphs.end());
  }
  kilnGraph_t graph = nullptr;
  const kilnError_t status = kilnStreamEndCapture(capture_stream_->stream(), &graph);
  detail::captures_underway.fetch_sub(1);
  capturing_ = false;
  KilnCachingAllocator::endAllocateToPool(device_, mempool_id_);
  if (status != kilnSuccess) {
    KilnCachingAllocator::releasePool(device_, mempool_id_);
    mempool_id_ = {0, 0};
    generators_.clear();
    KILN_CHECK(status);
  }
  graph_ = graph;
  has_graph_ = true;
}

void KilnGraph::replay() {
  TORCH_CHECK(has_graph_, "Called KilnGraph::replay without a preceding successful capture.");
  const DeviceIndex previous = exchange_device(device_);
  try {
    const KilnStream stream = getCurrentKilnStream(device_);
    for (const at::Generator& generator : generators_) {
      // Orders this replay's random kernels like an eager random launch.
      generator.get<KilnGeneratorImpl>()->engineForLaunch(stream);
    }
    KILN_CHECK(kilnGraphLaunch(graph_, stream.stream()));
  } catch (...) {
    exchange_device(previous);
    throw;
  }
  exchange_device(previous);
}

void KilnGraph::reset() {
  TORCH_CHECK(!capturing_, "Called KilnGraph::reset during a capture; end the capture first.");
  if (!has_graph_) {
    return;
  }
  has_graph_ = false;
  KILN_CHECK(kilnGraphDestroy(graph_));
  graph_ = nullptr;
  generators_.clear();
  KilnCachingAllocator::releasePool(device_, mempool_id_);
  mempool_id_ = {0, 0};
}

MempoolId_t KilnGraph::pool() const {
  TORCH_CHECK(has_graph_ || capturing_,
              "Called KilnGraph::pool() without a preceding successful capture.");
  return mempool_id_;
}

size_t KilnGraph::num_nodes() const {
  if (!has_graph_) {
    return 0;
  }
  size_t count = 0;
  KILN_CHECK(kilnGraphGetNodeCount(graph_, &count));
  return count;
}

} // namespace c10::kiln

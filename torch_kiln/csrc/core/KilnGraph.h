// KilnGraph.h — kiln graphs: capture of a kiln stream's work and its replay,
// with CUDA Graphs' semantics (at::cuda::CUDAGraph). Bound as
// torch_kiln._C._KilnGraph; users call torch.kiln.KilnGraph / torch.kiln.graph.
//
// See Note [Kiln graphs] in KilnGraph.cc (what is captured, memory pools,
// random numbers, errors) and Note [Stream capture] in runtime/src/graph.cc.
//
// Thread-safety: one KilnGraph is used by one thread at a time (as CUDAGraph);
// the capture registry functions below are thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>

#include "core/KilnStream.h"

namespace c10::kiln {

class KilnGraph {
 public:
  KilnGraph() = default;
  KilnGraph(const KilnGraph&) = delete;
  KilnGraph& operator=(const KilnGraph&) = delete;
  ~KilnGraph();

  // Begins capturing the current stream of the current device. `pool` {0, 0}
  // makes a private memory pool for this graph; another graph's pool() or a
  // graph_pool_handle() or a MemPool's id shares that pool; any other id
  // raises c10::ValueError (a made-up token). `capture_error_mode` must be
  // "global", "thread_local" or "relaxed" (CUDA's names); kiln applies one
  // rule in every mode (Note [Kiln graphs]). Raises c10::Error if this graph
  // already holds a capture, the current stream is the default stream, or
  // the stream is already capturing.
  void capture_begin(MempoolId_t pool = {0, 0}, const std::string& capture_error_mode = "global");
  // Ends the capture begun by capture_begin (on the same stream). Raises
  // c10::Error naming the operation that invalidated the capture, if one did
  // (the graph then holds nothing). (torch.kiln.KilnGraph warns if nothing
  // was captured.)
  void capture_end();
  // Launches the captured work on the current stream of the capture's device:
  // one queue entry, ordered after earlier work there.
  void replay();
  // Drops the captured graph and this graph's use of its memory pool.
  void reset();
  // The memory pool id; raises if there is no capture.
  MempoolId_t pool() const;
  // Captured nodes (tasks, copies, memsets); 0 if there is no capture.
  size_t num_nodes() const;

  // For the kiln generator: `generator` drew numbers in work captured on
  // this graph's stream; each replay orders it like an eager random launch.
  void noteGenerator(const at::Generator& generator);

 private:
  kilnGraph_t graph_ = nullptr;
  bool has_graph_ = false;
  bool capturing_ = false;
  MempoolId_t mempool_id_{0, 0};
  DeviceIndex device_ = -1;
  std::optional<KilnStream> capture_stream_;
  std::vector<at::Generator> generators_;
};

namespace detail {
extern std::atomic<int> captures_underway; // kiln graph captures in the process
} // namespace detail

// Whether any kiln graph capture is underway in the process (one relaxed
// load: the hot paths' test before asking the runtime).
inline bool anyCaptureUnderway() {
  return detail::captures_underway.load(std::memory_order_relaxed) != 0;
}

// A new id for a memory pool graphs may share (torch.kiln.graph_pool_handle).
MempoolId_t graphPoolHandle();

// Whether `stream` is capturing (active or invalidated). One relaxed load
// when no capture is underway in the process.
bool isStreamCapturing(const KilnStream& stream);

// Why an op cannot be captured (refuseWhileCapturing).
enum class CaptureRefusal {
  HostRead,    // it waits for the device to read device data on the host
  LayoutCheck, // kiln's first-call meta-kernel check waits (warm up first)
  HostCopy,    // an asynchronous copy to or from pageable host memory, or
               // one that needs a host-side staging copy: only dense copies
               // with pinned memory are captured
};

// Called by an op before it waits for the current stream or makes a host
// copy a capture cannot record: if that stream is capturing, invalidates the
// capture and raises c10::Error naming `op` ("operation not permitted when
// stream is capturing") and the reason. One relaxed load otherwise.
void refuseWhileCapturing(const char* op, CaptureRefusal reason);

// For KilnGeneratorImpl::engineForLaunch: notes `generator` with the graph
// capturing `stream`, if any.
void noteCapturedGenerator(const KilnStream& stream, const at::Generator& generator);

} // namespace c10::kiln

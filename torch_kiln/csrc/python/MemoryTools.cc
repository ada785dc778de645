// The bindings behind torch.kiln's memory tools: memory history and snapshots
// (torch.kiln.memory._record_memory_history, _snapshot, memory_snapshot) and
// the per-process memory fraction. The snapshot is built in
// the dictionary format of torch/csrc/cuda/Module.cpp (memorySnapshot), so
// torch.cuda._memory_viz and pytorch.org/memory_viz read kiln's snapshots.
// See Note [Kiln memory history] in core/KilnCachingAllocator.cc.
#include "python/MemoryTools.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/util/irange.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/KilnCachingAllocator.h"
#include "core/KilnFunctions.h"
#include "core/KilnStream.h"

namespace py = pybind11;

namespace torch_kiln {
namespace {

namespace alloc = c10::kiln::KilnCachingAllocator;
using alloc::TraceEntry;

// Python (and TorchScript) frames, as CUDA's bindings record them.
std::shared_ptr<c10::GatheredContext> gatherPython() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, /*cpp=*/false);
}

// Python, TorchScript and C++ frames (stacks="all").
std::shared_ptr<c10::GatheredContext> gatherPythonAndCpp() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, /*cpp=*/true);
}

TraceEntry::Action parseAction(const std::string& name) {
  static const std::unordered_map<std::string, TraceEntry::Action> actions = {
      {"alloc", TraceEntry::ALLOC},
      {"free_requested", TraceEntry::FREE_REQUESTED},
      {"free_completed", TraceEntry::FREE_COMPLETED},
      {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
      {"segment_free", TraceEntry::SEGMENT_FREE},
      {"oom", TraceEntry::OOM},
      {"snapshot", TraceEntry::SNAPSHOT},
  };
  const auto it = actions.find(name);
  TORCH_CHECK_VALUE(it != actions.end(), "Unknown memory history action '", name,
                    "' in skip_actions (allowed: alloc, free_requested, free_completed, "
                    "segment_alloc, segment_free, oom, snapshot)");
  return it->second;
}

const char* actionName(TraceEntry::Action action) {
  switch (action) {
    case TraceEntry::ALLOC:
      return "alloc";
    case TraceEntry::FREE_REQUESTED:
      return "free_requested";
    case TraceEntry::FREE_COMPLETED:
      return "free_completed";
    case TraceEntry::SEGMENT_ALLOC:
      return "segment_alloc";
    case TraceEntry::SEGMENT_FREE:
      return "segment_free";
    case TraceEntry::SEGMENT_MAP:
      return "segment_map";
    case TraceEntry::SEGMENT_UNMAP:
      return "segment_unmap";
    case TraceEntry::SNAPSHOT:
      return "snapshot";
    case TraceEntry::OOM:
      return "oom";
  }
  return "unknown";
}

// enabled: "state" | "all" | None; context: "state" | "alloc" | "all" | None;
// stacks: "python" | "all" (validated in torch_kiln/kiln/memory.py, checked
// again here since the binding is reachable directly).
void recordMemoryHistory(const std::optional<std::string>& enabled,
                         const std::optional<std::string>& context, const std::string& stacks,
                         size_t max_entries, bool clear_history,
                         const std::vector<std::string>& skip_actions) {
  TORCH_CHECK_VALUE(!enabled || *enabled == "state" || *enabled == "all",
                    "enabled must be 'state', 'all' or None, not '", *enabled, "'");
  TORCH_CHECK_VALUE(!context || *context == "state" || *context == "alloc" || *context == "all",
                    "context must be 'state', 'alloc', 'all' or None, not '", *context, "'");
  TORCH_CHECK_VALUE(stacks == "python" || stacks == "all",
                    "stacks must be 'python' or 'all', not '", stacks, "'");
  std::vector<TraceEntry::Action> skip;
  for (const std::string& name : skip_actions) {
    skip.push_back(parseAction(name));
  }
  alloc::CreateContextFn recorder = gatherPython;
  if (enabled && stacks == "all") {
    recorder = gatherPythonAndCpp;
    torch::unwind::unwind(); // warm up C++ unwinding, as CUDA does
  }
  auto when = alloc::RecordContext::NEVER;
  if (context == "all") {
    when = alloc::RecordContext::ALL;
  } else if (context == "alloc") {
    when = alloc::RecordContext::ALLOC;
  } else if (context == "state") {
    when = alloc::RecordContext::STATE;
  }
  // "state" keeps the current allocations' contexts only: CUDA then keeps a
  // trace of a single entry.
  const size_t entries = (enabled && *enabled == "all") ? max_entries : 1;
  c10::kiln::device_count_ensure_non_zero();
  alloc::recordHistory(enabled.has_value(), recorder, entries, when, clear_history, skip);
}

// The snapshot as Python objects (needs the GIL, to symbolize Python frames).
// `pool` other than (0, 0): only that memory pool's segments.
py::dict memorySnapshot(bool include_traces, std::pair<uint64_t, uint64_t> pool) {
  const py::str device_s = "device", address_s = "address", total_size_s = "total_size",
                allocated_size_s = "allocated_size", active_size_s = "active_size",
                requested_size_s = "requested_size", stream_s = "stream",
                segment_type_s = "segment_type", segment_pool_id_s = "segment_pool_id",
                is_expandable_s = "is_expandable", large_s = "large", small_s = "small",
                size_s = "size", state_s = "state", active_allocated_s = "active_allocated",
                active_pending_free_s = "active_pending_free", inactive_s = "inactive",
                blocks_s = "blocks", frames_s = "frames", action_s = "action", addr_s = "addr",
                device_free_s = "device_free", time_us_s = "time_us";

  // Frames are symbolized at the end, all at once (as CUDA does): contexts
  // repeat across blocks and trace entries.
  std::vector<torch::CapturedTraceback*> to_symbolize;
  std::vector<py::dict> destinations;
  const auto addFrames = [&](const py::dict& d, const std::shared_ptr<c10::GatheredContext>& ctx) {
    if (ctx) {
      to_symbolize.push_back(torch::getCapturedTracebackFromContext(ctx));
      destinations.push_back(d);
    } else {
      d[frames_s] = py::list();
    }
  };

  const alloc::SnapshotInfo snapshot = alloc::snapshot(include_traces, {pool.first, pool.second});

  py::list segments;
  for (const auto& segment : snapshot.segments) {
    py::dict s;
    s[device_s] = static_cast<int>(segment.device);
    s[address_s] = segment.address;
    s[total_size_s] = segment.total_size;
    s[allocated_size_s] = segment.allocated_size;
    s[active_size_s] = segment.active_size;
    s[requested_size_s] = segment.requested_size;
    s[stream_s] = reinterpret_cast<intptr_t>(segment.stream);
    s[segment_type_s] = segment.is_large ? large_s : small_s;
    s[segment_pool_id_s] =
        py::make_tuple(segment.owner_private_pool_id.first, segment.owner_private_pool_id.second);
    s[is_expandable_s] = false;
    addFrames(s, segment.context_when_allocated);
    py::list blocks;
    size_t address = segment.address;
    for (const auto& block : segment.blocks) {
      py::dict b;
      b[address_s] = address;
      b[size_s] = block.size;
      b[requested_size_s] = block.requested_size;
      b[state_s] = block.allocated ? active_allocated_s
                                   : (block.active ? active_pending_free_s : inactive_s);
      addFrames(b, block.context_when_allocated);
      blocks.append(b);
      address += block.size;
    }
    s[blocks_s] = blocks;
    segments.append(s);
  }

  py::list traces;
  for (const auto& device_trace : snapshot.device_traces) {
    py::list trace;
    for (const TraceEntry& entry : device_trace) {
      py::dict e;
      e[action_s] = actionName(entry.action_);
      e[entry.action_ == TraceEntry::OOM ? device_free_s : addr_s] = entry.addr_;
      e[size_s] = entry.size_;
      e[stream_s] = reinterpret_cast<intptr_t>(entry.stream_);
      e[device_s] = static_cast<int>(entry.device_);
      e[time_us_s] = static_cast<int64_t>(entry.time_.t_);
      addFrames(e, entry.context_);
      trace.append(e);
    }
    traces.append(trace);
  }

  const alloc::AllocatorSettings kiln_settings = alloc::allocatorSettings();
  py::list fractions;
  for (const auto device : c10::irange(c10::kiln::device_count())) {
    fractions.append(alloc::getMemoryFraction(device));
  }
  py::dict settings;
  // CUDA's keys, with what they mean for kiln's allocator: it reads no
  // PYTORCH_CUDA_ALLOC_CONF, never splits by max_split_size, has no
  // expandable segments or garbage collection threshold.
  settings["PYTORCH_CUDA_ALLOC_CONF"] = "";
  settings["max_split_size"] = static_cast<int64_t>(-1);
  settings["garbage_collection_threshold"] = 0.0;
  settings["expandable_segments"] = false;
  settings["pinned_num_register_threads"] = 1;
  settings["release_lock_on_cudamalloc"] = false;
  settings["pinned_use_cuda_host_register"] = false;
  settings["roundup_power2_divisions"] = py::dict();
  // Kiln's own (Note [Kiln caching allocator]).
  settings["min_block_size"] = kiln_settings.min_block_size;
  settings["small_size"] = kiln_settings.small_size;
  settings["small_segment_size"] = kiln_settings.small_segment_size;
  settings["per_process_memory_fraction"] = fractions;

  std::unordered_map<torch::CapturedTraceback*, size_t> unique_index;
  std::vector<torch::CapturedTraceback*> unique;
  for (auto* traceback : to_symbolize) {
    if (unique_index.emplace(traceback, unique.size()).second) {
      unique.push_back(traceback);
    }
  }
  const torch::SymbolizedTracebacks symbolized = torch::symbolize(unique);
  std::vector<py::dict> frame_dicts;
  frame_dicts.reserve(symbolized.all_frames.size());
  for (const auto& frame : symbolized.all_frames) {
    py::dict f;
    f["filename"] = frame.filename;
    f["line"] = frame.lineno;
    f["name"] = frame.funcname;
    frame_dicts.push_back(std::move(f));
  }
  std::vector<py::list> frame_lists;
  for (const auto& traceback : symbolized.tracebacks) {
    py::list frames;
    for (const uint64_t index : traceback) {
      frames.append(frame_dicts.at(index));
    }
    frame_lists.push_back(std::move(frames));
  }
  for (const auto i : c10::irange(to_symbolize.size())) {
    destinations[i][frames_s] = frame_lists.at(unique_index.at(to_symbolize[i]));
  }

  py::dict result;
  result["segments"] = segments;
  result["device_traces"] = traces;
  result["allocator_settings"] = settings;
  return result;
}

py::dict statDict(const c10::CachingAllocator::Stat& stat) {
  py::dict d;
  d["current"] = stat.current;
  d["peak"] = stat.peak;
  d["allocated"] = stat.allocated;
  d["freed"] = stat.freed;
  return d;
}

py::dict durationDict(const c10::CachingAllocator::DurationStat& stat) {
  py::dict d;
  d["total"] = stat.total;
  d["max"] = stat.max;
  d["min"] = stat.min;
  d["count"] = stat.count;
  d["avg"] = stat.count == 0 ? 0 : stat.total / stat.count;
  return d;
}

// The pinned host allocator's statistics, with the keys of
// torch.cuda.host_memory_stats_as_nested_dict.
py::dict hostMemoryStats() {
  const at::HostStats stats = at::getHostAllocator(at::kPrivateUse1)->get_stats();
  py::dict result;
  result["allocations"] = statDict(stats.allocations);
  result["allocated_bytes"] = statDict(stats.allocated_bytes);
  result["active_requests"] = statDict(stats.active_requests);
  result["active_bytes"] = statDict(stats.active_bytes);
  result["num_host_alloc"] = stats.num_host_alloc;
  result["num_host_free"] = stats.num_host_free;
  result["host_alloc_time"] = durationDict(stats.host_alloc_time);
  result["host_free_time"] = durationDict(stats.host_free_time);
  return result;
}

c10::MempoolId_t poolId(std::pair<uint64_t, uint64_t> id) {
  return {id.first, id.second};
}

} // namespace

void initMemoryToolsBindings(py::module_& m) {
  m.def("_record_memory_history", &recordMemoryHistory);
  m.def("_memory_snapshot", &memorySnapshot, py::arg("include_traces"),
        py::arg("pool") = std::pair<uint64_t, uint64_t>{0, 0});
  // torch.kiln.MemPool / use_mem_pool (Note [User memory pools]).
  m.def("_mempool_create", [](int device, bool no_split, bool use_on_oom) {
    const c10::MempoolId_t id = alloc::newPoolId(/*user_created=*/true);
    alloc::createOrIncrefPool(static_cast<c10::DeviceIndex>(device), id, no_split, use_on_oom);
    return std::pair<uint64_t, uint64_t>{id.first, id.second};
  });
  m.def("_mempool_use_count", [](int device, std::pair<uint64_t, uint64_t> id) {
    return alloc::poolUseCount(static_cast<c10::DeviceIndex>(device), poolId(id));
  });
  m.def("_mempool_is_issued", [](std::pair<uint64_t, uint64_t> id) {
    return alloc::isIssuedPoolId(poolId(id));
  });
  m.def("_begin_allocate_current_thread_to_pool", [](int device, std::pair<uint64_t, uint64_t> id) {
    alloc::beginAllocateCurrentThreadToPool(static_cast<c10::DeviceIndex>(device), poolId(id));
  });
  m.def("_end_allocate_current_thread_to_pool", [](int device, std::pair<uint64_t, uint64_t> id) {
    alloc::endAllocateCurrentThreadToPool(static_cast<c10::DeviceIndex>(device), poolId(id));
  });
  m.def("_release_pool", [](int device, std::pair<uint64_t, uint64_t> id) {
    alloc::releasePool(static_cast<c10::DeviceIndex>(device), poolId(id));
  });
  m.def("_empty_pool_cache", [](std::pair<uint64_t, uint64_t> id) {
    alloc::emptyPoolCache(poolId(id));
  });
  // torch.kiln.caching_allocator_alloc / _delete / _enable.
  m.def("_caching_allocator_raw_alloc", [](size_t size, int device, int64_t stream_id) {
    const c10::kiln::KilnStream stream(c10::Stream(
        c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)),
        stream_id));
    return reinterpret_cast<uintptr_t>(
        alloc::rawAlloc(size, static_cast<c10::DeviceIndex>(device), stream));
  });
  m.def("_caching_allocator_raw_delete", [](uintptr_t ptr) {
    alloc::rawDelete(reinterpret_cast<void*>(ptr));
  });
  m.def("_caching_allocator_enable", &alloc::setEnabled);
  m.def("_caching_allocator_is_enabled", &alloc::isEnabled);
  // torch.kiln.host_memory_stats (PyTorch's caching host allocator on kiln).
  m.def("_host_memory_stats", &hostMemoryStats);
  m.def("_reset_accumulated_host_memory_stats",
        [] { at::getHostAllocator(at::kPrivateUse1)->reset_accumulated_stats(); });
  m.def("_reset_peak_host_memory_stats",
        [] { at::getHostAllocator(at::kPrivateUse1)->reset_peak_stats(); });
  m.def("_set_memory_fraction", [](double fraction, int device) {
    alloc::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
  });
  m.def("_get_memory_fraction", [](int device) {
    return alloc::getMemoryFraction(static_cast<c10::DeviceIndex>(device));
  });
}

} // namespace torch_kiln

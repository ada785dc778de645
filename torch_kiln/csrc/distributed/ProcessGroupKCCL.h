// ProcessGroupKCCL.h — `kccl`, the c10d backend for kiln tensors (what NCCL
// is to CUDA): torch.distributed collectives between the ranks' processes,
// through POSIX shared memory (ShmGroup.h) between the ranks of one host and
// Gloo's transport between hosts (CrossHost.h, Note [kccl across hosts]).
//
// Behaviour (NCCL's semantics):
//   * Every collective is a task on the group's *communication stream* of the
//     tensors' kiln device (one stream per group and device, created on first
//     use), launched with the eager executor's mechanism (aten/KilnTask.h).
//     It is ordered after the work already issued on the caller's current
//     stream by a kiln event, and the call returns at once with a WorkKCCL
//     (WorkKCCL.h): wait() makes the current stream wait, the host does not.
//   * The tensors are recorded on the communication stream (record_stream),
//     so the caching allocator never reuses their memory while the collective
//     may still read or write it.
//   * Inside the task, each rank copies its contribution from its device
//     memory into its shared-memory slot, and reads the peers' slots directly
//     (reductions combine them in place, in rank order; Reductions.h).
//   * Failures inside the task (timeout, mismatch) become the communication
//     stream's sticky error (raised at the next synchronization of the
//     device), mark the outputs as failed (reading them raises, Note [Results
//     of failed kernels]) and fail the Work and its Future. See Note [kccl
//     shared-memory protocol] for timeouts and broken groups.
//
// Tensors: dense kiln tensors of one device per call (no multi-device
// lists, as NCCL: one tensor per rank, or per peer for the list forms of
// all_gather, reduce_scatter, gather, scatter, all_to_all); any dtype; shapes
// are free, element counts must match as each collective requires.
// Non-contiguous tensors are staged through a contiguous copy inside the
// task (except all_gather_into_tensor's output and reduce_scatter_tensor's
// input, which must be contiguous, as with NCCL). Arguments are checked on the calling thread: a bad root,
// list length, size or dtype raises c10::ValueError naming what was asked
// and what is allowed.
//
// Thread-safety: collectives may be issued from any thread; they run in the
// order they were issued (Note [kccl issue order], ProcessGroupKCCL.cc).
#pragma once

#include <atomic>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace c10d::kiln {

struct KcclShared;       // the group's transport, issue order and completion thread
struct CollectiveCall;   // one collective, as the task runs it
class CrossHost;         // the collectives of a group that spans hosts

class ProcessGroupKCCL : public c10d::Backend {
 public:
  // Collective over the group's ranks: sets up the shared-memory transport
  // through `store` (which must be this group's PrefixStore). `hosts` lists
  // the group ranks of each host (empty: all on this one); with more than
  // one host, shared memory joins the ranks of each host and the Gloo
  // groups `gloo_leaders` (among the hosts' lowest ranks; null on the
  // others) and `gloo_all` (among all ranks) join the hosts (Note [kccl
  // across hosts]). Throws c10::ValueError for a bad layout and
  // c10::DistBackendError if peers do not arrive within `timeout`.
  ProcessGroupKCCL(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout, const std::string& group_name,
                   std::vector<std::vector<int>> hosts = {},
                   c10::intrusive_ptr<c10d::Backend> gloo_leaders = {},
                   c10::intrusive_ptr<c10d::Backend> gloo_all = {});
  ~ProcessGroupKCCL() override;

  const std::string getBackendName() const override { return "kccl"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  void setSequenceNumberForGroup() override {}

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const BroadcastOptions& opts = BroadcastOptions()) override;
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const AllreduceOptions& opts = AllreduceOptions()) override;
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors,
                                  const ReduceOptions& opts = ReduceOptions()) override;
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const AllgatherOptions& opts = AllgatherOptions()) override;
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const AllgatherOptions& opts = AllgatherOptions()) override;
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const ReduceScatterOptions& opts = ReduceScatterOptions()) override;
  c10::intrusive_ptr<Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const ReduceScatterOptions& opts = ReduceScatterOptions()) override;
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const GatherOptions& opts = GatherOptions()) override;
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const ScatterOptions& opts = ScatterOptions()) override;
  // all_to_all_single: split sizes count rows (dim 0); empty = equal parts.
  // Uneven splits must agree between ranks (else a mismatch error).
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const AllToAllOptions& opts = AllToAllOptions()) override;
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                    const AllToAllOptions& opts = AllToAllOptions()) override;
  // Coalesced forms: one collective per tensor, in order; the last one's
  // Work stands for all.
  c10::intrusive_ptr<Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const AllreduceCoalescedOptions& opts = AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const AllgatherOptions& opts = AllgatherOptions()) override;
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const ReduceScatterOptions& opts = ReduceScatterOptions()) override;
  c10::intrusive_ptr<Work> barrier(const BarrierOptions& opts = BarrierOptions()) override;
  // Point-to-point through shared memory (Note [kccl point-to-point] in
  // ShmGroup.h). `tag` is ignored, as NCCL ignores it. A send that does not
  // fit in one chunk (KCCL_SHM_SLOT_BYTES / world size) waits for its recv.
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;

  // Coalescing (batch_isend_irecv): sends and recvs issued between
  // startCoalescing() and endCoalescing() run as one task whose transfers
  // progress together; endCoalescing() returns its Work. Collectives issued
  // inside the block run as they are issued.
  bool supportsCoalescing() const override { return true; }

  // destroy_process_group() calls this (GIL released): waits for the
  // operations issued on the group (each ends within its timeout), completes
  // their Futures and stops the group's completion thread (Note [kccl
  // completion thread]). Later operations raise DistBackendError.
  // Idempotent.
  void shutdown() override;
  void startCoalescing() override;
  c10::intrusive_ptr<Work> endCoalescing() override;

  // torch.distributed.split_group (and DeviceMesh on a group made with
  // device_id=): Note [Splitting a kccl group], ProcessGroupKCCL.cc.
  // getBackendOptions() is this group's name and timeout; split() returns
  // the new group's backend for the members of `ranks` (this group's ranks,
  // sorted) and null for the others.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  // torch.distributed.monitored_barrier on a kccl group (Note [kccl
  // monitored barrier], MonitoredBarrierKCCL.cc): Gloo's semantics through
  // the group's Store, on the calling thread. Rank 0 raises
  // c10::DistBackendError naming the first rank (every rank, with
  // `wait_all_ranks`) that did not arrive within the timeout; the others
  // raise if rank 0 does not release them.
  void monitoredBarrier(const BarrierOptions& opts, bool wait_all_ranks = false) override;

  // How a new kccl backend is made (set once by torch_kiln.distributed: the
  // same Python creator c10d calls for new_group, which also joins hosts
  // through Gloo). Arguments: the new group's PrefixStore, this process's
  // rank in it, its size, timeout and name.
  using Factory = std::function<c10::intrusive_ptr<c10d::Backend>(
      const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds,
      const std::string&)>;
  static void setFactory(Factory factory);

 private:
  struct PendingP2P {
    bool send;
    int peer;
    at::Tensor tensor;
  };

  c10::intrusive_ptr<Work> enqueue(CollectiveCall call, bool blocking);
  c10::intrusive_ptr<Work> pointToPoint(bool is_send, std::vector<at::Tensor>& tensors, int peer);
  c10::intrusive_ptr<Work> launchPointToPoint(std::vector<PendingP2P> ops);
  // A Work that is already complete (placeholders inside a coalesced block).
  c10::intrusive_ptr<Work> completedWork(c10d::OpType type, const char* name);
  std::chrono::milliseconds timeoutFor(std::chrono::milliseconds requested) const;

  std::shared_ptr<KcclShared> shared_;
  std::shared_ptr<CrossHost> cross_; // null when every rank is on this host
  std::chrono::milliseconds timeout_;
  std::string group_name_;
  c10::intrusive_ptr<c10d::Store> store_; // the group's PrefixStore
  std::string store_tag_;                 // this group's key prefix in it
  uint64_t monitored_barriers_ = 0;       // monitoredBarrier calls so far
  uint64_t seq_ = 0;     // collectives' sequence numbers (compared across ranks)
  uint64_t p2p_seq_ = 0; // send/recv's, numbered apart as in NCCL
  uint64_t order_ = 0;   // every operation, in issue order (Note [kccl issue order])
  std::mutex issue_mutex_;
  std::atomic<bool> shut_down_{false};
  c10::DeviceIndex last_device_ = 0; // barrier's device: the last one used
  // Coalescing state (batch_isend_irecv), guarded by p2p_mutex_.
  std::mutex p2p_mutex_;
  bool coalescing_ = false;
  std::vector<PendingP2P> pending_p2p_;
  c10::intrusive_ptr<Work> coalesced_last_;
};

// At interpreter exit, before finalization (an atexit handler calls it with
// the GIL released): ends every group's completion thread without waiting for
// unfinished operations (Note [kccl completion thread]).
void abandonAllKcclCompletionsAtExit();

} // namespace c10d::kiln

// CrossHost.h — kccl between hosts: the collectives of a group whose ranks
// sit on several hosts, with shared memory inside each host (ShmGroup, one
// per host) and Gloo's transport between hosts (c10d::ProcessGroupGloo,
// made by torch_kiln.distributed on the same Store). Never a protocol of
// kccl's own on the network.
//
// Note [kccl across hosts]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// torch_kiln.distributed groups the ranks by host identity (hostname and
// boot id, or KCCL_HOST_ID), exchanged through the c10d Store when the group
// is made; hosts are numbered in the order of their lowest rank, and each
// host's lowest rank is its *leader*. It makes two Gloo groups: one among
// the leaders (rank = host number) and one among all ranks. Then:
//   * hierarchical (shared memory inside the host, Gloo among leaders):
//       all_reduce, reduce, reduce_scatter(_tensor): every rank's input is
//         gathered to its leader (shared memory), the leaders all-gather the
//         hosts' blocks (Gloo), every leader reduces all ranks' inputs in rank
//         order (Reductions.h) and broadcasts the result to its host. So the
//         numbers are bit-identical to the one-host path (and to the same
//         reduction in rank order with torch on the CPU), whatever the hosts.
//         reduce is an all_reduce whose result only the root keeps;
//         reduce_scatter reduces the whole input and each rank keeps its part.
//         Done in pieces of at most KCCL_SHM_SLOT_BYTES per rank, so a leader
//         holds world_size pieces at a time.
//       all_gather(_into_tensor): gathered to the leaders, all-gathered
//         between them (Gloo), broadcast inside each host.
//       broadcast: inside the root's host, then among the leaders (Gloo),
//         then inside the other hosts.
//     Before the data, the leaders compare what their hosts run (sequence
//     number, kind, dtype, element count, root, op; one small Gloo
//     all_gather) and tell their host (one shared-memory step), so ranks of
//     different hosts that call different collectives fail with "mismatched
//     collectives across hosts" on every rank instead of exchanging garbage.
//   * through Gloo among all ranks, on the bytes of the (staged) tensors:
//       gather, scatter, barrier, send/recv/batch_isend_irecv (also between
//       two ranks of one host), and all_to_all(_single) as one send and one
//       recv per peer, posted together. The descriptions (and all_to_all's
//       split sizes) are compared first, as above (not for send/recv).
//       A send is posted from a copy of its data and its task does not wait
//       for it (a Gloo send waits for the recv to be posted; an ungrouped
//       isend before its irecv must not hold the stream): a send that fails
//       later breaks the group at the group's next operation on that rank.
// Everything runs inside the collective's task on the kiln communication
// stream (Note [kccl issue order]), which waits for Gloo's Work within the
// collective's deadline (a Work given up on is kept, with the tensors it
// holds, for the group's life; receives land in staging buffers). A failure between hosts (a Gloo error or timeout,
// a mismatch) breaks the host's ShmGroup like a shared-memory timeout; the
// other ranks of a failing leader's host then fail at their own deadline.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "distributed/ShmGroup.h"

namespace c10d::kiln {

// Which host each rank of a group is on (Note [kccl across hosts]).
struct HostLayout {
  std::vector<std::vector<int>> hosts; // group ranks of each host, ascending
  std::vector<int> host_of;            // by group rank
  std::vector<int> local_of;           // index of the rank within its host
  int rank = 0;                        // this process's group rank
  int max_local = 1;                   // ranks on the fullest host

  // Throws c10::ValueError unless `hosts` partitions 0 .. size-1 into
  // non-empty ascending lists ordered by their first rank.
  HostLayout(std::vector<std::vector<int>> hosts, int rank, int size);
  int size() const { return static_cast<int>(host_of.size()); }
  int host() const { return host_of[rank]; }
  int localRank() const { return local_of[rank]; }
  int localSize() const { return static_cast<int>(hosts[host()].size()); }
  bool leader() const { return localRank() == 0; }
};

class CrossHost {
 public:
  using Clock = ShmGroup::Clock;
  using Tensors = std::vector<at::Tensor>;

  // `leaders`: the Gloo group among the hosts' leaders (null on the other
  // ranks); `all`: the Gloo group among all ranks.
  CrossHost(HostLayout layout, c10::intrusive_ptr<c10d::Backend> leaders,
            c10::intrusive_ptr<c10d::Backend> all);

  const HostLayout& layout() const { return layout_; }

  // The collectives' task bodies (ProcessGroupKCCL.cc's signature): `local`
  // is this host's ShmGroup; `in`/`out` are flat contiguous host tensors
  // as the one-host bodies get them.
  void allReduce(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                 Tensors& in, Tensors& out, const c10d::ReduceOp& op);
  void reduce(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
              Tensors& in, Tensors& out, const c10d::ReduceOp& op, int root);
  // `in` holds world_size pieces (list form) or one tensor of world_size pieces.
  void reduceScatter(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                     Tensors& in, Tensors& out, const c10d::ReduceOp& op);
  // `out` holds world_size tensors (list form) or one of world_size pieces.
  void allGather(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                 Tensors& in, Tensors& out);
  void broadcast(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                 Tensors& in, Tensors& out, int root);
  void gather(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
              Tensors& in, Tensors& out, int root);
  void scatter(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
               Tensors& in, Tensors& out, int root);
  // Piece j of `ins` goes to rank j; piece r of `outs` comes from rank r.
  void allToAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                Tensors& ins, Tensors& outs);
  void barrier(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline);
  void exchange(ShmGroup& local, const CollectiveDescription& what,
                std::vector<P2PTransfer>& transfers, Clock::time_point deadline);

 private:
  // Waits for Gloo's `work` within the deadline; a failure breaks `local`
  // with a message naming the collective and `part`.
  void wait(ShmGroup& local, const c10::intrusive_ptr<c10d::Work>& work,
            const CollectiveDescription& what, Clock::time_point deadline, const char* part);
  // Leaders compare `what` across hosts and tell their host; every rank
  // fails alike on a mismatch.
  void agreeAcrossHosts(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline);
  // The same among all ranks through the all-ranks Gloo group.
  void agreeAmongAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline);
  // out = reduction over all ranks, in rank order, of their `in` (flat,
  // same numel and dtype everywhere); every rank gets it.
  void reduceAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                 const at::Tensor& in, at::Tensor& out, const c10d::ReduceOp& op);
  // dst (world_size * nbytes) = every rank's `src` bytes, in rank order.
  void gatherAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                 const char* src, int64_t nbytes, char* dst);

  // Forgets completed sends; breaks `local` if one of them failed.
  void reapSends(ShmGroup& local, const CollectiveDescription& what);

  HostLayout layout_;
  c10::intrusive_ptr<c10d::Backend> leaders_;
  c10::intrusive_ptr<c10d::Backend> all_;
  // Sends posted to Gloo and not known to be complete, with their staged data.
  struct PendingSend {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor data;
    std::string what;
  };
  std::vector<PendingSend> pending_sends_;
  // Gloo Works that failed or outlived their deadline (kept with their tensors).
  std::vector<c10::intrusive_ptr<c10d::Work>> abandoned_;
};

} // namespace c10d::kiln

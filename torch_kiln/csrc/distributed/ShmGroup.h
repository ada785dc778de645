// ShmGroup.h — the shared-memory transport of one kccl process group on one
// host: every rank's segment mapped into every rank's process, and the step
// protocol ranks use to hand data to each other through them.
//
// Note [kccl shared-memory protocol]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Set-up (in the constructor, collectively, when the process group is made):
//   1. each rank creates its own segment, "/kccl-<pid>-<random>-r<rank>",
//      of an 8 KiB header, KCCL_SHM_SLOT_BYTES of data for collectives (its
//      "slot"), and as much again for point-to-point messages;
//   2. it publishes the name in the c10d Store under "<tag>/seg/<rank>"
//      (the Store is the group's PrefixStore; <tag> counts the kccl groups
//      this process made with that store, the same on every rank);
//   3. it reads every other rank's name from the Store and maps that segment;
//   4. it sets "<tag>/mapped/<rank>", waits for every rank's "mapped" key and
//      then shm_unlinks its own segment. From then on the memory lives only
//      in the mappings: a rank that is killed leaks nothing in /dev/shm.
//      (Between 1 and 4 a kill leaves the name; the creator's destructor and
//      a failure during set-up unlink it too.)
//
// A collective is a sequence of *steps* (one per chunk of at most one slot),
// numbered 1, 2, ... across the life of the group. Each rank's header holds two
// counters written only by that rank: `ready` (the last step whose data is in
// its slot) and `done` (the last step in which it finished reading the other
// ranks' slots). Step s on every rank:
//   a. wait until every rank has done >= s-1: nobody still reads my slot;
//   b. write my contribution into my slot, describe the collective (sequence
//      number, kind, dtype, element count, root) in my header, then
//      ready = s (release);
//   c. wait until every rank has ready >= s (acquire), and check that every
//      rank describes the same collective (else: a mismatch error naming both);
//   d. read the slots I need (reductions read the peers' slots in place);
//      then done = s (release).
// A rank can therefore be at most one step ahead of the slowest one, and a
// slot is never written while someone reads it. Waiting spins briefly, then
// sleeps on a futex in the shared memory (Note [kccl futex waits] in
// ShmGroup.cc), always against the collective's deadline (the process
// group's timeout, counted from the moment the collective started on this
// rank). On the deadline the step raises
// c10::DistBackendError naming the collective, its sequence number, its shape
// and the ranks that did not arrive (with the last collective each of them
// entered); the group is then *broken*: every later step fails at once with
// the first error, as an aborted NCCL communicator does, because the ranks no
// longer agree on the step count.
//
// Note [kccl point-to-point]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// send/recv do not involve the other ranks, so they do not use steps. The
// point-to-point area of rank s's segment holds one slot per destination d
// (KCCL_SHM_SLOT_BYTES / world size bytes). Per ordered pair (s, d), s's
// header counts the chunks s has posted to d (p2p_posted[d]) and d's header
// the chunks d has taken from s (p2p_taken[s]). Chunk n: s waits until
// p2p_taken >= n-1, writes its slot for d, then p2p_posted = n (release);
// d waits until p2p_posted >= n, checks the message's element count and
// dtype, copies the chunk out, then p2p_taken = n. So one chunk is buffered
// per pair: a send that fits in one chunk finishes before its recv runs, a
// longer one waits for the recv (as an NCCL send may wait for its recv).
// Sends and recvs issued together (batch_isend_irecv, which coalesces them
// into one task) progress together, chunk by chunk, so a ring of large
// messages does not deadlock, as with NCCL's grouped calls.
// Tags are ignored, as NCCL ignores them; messages of a pair arrive in order.
//
// Thread-safety: steps of one group must not run concurrently; ProcessGroupKCCL
// runs them in issue order (Note [kccl issue order] in ProcessGroupKCCL.cc).
// `broken()` and `firstError()` may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "distributed/ShmSegment.h"

namespace c10d::kiln {

// What a rank is running, compared across ranks at every step.
struct CollectiveDescription {
  const char* name = "";      // "all_reduce", ...: static string
  uint64_t seq = 0;           // the group's sequence number of the collective
  int32_t kind = 0;           // c10d::OpType
  int32_t dtype = -1;         // c10::ScalarType, -1 for none (barrier)
  int64_t numel = 0;          // elements this rank contributes in total
  int32_t root = -1;          // broadcast/reduce root, -1 for none
  int32_t reduce_op = -1;     // c10d::ReduceOp::RedOpType, -1 for none
  std::string shape;          // "Float[4, 3]", for messages only
  int64_t timeout_ms = 0;     // the collective's timeout, for messages only
};

// One send or recv of a point-to-point exchange (ShmGroup::exchange).
struct P2PTransfer {
  bool send = true;
  int peer = -1;
  char* data = nullptr;      // contiguous host memory (read for send, written for recv)
  int64_t numel = 0;
  int64_t element_size = 1;
  int32_t dtype = -1;        // c10::ScalarType
  std::string shape;         // "Float[4]", for messages
};

class ShmGroup {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective: every rank of the group must construct its ShmGroup with the
  // same `tag` and `slot_bytes`. Throws c10::DistBackendError if a segment
  // cannot be made or mapped, or if the peers do not arrive within `timeout`.
  ShmGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
           std::chrono::milliseconds timeout, const std::string& tag, size_t slot_bytes);
  ~ShmGroup();

  int rank() const noexcept { return rank_; }
  // The process group's rank of member `r`, for messages: `r` itself unless
  // setGroupRanks() named them (a group of one host's ranks, CrossHost.h).
  int groupRank(int r) const { return group_ranks_.empty() ? r : group_ranks_[r]; }
  void setGroupRanks(std::vector<int> ranks) { group_ranks_ = std::move(ranks); }
  int size() const noexcept { return size_; }
  // Bytes of each rank's slot.
  size_t slotBytes() const noexcept { return slot_bytes_; }
  // The first byte of rank `r`'s slot (in this process's mapping).
  char* slot(int r) const;

  // One step of Note [kccl shared-memory protocol]: `fill` writes this
  // rank's slot (stage b), `consume` reads the slots (stage d). Throws
  // c10::DistBackendError on the deadline or a mismatch (and breaks the
  // group); exceptions from `fill`/`consume` also break it.
  void step(const CollectiveDescription& what, Clock::time_point deadline,
            const std::function<void()>& fill, const std::function<void()>& consume);

  // Point-to-point (Note [kccl point-to-point]): runs `transfers` (sends and
  // recvs, with any peers) together, moving a chunk of whichever can move,
  // until all are done; transfers of one (peer, direction) move in order.
  // A recv must match its send's element count and dtype (else a mismatch
  // error). Throws c10::ValueError for a bad peer, c10::DistBackendError on
  // the deadline (and breaks the group).
  void exchange(const CollectiveDescription& what, std::vector<P2PTransfer>& transfers,
                Clock::time_point deadline);
  // Throws c10::ValueError unless `peer` is another rank of the group.
  void checkPeer(int peer, const char* op) const;

  // Marks a collective as entered by this rank (for other ranks' timeout messages).
  void enter(const CollectiveDescription& what);

  // Breaks the group with `message` (as a timeout would) and throws it as
  // c10::DistBackendError: for failures found before a collective's steps
  // (an input that holds no valid result), after which this rank cannot
  // take part in the steps the other ranks expect.
  [[noreturn]] void fail(const std::string& message) { breakWith(message); }

  bool broken() const;
  std::string firstError() const;
  // Fails with the first error if the group is broken.
  void checkNotBroken() const;

  // The per-rank header at the start of each segment (ShmGroup.cc).
  struct Header;

 private:
  Header* header(int r) const;
  size_t p2pSlotBytes() const noexcept;
  // The slot in `owner`'s segment that carries owner -> peer messages.
  char* p2pSlot(int owner, int peer) const;
  // True once `arrived()`; false at the deadline (spin, yield, then sleep).
  static bool spinUntil(const std::function<bool()>& arrived, Clock::time_point deadline);
  std::string timeoutMessage(const CollectiveDescription& what, const std::vector<int>& missing,
                             const char* stage) const;
  // Breaks this group if a peer timed out in a step (Note [kccl broken groups]).
  void checkPeersNotBroken(const CollectiveDescription& what);
  // Waits until `value(r) >= target` for every rank r; throws on the deadline.
  void waitAll(bool ready_counter, uint64_t target, const CollectiveDescription& what,
               Clock::time_point deadline, const char* stage);
  void checkSame(const CollectiveDescription& what) const;
  // Records the first error and throws it; with tell_peers (a timeout in a
  // step), also flags it in this rank's header (Note [kccl broken groups]).
  [[noreturn]] void breakWith(const std::string& message, bool tell_peers = false);

  int rank_;
  int size_;
  size_t slot_bytes_;
  std::chrono::milliseconds timeout_;
  uint64_t step_ = 0;
  std::vector<ShmSegment> segments_; // index = rank; segments_[rank_] is ours
  std::vector<int> group_ranks_;     // setGroupRanks(); empty: the same numbers
  mutable std::mutex error_mutex_;
  std::string first_error_;
};

// Slot bytes from KCCL_SHM_SLOT_BYTES (default 4 MiB; 4 KiB .. 1 GiB). Throws
// c10::ValueError naming the variable for a bad value.
size_t slotBytesFromEnvironment();

} // namespace c10d::kiln

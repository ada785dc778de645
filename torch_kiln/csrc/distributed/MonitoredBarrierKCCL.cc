// torch.distributed.monitored_barrier for kccl: ProcessGroupKCCL's
// monitoredBarrier().
//
// Note [kccl monitored barrier]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A debugging barrier that names the ranks that did not arrive, with
// ProcessGroupGloo::monitoredBarrier's semantics and messages: every rank but
// 0 announces its arrival and waits for rank 0's release; rank 0 waits for
// each rank in turn within the timeout (the barrier's, else the group's) and
// releases them all once every rank arrived. If one does not, rank 0 raises
// "[Rank 0]: Rank r failed to pass monitoredBarrier in T ms" at the first
// missing rank, or, with wait_all_ranks, after waiting for every rank,
// "[Rank 0]: Ranks r1, r2 failed to pass monitoredBarrier in T ms"; it
// releases nobody, so the others raise when their own wait ends. Nothing
// goes through the device: the exchange uses the group's Store (its
// PrefixStore, keys under this group's tag and the call's number), on the
// calling thread, as Gloo's runs on the host. Rank 0 deletes the arrival
// keys of a completed barrier (the release key stays: one per call).
// torch.distributed.monitored_barrier accepts only Gloo groups in Python;
// torch_kiln.distributed routes the groups with a kccl backend here.
#include <sstream>
#include <vector>

#include <c10/util/Exception.h>

#include "distributed/ProcessGroupKCCL.h"

namespace c10d::kiln {

void ProcessGroupKCCL::monitoredBarrier(const BarrierOptions& opts, bool wait_all_ranks) {
  TORCH_CHECK(!shut_down_.load(), "kccl: monitored_barrier: the process group was shut down");
  const auto timeout = timeoutFor(opts.timeout);
  const std::string prefix = store_tag_ + "/monitored_barrier/" +
      std::to_string(monitored_barriers_++) + "/";
  const std::string release = prefix + "release";
  const auto arrival = [&](int rank) { return prefix + "arrived/" + std::to_string(rank); };
  const int rank = getRank();
  if (rank != 0) {
    store_->set(arrival(rank), std::vector<uint8_t>{1});
    try {
      store_->wait({release}, timeout);
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str("Rank ", rank, " successfully reached monitoredBarrier, but ",
                               "received errors while waiting to be unblocked by rank 0 ",
                               "(timeout ", timeout.count(), " ms). Please check rank 0 logs ",
                               "for faulty rank. (", e.what(), ")"));
    }
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> missing;
  for (int peer = 1; peer < getSize(); ++peer) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    bool arrived = false;
    if (left.count() > 0) {
      try {
        store_->wait({arrival(peer)}, left);
        arrived = true;
      } catch (const c10::Error&) { // the Store's timeout
      }
    } else {
      arrived = store_->check({arrival(peer)});
    }
    if (!arrived) {
      missing.push_back(peer);
      if (!wait_all_ranks) {
        break;
      }
    }
  }
  if (!missing.empty()) {
    std::ostringstream ranks;
    for (size_t i = 0; i < missing.size(); ++i) {
      ranks << (i ? ", " : "") << missing[i];
    }
    C10_THROW_ERROR(DistBackendError,
                    c10::str("[Rank 0]: ", missing.size() == 1 ? "Rank " : "Ranks ", ranks.str(),
                             " failed to pass monitoredBarrier in ", timeout.count(), " ms"));
  }
  store_->set(release, std::vector<uint8_t>{1});
  for (int peer = 1; peer < getSize(); ++peer) {
    store_->deleteKey(arrival(peer));
  }
}

} // namespace c10d::kiln

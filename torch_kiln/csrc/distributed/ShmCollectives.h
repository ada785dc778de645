// ShmCollectives.h — byte-level broadcast and gather over one ShmGroup (the
// ranks of one host), in steps of at most one slot (Note [kccl shared-memory
// protocol] in ShmGroup.h). Used by ProcessGroupKCCL's one-host collectives
// and by the intra-host parts of the cross-host ones (CrossHost.h).
//
// All buffers are contiguous host memory (aliases of kiln device memory or
// staging tensors); `nbytes` must be the same on every rank of the group.
// Every rank takes part in at least one step, also for 0 bytes. Errors: the
// step protocol's (c10::DistBackendError on the deadline or a mismatch of
// `what` between ranks; the group is then broken).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "distributed/ShmGroup.h"

namespace c10d::kiln {

// Copies `nbytes` at `data` of rank `root` (of `g`) to `data` of every rank.
void shmBroadcast(ShmGroup& g, const CollectiveDescription& what, ShmGroup::Clock::time_point deadline,
                  char* data, int64_t nbytes, int root);

// Copies `nbytes` at `src` of every rank r to `dst[r]` of rank `root`
// (`dst` has g.size() entries on the root and is ignored elsewhere).
void shmGather(ShmGroup& g, const CollectiveDescription& what, ShmGroup::Clock::time_point deadline,
               const char* src, int64_t nbytes, const std::vector<char*>& dst, int root);

} // namespace c10d::kiln

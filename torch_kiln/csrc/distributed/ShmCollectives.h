// ShmCollectives.h — byte-level broadcast and gather over one ShmGroup (the
// ranks of one host), and the chunking every kccl collective uses, in steps of at most one slot (Note [kccl shared-memory
// protocol] in ShmGroup.h). Used by ProcessGroupKCCL's one-host collectives
// and by the intra-host parts of the cross-host ones (CrossHost.h).
//
// All buffers are contiguous host memory (aliases of kiln device memory or
// staging tensors); `nbytes` must be the same on every rank of the group.
// Every rank takes part in at least one step, also for 0 bytes. Errors: the
// step protocol's (c10::DistBackendError on the deadline or a mismatch of
// `what` between ranks; the group is then broken).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include <c10/util/Exception.h>

#include "distributed/ShmGroup.h"

namespace c10d::kiln {

// Chunks of `total` units (elements or bytes), at most `per_step` each; at
// least one (empty) chunk so that every rank takes part in one step even for
// empty tensors. `f(offset, count)`.
template <typename F>
void forEachChunk(int64_t total, int64_t per_step, F&& f) {
  TORCH_CHECK(per_step > 0, "kccl: the shared-memory slot is too small for one element");
  int64_t offset = 0;
  do {
    const int64_t n = std::min(per_step, total - offset);
    f(offset, n);
    offset += n;
  } while (offset < total);
}

// Copies `nbytes` at `data` of rank `root` (of `g`) to `data` of every rank.
void shmBroadcast(ShmGroup& g, const CollectiveDescription& what, ShmGroup::Clock::time_point deadline,
                  char* data, int64_t nbytes, int root);

// Copies `nbytes` at `src` of every rank r to `dst[r]` of rank `root`
// (`dst` has g.size() entries on the root and is ignored elsewhere).
void shmGather(ShmGroup& g, const CollectiveDescription& what, ShmGroup::Clock::time_point deadline,
               const char* src, int64_t nbytes, const std::vector<char*>& dst, int root);

} // namespace c10d::kiln

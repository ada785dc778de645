#include "distributed/ShmCollectives.h"

#include <cstring>

namespace c10d::kiln {

void shmBroadcast(ShmGroup& g, const CollectiveDescription& what, ShmGroup::Clock::time_point deadline,
                  char* data, int64_t nbytes, int root) {
  const bool is_root = g.rank() == root;
  forEachChunk(nbytes, static_cast<int64_t>(g.slotBytes()), [&](int64_t o, int64_t n) {
    g.step(
        what, deadline,
        [&] {
          if (is_root) {
            std::memcpy(g.slot(root), data + o, n);
          }
        },
        [&] {
          if (!is_root) {
            std::memcpy(data + o, g.slot(root), n);
          }
        });
  });
}

void shmGather(ShmGroup& g, const CollectiveDescription& what, ShmGroup::Clock::time_point deadline,
               const char* src, int64_t nbytes, const std::vector<char*>& dst, int root) {
  forEachChunk(nbytes, static_cast<int64_t>(g.slotBytes()), [&](int64_t o, int64_t n) {
    g.step(
        what, deadline, [&] { std::memcpy(g.slot(g.rank()), src + o, n); },
        [&] {
          if (g.rank() == root) {
            for (int r = 0; r < g.size(); ++r) {
              std::memcpy(dst[r] + o, g.slot(r), n);
            }
          }
        });
  });
}

} // namespace c10d::kiln

#include "core/KilnHostAllocator.h"

#include <c10/core/Stream.h>

#include "core/KilnEvent.h"
#include "core/KilnException.h"
#include "core/KilnFunctions.h"
#include "core/KilnStream.h"

namespace c10::kiln {
namespace {

struct KilnHostAllocatorImpl
    : public at::CachingHostAllocatorImpl<KilnStream, KilnEvent> {
 private:
  void allocate_host_memory(size_t size, void** ptr) override {
    KILN_CHECK(kilnMallocHost(ptr, size));
  }

  void free_block(at::HostBlock<KilnStream>* block) override {
    KILN_WARN(kilnFreeHost(block->ptr_));
  }

  void record_stream(std::optional<std::vector<KilnEvent>>& events,
                     KilnStream stream) override {
    KilnEvent event;
    event.record(stream);
    events->push_back(std::move(event));
  }

  bool query_event(KilnEvent& event) override {
    return event.query();
  }

  KilnStream get_current_stream() const override {
    return getCurrentKilnStream();
  }

  bool stream_is_capturing(KilnStream /*stream*/) const override {
    return false; // kiln has no graph capture
  }
};

void deleteHostBlock(void* ctx);

struct KilnHostAllocatorInterface final
    : public at::CachingHostAllocatorInterface<KilnHostAllocatorImpl, deleteHostBlock> {};

KilnHostAllocatorInterface g_host_allocator;

void deleteHostBlock(void* ctx) {
  g_host_allocator.free(ctx);
}

} // namespace

at::HostAllocator* getKilnHostAllocator() {
  return &g_host_allocator;
}

REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &g_host_allocator)

} // namespace c10::kiln

// test_memory.cc — device and pinned allocations, capacity accounting,
// invalid frees and pointer attributes.
#include <sys/resource.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "test_util.h"

using kiln_test::ExpectChildPasses;
using kiln_test::LastMessage;

namespace {

size_t FreeBytes() {
  size_t free_bytes = 0, total = 0;
  EXPECT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST(Memory, ZeroSizeAllocationsGiveNullAndFreeingNullIsANoOp) {
  void* p = reinterpret_cast<void*>(0x1);
  ASSERT_KILN_OK(kilnMalloc(&p, 0));
  EXPECT_EQ(p, nullptr);
  void* h = reinterpret_cast<void*>(0x1);
  ASSERT_KILN_OK(kilnMallocHost(&h, 0));
  EXPECT_EQ(h, nullptr);
  const size_t before = FreeBytes();
  EXPECT_KILN_OK(kilnFree(nullptr));
  EXPECT_KILN_OK(kilnFreeHost(nullptr));
  EXPECT_EQ(FreeBytes(), before);
}

TEST(Memory, AllocationsAreAlignedTo256BytesAndUsable) {
  for (size_t size : {size_t{1}, size_t{3}, size_t{255}, size_t{256}, size_t{4097}, size_t{1} << 20}) {
    void* p = nullptr;
    ASSERT_KILN_OK(kilnMalloc(&p, size));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u) << size;
    ASSERT_KILN_OK(kilnMemsetAsync(p, 0x5a, size, nullptr));
    ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
    EXPECT_EQ(static_cast<unsigned char*>(p)[size - 1], 0x5a);
    ASSERT_KILN_OK(kilnFree(p));
  }
}

TEST(Memory, MemGetInfoChargesAllocationsAndCreditsFrees) {
  const size_t before = FreeBytes();
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&a, 1000));  // charged in 256-byte units
  EXPECT_EQ(FreeBytes(), before - 1024);
  ASSERT_KILN_OK(kilnMalloc(&b, 1 << 20));
  EXPECT_EQ(FreeBytes(), before - 1024 - (1 << 20));
  ASSERT_KILN_OK(kilnFree(a));
  ASSERT_KILN_OK(kilnFree(b));
  EXPECT_EQ(FreeBytes(), before);
}

TEST(Memory, EachDeviceHasItsOwnCapacity) {
  ASSERT_KILN_OK(kilnSetDevice(0));
  const size_t free0 = FreeBytes();
  ASSERT_KILN_OK(kilnSetDevice(1));
  const size_t free1 = FreeBytes();
  void* p = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&p, 4096));
  EXPECT_EQ(FreeBytes(), free1 - 4096);
  kilnPointerAttributes a;
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, p));
  EXPECT_EQ(a.device, 1) << "kilnMalloc allocates on the current device";
  ASSERT_KILN_OK(kilnSetDevice(0));
  EXPECT_EQ(FreeBytes(), free0);
  ASSERT_KILN_OK(kilnFree(p));  // freeing works from any current device
  ASSERT_KILN_OK(kilnSetDevice(1));
  EXPECT_EQ(FreeBytes(), free1);
  ASSERT_KILN_OK(kilnSetDevice(0));
}

TEST(Memory, AbsurdSizesAreOutOfMemoryWithRequestFreeAndTotal) {
  const size_t before = FreeBytes();
  const size_t sizes[] = {size_t{1} << 50, SIZE_MAX, SIZE_MAX - 100, (size_t{16} << 30) + 1};
  for (size_t size : sizes) {
    void* p = reinterpret_cast<void*>(0x1234);
    EXPECT_KILN_ERR(kilnMalloc(&p, size), kilnErrorMemoryAllocation);
    const std::string m = LastMessage();
    EXPECT_TRUE(Contains(m, "kilnMalloc: out of memory on kiln device 0")) << m;
    EXPECT_TRUE(Contains(m, "requested " + std::to_string(size) + " bytes")) << m;
    EXPECT_TRUE(Contains(m, "free of 17179869184 bytes (16.00 GiB) total")) << m;
  }
  EXPECT_KILN_ERR(kilnMalloc(nullptr, 1), kilnErrorInvalidValue);
  void* p = nullptr;
  EXPECT_KILN_ERR(kilnMalloc(&p, size_t{1} << 50), kilnErrorMemoryAllocation);
  EXPECT_TRUE(Contains(LastMessage(), "requested 1125899906842624 bytes (1.00 PiB)")) << LastMessage();
  EXPECT_EQ(FreeBytes(), before) << "a failed allocation must not charge the device";
  ASSERT_KILN_OK(kilnMalloc(&p, 64));  // and the device still works
  ASSERT_KILN_OK(kilnFree(p));
}

TEST(Memory, AbsurdPinnedSizesFailCleanly) {
  void* h = nullptr;
  EXPECT_KILN_ERR(kilnMallocHost(&h, SIZE_MAX), kilnErrorMemoryAllocation);
  EXPECT_TRUE(Contains(LastMessage(), "kilnMallocHost")) << LastMessage();
  EXPECT_KILN_ERR(kilnMallocHost(&h, size_t{1} << 50), kilnErrorMemoryAllocation);
}

TEST(Memory, FreeingTwiceIsRejectedAndChangesNothing) {
  void* p = nullptr;
  void* q = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&p, 512));
  ASSERT_KILN_OK(kilnFree(p));
  ASSERT_KILN_OK(kilnMalloc(&q, 512));
  const size_t before = FreeBytes();
  if (p != q) {  // (the allocator may hand the same address back; then it is live again)
    EXPECT_KILN_ERR(kilnFree(p), kilnErrorInvalidDevicePointer);
    EXPECT_TRUE(Contains(LastMessage(), "not a live allocation")) << LastMessage();
  }
  EXPECT_EQ(FreeBytes(), before);
  ASSERT_KILN_OK(kilnFree(q));
  EXPECT_KILN_ERR(kilnFree(q), kilnErrorInvalidDevicePointer);
  EXPECT_TRUE(Contains(LastMessage(), "kilnFree")) << LastMessage();
}

TEST(Memory, FreeingAnInteriorPointerIsRejectedAndKeepsTheAllocation) {
  void* p = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&p, 1024));
  const size_t before = FreeBytes();
  void* interior = static_cast<char*>(p) + 16;
  EXPECT_KILN_ERR(kilnFree(interior), kilnErrorInvalidDevicePointer);
  EXPECT_TRUE(Contains(LastMessage(), "16 bytes into")) << LastMessage();
  EXPECT_EQ(FreeBytes(), before);
  kilnPointerAttributes a;
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, p));
  EXPECT_EQ(a.type, kilnMemoryTypeDevice) << "the allocation must still be live";
  ASSERT_KILN_OK(kilnFree(p));
}

TEST(Memory, FreeingForeignPointersIsRejected) {
  int on_stack = 0;
  EXPECT_KILN_ERR(kilnFree(&on_stack), kilnErrorInvalidDevicePointer);
  void* heap = std::malloc(64);
  EXPECT_KILN_ERR(kilnFree(heap), kilnErrorInvalidDevicePointer);
  std::free(heap);
  void* pinned = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(&pinned, 64));
  EXPECT_KILN_ERR(kilnFree(pinned), kilnErrorInvalidDevicePointer);
  EXPECT_TRUE(Contains(LastMessage(), "kilnFreeHost")) << LastMessage();
  EXPECT_KILN_ERR(kilnFreeHost(&on_stack), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnFreeHost(static_cast<char*>(pinned) + 8), kilnErrorInvalidValue);
  void* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev, 64));
  EXPECT_KILN_ERR(kilnFreeHost(dev), kilnErrorInvalidValue);
  EXPECT_TRUE(Contains(LastMessage(), "kilnFree")) << LastMessage();
  ASSERT_KILN_OK(kilnFreeHost(pinned));
  EXPECT_KILN_ERR(kilnFreeHost(pinned), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnFree(dev));
}

TEST(Memory, FreeWaitsForPendingWorkOnTheDevice) {
  void* p = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&p, 4096));
  std::atomic<bool> release{false};
  std::atomic<bool> written{false};
  // The task holds the stream until `release`, then writes the buffer.
  ASSERT_KILN_OK(kiln_test::Launch(nullptr, [&, p] {
    while (!release.load()) std::this_thread::yield();
    std::memset(p, 1, 4096);
    written.store(true);
  }));
  // Release the task only once this thread is (about to be) inside kilnFree,
  // so a kilnFree that did not wait would return before the write.
  std::atomic<bool> freeing{false};
  std::thread opener([&] {
    while (!freeing.load()) std::this_thread::yield();
    for (int i = 0; i < 100; ++i) std::this_thread::yield();
    release.store(true);
  });
  freeing.store(true);
  EXPECT_KILN_OK(kilnFree(p));
  EXPECT_TRUE(written.load()) << "kilnFree returned before the pending task that uses the memory";
  opener.join();
}

TEST(Memory, FreeWaitsForPeerWorkOnOtherDevices) {
  // A copy out of device 0 memory queued on device 1's stream must finish
  // before the memory is released.
  ASSERT_KILN_OK(kilnSetDevice(0));
  void* src = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&src, 4096));
  ASSERT_KILN_OK(kilnMemsetAsync(src, 7, 4096, nullptr));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  ASSERT_KILN_OK(kilnSetDevice(1));
  void* dst = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dst, 4096));
  kilnStream_t s1 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s1, 1));
  auto gate = kiln_test::MakeGate();
  kiln_test::GateGuard guard{gate};
  ASSERT_KILN_OK(kiln_test::LaunchGate(s1, gate));
  ASSERT_KILN_OK(kilnMemcpyPeerAsync(dst, 1, src, 0, 4096, s1));
  std::atomic<bool> freeing{false};
  std::thread opener([&freeing, gate] {
    while (!freeing.load()) std::this_thread::yield();
    for (int i = 0; i < 100; ++i) std::this_thread::yield();
    gate->Open();
  });
  freeing.store(true);
  EXPECT_KILN_OK(kilnFree(src));
  EXPECT_KILN_OK(kilnStreamQuery(s1)) << "device 1's copy must be done when kilnFree(src) returns";
  opener.join();
  EXPECT_EQ(static_cast<unsigned char*>(dst)[4095], 7);
  ASSERT_KILN_OK(kilnFree(dst));
  ASSERT_KILN_OK(kilnSetDevice(0));
}

TEST(Memory, PointerAttributesOfDevicePinnedPageableAndInteriorPointers) {
  void* dev = nullptr;
  ASSERT_KILN_OK(kilnSetDevice(1));
  ASSERT_KILN_OK(kilnMalloc(&dev, 1000));
  ASSERT_KILN_OK(kilnSetDevice(0));
  kilnPointerAttributes a;

  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, dev));
  EXPECT_EQ(a.type, kilnMemoryTypeDevice);
  EXPECT_EQ(a.device, 1);
  EXPECT_EQ(a.basePointer, dev);
  EXPECT_EQ(a.allocationSize, 1000u);

  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, static_cast<char*>(dev) + 999));
  EXPECT_EQ(a.type, kilnMemoryTypeDevice);
  EXPECT_EQ(a.device, 1);
  EXPECT_EQ(a.basePointer, dev);
  EXPECT_EQ(a.allocationSize, 1000u);

  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, static_cast<char*>(dev) + 1000));
  EXPECT_NE(a.basePointer, dev) << "one past the end is not inside the allocation";

  void* pinned = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(&pinned, 300));
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, static_cast<char*>(pinned) + 17));
  EXPECT_EQ(a.type, kilnMemoryTypeHost);
  EXPECT_EQ(a.device, -1);
  EXPECT_EQ(a.basePointer, pinned);
  EXPECT_EQ(a.allocationSize, 300u);

  int on_stack = 0;
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, &on_stack));
  EXPECT_EQ(a.type, kilnMemoryTypeUnregistered);
  EXPECT_EQ(a.device, -1);
  EXPECT_EQ(a.basePointer, nullptr);
  EXPECT_EQ(a.allocationSize, 0u);
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, nullptr));
  EXPECT_EQ(a.type, kilnMemoryTypeUnregistered);

  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, dev));
  EXPECT_EQ(a.type, kilnMemoryTypeUnregistered) << "a freed pointer is no longer device memory";
  ASSERT_KILN_OK(kilnFreeHost(pinned));
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, pinned));
  EXPECT_EQ(a.type, kilnMemoryTypeUnregistered);
}

TEST(Memory, ConcurrentAllocationsFromManyThreadsBalance) {
  const size_t before = FreeBytes();
  std::thread threads[4];
  std::atomic<int> failures{0};
  for (auto& t : threads) {
    t = std::thread([&] {
      for (int i = 0; i < 200; ++i) {
        void* p = nullptr;
        if (kilnMalloc(&p, 256 * (1 + i % 7)) != kilnSuccess || kilnFree(p) != kilnSuccess) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(FreeBytes(), before);
}

// --- A small device (child process) -------------------------------------------

TEST(ChildSmallDevice, ExhaustionAndRecovery) {
  size_t free_bytes = 0, total = 0;
  ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
  ASSERT_EQ(total, size_t{1} << 20);
  ASSERT_EQ(free_bytes, total);

  void* all = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&all, 1 << 20));
  void* one = nullptr;
  EXPECT_KILN_ERR(kilnMalloc(&one, 1), kilnErrorMemoryAllocation);
  EXPECT_EQ(LastMessage(),
            "kilnMalloc: out of memory on kiln device 0: requested 1 bytes, which takes 256 "
            "bytes of device memory (allocations are charged in 256-byte units); 0 bytes free "
            "of 1048576 bytes (1.00 MiB) total");
  ASSERT_KILN_OK(kilnFree(all));

  void* halves[2] = {nullptr, nullptr};
  ASSERT_KILN_OK(kilnMalloc(&halves[0], 512 << 10));
  ASSERT_KILN_OK(kilnMalloc(&halves[1], 512 << 10));
  EXPECT_KILN_ERR(kilnMalloc(&one, 256), kilnErrorMemoryAllocation);
  ASSERT_KILN_OK(kilnFree(halves[0]));
  EXPECT_KILN_ERR(kilnMalloc(&one, (512 << 10) + 1), kilnErrorMemoryAllocation);
  EXPECT_TRUE(Contains(LastMessage(), "524288 bytes (512.00 KiB) free")) << LastMessage();
  ASSERT_KILN_OK(kilnMalloc(&halves[0], 512 << 10));  // recovered
  ASSERT_KILN_OK(kilnFree(halves[0]));
  ASSERT_KILN_OK(kilnFree(halves[1]));

  // The other device's capacity is separate.
  ASSERT_KILN_OK(kilnMalloc(&all, 1 << 20));
  ASSERT_KILN_OK(kilnSetDevice(1));
  void* other = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&other, 1 << 20));
  ASSERT_KILN_OK(kilnFree(other));
  ASSERT_KILN_OK(kilnFree(all));

  // Pinned memory is not charged to the device.
  ASSERT_KILN_OK(kilnSetDevice(0));
  void* pinned = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(&pinned, 4 << 20));
  ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
  EXPECT_EQ(free_bytes, total);
  ASSERT_KILN_OK(kilnFreeHost(pinned));
}

TEST(MemoryEnv, ExhaustionAndRecoveryOnA1MiBDevice) {
  ExpectChildPasses("ChildSmallDevice.ExhaustionAndRecovery", {{"KILN_DEVICE_MEMORY", "1MiB"}});
}

// When the capacity allows a request but the host cannot provide it, the
// result is still kilnErrorMemoryAllocation, and nothing stays charged.
TEST(ChildHugeDevice, HostAllocatorFailureIsOutOfMemory) {
  size_t free_bytes = 0, total = 0;
  ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
  ASSERT_EQ(total, size_t{1} << 60);
  // Make the failure certain whatever the kernel's overcommit policy: cap the
  // address space well below the request.
  struct rlimit limit;
  ASSERT_EQ(getrlimit(RLIMIT_AS, &limit), 0);
  if (!kiln_test::UnderSanitizer()) {
    limit.rlim_cur = rlim_t{64} << 30;
    ASSERT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
  }
  void* p = nullptr;
  EXPECT_KILN_ERR(kilnMalloc(&p, size_t{1} << 59), kilnErrorMemoryAllocation);
  const std::string m = LastMessage();
  EXPECT_TRUE(Contains(m, "host could not provide")) << m;
  EXPECT_TRUE(Contains(m, "requested 576460752303423488 bytes (512.00 PiB)")) << m;
  ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
  EXPECT_EQ(free_bytes, total);
  ASSERT_KILN_OK(kilnMalloc(&p, 4096));
  ASSERT_KILN_OK(kilnFree(p));
}

TEST(MemoryEnv, HostAllocatorFailureIsOutOfMemory) {
  auto with = [](const char* name, const char* extra) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "") + (v != nullptr && *v ? ":" : "") + extra;
  };
  ExpectChildPasses("ChildHugeDevice.HostAllocatorFailureIsOutOfMemory",
                    {{"KILN_DEVICE_MEMORY", "1048576TiB"},
                     // Sanitizer allocators would abort on the huge request instead of failing it.
                     {"ASAN_OPTIONS", with("ASAN_OPTIONS", "allocator_may_return_null=1")},
                     {"TSAN_OPTIONS", with("TSAN_OPTIONS", "allocator_may_return_null=1")}});
}

// test_copy.cc — copies in every direction, pinned and pageable, synchronous
// and asynchronous, at odd sizes and offsets; staging and asynchrony rules;
// range and kind validation; memset.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

using kiln_test::GateGuard;
using kiln_test::Launch;
using kiln_test::LaunchGate;
using kiln_test::LastMessage;
using kiln_test::MakeGate;

namespace {

constexpr unsigned char kCanary = 0xEE;

enum class Mem { kPageable, kPinned, kDevice0, kDevice1 };

// A buffer of one memory kind. Device contents are written and read by tasks
// on the owning device's default stream (device pointers are host addresses
// on the reference device), so the check does not depend on the copy code.
class Buffer {
 public:
  Buffer(Mem mem, size_t size) : mem_(mem), size_(size) {
    switch (mem) {
      case Mem::kPageable: ptr_ = static_cast<unsigned char*>(std::malloc(size)); break;
      case Mem::kPinned: EXPECT_KILN_OK(kilnMallocHost(reinterpret_cast<void**>(&ptr_), size)); break;
      case Mem::kDevice0:
      case Mem::kDevice1: {
        int current = 0;
        EXPECT_KILN_OK(kilnGetDevice(&current));
        EXPECT_KILN_OK(kilnSetDevice(device()));
        EXPECT_KILN_OK(kilnMalloc(reinterpret_cast<void**>(&ptr_), size));
        EXPECT_KILN_OK(kilnSetDevice(current));
        break;
      }
    }
  }
  ~Buffer() {
    switch (mem_) {
      case Mem::kPageable: std::free(ptr_); break;
      case Mem::kPinned: EXPECT_KILN_OK(kilnFreeHost(ptr_)); break;
      default: EXPECT_KILN_OK(kilnFree(ptr_)); break;
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  unsigned char* ptr() const { return ptr_; }
  int device() const { return mem_ == Mem::kDevice1 ? 1 : 0; }
  bool on_device() const { return mem_ == Mem::kDevice0 || mem_ == Mem::kDevice1; }

  void Write(const std::vector<unsigned char>& bytes) {
    ASSERT_EQ(bytes.size(), size_);
    if (!on_device()) {
      std::memcpy(ptr_, bytes.data(), size_);
      return;
    }
    kilnStream_t s = nullptr;
    ASSERT_KILN_OK(kilnStreamGetDefault(&s, device()));
    unsigned char* p = ptr_;
    ASSERT_KILN_OK(Launch(s, [p, bytes] { std::memcpy(p, bytes.data(), bytes.size()); }));
    ASSERT_KILN_OK(kilnStreamSynchronize(s));
  }

  std::vector<unsigned char> Read() {
    std::vector<unsigned char> out(size_);
    if (!on_device()) {
      std::memcpy(out.data(), ptr_, size_);
      return out;
    }
    kilnStream_t s = nullptr;
    EXPECT_KILN_OK(kilnStreamGetDefault(&s, device()));
    unsigned char* p = ptr_;
    unsigned char* o = out.data();
    const size_t n = size_;
    EXPECT_KILN_OK(Launch(s, [p, o, n] { std::memcpy(o, p, n); }));
    EXPECT_KILN_OK(kilnStreamSynchronize(s));
    return out;
  }

 private:
  Mem mem_;
  size_t size_;
  unsigned char* ptr_ = nullptr;
};

std::vector<unsigned char> Pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  uint32_t x = 2463534242u ^ seed;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<unsigned char>(x == kCanary ? 0x11 : x);
  }
  return v;
}

enum class Api { kAsync, kSync, kPeer };

struct Direction {
  const char* name;
  Mem src;
  Mem dst;
  Api api;
  kilnMemcpyKind kind;
  int stream_device;  // for kAsync and kPeer
  bool done_on_return;  // no synchronisation needed before reading dst
};

const Direction kDirections[] = {
    {"H2D_pageable_async", Mem::kPageable, Mem::kDevice0, Api::kAsync, kilnMemcpyHostToDevice, 0, false},
    {"H2D_pinned_async", Mem::kPinned, Mem::kDevice0, Api::kAsync, kilnMemcpyHostToDevice, 0, false},
    {"H2D_pageable_sync", Mem::kPageable, Mem::kDevice1, Api::kSync, kilnMemcpyHostToDevice, 1, true},
    {"H2D_pinned_sync", Mem::kPinned, Mem::kDevice0, Api::kSync, kilnMemcpyHostToDevice, 0, true},
    {"D2H_pageable_async", Mem::kDevice0, Mem::kPageable, Api::kAsync, kilnMemcpyDeviceToHost, 0, true},
    {"D2H_pinned_async", Mem::kDevice1, Mem::kPinned, Api::kAsync, kilnMemcpyDeviceToHost, 1, false},
    {"D2H_pageable_sync", Mem::kDevice1, Mem::kPageable, Api::kSync, kilnMemcpyDeviceToHost, 1, true},
    {"D2H_pinned_sync", Mem::kDevice0, Mem::kPinned, Api::kSync, kilnMemcpyDeviceToHost, 0, true},
    {"D2D_same_device_async", Mem::kDevice0, Mem::kDevice0, Api::kAsync, kilnMemcpyDeviceToDevice, 0, false},
    {"D2D_same_device_sync", Mem::kDevice1, Mem::kDevice1, Api::kSync, kilnMemcpyDeviceToDevice, 1, true},
    {"D2D_0_to_1_async", Mem::kDevice0, Mem::kDevice1, Api::kAsync, kilnMemcpyDeviceToDevice, 1, false},
    {"D2D_1_to_0_sync", Mem::kDevice1, Mem::kDevice0, Api::kSync, kilnMemcpyDeviceToDevice, 0, true},
    {"Peer_0_to_1_on_dst", Mem::kDevice0, Mem::kDevice1, Api::kPeer, kilnMemcpyDefault, 1, false},
    {"Peer_0_to_1_on_src", Mem::kDevice0, Mem::kDevice1, Api::kPeer, kilnMemcpyDefault, 0, false},
    {"Peer_1_to_0", Mem::kDevice1, Mem::kDevice0, Api::kPeer, kilnMemcpyDefault, 0, false},
    {"H2H_pinned_async", Mem::kPinned, Mem::kPinned, Api::kAsync, kilnMemcpyHostToHost, 0, false},
    {"H2H_pageable_sync", Mem::kPageable, Mem::kPageable, Api::kSync, kilnMemcpyHostToHost, 0, true},
    {"Default_H2D_pageable_async", Mem::kPageable, Mem::kDevice1, Api::kAsync, kilnMemcpyDefault, 1, false},
    {"Default_D2H_pinned_async", Mem::kDevice0, Mem::kPinned, Api::kAsync, kilnMemcpyDefault, 0, false},
    {"Default_D2D_sync", Mem::kDevice0, Mem::kDevice1, Api::kSync, kilnMemcpyDefault, 1, true},
};

using CopyParam = std::tuple<int, size_t, size_t>;  // direction index, size, offset

class CopyMatrix : public testing::TestWithParam<CopyParam> {};

TEST_P(CopyMatrix, CopiesExactlyTheRangeAndNothingElse) {
  const Direction& dir = kDirections[std::get<0>(GetParam())];
  const size_t count = std::get<1>(GetParam());
  const size_t dst_offset = std::get<2>(GetParam());
  const size_t src_offset = dst_offset + 2;  // different alignment on each side
  const size_t pad = 37;

  Buffer src(dir.src, src_offset + count + pad);
  Buffer dst(dir.dst, dst_offset + count + pad);
  const auto src_bytes = Pattern(src_offset + count + pad, static_cast<unsigned>(count * 31 + dst_offset));
  src.Write(src_bytes);
  dst.Write(std::vector<unsigned char>(dst_offset + count + pad, kCanary));

  kilnStream_t stream = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&stream, dir.stream_device));
  unsigned char* d = dst.ptr() + dst_offset;
  const unsigned char* s = src.ptr() + src_offset;
  switch (dir.api) {
    case Api::kAsync: ASSERT_KILN_OK(kilnMemcpyAsync(d, s, count, dir.kind, stream)); break;
    case Api::kSync: ASSERT_KILN_OK(kilnMemcpy(d, s, count, dir.kind)); break;
    case Api::kPeer:
      ASSERT_KILN_OK(kilnMemcpyPeerAsync(d, dst.device(), s, src.device(), count, stream));
      break;
  }
  if (!dir.done_on_return) {
    ASSERT_KILN_OK(kilnStreamSynchronize(stream));
  }

  const auto got = dst.Read();
  for (size_t i = 0; i < got.size(); ++i) {
    const bool inside = i >= dst_offset && i < dst_offset + count;
    const unsigned char want = inside ? src_bytes[src_offset + (i - dst_offset)] : kCanary;
    ASSERT_EQ(static_cast<int>(got[i]), static_cast<int>(want))
        << dir.name << ": byte " << i << " of the destination (copy of " << count << " bytes at offset "
        << dst_offset << ")";
  }
}

std::string CopyName(const testing::TestParamInfo<CopyParam>& info) {
  return std::string(kDirections[std::get<0>(info.param)].name) + "_" +
         std::to_string(std::get<1>(info.param)) + "B_at_" + std::to_string(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    AllDirections, CopyMatrix,
    testing::Combine(testing::Range(0, static_cast<int>(sizeof kDirections / sizeof kDirections[0])),
                     testing::Values(size_t{1}, size_t{3}, size_t{4097}),
                     testing::Values(size_t{1}, size_t{13})),
    CopyName);

void* DeviceAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_KILN_OK(kilnMalloc(&p, n));
  return p;
}

}  // namespace

TEST(Copy, PageableHostToDeviceIsStagedAtCallTime) {
  kilnStream_t stream = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&stream));
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(4097));
  std::vector<unsigned char> host(4097, 0xAB);
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(stream, gate));  // the copy cannot run yet
    ASSERT_KILN_OK(kilnMemcpyAsync(dev, host.data(), host.size(), kilnMemcpyHostToDevice, stream));
    std::fill(host.begin(), host.end(), 0x00);  // the caller may reuse it at once
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(stream));
  for (size_t i = 0; i < host.size(); ++i) ASSERT_EQ(dev[i], 0xAB) << i;
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnStreamDestroy(stream));
}

TEST(Copy, PinnedHostToDeviceReadsTheSourceWhenItRuns) {
  kilnStream_t stream = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&stream));
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(256));
  unsigned char* pinned = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(reinterpret_cast<void**>(&pinned), 256));
  std::memset(pinned, 0x01, 256);
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(stream, gate));
    ASSERT_KILN_OK(kilnMemcpyAsync(dev, pinned, 256, kilnMemcpyHostToDevice, stream));
    std::memset(pinned, 0x02, 256);  // before the copy ran: the copy sees this
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(stream));
  EXPECT_EQ(dev[0], 0x02);
  EXPECT_EQ(dev[255], 0x02);
  ASSERT_KILN_OK(kilnFreeHost(pinned));
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnStreamDestroy(stream));
}

TEST(Copy, PinnedDeviceToHostIsAsynchronous) {
  kilnStream_t stream = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&stream));
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(64));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 0x33, 64, stream));
  unsigned char* pinned = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(reinterpret_cast<void**>(&pinned), 64));
  std::memset(pinned, 0, 64);
  auto gate = MakeGate();
  {
    GateGuard guard{gate};
    ASSERT_KILN_OK(LaunchGate(stream, gate));
    ASSERT_KILN_OK(kilnMemcpyAsync(pinned, dev, 64, kilnMemcpyDeviceToHost, stream));
    EXPECT_EQ(pinned[0], 0) << "the copy ran before the work ahead of it on the stream";
    EXPECT_KILN_ERR(kilnStreamQuery(stream), kilnErrorNotReady);
  }
  ASSERT_KILN_OK(kilnStreamSynchronize(stream));
  EXPECT_EQ(pinned[0], 0x33);
  EXPECT_EQ(pinned[63], 0x33);
  ASSERT_KILN_OK(kilnFreeHost(pinned));
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnStreamDestroy(stream));
}

TEST(Copy, PageableDeviceToHostReturnsWithTheData) {
  kilnStream_t stream = nullptr;
  ASSERT_KILN_OK(kilnStreamCreate(&stream));
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(1 << 16));
  // Slow work ahead of the copy on the same stream.
  ASSERT_KILN_OK(Launch(stream, [dev] {
    for (int i = 0; i < (1 << 16); ++i) dev[i] = static_cast<unsigned char>(i * 7);
  }));
  std::vector<unsigned char> host(1 << 16, 0);
  ASSERT_KILN_OK(kilnMemcpyAsync(host.data(), dev, host.size(), kilnMemcpyDeviceToHost, stream));
  for (int i = 0; i < (1 << 16); ++i) ASSERT_EQ(host[i], static_cast<unsigned char>(i * 7)) << i;
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnStreamDestroy(stream));
}

TEST(Copy, CopiesAreOrderedWithTasksAndOtherCopies) {
  auto* a = static_cast<int*>(DeviceAlloc(sizeof(int) * 1000));
  auto* b = static_cast<int*>(DeviceAlloc(sizeof(int) * 1000));
  std::vector<int> host(1000, 0);
  for (int round = 0; round < 20; ++round) {
    ASSERT_KILN_OK(Launch(nullptr, [a, round] {
      for (int i = 0; i < 1000; ++i) a[i] = round * 1000 + i;
    }));
    ASSERT_KILN_OK(kilnMemcpyAsync(b, a, sizeof(int) * 1000, kilnMemcpyDeviceToDevice, nullptr));
    ASSERT_KILN_OK(Launch(nullptr, [b] {
      for (int i = 0; i < 1000; ++i) b[i] += 1;
    }));
    ASSERT_KILN_OK(kilnMemcpyAsync(host.data(), b, sizeof(int) * 1000, kilnMemcpyDeviceToHost, nullptr));
    for (int i = 0; i < 1000; i += 111) ASSERT_EQ(host[i], round * 1000 + i + 1);
  }
  ASSERT_KILN_OK(kilnFree(a));
  ASSERT_KILN_OK(kilnFree(b));
}

TEST(Copy, ZeroBytesIsANoOpEvenWithNullPointers) {
  EXPECT_KILN_OK(kilnMemcpyAsync(nullptr, nullptr, 0, kilnMemcpyHostToDevice, nullptr));
  EXPECT_KILN_OK(kilnMemcpy(nullptr, nullptr, 0, kilnMemcpyDeviceToHost));
  EXPECT_KILN_OK(kilnMemcpyPeerAsync(nullptr, 1, nullptr, 0, 0, nullptr));
  EXPECT_KILN_OK(kilnMemsetAsync(nullptr, 0, 0, nullptr));
}

TEST(Copy, RangesPastTheEndOfAnAllocationAreRejected) {
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(100));
  std::vector<unsigned char> host(200, 0x5c);
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 0, 100, nullptr));
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));

  EXPECT_KILN_ERR(kilnMemcpyAsync(dev, host.data(), 101, kilnMemcpyHostToDevice, nullptr),
                  kilnErrorInvalidValue);
  const std::string m = LastMessage();
  EXPECT_NE(m.find("kilnMemcpyAsync: dst range"), std::string::npos) << m;
  EXPECT_NE(m.find("1 bytes past the end"), std::string::npos) << m;
  EXPECT_NE(m.find("(100 bytes)"), std::string::npos) << m;

  EXPECT_KILN_ERR(kilnMemcpyAsync(dev + 50, host.data(), 51, kilnMemcpyHostToDevice, nullptr),
                  kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpy(host.data(), dev + 99, 2, kilnMemcpyDeviceToHost), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("src range"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnMemcpy(dev, dev + 1, 100, kilnMemcpyDeviceToDevice), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemsetAsync(dev + 1, 0, 100, nullptr), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpyPeerAsync(dev, 0, dev + 10, 0, 91, nullptr), kilnErrorInvalidValue);
  // A host range that runs into a device allocation is not host memory.
  unsigned char* before = dev - 16;
  EXPECT_KILN_ERR(kilnMemcpy(dev, before, 32, kilnMemcpyHostToDevice), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("overlaps"), std::string::npos) << LastMessage();
  // A range that wraps around the address space.
  EXPECT_KILN_ERR(kilnMemcpy(host.data(), dev, SIZE_MAX, kilnMemcpyDeviceToHost), kilnErrorInvalidValue);

  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  for (int i = 0; i < 100; ++i) ASSERT_EQ(dev[i], 0) << "a rejected copy wrote byte " << i;
  ASSERT_KILN_OK(kilnFree(dev));
}

TEST(Copy, FreedDevicePointersAreRejected) {
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(64));
  ASSERT_KILN_OK(kilnFree(dev));
  std::vector<unsigned char> host(64);
  EXPECT_KILN_ERR(kilnMemcpyAsync(dev, host.data(), 64, kilnMemcpyHostToDevice, nullptr),
                  kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("was it freed?"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnMemcpy(host.data(), dev, 64, kilnMemcpyDeviceToHost), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemsetAsync(dev, 0, 64, nullptr), kilnErrorInvalidValue);
}

TEST(Copy, PointerKindsMustMatchTheKind) {
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(64));
  auto* dev2 = static_cast<unsigned char*>(DeviceAlloc(64));
  std::vector<unsigned char> host(64), host2(64);
  EXPECT_KILN_ERR(kilnMemcpy(host.data(), host2.data(), 64, kilnMemcpyHostToDevice), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("kilnMemcpyHostToDevice needs device memory"), std::string::npos)
      << LastMessage();
  EXPECT_KILN_ERR(kilnMemcpy(dev, dev2, 64, kilnMemcpyHostToDevice), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("src"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnMemcpy(host.data(), host2.data(), 64, kilnMemcpyDeviceToHost), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpy(dev, dev2, 64, kilnMemcpyDeviceToHost), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpy(dev, host.data(), 64, kilnMemcpyDeviceToDevice), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpy(host.data(), dev, 64, kilnMemcpyHostToHost), kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpyAsync(dev, dev2, 64, static_cast<kilnMemcpyKind>(7), nullptr),
                  kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpyAsync(nullptr, dev2, 64, kilnMemcpyDeviceToDevice, nullptr),
                  kilnErrorInvalidValue);
  EXPECT_KILN_ERR(kilnMemcpyAsync(dev, nullptr, 64, kilnMemcpyDefault, nullptr), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnFree(dev));
  ASSERT_KILN_OK(kilnFree(dev2));
}

TEST(Copy, PeerCopiesCheckDevicesAndPointers) {
  ASSERT_KILN_OK(kilnSetDevice(0));
  void* d0 = DeviceAlloc(64);
  ASSERT_KILN_OK(kilnSetDevice(1));
  void* d1 = DeviceAlloc(64);
  ASSERT_KILN_OK(kilnSetDevice(0));
  EXPECT_KILN_ERR(kilnMemcpyPeerAsync(d1, 5, d0, 0, 64, nullptr), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnMemcpyPeerAsync(d1, 1, d0, -1, 64, nullptr), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnMemcpyPeerAsync(d1, 0, d0, 1, 64, nullptr), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("not memory of kiln device 0"), std::string::npos) << LastMessage();
  std::vector<unsigned char> host(64);
  EXPECT_KILN_ERR(kilnMemcpyPeerAsync(host.data(), 1, d0, 0, 64, nullptr), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnFree(d0));
  ASSERT_KILN_OK(kilnFree(d1));
}

TEST(Copy, MemsetWritesTheByteValueToExactlyTheRange) {
  auto* dev = static_cast<unsigned char*>(DeviceAlloc(4097));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 0, 4097, nullptr));
  ASSERT_KILN_OK(kilnMemsetAsync(dev + 13, 0x1ff, 3, nullptr));  // only the low byte counts
  ASSERT_KILN_OK(kilnStreamSynchronize(nullptr));
  for (int i = 0; i < 4097; ++i) ASSERT_EQ(dev[i], (i >= 13 && i < 16) ? 0xff : 0) << i;
  std::vector<unsigned char> host(16);
  EXPECT_KILN_ERR(kilnMemsetAsync(host.data(), 0, 16, nullptr), kilnErrorInvalidValue);
  ASSERT_KILN_OK(kilnFree(dev));
}

TEST(ChildThreeDevices, PeerCopyStreamMustBelongToSourceOrDestination) {
  void* p[3];
  for (int d = 0; d < 3; ++d) {
    ASSERT_KILN_OK(kilnSetDevice(d));
    ASSERT_KILN_OK(kilnMalloc(&p[d], 64));
  }
  kilnStream_t s2 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s2, 2));
  EXPECT_KILN_ERR(kilnMemcpyPeerAsync(p[1], 1, p[0], 0, 64, s2), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("belongs to kiln device 2"), std::string::npos) << LastMessage();
  ASSERT_KILN_OK(kilnMemsetAsync(p[0], 9, 64, s2));  // any stream may touch any device memory
  ASSERT_KILN_OK(kilnStreamSynchronize(s2));
  kilnStream_t s0 = nullptr;
  ASSERT_KILN_OK(kilnStreamGetDefault(&s0, 0));
  ASSERT_KILN_OK(kilnMemcpyPeerAsync(p[2], 2, p[0], 0, 64, s0));
  ASSERT_KILN_OK(kilnStreamSynchronize(s0));
  EXPECT_EQ(static_cast<unsigned char*>(p[2])[63], 9);
  for (void* q : p) ASSERT_KILN_OK(kilnFree(q));
}

TEST(CopyEnv, PeerCopyStreamMustBelongToSourceOrDestination) {
  kiln_test::ExpectChildPasses("ChildThreeDevices.PeerCopyStreamMustBelongToSourceOrDestination",
                               {{"KILN_DEVICE_COUNT", "3"}});
}

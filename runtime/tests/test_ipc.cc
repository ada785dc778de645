// test_ipc.cc — sharing device memory between processes through file
// descriptors (kilnMemExportToShareableHandle / kilnMemImportFromShareableHandle,
// Note [Shareable device memory]): the same bytes seen from both sides, in
// one process and across processes, and clear errors for bad handles.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

using kiln_test::ChildParam;
using kiln_test::ExpectChildPasses;
using kiln_test::LastMessage;

namespace {

std::vector<unsigned char> Read(const void* dev, size_t n) {
  std::vector<unsigned char> out(n, 0);
  EXPECT_KILN_OK(kilnMemcpy(out.data(), dev, n, kilnMemcpyDeviceToHost));
  return out;
}

}  // namespace

TEST(Ipc, ImportSeesTheExportersBytesBothWaysAndOutlivesItsFree) {
  constexpr size_t kSize = 3 << 20;
  void* original = nullptr;
  ASSERT_KILN_OK(kilnSetDevice(0));
  ASSERT_KILN_OK(kilnMalloc(&original, kSize));
  ASSERT_KILN_OK(kilnMemsetAsync(original, 7, kSize, nullptr));
  int fd = -1;
  size_t size = 0, offset = 99;
  unsigned char* inside = static_cast<unsigned char*>(original) + 4096 + 5;
  ASSERT_KILN_OK(kilnMemExportToShareableHandle(&fd, &size, &offset, inside));
  EXPECT_GE(fd, 0);
  EXPECT_EQ(size, kSize);
  EXPECT_EQ(offset, 4096u + 5);

  void* imported = nullptr;
  ASSERT_KILN_OK(kilnMemImportFromShareableHandle(&imported, fd, size, 1));
  ASSERT_EQ(close(fd), 0);
  EXPECT_NE(imported, original);
  kilnPointerAttributes a{};
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, imported));
  EXPECT_EQ(a.type, kilnMemoryTypeDevice);
  EXPECT_EQ(a.device, 1);
  ASSERT_KILN_OK(kilnDeviceSynchronize());
  EXPECT_EQ(Read(imported, kSize), std::vector<unsigned char>(kSize, 7));

  // A write through the import (on device 1's stream) is seen by the original.
  ASSERT_KILN_OK(kilnSetDevice(1));
  ASSERT_KILN_OK(kilnMemsetAsync(static_cast<unsigned char*>(imported) + 10, 9, 6, nullptr));
  ASSERT_KILN_OK(kilnDeviceSynchronize());
  ASSERT_KILN_OK(kilnSetDevice(0));
  const auto seen = Read(original, 32);
  EXPECT_EQ(seen[9], 7);
  EXPECT_EQ(seen[10], 9);
  EXPECT_EQ(seen[15], 9);
  EXPECT_EQ(seen[16], 7);

  // Imports are not charged to the importing device.
  size_t free_bytes = 0, total = 0;
  ASSERT_KILN_OK(kilnSetDevice(1));
  ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
  EXPECT_EQ(free_bytes, total);

  ASSERT_KILN_OK(kilnFree(original));  // the import keeps the pages
  EXPECT_EQ(Read(imported, 16)[0], 7);
  ASSERT_KILN_OK(kilnFree(imported));
  ASSERT_KILN_OK(kilnPointerGetAttributes(&a, imported));
  EXPECT_NE(a.type, kilnMemoryTypeDevice);  // unmapped and unregistered
  ASSERT_KILN_OK(kilnSetDevice(0));
}

TEST(Ipc, BadHandlesAreClearErrors) {
  int fd = -1;
  size_t size = 0, offset = 0;
  int host = 0;
  EXPECT_KILN_ERR(kilnMemExportToShareableHandle(&fd, &size, &offset, &host),
                  kilnErrorInvalidDevicePointer);
  EXPECT_NE(LastMessage().find("only device memory can be shared"), std::string::npos)
      << LastMessage();
  EXPECT_KILN_ERR(kilnMemExportToShareableHandle(nullptr, &size, &offset, &host),
                  kilnErrorInvalidValue);

  void* p = nullptr;
  EXPECT_KILN_ERR(kilnMemImportFromShareableHandle(&p, -1, 4096, 0), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("not an open file descriptor"), std::string::npos) << LastMessage();

  void* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev, 8192));
  ASSERT_KILN_OK(kilnMemExportToShareableHandle(&fd, &size, &offset, dev));
  EXPECT_KILN_ERR(kilnMemImportFromShareableHandle(&p, fd, size * 4, 0), kilnErrorInvalidValue);
  EXPECT_NE(LastMessage().find("not the handle of that allocation"), std::string::npos)
      << LastMessage();
  EXPECT_KILN_ERR(kilnMemImportFromShareableHandle(&p, fd, size, 64), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnMemImportFromShareableHandle(&p, fd, 0, 0), kilnErrorInvalidValue);
  close(fd);
  ASSERT_KILN_OK(kilnFree(dev));
}

// The child maps the parent's allocation from an inherited descriptor, checks
// the parent's bytes and writes its own.
TEST(ChildIpc, ImportsAndWrites) {
  const int fd = std::stoi(ChildParam("KILN_TEST_FD"));
  const size_t size = std::stoul(ChildParam("KILN_TEST_SIZE"));
  void* p = nullptr;
  ASSERT_KILN_OK(kilnMemImportFromShareableHandle(&p, fd, size, 0));
  close(fd);
  EXPECT_EQ(Read(p, size), std::vector<unsigned char>(size, 3));
  ASSERT_KILN_OK(kilnMemsetAsync(p, 5, 100, nullptr));
  ASSERT_KILN_OK(kilnDeviceSynchronize());
  ASSERT_KILN_OK(kilnFree(p));
}

TEST(Ipc, AnotherProcessSharesTheBytes) {
  constexpr size_t kSize = 1 << 20;
  void* dev = nullptr;
  ASSERT_KILN_OK(kilnMalloc(&dev, kSize));
  ASSERT_KILN_OK(kilnMemsetAsync(dev, 3, kSize, nullptr));
  ASSERT_KILN_OK(kilnDeviceSynchronize());
  int fd = -1;
  size_t size = 0, offset = 0;
  ASSERT_KILN_OK(kilnMemExportToShareableHandle(&fd, &size, &offset, dev));
  // Inheritable for the child (the runtime hands out close-on-exec copies).
  const int inheritable = dup(fd);
  close(fd);
  ASSERT_GE(inheritable, 0);
  ExpectChildPasses("ChildIpc.ImportsAndWrites",
                    {{"KILN_TEST_FD", std::to_string(inheritable)},
                     {"KILN_TEST_SIZE", std::to_string(size)}});
  close(inheritable);
  const auto seen = Read(dev, 128);
  EXPECT_EQ(seen[0], 5);
  EXPECT_EQ(seen[99], 5);
  EXPECT_EQ(seen[100], 3);
  ASSERT_KILN_OK(kilnFree(dev));
}

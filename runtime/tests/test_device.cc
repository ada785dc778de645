// test_device.cc — device count, selection and properties (default environment).
#include <cstring>
#include <thread>

#include "test_util.h"

using kiln_test::LastMessage;

TEST(Device, DefaultCountIsTwo) {
  int count = -1;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  EXPECT_EQ(count, 2);
}

TEST(Device, PropertiesDescribeEachDevice) {
  for (int d = 0; d < 2; ++d) {
    kilnDeviceProp prop;
    std::memset(&prop, 0xff, sizeof prop);
    ASSERT_KILN_OK(kilnGetDeviceProperties(&prop, d));
    EXPECT_STREQ(prop.name, "Kiln reference device");
    EXPECT_EQ(prop.totalGlobalMem, size_t{16} << 30);
    EXPECT_GE(prop.multiProcessorCount, 1);
    EXPECT_EQ(prop.streamPriorityLowest, 0);
    EXPECT_EQ(prop.streamPriorityHighest, -1);
  }
}

TEST(Device, CurrentDeviceDefaultsToZeroAndFollowsSetDevice) {
  int d = -1;
  ASSERT_KILN_OK(kilnGetDevice(&d));
  EXPECT_EQ(d, 0);
  ASSERT_KILN_OK(kilnSetDevice(1));
  ASSERT_KILN_OK(kilnGetDevice(&d));
  EXPECT_EQ(d, 1);
  ASSERT_KILN_OK(kilnSetDevice(0));
}

TEST(Device, SetDeviceRejectsIndexOutOfRange) {
  ASSERT_KILN_OK(kilnSetDevice(1));
  EXPECT_KILN_ERR(kilnSetDevice(7), kilnErrorInvalidDevice);
  const std::string message = LastMessage();
  EXPECT_NE(message.find("kilnSetDevice"), std::string::npos) << message;
  EXPECT_NE(message.find("7"), std::string::npos) << message;
  EXPECT_NE(message.find("0 to 1"), std::string::npos) << message;
  EXPECT_KILN_ERR(kilnSetDevice(-1), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnSetDevice(2), kilnErrorInvalidDevice);
  int d = -1;
  ASSERT_KILN_OK(kilnGetDevice(&d));
  EXPECT_EQ(d, 1) << "a rejected kilnSetDevice must not change the current device";
  ASSERT_KILN_OK(kilnSetDevice(0));
}

TEST(Device, GetDevicePropertiesRejectsBadIndex) {
  kilnDeviceProp prop;
  EXPECT_KILN_ERR(kilnGetDeviceProperties(&prop, -1), kilnErrorInvalidDevice);
  EXPECT_NE(LastMessage().find("-1"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnGetDeviceProperties(&prop, 2), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnGetDeviceProperties(nullptr, 0), kilnErrorInvalidValue);
}

TEST(Device, CurrentDeviceIsPerThread) {
  ASSERT_KILN_OK(kilnSetDevice(1));
  int other = -1;
  kilnError_t err = kilnErrorUnknown;
  std::thread([&] { err = kilnGetDevice(&other); }).join();
  EXPECT_KILN_OK(err);
  EXPECT_EQ(other, 0) << "a new thread starts on device 0";
  int mine = -1;
  ASSERT_KILN_OK(kilnGetDevice(&mine));
  EXPECT_EQ(mine, 1);
  ASSERT_KILN_OK(kilnSetDevice(0));
}

TEST(Device, StreamPriorityRangeMatchesCuda) {
  int least = 99, greatest = 99;
  ASSERT_KILN_OK(kilnDeviceGetStreamPriorityRange(&least, &greatest));
  EXPECT_EQ(least, 0);
  EXPECT_EQ(greatest, -1);
}

TEST(Device, MemGetInfoReportsCapacityOfCurrentDevice) {
  for (int d = 0; d < 2; ++d) {
    ASSERT_KILN_OK(kilnSetDevice(d));
    size_t free_bytes = 0, total = 0;
    ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
    EXPECT_EQ(total, size_t{16} << 30);
    EXPECT_LE(free_bytes, total);
  }
  ASSERT_KILN_OK(kilnSetDevice(0));
  size_t total = 0;
  EXPECT_KILN_ERR(kilnMemGetInfo(nullptr, &total), kilnErrorInvalidValue);
}

TEST(Device, DeviceSynchronizeWaitsForEveryStreamOfTheDevice) {
  kilnStream_t streams[3];
  for (auto& s : streams) ASSERT_KILN_OK(kilnStreamCreate(&s));
  int done[4] = {0, 0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    ASSERT_KILN_OK(kiln_test::Launch(streams[i], [&done, i] {
      volatile unsigned sink = 0;
      for (unsigned k = 0; k < 100000; ++k) sink = sink + k;
      done[i] = 1;
    }));
  }
  ASSERT_KILN_OK(kiln_test::Launch(nullptr, [&done] { done[3] = 1; }));
  ASSERT_KILN_OK(kilnDeviceSynchronize());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(done[i], 1) << "stream " << i;
  for (auto& s : streams) ASSERT_KILN_OK(kilnStreamDestroy(s));
}

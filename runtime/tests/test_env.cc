// test_env.cc — parsing of KILN_DEVICE_COUNT, KILN_DEVICE_MEMORY,
// KILN_LAUNCH_BLOCKING, KILN_LAUNCH_QUEUE_DEPTH and KILN_VISIBLE_DEVICES. Every case runs in a child
// process with that environment (the runtime reads it once per process); see
// test_util.h.
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "test_util.h"

using kiln_test::ChildParam;
using kiln_test::ExpectChildPasses;
using kiln_test::LastMessage;

// --- Child bodies: their parameters come from KILN_TEST_* variables ---------

// Expects the device count KILN_TEST_EXPECT_COUNT and working devices.
TEST(ChildEnv, DeviceCountIs) {
  const int expected = std::stoi(ChildParam("KILN_TEST_EXPECT_COUNT"));
  int count = -1;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  EXPECT_EQ(count, expected);
  for (int d = 0; d < count; ++d) {
    ASSERT_KILN_OK(kilnSetDevice(d));
    void* p = nullptr;
    ASSERT_KILN_OK(kilnMalloc(&p, 64));
    kilnPointerAttributes a;
    ASSERT_KILN_OK(kilnPointerGetAttributes(&a, p));
    EXPECT_EQ(a.device, d);
    ASSERT_KILN_OK(kilnFree(p));
  }
  EXPECT_KILN_ERR(kilnSetDevice(count), kilnErrorInvalidDevice);
  kilnDeviceProp prop;
  EXPECT_KILN_ERR(kilnGetDeviceProperties(&prop, count), kilnErrorInvalidDevice);
}

// Expects the devices to be those of the machine listed (by pciBusID, i.e.
// index among the KILN_DEVICE_COUNT devices) in KILN_TEST_EXPECT_BUS_IDS
// ("1,0"; "" for none), numbered 0..n-1, each working.
TEST(ChildEnv, VisibleDevicesAre) {
  const std::string ids = ChildParam("KILN_TEST_EXPECT_BUS_IDS");
  std::vector<int> expected;
  for (size_t start = 0; start < ids.size();) {
    const size_t comma = ids.find(',', start);
    expected.push_back(std::stoi(ids.substr(start, comma - start)));
    start = comma == std::string::npos ? ids.size() : comma + 1;
  }
  int count = -1;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  ASSERT_EQ(count, static_cast<int>(expected.size()));
  for (int d = 0; d < count; ++d) {
    kilnDeviceProp prop;
    ASSERT_KILN_OK(kilnGetDeviceProperties(&prop, d));
    EXPECT_EQ(prop.pciBusID, expected[static_cast<size_t>(d)]) << "device " << d;
    ASSERT_KILN_OK(kilnSetDevice(d));
    void* p = nullptr;
    ASSERT_KILN_OK(kilnMalloc(&p, 64));
    kilnPointerAttributes a;
    ASSERT_KILN_OK(kilnPointerGetAttributes(&a, p));
    EXPECT_EQ(a.device, d);
    ASSERT_KILN_OK(kilnFree(p));
  }
  EXPECT_KILN_ERR(kilnSetDevice(count), kilnErrorInvalidDevice);
  if (std::getenv("KILN_VISIBLE_DEVICES") != nullptr) {
    EXPECT_NE(LastMessage().find("KILN_VISIBLE_DEVICES='"), std::string::npos) << LastMessage();
  }
}

// With no devices, device calls fail cleanly and say why.
TEST(ChildEnv, NoDevices) {
  int count = -1;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  EXPECT_EQ(count, 0);
  int d = -1;
  EXPECT_KILN_ERR(kilnGetDevice(&d), kilnErrorInvalidDevice);
  EXPECT_NE(LastMessage().find("no kiln devices"), std::string::npos) << LastMessage();
  EXPECT_KILN_ERR(kilnSetDevice(0), kilnErrorInvalidDevice);
  void* p = nullptr;
  EXPECT_KILN_ERR(kilnMalloc(&p, 16), kilnErrorInvalidDevice);
  kilnStream_t s = nullptr;
  EXPECT_KILN_ERR(kilnStreamCreate(&s), kilnErrorInvalidDevice);
  EXPECT_KILN_ERR(kilnStreamSynchronize(nullptr), kilnErrorInvalidDevice);
  int released = 0;
  EXPECT_KILN_ERR(kilnLaunchTask(
                      nullptr, [](void*) { return kilnSuccess; },
                      [](void* u) { ++*static_cast<int*>(u); }, &released, "t"),
                  kilnErrorInvalidDevice);
  EXPECT_EQ(released, 1) << "a rejected launch still releases its userData";
  // Pinned host memory needs no device.
  void* h = nullptr;
  ASSERT_KILN_OK(kilnMallocHost(&h, 64));
  ASSERT_KILN_OK(kilnFreeHost(h));
}

// Every call fails with kilnErrorInitializationError and a message containing
// each of the ';'-separated parts of KILN_TEST_EXPECT_MESSAGE.
TEST(ChildEnv, InvalidEnvironment) {
  const std::string parts = ChildParam("KILN_TEST_EXPECT_MESSAGE");
  int count = -1;
  EXPECT_KILN_ERR(kilnGetDeviceCount(&count), kilnErrorInitializationError);
  const std::string message = LastMessage();
  size_t start = 0;
  while (start <= parts.size()) {
    const size_t end = parts.find(';', start);
    const std::string part = parts.substr(start, end == std::string::npos ? std::string::npos : end - start);
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  void* p = nullptr;
  EXPECT_KILN_ERR(kilnMalloc(&p, 16), kilnErrorInitializationError);
  EXPECT_KILN_ERR(kilnSetDevice(0), kilnErrorInitializationError);
  kilnStream_t s = nullptr;
  EXPECT_KILN_ERR(kilnStreamCreate(&s), kilnErrorInitializationError);
  int version = 0;
  EXPECT_KILN_OK(kilnRuntimeGetVersion(&version));  // needs no devices
  EXPECT_EQ(version, KILN_RUNTIME_VERSION);
}

// Expects totalGlobalMem == KILN_TEST_EXPECT_BYTES on every device.
TEST(ChildEnv, DeviceMemoryIs) {
  const size_t expected = std::stoull(ChildParam("KILN_TEST_EXPECT_BYTES"));
  int count = 0;
  ASSERT_KILN_OK(kilnGetDeviceCount(&count));
  ASSERT_EQ(count, 2);
  for (int d = 0; d < count; ++d) {
    kilnDeviceProp prop;
    ASSERT_KILN_OK(kilnGetDeviceProperties(&prop, d));
    EXPECT_EQ(prop.totalGlobalMem, expected);
    ASSERT_KILN_OK(kilnSetDevice(d));
    size_t free_bytes = 0, total = 0;
    ASSERT_KILN_OK(kilnMemGetInfo(&free_bytes, &total));
    EXPECT_EQ(total, expected);
    EXPECT_EQ(free_bytes, expected);
  }
}

// --- Parents --------------------------------------------------------------------

namespace {

// A gtest-safe test name suffix for an environment value.
std::string NameFor(const char* value) {
  if (value == nullptr) return "unset";
  std::string out;
  for (const char* c = value; *c != '\0'; ++c) {
    const bool alnum = (*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z');
    out += alnum ? *c : (*c == '-' ? 'm' : '_');
  }
  return out.empty() ? "empty" : out;
}

}  // namespace

struct CountCase {
  const char* value;  // nullptr: unset
  int expected;
};

void PrintTo(const CountCase& c, std::ostream* os) {
  *os << "KILN_DEVICE_COUNT=" << (c.value ? c.value : "(unset)") << " -> " << c.expected;
}

class DeviceCountEnv : public testing::TestWithParam<CountCase> {};

TEST_P(DeviceCountEnv, GivesThatManyDevices) {
  const CountCase c = GetParam();
  kiln_test::EnvOverrides env = {{"KILN_TEST_EXPECT_COUNT", std::to_string(c.expected)}};
  if (c.value != nullptr) env.push_back({"KILN_DEVICE_COUNT", std::string(c.value)});
  else env.push_back({"KILN_DEVICE_COUNT", std::nullopt});
  ExpectChildPasses("ChildEnv.DeviceCountIs", env);
}

INSTANTIATE_TEST_SUITE_P(Values, DeviceCountEnv,
                         testing::Values(CountCase{nullptr, 2}, CountCase{"", 2}, CountCase{"1", 1},
                                         CountCase{"3", 3}, CountCase{"64", 64},
                                         CountCase{"007", 7}),
                         [](const auto& p) { return NameFor(p.param.value); });

TEST(DeviceCountEnvZero, NoDevicesFailCleanly) {
  ExpectChildPasses("ChildEnv.NoDevices", {{"KILN_DEVICE_COUNT", "0"}});
}

struct VisibleCase {
  const char* count;    // KILN_DEVICE_COUNT
  const char* visible;  // KILN_VISIBLE_DEVICES
  const char* bus_ids;  // the devices seen, by index among KILN_DEVICE_COUNT
};

void PrintTo(const VisibleCase& c, std::ostream* os) {
  *os << "KILN_DEVICE_COUNT=" << c.count << " KILN_VISIBLE_DEVICES='" << c.visible << "' -> ["
      << c.bus_ids << "]";
}

class VisibleDevicesEnv : public testing::TestWithParam<VisibleCase> {};

// CUDA_VISIBLE_DEVICES's rules (Note [KILN_VISIBLE_DEVICES] in env.cc).
TEST_P(VisibleDevicesEnv, SelectsAndRenumbersAsCudaVisibleDevices) {
  const VisibleCase c = GetParam();
  ExpectChildPasses("ChildEnv.VisibleDevicesAre",
                    {{"KILN_DEVICE_COUNT", std::string(c.count)},
                     {"KILN_VISIBLE_DEVICES", std::string(c.visible)},
                     {"KILN_TEST_EXPECT_BUS_IDS", std::string(c.bus_ids)}});
}

INSTANTIATE_TEST_SUITE_P(
    Values, VisibleDevicesEnv,
    testing::Values(VisibleCase{"2", "1", "1"}, VisibleCase{"2", "1,0", "1,0"},
                    VisibleCase{"4", "3,1", "3,1"}, VisibleCase{"2", "", ""},
                    VisibleCase{"2", "-1", ""}, VisibleCase{"3", "0,-1,1", "0"},
                    VisibleCase{"2", "0,5,1", "0"}, VisibleCase{"2", "1,1", ""},
                    VisibleCase{"3", "0,1,0", ""}, VisibleCase{"3", "1gpu,2", "1,2"},
                    VisibleCase{"2", " 1 , 0 ", "1,0"}, VisibleCase{"2", "GPU-1234", ""},
                    VisibleCase{"2", "x,0", ""}, VisibleCase{"2", "00001", "1"},
                    VisibleCase{"2", "0,99999999999999999999999", "0"},
                    VisibleCase{"2", "0,-1,0", "0"}),
    [](const auto& p) {
      return std::string("count") + p.param.count + "_" + NameFor(p.param.visible);
    });

TEST(VisibleDevicesEnvUnset, EveryDeviceInOrder) {
  ExpectChildPasses("ChildEnv.VisibleDevicesAre", {{"KILN_DEVICE_COUNT", "3"},
                                                    {"KILN_VISIBLE_DEVICES", std::nullopt},
                                                    {"KILN_TEST_EXPECT_BUS_IDS", "0,1,2"}});
}

struct InvalidCase {
  const char* variable;
  const char* value;
  const char* expect;  // ';'-separated parts of the message
};

void PrintTo(const InvalidCase& c, std::ostream* os) { *os << c.variable << "='" << c.value << "'"; }

class InvalidEnv : public testing::TestWithParam<InvalidCase> {};

TEST_P(InvalidEnv, IsAnInitializationErrorNamingVariableValueAndAcceptedForms) {
  const InvalidCase c = GetParam();
  ExpectChildPasses("ChildEnv.InvalidEnvironment",
                    {{c.variable, std::string(c.value)},
                     {"KILN_TEST_EXPECT_MESSAGE", std::string(c.expect)}});
}

INSTANTIATE_TEST_SUITE_P(
    DeviceCount, InvalidEnv,
    testing::Values(InvalidCase{"KILN_DEVICE_COUNT", "abc", "KILN_DEVICE_COUNT='abc';0 to 64"},
                    InvalidCase{"KILN_DEVICE_COUNT", "-1", "KILN_DEVICE_COUNT='-1';0 to 64"},
                    InvalidCase{"KILN_DEVICE_COUNT", "65", "KILN_DEVICE_COUNT='65';0 to 64"},
                    InvalidCase{"KILN_DEVICE_COUNT", "2x", "KILN_DEVICE_COUNT='2x';0 to 64"},
                    InvalidCase{"KILN_DEVICE_COUNT", " 2", "KILN_DEVICE_COUNT=' 2';0 to 64"},
                    InvalidCase{"KILN_DEVICE_COUNT", "99999999999999999999999",
                                "KILN_DEVICE_COUNT='99999999999999999999999'"}),
    [](const auto& p) { return NameFor(p.param.value); });

INSTANTIATE_TEST_SUITE_P(
    DeviceMemory, InvalidEnv,
    testing::Values(
        InvalidCase{"KILN_DEVICE_MEMORY", "16GB", "KILN_DEVICE_MEMORY='16GB';16GiB;KiB, MiB, GiB or TiB"},
        InvalidCase{"KILN_DEVICE_MEMORY", "512MB", "KILN_DEVICE_MEMORY='512MB';512MiB"},
        InvalidCase{"KILN_DEVICE_MEMORY", "1.5GiB", "KILN_DEVICE_MEMORY='1.5GiB';KiB, MiB, GiB or TiB"},
        InvalidCase{"KILN_DEVICE_MEMORY", "16gib", "KILN_DEVICE_MEMORY='16gib'"},
        InvalidCase{"KILN_DEVICE_MEMORY", "16 GiB", "KILN_DEVICE_MEMORY='16 GiB'"},
        InvalidCase{"KILN_DEVICE_MEMORY", "GiB", "KILN_DEVICE_MEMORY='GiB'"},
        InvalidCase{"KILN_DEVICE_MEMORY", "-1", "KILN_DEVICE_MEMORY='-1'"},
        InvalidCase{"KILN_DEVICE_MEMORY", "99999999TiB", "KILN_DEVICE_MEMORY='99999999TiB';64 bits"}),
    [](const auto& p) { return NameFor(p.param.value); });

INSTANTIATE_TEST_SUITE_P(
    LaunchBlocking, InvalidEnv,
    testing::Values(InvalidCase{"KILN_LAUNCH_BLOCKING", "2", "KILN_LAUNCH_BLOCKING='2';expected 1"},
                    InvalidCase{"KILN_LAUNCH_BLOCKING", "yes", "KILN_LAUNCH_BLOCKING='yes'"}),
    [](const auto& p) { return NameFor(p.param.value); });

INSTANTIATE_TEST_SUITE_P(
    LaunchQueueDepth, InvalidEnv,
    testing::Values(
        InvalidCase{"KILN_LAUNCH_QUEUE_DEPTH", "0", "KILN_LAUNCH_QUEUE_DEPTH='0';from 1 to 1048576"},
        InvalidCase{"KILN_LAUNCH_QUEUE_DEPTH", "1048577", "KILN_LAUNCH_QUEUE_DEPTH='1048577'"},
        InvalidCase{"KILN_LAUNCH_QUEUE_DEPTH", "many", "KILN_LAUNCH_QUEUE_DEPTH='many';1024"}),
    [](const auto& p) { return NameFor(p.param.value); });

struct MemoryCase {
  const char* value;
  unsigned long long bytes;
};

void PrintTo(const MemoryCase& c, std::ostream* os) {
  *os << "KILN_DEVICE_MEMORY='" << c.value << "' -> " << c.bytes;
}

class DeviceMemoryEnv : public testing::TestWithParam<MemoryCase> {};

TEST_P(DeviceMemoryEnv, SetsEveryDevicesCapacity) {
  const MemoryCase c = GetParam();
  ExpectChildPasses("ChildEnv.DeviceMemoryIs",
                    {{"KILN_DEVICE_MEMORY", std::string(c.value)},
                     {"KILN_TEST_EXPECT_BYTES", std::to_string(c.bytes)}});
}

INSTANTIATE_TEST_SUITE_P(Values, DeviceMemoryEnv,
                         testing::Values(MemoryCase{"1048576", 1ull << 20}, MemoryCase{"1000", 1000},
                                         MemoryCase{"0", 0}, MemoryCase{"64KiB", 64ull << 10},
                                         MemoryCase{"512MiB", 512ull << 20},
                                         MemoryCase{"3GiB", 3ull << 30},
                                         MemoryCase{"2TiB", 2ull << 40}, MemoryCase{"", 16ull << 30}),
                         [](const auto& p) { return NameFor(p.param.value); });

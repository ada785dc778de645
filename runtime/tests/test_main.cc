// test_main.cc — main() of kiln_runtime_tests.
//
// Two modes (see test_util.h, "Child processes"):
//   - normal: the KILN_* variables are removed from the environment before
//     the runtime can read them, so the suite always tests the documented
//     defaults (2 devices, 16GiB, asynchronous streams) whatever the caller's
//     shell has set; suites named Child* are filtered out (also from
//     --gtest_list_tests, so CTest never registers them).
//   - KILN_TEST_CHILD=1: a parent test re-executed us to run one Child* test
//     with the environment it chose; nothing is changed.
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <string>

#include "test_util.h"

int main(int argc, char** argv) {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  kiln_test::SetSelfExecutable(n > 0 ? std::string(self, static_cast<size_t>(n)) : argv[0]);

  const bool child = std::getenv("KILN_TEST_CHILD") != nullptr;
  if (!child) {
    unsetenv("KILN_DEVICE_COUNT");
    unsetenv("KILN_DEVICE_MEMORY");
    unsetenv("KILN_LAUNCH_BLOCKING");
    unsetenv("KILN_VISIBLE_DEVICES");
  }

  testing::InitGoogleTest(&argc, argv);

  if (!child) {
    std::string filter = GTEST_FLAG_GET(filter);
    filter += filter.find('-') == std::string::npos ? "-Child*" : ":Child*";
    GTEST_FLAG_SET(filter, filter);
  }
  return RUN_ALL_TESTS();
}

// env.cc — reads the runtime's environment variables, once, at initialisation.
//
// Why strict parsing: a typo in KILN_DEVICE_MEMORY ("16GB", "16 GiB") that
// silently fell back to a default would make out-of-memory behaviour differ
// from what the user asked for, and the difference would surface far from its
// cause. So anything but the documented forms is an initialisation error whose
// message names the variable, the bad value and what is accepted. An empty
// value counts as unset, as most shells make it easy to produce one.
//
//   KILN_DEVICE_COUNT     integer 0..64, default 2
//   KILN_DEVICE_MEMORY    bytes per device: "17179869184", or a whole number
//                         with KiB, MiB, GiB or TiB ("512MiB", "16GiB");
//                         default 16GiB. Decimal units (GB, MB) are refused
//                         rather than guessed.
//   KILN_LAUNCH_BLOCKING  "0" or "1", default 0
//   KILN_LAUNCH_QUEUE_DEPTH  entries a stream holds before a launching host
//                         thread waits: integer 1..1048576, default 1024
#include <cstdlib>
#include <cstring>

#include "runtime_internal.h"

namespace kiln {
namespace {

// Parses a non-empty run of decimal digits into *out; false on anything else
// or on overflow past `limit`.
bool ParseDecimal(const std::string& s, uint64_t limit, uint64_t* out) {
  if (s.empty()) return false;
  uint64_t value = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const uint64_t digit = static_cast<uint64_t>(c - '0');
    if (value > (limit - digit) / 10) return false;
    value = value * 10 + digit;
  }
  *out = value;
  return true;
}

const char* Getenv(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

std::string ParseDeviceCount(const char* value, Config* config) {
  uint64_t n = 0;
  if (!ParseDecimal(value, UINT64_MAX, &n) || n > static_cast<uint64_t>(kMaxDevices)) {
    return StrFormat(
        "KILN_DEVICE_COUNT='%s' is invalid: expected a whole number of devices from 0 to %d "
        "(unset it for the default of %d)",
        value, kMaxDevices, kDefaultDeviceCount);
  }
  config->device_count = static_cast<int>(n);
  return {};
}

std::string ParseDeviceMemory(const char* value, Config* config) {
  static const struct {
    const char* suffix;
    int shift;
  } kSuffixes[] = {{"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40}};

  const std::string s(value);
  size_t digits = 0;
  while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
  const std::string number = s.substr(0, digits);
  const std::string suffix = s.substr(digits);

  int shift = -1;
  if (suffix.empty()) shift = 0;
  for (const auto& u : kSuffixes)
    if (suffix == u.suffix) shift = u.shift;

  uint64_t n = 0;
  if (shift >= 0 && ParseDecimal(number, UINT64_MAX >> shift, &n)) {
    config->device_memory = n << shift;
    return {};
  }

  std::string hint;
  if (!number.empty() && (suffix == "GB" || suffix == "MB" || suffix == "KB" || suffix == "TB" ||
                          suffix == "G" || suffix == "M" || suffix == "K" || suffix == "T")) {
    hint = StrFormat(" ('%s' is ambiguous between decimal and binary units; write %s%ciB)",
                     suffix.c_str(), number.c_str(), suffix[0]);
  } else if (shift >= 0 && !number.empty()) {
    hint = " (the value does not fit in 64 bits)";
  }
  return StrFormat(
      "KILN_DEVICE_MEMORY='%s' is invalid%s: expected a number of bytes per device, either "
      "plain (e.g. 1073741824) or a whole number followed by KiB, MiB, GiB or TiB "
      "(e.g. 512MiB, 16GiB); unset it for the default of 16GiB",
      value, hint.c_str());
}

std::string ParseLaunchBlocking(const char* value, Config* config) {
  if (std::strcmp(value, "0") == 0 || std::strcmp(value, "1") == 0) {
    config->launch_blocking = value[0] == '1';
    return {};
  }
  return StrFormat(
      "KILN_LAUNCH_BLOCKING='%s' is invalid: expected 1 (run every task on the launching "
      "thread) or 0 (asynchronous streams, the default)",
      value);
}

std::string ParseLaunchQueueDepth(const char* value, Config* config) {
  uint64_t n = 0;
  if (ParseDecimal(value, UINT64_MAX, &n) && n >= 1 && n <= kMaxLaunchQueueDepth) {
    config->launch_queue_depth = static_cast<size_t>(n);
    return {};
  }
  return StrFormat(
      "KILN_LAUNCH_QUEUE_DEPTH='%s' is invalid: expected a whole number of queued entries per "
      "stream from 1 to %zu (unset it for the default of %zu)",
      value, kMaxLaunchQueueDepth, kDefaultLaunchQueueDepth);
}

}  // namespace

Config ReadConfig() {
  Config config;
  std::string errors;
  auto note = [&errors](std::string e) {
    if (e.empty()) return;
    if (!errors.empty()) errors += "; ";
    errors += e;
  };
  if (const char* v = Getenv("KILN_DEVICE_COUNT")) note(ParseDeviceCount(v, &config));
  if (const char* v = Getenv("KILN_DEVICE_MEMORY")) note(ParseDeviceMemory(v, &config));
  if (const char* v = Getenv("KILN_LAUNCH_BLOCKING")) note(ParseLaunchBlocking(v, &config));
  if (const char* v = Getenv("KILN_LAUNCH_QUEUE_DEPTH")) note(ParseLaunchQueueDepth(v, &config));
  if (!errors.empty()) config.error = "invalid kiln environment: " + errors;
  return config;
}

}  // namespace kiln

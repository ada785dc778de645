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
//   KILN_VISIBLE_DEVICES  which of the KILN_DEVICE_COUNT devices this process
//                         sees, with CUDA_VISIBLE_DEVICES's rules (below)
//
// Note [KILN_VISIBLE_DEVICES]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// KILN_DEVICE_COUNT is the number of devices "in the machine";
// KILN_VISIBLE_DEVICES, like CUDA_VISIBLE_DEVICES, selects some of them, in
// the order given, and numbers them 0..n-1 for this process: with
// KILN_VISIBLE_DEVICES=1 the process has one device, kiln:0, which is device 1
// of the machine (kilnDeviceProp::pciBusID says which). Its rules are
// CUDA's, as PyTorch models them (torch/cuda/__init__.py,
// _parse_visible_devices and _device_count_nvml), deliberately not kiln's
// strict parsing: programs and launchers written for CUDA rely on them
// (CUDA_VISIBLE_DEVICES= and =-1 to hide every device):
//   - unset: every device is visible; set but empty: none is;
//   - entries are separated by commas; each, without surrounding blanks, is
//     read like strtoul: an optional sign and the leading digits ("1gpu" is
//     1);
//   - the list ends at the first entry that is not a number or is negative:
//     only the devices before it are visible ("0,-1,1" is device 0);
//   - a device listed twice (before that end) makes no device visible;
//   - then the list ends at the first index that is not below
//     KILN_DEVICE_COUNT ("0,5,1" with 2 devices is device 0).
// This is the one variable an unexpected value of which does not make the
// environment invalid, as CUDA raises nothing for it either.
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

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

// One entry of KILN_VISIBLE_DEVICES read as PyTorch's _strtoul reads it: its
// index as decimal digits without leading zeros (kept as text so that indices
// of any length compare exactly, as Python's ints do), or nothing when the
// list ends here (not a number, or negative).
std::optional<std::string> ParseVisibleEntry(std::string entry) {
  const auto blank = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  while (!entry.empty() && blank(entry.front())) entry.erase(entry.begin());
  while (!entry.empty() && blank(entry.back())) entry.pop_back();
  size_t i = 0;
  bool negative = false;
  if (i < entry.size() && (entry[i] == '+' || entry[i] == '-')) negative = entry[i++] == '-';
  const size_t first_digit = i;
  std::string digits;
  for (; i < entry.size() && entry[i] >= '0' && entry[i] <= '9'; ++i) {
    if (!(digits.empty() && entry[i] == '0')) digits += entry[i];
  }
  if (i == first_digit) return std::nullopt;
  if (digits.empty()) digits = "0";
  if (negative && digits != "0") return std::nullopt;
  return digits;
}

void ParseVisibleDevices(const char* value, Config* config) {
  const std::string s(value);
  std::vector<std::string> listed;
  size_t start = 0;
  bool repeated = false;
  while (true) {
    const size_t comma = s.find(',', start);
    const auto index =
        ParseVisibleEntry(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (!index) break;
    for (const std::string& seen : listed) repeated = repeated || seen == *index;
    if (repeated) break;
    listed.push_back(*index);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  std::vector<int> visible;
  if (!repeated) {
    for (const std::string& index : listed) {
      // Below physical_device_count (at most 64) means at most two digits.
      if (index.size() > 2 || std::stoi(index) >= config->physical_device_count) break;
      visible.push_back(std::stoi(index));
    }
  }
  config->visible_devices = std::move(visible);
  config->visible_devices_set = true;
  config->visible_devices_value = s;
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
  config.physical_device_count = config.device_count;
  config.visible_devices.clear();
  for (int i = 0; i < config.device_count; ++i) config.visible_devices.push_back(i);
  // Not Getenv: an empty KILN_VISIBLE_DEVICES hides every device, as CUDA's does.
  if (const char* v = std::getenv("KILN_VISIBLE_DEVICES")) {
    ParseVisibleDevices(v, &config);
    config.device_count = static_cast<int>(config.visible_devices.size());
  }
  if (!errors.empty()) config.error = "invalid kiln environment: " + errors;
  return config;
}

}  // namespace kiln

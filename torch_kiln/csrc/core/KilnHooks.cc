#include "core/KilnHooks.h"

#include <c10/util/Exception.h>

#include "core/KilnException.h"
#include "core/KilnFunctions.h"
#include "core/KilnGenerator.h"
#include "core/KilnHostAllocator.h"
#include "core/KilnStorage.h"

namespace c10::kiln {

bool KilnHooksInterface::isBuilt() const {
  return true;
}

bool KilnHooksInterface::isAvailable() const {
  return device_count() > 0;
}

bool KilnHooksInterface::hasPrimaryContext(DeviceIndex device_index) const {
  // The reference runtime creates a device's state on first use and has no
  // per-device context to initialise; every valid device is ready.
  return device_index >= 0 && device_index < device_count();
}

void KilnHooksInterface::init() const {
  device_count_ensure_non_zero();
}

DeviceIndex KilnHooksInterface::deviceCount() const {
  return device_count();
}

void KilnHooksInterface::setCurrentDevice(DeviceIndex device) const {
  set_device(device);
}

DeviceIndex KilnHooksInterface::getCurrentDevice() const {
  return current_device();
}

DeviceIndex KilnHooksInterface::exchangeDevice(DeviceIndex device) const {
  return exchange_device(device);
}

DeviceIndex KilnHooksInterface::maybeExchangeDevice(DeviceIndex device) const {
  return maybe_exchange_device(device);
}

bool KilnHooksInterface::isPinnedPtr(const void* data) const {
  if (data == nullptr || device_count() == 0) {
    return false;
  }
  kilnPointerAttributes attributes{};
  if (kilnPointerGetAttributes(&attributes, data) != kilnSuccess) {
    return false;
  }
  return attributes.type == kilnMemoryTypeHost;
}

at::Allocator* KilnHooksInterface::getPinnedMemoryAllocator() const {
  return getKilnHostAllocator();
}

at::Device KilnHooksInterface::getDeviceFromPtr(void* data) const {
  kilnPointerAttributes attributes{};
  KILN_CHECK(kilnPointerGetAttributes(&attributes, data));
  TORCH_CHECK(
      attributes.type == kilnMemoryTypeDevice,
      "The pointer ", data, " is not kiln device memory (it was not allocated by the kiln runtime).");
  return at::Device(DeviceType::PrivateUse1, static_cast<DeviceIndex>(attributes.device));
}

const at::Generator& KilnHooksInterface::getDefaultGenerator(DeviceIndex device_index) const {
  return getDefaultKilnGenerator(device_index);
}

at::Generator KilnHooksInterface::getNewGenerator(DeviceIndex device_index) const {
  return createKilnGenerator(device_index);
}

void KilnHooksInterface::resizePrivateUse1Bytes(const c10::Storage& storage,
                                                size_t new_bytes) const {
  resizeStorageBytes(storage.unsafeGetStorageImpl(), new_bytes);
}

namespace {
// Registered when torch_kiln._C is loaded.
const bool registered = [] {
  at::RegisterPrivateUse1HooksInterface(new KilnHooksInterface());
  return true;
}();
} // namespace

} // namespace c10::kiln

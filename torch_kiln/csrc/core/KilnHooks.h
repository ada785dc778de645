// KilnHooks.h — PyTorch's PrivateUse1 hooks for kiln (the accelerator hooks
// behind at::globalContext(): availability, generators, pinned memory,
// device-from-pointer, storage resize). Every hook PyTorch 2.13 declares in
// AcceleratorHooksInterface and PrivateUse1HooksInterface is overridden, so no
// generic code path ends in PyTorch's "You should register
// PrivateUse1HooksInterface" error. Registered at library load.
#pragma once

#include <ATen/detail/PrivateUse1HooksInterface.h>

namespace c10::kiln {

struct KilnHooksInterface final : public at::PrivateUse1HooksInterface {
  ~KilnHooksInterface() override = default;

  bool isBuilt() const override;
  bool isAvailable() const override;
  bool hasPrimaryContext(DeviceIndex device_index) const override;
  void init() const override;
  DeviceIndex deviceCount() const override;
  void setCurrentDevice(DeviceIndex device) const override;
  DeviceIndex getCurrentDevice() const override;
  DeviceIndex exchangeDevice(DeviceIndex device) const override;
  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override;
  bool isPinnedPtr(const void* data) const override;
  at::Allocator* getPinnedMemoryAllocator() const override;
  at::Device getDeviceFromPtr(void* data) const override;
  const at::Generator& getDefaultGenerator(DeviceIndex device_index) const override;
  at::Generator getNewGenerator(DeviceIndex device_index = -1) const override;
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override;
};

} // namespace c10::kiln

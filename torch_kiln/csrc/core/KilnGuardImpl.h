// KilnGuardImpl.h — c10's device guard interface for kiln, registered for
// DeviceType::PrivateUse1. PyTorch's generic machinery (c10::DeviceGuard,
// c10::StreamGuard, torch.Stream, torch.Event, torch.accelerator) reaches
// kiln devices, streams and events only through this class.
//
// Events are runtime events (kilnEvent_t) passed around as void*; they are
// created lazily by record() with timing enabled only when PyTorch asks for
// EventFlag::BACKEND_DEFAULT (torch.Event(enable_timing=True)).
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace c10::kiln {

struct KilnGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType static_type = DeviceType::PrivateUse1;

  KilnGuardImpl() = default;
  explicit KilnGuardImpl(DeviceType t);

  DeviceType type() const override;
  Device exchangeDevice(Device d) const override;
  Device getDevice() const override;
  void setDevice(Device d) const override;
  void uncheckedSetDevice(Device d) const noexcept override;
  DeviceIndex deviceCount() const noexcept override;
  // torch.accelerator.get_device_capability(): the dtypes a kiln tensor can
  // have and convert between (see the .cc). Raises for an invalid device.
  DeviceCapability getDeviceCapability(Device d) const override;

  Stream getStream(Device d) const override;
  Stream getDefaultStream(Device d) const override;
  Stream getStreamFromGlobalPool(Device d, bool isHighPriority = false) const override;
  Stream getNewStream(Device d, int priority = 0) const override;
  Stream exchangeStream(Stream s) const override;
  void* getStreamNativeHandle(const Stream s) const override;
  bool queryStream(const Stream& stream) const override;
  void synchronizeStream(const Stream& stream) const override;
  void synchronizeDevice(const DeviceIndex device_index) const override;

  void destroyEvent(void* event, const DeviceIndex device_index) const noexcept override;
  void record(void** event, const Stream& stream, const DeviceIndex device_index,
              const EventFlag flag) const override;
  void block(void* event, const Stream& stream) const override;
  bool queryEvent(void* event) const override;
  void synchronizeEvent(void* event) const override;
  double elapsedTime(void* start, void* end, const DeviceIndex device_index) const override;

  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const Stream& stream) const override;
};

} // namespace c10::kiln

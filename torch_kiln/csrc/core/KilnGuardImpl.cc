#include "core/KilnGuardImpl.h"

#include <c10/util/Exception.h>

#include "core/KilnCachingAllocator.h"
#include "core/KilnException.h"
#include "core/KilnFunctions.h"
#include "core/KilnStream.h"

namespace c10::kiln {

KilnGuardImpl::KilnGuardImpl(DeviceType t) {
  TORCH_CHECK(t == static_type, "KilnGuardImpl initialized with non-kiln DeviceType: ", t);
}

DeviceType KilnGuardImpl::type() const {
  return static_type;
}

Device KilnGuardImpl::exchangeDevice(Device d) const {
  TORCH_CHECK(d.is_privateuseone(), "Expected a kiln device, got ", d);
  const DeviceIndex previous = exchange_device(d.index());
  return Device(static_type, previous);
}

Device KilnGuardImpl::getDevice() const {
  return Device(static_type, current_device());
}

void KilnGuardImpl::setDevice(Device d) const {
  TORCH_CHECK(d.is_privateuseone(), "Expected a kiln device, got ", d);
  set_device(d.index());
}

void KilnGuardImpl::uncheckedSetDevice(Device d) const noexcept {
  KILN_WARN(kilnSetDevice(d.index()));
}

DeviceIndex KilnGuardImpl::deviceCount() const noexcept {
  return device_count();
}

DeviceCapability KilnGuardImpl::getDeviceCapability(Device d) const {
  check_device_index(d.has_index() ? d.index() : current_device());
  // PyTorch's contract ("supported_dtypes"): dtypes tensors can be allocated
  // with on the device and converted between. A kiln tensor holds any dtype
  // in device memory and converts with CPU's copy kernel, so these are the
  // dtypes CPU converts: not the quantized ones (kiln has no quantized
  // tensors), the bit and sub-byte placeholder dtypes, or float4_e2m1fn_x2,
  // for which CPU has no conversions either.
  DeviceCapability capability;
  capability.capability_data.capability_bits = 0;
  for (const int index :
       {kIndex_Byte, kIndex_Char, kIndex_Short, kIndex_Int, kIndex_Long, kIndex_Half,
        kIndex_Float, kIndex_Double, kIndex_ComplexHalf, kIndex_ComplexFloat,
        kIndex_ComplexDouble, kIndex_Bool, kIndex_BFloat16, kIndex_Float8_e5m2,
        kIndex_Float8_e4m3fn, kIndex_Float8_e5m2fnuz, kIndex_Float8_e4m3fnuz, kIndex_UInt16,
        kIndex_UInt32, kIndex_UInt64, kIndex_Float8_e8m0fnu}) {
    capability.capability_data.capability_bits |= uint64_t{1} << index;
  }
  return capability;
}

Stream KilnGuardImpl::getStream(Device d) const {
  return getCurrentKilnStream(d.index()).unwrap();
}

Stream KilnGuardImpl::getDefaultStream(Device d) const {
  return getDefaultKilnStream(d.index()).unwrap();
}

Stream KilnGuardImpl::getStreamFromGlobalPool(Device d, bool isHighPriority) const {
  return getStreamFromPool(isHighPriority ? -1 : 0, d.index()).unwrap();
}

Stream KilnGuardImpl::getNewStream(Device d, int priority) const {
  return getStreamFromPool(priority, d.index()).unwrap();
}

Stream KilnGuardImpl::exchangeStream(Stream s) const {
  const KilnStream stream(s);
  const KilnStream previous = getCurrentKilnStream(stream.device_index());
  setCurrentKilnStream(stream);
  return previous.unwrap();
}

void* KilnGuardImpl::getStreamNativeHandle(const Stream s) const {
  return KilnStream(s).stream();
}

bool KilnGuardImpl::queryStream(const Stream& stream) const {
  return KilnStream(stream).query();
}

void KilnGuardImpl::synchronizeStream(const Stream& stream) const {
  // torch.Stream.synchronize() on kiln; CUDA's sync debug mode covers it
  // (Note [Sync debug mode]).
  if (C10_UNLIKELY(syncDebugModeIsOn())) {
    warn_or_error_on_sync("torch.kiln.Stream.synchronize()");
  }
  KilnStream(stream).synchronize();
}

void KilnGuardImpl::synchronizeDevice(const DeviceIndex device_index) const {
  device_synchronize(device_index);
}

void KilnGuardImpl::destroyEvent(void* event, const DeviceIndex) const noexcept {
  if (event != nullptr) {
    KILN_WARN(kilnEventDestroy(static_cast<kilnEvent_t>(event)));
  }
}

void KilnGuardImpl::record(void** event, const Stream& stream,
                           const DeviceIndex device_index, const EventFlag flag) const {
  TORCH_CHECK(
      device_index == -1 || device_index == stream.device_index(),
      "Event device index ", static_cast<int>(device_index),
      " does not match recording stream's device index ",
      static_cast<int>(stream.device_index()), ".");
  const KilnStream kiln_stream(stream);
  auto* kiln_event = static_cast<kilnEvent_t>(*event);
  if (kiln_event == nullptr) {
    const unsigned int flags =
        flag == EventFlag::BACKEND_DEFAULT ? kilnEventDefault : kilnEventDisableTiming;
    KILN_CHECK(kilnEventCreateWithFlags(&kiln_event, flags));
    *event = kiln_event;
  }
  KILN_CHECK(kilnEventRecord(kiln_event, kiln_stream.stream()));
}

void KilnGuardImpl::block(void* event, const Stream& stream) const {
  if (event == nullptr) {
    return; // never recorded: nothing to wait for
  }
  KILN_CHECK(kilnStreamWaitEvent(KilnStream(stream).stream(),
                                 static_cast<kilnEvent_t>(event), 0));
}

bool KilnGuardImpl::queryEvent(void* event) const {
  if (event == nullptr) {
    return true;
  }
  const kilnError_t status = kilnEventQuery(static_cast<kilnEvent_t>(event));
  if (status == kilnErrorNotReady) {
    return false;
  }
  KILN_CHECK(status);
  return true;
}

void KilnGuardImpl::synchronizeEvent(void* event) const {
  if (event != nullptr) {
    KILN_CHECK(kilnEventSynchronize(static_cast<kilnEvent_t>(event)));
  }
}

double KilnGuardImpl::elapsedTime(void* start, void* end, const DeviceIndex) const {
  TORCH_CHECK(
      start != nullptr && end != nullptr,
      "Both events must be recorded before calculating elapsed time.");
  float ms = 0;
  KILN_CHECK(kilnEventElapsedTime(&ms, static_cast<kilnEvent_t>(start),
                                  static_cast<kilnEvent_t>(end)));
  return static_cast<double>(ms);
}

void KilnGuardImpl::recordDataPtrOnStream(const c10::DataPtr& data_ptr,
                                          const Stream& stream) const {
  KilnCachingAllocator::recordStream(data_ptr, KilnStream(stream));
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, KilnGuardImpl);

} // namespace c10::kiln

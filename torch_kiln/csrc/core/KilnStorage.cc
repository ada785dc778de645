#include "core/KilnStorage.h"

#include <algorithm>

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include "core/KilnCachingAllocator.h"
#include "core/KilnException.h"
#include "core/KilnStream.h"

namespace c10::kiln {

void resizeStorageBytes(c10::StorageImpl* storage, size_t new_nbytes) {
  TORCH_CHECK(
      storage->resizable(),
      "Trying to resize storage that is not resizable (a kiln storage wrapping "
      "external memory cannot change size).");
  const Device device = storage->device();
  TORCH_INTERNAL_ASSERT(device.is_privateuseone(), "resizeStorageBytes: not a kiln storage");
  c10::DeviceGuard guard(device);
  at::DataPtr new_data;
  if (new_nbytes != 0) {
    new_data = storage->allocator()->allocate(new_nbytes);
  } else {
    new_data = at::DataPtr(nullptr, device);
  }
  const size_t copy_bytes = std::min(storage->nbytes(), new_nbytes);
  if (copy_bytes > 0) {
    const KilnStream stream = getCurrentKilnStream(device.index());
    KILN_CHECK(kilnMemcpyAsync(new_data.get(), storage->data(), copy_bytes,
                               kilnMemcpyDeviceToDevice, stream.stream()));
    // The old block returns to the cache of the stream it was allocated on;
    // keep it from reuse there until this copy has read it.
    KilnCachingAllocator::recordStream(storage->data_ptr(), stream);
  }
  storage->set_data_ptr_noswap(std::move(new_data));
  storage->set_nbytes(new_nbytes);
}

} // namespace c10::kiln

// KilnStorage.h — growing and shrinking the memory behind a kiln storage.
//
// Used by resize_ / set_ kernels and by the hooks' resizePrivateUse1Bytes
// (UntypedStorage.resize_()). The old bytes (up to the smaller size) are
// copied on the device's current stream, so the copy is ordered after pending
// kernels that write them and before later kernels that read the new memory.
#pragma once

#include <cstddef>

#include <c10/core/StorageImpl.h>

namespace c10::kiln {

// Resizes `storage` (a kiln storage) to `new_nbytes` bytes. Throws if the
// storage is not resizable, and torch.OutOfMemoryError if the device cannot
// hold the new size.
void resizeStorageBytes(c10::StorageImpl* storage, size_t new_nbytes);

} // namespace c10::kiln

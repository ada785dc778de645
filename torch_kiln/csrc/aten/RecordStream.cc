// Tensor.record_stream(s) on kiln: tells the caching allocator that the
// tensor's memory is used by work queued on stream `s`, so when the tensor is
// freed its block is not handed out again until that work has finished
// (Note [Kiln caching allocator]). Metadata only: no device work.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "aten/AdaptiveEager.h"
#include "core/KilnCachingAllocator.h"

namespace at::kiln {
namespace {

void recordStream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(
      stream.device_type() == c10::DeviceType::PrivateUse1,
      "record_stream: expected a kiln stream for a kiln tensor, got a stream on ", stream.device());
  TORCH_CHECK(
      stream.device_index() == self.device().index(),
      "record_stream: the stream is on kiln:", static_cast<int>(stream.device_index()),
      " but the tensor is on ", self.device(), "; a tensor can only be recorded on streams of its own device.");
  c10::kiln::KilnCachingAllocator::recordStream(self.storage().data_ptr(),
                                                c10::kiln::KilnStream(stream));
  closeFusionGroups(); // Note [Adaptive eager fusion]
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("record_stream", TORCH_FN(recordStream));
}

} // namespace at::kiln

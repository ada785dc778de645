// Copies between kiln tensors and the host or another kiln device
// (aten::_copy_from, which copy_ calls when either side is kiln), and
// reading a single element back (aten::_local_scalar_dense, behind item()).
#include <array>
#include <atomic>
#include <cstring>

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "aten/KernelLaunch.h"
#include "aten/KilnTask.h"
#include "aten/OpSchemaInfo.h"
#include "aten/OpTracking.h"
#include "core/FailedResults.h"
#include "core/KilnEvent.h"
#include "core/KilnGraph.h"
#include "core/KilnException.h"
#include "core/KilnStream.h"

namespace at::kiln {

// Note [Kiln copies]
// ~~~~~~~~~~~~~~~~~~
// A copy is a raw byte transfer (kilnMemcpy*) when both sides hold the same
// dtype in the same dense layout; otherwise the conversion (dtype cast,
// transposition, broadcast of a stride-0 view, conj/neg bits) is done by
// ATen's CPU copy_ — on the host for host->device copies, as a task on the
// device for device->host and device->device copies — with a dense staging
// tensor in between. Either way the values are exactly CPU's, and no copy
// reads a byte outside the source tensor's elements.
//
// Synchronization follows CUDA (copy_kernel_cuda's memcpy_and_sync): a copy
// with non_blocking=False in either direction has completed when it returns —
// it waits for the stream and counts as a sync op — so the caller may
// overwrite or free the host buffer, and use the result on any stream, at
// once. That holds for pinned sources too: the runtime does not stage pinned
// memory, so returning early from a blocking pinned->device copy let the next
// pin_memory() batch overwrite the block before the device read it (the
// DataLoader(pin_memory=True) + x.to(device) loop trained on wrong batches).
// With non_blocking=True: a device->host copy into pageable memory still
// waits (the caller would read it at once); a host->device copy from pageable
// memory is staged by the runtime at the call and does not wait; with pinned
// host memory both directions are asynchronous, and the pinned block is kept
// from reuse by the host allocator until the copy ran (record_event). The
// tests in tests/test_copy_hazards.py reuse the host buffer right after each
// kind of copy, behind a busy stream.

namespace {

using c10::kiln::KilnEvent;
using c10::kiln::KilnStream;

bool hasBits(const at::Tensor& t) {
  return t.is_conj() || t.is_neg();
}

// Same strides on every dimension of size > 1.
bool sameStrides(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() != b.dim()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) {
      return false;
    }
  }
  return true;
}

// `src` can be byte-copied into `dst`: same dtype, both dense with the same
// layout, no lazy conj/neg bits.
bool byteCopyable(const at::Tensor& src, const at::Tensor& dst) {
  return src.dtype() == dst.dtype() && !hasBits(src) && !hasBits(dst) &&
      src.is_non_overlapping_and_dense() && dst.is_non_overlapping_and_dense() &&
      sameStrides(src, dst);
}

// A conversion CPU's copy_ lacks (to or from a bit dtype, float4_e2m1fn_x2,
// ...) raises CPU's error here, at the call, rather than in the device task
// that would do it (Note [Dtype errors at the call] in KilnOpExecutor.cc).
// Checked once per pair of dtypes by a one-element copy on the calling
// thread; its warnings pass through (CPU's copy_ would give them at the call
// too, and the complex-to-real one is given only once per process).
void checkConversion(c10::ScalarType from, c10::ScalarType to) {
  constexpr size_t kTypes = static_cast<size_t>(c10::ScalarType::NumOptions);
  static std::array<std::atomic<bool>, kTypes * kTypes> converts{};
  std::atomic<bool>& known = converts[static_cast<size_t>(from) * kTypes + static_cast<size_t>(to)];
  if (known.load(std::memory_order_relaxed)) {
    return;
  }
  at::Tensor source = at::empty({1}, at::TensorOptions().dtype(from));
  std::memset(source.mutable_data_ptr(), 0, source.nbytes());
  at::empty({1}, at::TensorOptions().dtype(to)).copy_(source); // raises CPU's error
  known.store(true, std::memory_order_relaxed);
}

size_t denseBytes(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.dtype().itemsize();
}

// A byte range we are about to copy lies inside the tensor's storage. It can
// only fail if the storage was shrunk under the tensor (UntypedStorage.resize_).
void checkSpanInStorage(const at::Tensor& t, size_t bytes) {
  const size_t begin = static_cast<size_t>(t.storage_offset()) * t.dtype().itemsize();
  TORCH_CHECK(
      begin + bytes <= t.storage().nbytes(), "The kiln tensor's elements (bytes ", begin, " to ",
      begin + bytes, ") extend past its storage of ", t.storage().nbytes(),
      " bytes; was the storage resized? Resize the tensor (or its storage) back before reading it.");
}

bool isPinned(const at::Tensor& t) {
  kilnPointerAttributes attributes{};
  return t.data_ptr() != nullptr &&
      kilnPointerGetAttributes(&attributes, t.data_ptr()) == kilnSuccess &&
      attributes.type == kilnMemoryTypeHost;
}

// Keeps a pinned host block from reuse until work on `stream` so far is done.
void protectPinned(const at::Tensor& host, const KilnStream& stream) {
  const auto& data_ptr = host.storage().data_ptr();
  at::getHostAllocator(at::kPrivateUse1)
      ->record_event(data_ptr.get(), data_ptr.get_context(), stream.unwrap());
}

// Waits for a blocking copy. If the wait is abandoned (Ctrl-C, Note [Ctrl-C
// during a host wait]) the copy is still queued: a pinned host side is then
// kept from reuse until it ran, so the late copy cannot reach the block's
// next owner (pageable sources were staged; pageable destinations are
// written before the runtime returns).
void synchronizeProtectingPinned(const KilnStream& stream, const at::Tensor& host) {
  try {
    stream.synchronize();
  } catch (...) {
    if (isPinned(host)) {
      protectPinned(host, stream);
    }
    throw;
  }
}

// dst = src on the device, by ATen's CPU copy_ run as a kernel on `stream`.
void launchDeviceCopy(const at::Tensor& dst, const at::Tensor& src, const KilnStream& stream) {
  static const auto copy_op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  static const OpSchemaInfo& copy_info = opSchemaInfo(copy_op);
  KernelLaunch* launch = KernelLaunch::acquire();
  launch->setOperator(copy_op, copy_info);
  launch->addArgument(c10::IValue(dst), ArgKind::Tensor, /*written=*/true, /*overwritten=*/true);
  launch->addArgument(c10::IValue(src), ArgKind::Tensor);
  launch->addArgument(c10::IValue(false), ArgKind::Other);
  launch->launch(stream);
}

at::Tensor emptyLike(const at::Tensor& layout_source, c10::ScalarType dtype, c10::Device device,
                     bool keep_strides) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  return keep_strides
      ? at::empty_strided(layout_source.sizes(), layout_source.strides(), options)
      : at::empty(layout_source.sizes(), options);
}

// Runs right behind a host->device copy on its stream. If an earlier kernel
// there failed, the runtime skips the copy and this task too: the
// destination then holds its old bytes (or, fresh from the allocator, none),
// and is marked so (Note [Results of failed kernels]) instead of being read
// later, after the error was raised and caught, as if the copy had been made.
struct HostCopySkipMark final : TaskBody {
  explicit HostCopySkipMark(const at::Tensor& target) : target_data(target.storage().data()) {}
  void run() override {}
  void skipped() override {
    const std::string& failure = lastKernelFailureOnThread();
    c10::kiln::markFailedResult(
        target_data, "the copy from host memory was skipped after an earlier kernel on its stream "
                     "failed" + (failure.empty() ? std::string() : ": " + failure));
  }
  const void* target_data;
};

// Note [Host copies in a capture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// As CUDA Graphs capture cudaMemcpyAsync with pinned memory, a kiln graph
// records an asynchronous (non_blocking=True) copy between a kiln tensor and
// a dense pinned host tensor: each replay reads the host source, or writes
// the host destination, anew, so the program refills or reads that pinned
// tensor around replays and must keep it alive as long as the graph (as on
// CUDA). Everything else a host copy could need is refused during a capture
// (and invalidates it): a blocking copy waits for the device; pageable
// memory, or a host-side staging copy for another dtype or layout, would be
// read or written once, at capture. A conversion on the device side is
// captured as a kernel. The pinned block is not protected by a host
// allocator event during a capture (an event recorded in a capture marks a
// point of the graph and is never queried; Note [Cross-stream capture] in
// runtime/src/graph.cc): nothing runs until a replay, and keeping the
// tensor alive is the program's part.
void copyHostToKiln(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  const c10::DeviceGuard guard(dst.device());
  const KilnStream stream = c10::kiln::getCurrentKilnStream(dst.device().index());
  const bool dst_dense = dst.is_non_overlapping_and_dense() && !hasBits(dst);
  // Note [Host copies in a capture]: only a copy the runtime records, from
  // the pinned source itself, is captured; the rest would be done once, now.
  const bool captured = C10_UNLIKELY(c10::kiln::anyCaptureUnderway()) &&
      c10::kiln::isStreamCapturing(stream);
  if (captured && !(non_blocking && dst_dense && byteCopyable(src, dst) && isPinned(src))) {
    c10::kiln::refuseWhileCapturing("aten::_copy_from (host to kiln)",
                                    c10::kiln::CaptureRefusal::HostCopy);
  }
  // A host tensor with exactly the bytes the device side needs.
  at::Tensor staged = src;
  if (!(dst_dense && byteCopyable(src, dst))) {
    staged = emptyLike(dst, dst.scalar_type(), c10::kCPU, dst_dense);
    staged.copy_(src);
  }
  const at::Tensor target = dst_dense ? dst : at::empty(dst.sizes(), dst.options());
  const size_t bytes = denseBytes(target);
  checkSpanInStorage(target, bytes);
  if (!non_blocking) {
    recordSyncOp("aten::_copy_from"); // may raise (sync debug mode): before the copy is queued
  }
  if (bytes == target.storage().nbytes()) {
    // Overwritten whole. Cleared before the copy is queued: if the copy is
    // skipped, its check below marks the target again, possibly at once.
    c10::kiln::clearFailedResult(target.storage().data());
  }
  KILN_CHECK(kilnMemcpyAsync(target.data_ptr(), staged.const_data_ptr(), bytes,
                             kilnMemcpyHostToDevice, stream.stream()));
  launchTaskBody(stream, "host copy check", std::make_unique<HostCopySkipMark>(target));
  if (!target.is_same(dst)) {
    launchDeviceCopy(dst, target, stream);
  }
  if (non_blocking) {
    if (isPinned(staged) && !captured) {
      protectPinned(staged, stream);
    }
    return;
  }
  synchronizeProtectingPinned(stream, staged); // a blocking copy has completed when it returns
}

// Runs right before an asynchronous device->host copy, on its stream. The
// program returned from the copy long ago and reads the host buffer after a
// stream or event synchronization, so a source that a failure on another
// stream (ordered before this one by an event) left without values must fail
// this stream: its synchronization then raises, and the copy queued behind
// this task is skipped, instead of the host buffer receiving bytes that were
// never computed. Note [Results of failed kernels]
struct HostCopySourceCheck final : TaskBody {
  explicit HostCopySourceCheck(const at::Tensor& source)
      : source_data(source.storage().data()), device(source.device()) {}
  void run() override {
    if (const auto reason = c10::kiln::failedResultReason(source_data)) {
      TORCH_CHECK(false, "The values of the ", device.str(),
                  " tensor copied to host memory with non_blocking=True were never computed: the "
                  "device kernel that should have written them failed (", *reason,
                  "); the copy was not made.");
    }
  }
  const void* source_data;
  c10::Device device;
};

// `sync_op` names the op counted as a sync op when the copy waits.
void copyKilnToHost(const at::Tensor& src, const at::Tensor& dst, bool non_blocking,
                    const char* sync_op) {
  const c10::DeviceGuard guard(src.device());
  const KilnStream stream = c10::kiln::getCurrentKilnStream(src.device().index());
  const bool dst_dense = dst.is_non_overlapping_and_dense() && !hasBits(dst);
  // Note [Host copies in a capture]: only an asynchronous copy into a dense
  // pinned destination is captured (any conversion runs on the device, into
  // `packed`, so it lands in `dst` itself).
  const bool captured = C10_UNLIKELY(c10::kiln::anyCaptureUnderway()) &&
      c10::kiln::isStreamCapturing(stream);
  if (captured && !(non_blocking && dst_dense && isPinned(dst))) {
    c10::kiln::refuseWhileCapturing(sync_op, non_blocking ? c10::kiln::CaptureRefusal::HostCopy
                                                          : c10::kiln::CaptureRefusal::HostRead);
  }
  // A device tensor with exactly the bytes the host side needs.
  at::Tensor packed = src;
  if (!(dst_dense && byteCopyable(src, dst))) {
    packed = emptyLike(dst, dst.scalar_type(), src.device(), dst_dense);
    launchDeviceCopy(packed, src, stream);
  }
  const at::Tensor landing =
      byteCopyable(packed, dst) ? dst : emptyLike(packed, packed.scalar_type(), c10::kCPU, true);
  const size_t bytes = denseBytes(packed);
  checkSpanInStorage(packed, bytes);
  const bool waits = !(non_blocking && landing.is_same(dst) && isPinned(dst));
  if (waits) {
    recordSyncOp(sync_op); // may raise: before `landing` is written asynchronously
  }
  if (!waits) {
    // Note [Results of failed kernels]
    c10::kiln::checkNotFailedResult(src.storage().data(), src.device().index());
    // The source may also be marked later, by a failure on another stream
    // this one waits for: checked again when the copy runs (see the task).
    launchTaskBody(stream, "aten::_copy_from (kiln to host)",
                   std::make_unique<HostCopySourceCheck>(packed));
  }
  KILN_CHECK(kilnMemcpyAsync(landing.data_ptr(), packed.const_data_ptr(), bytes,
                             kilnMemcpyDeviceToHost, stream.stream()));
  if (!waits) {
    if (!captured) {
      protectPinned(dst, stream);
    }
    return;
  }
  synchronizeProtectingPinned(stream, landing); // raises a pending kernel error first...
  // ...then refuses never-computed values
  c10::kiln::checkNotFailedResult(src.storage().data(), src.device().index());
  if (!landing.is_same(dst)) {
    dst.copy_(landing);
  }
}

// Runs right behind a peer copy on the source stream. If an earlier kernel
// there failed, the runtime skips the copy and this task too; then the
// destination never received the values, and is marked so (Note [Results of
// failed kernels]) instead of being read later as if it had.
//
// It also carries a mark the source received after the copy was launched (a
// failure on another stream of the source device that this stream waits for
// by an event): the copy then moved bytes that were never computed, and the
// destination must not be read as if they had been.
struct PeerCopySkipMark final : TaskBody {
  PeerCopySkipMark(const at::Tensor& target, const at::Tensor& src)
      : target_data(target.storage().data()), source_data(src.storage().data()),
        source(src.device()) {}
  void run() override {
    if (const auto reason = c10::kiln::failedResultReason(source_data)) {
      c10::kiln::markFailedResult(target_data, *reason); // the mark follows the data
    }
  }
  void skipped() override {
    c10::kiln::markFailedResult(
        target_data, "the copy from " + source.str() +
                         " was skipped because an earlier kernel on its stream failed");
  }
  const void* target_data;
  const void* source_data;
  c10::Device source;
};

void copyBetweenKilnDevices(const at::Tensor& src, const at::Tensor& dst) {
  if (const auto reason = c10::kiln::failedResultReason(src.storage().data())) {
    c10::kiln::markFailedResult(dst.storage().data(), *reason); // the mark follows the data
  }
  const KilnStream src_stream = c10::kiln::getCurrentKilnStream(src.device().index());
  const KilnStream dst_stream = c10::kiln::getCurrentKilnStream(dst.device().index());
  // Source bytes in the destination's dtype, contiguous, on the source device.
  at::Tensor packed = src;
  if (!(src.is_contiguous() && src.dtype() == dst.dtype() && !hasBits(src))) {
    const c10::DeviceGuard guard(src.device());
    packed = at::empty(dst.sizes(), dst.options().device(src.device()));
    launchDeviceCopy(packed, src, src_stream);
  }
  const bool dst_contiguous = dst.is_contiguous() && !hasBits(dst);
  at::Tensor target = dst;
  if (!dst_contiguous) {
    const c10::DeviceGuard guard(dst.device());
    target = at::empty(dst.sizes(), dst.options());
  }
  // As CUDA does for peer copies: the copy runs on the source stream after
  // the destination stream's earlier work, and the destination stream's later
  // work waits for the copy.
  KilnEvent dst_ready;
  dst_ready.record(dst_stream);
  dst_ready.block(src_stream);
  const size_t bytes = denseBytes(packed);
  checkSpanInStorage(packed, bytes);
  checkSpanInStorage(target, bytes);
  KILN_CHECK(kilnMemcpyPeerAsync(target.data_ptr(), dst.device().index(), packed.const_data_ptr(),
                                 src.device().index(), bytes, src_stream.stream()));
  launchTaskBody(src_stream, "peer copy check", std::make_unique<PeerCopySkipMark>(target, packed));
  KilnEvent copy_done;
  copy_done.record(src_stream);
  copy_done.block(dst_stream);
  if (!dst_contiguous) {
    const c10::DeviceGuard guard(dst.device());
    launchDeviceCopy(dst, target, dst_stream);
  }
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const at::Tensor& src = self;
  TORCH_CHECK(src.defined(), "copy_: the source tensor is undefined");
  TORCH_CHECK(dst.defined(), "copy_: the destination tensor is undefined");
  TORCH_CHECK(
      (src.device().is_cpu() || src.device().is_privateuseone()) &&
          (dst.device().is_cpu() || dst.device().is_privateuseone()),
      "Kiln copies between kiln and cpu tensors only; cannot copy from ", src.device(), " to ",
      dst.device(), ". Copy through the CPU first.");
  recordExecutedOp("aten::_copy_from");
  at::assert_no_internal_overlap(dst);
  if (dst.numel() == 0) {
    return dst;
  }
  const at::Tensor src_b = src.sizes().equals(dst.sizes()) ? src : src.expand(dst.sizes());
  if (src_b.is_alias_of(dst) && src_b.data_ptr() == dst.data_ptr() &&
      src_b.strides().equals(dst.strides()) && src_b.dtype() == dst.dtype() &&
      src_b.is_conj() == dst.is_conj() && src_b.is_neg() == dst.is_neg()) {
    return dst; // copying a tensor onto itself
  }
  at::assert_no_partial_overlap(dst, src_b);
  if (src_b.device().is_privateuseone() && src_b.scalar_type() != dst.scalar_type()) {
    checkConversion(src_b.scalar_type(), dst.scalar_type()); // converted on the device
  }

  if (src_b.device().is_cpu()) {
    copyHostToKiln(src_b, dst, non_blocking);
  } else if (dst.device().is_cpu()) {
    copyKilnToHost(src_b, dst, non_blocking, "aten::_copy_from");
  } else if (src_b.device() == dst.device()) {
    const c10::DeviceGuard guard(dst.device());
    launchDeviceCopy(dst, src_b, c10::kiln::getCurrentKilnStream(dst.device().index()));
  } else {
    copyBetweenKilnDevices(src_b, dst);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, /*non_blocking=*/false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(),
              " elements cannot be converted to Scalar");
  recordExecutedOp("aten::_local_scalar_dense");
  at::Tensor host = at::empty(self.sizes(), self.options().device(c10::kCPU));
  copyKilnToHost(self, host, /*non_blocking=*/false, "aten::_local_scalar_dense");
  return host.item();
}

} // namespace

// PyTorch resolves lazy conj/neg bits of an op's inputs by cloning them
// (the Conjugate/Negative fallbacks), and a clone of a kiln tensor is itself
// a _copy_from: without these fallthroughs copying a conj view would recurse
// forever. Kiln's copy handles the bits itself (ATen's CPU copy_ does).
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
}

} // namespace at::kiln

// FailedResults.h — which device memory holds no valid result because the
// kernel that should have written it failed or was skipped.
//
// Note [Results of failed kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Kernels run asynchronously, so when one fails (say an index out of range)
// the tensors it should have written have already been returned to the
// program, and the failure is raised at the next synchronization (Note
// [Sticky stream errors] in the runtime). After that the stream works again,
// and without more care a program could go on computing with, and reading,
// memory that was never written. Kiln therefore remembers the storages of
// failed and skipped kernels:
//   * a kernel that fails, or is skipped because an earlier one on its stream
//     failed, marks the storages it writes (KernelLaunch); so does a copy
//     from the host or another device that is skipped (Copy.cc);
//   * a kernel launched with a marked input marks what it writes, so the mark
//     follows the data (KernelLaunch::launch), and so does a kernel whose
//     input is marked by the time it runs (a failure on another stream,
//     ordered before it by an event); neither computes;
//   * reading a marked storage back to the host (item(), .cpu(), printing,
//     copies) raises a RuntimeError naming the original failure, and so does
//     an op that runs synchronously on a marked input (a data-dependent op
//     such as nonzero, unique or torch.equal, or a first call's layout check:
//     KilnOpExecutor's runSynchronously checks its inputs in stream order); an
//     asynchronous copy into pinned memory, whose source may be marked only
//     by the time it runs, fails its stream then (Copy.cc,
//     HostCopySourceCheck), so the synchronization the program waits on
//     raises; a copy to another kiln device passes such a mark on to its
//     destination (PeerCopySkipMark);
//   * a storage's mark ends when its memory is allocated anew, when it is
//     overwritten whole (fill_, zero_, copy_ from valid data), and when a
//     kernel that wrote all of it without reading it (its fresh outputs, an
//     out= argument covering the storage) has run successfully: in stream
//     order, so this also ends a mark that a kernel skipped after an earlier
//     failure left on memory the allocator had meanwhile handed to a new
//     tensor. In-place kernels (which read what they write) keep the mark.
//     A fused group (adaptive eager) applies these rules op by op (Note
//     [Failed-result marks in a fused run] in AdaptiveEager.cc).
// Marks are keyed by the storage's first byte. With no marks (the normal
// case) every check is one relaxed atomic load.
//
// Thread-safety: all functions are thread-safe (marks come from stream
// workers, checks from program threads).
#pragma once

#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace c10::kiln {

// Marks the storage starting at `data` as not holding valid results.
void markFailedResult(const void* data, const std::string& reason);
// The reason if the storage starting at `data` is marked, else nullopt.
std::optional<std::string> failedResultReason(const void* data);
// Ends the mark of the storage starting at `data`, if any.
void clearFailedResult(const void* data);
// True if any storage is marked (a fast pre-check).
bool anyFailedResults();

// Throws if the storage starting at `data` (on kiln device `device`) is
// marked: first the failure itself if it is still pending on one of the
// device's streams (device_synchronize raises it: the kernel may have run on
// another stream than the reader's, e.g. a collective on a communication
// stream), else a RuntimeError naming the failure (raised before, or
// pending on another device, whose kernel's result a peer copy brought).
void checkNotFailedResult(const void* data, c10::DeviceIndex device);
// What checkNotFailedResult throws for a mark with this reason.
[[noreturn]] void raiseFailedResult(const std::string& reason, c10::DeviceIndex device);

} // namespace c10::kiln

// WorkKCCL.h — the c10d::Work of one kccl collective (what `async_op=True`
// returns), with NCCL's semantics on kiln streams.
//
// A collective runs as a task on its process group's communication stream
// (ProcessGroupKCCL.h). Its Work holds:
//   * `done_event`, recorded on the communication stream right after the
//     task: wait() / synchronize() make the caller's *current* stream of the
//     collective's device wait for it, and return without blocking the host,
//     as ProcessGroupNCCL's WorkNCCL does;
//   * a shared WorkState the task sets when it has run (or failed, or was
//     skipped): isCompleted(), isSuccess() and exception() read it;
//   * a Future (get_future()) holding the output tensors, completed by the
//     process group's completion thread once the task ran, never on a stream
//     worker, so Python callbacks (`fut.then(...)`) never block device work.
// Blocking works (barrier) make wait() block the host until the task ran.
//
// Errors: wait() raises the collective's error (c10::DistBackendError) if the
// task has already failed when wait() is called; a failure after that
// surfaces at the next synchronization of the device and when the outputs
// are read (Note [Results of failed kernels]), and in get_future().
//
// Thread-safety: WorkState is thread-safe; a Work is used by one thread at a
// time (as c10d's Works are).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "core/KilnEvent.h"

namespace c10d::kiln {

// Set by the collective's task; read by the Work and the completion thread.
struct WorkState {
  void finish(std::exception_ptr error);
  bool completed() const;
  std::exception_ptr error() const;
  // Blocks until finish(); false on the timeout (kNoTimeout: no limit).
  bool waitFinished(std::chrono::milliseconds timeout) const;

  mutable std::mutex mutex;
  mutable std::condition_variable cv;
  bool done = false;
  std::exception_ptr exception;
};

class WorkKCCL : public c10d::Work {
 public:
  WorkKCCL(int rank, c10d::OpType type, const char* name, uint64_t seq, c10::Device device,
           std::vector<at::Tensor> outputs, bool blocking);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void blockCurrentStream() override { synchronize(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  uint64_t getSequencenumber() const override { return seq_; }

  const std::shared_ptr<WorkState>& state() const { return state_; }
  const c10::intrusive_ptr<c10::ivalue::Future>& future() const { return future_; }
  c10::kiln::KilnEvent& doneEvent() { return done_event_; }
  const std::vector<at::Tensor>& outputs() const { return outputs_; }

 private:
  const char* name_;
  uint64_t seq_;
  c10::Device device_;
  std::vector<at::Tensor> outputs_;
  bool blocking_;
  std::shared_ptr<WorkState> state_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  c10::kiln::KilnEvent done_event_;
};

} // namespace c10d::kiln

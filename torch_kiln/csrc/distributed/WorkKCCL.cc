#include "distributed/WorkKCCL.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include "core/KilnStream.h"

namespace c10d::kiln {

void WorkState::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
    exception = std::move(error);
  }
  cv.notify_all();
}

bool WorkState::completed() const {
  std::lock_guard<std::mutex> lock(mutex);
  return done;
}

std::exception_ptr WorkState::error() const {
  std::lock_guard<std::mutex> lock(mutex);
  return exception;
}

bool WorkState::waitFinished(std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mutex);
  if (timeout == kNoTimeout) {
    cv.wait(lock, [&] { return done; });
    return true;
  }
  return cv.wait_for(lock, timeout, [&] { return done; });
}

WorkKCCL::WorkKCCL(int rank, c10d::OpType type, const char* name, uint64_t seq, c10::Device device,
                   std::vector<at::Tensor> outputs, bool blocking)
    : Work(rank, type),
      name_(name),
      seq_(seq),
      device_(device),
      outputs_(std::move(outputs)),
      blocking_(blocking),
      state_(std::make_shared<WorkState>()),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

bool WorkKCCL::isCompleted() {
  return state_->completed();
}

bool WorkKCCL::isSuccess() const {
  return state_->completed() && state_->error() == nullptr;
}

std::exception_ptr WorkKCCL::exception() const {
  return state_->error();
}

std::vector<at::Tensor> WorkKCCL::result() {
  return outputs_;
}

void WorkKCCL::synchronize() {
  // Later work on the caller's current stream runs after the collective.
  c10::DeviceGuard guard(device_);
  done_event_.block(c10::kiln::getCurrentKilnStream(device_.index()));
}

bool WorkKCCL::wait(std::chrono::milliseconds timeout) {
  if (blocking_ || timeout != kNoTimeout) {
    if (!state_->waitFinished(timeout)) {
      TORCH_CHECK_WITH(DistBackendError, false, "kccl: ", name_, " (sequence number ", seq_,
                       ") did not complete within the ", timeout.count(),
                       " ms given to Work.wait()");
    }
  }
  if (auto error = state_->error()) {
    std::rethrow_exception(error);
  }
  synchronize();
  return true;
}

} // namespace c10d::kiln

// ShmSegment.h — one POSIX shared-memory segment (shm_open + mmap), owned by
// the kccl process group of one rank (ProcessGroupKCCL.h).
//
// A segment is created by one process under a unique name ("/kccl-..."),
// mapped by the others by name, and unlinked by its creator as soon as every
// rank has mapped it, so that nothing is left in /dev/shm even if a process
// is killed later (See Note [kccl shared-memory protocol] in ShmGroup.h).
// The mapping itself lives until the ShmSegment is destroyed.
//
// Errors: creation, opening and mapping throw c10::DistBackendError naming
// the segment and the system error (errno text).
//
// Thread-safety: none needed; a segment is set up once, then only its bytes
// are used (through atomics in ShmGroup).
#pragma once

#include <cstddef>
#include <string>

namespace c10d::kiln {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;

  // Creates (O_EXCL) and maps a zero-filled segment of `bytes` bytes.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Maps an existing segment; its size is read from the file (fstat).
  static ShmSegment open(const std::string& name);

  // Removes the name from /dev/shm (the mapping stays). Idempotent; only the
  // creator unlinks. Returns false if the name was already gone.
  bool unlink();

  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;    // created here: unlinks on destruction if still named
  bool unlinked_ = false;
};

} // namespace c10d::kiln

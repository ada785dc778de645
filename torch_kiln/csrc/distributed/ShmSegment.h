// ShmSegment.h — one POSIX shared-memory segment (shm_open + mmap), owned by
// the kccl process group of one rank (ProcessGroupKCCL.h).
//
// A segment is created by one process under a unique name ("/kccl-..."),
// mapped by the others by name, and unlinked by its creator as soon as every
// rank has mapped it, so that nothing is left in /dev/shm even if a process
// is killed later (See Note [kccl shared-memory protocol] in ShmGroup.h).
// The mapping itself lives until the ShmSegment is destroyed.
//
// Note [Abandoned kccl segments]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A creator killed before every rank mapped its segment (a peer that never
// joined, torchrun stopping the job) cannot unlink it. So the creator holds
// a shared flock on the segment until it unlinks the name; the kernel drops
// the lock when the process dies, however it dies. removeAbandoned(), called
// before every group creates its segments, unlinks the segments of the
// prefix that nobody locks and that are older than 10 s (the lock is taken
// microseconds after creation). flock works across PID namespaces, so a
// live creator in another container sharing /dev/shm keeps its segment.
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

  // Unlinks the segments in /dev/shm whose names start with `prefix` (no
  // leading '/', e.g. "kccl-") and whose creators are gone (Note [Abandoned
  // kccl segments]). Never throws; segments it cannot open are left.
  static void removeAbandoned(const std::string& prefix);

  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;    // created here: unlinks on destruction if still named
  bool unlinked_ = false;
  int lock_fd_ = -1;      // the creator's flock, held while the name exists
};

} // namespace c10d::kiln

#include "distributed/ShmSegment.h"

#include <cerrno>
#include <cstring>
#include <utility>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ctime>

#include <c10/util/Exception.h>

namespace c10d::kiln {
namespace {

[[noreturn]] void fail(const char* what, const std::string& name, int error) {
  TORCH_CHECK_WITH(DistBackendError, false, "kccl: ", what, " of shared-memory segment ", name,
                   " failed: ", std::strerror(error),
                   (error == ENOSPC || error == ENOMEM
                        ? " (is /dev/shm large enough? kccl needs KCCL_SHM_SLOT_BYTES plus 4 KiB per rank)"
                        : ""));
}

void* mapFd(int fd, size_t bytes, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    fail("mmap", name, error);
  }
  ::close(fd); // the mapping keeps the memory; the descriptor is not needed
  return data;
}

// Note [Abandoned kccl segments]: a segment whose creator holds no lock on
// it and that is older than this is abandoned (the creator takes its lock
// microseconds after creating it).
constexpr time_t kAbandonedAfterSeconds = 10;

} // namespace

void ShmSegment::removeAbandoned(const std::string& prefix) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) {
    return;
  }
  const time_t now = ::time(nullptr);
  while (const dirent* entry = ::readdir(dir)) {
    const std::string file = entry->d_name;
    if (file.rfind(prefix, 0) != 0) {
      continue;
    }
    const std::string name = "/" + file;
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      continue; // gone meanwhile, or another user's
    }
    struct stat info {};
    if (::fstat(fd, &info) == 0 && now - info.st_mtime >= kAbandonedAfterSeconds &&
        ::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      ::shm_unlink(name.c_str()); // no creator holds it: nobody else will
    }
    ::close(fd);
  }
  ::closedir(dir);
}

ShmSegment::~ShmSegment() {
  if (owner_ && !unlinked_ && !name_.empty()) {
    ::shm_unlink(name_.c_str());
  }
  if (lock_fd_ >= 0) {
    ::close(lock_fd_);
  }
  if (data_ != nullptr) {
    ::munmap(data_, size_);
  }
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  std::swap(name_, other.name_);
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  std::swap(owner_, other.owner_);
  std::swap(unlinked_, other.unlinked_);
  std::swap(lock_fd_, other.lock_fd_);
  return *this;
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    fail("shm_open (create)", name, errno);
  }
  // Held until the name is unlinked or this process ends (also when killed):
  // Note [Abandoned kccl segments].
  const int lock_fd = ::dup(fd);
  if (lock_fd < 0 || ::flock(lock_fd, LOCK_SH) != 0) {
    const int error = errno;
    if (lock_fd >= 0) {
      ::close(lock_fd);
    }
    ::close(fd);
    ::shm_unlink(name.c_str());
    fail("flock", name, error);
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    ::close(lock_fd);
    ::close(fd);
    ::shm_unlink(name.c_str());
    fail("ftruncate", name, error);
  }
  ShmSegment segment;
  segment.name_ = name;
  segment.owner_ = true;
  segment.lock_fd_ = lock_fd;
  try {
    segment.data_ = mapFd(fd, bytes, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    segment.unlinked_ = true;
    throw;
  }
  segment.size_ = bytes;
  return segment;
}

ShmSegment ShmSegment::open(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    fail("shm_open", name, errno);
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    fail("fstat", name, error);
  }
  ShmSegment segment;
  segment.name_ = name;
  segment.size_ = static_cast<size_t>(info.st_size);
  segment.data_ = mapFd(fd, segment.size_, name);
  return segment;
}

bool ShmSegment::unlink() {
  if (!owner_ || unlinked_) {
    return false;
  }
  unlinked_ = true;
  const bool removed = ::shm_unlink(name_.c_str()) == 0;
  if (lock_fd_ >= 0) {
    ::close(lock_fd_); // no name left for anyone to reclaim
    lock_fd_ = -1;
  }
  return removed;
}

} // namespace c10d::kiln

#include "distributed/ShmGroup.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KCCL_CPU_RELAX() _mm_pause()
#else
#define KCCL_CPU_RELAX() ((void)0)
#endif

namespace c10d::kiln {

namespace {
constexpr uint64_t kMagic = 0x6b63636c73686d31ULL; // "kcclshm1"
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kDefaultSlotBytes = size_t{4} << 20;
constexpr size_t kMinSlotBytes = size_t{4} << 10;
constexpr size_t kMaxSlotBytes = size_t{1} << 30;
} // namespace

// Lives at the start of each rank's segment; written only by its owner.
// std::atomic<uint64_t> is lock-free and address-free on the platforms kiln
// builds for, so it works between processes mapping the same memory.
struct ShmGroup::Header {
  uint64_t magic;
  int32_t rank;
  int32_t size;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint64_t> ready;
  alignas(64) std::atomic<uint64_t> done;
  alignas(64) std::atomic<uint64_t> entered_seq; // last collective entered
  std::atomic<int32_t> entered_kind;
  // The collective of step `ready` (valid between its ready and done).
  alignas(64) uint64_t seq;
  int32_t kind;
  int32_t dtype;
  int64_t numel;
  int32_t root;
  int32_t reduce_op;
  char name[32];
};
static_assert(sizeof(ShmGroup::Header) <= kHeaderBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

size_t slotBytesFromEnvironment() {
  const char* text = std::getenv("KCCL_SHM_SLOT_BYTES");
  if (text == nullptr || *text == '\0') {
    return kDefaultSlotBytes;
  }
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text, &end, 10);
  TORCH_CHECK_VALUE(errno == 0 && end != text && *end == '\0' && value >= kMinSlotBytes &&
                        value <= kMaxSlotBytes && value % 64 == 0,
                    "KCCL_SHM_SLOT_BYTES='", text, "' is invalid: expected a number of bytes from ",
                    kMinSlotBytes, " to ", kMaxSlotBytes, ", a multiple of 64 (default ",
                    kDefaultSlotBytes, ")");
  return static_cast<size_t>(value);
}

namespace {

std::string uniqueSegmentName(int rank) {
  std::random_device device;
  std::ostringstream name;
  name << "/kccl-" << ::getpid() << "-" << std::hex << device() << device() << std::dec << "-r" << rank;
  return name.str();
}

std::string messageOf(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

std::string dtypeName(int32_t dtype) {
  return dtype < 0 ? std::string("none") : std::string(c10::toString(static_cast<c10::ScalarType>(dtype)));
}

std::string toString(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

} // namespace

ShmGroup::ShmGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout, const std::string& tag, size_t slot_bytes)
    : rank_(rank), size_(size), slot_bytes_(slot_bytes), timeout_(timeout) {
  segments_.resize(size);
  const size_t bytes = kHeaderBytes + slot_bytes;
  segments_[rank] = ShmSegment::create(uniqueSegmentName(rank), bytes);
  auto* own = new (segments_[rank].data()) Header{};
  own->magic = kMagic;
  own->rank = rank;
  own->size = size;
  own->slot_bytes = slot_bytes;

  // The Store waits use the group's timeout, then restore the store's own.
  const auto store_timeout = store->getTimeout();
  store->setTimeout(timeout);
  try {
    store->set(tag + "/seg/" + std::to_string(rank), segments_[rank].name());
    for (int r = 0; r < size; ++r) {
      if (r == rank) {
        continue;
      }
      const std::string name = toString(store->get(tag + "/seg/" + std::to_string(r)));
      segments_[r] = ShmSegment::open(name);
      const Header* peer = header(r);
      TORCH_CHECK_WITH(DistBackendError,
                       segments_[r].size() == bytes && peer->magic == kMagic && peer->rank == r &&
                           peer->size == size && peer->slot_bytes == slot_bytes,
                       "kccl: rank ", r, "'s shared-memory segment ", name,
                       " does not match rank ", rank, "'s (size ", segments_[r].size(), " vs ", bytes,
                       " bytes; is KCCL_SHM_SLOT_BYTES the same on every rank?)");
    }
    store->set(tag + "/mapped/" + std::to_string(rank), "1");
    std::vector<std::string> mapped;
    for (int r = 0; r < size; ++r) {
      mapped.push_back(tag + "/mapped/" + std::to_string(r));
    }
    store->wait(mapped, timeout);
  } catch (...) {
    store->setTimeout(store_timeout);
    segments_[rank].unlink();
    throw;
  }
  store->setTimeout(store_timeout);
  segments_[rank].unlink();
}

ShmGroup::~ShmGroup() = default;

ShmGroup::Header* ShmGroup::header(int r) const {
  return static_cast<Header*>(segments_[r].data());
}

char* ShmGroup::slot(int r) const {
  return static_cast<char*>(segments_[r].data()) + kHeaderBytes;
}

bool ShmGroup::broken() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return !first_error_.empty();
}

std::string ShmGroup::firstError() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return first_error_;
}

void ShmGroup::checkNotBroken() const {
  const std::string error = firstError();
  TORCH_CHECK_WITH(DistBackendError, error.empty(),
                   "kccl: this process group is unusable after an earlier failure (as an aborted NCCL "
                   "communicator); destroy it and create a new one. The first failure was: ",
                   error);
}

void ShmGroup::breakWith(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (first_error_.empty()) {
      first_error_ = message;
    }
  }
  TORCH_CHECK_WITH(DistBackendError, false, message);
}

void ShmGroup::enter(const CollectiveDescription& what) {
  Header* own = header(rank_);
  own->entered_kind.store(what.kind, std::memory_order_relaxed);
  own->entered_seq.store(what.seq, std::memory_order_release);
}

void ShmGroup::waitAll(bool ready_counter, uint64_t target, const CollectiveDescription& what,
                       Clock::time_point deadline, const char* stage) {
  auto value = [&](int r) {
    const Header* h = header(r);
    return (ready_counter ? h->ready : h->done).load(std::memory_order_acquire);
  };
  auto arrived = [&] {
    for (int r = 0; r < size_; ++r) {
      if (value(r) < target) {
        return false;
      }
    }
    return true;
  };
  // Spin (the peers are usually there within microseconds), then yield, then
  // sleep with growing pauses so that waiting ranks leave the cores to the
  // ranks that still compute (2 ranks on 2 cores is a normal set-up).
  for (int i = 0; i < 2000; ++i) {
    if (arrived()) {
      return;
    }
    KCCL_CPU_RELAX();
  }
  auto pause = std::chrono::microseconds(0);
  const auto started = Clock::now();
  while (!arrived()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::ostringstream missing;
      bool first = true;
      for (int r = 0; r < size_; ++r) {
        if (value(r) < target) {
          missing << (first ? "" : ", ") << r;
          first = false;
        }
      }
      std::ostringstream last;
      first = true;
      for (int r = 0; r < size_; ++r) {
        if (value(r) < target) {
          const uint64_t seq = header(r)->entered_seq.load(std::memory_order_acquire);
          last << (first ? "" : "; ") << "rank " << r << ": "
               << (seq == 0 ? std::string("none") : "#" + std::to_string(seq));
          first = false;
        }
      }
      std::ostringstream message;
      message << "kccl: " << what.name << " (sequence number " << what.seq;
      if (!what.shape.empty()) {
        message << ", " << what.shape;
      }
      message << ") timed out on rank " << rank_ << " after " << timeout_.count()
              << " ms (the process group's timeout): ranks [" << missing.str()
              << "] did not arrive (" << stage << "; last collective they entered: " << last.str()
              << "). A rank may have crashed, be stuck, or be running a different collective.";
      breakWith(message.str());
    }
    if (now - started < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      pause = std::min(std::chrono::microseconds(1000), pause + std::chrono::microseconds(20));
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    }
  }
}

void ShmGroup::checkSame(const CollectiveDescription& what) const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      continue;
    }
    const Header* peer = header(r);
    if (peer->seq != what.seq || peer->kind != what.kind || peer->dtype != what.dtype ||
        peer->numel != what.numel || peer->root != what.root || peer->reduce_op != what.reduce_op) {
      std::ostringstream message;
      message << "kccl: mismatched collectives: rank " << rank_ << " runs " << what.name
              << " #" << what.seq << " (" << (what.shape.empty() ? "no tensor" : what.shape)
              << ", " << what.numel << " elements, dtype " << dtypeName(what.dtype) << ", root "
              << what.root << ", op " << what.reduce_op << ") but rank " << r << " runs "
              << std::string(peer->name, strnlen(peer->name, sizeof(peer->name))) << " #"
              << peer->seq << " (" << peer->numel << " elements, dtype " << dtypeName(peer->dtype)
              << ", root " << peer->root << ", op " << peer->reduce_op
              << "). Every rank must call the same collectives in the same order with the same "
                 "sizes, dtypes and roots.";
      const_cast<ShmGroup*>(this)->breakWith(message.str());
    }
  }
}

void ShmGroup::step(const CollectiveDescription& what, Clock::time_point deadline,
                    const std::function<void()>& fill, const std::function<void()>& consume) {
  checkNotBroken();
  const uint64_t s = ++step_;
  Header* own = header(rank_);
  waitAll(/*ready_counter=*/false, s - 1, what, deadline, "the previous step's readers");
  try {
    if (fill) {
      fill();
    }
  } catch (const std::exception& e) {
    breakWith(std::string("kccl: ") + what.name + " failed while writing its data: " + messageOf(e));
  }
  own->seq = what.seq;
  own->kind = what.kind;
  own->dtype = what.dtype;
  own->numel = what.numel;
  own->root = what.root;
  own->reduce_op = what.reduce_op;
  std::strncpy(own->name, what.name, sizeof(own->name) - 1);
  own->ready.store(s, std::memory_order_release);
  waitAll(/*ready_counter=*/true, s, what, deadline, "waiting for their data");
  checkSame(what);
  try {
    if (consume) {
      consume();
    }
  } catch (const std::exception& e) {
    breakWith(std::string("kccl: ") + what.name + " failed while reducing: " + messageOf(e));
  }
  own->done.store(s, std::memory_order_release);
}

} // namespace c10d::kiln

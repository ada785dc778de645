#include "distributed/ShmGroup.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include <climits>
#include <ctime>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KCCL_CPU_RELAX() _mm_pause()
#else
#define KCCL_CPU_RELAX() ((void)0)
#endif

namespace c10d::kiln {

namespace {
constexpr int kMaxP2PRanks = 128;
constexpr uint64_t kMagic = 0x6b63636c73686d31ULL; // "kcclshm1"
constexpr size_t kHeaderBytes = 8192;
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
  // Set by this rank when it timed out in a step (Note [kccl broken groups]).
  std::atomic<int32_t> broken;
  // The collective of step `ready` (valid between its ready and done).
  alignas(64) uint64_t seq;
  int32_t kind;
  int32_t dtype;
  int64_t numel;
  int32_t root;
  int32_t reduce_op;
  char name[32];
  // Point-to-point (Note [kccl point-to-point]), indexed by the peer rank:
  // chunks this rank has posted to the peer, chunks it has taken from the
  // peer, and what the message being posted to the peer holds.
  alignas(64) std::atomic<uint64_t> p2p_posted[kMaxP2PRanks];
  alignas(64) std::atomic<uint64_t> p2p_taken[kMaxP2PRanks];
  int64_t p2p_numel[kMaxP2PRanks];
  int32_t p2p_dtype[kMaxP2PRanks];
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
  // header, the collectives' slot, then the point-to-point slots
  const size_t bytes = kHeaderBytes + 2 * slot_bytes;
  ShmSegment::removeAbandoned("kccl-"); // Note [Abandoned kccl segments]
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
    // The slot size goes first, under its own key, so that every rank can
    // compare it before opening a peer's segment: a rank that found a
    // mismatch unlinks its own segment at once, and its peers would
    // otherwise fail to open it with a bare "No such file or directory".
    store->set(tag + "/slot/" + std::to_string(rank), std::to_string(slot_bytes));
    store->set(tag + "/seg/" + std::to_string(rank), segments_[rank].name());
    for (int r = 0; r < size; ++r) {
      if (r == rank) {
        continue;
      }
      const std::string peer_slot = toString(store->get(tag + "/slot/" + std::to_string(r)));
      TORCH_CHECK_WITH(DistBackendError, peer_slot == std::to_string(slot_bytes),
                       "kccl: rank ", r, " uses shared-memory slots of ", peer_slot,
                       " bytes and rank ", rank, " of ", slot_bytes,
                       " bytes: set KCCL_SHM_SLOT_BYTES to the same value on every rank");
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

size_t ShmGroup::p2pSlotBytes() const noexcept {
  return (slot_bytes_ / static_cast<size_t>(size_)) / 64 * 64;
}

char* ShmGroup::p2pSlot(int owner, int peer) const {
  return static_cast<char*>(segments_[owner].data()) + kHeaderBytes + slot_bytes_ +
         static_cast<size_t>(peer) * p2pSlotBytes();
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

// Note [kccl broken groups]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Mismatches and bad data are found by every rank from the same shared data,
// so every rank fails the same collective. A timeout is one rank's verdict:
// the rank that waited gives up, while a late peer reaching the step would
// find the data the waiting rank had already published, complete it and carry
// on (a late rank's all_reduce returned a result after its peer timed out).
// So a rank that times out in a collective's step also says so in its own
// header, and a step checks the peers' flags once the counters it waited for
// arrived (for the data, after checking that every rank runs the same
// collective) and fails, breaking its own group too, naming the rank that gave
// up. A timeout that comes after a peer passed that check is not seen by it:
// as with NCCL, a timeout on one rank can race with a late success on another.
void ShmGroup::breakWith(const std::string& message, bool tell_peers) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (first_error_.empty()) {
      first_error_ = message;
    }
  }
  if (tell_peers && segments_.size() == static_cast<size_t>(size_) &&
      segments_[rank_].data() != nullptr) {
    header(rank_)->broken.store(1, std::memory_order_release);
  }
  TORCH_CHECK_WITH(DistBackendError, false, message);
}

void ShmGroup::checkPeersNotBroken(const CollectiveDescription& what) {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && header(r)->broken.load(std::memory_order_acquire) != 0) {
      breakWith("kccl: " + std::string(what.name) + " (sequence number " +
                std::to_string(what.seq) + ") on rank " + std::to_string(groupRank(rank_)) +
                ": rank " + std::to_string(groupRank(r)) +
                " gave up on this process group after timing out in an earlier step (see that "
                "rank's error); the ranks no longer agree, so the group is unusable (as an "
                "aborted NCCL communicator). Destroy it and create a new one.");
    }
  }
}

void ShmGroup::enter(const CollectiveDescription& what) {
  Header* own = header(rank_);
  own->entered_kind.store(what.kind, std::memory_order_relaxed);
  own->entered_seq.store(what.seq, std::memory_order_release);
}

bool ShmGroup::spinUntil(const std::function<bool()>& arrived, Clock::time_point deadline) {
  // Spin (the peers are usually there within microseconds), then yield, then
  // sleep with growing pauses so that waiting ranks leave the cores to the
  // ranks that still compute (2 ranks on 2 cores is a normal set-up).
  for (int i = 0; i < 2000; ++i) {
    if (arrived()) {
      return true;
    }
    KCCL_CPU_RELAX();
  }
  auto pause = std::chrono::microseconds(0);
  const auto started = Clock::now();
  while (!arrived()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      return false;
    }
    if (now - started < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      pause = std::min(std::chrono::microseconds(1000), pause + std::chrono::microseconds(20));
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    }
  }
  return true;
}

std::string ShmGroup::timeoutMessage(const CollectiveDescription& what, const std::vector<int>& missing,
                                     const char* stage) const {
  std::ostringstream ranks;
  std::ostringstream last;
  for (size_t k = 0; k < missing.size(); ++k) {
    const int r = missing[k];
    const uint64_t seq = header(r)->entered_seq.load(std::memory_order_acquire);
    ranks << (k == 0 ? "" : ", ") << groupRank(r);
    last << (k == 0 ? "" : "; ") << "rank " << groupRank(r) << ": "
         << (seq == 0 ? std::string("none") : "#" + std::to_string(seq));
  }
  std::ostringstream message;
  message << "kccl: " << what.name << " (sequence number " << what.seq;
  if (!what.shape.empty()) {
    message << ", " << what.shape;
  }
  message << ") timed out on rank " << groupRank(rank_) << " after "
          << (what.timeout_ms > 0 ? what.timeout_ms : static_cast<int64_t>(timeout_.count()))
          << " ms (the process group's timeout): ranks [" << ranks.str() << "] did not arrive ("
          << stage << "; last operation they entered: " << last.str()
          << "). A rank may have crashed, be stuck, or be running a different collective.";
  return message.str();
}

namespace {

// Note [kccl futex waits]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A rank waiting for a step's counters spins and yields briefly, then sleeps in the
// kernel on the low 32-bit word of the first counter that has not arrived
// (a shared, not private, futex: the word lives in memory every rank maps),
// for at most 2 ms at a time so that the deadline and the other counters are
// rechecked. Every store to a counter is followed by a FUTEX_WAKE of its word.
// A missed wake-up (the store lands between the check and the sleep) cannot
// hang: FUTEX_WAIT returns at once when the word no longer holds the value
// the waiter saw, and otherwise within 2 ms.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kccl's futex words assume little-endian");

uint32_t* lowWord(const std::atomic<uint64_t>& counter) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(&counter));
}

void futexWait(const std::atomic<uint64_t>& counter, uint64_t seen, std::chrono::nanoseconds limit) {
  const auto ns = std::max<int64_t>(1000, std::min<int64_t>(limit.count(), 2'000'000));
  struct timespec timeout {0, static_cast<long>(ns)};
  ::syscall(SYS_futex, lowWord(counter), FUTEX_WAIT, static_cast<uint32_t>(seen), &timeout, nullptr, 0);
}

void futexWake(const std::atomic<uint64_t>& counter) {
  ::syscall(SYS_futex, lowWord(counter), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

} // namespace

void ShmGroup::waitAll(bool ready_counter, uint64_t target, const CollectiveDescription& what,
                       Clock::time_point deadline, const char* stage) {
  auto counter = [&](int r) -> const std::atomic<uint64_t>& {
    const Header* h = header(r);
    return ready_counter ? h->ready : h->done;
  };
  auto firstMissing = [&]() {
    for (int r = 0; r < size_; ++r) {
      if (counter(r).load(std::memory_order_acquire) < target) {
        return r;
      }
    }
    return -1;
  };
  for (int i = 0; i < 2000; ++i) {
    if (firstMissing() < 0) {
      if (!ready_counter) {
        checkPeersNotBroken(what);
      }
      return;
    }
    KCCL_CPU_RELAX();
  }
  // Then yield for a while: a peer that is about to arrive usually only
  // needs the core (2 ranks on 2 cores is a normal set-up).
  const auto yield_until = Clock::now() + std::chrono::microseconds(200);
  while (Clock::now() < yield_until) {
    if (firstMissing() < 0) {
      if (!ready_counter) {
        checkPeersNotBroken(what);
      }
      return;
    }
    std::this_thread::yield();
  }
  // Note [kccl futex waits]
  for (int r = firstMissing(); r >= 0; r = firstMissing()) {
    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int> missing;
      for (int k = 0; k < size_; ++k) {
        if (counter(k).load(std::memory_order_acquire) < target) {
          missing.push_back(k);
        }
      }
      breakWith(timeoutMessage(what, missing, stage), /*tell_peers=*/true);
    }
    const uint64_t seen = counter(r).load(std::memory_order_acquire);
    if (seen < target) {
      futexWait(counter(r), seen, deadline - now);
    }
  }
  if (!ready_counter) {
    checkPeersNotBroken(what);
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
      message << "kccl: mismatched collectives: rank " << groupRank(rank_) << " runs " << what.name
              << " #" << what.seq << " (" << (what.shape.empty() ? "no tensor" : what.shape)
              << ", " << what.numel << " elements, dtype " << dtypeName(what.dtype) << ", root "
              << what.root << ", op " << what.reduce_op << ") but rank " << groupRank(r) << " runs "
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
  futexWake(own->ready);
  waitAll(/*ready_counter=*/true, s, what, deadline, "waiting for their data");
  checkSame(what); // a mismatch is reported as such, before a peer's break
  checkPeersNotBroken(what);
  try {
    if (consume) {
      consume();
    }
  } catch (const std::exception& e) {
    breakWith(std::string("kccl: ") + what.name + " failed while reading the ranks' data: " + messageOf(e));
  }
  own->done.store(s, std::memory_order_release);
  futexWake(own->done);
}

} // namespace c10d::kiln

namespace c10d::kiln {

void ShmGroup::checkPeer(int peer, const char* op) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_ && peer != rank_, "kccl: ", op, ": invalid peer rank ",
                    peer, " on rank ", rank_, " (the group has ranks 0 to ", size_ - 1,
                    "; a rank cannot send to or receive from itself)");
  TORCH_CHECK_VALUE(size_ <= kMaxP2PRanks, "kccl: ", op, " needs a group of at most ", kMaxP2PRanks,
                    " ranks, this one has ", size_);
}

void ShmGroup::exchange(const CollectiveDescription& what, std::vector<P2PTransfer>& transfers,
                        Clock::time_point deadline) {
  checkNotBroken();
  const int64_t slot = static_cast<int64_t>(p2pSlotBytes());
  for (const auto& t : transfers) {
    checkPeer(t.peer, t.send ? "send" : "recv");
    TORCH_CHECK(slot / t.element_size > 0, "kccl: the point-to-point slot is too small for one element");
  }
  Header* own = header(rank_);
  std::vector<int64_t> offset(transfers.size(), 0);
  std::vector<bool> done(transfers.size(), false);
  size_t remaining = transfers.size();
  // Only the first unfinished transfer of each (peer, direction) may move:
  // messages of a pair arrive in issue order.
  auto active = [&](size_t k) {
    for (size_t j = 0; j < k; ++j) {
      if (!done[j] && transfers[j].peer == transfers[k].peer && transfers[j].send == transfers[k].send) {
        return false;
      }
    }
    return true;
  };
  auto progress = [&](size_t k) {
    P2PTransfer& t = transfers[k];
    const Header* peer = header(t.peer);
    const int64_t per_chunk = slot / t.element_size;
    const int64_t n = std::min(per_chunk, t.numel - offset[k]);
    if (t.send) {
      const uint64_t chunk = own->p2p_posted[t.peer].load(std::memory_order_relaxed) + 1;
      if (peer->p2p_taken[rank_].load(std::memory_order_acquire) < chunk - 1) {
        return false; // the peer still reads the previous chunk
      }
      std::memcpy(p2pSlot(rank_, t.peer), t.data + offset[k] * t.element_size, n * t.element_size);
      own->p2p_numel[t.peer] = t.numel;
      own->p2p_dtype[t.peer] = t.dtype;
      own->p2p_posted[t.peer].store(chunk, std::memory_order_release);
    } else {
      const uint64_t chunk = own->p2p_taken[t.peer].load(std::memory_order_relaxed) + 1;
      if (peer->p2p_posted[rank_].load(std::memory_order_acquire) < chunk) {
        return false; // nothing posted yet
      }
      if (peer->p2p_numel[rank_] != t.numel || peer->p2p_dtype[rank_] != t.dtype) {
        breakWith("kccl: mismatched send/recv: rank " + std::to_string(t.peer) + " sends " +
                  std::to_string(peer->p2p_numel[rank_]) + " elements of dtype " +
                  dtypeName(peer->p2p_dtype[rank_]) + " but rank " + std::to_string(rank_) +
                  " receives " + t.shape + " (" + std::to_string(t.numel) +
                  " elements); a recv must match its send's number of elements and dtype.");
      }
      std::memcpy(t.data + offset[k] * t.element_size, p2pSlot(t.peer, rank_), n * t.element_size);
      own->p2p_taken[t.peer].store(chunk, std::memory_order_release);
    }
    offset[k] += n;
    if (offset[k] >= t.numel) {
      done[k] = true;
      --remaining;
    }
    return true;
  };
  auto step = [&] {
    bool moved = false;
    for (size_t k = 0; k < transfers.size(); ++k) {
      if (!done[k] && active(k) && progress(k)) {
        moved = true;
      }
    }
    return moved;
  };
  while (remaining > 0) {
    if (step()) {
      continue;
    }
    if (!spinUntil([&] { return step() || remaining == 0; }, deadline)) {
      std::vector<int> missing;
      std::ostringstream stage;
      for (size_t k = 0; k < transfers.size(); ++k) {
        if (!done[k]) {
          const auto& t = transfers[k];
          if (std::find(missing.begin(), missing.end(), t.peer) == missing.end()) {
            missing.push_back(t.peer);
          }
          stage << (stage.tellp() > 0 ? ", " : "") << (t.send ? "send to rank " : "recv from rank ")
                << t.peer << " " << t.shape << ": " << offset[k] << " of " << t.numel
                << " elements moved" << (t.send ? "" : ", no matching send");
        }
      }
      breakWith(timeoutMessage(what, missing, stage.str().c_str()));
    }
  }
}

} // namespace c10d::kiln

#include "distributed/CrossHost.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "distributed/Reductions.h"
#include "distributed/ShmCollectives.h"

namespace c10d::kiln {
namespace {

char* bytes(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

// The bytes of a contiguous host tensor, as a uint8 CPU tensor (what kccl
// hands to Gloo: any dtype, no conversion).
at::Tensor asBytes(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.numel() * t.element_size())},
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

at::Tensor byteBuffer(int64_t n) {
  return at::empty({n}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

// What is compared across hosts (CollectiveDescription without the texts).
constexpr int kDescriptionWords = 6;

void describeInto(const CollectiveDescription& what, int64_t* words) {
  words[0] = static_cast<int64_t>(what.seq);
  words[1] = what.kind;
  words[2] = what.dtype;
  words[3] = what.numel;
  words[4] = what.root;
  words[5] = what.reduce_op;
}

std::string describeWords(const int64_t* w) {
  std::ostringstream text;
  text << c10d::opTypeToString(static_cast<c10d::OpType>(w[1])) << " #" << w[0] << " (" << w[3]
       << " elements, dtype "
       << (w[2] >= 0 ? c10::toString(static_cast<c10::ScalarType>(w[2])) : "none") << ", root "
       << w[4] << ", op " << w[5] << ")";
  return text.str();
}

} // namespace

HostLayout::HostLayout(std::vector<std::vector<int>> hosts_, int rank_, int size)
    : hosts(std::move(hosts_)), host_of(size, -1), local_of(size, -1), rank(rank_) {
  TORCH_CHECK_VALUE(!hosts.empty(), "kccl: the host layout lists no host");
  int previous_first = -1;
  for (size_t h = 0; h < hosts.size(); ++h) {
    TORCH_CHECK_VALUE(!hosts[h].empty() && hosts[h].front() > previous_first,
                      "kccl: host ", h, " of the layout is empty or out of order");
    previous_first = hosts[h].front();
    for (size_t l = 0; l < hosts[h].size(); ++l) {
      const int r = hosts[h][l];
      TORCH_CHECK_VALUE(r >= 0 && r < size && host_of[r] < 0 && (l == 0 || r > hosts[h][l - 1]),
                        "kccl: the host layout lists rank ", r, " badly (group of ", size, " ranks)");
      host_of[r] = static_cast<int>(h);
      local_of[r] = static_cast<int>(l);
    }
    max_local = std::max(max_local, static_cast<int>(hosts[h].size()));
  }
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK_VALUE(host_of[r] >= 0, "kccl: the host layout misses rank ", r);
  }
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, "kccl: invalid rank ", rank);
}

CrossHost::CrossHost(HostLayout layout, c10::intrusive_ptr<c10d::Backend> leaders,
                     c10::intrusive_ptr<c10d::Backend> all)
    : layout_(std::move(layout)), leaders_(std::move(leaders)), all_(std::move(all)) {
  TORCH_CHECK_VALUE(all_, "kccl: a group across hosts needs a Gloo group among all ranks");
  TORCH_CHECK_VALUE(!layout_.leader() || leaders_,
                    "kccl: a host's leader needs the Gloo group among the leaders");
}

void CrossHost::wait(ShmGroup& local, const c10::intrusive_ptr<c10d::Work>& work,
                     const CollectiveDescription& what, Clock::time_point deadline, const char* part) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  std::string reason;
  try {
    if (work->wait(std::max(left, std::chrono::milliseconds(1)))) {
      return;
    }
    reason = "did not complete";
  } catch (const c10::Error& e) {
    reason = e.what_without_backtrace();
  } catch (const std::exception& e) {
    reason = e.what();
  }
  // Gloo may still run it (our deadline came first): the Work keeps the
  // tensors it holds alive for as long as the group lives.
  abandoned_.push_back(work);
  std::ostringstream message;
  message << "kccl: " << what.name << " (sequence number " << what.seq;
  if (!what.shape.empty()) {
    message << ", " << what.shape;
  }
  message << ") failed on rank " << layout_.rank << " between hosts (Gloo " << part
          << ", within the process group's timeout of " << what.timeout_ms << " ms): " << reason;
  local.fail(message.str());
}

void CrossHost::agreeAcrossHosts(ShmGroup& local, const CollectiveDescription& what,
                                 Clock::time_point deadline) {
  reapSends(local, what);
  // The leader's verdict, broadcast to its host: empty = agreed.
  constexpr int64_t kVerdictBytes = 1024;
  at::Tensor verdict = at::zeros({kVerdictBytes}, at::TensorOptions().dtype(at::kByte));
  if (layout_.leader()) {
    const int hosts = static_cast<int>(layout_.hosts.size());
    at::Tensor mine = at::empty({kDescriptionWords}, at::TensorOptions().dtype(at::kLong));
    describeInto(what, mine.data_ptr<int64_t>());
    at::Tensor every = at::empty({hosts * kDescriptionWords}, mine.options());
    wait(local, leaders_->_allgather_base(every, mine), what, deadline, "all_gather of descriptions");
    const int64_t* words = every.data_ptr<int64_t>();
    for (int h = 0; h < hosts; ++h) {
      if (!std::equal(words + h * kDescriptionWords, words + (h + 1) * kDescriptionWords,
                      mine.data_ptr<int64_t>())) {
        std::ostringstream message;
        message << "kccl: mismatched collectives across hosts: rank " << layout_.rank << " runs "
                << what.name << " " << describeWords(mine.data_ptr<int64_t>()) << " but rank "
                << layout_.hosts[h].front() << " (leader of host " << h << ") runs "
                << describeWords(words + h * kDescriptionWords)
                << ". Every rank must call the same collectives in the same order with the same "
                   "sizes, dtypes and roots.";
        const std::string text = message.str().substr(0, kVerdictBytes - 1);
        std::memcpy(bytes(verdict), text.data(), text.size());
        break;
      }
    }
  }
  shmBroadcast(local, what, deadline, bytes(verdict), kVerdictBytes, 0);
  if (verdict.data_ptr<uint8_t>()[0] != 0) {
    local.fail(std::string(reinterpret_cast<const char*>(verdict.data_ptr<uint8_t>())));
  }
}

void CrossHost::agreeAmongAll(ShmGroup& local, const CollectiveDescription& what,
                              Clock::time_point deadline) {
  reapSends(local, what);
  at::Tensor mine = at::empty({kDescriptionWords}, at::TensorOptions().dtype(at::kLong));
  describeInto(what, mine.data_ptr<int64_t>());
  at::Tensor every = at::empty({layout_.size() * kDescriptionWords}, mine.options());
  wait(local, all_->_allgather_base(every, mine), what, deadline, "all_gather of descriptions");
  const int64_t* words = every.data_ptr<int64_t>();
  for (int r = 0; r < layout_.size(); ++r) {
    if (!std::equal(words + r * kDescriptionWords, words + (r + 1) * kDescriptionWords,
                    mine.data_ptr<int64_t>())) {
      local.fail("kccl: mismatched collectives: rank " + std::to_string(layout_.rank) + " runs " +
                 what.name + " " + describeWords(mine.data_ptr<int64_t>()) + " but rank " +
                 std::to_string(r) + " runs " + describeWords(words + r * kDescriptionWords) +
                 ". Every rank must call the same collectives in the same order with the same "
                 "sizes, dtypes and roots.");
    }
  }
}

void CrossHost::gatherAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                          const char* src, int64_t nbytes, char* dst) {
  const int world = layout_.size();
  const int64_t block_ranks = layout_.max_local;
  const int64_t hosts = static_cast<int64_t>(layout_.hosts.size());
  forEachChunk(nbytes, static_cast<int64_t>(local.slotBytes()), [&](int64_t o, int64_t c) {
    at::Tensor block;
    std::vector<char*> pieces;
    if (layout_.leader()) {
      block = byteBuffer(block_ranks * c);
      for (int l = 0; l < local.size(); ++l) {
        pieces.push_back(bytes(block) + l * c);
      }
    }
    shmGather(local, what, deadline, src + o, c, pieces, 0);
    if (layout_.leader()) {
      at::Tensor every = byteBuffer(hosts * block_ranks * c);
      wait(local, leaders_->_allgather_base(every, block), what, deadline, "all_gather between hosts");
      for (int r = 0; r < world; ++r) {
        const int64_t at_block = layout_.host_of[r] * block_ranks + layout_.local_of[r];
        std::memcpy(dst + r * nbytes + o, bytes(every) + at_block * c, c);
      }
    }
  });
}

void CrossHost::reduceAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                          const at::Tensor& in, at::Tensor& out, const c10d::ReduceOp& op) {
  const int world = layout_.size();
  const int64_t es = static_cast<int64_t>(in.element_size());
  const int64_t per_step = static_cast<int64_t>(local.slotBytes()) / es;
  forEachChunk(in.numel(), per_step, [&](int64_t o, int64_t n) {
    at::Tensor everyone;
    if (layout_.leader()) {
      everyone = at::empty({world * n}, in.options());
    }
    gatherAll(local, what, deadline, bytes(in) + o * es, n * es,
              layout_.leader() ? bytes(everyone) : nullptr);
    at::Tensor chunk = out.narrow(0, o, n);
    if (layout_.leader()) {
      std::vector<at::Tensor> parts;
      for (int r = 0; r < world; ++r) {
        parts.push_back(everyone.narrow(0, r * n, n));
      }
      reduceInto(chunk, parts, op, world);
    }
    shmBroadcast(local, what, deadline, bytes(chunk), n * es, 0);
  });
}

void CrossHost::allReduce(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                          Tensors& in, Tensors& out, const c10d::ReduceOp& op) {
  agreeAcrossHosts(local, what, deadline);
  reduceAll(local, what, deadline, in[0], out[0], op);
}

void CrossHost::reduce(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                       Tensors& in, Tensors& out, const c10d::ReduceOp& op, int root) {
  agreeAcrossHosts(local, what, deadline);
  at::Tensor result = at::empty_like(in[0]);
  reduceAll(local, what, deadline, in[0], result, op);
  // Non-roots keep their input (as the one-host path).
  out[0].copy_(layout_.rank == root ? result : in[0]);
}

void CrossHost::reduceScatter(ShmGroup& local, const CollectiveDescription& what,
                              Clock::time_point deadline, Tensors& in, Tensors& out,
                              const c10d::ReduceOp& op) {
  agreeAcrossHosts(local, what, deadline);
  const int64_t n = out[0].numel();
  at::Tensor whole = in.size() == 1 ? in[0] : at::cat(in);
  at::Tensor result = at::empty_like(whole);
  reduceAll(local, what, deadline, whole, result, op);
  out[0].copy_(result.narrow(0, layout_.rank * n, n));
}

void CrossHost::allGather(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                          Tensors& in, Tensors& out) {
  agreeAcrossHosts(local, what, deadline);
  const int world = layout_.size();
  const int64_t nbytes = static_cast<int64_t>(in[0].numel() * in[0].element_size());
  at::Tensor whole = out.size() == 1 ? out[0] : byteBuffer(world * nbytes);
  gatherAll(local, what, deadline, bytes(in[0]), nbytes, bytes(whole));
  shmBroadcast(local, what, deadline, bytes(whole), world * nbytes, 0);
  if (out.size() != 1) {
    for (int r = 0; r < world; ++r) {
      std::memcpy(bytes(out[r]), bytes(whole) + r * nbytes, nbytes);
    }
  }
}

void CrossHost::broadcast(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                          Tensors& in, Tensors& out, int root) {
  agreeAcrossHosts(local, what, deadline);
  const int root_host = layout_.host_of[root];
  at::Tensor data = out[0];
  if (layout_.rank == root && in[0].data_ptr() != data.data_ptr()) {
    data.copy_(in[0]); // a non-contiguous input was staged
  }
  const int64_t nbytes = static_cast<int64_t>(data.numel() * data.element_size());
  if (layout_.host() == root_host) {
    shmBroadcast(local, what, deadline, bytes(data), nbytes, layout_.local_of[root]);
  }
  if (layout_.leader()) {
    std::vector<at::Tensor> payload = {asBytes(data)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root_host;
    wait(local, leaders_->broadcast(payload, opts), what, deadline, "broadcast between hosts");
  }
  if (layout_.host() != root_host) {
    shmBroadcast(local, what, deadline, bytes(data), nbytes, 0);
  }
}

void CrossHost::gather(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                       Tensors& in, Tensors& out, int root) {
  agreeAmongAll(local, what, deadline);
  std::vector<at::Tensor> inputs = {asBytes(in[0])};
  std::vector<std::vector<at::Tensor>> outputs;
  if (layout_.rank == root) {
    outputs.emplace_back();
    for (const auto& o : out) {
      outputs.back().push_back(asBytes(o));
    }
  }
  c10d::GatherOptions opts;
  opts.rootRank = root;
  wait(local, all_->gather(outputs, inputs, opts), what, deadline, "gather");
}

void CrossHost::scatter(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                        Tensors& in, Tensors& out, int root) {
  agreeAmongAll(local, what, deadline);
  std::vector<at::Tensor> outputs = {asBytes(out[0])};
  std::vector<std::vector<at::Tensor>> inputs;
  if (layout_.rank == root) {
    inputs.emplace_back();
    for (const auto& i : in) {
      inputs.back().push_back(asBytes(i));
    }
  }
  c10d::ScatterOptions opts;
  opts.rootRank = root;
  wait(local, all_->scatter(outputs, inputs, opts), what, deadline, "scatter");
}

void CrossHost::allToAll(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline,
                         Tensors& ins, Tensors& outs) {
  agreeAmongAll(local, what, deadline);
  const int w = layout_.size();
  const int me = layout_.rank;
  // Every rank's sends and expected receives (elements), compared pairwise
  // as the one-host path does, so all ranks fail alike on a disagreement.
  at::Tensor mine = at::empty({2 * w}, at::TensorOptions().dtype(at::kLong));
  for (int j = 0; j < w; ++j) {
    mine.data_ptr<int64_t>()[j] = ins[j].numel();
    mine.data_ptr<int64_t>()[w + j] = outs[j].numel();
  }
  at::Tensor every = at::empty({w * 2 * w}, mine.options());
  wait(local, all_->_allgather_base(every, mine), what, deadline, "all_gather of split sizes");
  const int64_t* sizes = every.data_ptr<int64_t>();
  for (int r = 0; r < w; ++r) {
    for (int j = 0; j < w; ++j) {
      const int64_t sends = sizes[r * 2 * w + j];
      const int64_t expected = sizes[j * 2 * w + w + r];
      if (sends != expected) {
        local.fail("kccl: all_to_all (sequence number " + std::to_string(what.seq) + ") on rank " +
                   std::to_string(me) + ": rank " + std::to_string(r) + " sends " +
                   std::to_string(sends) + " elements to rank " + std::to_string(j) +
                   ", which expects " + std::to_string(expected) +
                   " from it; the split sizes must agree between ranks");
      }
    }
  }
  // Each piece is a send to / recv from its peer (all posted together), and
  // this rank's own piece a copy.
  std::vector<P2PTransfer> transfers;
  for (int j = 0; j < w; ++j) {
    if (j == me) {
      std::memcpy(bytes(outs[j]), bytes(ins[j]), outs[j].numel() * outs[j].element_size());
      continue;
    }
    transfers.push_back({true, j, bytes(ins[j]), ins[j].numel(), static_cast<int64_t>(ins[j].element_size())});
    transfers.push_back({false, j, bytes(outs[j]), outs[j].numel(), static_cast<int64_t>(outs[j].element_size())});
  }
  exchange(local, what, transfers, deadline);
}

void CrossHost::barrier(ShmGroup& local, const CollectiveDescription& what, Clock::time_point deadline) {
  agreeAmongAll(local, what, deadline);
  wait(local, all_->barrier(), what, deadline, "barrier");
}

void CrossHost::reapSends(ShmGroup& local, const CollectiveDescription& what) {
  auto done = [](const PendingSend& p) { return p.work->isCompleted(); };
  for (auto& p : pending_sends_) {
    if (done(p) && p.work->exception()) {
      const std::string failed = p.what;
      pending_sends_.clear();
      try {
        std::rethrow_exception(p.work->exception());
      } catch (const std::exception& e) {
        local.fail("kccl: " + failed + " failed between hosts (Gloo send), found by " + what.name +
                   " (sequence number " + std::to_string(what.seq) + ") on rank " +
                   std::to_string(layout_.rank) + ": " + e.what());
      }
    }
  }
  pending_sends_.erase(std::remove_if(pending_sends_.begin(), pending_sends_.end(), done),
                       pending_sends_.end());
}

void CrossHost::exchange(ShmGroup& local, const CollectiveDescription& what,
                         std::vector<P2PTransfer>& transfers, Clock::time_point deadline) {
  reapSends(local, what);
  // Sends are posted from a copy and not waited for here (a Gloo send waits
  // for its recv to be posted, and an ungrouped isend before the irecv must
  // not hold the communication stream); receives are posted together and
  // waited for, so a batch progresses together.
  // Receives land in staging buffers first, copied out once all arrived, so
  // a recv that fails never writes the caller's memory later.
  std::vector<c10::intrusive_ptr<c10d::Work>> recvs;
  std::vector<std::pair<at::Tensor, char*>> landed;
  for (auto& t : transfers) {
    at::Tensor payload = at::from_blob(t.data, {t.numel * t.element_size},
                                       at::TensorOptions().dtype(at::kByte));
    if (t.send) {
      std::vector<at::Tensor> staged = {payload.clone()};
      auto work = all_->send(staged, t.peer, 0);
      pending_sends_.push_back({work, staged[0],
                                std::string("send to rank ") + std::to_string(t.peer) + " (" +
                                    what.name + " #" + std::to_string(what.seq) + ")"});
    } else {
      std::vector<at::Tensor> target = {byteBuffer(payload.numel())};
      recvs.push_back(all_->recv(target, t.peer, 0));
      landed.emplace_back(target[0], t.data);
    }
  }
  for (auto& work : recvs) {
    wait(local, work, what, deadline, "recv");
  }
  for (auto& [buffer, dst] : landed) {
    std::memcpy(dst, bytes(buffer), buffer.numel());
  }
}

} // namespace c10d::kiln

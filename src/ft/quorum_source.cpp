#include "ft/quorum_source.h"

#include <thread>

namespace shardtorch::ft::detail {

using Clock = std::chrono::steady_clock;

std::string QuorumSource::ask_lighthouse(const Ask& ask) {
  try {
    const std::string& address = primary_->store_address();
    Member m{me_.replica_id,
             address,
             address,
             ask.step,
             static_cast<uint64_t>(world_->size()),
             request_data(me_.group, me_.config, me_.restarted, ask)};
    return encode(primary_->lighthouse().quorum(m, quorum_timeout_));
  } catch (const std::exception& e) {
    return encode_error(e.what());
  }
}

std::string QuorumSource::text(const Ask& ask, const std::atomic<bool>& cancelled) {
  const std::string key = me_.key_prefix + "round/" + std::to_string(ask.round);
  if (world_->rank() != 0) return wait_for_rank0(key, cancelled);
  std::string text = ask_lighthouse(ask);
  if (world_->size() == 1 || cancelled) return text;  // nobody reads it
  auto& store = *world_->store();
  store.set(key, std::vector<uint8_t>(text.begin(), text.end()));
  // Every rank read the previous posted answer before the vote that
  // followed it, which this rank has passed: drop it, or the store grows
  // every step.
  if (posted_ >= 0) store.deleteKey(me_.key_prefix + "round/" + std::to_string(posted_));
  posted_ = ask.round;
  return text;
}

std::string QuorumSource::wait_for_rank0(const std::string& key, const std::atomic<bool>& cancelled) {
  auto& store = *world_->store();
  // Polled, not store.wait(): a blocking wait would hold the store client's
  // lock and stall the training thread's own use of the store.
  const auto deadline = Clock::now() + quorum_timeout_ + std::chrono::seconds(5);
  while (!store.check({key})) {
    if (cancelled) return encode_error("cancelled");
    if (Clock::now() > deadline)
      return encode_error("rank " + std::to_string(world_->rank()) + " of replica group '" + me_.group +
                          "' did not get the quorum from its group rank 0 within the quorum timeout");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

}  // namespace shardtorch::ft::detail

#pragma once
// Internal: one step's quorum as a rank sees it, computed from the
// lighthouse's answer: who takes part, whose configuration is refused, whose
// gradients count, who is healed from whom, and the name of the
// cross-replica group built for it. Pure: every rank of every group in the
// quorum computes the same from the same answer.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ft/config.h"
#include "ft/lighthouse_client.h"

namespace shardtorch::ft::detail {

/// What a replica tells the lighthouse about itself in a quorum request
/// (the request's data), as another replica reads it.
struct Participant {
  std::string id, group, store_address, held, nonce;
  Config config;
  int64_t step = 0;
  bool restarted = false;
};

/// What a quorum request tells the lighthouse that can change between steps,
/// taken when the request is made (the worker thread reads no live field).
struct Ask {
  int64_t round = 0, step = 0;
  std::string held;  // the cross-replica group this rank holds ("" none)
};

struct Quorum {
  int64_t id = 0;
  std::vector<Participant> participants;  // sorted by replica id; without the refused ones
  std::vector<std::string> refused;       // groups refused for their configuration (logged)
  std::string refusal;                    // why, in words
  int me = -1;                            // index among participants
  int64_t max_step = 0;
  std::vector<int> counted;                // participants whose gradients count
  std::vector<std::pair<int, int>> heals;  // (healed, source) participant indices
  std::string config;                      // names the cross-replica group, should it be built now
  bool rebuilt = false;                    // this step built the cross-replica group
  std::string error;                       // the quorum could not be had: the step cannot commit
  bool fatal = false;                      // ... and that is a configuration error: throw
};

/// A request's data: this group's name, configuration, whether it was
/// restarted, the cross-replica group it holds, and a fresh nonce (so that
/// a cross-replica group built from this quorum gets a name no earlier
/// rendezvous had, whatever the lighthouse: a restarted one counts its
/// quorum ids from the start again).
std::string request_data(const std::string& group, const Config& config, bool restarted, const Ask& ask);
/// The lighthouse's answer as text, which group rank 0 hands to its group.
std::string encode(const QuorumReply& r);
/// The text of an answer that could not be had.
std::string encode_error(const std::string& why);
/// The quorum that `text` (encode's or encode_error's) gives replica `replica_id`.
Quorum compute_quorum(const std::string& text, const std::string& replica_id);

/// The participants' group names, and their replica ids.
std::vector<std::string> names(const Quorum& q);
std::vector<std::string> ids(const Quorum& q);
/// Whether this rank's group is healed in `q`.
bool heals_me(const Quorum& q);

}  // namespace shardtorch::ft::detail

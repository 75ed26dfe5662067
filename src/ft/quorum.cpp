#include "ft/quorum.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <set>

#include "ft/util.h"

namespace shardtorch::ft::detail {
namespace json = boost::json;

namespace {

// A participant from the lighthouse's record of its request; false when its
// data is not a shardtorch manager's.
bool parse_participant(const json::object& p, Participant& x) {
  x.id = json::value_to<std::string>(p.at("id"));
  x.store_address = json::value_to<std::string>(p.at("store"));
  x.step = p.at("step").as_int64();
  try {
    auto d = json::parse(json::value_to<std::string>(p.at("data"))).as_object();
    x.group = json::value_to<std::string>(d.at("group"));
    x.config = config_of(d.at("config"));
    x.restarted = d.at("restarted").as_bool();
    x.held = json::value_to<std::string>(d.at("held"));
    x.nonce = json::value_to<std::string>(d.at("nonce"));
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

// The quorum's id and participants (sorted by id) from `text`; false with
// q.error set when there are none to be had.
bool parse(const std::string& text, Quorum& q) {
  json::object o;
  try {
    o = json::parse(text).as_object();
  } catch (const std::exception& e) {
    q.error = std::string("malformed quorum: ") + e.what();
    return false;
  }
  if (o.contains("error")) {
    q.error = json::value_to<std::string>(o.at("error"));
    q.fatal = true;  // the lighthouse could not be had within its timeout
    return false;
  }
  q.id = o.at("quorum_id").as_int64();
  for (const auto& v : o.at("participants").as_array()) {
    Participant x;
    if (!parse_participant(v.as_object(), x)) {
      q.error = "replica '" + x.id +
                "' in the quorum is not a shardtorch fault-tolerance manager of this version (its data is not "
                "shardtorch's); every replica group must run shardtorch::ft::Manager";
      q.fatal = true;
      return false;
    }
    q.participants.push_back(std::move(x));
  }
  std::sort(q.participants.begin(), q.participants.end(), [](auto& a, auto& b) { return a.id < b.id; });
  return true;
}

// Sets q.me; false (with q.error) if this replica is not in the quorum.
bool find_me(Quorum& q, const std::string& replica_id) {
  q.me = -1;
  for (size_t i = 0; i < q.participants.size(); ++i)
    if (q.participants[i].id == replica_id) q.me = static_cast<int>(i);
  if (q.me < 0) q.error = "the lighthouse's quorum does not include this replica";
  return q.me >= 0;
}

// False (with q.error) if two participants are one group's. Ids are
// "group:random", so one group's replicas sort side by side.
bool one_replica_per_group(Quorum& q) {
  for (size_t i = 1; i < q.participants.size(); ++i)
    if (q.participants[i].group == q.participants[i - 1].group) {
      // An incarnation that died within the lighthouse's heartbeat timeout
      // is still a participant: it would never join the group's rendezvous.
      q.error = "the quorum " + join(names(q)) + " holds two replicas of group '" + q.participants[i].group + "' ('" +
                q.participants[i - 1].id + "' and '" + q.participants[i].id +
                "'): one is an earlier incarnation that the lighthouse has not yet timed out; the next quorum goes "
                "without it";
      return false;
    }
  return true;
}

const char* const kConfigAdvice =
    "Every replica group must build the same model with the same ShardOptions, world size and optimizer "
    "(its hyperparameters included)";

// The groups already training: those that hold a cross-replica group, when
// they hold the same one (each such group was built by a quorum that passed
// the configuration check), else those at the latest step once a step
// committed; empty when there are none.
std::vector<const Participant*> reference_groups(const std::vector<Participant>& ps) {
  std::set<std::string> held;
  int64_t max_step = 0;
  for (const auto& p : ps) {
    if (!p.held.empty()) held.insert(p.held);
    max_step = std::max(max_step, p.step);
  }
  std::vector<const Participant*> ref;
  for (const auto& p : ps)
    if (held.size() == 1 ? p.held == *held.begin() : max_step > 0 && p.step == max_step) ref.push_back(&p);
  return ref;
}

// Drops the participants whose configuration differs from `reference`
// (group `reference_group`'s), recording them as refused.
void refuse_others(Quorum& q, const Config& reference, const std::string& reference_group) {
  std::vector<Participant> kept;
  for (auto& p : q.participants)
    if (p.config == reference) {
      kept.push_back(std::move(p));
    } else {
      q.refused.push_back(p.group);
      if (q.refusal.empty()) q.refusal = config_difference(p.group, p.config, reference_group, reference);
    }
  q.participants = std::move(kept);
}

// Groups configured differently (model, strategy, mixed precision, world
// size, optimizer). When the groups already training agree, only the groups
// that differ from them are refused: they throw, and the others go on
// without them. With no such reference (nothing committed yet) or one that
// disagrees, every group throws. False when this rank's quorum ends here
// (q.error set).
bool check_configurations(Quorum& q, const std::string& replica_id) {
  const auto& ps = q.participants;
  const Participant& mine = ps[static_cast<size_t>(q.me)];
  bool alike = true;
  for (const auto& p : ps) alike = alike && p.config == mine.config;
  if (alike) return true;
  const auto ref = reference_groups(ps);
  bool agree = !ref.empty();
  for (const auto* p : ref) agree = agree && p->config == ref.front()->config;
  if (!agree) {
    for (const auto& p : ps)
      if (p.config != mine.config) {
        q.error = "replica groups '" + mine.group + "' and '" + p.group + "' are configured differently (" +
                  config_difference(mine.group, mine.config, p.group, p.config) + "). " + kConfigAdvice +
                  "; with no configuration that the groups already training share to keep, every group stops";
        q.fatal = true;
        return false;
      }
  }
  const Participant& r = *ref.front();
  std::vector<std::string> training;
  for (const auto* p : ref) training.push_back(p->group);
  if (mine.config != r.config) {
    q.error = "replica group '" + mine.group + "' is refused: its configuration differs from that of the groups " +
              "already training " + join(training) + " (" +
              config_difference(mine.group, mine.config, r.group, r.config) + "). " + kConfigAdvice +
              "; the others go on without this one";
    q.fatal = true;
    return false;
  }
  // Copies: `r` is one of the participants moved.
  refuse_others(q, Config(r.config), std::string(r.group));
  return find_me(q, replica_id);
}

// Who counts: the groups at the latest step. Before any step committed, one
// group's weights are everyone's start: the first (by id) that was not
// restarted. The others are healed from the counted groups. False (with
// q.error) when there is no live state to start from.
bool choose_counted(Quorum& q) {
  for (const auto& p : q.participants) q.max_step = std::max(q.max_step, p.step);
  const int n = static_cast<int>(q.participants.size());
  if (q.max_step > 0) {
    for (int i = 0; i < n; ++i)
      if (q.participants[i].step == q.max_step) q.counted.push_back(i);
  } else {
    for (int i = 0; i < n && q.counted.empty(); ++i)
      if (!q.participants[i].restarted) q.counted.push_back(i);
    if (q.counted.empty()) {
      q.error = "every replica group in the quorum " + join(names(q)) +
                " was restarted and none has committed a step: there is no live state to heal from. Load the latest "
                "checkpoint (then Manager::set_step) in every group, or start the groups afresh (not as restarts)";
      q.fatal = true;
      return false;
    }
  }
  std::set<int> counted(q.counted.begin(), q.counted.end());
  int k = 0;
  for (int i = 0; i < n; ++i)
    if (!counted.count(i)) q.heals.push_back({i, q.counted[static_cast<size_t>(k++) % q.counted.size()]});
  return true;
}

// The name of a cross-replica group built for this quorum: every member
// computes it from the same requests, and their nonces make it one that no
// earlier rendezvous had (a restarted lighthouse repeats quorum ids).
std::string group_name(const Quorum& q) {
  std::string text = std::to_string(q.id);
  for (const auto& p : q.participants) text += "|" + p.id + "@" + p.store_address + "/" + p.held + "/" + p.nonce;
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a(text)));
  return "q" + std::to_string(q.id) + "-" + hash;
}

}  // namespace

std::string request_data(const std::string& group, const Config& config, bool restarted, const Ask& ask) {
  return json::serialize(json::object{{"group", group},
                                      {"config", config_json(config)},
                                      {"restarted", restarted},
                                      {"held", ask.held},
                                      {"nonce", random_hex(16)}});
}

std::string encode(const QuorumReply& r) {
  json::array ps;
  for (const auto& p : r.participants)
    ps.push_back(json::object{{"id", p.replica_id}, {"store", p.store_address}, {"step", p.step}, {"data", p.data}});
  return json::serialize(json::object{{"quorum_id", r.quorum_id}, {"participants", ps}});
}

std::string encode_error(const std::string& why) { return json::serialize(json::object{{"error", why}}); }

Quorum compute_quorum(const std::string& text, const std::string& replica_id) {
  Quorum q;
  if (!parse(text, q) || !find_me(q, replica_id) || !one_replica_per_group(q) || !check_configurations(q, replica_id) ||
      !choose_counted(q))
    return q;
  q.config = group_name(q);
  return q;
}

std::vector<std::string> names(const Quorum& q) {
  std::vector<std::string> v;
  for (const auto& p : q.participants) v.push_back(p.group);
  return v;
}

std::vector<std::string> ids(const Quorum& q) {
  std::vector<std::string> v;
  for (const auto& p : q.participants) v.push_back(p.id);
  return v;
}

bool heals_me(const Quorum& q) {
  for (auto [healed, source] : q.heals)
    if (healed == q.me) return true;
  return false;
}

}  // namespace shardtorch::ft::detail

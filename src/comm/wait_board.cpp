// The WaitBoard: records of long waits in the store, and the cycles of
// waits found in them (wait_board.h).
#include "comm/wait_board.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "base/check.h"

namespace shardtorch::detail {

namespace {

using Kind = WaitBoard::Kind;

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

// A rank's record: "idle", or what it waits for, the members of that
// communicator and what it has launched and entered on each of its communicators.
struct WaitRecord {
  bool waiting = false;
  Kind kind = Kind::Collective;
  std::string comm, description;
  int64_t seq = 0;
  std::vector<int> members;                 // of `comm`, by rank in the World
  std::map<std::string, int64_t> launched;  // collectives, by communicator name
  std::map<std::string, int64_t> entered;   // exchanges, by communicator name
  std::string text;                         // as stored
};

WaitRecord parse_record(std::string text) {
  std::istringstream in(text);
  WaitRecord r;
  r.text = std::move(text);
  std::string line;
  char kind = 0;
  if (!std::getline(in, line) || line != "waiting") return r;
  int64_t n = 0;
  if (!(in >> kind >> r.seq) || (kind != 'c' && kind != 'x') || in.get() != ' ' || !std::getline(in, r.comm) ||
      !std::getline(in, r.description) || !std::getline(in, line))
    return r;
  r.kind = kind == 'c' ? Kind::Collective : Kind::Exchange;
  std::istringstream members(line);
  for (int m = 0; members >> m;) r.members.push_back(m);
  if (!(in >> n)) return r;
  for (int64_t i = 0; i < n; ++i) {
    int64_t launched = 0, entered = 0;
    std::string name;
    if (!(in >> launched >> entered) || in.get() != ' ' || !std::getline(in, name)) return r;
    r.launched[name] = launched;
    r.entered[name] = entered;
  }
  r.waiting = true;
  return r;
}

// How many collectives (exchanges) `r` has launched (entered) on
// communicator `comm`, the kind `kind` counts (0 on one it does not have).
int64_t reached(const WaitRecord& r, Kind kind, const std::string& comm) {
  const auto& counts = kind == Kind::Collective ? r.launched : r.entered;
  auto it = counts.find(comm);
  return it == counts.end() ? 0 : it->second;
}

// The edge of the wait-for graph: waiting rank `r` waits for member `p` of
// its communicator when `p` waits too and has not reached what `r` waits for.
bool waits_for(const WaitRecord& r, const WaitRecord& p) {
  return r.waiting && p.waiting && reached(p, r.kind, r.comm) < r.seq;
}

// A cycle of the wait-for graph through `self`, in edge order from `self`;
// empty if none. `record_of(rank)` reads a rank's record (once per rank).
template <class RecordOf>
std::vector<int> cycle_through(int self, RecordOf&& record_of) {
  std::vector<int> path{self};
  std::vector<size_t> next{0};  // per rank on the path: its next member to try
  std::set<int> seen{self};     // on the path, or left without leading back to `self`: not entered again
  while (!path.empty()) {
    const WaitRecord& r = record_of(path.back());
    if (next.back() >= r.members.size()) {
      path.pop_back();
      next.pop_back();
      continue;
    }
    const int p = r.members[next.back()++];
    if (p == path.back() || !waits_for(r, record_of(p))) continue;
    if (p == self) return path;
    if (seen.insert(p).second) {
      path.push_back(p);
      next.push_back(0);
    }
  }
  return {};
}

// The ranks that this one waits for, directly or not, and that wait for it
// in turn (its strongly connected component of the wait-for graph), in
// rank order; empty when it is on no cycle. Each of them is on a cycle.
template <class RecordOf>
std::vector<int> deadlocked_with(int self, RecordOf&& record_of) {
  std::vector<int> reach{self};  // from `self`, breadth first
  std::set<int> reached{self};
  std::map<int, std::vector<int>> edges;
  for (size_t i = 0; i < reach.size(); ++i) {
    const int r = reach[i];
    const WaitRecord& rec = record_of(r);
    for (int p : rec.members) {
      if (p == r || !waits_for(rec, record_of(p))) continue;
      edges[r].push_back(p);
      if (reached.insert(p).second) reach.push_back(p);
    }
  }
  std::set<int> back{self};  // of those, the ones that lead back to `self`
  for (bool grew = true; grew;) {
    grew = false;
    for (int r : reach)
      if (!back.count(r))
        for (int p : edges[r])
          if (back.count(p)) {
            back.insert(r);
            grew = true;
            break;
          }
  }
  if (back.size() < 2) return {};
  return std::vector<int>(back.begin(), back.end());
}

// The error for a cycle of waits, the same on each of its ranks: from its
// lowest rank on, each rank, where it waits and what the next has reached there.
template <class RecordOf>
std::string cycle_text(std::vector<int> cycle, RecordOf&& record_of) {
  std::rotate(cycle.begin(), std::min_element(cycle.begin(), cycle.end()), cycle.end());
  const size_t n = cycle.size();
  if (n == 2 && record_of(cycle[0]).comm == record_of(cycle[1]).comm) {
    // One communicator: one rank launched its collective, the other waits in
    // the exchange before its own (the two differ; see collective_check.h).
    return "collectives diverged: rank " + std::to_string(cycle[0]) + " is at " + record_of(cycle[0]).description +
           " but rank " + std::to_string(cycle[1]) + " is at " + record_of(cycle[1]).description + ". " + kSameOrder +
           "; neither collective ran";
  }
  std::vector<std::string> parts;
  for (size_t i = 0; i < n; ++i) {
    const WaitRecord& r = record_of(cycle[i]);
    const std::string next = std::to_string(cycle[(i + 1) % n]);
    const std::string count = std::to_string(reached(record_of(cycle[(i + 1) % n]), r.kind, r.comm));
    std::string where = "rank " + std::to_string(cycle[i]) + " waits at " + r.description + " (";
    if (r.kind == Kind::Collective)
      where += "collective " + std::to_string(r.seq) + " of communicator '" + r.comm + "', which rank " + next +
               " has not launched: it launched " + count + " there)";
    else
      where += "in its check, exchange " + std::to_string(r.seq) + " of communicator '" + r.comm + "', which rank " +
               next + " has not entered: it entered " + count + " there)";
    parts.push_back(std::move(where));
  }
  std::string text = "collectives diverged across communicators: ";
  if (n == 2) {
    text += parts[0] + " but " + parts[1];
  } else {
    text += "ranks ";
    for (size_t i = 0; i < n; ++i) text += (i == 0 ? "" : i + 1 < n ? ", " : " and ") + std::to_string(cycle[i]);
    text += " wait for each other in a cycle: ";
    for (size_t i = 0; i < n; ++i) text += (i == 0 ? "" : i + 1 < n ? ", " : ", and ") + parts[i];
  }
  return text + ". Every rank must issue the same collectives in the same order on each communicator; " +
         (n == 2 ? std::string("neither collective ran") : "none of the " + std::to_string(n) + " collectives ran");
}

std::string wait_key(int rank) { return "shardtorch-waits/wait/" + std::to_string(rank); }
std::string crossed_key(int rank) { return "shardtorch-waits/crossed/" + std::to_string(rank); }
// What a probe, or a look for a reported cycle, waits for the store at most;
// a store that does not answer is left alone (the collective's own timeout
// holds, and its error names the store's host).
constexpr std::chrono::milliseconds kStoreAnswer{2000};
void put(BoundedStore& store, const std::string& key, const std::string& value, BoundedStore::Clock::time_point until) {
  store.run([key, value](c10d::Store& s) { s.set(key, std::vector<uint8_t>(value.begin(), value.end())); }, until);
}

}  // namespace

WaitBoard::WaitBoard(c10::intrusive_ptr<BoundedStore> store, int rank, int size, std::chrono::milliseconds probe)
    : store_(std::move(store)), rank_(rank), size_(size), probe_(probe) {}

std::string WaitBoard::prefixed(const std::string& text) const {
  return detail::rank_prefix(rank_) + "/" + std::to_string(size_) + ": " + text;
}

std::string WaitBoard::cycle_reported() const {
  try {
    if (!store_->answering(kStoreAnswer)) return "";
    auto text = store_->get_if_set(crossed_key(rank_), BoundedStore::Clock::now() + kStoreAnswer);
    return text ? prefixed(*text) : "";
  } catch (...) {
    return "";
  }
}

int WaitBoard::add(std::string name, std::vector<int> members) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.push_back(Comm{one_line(std::move(name)), std::move(members)});
  return static_cast<int>(comms_.size()) - 1;
}

void WaitBoard::launched(int comm) {
  std::lock_guard<std::mutex> lock(mu_);
  ++comms_.at(static_cast<size_t>(comm)).launched;
}

void WaitBoard::entered(int comm) {
  std::lock_guard<std::mutex> lock(mu_);
  ++comms_.at(static_cast<size_t>(comm)).entered;
}

void WaitBoard::issued(int64_t step) {
  const auto me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(mu_);
  if (step > issue_step_) {
    // The previous step with collectives stays (a step without any, between
    // two optimizers, does not wipe it); a thread still at an older step
    // counts with the newest.
    if (!issuers_.empty()) issued_before_ = std::move(issuers_);
    issuers_.clear();
    issue_step_ = step;
  }
  if (std::find(issuers_.begin(), issuers_.end(), me) == issuers_.end()) issuers_.push_back(me);
}

bool WaitBoard::issued_from_several_threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return several_threads();
}

bool WaitBoard::several_threads() const {
  std::vector<std::thread::id> all = issuers_;
  for (const auto* each : {&issued_before_, &waiting_})
    for (const auto& t : *each)
      if (std::find(all.begin(), all.end(), t) == all.end()) all.push_back(t);
  return all.size() > 1;
}

std::string WaitBoard::record(int comm, Kind kind, int64_t seq, const std::string& description) const {
  std::lock_guard<std::mutex> lock(mu_);
  // Not "waiting": another thread of this rank may launch what a peer waits for.
  if (several_threads()) return "several threads issue this rank's collectives\n";
  const Comm& c = comms_[static_cast<size_t>(comm)];
  std::ostringstream os;
  os << "waiting\n"
     << (kind == Kind::Collective ? 'c' : 'x') << ' ' << seq << ' ' << c.name << '\n'
     << one_line(description) << '\n';
  for (size_t i = 0; i < c.members.size(); ++i) os << (i ? " " : "") << c.members[i];
  os << '\n' << comms_.size() << '\n';
  for (const auto& each : comms_) os << each.launched << ' ' << each.entered << ' ' << each.name << '\n';
  return os.str();
}

WaitBoard::Wait::Wait(std::shared_ptr<WaitBoard> board, int comm, Kind kind, int64_t seq,
                      std::function<std::string()> describe)
    : board_(std::move(board)),
      comm_(comm),
      kind_(kind),
      seq_(seq),
      describe_(std::move(describe)),
      next_(std::chrono::steady_clock::now() + board_->quiet()) {
  std::lock_guard<std::mutex> lock(board_->mu_);
  board_->waiting_.push_back(std::this_thread::get_id());
}

WaitBoard::Wait::~Wait() {
  {
    std::lock_guard<std::mutex> lock(board_->mu_);
    auto& w = board_->waiting_;
    if (auto it = std::find(w.begin(), w.end(), std::this_thread::get_id()); it != w.end()) w.erase(it);
  }
  // After a cycle the record stays: its other ranks' probes must still see it.
  if (written_.empty() || crossed_) return;
  try {
    if (board_->store_->answering(kStoreAnswer))
      put(*board_->store_, wait_key(board_->rank_), "idle", BoundedStore::Clock::now() + kStoreAnswer);
  } catch (...) {
  }
}

std::string WaitBoard::Wait::probe(std::optional<std::chrono::steady_clock::time_point> until) {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_) return "";
  next_ = now + board_->probe();
  WaitBoard& b = *board_;
  const auto give_up = until ? std::min(*until, now + kStoreAnswer) : now + kStoreAnswer;
  if (!b.store_->answering(kStoreAnswer)) return "";
  try {
    if (description_.empty()) description_ = describe_();
    // Rewritten when it changed: another thread of this rank launched meanwhile.
    std::string mine = b.record(comm_, kind_, seq_, description_);
    if (mine != written_) {
      put(*b.store_, wait_key(b.rank_), mine, give_up);
      written_ = mine;
    }
    std::map<int, WaitRecord> records;  // read at most once each per probe
    records.emplace(b.rank_, parse_record(std::move(mine)));
    const auto record_of = [&](int p) -> const WaitRecord& {
      auto it = records.find(p);
      if (it == records.end()) {
        std::string text = b.store_->get_if_set(wait_key(p), give_up).value_or("");
        it = records.emplace(p, parse_record(std::move(text))).first;
      }
      return it->second;
    };
    const std::vector<int> stuck = deadlocked_with(b.rank_, record_of);
    // The same ranks with the same records at two probes in a row: none of them went on meanwhile.
    std::string seen;
    for (int r : stuck) seen += std::to_string(r) + "\n" + record_of(r).text + "\n";
    crossed_ = !stuck.empty() && seen == suspect_;
    suspect_ = std::move(seen);
    if (crossed_) {
      // Each of them, a cycle through it; stored for the others, whose own
      // waits may fail first once this rank is gone.
      std::string mine;
      for (int r : stuck) {
        std::string text = cycle_text(cycle_through(r, record_of), record_of);
        put(*b.store_, crossed_key(r), text, give_up);
        if (r == b.rank_) mine = std::move(text);
      }
      return b.prefixed(mine);
    }
    std::string reported = b.cycle_reported();  // found by another rank of the cycle first
    crossed_ = !reported.empty();
    return reported;
  } catch (...) {
    return "";  // a store that fails or does not answer: the collective's own timeout still holds
  }
}

const char* const kSameOrder =
    "Every rank must issue the same collectives in the same order (the same number of micro-batches and of "
    "optimizer steps, the same units in forward, inputs of the same shapes)";

}  // namespace shardtorch::detail

#include "comm/progress.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <fstream>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <thread>

namespace shardtorch::detail {

namespace {
int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
std::string this_host() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}
std::string seconds(int64_t ms) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << ms / 1000.0 << " s";
  return os.str();
}

struct Record {
  int64_t step = 0;
  std::string phase, unit;
  std::string context;  // what the program set beside the phase (a pipeline's stage and micro-batch)
  int64_t pid = 0;
  std::string host;
  int64_t changed_ms = 0;  // wall clock when step, phase or unit last changed
  int64_t beat_ms = 0;     // wall clock of the write
  // Written as its number. Failed: a collective of this rank failed
  // (Progress::failed). Finished, LeftOnError: its World was destroyed
  // (~Progress), it left every collective; LeftOnError while an exception
  // unwound, with no collective of its own failed.
  enum class State { Running = 0, Failed = 1, Finished = 2, LeftOnError = 3 };
  State state = State::Running;
};

// Tab-separated; phase and unit names carry no tab or newline.
std::string encode(const Record& r) {
  std::ostringstream os;
  os << r.step << '\t' << r.phase << '\t' << r.unit << '\t' << r.pid << '\t' << r.host << '\t' << r.changed_ms << '\t'
     << r.beat_ms << '\t' << static_cast<int>(r.state) << '\t' << r.context;
  return os.str();
}
bool decode(const std::string& s, Record& r) {
  std::vector<std::string> f;
  size_t from = 0;
  for (;;) {
    size_t tab = s.find('\t', from);
    f.push_back(s.substr(from, tab == std::string::npos ? std::string::npos : tab - from));
    if (tab == std::string::npos) break;
    from = tab + 1;
  }
  if (f.size() != 9) return false;
  try {
    r.step = std::stoll(f[0]);
    r.phase = f[1];
    r.unit = f[2];
    r.pid = std::stoll(f[3]);
    r.host = f[4];
    r.changed_ms = std::stoll(f[5]);
    r.beat_ms = std::stoll(f[6]);
    const int state = std::stoi(f[7]);
    if (state < 0 || state > 3) return false;
    r.state = static_cast<Record::State>(state);
    r.context = f[8];
  } catch (const std::exception&) {
    return false;
  }
  return true;
}
std::string where(const Record& r) {
  std::string s = "step " + std::to_string(r.step) + ", " + r.phase;
  if (!r.unit.empty()) s += " of unit '" + r.unit + "'";
  if (!r.context.empty()) s += " (" + r.context + ")";
  return s;
}
// A process of this host that is gone: no such process, or a zombie (dead,
// not yet reaped by its parent: the launcher reaps it a moment later).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return false;
  const size_t paren = text.rfind(')');  // "pid (name) S ...": the name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < text.size() && (text[paren + 2] == 'Z' || text[paren + 2] == 'X');
}
bool same_place(const Record& a, const Record& b) {
  return a.step == b.step && a.phase == b.phase && a.unit == b.unit && a.context == b.context;
}
}  // namespace

struct Progress::Shared {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  std::string key;
  std::mutex mu;
  std::condition_variable cv;
  Record mine;
  uint64_t version = 0;
  bool stop = false, done = false;
};

Progress::Progress(c10::intrusive_ptr<c10d::Store> store, int rank) : s_(std::make_shared<Shared>()) {
  s_->store = std::move(store);
  s_->rank = rank;
  s_->key = "progress/" + std::to_string(rank);
  s_->mine.phase = "setting up";
  s_->mine.pid = static_cast<int64_t>(::getpid());
  s_->mine.host = this_host();
  s_->mine.changed_ms = now_ms();
  auto s = s_;
  thread_ = std::thread([s] {
    // Writes the record when it changed (at most every kWriteInterval) and at
    // least every kBeat. Nothing leaves this thread: a failing store ends it.
    uint64_t written = UINT64_MAX;
    auto last_write = std::chrono::steady_clock::time_point{};
    try {
      std::unique_lock<std::mutex> lock(s->mu);
      for (;;) {
        const auto now = std::chrono::steady_clock::now();
        // Stopping: the last record (finished) is written once more.
        if (s->version != written || (!s->stop && now - last_write >= kBeat)) {
          Record r = s->mine;
          written = s->version;
          lock.unlock();
          r.beat_ms = now_ms();
          const std::string text = encode(r);
          s->store->set(s->key, std::vector<uint8_t>(text.begin(), text.end()));
          last_write = std::chrono::steady_clock::now();
          lock.lock();
        }
        if (s->stop && s->version == written) break;
        s->cv.wait_for(lock, kWriteInterval, [&] { return s->stop; });
      }
    } catch (...) {  // the store is gone (its host died): peers will see this rank's record age
    }
    std::lock_guard<std::mutex> lock(s->mu);
    s->done = true;
    s->cv.notify_all();
  });
}

Progress::~Progress() {
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(s_->mu);
    // Peers whose collective fails next learn that this rank left, and where
    // from; a World destroyed while an exception unwinds left after an error.
    if (s_->mine.state != Record::State::Failed)
      s_->mine.state = std::uncaught_exceptions() > 0 ? Record::State::LeftOnError : Record::State::Finished;
    ++s_->version;
    s_->stop = true;
    s_->cv.notify_all();
    done = s_->cv.wait_for(lock, std::chrono::seconds(1), [&] { return s_->done; });
  }
  // A store write stuck past the bound (a store host that stopped answering)
  // must not hold up the exit: the thread keeps what it uses alive.
  if (done)
    thread_.join();
  else
    thread_.detach();
}

void Progress::note(const std::string& phase, const std::string& unit) {
  std::lock_guard<std::mutex> lock(s_->mu);
  Record& r = s_->mine;
  if (r.phase == phase && r.unit == unit) return;
  r.phase = phase;
  r.unit = unit;
  r.state = Record::State::Running;  // it moved on from the failure (a caught error, a retry)
  r.changed_ms = now_ms();
  ++s_->version;
}

void Progress::set_context(const std::string& context) {
  std::lock_guard<std::mutex> lock(s_->mu);
  Record& r = s_->mine;
  if (r.context == context) return;
  r.context = context;
  r.changed_ms = now_ms();
  ++s_->version;
}

void Progress::step_done() {
  std::lock_guard<std::mutex> lock(s_->mu);
  ++s_->mine.step;
  s_->mine.phase = "optimizer step done";
  s_->mine.unit.clear();
  s_->mine.state = Record::State::Running;
  s_->mine.changed_ms = now_ms();
  ++s_->version;
}

void Progress::failed() {
  Record r;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->mine.state = Record::State::Failed;
    ++s_->version;
    r = s_->mine;
  }
  try {  // now, not from the thread: this rank may exit at once, and its peers must not take it for the dead one
    r.beat_ms = now_ms();
    const std::string text = encode(r);
    s_->store->set(s_->key, std::vector<uint8_t>(text.begin(), text.end()));
  } catch (...) {
  }
}

std::string Progress::report(const std::vector<int>& members, std::chrono::steady_clock::time_point started) const {
  try {
    Record me;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      me = s_->mine;
    }
    const int64_t now = now_ms();
    const int64_t started_ms =
        now - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count();
    const int64_t silent_after = 4 * kBeat.count();
    std::vector<std::string> at_fault, others;
    // A killed process closes its sockets before it becomes a zombie: a peer
    // that saw the connection close may still find it running for a moment.
    // Local peers get up to 300 ms, in all, to be seen gone.
    const auto grace_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    auto gone = [&](int64_t pid) {
      for (;;) {
        if (process_gone(pid)) return true;
        if (std::chrono::steady_clock::now() >= grace_until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    };
    auto read = [&](const std::string& key, Record& r) {
      std::string text;
      if (s_->store->check({key})) {
        auto v = s_->store->get(key);
        text.assign(v.begin(), v.end());
      }
      return !text.empty() && decode(text, r);
    };
    for (int peer : members) {
      if (peer == s_->rank) continue;
      const std::string key = "progress/" + std::to_string(peer);
      Record r;
      if (!read(key, r)) {
        at_fault.push_back("rank " + std::to_string(peer) + " has recorded no progress (did it start?)");
        continue;
      }
      const std::string rank = "rank " + std::to_string(peer);
      const bool local = r.host == me.host;
      // A survivor marks its record failed before it looks at others, so one
      // seen gone is read again: it may have failed and exited since.
      if (r.state != Record::State::Failed && local && gone(r.pid)) read(key, r);
      if (r.state ==
          Record::State::Failed) {  // a fellow survivor that gave up first (and may have exited since): not at fault
        others.push_back(rank + " failed too, at " + where(r));
      } else if (r.state == Record::State::LeftOnError) {
        at_fault.push_back(rank + " stopped on an error of its own (see its output): its World was destroyed " +
                           seconds(now - r.beat_ms) + " ago, while an exception unwound, after " + where(r));
      } else if (r.state ==
                 Record::State::Finished) {  // left without an error: it issued fewer collectives than this rank
        at_fault.push_back(rank + " had finished: its World was destroyed " + seconds(now - r.beat_ms) +
                           " ago, after " + where(r) +
                           ", with no exception in flight (it issued fewer collectives than this rank: "
                           "fewer steps or micro-batches, or it caught an error of its own and ended?)");
      } else if (local && gone(r.pid)) {
        at_fault.push_back(rank + " is no longer running (pid " + std::to_string(r.pid) +
                           " on this host); it was last at " + where(r) + ", " + seconds(now - r.changed_ms) + " ago");
      } else if (now - r.beat_ms > silent_after) {
        at_fault.push_back(rank + " stopped reporting " + seconds(now - r.beat_ms) +
                           " ago (dead, or its process hung; pid " + std::to_string(r.pid) + " on " + r.host +
                           "); it was last at " + where(r));
      } else if (!same_place(r, me) && now - r.changed_ms >= std::max<int64_t>((now - started_ms) / 2, 100)) {
        // Elsewhere for at least half of this collective's wait (a peer that
        // arrived would have moved to it long ago; "since it started" misses
        // one that stalled a moment after this rank began). On this host it
        // is known to run; on another, only that it was heard from lately.
        at_fault.push_back(rank + (local ? " is alive but" : "") + " did not arrive: it has been at " + where(r) +
                           " for " + seconds(now - r.changed_ms) +
                           (local ? " (pid " + std::to_string(r.pid) + " on this host)"
                                  : " (last heard from " + seconds(now - r.beat_ms) + " ago; pid " +
                                        std::to_string(r.pid) + " on " + r.host + ")"));
      } else {
        others.push_back(rank + " at " + where(r));
      }
    }
    if (at_fault.empty() && others.empty()) return "";
    std::ostringstream os;
    if (!at_fault.empty()) {
      os << "Peer at fault: ";
      for (size_t i = 0; i < at_fault.size(); ++i) os << (i ? "; " : "") << at_fault[i];
      os << ".";
    } else {
      os << "Every peer is alive and reporting.";
    }
    os << " This rank is at " << where(me);
    if (!others.empty()) {
      os << "; ";
      for (size_t i = 0; i < others.size(); ++i) os << (i ? ", " : "") << others[i];
    }
    return os.str();
  } catch (const std::exception& e) {
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    return std::string("(the peers' progress could not be read from the store: ") +
           (c ? c->what_without_backtrace() : e.what()) + "; if rank 0 hosts it, rank 0 may have died)";
  }
}

}  // namespace shardtorch::detail

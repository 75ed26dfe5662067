#include "comm/progress.h"
#include "comm/collective_check.h"
#include "base/errors.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <fstream>
#include <functional>
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
  os << std::fixed << std::setprecision(1) << std::max<int64_t>(ms, 0) / 1000.0 << " s";  // clocks a little apart: 0
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
  // unwound, with no collective of its own failed. Terminating:
  // std::terminate was called (an exception no one caught), `error` says why.
  enum class State { Running = 0, Failed = 1, Finished = 2, LeftOnError = 3, Terminating = 4 };
  State state = State::Running;
  std::string error;  // Terminating, or raised(): the exception's message, no tab or newline
  // "KEY:N,KEY:N": the collectives launched on each Comm that Progress::count
  // follows, KEY a hash of its group's name (names may hold any character).
  std::string counts;
};

// Tab-separated; phase and unit names carry no tab or newline.
std::string encode(const Record& r) {
  std::ostringstream os;
  os << r.step << '\t' << r.phase << '\t' << r.unit << '\t' << r.pid << '\t' << r.host << '\t' << r.changed_ms << '\t'
     << r.beat_ms << '\t' << static_cast<int>(r.state) << '\t' << r.context << '\t' << r.error << '\t' << r.counts;
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
  if (f.size() != 11) return false;
  try {
    r.step = std::stoll(f[0]);
    r.phase = f[1];
    r.unit = f[2];
    r.pid = std::stoll(f[3]);
    r.host = f[4];
    r.changed_ms = std::stoll(f[5]);
    r.beat_ms = std::stoll(f[6]);
    const int state = std::stoi(f[7]);
    if (state < 0 || state > 4) return false;
    r.state = static_cast<Record::State>(state);
    r.context = f[8];
    r.error = f[9];
    r.counts = f[10];
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
// The state of a process of this host, as /proc/PID/stat shows it: 'R',
// 'S', 'T' (stopped), 't' (traced), 'Z' (a zombie: dead, not yet reaped by
// its parent, which the launcher does a moment later); 'X' when there is no
// such process, '?' when it cannot be told.
char process_state(int64_t pid) {
  if (pid <= 0) return '?';
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH ? 'X' : '?';
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return '?';
  const size_t paren = text.rfind(')');  // "pid (name) S ...": the name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : '?';
}
// A process of this host that is gone: no such process, or a zombie.
bool process_gone(int64_t pid) {
  const char state = process_state(pid);
  return state == 'X' || state == 'Z';
}
// A group name's key in Record::counts: the same in every process.
std::string count_key(const std::string& group) { return std::to_string(text_hash(group)); }
// The count of `key` in `counts` (Record::counts); -1 when it has none.
int64_t count_of(const std::string& counts, const std::string& key) {
  const std::string at = key + ":";
  for (size_t from = 0; from < counts.size();) {
    const size_t end = std::min(counts.find(',', from), counts.size());
    if (counts.compare(from, at.size(), at) == 0) try {
        return std::stoll(counts.substr(from + at.size(), end - from - at.size()));
      } catch (const std::exception&) {
        return -1;
      }
    from = end + 1;
  }
  return -1;
}
bool same_place(const Record& a, const Record& b) {
  return a.step == b.step && a.phase == b.phase && a.unit == b.unit && a.context == b.context;
}

std::string key_of(int rank) { return "shardtorch-peers/progress/" + std::to_string(rank); }
}  // namespace

struct Progress::Shared {
  c10::intrusive_ptr<BoundedStore> store;
  int rank = 0;
  std::string key;
  std::mutex mu;
  std::condition_variable cv;
  Record mine;
  // The Comms whose launched collectives the record counts (Progress::count).
  std::vector<std::pair<std::string, std::shared_ptr<const std::atomic<int64_t>>>> counters;
  bool counting = true;  // until stop_counting()
  uint64_t version = 0;
  bool stop = false, done = false;
  // The last time this process did not run for kSilent or longer (stopped,
  // or starved): how long, and when it ran again (wall clock, ms; 0: never).
  int64_t stalled_ms = 0, stalled_until_ms = 0;

  // `mine` with the counts of now, to write; under `mu`.
  Record current() const {
    Record r = mine;
    for (const auto& [key, count] : counters)
      r.counts += (r.counts.empty() ? "" : ",") + key + ":" + std::to_string(count->load());
    return r;
  }

  // Writes `r` now, from the calling thread rather than the record's, waiting
  // at most kSilent for the store; never throws. Not under `mu`.
  void write_now(Record r) {
    if (!store->answering(Progress::kSilent)) return;  // its peers cannot read the store either
    try {
      r.beat_ms = now_ms();
      store->set_and_confirm(key, encode(r), std::chrono::steady_clock::now() + Progress::kSilent);
    } catch (...) {
    }
  }

  // Ends the thread after one last write of `mine`, waiting for it at most
  // a second; `lock` holds `mu`. Whether the thread ended.
  bool stop_after_last_write(std::unique_lock<std::mutex>& lock) {
    ++version;
    stop = true;
    cv.notify_all();
    return cv.wait_for(lock, last_write_bound, [&] { return done; });
  }
  // A TCPStore whose host stopped answering must not hold up the exit: a
  // second. A FileStore (a shared file, no host to lose) is waited for: a
  // process that exits in the middle of its append leaves a record cut short,
  // on which every other process's next read of the file spins for ever.
  std::chrono::milliseconds last_write_bound{1000};
};

namespace {
// std::terminate in a process with a World (an exception that nothing
// caught, in main or in a thread): every live Progress writes its record as
// Terminating, with the exception's message, before the handler that was
// there before (the runtime's prints the exception and aborts) runs, so that
// a peer whose transfer fails once this process is gone names it and says why.
struct AtTerminate {
  std::mutex mu;
  std::vector<std::pair<std::weak_ptr<void>, std::function<void(const std::string&)>>> hooks;
  std::terminate_handler previous = nullptr;
  bool installed = false;
};
AtTerminate& at_terminate() {
  static auto* t = new AtTerminate;  // never destroyed: terminate may come during static destruction
  return *t;
}

// The message of the exception in flight or being handled, for the record;
// "" when there is none (std::terminate called directly, a joinable
// std::thread destroyed).
std::string exception_message() {
  std::string text;
  if (const auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      text = x.what();
    } catch (...) {
      text = "an exception not derived from std::exception";
    }
  }
  for (char& c : text)
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';  // the record is tab-separated
  if (text.size() > 500) text = text.substr(0, 500) + "...";
  return text;
}

[[noreturn]] void on_terminate() {
  auto& t = at_terminate();
  const std::string reason = exception_message();
  std::vector<std::function<void(const std::string&)>> hooks;
  for (int i = 0; i < 20; ++i) {  // held only briefly, by a World being made (not by one that terminated there)
    if (t.mu.try_lock()) {
      for (auto& [alive, hook] : t.hooks)
        if (!alive.expired()) hooks.push_back(hook);
      t.mu.unlock();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& hook : hooks) try {
      hook(reason);
    } catch (...) {
    }
  if (t.previous) t.previous();
  std::abort();
}

void call_at_terminate(std::weak_ptr<void> alive, std::function<void(const std::string&)> hook) {
  auto& t = at_terminate();
  std::lock_guard<std::mutex> lock(t.mu);
  t.hooks.erase(std::remove_if(t.hooks.begin(), t.hooks.end(), [](const auto& h) { return h.first.expired(); }),
                t.hooks.end());
  t.hooks.emplace_back(std::move(alive), std::move(hook));
  if (!t.installed) {
    t.previous = std::set_terminate(on_terminate);
    t.installed = true;
  }
}
}  // namespace

Progress::Progress(c10::intrusive_ptr<BoundedStore> store, int rank, bool file_store) : s_(std::make_shared<Shared>()) {
  s_->store = std::move(store);
  if (file_store) s_->last_write_bound = std::chrono::seconds(60);
  s_->rank = rank;
  s_->key = key_of(rank);
  s_->mine.phase = "setting up";
  s_->mine.pid = static_cast<int64_t>(::getpid());
  s_->mine.host = this_host();
  s_->mine.changed_ms = now_ms();
  auto s = s_;
  thread_ = std::thread([s] {
    // Writes the record when it changed (at most every kWriteInterval), and
    // at least every kBeat waiting for the store's answer. A call the store
    // does not answer in time is retried at the next beat (the store answers
    // again once its host goes on); a closed connection ends the thread.
    // Nothing leaves this thread.
    uint64_t written = UINT64_MAX;
    auto last_write = std::chrono::steady_clock::time_point{}, retry_at = last_write;
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      const bool beat = !s->stop && now - last_write >= kBeat;
      // Stopping: the last record is written once more, at once, whatever an earlier failure said.
      if ((s->version != written && (now >= retry_at || s->stop)) || beat) {
        Record r = s->current();
        const uint64_t version = s->version;
        lock.unlock();
        bool ok = true;
        try {
          r.beat_ms = now_ms();
          if (beat)
            s->store->set_and_confirm(s->key, encode(r), std::nullopt);
          else
            s->store->run([key = s->key, text = encode(r)](c10d::Store& st) {
              st.set(key, std::vector<uint8_t>(text.begin(), text.end()));
            });
        } catch (...) {
          ok = false;
        }
        last_write = std::chrono::steady_clock::now();
        lock.lock();
        if (ok) written = version;
        if (!ok) retry_at = last_write + kBeat;
        if (!ok && (s->stop || !s->store->broken().empty())) break;  // gone for good, or no time left
      }
      if (s->stop && s->version == written) break;
      const auto before = std::chrono::steady_clock::now();
      s->cv.wait_for(lock, kWriteInterval, [&] { return s->stop; });
      // A wait of 20 ms that took seconds: the whole process was stopped (or starved).
      if (const auto took = std::chrono::steady_clock::now() - before; took >= kSilent) {
        s->stalled_ms = std::chrono::duration_cast<std::chrono::milliseconds>(took).count();
        s->stalled_until_ms = now_ms();
      }
    }
    s->done = true;
    s->cv.notify_all();
  });
  // The last record says why the process is ending, written as ~Progress
  // writes it (the thread's last write, waited for at most a second).
  call_at_terminate(s_, [w = std::weak_ptr<Shared>(s_)](const std::string& reason) {
    const auto s = w.lock();
    if (!s) return;
    std::unique_lock<std::mutex> lock(s->mu, std::defer_lock);
    for (int i = 0; !lock.try_lock(); ++i) {  // not held for long by anyone but a thread that stopped
      if (i == 20) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // The thread has ended, or ~Progress runs; or a record of the parent
    // this process was forked from (its thread did not come along).
    if (s->done || s->stop || s->mine.pid != static_cast<int64_t>(::getpid())) return;
    if (s->mine.state != Record::State::Failed) {  // a survivor of a peer's failure stays one
      s->mine.state = Record::State::Terminating;
      s->mine.error = reason;
    }
    s->stop_after_last_write(lock);
  });
}

Progress::~Progress() {
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(s_->mu);
    // Peers whose collective fails next learn that this rank left, and where
    // from; a World destroyed while an exception unwinds left after an error.
    if (s_->mine.state != Record::State::Failed && s_->mine.state != Record::State::Terminating)
      s_->mine.state = std::uncaught_exceptions() > 0 ? Record::State::LeftOnError : Record::State::Finished;
    done = s_->stop_after_last_write(lock);
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
  if (s_->stop || (r.phase == phase && r.unit == unit)) return;  // stop: the last record is written (terminating)
  r.phase = phase;
  r.unit = unit;
  r.state = Record::State::Running;  // it moved on from the failure (a caught error, a retry)
  r.changed_ms = now_ms();
  ++s_->version;
}

void Progress::set_context(const std::string& context) {
  std::lock_guard<std::mutex> lock(s_->mu);
  Record& r = s_->mine;
  if (s_->stop || r.context == context) return;  // stop: the last record is written (terminating)
  r.context = context;
  r.changed_ms = now_ms();
  ++s_->version;
}

void Progress::count(const std::string& group, std::shared_ptr<const std::atomic<int64_t>> launched) {
  std::lock_guard<std::mutex> lock(s_->mu);
  if (!s_->counting) return;
  const std::string key = count_key(group);
  for (auto& [k, c] : s_->counters)
    if (k == key) {
      c = std::move(launched);
      return;
    }
  s_->counters.emplace_back(key, std::move(launched));
}

void Progress::stop_counting() {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->counting = false;
  s_->counters.clear();
  ++s_->version;  // the next write has no counts
}

void Progress::raised() {
  std::string text = exception_message();
  Record r;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->stop || text.empty()) return;  // the last record is written (terminating)
    s_->mine.error = std::move(text);
    ++s_->version;
    r = s_->current();
  }
  s_->write_now(std::move(r));  // the peers' transfers with this rank fail as soon as its groups go
}

void Progress::step_done() {
  std::lock_guard<std::mutex> lock(s_->mu);
  if (s_->stop) return;  // the last record is written (terminating)
  ++s_->mine.step;
  s_->mine.phase = "optimizer step done";
  s_->mine.unit.clear();
  s_->mine.error.clear();
  s_->mine.state = Record::State::Running;
  s_->mine.changed_ms = now_ms();
  ++s_->version;
}

void Progress::failed() {
  Record r;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->stop) return;  // the last record is written (terminating)
    s_->mine.state = Record::State::Failed;
    ++s_->version;
    r = s_->current();
  }
  s_->write_now(std::move(r));  // this rank may exit at once, and its peers must not take it for the dead one
}

namespace {
// The peer at fault when the store does not answer or closed its connection:
// the rank that hosts it, if one does, named as surely as any other peer.
std::string store_failure(const BoundedStore& store, int self, const Record& me, const std::string& error) {
  const std::string closed = store.broken();
  const auto silent = std::max(store.unanswered_for(), Progress::kSilent);
  const std::string unanswered = store.name() + ", which has not answered for " + seconds(silent.count());
  const auto& host = store.host();
  std::string text;
  if (!host || host->rank == self) {
    text = "The peers' records could not be read: " +
           (closed.empty() ? unanswered : store.name() + " closed its connection: " + closed) +
           (error.empty() ? "" : " (" + error + ")") + ".";
  } else {
    const std::string rank = "rank " + std::to_string(host->rank);
    const bool local = host->pid > 0 && host->name == me.host;
    char state = local ? process_state(host->pid) : '?';
    // A killed process closes its sockets before it becomes a zombie (as in report()).
    for (int i = 0; i < 30 && !closed.empty() && local && state != 'X' && state != 'Z'; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      state = process_state(host->pid);
    }
    const std::string pid = "pid " + std::to_string(host->pid) + (local ? " on this host" : " on " + host->name);
    text = "Peer at fault: ";
    if (state == 'X' || state == 'Z')
      text += rank + " is no longer running (" + pid + "); it hosted " + store.name() +
              ", so the other peers' records went with it";
    else if (state == 'T' || state == 't')
      text += rank + " is stopped (" + pid + ", process state " + std::string(1, state) +
              ": SIGSTOP, job control or a debugger); it hosts " + unanswered +
              ", so the other peers' records cannot be read";
    else if (!closed.empty())
      text += rank + ", which hosts " + store.name() + ", closed its connection: it died, or its World ended" +
              (host->pid > 0 ? " (" + pid + ")" : "") + "; the other peers' records went with it";
    else
      text += rank + " hosts " + unanswered + ": its process is stopped or hung, or its host is down" +
              (host->pid > 0 ? " (" + pid + (local ? ", running" : "") + ")" : "") +
              "; the other peers' records are there and could not be read";
    text += ".";
  }
  return text + " This rank is at " + where(me);
}
}  // namespace

namespace {

// What one peer's record says about a collective that failed on this rank.
struct Verdict {
  Verdict(bool at_fault, bool failed_too, std::string text, bool late = false, std::string place = "")
      : at_fault(at_fault), failed_too(failed_too), text(std::move(text)), late(late), place(std::move(place)) {}
  bool at_fault = false;
  bool failed_too = false;  // a fellow survivor that gave up first
  std::string text;
  // At fault only by its count of launched collectives: named only when no
  // peer is at fault otherwise (a peer that died explains the failure; one
  // that had not come yet when it did is only late), else `place` is given.
  bool late = false;
  std::string place;
};

// `r`: the peer's record; `gone(pid)`: whether a local process has exited;
// `started_ms`: when this rank's collective started; times in ms.
Verdict judge(const std::string& rank, const Record& r, const Record& me, const std::function<bool(int64_t)>& gone,
              int64_t now, int64_t started_ms, const std::string& key, int64_t seq) {
  const bool local = r.host == me.host;
  if (r.state == Record::State::Failed)  // a fellow survivor that gave up first (and may have exited since)
    return {false, true, rank + " failed too, at " + where(r)};
  if (r.state == Record::State::Terminating)
    return {true, false,
            rank +
                (r.error.empty() ? " is ending in std::terminate, with no exception in flight"
                                 : " is ending on an exception that nothing caught (" + r.error + ")") +
                ", " + seconds(now - r.beat_ms) + " ago, at " + where(r)};
  if (r.state == Record::State::LeftOnError)
    return {true, false,
            rank + " stopped on an error of its own (" + (r.error.empty() ? "see its output" : r.error) +
                "): its World was destroyed " + seconds(now - r.beat_ms) + " ago, while an exception unwound, after " +
                where(r)};
  if (r.state == Record::State::Finished && !r.error.empty())  // a library call threw, the program caught it
    return {true, false,
            rank + " had finished after an error of its own that the program caught (" + r.error +
                "): its World was destroyed " + seconds(now - r.beat_ms) + " ago, after " + where(r)};
  if (r.state == Record::State::Running && !r.error.empty())  // a library call threw since its last step
    return {
        true, false,
        rank + " threw an error of its own (" + r.error + ") at " + where(r) + ", " + seconds(now - r.changed_ms) +
            " ago" +
            (local && gone(r.pid) ? "; it is no longer running (pid " + std::to_string(r.pid) + " on this host)" : "")};
  if (r.state == Record::State::Finished)  // left without an error: it issued fewer collectives than this rank
    return {true, false,
            rank + " had finished: its World was destroyed " + seconds(now - r.beat_ms) + " ago, after " + where(r) +
                ", with no exception in flight (it issued fewer collectives than this rank: "
                "fewer steps or micro-batches, or it caught an error of its own and ended?)"};
  if (local && gone(r.pid))
    return {true, false,
            rank + " is no longer running (pid " + std::to_string(r.pid) + " on this host); it was last at " +
                where(r) + ", " + seconds(now - r.changed_ms) + " ago"};
  if (now - r.beat_ms > Progress::kSilent.count())
    return {true, false,
            rank + " stopped reporting " + seconds(now - r.beat_ms) + " ago (dead, or its process hung; pid " +
                std::to_string(r.pid) + " on " + r.host + "); it was last at " + where(r)};
  const int64_t launched = seq > 0 ? count_of(r.counts, key) : -1;
  if (launched >= seq) return {false, false, rank + " at " + where(r)};  // it launched this collective too
  // It had not launched it when it wrote its record in the second half of
  // this collective's wait (counts are written with the beats).
  if (launched >= 0 && r.beat_ms - started_ms >= std::max<int64_t>((now - started_ms) / 2, 100))
    return {true, false,
            rank + (local ? " is alive but" : "") + " did not arrive: it has been at " + where(r) + " for " +
                seconds(now - r.changed_ms) + ", and " + seconds(now - r.beat_ms) + " ago it had launched " +
                std::to_string(launched) + " collective(s) of this group, this one being number " +
                std::to_string(seq) +
                (local ? " (pid " + std::to_string(r.pid) + " on this host)"
                       : " (pid " + std::to_string(r.pid) + " on " + r.host + ")"),
            true, rank + " at " + where(r) + " (not yet at this collective)"};
  if (!same_place(r, me) && now - r.changed_ms >= std::max<int64_t>((now - started_ms) / 2, 100)) {
    // Elsewhere for at least half of this collective's wait (a peer that
    // arrived would have moved to it long ago; "since it started" misses
    // one that stalled a moment after this rank began). On this host it
    // is known to run; on another, only that it was heard from lately.
    return {true, false,
            rank + (local ? " is alive but" : "") + " did not arrive: it has been at " + where(r) + " for " +
                seconds(now - r.changed_ms) +
                (local ? " (pid " + std::to_string(r.pid) + " on this host)"
                       : " (last heard from " + seconds(now - r.beat_ms) + " ago; pid " + std::to_string(r.pid) +
                             " on " + r.host + ")")};
  }
  return {false, false, rank + " at " + where(r)};
}

// The report's text from the verdicts ("" when there is nothing to say).
// `stalled_ms`, `stalled_until_ms`: this process's own last stall.
std::string summary(const std::vector<std::string>& at_fault, const std::vector<std::string>& others, int failed_too,
                    bool stalled, int64_t stalled_ms, int64_t stalled_until_ms, int64_t now, const Record& me) {
  if (at_fault.empty() && others.empty() && !stalled) return "";
  std::ostringstream os;
  if (!at_fault.empty()) {
    os << "Peer at fault: ";
    for (size_t i = 0; i < at_fault.size(); ++i) os << (i ? "; " : "") << at_fault[i];
    os << ".";
  } else if (stalled) {
    os << "No peer is at fault: this rank's own process did not run for " << seconds(stalled_ms) << ", until "
       << seconds(now - stalled_until_ms)
       << " ago (stopped, by SIGSTOP, job control or a debugger, or starved of CPU), and its peers gave up "
          "waiting for it.";
  } else if (others.size() == static_cast<size_t>(failed_too)) {
    os << "No peer is at fault that this rank can tell: every other failed too.";
  } else {
    os << "Every peer is alive and reporting.";
  }
  if (stalled && !at_fault.empty())
    os << " This rank's own process did not run for " << seconds(stalled_ms) << ", until "
       << seconds(now - stalled_until_ms) << " ago.";
  os << " This rank is at " << where(me);
  if (!others.empty()) {
    os << "; ";
    for (size_t i = 0; i < others.size(); ++i) os << (i ? ", " : "") << others[i];
  }
  return os.str();
}

}  // namespace

bool Progress::any_ended(const std::vector<int>& members) const {
  std::string host;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    host = s_->mine.host;
  }
  const auto give_up = std::chrono::steady_clock::now() + kSilent;
  try {
    for (int peer : members) {
      if (peer == s_->rank) continue;
      Record r;
      auto text = s_->store->get_if_set(key_of(peer), give_up);
      if (!text || !decode(*text, r)) continue;
      if (r.state != Record::State::Running) return true;
      if (now_ms() - r.beat_ms > kSilent.count()) return true;
      if (r.host == host && process_gone(r.pid)) return true;
    }
  } catch (const std::exception&) {  // the store did not answer: the caller's own wait says so in time
  }
  return false;
}

std::string Progress::report(const std::vector<int>& members, std::chrono::steady_clock::time_point started,
                             const std::string& group, int64_t seq) const {
  Record me;
  int64_t stalled_ms = 0, stalled_until_ms = 0;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    me = s_->mine;
    stalled_ms = s_->stalled_ms;
    stalled_until_ms = s_->stalled_until_ms;
  }
  const BoundedStore& store = *s_->store;
  // Everything read below within kSilent: a store that takes longer names its host.
  const auto give_up = std::chrono::steady_clock::now() + kSilent;
  try {
    if (!store.answering(kSilent)) return store_failure(store, s_->rank, me, "");
    const int64_t now = now_ms();
    const int64_t started_ms =
        now - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count();
    const std::string key = count_key(group);
    std::vector<Verdict> verdicts;
    std::vector<std::string> at_fault, others;
    int failed_too = 0;
    // A killed process closes its sockets before it becomes a zombie: a peer
    // that saw the connection close may still find it running for a moment.
    // Local peers get up to 300 ms, in all, to be seen gone.
    const auto grace_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    const std::function<bool(int64_t)> gone = [&](int64_t pid) {
      for (;;) {
        if (process_gone(pid)) return true;
        if (std::chrono::steady_clock::now() >= grace_until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    };
    auto read = [&](int peer, Record& r) {
      auto text = s_->store->get_if_set(key_of(peer), give_up);
      return text && decode(*text, r);
    };
    for (int peer : members) {
      if (peer == s_->rank) continue;
      Record r;
      if (!read(peer, r)) {
        verdicts.push_back({true, false, "rank " + std::to_string(peer) + " has recorded no progress (did it start?)"});
        continue;
      }
      // A survivor marks its record failed before it looks at others, so one
      // seen gone is read again: it may have failed and exited since.
      if (r.state != Record::State::Failed && r.host == me.host && gone(r.pid)) read(peer, r);
      verdicts.push_back(judge("rank " + std::to_string(peer), r, me, gone, now, started_ms, key, seq));
    }
    const bool explained =
        std::any_of(verdicts.begin(), verdicts.end(), [](const Verdict& v) { return v.at_fault && !v.late; });
    for (Verdict& v : verdicts) {
      if (v.late && explained)
        others.push_back(std::move(v.place));
      else
        (v.at_fault ? at_fault : others).push_back(std::move(v.text));
      failed_too += v.failed_too;
    }
    // This process itself did not run during this collective, or just before
    // it: its peers may have given up on it.
    const bool stalled = stalled_until_ms > 0 && stalled_until_ms >= started_ms - kSilent.count();
    return summary(at_fault, others, failed_too, stalled, stalled_ms, stalled_until_ms, now, me);
  } catch (const std::exception& e) {  // the store did not answer in time, or closed its connection
    return store_failure(store, s_->rank, me, message_of(e));
  }
}

}  // namespace shardtorch::detail

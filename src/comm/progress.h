#pragma once
// Progress: where each rank last was (step, phase, unit), kept in the c10d
// store so that a rank whose collective fails can name the peer at fault
// (docs/reliability.md, "Ranks and options").
//
// note() only updates memory (a mutex and a string copy): a thread of the
// Progress's own writes the record to the store when it changed (at most
// every kWriteInterval) and at least every kBeat, so a record's age also
// says whether its rank still runs. Each beat waits for the store's answer,
// so a store that stops answering (its host rank stopped) is seen within a
// beat or two. Nothing the thread does can throw out of it; a store whose
// connection closed stops the writing.
#include "comm/bounded_store.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace shardtorch::detail {

class Progress {
 public:
  static constexpr std::chrono::milliseconds kWriteInterval{20};
  static constexpr std::chrono::milliseconds kBeat{500};
  /// A peer whose record is this old has stopped reporting; a store that
  /// has not answered a call for this long is taken as not answering.
  static constexpr std::chrono::milliseconds kSilent{4 * kBeat};

  /// `store`: a connection of the Progress's own (BoundedStore::fresh_connection),
  /// shared with the World's WaitBoard.
  /// `file_store`: the store is a c10d::FileStore, whose last write is waited
  /// for at the end (a record cut short would stop every other reader).
  Progress(c10::intrusive_ptr<BoundedStore> store, int rank, bool file_store = false);
  /// Stops the thread (waits at most about a second for a store write in flight).
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// This rank is now at `phase` (of `unit`, if any). No I/O.
  void note(const std::string& phase, const std::string& unit = "");
  /// Where in its own work the program is, beside the phase (a pipeline's
  /// stage and micro-batch); shown after the phase; "" clears it. No I/O.
  /// Tabs and newlines are not allowed (the record is tab-separated).
  void set_context(const std::string& context);
  /// An optimizer step is done: the step count grows (and the error raised()
  /// kept is forgotten).
  void step_done();
  /// Called while a call into the library unwinds with the exception being
  /// handled: its message is kept in the record until the next step_done(),
  /// so that peers can give it when this rank ends after the program caught
  /// it. Written at once, as failed() writes; never throws.
  void raised();

  /// A collective of this rank failed: the record says so at once (written
  /// here, not by the thread), so that peers whose own collective fails
  /// next do not take this rank, gone after its error, for the one at fault.
  /// Never throws; waits at most kSilent for the store.
  void failed();

  /// The record counts the collectives launched on the Comm of `group` (a
  /// name the same on every member): `launched` is Comm::launched_count().
  /// Counting a group again replaces its counter (written with the beats,
  /// not on every change).
  void count(const std::string& group, std::shared_ptr<const std::atomic<int64_t>> launched);
  /// The record counts nothing from now on, and count() is ignored: in a
  /// World that rejoined, and in a replacement, the ranks' counts no longer
  /// line up (the survivors replay the set-up outside the Comms).
  void stop_counting();
  /// For the error of a collective over `members` (global ranks, this one
  /// among them) that started at `started` and failed: which peers are no
  /// longer running, which stopped reporting, and which did not arrive (their
  /// record, written in the second half of its wait, counts fewer than `seq`
  /// collectives launched on `group`'s Comm; without counts: they were
  /// elsewhere for at least half of its wait), with where each last was.
  /// Reads the store, for kSilent at most: a store that does not answer, or
  /// whose connection closed, names the rank that hosts it (stopped, hung or
  /// gone). Never throws ("" when nothing can be said).
  std::string report(const std::vector<int>& members, std::chrono::steady_clock::time_point started,
                     const std::string& group = "", int64_t seq = 0) const;

  /// Whether one of `members` (global ranks) will not come to a wait of this
  /// rank's: its record says it finished, left on an error, is terminating
  /// or failed, it stopped reporting (kSilent), or its process on this host
  /// is gone. For waits that no collective bounds (a store key); never
  /// throws (false when the store cannot tell).
  bool any_ended(const std::vector<int>& members) const;

 private:
  struct Shared;  // what the thread uses: it may outlive this object (a store write stuck at exit)
  std::shared_ptr<Shared> s_;
  std::thread thread_;
};

}  // namespace shardtorch::detail

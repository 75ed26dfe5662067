// Progress and logs (shardtorch/log.h): levels, the environment variable,
// warnings through TORCH_WARN, the default progress printing and the
// progress callbacks of each long operation. The tests join the suites of
// the operations they cover (one process per suite).
#include <c10/util/Logging.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "captured_warnings.h"
#include "../src/base/log.h"
#include "dcp_helpers.h"
#include "models.h"
#include "progress_helpers.h"
#include "shardtorch/log.h"

using namespace testmodels;
using shardtorch::LogLevel;
using shardtorch::ProgressUpdate;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// The lines of `text` holding `needle`.
int lines_with(const std::string& text, const std::string& needle) {
  int n = 0;
  size_t at = 0;
  while ((at = text.find(needle, at)) != std::string::npos) {
    ++n;
    at += needle.size();
  }
  return n;
}

// Restores the level, the environment variable and the progress timing.
struct LogSettingsGuard {
  LogSettingsGuard() {
    if (const char* e = std::getenv("SHARDTORCH_LOG_LEVEL")) env_ = e;
  }
  ~LogSettingsGuard() {
    if (env_)
      ::setenv("SHARDTORCH_LOG_LEVEL", env_->c_str(), 1);
    else
      ::unsetenv("SHARDTORCH_LOG_LEVEL");
    shardtorch::detail::reset_log_level();
    shardtorch::detail::set_progress_timing(2.0, 5.0);
    shardtorch::detail::set_log_rank(-1);
    shardtorch::set_progress_callback(nullptr);
  }
  std::optional<std::string> env_;
};

// A small training model sharded and checkpointed every way on 2 ranks: the
// operations whose printing the tests below capture.
void shard_save_load(World& w, const std::string& dir) {
  torch::manual_seed(3);
  gpt::GPT m(gpt::Config{});
  shardtorch::shard(m, w);
  shardtorch::save_sharded_checkpoint(*m, nullptr, dir + "/sharded", 1);
  shardtorch::load_sharded_checkpoint(*m, nullptr, dir + "/sharded");
  shardtorch::save_full_state_dict(*m, dir + "/full.safetensors");
  shardtorch::load_full_state_dict(*m, dir + "/full.safetensors");
  shardtorch::save_hf_checkpoint(*m, dir + "/hf");
  shardtorch::load_hf_checkpoint(*m, dir + "/hf");
}

}  // namespace

TEST(Errors, LogLevelFromTheEnvironmentUnlessSetInTheProgram) {
  LogSettingsGuard restore;
  EXPECT_EQ(shardtorch::parse_log_level("quiet"), LogLevel::Quiet);
  EXPECT_EQ(shardtorch::parse_log_level("ERROR"), LogLevel::Error);
  EXPECT_EQ(shardtorch::parse_log_level("Warning"), LogLevel::Warning);
  EXPECT_EQ(shardtorch::parse_log_level("warn"), LogLevel::Warning);
  EXPECT_EQ(shardtorch::parse_log_level("info"), LogLevel::Info);
  EXPECT_EQ(shardtorch::parse_log_level("debug"), LogLevel::Debug);
  try {  // the library's error type, as every refusal of the library's (it was c10::Error)
    shardtorch::parse_log_level("verbose");
    ADD_FAILURE() << "'verbose' was accepted";
  } catch (const shardtorch::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown log level 'verbose'; expected one of quiet"), std::string::npos)
        << e.what();
  }
  for (auto l : {LogLevel::Quiet, LogLevel::Error, LogLevel::Warning, LogLevel::Info, LogLevel::Debug})
    EXPECT_EQ(shardtorch::parse_log_level(shardtorch::log_level_name(l)), l);

  ::unsetenv("SHARDTORCH_LOG_LEVEL");
  shardtorch::detail::reset_log_level();
  EXPECT_EQ(shardtorch::log_level(), LogLevel::Info) << "the default";
  ::setenv("SHARDTORCH_LOG_LEVEL", "Debug", 1);
  shardtorch::detail::reset_log_level();
  EXPECT_EQ(shardtorch::log_level(), LogLevel::Debug);
  ::setenv("SHARDTORCH_LOG_LEVEL", "quiet", 1);  // read once: a later change is not seen
  EXPECT_EQ(shardtorch::log_level(), LogLevel::Debug);
  shardtorch::detail::reset_log_level();
  EXPECT_EQ(shardtorch::log_level(), LogLevel::Quiet);
  shardtorch::set_log_level(LogLevel::Warning);  // the program's setting wins
  EXPECT_EQ(shardtorch::log_level(), LogLevel::Warning);
  EXPECT_FALSE(shardtorch::detail::log_enabled(LogLevel::Info));
  EXPECT_TRUE(shardtorch::detail::log_enabled(LogLevel::Error));

  // Before the World (no rank set), the launcher's RANK names the rank.
  shardtorch::detail::set_log_rank(-1);
  const char* rank_before = std::getenv("RANK");
  const std::optional<std::string> saved_rank = rank_before ? std::optional<std::string>(rank_before) : std::nullopt;
  ::setenv("RANK", "5", 1);
  ::setenv("SHARDTORCH_LOG_LEVEL", "loud", 1);
  shardtorch::detail::reset_log_level();
  ::testing::internal::CaptureStderr();
  const LogLevel got = shardtorch::log_level();
  const std::string said = ::testing::internal::GetCapturedStderr();
  saved_rank ? (void)::setenv("RANK", saved_rank->c_str(), 1) : (void)::unsetenv("RANK");
  EXPECT_EQ(got, LogLevel::Info);
  EXPECT_NE(said.find("[rank 5] shardtorch: SHARDTORCH_LOG_LEVEL='loud' is not one of quiet (or off, none), error, "
                      "warning (or warn), info, debug"),
            std::string::npos)
      << said;
}

TEST(Errors, WarningsGoThroughTorchWarnWithTheRankAndQuietSilencesEverything) {
  LogSettingsGuard restore;
  shardtorch::detail::set_log_rank(3);
  shardtorch::set_log_level(LogLevel::Info);
  CapturedWarnings warnings;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    ::testing::internal::CaptureStderr();
    SHARDTORCH_WARN("shardtorch: a test warning ", 42);
    shardtorch::detail::log(LogLevel::Info, "shardtorch: an info line");
    SHARDTORCH_DEBUG("a debug line");  // below the level: not even built
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(printed, "[rank 3] shardtorch: an info line\n");
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_EQ(warnings.messages[0], "[rank 3] shardtorch: a test warning 42");
    // A message naming this rank names it once, in the prefix; another rank's stays.
    SHARDTORCH_WARN("shardtorch: rank 3: named");
    SHARDTORCH_WARN("shardtorch: rank 4: another's");
    ASSERT_EQ(warnings.messages.size(), 3u);
    EXPECT_EQ(warnings.messages[1], "[rank 3] shardtorch: named");
    EXPECT_EQ(warnings.messages[2], "[rank 3] shardtorch: rank 4: another's");

    shardtorch::set_log_level(LogLevel::Quiet);
    ::testing::internal::CaptureStderr();
    SHARDTORCH_WARN("shardtorch: silenced");
    shardtorch::detail::log(LogLevel::Error, "shardtorch: silenced too");
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(warnings.messages.size(), 3u);
  }
}

// c10d's own log lines obey LibTorch's TORCH_CPP_LOG_LEVEL, which a World
// reads as Python's torch does (a C++ program otherwise never reads it).
TEST(Errors, AWorldReadsTorchsCppLogLevelForC10dsOwnLines) {
  const char* before = std::getenv("TORCH_CPP_LOG_LEVEL");
  const std::optional<std::string> saved = before ? std::optional<std::string>(before) : std::nullopt;
  const int level = FLAGS_caffe2_log_level;
  FLAGS_caffe2_log_level = 1;  // WARNING, whatever this process read before
  ::setenv("TORCH_CPP_LOG_LEVEL", "ERROR", 1);
  auto r = run_ranks(1, [](World&) {
    require(FLAGS_caffe2_log_level == 2, "c10's level is " + std::to_string(FLAGS_caffe2_log_level) + ", not ERROR");
  });
  saved ? (void)::setenv("TORCH_CPP_LOG_LEVEL", saved->c_str(), 1) : (void)::unsetenv("TORCH_CPP_LOG_LEVEL");
  FLAGS_caffe2_log_level = level;
  ASSERT_TRUE(r.ok) << r.summary();
}

// Quiet: nothing printed on success. Info with no quiet period: the
// progress lines that quiet silences (a line at the start of each operation
// and one at its end off a terminal), so the capture works.
TEST(Errors, QuietPrintsNothingOnSuccessAndInfoPrintsProgressOnRankZeroOnly) {
  LogSettingsGuard restore;
  const TempDir dir("shardtorch-log");
  for (LogLevel level : {LogLevel::Quiet, LogLevel::Info}) {
    shardtorch::set_log_level(level);
    shardtorch::detail::set_progress_timing(0, 1e9);
    ::testing::internal::CaptureStderr();
    auto r = run_ranks(2, [&](World& w) { shard_save_load(w, dir.string()); });
    const std::string printed = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(r.ok) << r.summary();
    if (level == LogLevel::Quiet) {
      EXPECT_EQ(printed, "");
      continue;
    }
    EXPECT_EQ(lines_with(printed, "[rank 1]"), 0) << printed;
    for (const char* op : {"shard", "save_sharded_checkpoint", "load_sharded_checkpoint", "save_full_state_dict",
                           "load_full_state_dict", "save_hf_checkpoint", "load_hf_checkpoint"}) {
      EXPECT_EQ(lines_with(printed, std::string("[rank 0] shardtorch: ") + op + ": "), 2) << op << ":\n" << printed;
    }
    EXPECT_NE(printed.find(" units, "), std::string::npos) << printed;
    EXPECT_NE(printed.find("B/s in "), std::string::npos) << printed;
    // A sharded save's bytes are its file's twice (written, then read back for the checksum): the line says so.
    EXPECT_NE(printed.find("[rank 0] shardtorch: save_sharded_checkpoint: 1/1 files, "), std::string::npos) << printed;
    EXPECT_NE(printed.find(" written and read back, "), std::string::npos) << printed;
  }
}

// Debug names every checkpoint file as it is opened for writing: the data
// files and each kind's index (the sharded index, Hugging Face's index,
// DCP's .metadata), which rank 0 writes.
TEST(Errors, DebugNamesEveryCheckpointFileOpenedForWriting) {
  LogSettingsGuard restore;
  const TempDir dir("shardtorch-log");
  shardtorch::set_log_level(LogLevel::Debug);
  ::testing::internal::CaptureStderr();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(3);
    gpt::GPT m(gpt::Config{});
    shardtorch::shard(m, w);
    shardtorch::save_sharded_checkpoint(*m, nullptr, dir.string() + "/sharded", 1);
    shardtorch::save_hf_checkpoint(*m, dir.string() + "/hf");
    shardtorch::save_dcp_checkpoint(*m, dir.string() + "/dcp");
  });
  const std::string printed = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r.ok) << r.summary();
  auto opened = [&](const std::string& file) {
    for (size_t at = printed.find("[rank 0] shardtorch: opened '"); at != std::string::npos;
         at = printed.find("[rank 0] shardtorch: opened '", at + 1)) {
      const std::string line = printed.substr(at, printed.find('\n', at) - at);
      const size_t named = line.find(file);
      if (named != std::string::npos && line.find("' for writing", named) != std::string::npos) return true;
    }
    return false;
  };
  for (const char* file : {"/index.json", "model.safetensors.index.json", "/.metadata", ".safetensors.tmp-", ".distcp"})
    EXPECT_TRUE(opened(file)) << file << " not named as opened for writing:\n" << printed.substr(0, 20000);
}

// The defaults (level Info, 2 s quiet, a line every 5 s off a terminal): a
// fast operation prints nothing.
TEST(Errors, TheDefaultPrintsAtMostAFewLinesForFastOperations) {
  LogSettingsGuard restore;
  ::unsetenv("SHARDTORCH_LOG_LEVEL");
  shardtorch::detail::reset_log_level();
  const TempDir dir("shardtorch-log");
  ::testing::internal::CaptureStderr();
  auto r = run_ranks(2, [&](World& w) { shard_save_load(w, dir.string()); });
  const std::string printed = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r.ok) << r.summary();
  EXPECT_LE(lines_with(printed, "\n"), 4) << printed;
}

// shard() materialises a deferred model unit by unit, under FullShard and
// NoShard alike, and reports each unit and the bytes to its callback.
TEST(DeferredShard, ShardReportsUnitsAndBytesToItsCallback) {
  for (auto strategy : {shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard}) {
    auto r = run_ranks(2, [strategy](World& w) {
      std::vector<ProgressUpdate> got;
      auto lazy = shardtorch::deferred([] { return gpt::GPT(gpt::Config{}); });
      int64_t bytes = 0;
      for (const auto& p : unique_tensors(*lazy)) bytes += p.numel() * 4;
      auto sm = shardtorch::shard(lazy, w, shardtorch::ShardOptions().strategy(strategy).progress(collect_into(got)));
      const std::string at = "rank " + std::to_string(w.rank());
      require_progress(got, "shard", at);
      const auto& last = got.back();
      require(last.unit == "units" && static_cast<int64_t>(got.size()) == last.total + 2,
              at + ": not an update per unit, and the start and the end (" + std::to_string(got.size()) + " for " +
                  std::to_string(last.total) + ")");
      if (strategy == shardtorch::Strategy::FullShard)  // the flat parameters' padding counts too
        require(last.total == static_cast<int64_t>(sm.units().size()) && last.bytes_total >= bytes,
                at + ": units " + std::to_string(last.total) + ", bytes " + std::to_string(last.bytes_total) +
                    ", the parameters' " + std::to_string(bytes));
      else
        require(last.bytes_total == bytes,
                at + ": bytes " + std::to_string(last.bytes_total) + ", the parameters' " + std::to_string(bytes));
      for (const auto& p : lazy->parameters()) require(!shardtorch::is_deferred(p), at + ": a parameter is deferred");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
  }
}

TEST(Summon, FullParametersReportsUnitsGatheredToTheLibraryWideCallback) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(3);
    gpt::GPT m(gpt::Config{});
    auto sm = shardtorch::shard(m, w);
    std::vector<ProgressUpdate> got;
    shardtorch::set_progress_callback(collect_into(got));
    auto full = shardtorch::full_parameters(*m, /*rank0_only=*/true);
    shardtorch::set_progress_callback(nullptr);
    require_progress(got, "full_parameters", "rank " + std::to_string(w.rank()));
    require(got.back().total == static_cast<int64_t>(sm.units().size()) &&
                static_cast<int64_t>(got.size()) == got.back().total + 2,
            "not an update per unit");
    int64_t bytes = 0;           // rank 0's map: every parameter, whole (the flat parameters' padding aside)
    std::set<const void*> seen;  // a tied parameter is one tensor under two names
    for (const auto& [name, t] : full)
      if (seen.insert(t.data_ptr()).second) bytes += t.numel() * 4;
    if (w.rank() == 0) require(got.back().bytes_total >= bytes && bytes > 0, "fewer bytes than the parameters'");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  // NoShard gathers nothing: each rank reports the tensors it copies.
  auto n = run_ranks(2, [](World& w) {
    torch::manual_seed(3);
    gpt::GPT m(gpt::Config{});
    shardtorch::shard(m, w, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    std::vector<ProgressUpdate> got;
    shardtorch::set_progress_callback(collect_into(got));
    auto full = shardtorch::full_parameters(*m);
    shardtorch::set_progress_callback(nullptr);
    require_progress(got, "full_parameters", "NoShard, rank " + std::to_string(w.rank()));
    require(got.back().unit == "tensors" && got.back().total == static_cast<int64_t>(m->named_parameters().size()),
            "not a count of the tensors copied: " + std::to_string(got.back().total));
  });
  ASSERT_TRUE(n.ok) << n.summary();
}

// A callback that throws, a std::exception or anything else, is dropped for
// that operation with a warning; the operation succeeds, and the next one
// calls it again.
TEST(Summon, ACallbackThatThrowsIsDroppedForThatOperationOnly) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(3);
    gpt::GPT m(gpt::Config{});
    auto sm = shardtorch::shard(m, w);
    int calls = 0;
    bool as_int = false;
    shardtorch::set_progress_callback([&](const ProgressUpdate&) {
      ++calls;
      if (as_int) throw 42;
      throw std::runtime_error("the progress bar broke");
    });
    CapturedWarnings warnings;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      shardtorch::full_parameters(*m);
      require(calls == 1, "called " + std::to_string(calls) + " times in the first operation");
      as_int = true;
      shardtorch::full_parameters(*m);
      require(calls == 2, "called " + std::to_string(calls) + " times in all");
    }
    shardtorch::set_progress_callback(nullptr);
    require(warnings.any_with("progress callback of full_parameters threw (no more progress reported): the progress "
                              "bar broke"),
            "no warning of the std::exception");
    require(warnings.any_with("threw something not derived from std::exception"), "no warning of the int");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(HfSave, SaveAndLoadReportProgressToTheirCallbacks) {
  const TempDir dir("shardtorch-log");
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(3);
    gpt::GPT m(gpt::Config{});
    shardtorch::shard(m, w);
    std::vector<ProgressUpdate> saved, loaded;
    auto report = shardtorch::save_hf_checkpoint(
        *m, dir.string(), shardtorch::HfSaveOptions().max_file_bytes(8192).progress(collect_into(saved)));
    const std::string at = "rank " + std::to_string(w.rank());
    require_progress(saved, "save_hf_checkpoint", at);
    require(saved.back().total == report.tensors && saved.back().bytes_total == report.total_bytes,
            at + ": the save's totals are not its report's");
    // Rank 0 writes: an update per tensor.
    if (w.rank() == 0) {
      std::set<int64_t> counts;
      for (const auto& u : saved) counts.insert(u.done);
      require(static_cast<int64_t>(counts.size()) == report.tensors + 1, at + ": not an update per tensor");
    }
    shardtorch::load_hf_checkpoint(*m, dir.string(), shardtorch::HfLoadOptions().progress(collect_into(loaded)));
    require_progress(loaded, "load_hf_checkpoint", at);
    require(loaded.back().bytes_done > 0, at + ": the load read no bytes");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The saves without options report to the library-wide callback; the
// loads' options win over it.
TEST(ShardedCheckpoint, SavesAndLoadsReportProgressToTheLibraryWideCallbackOrTheirOwn) {
  const TempDir dir("shardtorch-log");
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(3);
    gpt::GPT m(gpt::Config{});
    shardtorch::shard(m, w);
    std::vector<ProgressUpdate> global, sharded_load, full_load;
    shardtorch::set_progress_callback(collect_into(global));
    const std::string at = "rank " + std::to_string(w.rank());
    shardtorch::save_sharded_checkpoint(*m, nullptr, dir.string() + "/sharded", 4);
    require_progress(global, "save_sharded_checkpoint", at);
    require(global.back().bytes_done > 0, at + ": the sharded save wrote nothing");
    global.clear();
    shardtorch::save_full_state_dict(*m, dir.string() + "/full.safetensors");
    require_progress(global, "save_full_state_dict", at);
    global.clear();
    shardtorch::load_sharded_checkpoint(*m, nullptr, dir.string() + "/sharded", nullptr,
                                        shardtorch::LoadOptions().progress(collect_into(sharded_load)));
    shardtorch::load_full_state_dict(*m, dir.string() + "/full.safetensors",
                                     shardtorch::LoadOptions().progress(collect_into(full_load)));
    shardtorch::set_progress_callback(nullptr);
    require(global.empty(), at + ": the loads' own callbacks were passed over");
    require_progress(sharded_load, "load_sharded_checkpoint", at);
    require_progress(full_load, "load_full_state_dict", at);
    require(sharded_load.back().bytes_done > 0 && full_load.back().bytes_done > 0, at + ": a load read no bytes");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(DcpSave, SaveAndLoadReportProgressToTheirCallbacks) {
  const TempDir dir("shardtorch-log");
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(5);
    DcpMlp m;
    shardtorch::shard(m, w);
    std::vector<ProgressUpdate> saved, loaded;
    const std::string at = "rank " + std::to_string(w.rank());
    shardtorch::save_dcp_checkpoint(*m, nullptr, dir.string() + "/ck",
                                    shardtorch::DcpSaveOptions().progress(collect_into(saved)));
    require_progress(saved, "save_dcp_checkpoint", at);
    require(saved.back().bytes_done > 0, at + ": the save wrote nothing");
    shardtorch::load_dcp_checkpoint(*m, nullptr, dir.string() + "/ck",
                                    shardtorch::DcpLoadOptions().progress(collect_into(loaded)));
    require_progress(loaded, "load_dcp_checkpoint", at);
    require(loaded.back().bytes_done > 0, at + ": the load read nothing");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

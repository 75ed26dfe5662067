// Pure arithmetic and parsing: layouts, launcher environments, byte formats.
#include <gtest/gtest.h>

#include <map>

#include "shardtorch/error.h"
#include "../src/runtime/flat_param.h"
#include "shardtorch/world.h"

using shardtorch::FlatParamLayout;

TEST(FlatParamLayout, OffsetsAndPaddingWhenWorldDividesNothing) {
  FlatParamLayout l({{3, 4}, {5}, {2, 2, 2}}, 3);  // 12 + 5 + 8 = 25 -> padded 27, shard 9
  EXPECT_EQ(l.size(), 3u);
  EXPECT_EQ(l.total_numel(), 25);
  EXPECT_EQ(l.padded_numel(), 27);
  EXPECT_EQ(l.padding(), 2);
  EXPECT_EQ(l.shard_numel(), 9);
  EXPECT_EQ(l.offset(0), 0);
  EXPECT_EQ(l.offset(1), 12);
  EXPECT_EQ(l.offset(2), 17);
  EXPECT_EQ(l.shard_range(2).first, 18);
  EXPECT_EQ(l.shard_range(2).second, 27);
}

TEST(FlatParamLayout, PiecesCoverEveryElementExactlyOnce) {
  for (int world : {1, 2, 3, 4, 7}) {
    FlatParamLayout l({{3, 4}, {5}, {1}, {2, 2, 2}}, world);
    std::vector<int> owner_count(l.padded_numel(), 0);
    for (size_t i = 0; i < l.size(); ++i) {
      int64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        auto p = l.piece(i, r);
        if (!p) continue;
        EXPECT_GE(p->shard_offset, 0);
        EXPECT_LE(p->shard_offset + p->length, l.shard_numel());
        EXPECT_EQ(l.offset(i) + p->param_offset, r * l.shard_numel() + p->shard_offset);
        for (int64_t k = 0; k < p->length; ++k) owner_count[l.offset(i) + p->param_offset + k]++;
        covered += p->length;
      }
      EXPECT_EQ(covered, l.numel(i)) << "param " << i << " world " << world;
    }
    for (int64_t k = 0; k < l.total_numel(); ++k) EXPECT_EQ(owner_count[k], 1) << k;
    for (int64_t k = l.total_numel(); k < l.padded_numel(); ++k) EXPECT_EQ(owner_count[k], 0) << k;
  }
}

TEST(FlatParamLayout, UnitSmallerThanWorld) {
  FlatParamLayout l({{2}}, 4);  // 2 elements over 4 ranks: shard 1, ranks 2 and 3 own padding only
  EXPECT_EQ(l.shard_numel(), 1);
  EXPECT_EQ(l.padded_numel(), 4);
  ASSERT_TRUE(l.piece(0, 0));
  ASSERT_TRUE(l.piece(0, 1));
  EXPECT_FALSE(l.piece(0, 2));
  EXPECT_FALSE(l.piece(0, 3));
  EXPECT_EQ(l.piece(0, 1)->param_offset, 1);
}

TEST(FlatParamLayout, EmptyAndScalarParameters) {
  FlatParamLayout l({{}, {0, 5}, {3}}, 2);  // scalar (1) + empty (0) + 3 = 4
  EXPECT_EQ(l.total_numel(), 4);
  EXPECT_EQ(l.numel(0), 1);
  EXPECT_EQ(l.numel(1), 0);
  EXPECT_FALSE(l.piece(1, 0));
  EXPECT_FALSE(l.piece(1, 1));
  EXPECT_THROW(FlatParamLayout({{2}}, 0), shardtorch::Error);
}

namespace {
shardtorch::EnvLookup env(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}
std::string error_of(std::map<std::string, std::string> m) {
  try {
    shardtorch::parse_launch_env(env(std::move(m)));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(LaunchEnv, Torchrun) {
  auto e = shardtorch::parse_launch_env(env({{"RANK", "3"},
                                             {"WORLD_SIZE", "4"},
                                             {"LOCAL_RANK", "1"},
                                             {"MASTER_ADDR", "10.0.0.1"},
                                             {"MASTER_PORT", "29500"},
                                             {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_TRUE(e.use_agent_store);
}

TEST(LaunchEnv, OpenMpiAndSlurm) {
  auto m = shardtorch::parse_launch_env(env({{"OMPI_COMM_WORLD_RANK", "1"},
                                             {"OMPI_COMM_WORLD_SIZE", "2"},
                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                             {"MASTER_ADDR", "h"},
                                             {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(m.launcher, "openmpi");
  EXPECT_EQ(m.rank, 1);
  EXPECT_EQ(m.local_rank, 1);
  auto s = shardtorch::parse_launch_env(env({{"SLURM_PROCID", "5"},
                                             {"SLURM_NTASKS", "8"},
                                             {"SLURM_LOCALID", "1"},
                                             {"MASTER_ADDR", "h"},
                                             {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(s.launcher, "slurm");
  auto p = shardtorch::parse_launch_env(env(
      {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(p.launcher, "mpich");  // MPICH's and Intel MPI's mpirun
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.world_size, 4);
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_FALSE(s.use_agent_store);
}

TEST(LaunchEnv, TimeoutFromTheEnvironment) {
  EXPECT_FALSE(shardtorch::parse_launch_env(env({})).timeout);
  auto e = shardtorch::parse_launch_env(env({{"SHARDTORCH_TIMEOUT_S", "7"}}));
  ASSERT_TRUE(e.timeout);
  EXPECT_EQ(e.timeout->count(), 7000);
  EXPECT_NE(error_of({{"SHARDTORCH_TIMEOUT_S", "0"}}).find("SHARDTORCH_TIMEOUT_S='0' must be at least 1"),
            std::string::npos);
  EXPECT_NE(error_of({{"SHARDTORCH_TIMEOUT_S", "2m"}}).find("SHARDTORCH_TIMEOUT_S='2m' is not an integer"),
            std::string::npos);
  EXPECT_FALSE(e.file_timeout);
  auto f = shardtorch::parse_launch_env(env({{"SHARDTORCH_FILE_TIMEOUT_S", "3600"}}));
  ASSERT_TRUE(f.file_timeout);
  EXPECT_EQ(f.file_timeout->count(), 3600000);
  EXPECT_FALSE(f.timeout);
  EXPECT_NE(error_of({{"SHARDTORCH_FILE_TIMEOUT_S", "0"}}).find("SHARDTORCH_FILE_TIMEOUT_S='0' must be at least 1"),
            std::string::npos);
}

TEST(LaunchEnv, NoLauncherIsOneRank) {
  auto e = shardtorch::parse_launch_env(env({}));
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.rank, 0);
}

TEST(LaunchEnv, BadValuesNameTheVariableAndValue) {
  auto base = std::map<std::string, std::string>{{"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    auto m = base;
    for (auto& [k, v] : extra) m[k] = v;
    return error_of(m);
  };
  EXPECT_NE(with({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}).find("RANK='abc' is not an integer"), std::string::npos);
  EXPECT_NE(with({{"RANK", "1x"}, {"WORLD_SIZE", "2"}}).find("RANK='1x'"), std::string::npos);
  EXPECT_NE(with({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK='2' is not below WORLD_SIZE=2"), std::string::npos);
  EXPECT_NE(with({{"RANK", "0"}, {"WORLD_SIZE", "-1"}}).find("WORLD_SIZE='-1'"), std::string::npos);
  EXPECT_NE(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT='70000' is outside 1..65535"),
            std::string::npos);
  EXPECT_NE(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}).find("MASTER_PORT='0'"),
            std::string::npos);
  EXPECT_NE(with({{"RANK", "0"}}).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "two"}}).find("SLURM_NTASKS='two'"), std::string::npos);
}

TEST(Memory, FormatBytes) {
  EXPECT_EQ(shardtorch::format_bytes(512), "512 B");
  EXPECT_EQ(shardtorch::format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(shardtorch::format_bytes(3 * 1024 * 1024), "3.00 MiB");
}

TEST(Memory, TrackerPeaks) {
  shardtorch::MemoryTracker t;
  t.add(shardtorch::Mem::Buckets, 100);
  t.sub(shardtorch::Mem::Buckets, 60);
  EXPECT_EQ(t.snapshot().cur(shardtorch::Mem::Buckets), 40);
  EXPECT_EQ(t.snapshot().max(shardtorch::Mem::Buckets), 100);
  t.reset_peaks();
  EXPECT_EQ(t.snapshot().max(shardtorch::Mem::Buckets), 40);
  t.unit_gathered();
  t.unit_gathered();
  t.unit_released();
  EXPECT_EQ(t.snapshot().gathered_units, 1);
  EXPECT_EQ(t.snapshot().peak_gathered_units, 2);
  // report(): a line per category, each after the rank when one is set.
  auto s = t.snapshot();
  EXPECT_EQ(s.report().rfind("sharded_params ", 0), 0u) << s.report();
  s.rank = 3;
  const std::string r = s.report();
  size_t lines = 0;
  for (size_t at = 0; at < r.size(); at = r.find('\n', at) + 1, ++lines)
    EXPECT_EQ(r.compare(at, 9, "[rank 3] "), 0) << r;
  EXPECT_EQ(lines, static_cast<size_t>(shardtorch::Mem::kCount) + 1) << r;
}

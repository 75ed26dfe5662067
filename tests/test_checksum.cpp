// Checksums of sharded checkpoint files: XXH3 is written, FNV-1a (written by
// earlier versions) is still verified, each with the algorithm its index names.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "../src/checkpoint/checksum.h"
#include "models.h"
#include "shardtorch/checkpoint.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;
namespace checksum = shardtorch::checkpoint::checksum;

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST(Checksum, KnownValuesAndAnySplitGiveTheSame) {
  EXPECT_EQ(checksum::of("", 0, checksum::kXxh3), "xxh3_64:2d06800538d394c2");
  // FNV-1a as earlier versions computed it, whose checksums old indexes
  // hold: its basis is 1469598103934665603 (the published one, one digit
  // short), so these are not the published FNV-1a values.
  EXPECT_EQ(checksum::of("", 0, checksum::kFnv1a), "fnv1a64:14650fb0739d0383");
  EXPECT_EQ(checksum::of("a", 1, checksum::kFnv1a), "fnv1a64:44bd8ad473cd9906");
  std::string data(1 << 20, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  for (auto alg : {checksum::kXxh3, checksum::kFnv1a}) {
    checksum::Hasher h(alg);
    for (size_t at = 0, piece = 1; at < data.size(); at += piece, piece = piece * 3 + 7)
      h.update(data.data() + at, std::min(piece, data.size() - at));
    EXPECT_EQ(h.text(), checksum::of(data.data(), data.size(), alg)) << alg;
  }
  EXPECT_EQ(checksum::algorithm_of("xxh3_64:0"), checksum::kXxh3);
  EXPECT_EQ(checksum::algorithm_of("fnv1a64:44bd8ad473cd9906"), checksum::kFnv1a);
  for (const char* bad : {"md5:0", "xxh3_64:", "xxh3_64:XYZ", "fnv1a64:00000000000000000", "xxh3_64-1"})
    EXPECT_TRUE(checksum::algorithm_of(bad).empty()) << bad;
  EXPECT_THROW(checksum::Hasher("crc32"), std::invalid_argument);
}

// A checkpoint records XXH3 checksums; the same checkpoint with FNV-1a
// checksums in its index (as earlier versions wrote it) loads, and a file
// that does not match its FNV-1a checksum is refused.
TEST(ShardedCheckpoint, ChecksumsAreXxh3AndCheckpointsWithFnvChecksumsStillLoad) {
  const TempDir dir;
  const std::string ckpt = (dir / "ckpt").string();
  auto save = run_ranks(2, [&](World& w) {
    auto model = MLP();
    shardtorch::shard(model, w);
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
    model(torch::ones({2, 7})).sum().backward();
    opt->step();
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt, 1);
    opt->step();  // other values, the same step number and sizes
    shardtorch::save_sharded_checkpoint(*model, opt.get(), ckpt + "-twin", 1);
  });
  ASSERT_TRUE(save.ok) << save.summary();
  const std::string index = read_all(ckpt + "/index.json");
  const std::regex entry("\\{\"name\":\"(rank-[0-9]+\\.safetensors)\",\"size\":[0-9]+,\"checksum\":\"([^\"]+)\"\\}");
  std::string fnv_index = index;
  int seen = 0;
  for (auto it = std::sregex_iterator(index.begin(), index.end(), entry); it != std::sregex_iterator(); ++it, ++seen) {
    const std::string file = (*it)[1], recorded = (*it)[2];
    const std::string bytes = read_all(ckpt + "/" + file);
    EXPECT_EQ(recorded, checksum::of(bytes.data(), bytes.size(), checksum::kXxh3)) << file;
    const std::string fnv = checksum::of(bytes.data(), bytes.size(), checksum::kFnv1a);
    fnv_index.replace(fnv_index.find(recorded), recorded.size(), fnv);
  }
  ASSERT_EQ(seen, 2) << index;
  auto load_error = [&](const std::string& path) {
    auto r = run_ranks(1, [&](World& w) {
      auto model = MLP();
      shardtorch::shard(model, w);
      auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1).momentum(0.9));
      shardtorch::load_sharded_checkpoint(*model, opt.get(), path);
    });
    return r.ok ? std::string() : r.ranks[0].message;
  };
  const std::string legacy = (dir / "legacy").string();
  files::copy_tree(ckpt, legacy);
  std::ofstream(legacy + "/index.json", std::ios::trunc) << fnv_index;
  EXPECT_EQ(load_error(legacy), "");
  EXPECT_EQ(shardtorch::read_sharded_checkpoint(legacy).size(), shardtorch::read_sharded_checkpoint(ckpt).size());
  // The twin's rank-1 file has the same size and step: only the checksum differs.
  files::copy_file(ckpt + "-twin/rank-1.safetensors", legacy + "/rank-1.safetensors");
  const std::string e = load_error(legacy);
  EXPECT_NE(e.find("'rank-1.safetensors' does not match its checksum in the index"), std::string::npos) << e;
}
